"""Weight sync: put a trainer's new weights into the running engine between two gateway control calls.

    pause(drain) on every gateway  ->  engine: new weights  ->  resume(policy_version + 1, engine_model)

Like `polar_mitm.client`, this module needs only httpx (no gateway dependencies), so a trainer imports it.

- vLLM (measured on 0.32.0 CPU, see docs/training.md): runtime LoRA. Serve with `--enable-lora
  --max-lora-rank R --max-loras N` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`polar-mitm engine start
  --lora-rank R` does both). `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` loads a PEFT adapter folder
  and serves it under its name; the gateway's resume names it as the engine model, so every call after resume
  uses it. Each version gets its own name: vLLM refuses a loaded name unless `load_inplace`, and an in-place
  reload would change the weights under calls the gateway still attributes to the old version.
- SGLang (not runnable on this CPU machine; endpoints as its RL docs give them): `POST /pause_generation`,
  `POST /update_weights_from_disk {"model_path"}`, `POST /continue_generation`. The gateway's drain already
  holds every call, so the engine-side pause is a second guard for callers that bypass the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from polar_mitm.client import GatewayControl
from polar_mitm.errors import ClientError


def _post(http: httpx.Client, url: str, body: dict | None = None) -> httpx.Response:
    try:
        response = http.post(url, json=body)
    except httpx.HTTPError as error:
        raise ClientError(f"engine at {url} unreachable: {error!r}") from error
    if response.status_code >= 400:
        raise ClientError(f"POST {url}: HTTP {response.status_code}: {response.text[:1000]}")
    return response


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
    """An SGLang engine's weight reload from disk, bracketed by its own generation pause."""

    def __init__(self, root_url: str, timeout: float = 600.0):
        self.root_url = root_url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(timeout=timeout, trust_env=False)

    def update_from_disk(self, model_path: str | Path) -> None:
        _post(self.http, self.root_url + "/pause_generation", {})
        try:
            _post(self.http, self.root_url + "/update_weights_from_disk", {"model_path": str(model_path)})
        finally:
            _post(self.http, self.root_url + "/continue_generation", {})

    def close(self) -> None:
        self.http.close()


@dataclass
class SyncReport:
    policy_version: int
    engine_model: str | None
    seconds: dict[str, float] = field(default_factory=dict)


def sync_lora(
    gateways: Sequence[GatewayControl],
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
    started = time.monotonic()
    for gateway in gateways:
        gateway.pause(mode=mode, timeout_seconds=drain_timeout)  # type: ignore[arg-type]
    report.seconds["pause"] = time.monotonic() - started
    try:
        mark = time.monotonic()
        engine.load(name, adapter_dir)
        report.seconds["load"] = time.monotonic() - mark
    except BaseException:
        for gateway in gateways:  # the old adapter still serves: resume on it rather than leave sessions held
            gateway.resume()
        raise
    mark = time.monotonic()
    for gateway in gateways:
        gateway.resume(policy_version=policy_version, engine_model=name)
    report.seconds["resume"] = time.monotonic() - mark
    if previous is not None and previous != name:
        engine.unload(previous)
    report.seconds["total"] = time.monotonic() - started
    return report
