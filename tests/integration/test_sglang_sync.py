"""SGLang weight sync: `SGLangDiskEngine` and `sync_from_disk` against a named stand-in (no SGLang runs on these CPU
machines) that speaks SGLang's documented endpoints and bodies, with a real gateway process in front of it."""

from __future__ import annotations

import os

import httpx
import pytest

from polar_mitm.client import GatewayControl
from polar_mitm.errors import PolarError, WeightSyncError
from polar_mitm.util import free_port
from polar_mitm.weight_sync import SGLangDiskEngine, sync_from_disk
from tests.support.upstream_standins import SGLangWeightSyncStandin


@pytest.fixture
def checkpoint(tmp_path, monkeypatch) -> str:
    """A trainer's checkpoint folder, named relative to the trainer's working directory as a user would."""
    (tmp_path / "ckpt" / "step-1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return "ckpt/step-1"


def test_update_from_disk_pauses_loads_and_continues_in_order(checkpoint, tmp_path) -> None:
    standin = SGLangWeightSyncStandin()
    engine = SGLangDiskEngine(standin.url)  # the OpenAI base works as well as the root
    try:
        engine.update_from_disk(checkpoint, weight_version="1")
        absolute = str(tmp_path / "ckpt" / "step-1")
        assert standin.calls == [
            ("/pause_generation", {"mode": "abort"}),
            ("/update_weights_from_disk", {"model_path": absolute, "weight_version": "1"}),
            ("/continue_generation", {}),
        ]
        info = httpx.get(standin.url.removesuffix("/v1") + "/get_model_info", trust_env=False).json()
        assert (info["model_path"], info["weight_version"]) == (absolute, "1")
        with pytest.raises(WeightSyncError, match="no checkpoint at org/hub-model"):  # the stand-in has no hub
            engine.update_from_disk("org/hub-model", pause_mode="retract")  # not a local path: sent as given
        assert standin.calls[3:] == [("/pause_generation", {"mode": "retract"}), ("/update_weights_from_disk", {"model_path": "org/hub-model"}), ("/continue_generation", {})]
    finally:
        engine.close()
        standin.close()


def test_engine_errors_are_weight_sync_errors(checkpoint) -> None:
    standin = SGLangWeightSyncStandin(admin_api_key="admin-key")
    try:
        # a failed load: generation continues on the old weights, and the engine's own message is raised
        engine = SGLangDiskEngine(standin.url, api_key="admin-key")
        with pytest.raises(WeightSyncError) as failed:
            engine.update_from_disk("ckpt/missing", weight_version="2")
        assert isinstance(failed.value, PolarError)
        assert failed.value.status == 400 and failed.value.endpoint.endswith("/update_weights_from_disk")
        assert "no checkpoint at" in failed.value.message and "ckpt/missing" in str(failed.value)
        assert [path for path, _ in standin.calls] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert standin.running.is_set()
        engine.close()

        # a refused pause: nothing is loaded
        del standin.calls[:]
        with pytest.raises(WeightSyncError) as refused:
            SGLangDiskEngine(standin.url, api_key="admin-key").update_from_disk(checkpoint, pause_mode="sleep")
        assert refused.value.status == 400 and "Invalid mode: 'sleep'" in refused.value.message
        assert [path for path, _ in standin.calls] == ["/pause_generation"]

        # the wrong admin key
        with pytest.raises(WeightSyncError) as unauthorized:
            SGLangDiskEngine(standin.url, api_key="wrong").update_from_disk(checkpoint)
        assert unauthorized.value.status == 401 and "/pause_generation" in unauthorized.value.endpoint
    finally:
        standin.close()
    # nobody listening
    with pytest.raises(WeightSyncError) as unreachable:
        SGLangDiskEngine(f"http://127.0.0.1:{free_port()}").pause()
    assert unreachable.value.status is None and "unreachable" in str(unreachable.value)


class RecordingControl(GatewayControl):
    """A gateway's control client that writes its pause/resume into the stand-in's call list, to check the order."""

    def __init__(self, url: str, calls: list):
        super().__init__(url)
        self.calls = calls

    def pause(self, *args, **kwargs) -> dict:
        status = super().pause(*args, **kwargs)
        self.calls.append(("gateway pause", {"state": status["state"], "in_flight": status["in_flight"]}))
        return status

    def resume(self, policy_version: int | None = None, engine_model: str | None = None) -> dict:
        status = super().resume(policy_version, engine_model)
        self.calls.append(("gateway resume", {"policy_version": status["policy_version"], "engine_model": status["engine_model"]}))
        return status


def test_sync_from_disk_with_a_gateway(make_gateway, session_id: str, checkpoint, tmp_path) -> None:
    calls: list = []
    standin = SGLangWeightSyncStandin(calls=calls)
    engine = SGLangDiskEngine(standin.url)
    try:
        gateway = make_gateway("--engine", "sglang", upstream=standin.url)
        control = RecordingControl(gateway.proxy_url(), calls)

        def ask() -> None:
            with httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=60) as http:
                reply = http.post("https://api.openai.com/v1/chat/completions", headers={"authorization": "Bearer sk-test"}, json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hi there", reply.text

        ask()
        report = sync_from_disk([control], engine, checkpoint, 1)
        ask()
        absolute = str(tmp_path / "ckpt" / "step-1")
        assert calls == [
            ("gateway pause", {"state": "paused", "in_flight": 0}),
            ("/pause_generation", {"mode": "abort"}),
            ("/update_weights_from_disk", {"model_path": absolute, "weight_version": "1"}),
            ("/continue_generation", {}),
            ("gateway resume", {"policy_version": 1, "engine_model": None}),  # SGLang reloads under the same name
        ]
        assert report.policy_version == 1 and set(report.seconds) == {"pause", "load", "resume", "total"}
        assert [(r["policy_version"], r["status"]) for r in gateway.exchanges(session_id)] == [(0, "ok"), (1, "ok")]

        # a failed reload: the gateway resumes on the old version, nothing is left paused, the error says why
        with pytest.raises(WeightSyncError, match="no checkpoint at"):
            sync_from_disk([control], engine, os.path.join("ckpt", "step-2"), 2)
        assert control.status()["state"] == "serving" and control.status()["policy_version"] == 1
        assert calls[-1] == ("gateway resume", {"policy_version": 1, "engine_model": None})
        ask()
        assert [r["policy_version"] for r in gateway.exchanges(session_id)] == [0, 1, 1]
        control.close()
    finally:
        engine.close()
        standin.close()
