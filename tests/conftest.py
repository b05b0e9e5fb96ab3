"""Shared fixtures. Append new fixtures; other test modules depend on the ones here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    """OpenAI base URL (".../v1") of a real vLLM engine.

    $POLAR_MITM_ENGINE_URL if set; else the local engine on 127.0.0.1:8011, reused when one is live
    and otherwise started for this run and stopped at its end.
    """
    if url := os.environ.get("POLAR_MITM_ENGINE_URL"):
        yield url.rstrip("/")
        return
    from polar_mitm.local_engine import LocalEngine

    engine = LocalEngine()
    url = engine.start()
    yield url
    if engine.started_here:
        engine.stop()
    else:  # reused on purpose: named at the end of the run (pytest_terminal_summary)
        REUSED_ENGINES.append(engine)


REUSED_ENGINES: list = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What the run leaves up on purpose: an engine it found running and reused, with its memory and how to stop it."""
    for engine in REUSED_ENGINES:
        if note := engine.left_running():
            terminalreporter.write_line(f"polar-mitm tests: {note}")


from polar_mitm.util import free_port  # noqa: E402
from tests.support.gatewayproc import Gateway  # noqa: E402


@pytest.fixture(scope="session")
def gateway(engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One real gateway process for the test run; tests keep apart by using their own session ids."""
    base = tmp_path_factory.mktemp("gateway")
    gw = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "confdir", upstream=engine_url).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def chat_gateway(engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One real gateway in chat mode (`--render chat`: the engine renders the messages) for the tests that check what
    a dialect hands the engine as messages; the default, `gateway`, is auto (tokens mode on this engine)."""
    base = tmp_path_factory.mktemp("chat-gateway")
    gw = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "confdir", upstream=engine_url, args=["--render", "chat"]).start()
    yield gw
    gw.stop()


@pytest.fixture
def make_gateway(tmp_path_factory: pytest.TempPathFactory, engine_url: str) -> Iterator:
    """Start extra gateways with their own options (dead upstream, --require-auth, ...)."""
    started: list[Gateway] = []

    def start(*args: str, upstream: str | None = None, db: Path | None = None, confdir: Path | None = None) -> Gateway:
        base = tmp_path_factory.mktemp("gw")
        gw = Gateway(port=free_port(), db=db or base / "store.duckdb", confdir=confdir or base / "confdir", upstream=upstream or engine_url, args=list(args)).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture
def session_id(request: pytest.FixtureRequest) -> str:
    import uuid

    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")


@pytest.fixture(scope="session")
def debug_store(engine_url: str, tmp_path_factory: pytest.TempPathFactory):
    """A small real run for the debugging tools (tests/support/debug_run.py): harness-shaped SDK sessions on two tasks,
    two sessions that break on purpose, rewards recorded, trajectories assembled; the gateway has stopped."""
    from tests.support import debug_run

    return debug_run.build(engine_url, tmp_path_factory.mktemp("debug_run"))


@pytest.fixture(scope="session")
def lora_engine() -> Iterator[str]:
    """OpenAI base URL of a real vLLM engine serving SmolLM2-135M-Instruct with runtime LoRA adapters (weight sync).

    $POLAR_MITM_LORA_ENGINE_URL if set; else the local engine on 127.0.0.1:8012 (`polar-mitm engine start --model
    smollm2 --port 8012 --lora-rank 8`), reused when live and otherwise started for this run and stopped at its end.
    """
    if url := os.environ.get("POLAR_MITM_LORA_ENGINE_URL"):
        yield url.rstrip("/")
        return
    from polar_mitm.local_engine import LocalEngine

    engine = LocalEngine(model="smollm2", port=8012, lora_rank=8)
    url = engine.start(timeout=900)
    yield url
    if engine.started_here:
        engine.stop()


@pytest.fixture(scope="session")
def trainer_python() -> str:
    """The Python a trainer step runs in (torch, transformers, peft): the local engine's venv, plus trainer packages."""
    from polar_mitm.local_engine import build

    return str(build.ensure_trainer_packages(build.engine_home()))


@pytest.fixture(scope="session")
def readme_store(engine_url: str, tmp_path_factory: pytest.TempPathFactory):
    """The README's main job, run with `--db hello.duckdb` in a directory of its own (tests/support/user_stores.py)."""
    from polar_mitm.errors import HarnessNotInstalled
    from tests.support import user_stores

    try:
        return user_stores.build_readme_store(engine_url, tmp_path_factory.mktemp("readme_store"))
    except HarnessNotInstalled as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def run_store(engine_url: str, tmp_path_factory: pytest.TempPathFactory):
    """`polar-mitm gateway --db run.duckdb`, two `polar-mitm run` sessions, no task (tests/support/user_stores.py)."""
    from tests.support import user_stores

    return user_stores.build_run_store(engine_url, tmp_path_factory.mktemp("run_store"))
