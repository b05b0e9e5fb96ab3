"""The declared engine interface (`engines._api.EngineClient`) holds statically: a type checker accepts every engine
client (one per kind, the router, what `make_engine` returns) as an EngineClient, refuses a half one, and finds
no type error at the seams that use it (the addon, the outcome mapping, the tokens-mode path), where `Any` and
`type: ignore` used to stand. No engine needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.engines import ENGINES, EngineClient, make_engine
from polar_mitm.engines.pool import EngineRouter

REPO = Path(__file__).resolve().parents[3]
CHECK = """
from polar_mitm.engines import EngineClient, make_engine
from polar_mitm.engines.base import Engine
from polar_mitm.engines.pool import EngineRouter
from polar_mitm.engines.sglang import SGLangEngine
from polar_mitm.engines.vllm import VLLMEngine

clients: list[EngineClient] = [
    Engine("http://127.0.0.1:9/v1"), VLLMEngine("http://127.0.0.1:9/v1"), SGLangEngine("http://127.0.0.1:9/v1"),
    EngineRouter([VLLMEngine("http://127.0.0.1:9/v1"), VLLMEngine("http://127.0.0.1:10/v1")]),
    make_engine("vllm", "http://127.0.0.1:9/v1,http://127.0.0.1:10/v1"),
]
"""
BROKEN = """
from typing import Any
from polar_mitm.engines import EngineClient
from polar_mitm.engines.vllm import VLLMEngine


class HalfAnEngine:
    kind = "vllm"
    base_url = "http://127.0.0.1:9/v1"
    max_model_len = None

    async def discover(self) -> str:
        return "m"

    def build_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        return chat


class WrongCount(VLLMEngine):
    async def count_tokens(self, count_request: dict[str, Any]) -> str:  # type: ignore[override]
        return "many"


half: EngineClient = HalfAnEngine()
wrong: EngineClient = WrongCount("http://127.0.0.1:9/v1")
"""
# the modules on either side of the seam: the engines themselves and what calls them
SEAMS = [
    "polar_mitm/engines", "polar_mitm/exchange.py", "polar_mitm/render/serve.py", "polar_mitm/render/token_engine.py",
    *(f"polar_mitm/gateway/{name}.py" for name in ("addon", "engine_side", "outcome", "flows", "control", "streaming", "startup")),
]


def mypy(tmp_path: Path, *targets: str) -> tuple[int, str]:
    pytest.importorskip("mypy.api")
    # a subprocess, run from the checkout: the seams are named by their paths in it
    command = [sys.executable, "-m", "mypy", *targets, "--follow-imports=silent", "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "MYPYPATH": str(REPO)})
    return result.returncode, result.stdout + result.stderr


def test_every_engine_client_is_an_engine_client_at_runtime() -> None:
    for name in ENGINES:
        assert isinstance(ENGINES.get(name)("http://127.0.0.1:9/v1"), EngineClient), name
    router = make_engine("sglang", "http://127.0.0.1:9/v1,http://127.0.0.1:10/v1")
    assert isinstance(router, EngineRouter) and isinstance(router, EngineClient)
    assert [reach.url for reach in router.reachability()] == ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]


def test_a_type_checker_accepts_every_engine_client_and_the_seams_and_refuses_a_half_one(tmp_path: Path) -> None:
    (tmp_path / "check.py").write_text(CHECK)
    status, out = mypy(tmp_path, str(tmp_path / "check.py"), *SEAMS)
    assert status == 0, out
    (tmp_path / "broken.py").write_text(BROKEN)
    status, out = mypy(tmp_path, str(tmp_path / "broken.py"))
    assert status == 1, out
    assert '"HalfAnEngine", variable has type "EngineClient"' in out and '"WrongCount", variable has type "EngineClient"' in out, out
    assert "def count_tokens(self, count_request: dict[str, Any]) -> Coroutine[Any, Any, int]" in out, out  # what it should be
