"""Weight sync: put a trainer's new weights into the running engine between two gateway control calls.

    pause(drain) on every gateway  ->  engine: new weights  ->  resume(policy_version + 1, engine_model)

Like `polar_mitm.client`, this module needs only httpx (no gateway dependencies), so a trainer imports it.

- vLLM (measured on 0.32.0 CPU, see docs/training.md): runtime LoRA. Serve with `--enable-lora
  --max-lora-rank R --max-loras N` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`polar-mitm engine start
  --lora-rank R` does both). `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` loads a PEFT adapter folder
  and serves it under its name; the gateway's resume names it as the engine model, so every call after resume
  uses it. Each version gets its own name: vLLM refuses a loaded name unless `load_inplace`, and an in-place
  reload would change the weights under calls the gateway still attributes to the old version.
- SGLang (not runnable on this CPU machine; endpoints and bodies as in SGLang's srt/entrypoints/http_server.py and
  srt/managers/io_struct.py): `POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`,
  `POST /update_weights_from_disk {"model_path", "weight_version"?, ...}` answering
  `{"success", "message", "num_paused_requests"}` (HTTP 400 when it fails), `POST /continue_generation {}`. They are
  admin endpoints: with `--admin-api-key` (or only `--api-key`) set, SGLang wants that key as a bearer token. The
  weights reload in place under the same served model name, so resume changes the policy version only. The
  gateway's drain already holds every call of its own; the engine-side pause (mode "abort" by default) is a second
  guard: a request that bypassed the gateway is ended rather than finished under weights it did not start with.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from polar_mitm.client import RolloutClient
from polar_mitm.errors import WeightSyncError


class Pausable(Protocol):
    """What a sync holds still while the weights change: one gateway (`polar_mitm.client.GatewayControl`), or
    every gateway a rollout server owns (`ServerGateways`)."""

    def pause(self, mode: Any = "drain", timeout_seconds: float = ...) -> Any: ...

    def resume(self, policy_version: int | None = None, engine_model: str | None = None) -> Any: ...


@dataclass
class ServerGateways:
    """Every gateway node of a rollout server (`rollout serve`, `rollout run`'s, or a Ray head's), paused and
    resumed as one through the server's /control/* (a node that refuses makes the call raise)."""

    server: RolloutClient

    def pause(self, mode: Any = "drain", timeout_seconds: float = 300.0) -> Any:
        return self.server.control("pause", mode=mode, timeout_seconds=timeout_seconds)

    def resume(self, policy_version: int | None = None, engine_model: str | None = None) -> Any:
        body = {k: v for k, v in {"policy_version": policy_version, "engine_model": engine_model}.items() if v is not None}
        return self.server.control("resume", **body)


def _post(http: httpx.Client, url: str, body: dict | None = None) -> httpx.Response:
    """POST JSON; any transport failure or HTTP status >= 400 raises WeightSyncError with the engine's words."""
    try:
        response = http.post(url, json=body)
    except httpx.HTTPError as error:
        raise WeightSyncError(url, None, repr(error)) from error
    if response.status_code >= 400:
        raise WeightSyncError(url, response.status_code, _engine_message(response))
    return response


def _engine_message(response: httpx.Response) -> str:
    """The error text of a vLLM/SGLang JSON error body (`message`, `error.message`, `detail`), else the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:1000]
    if isinstance(body, dict):
        nested = body.get("error")
        for value in (body.get("message"), nested.get("message") if isinstance(nested, dict) else nested, body.get("detail")):
            if isinstance(value, str) and value:
                return value
    return response.text[:1000]


class VLLMLoraEngine:
    """A vLLM engine's runtime LoRA endpoints. `base_url` is its OpenAI base (".../v1")."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(timeout=timeout, trust_env=False)

    def served(self) -> list[str]:
        """Model names the engine serves now: its base model and every loaded adapter."""
        response = self.http.get(self.base_url + "/models")
        response.raise_for_status()
        return [model["id"] for model in response.json()["data"]]

    def load(self, name: str, adapter_dir: str | Path) -> None:
        _post(self.http, self.base_url + "/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(adapter_dir).resolve())})

    def unload(self, name: str) -> None:
        _post(self.http, self.base_url + "/unload_lora_adapter", {"lora_name": name})

    def close(self) -> None:
        self.http.close()


class SGLangDiskEngine:
    """An SGLang engine's weight reload from disk, bracketed by its own generation pause. `url` is its root or
    OpenAI base; `api_key`: its --admin-api-key (or --api-key when only that is set), sent as a bearer token."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.root_url = url.rstrip("/").removesuffix("/v1")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout, trust_env=False, headers=headers)

    def pause(self, mode: str = "abort") -> None:
        _post(self.http, self.root_url + "/pause_generation", {"mode": mode})

    def load(self, model_path: str | Path, weight_version: str | None = None) -> None:
        """Reload every weight from `model_path` (a checkpoint folder the engine can read); `weight_version` is
        what SGLang then reports as its weight version. A local relative path is made absolute (the engine runs
        elsewhere); anything else (a hub id) goes as given. A reply with success false raises too."""
        local = Path(model_path)
        body: dict = {"model_path": str(local.resolve() if local.exists() else model_path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        url = self.root_url + "/update_weights_from_disk"
        reply = _post(self.http, url, body).json()
        if not reply.get("success", False):
            raise WeightSyncError(url, 200, reply.get("message") or f"no success in the reply: {reply}")

    def resume(self) -> None:
        _post(self.http, self.root_url + "/continue_generation", {})

    def update_from_disk(self, model_path: str | Path, weight_version: str | None = None, pause_mode: str = "abort") -> None:
        """pause -> load -> continue. Generation continues even when the load fails (on the old weights); the
        load's error is raised after it. A refused pause raises before anything is loaded."""
        self.pause(pause_mode)
        try:
            self.load(model_path, weight_version)
        finally:
            self.resume()

    def close(self) -> None:
        self.http.close()


@dataclass
class SyncReport:
    policy_version: int
    engine_model: str | None
    seconds: dict[str, float] = field(default_factory=dict)


def _paused_update(gateways: Sequence[Pausable], mode: str, drain_timeout: float, report: SyncReport, update) -> None:
    """Pause every gateway, run `update()` (timed as "load"), resume every gateway on `report`'s version and engine
    model. When the update fails, every gateway resumes unchanged (the old weights still serve) and the error is
    raised: no session is left held."""
    started = time.monotonic()
    for gateway in gateways:
        gateway.pause(mode=mode, timeout_seconds=drain_timeout)  # type: ignore[arg-type]
    report.seconds["pause"] = time.monotonic() - started
    try:
        mark = time.monotonic()
        update()
        report.seconds["load"] = time.monotonic() - mark
    except BaseException:
        for gateway in gateways:
            gateway.resume()
        raise
    mark = time.monotonic()
    try:
        for gateway in gateways:
            gateway.resume(policy_version=report.policy_version, engine_model=report.engine_model)
    except BaseException:
        # a refused resume (e.g. a version lower than the gateway's) must not leave a gateway paused for good: every
        # gateway still paused serves again, unchanged, and the refusal is raised
        for gateway in gateways:
            with contextlib.suppress(Exception):
                gateway.resume()
        raise
    report.seconds["resume"] = time.monotonic() - mark
    report.seconds["total"] = time.monotonic() - started


def sync_lora(
    gateways: Sequence[Pausable],
    engine: VLLMLoraEngine,
    adapter_dir: str | Path,
    policy_version: int,
    name_prefix: str = "policy-v",
    previous: str | None = None,
    mode: str = "drain",
    drain_timeout: float = 300.0,
) -> SyncReport:
    """Drain (or abort) every gateway, load `adapter_dir` as `<name_prefix><policy_version>`, resume every gateway
    on it with `policy_version`, then unload `previous` (no call uses it any more). Returns per-phase seconds."""
    name = f"{name_prefix}{policy_version}"
    report = SyncReport(policy_version, name)
    _paused_update(gateways, mode, drain_timeout, report, lambda: engine.load(name, adapter_dir))
    if previous is not None and previous != name:
        engine.unload(previous)
    return report


def sync_from_disk(
    gateways: Sequence[Pausable],
    engine: SGLangDiskEngine,
    model_path: str | Path,
    policy_version: int,
    mode: str = "drain",
    drain_timeout: float = 300.0,
    engine_pause_mode: str = "abort",
) -> SyncReport:
    """Drain (or abort) every gateway, then on the engine pause -> update_weights_from_disk(model_path,
    weight_version=policy_version) -> continue, then resume every gateway with `policy_version` (same engine model:
    SGLang reloads in place). Returns per-phase seconds."""
    report = SyncReport(policy_version, None)
    _paused_update(gateways, mode, drain_timeout, report, lambda: engine.update_from_disk(model_path, str(policy_version), engine_pause_mode))
    return report
