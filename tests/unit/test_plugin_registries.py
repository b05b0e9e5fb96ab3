"""One registry style for every plug-in kind (polar_mitm/registry.py): dialects, engines, trajectory builders,
harnesses, sandbox runtimes. Each registry keeps its public names, hands out plug-ins that satisfy the kind's
declared interface, and refuses an unknown name with a ConfigError listing the valid ones. The builders'
pure logic runs here on hand-made exchanges: no engine, store or network."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from polar_mitm import dialects, harnesses
from polar_mitm.assembler import BUILDERS, Assembler, Builder
from polar_mitm.assembler.chain import Chain
from polar_mitm.assembler.diagnosis import Diagnoser
from polar_mitm.assembler.source import Exchange
from polar_mitm.engines import ENGINES, Engine, make_engine
from polar_mitm.errors import ConfigError
from polar_mitm.registry import Registry
from polar_mitm.render.parsers import TOOL_PARSERS
from polar_mitm.rollout.runtimes import RUNTIMES, Sandbox

# registry, its kind, and the names users type (--engine, --builder, runtime.backend, agent.harness, exchanges.api)
REGISTRIES = [
    (dialects.DIALECTS, "dialect", ("openai_chat", "openai_responses", "anthropic_messages", "gemini")),
    (ENGINES, "engine", ("vllm", "sglang")),
    (BUILDERS, "builder", ("per_request", "prefix_merging")),
    (RUNTIMES, "runtime", ("local", "docker")),
    (TOOL_PARSERS, "tool parser", ("hermes", "qwen3_coder", "none")),
]
# harness presets keep the first four names first; every agent added since comes after them
FIRST_HARNESSES = ("codex", "claude", "qwen", "gemini")


@pytest.mark.parametrize(("registry", "kind", "names"), REGISTRIES, ids=[kind for _, kind, _ in REGISTRIES])
def test_each_registry_keeps_its_names_and_refuses_unknown_ones(registry: Registry, kind: str, names: tuple[str, ...]) -> None:
    assert registry.kind == kind
    assert registry.names() == tuple(registry) == names
    assert len(registry) == len(names) and all(name in registry for name in names) and "nope" not in registry
    with pytest.raises(ConfigError) as raised:
        registry.get("nope")
    assert str(raised.value) == f"unknown {kind} 'nope'; valid: {', '.join(names)}"
    assert isinstance(raised.value, ValueError)  # what callers caught before the registries
    with pytest.raises(KeyError):
        registry["nope"]
    assert [registry[name] for name in names] == registry.values()


def test_the_harness_registry_keeps_its_first_names_and_refuses_unknown_ones() -> None:
    names = harnesses.HARNESSES.names()
    assert harnesses.HARNESSES.kind == "harness" and names[: len(FIRST_HARNESSES)] == FIRST_HARNESSES
    assert len(set(names)) == len(names) == len(harnesses.HARNESSES) and "nope" not in harnesses.HARNESSES
    with pytest.raises(ConfigError) as raised:
        harnesses.HARNESSES.get("nope")
    assert str(raised.value) == f"unknown harness 'nope'; valid: {', '.join(names)}"


def test_registry_imports_a_lazy_entry_once_on_first_use() -> None:
    registry: Registry[object] = Registry("thing", {"path": "os.path:join", "module": "json", "given": 42})
    assert registry.get("given") == 42
    import json
    import os.path

    assert registry.get("path") is os.path.join and registry.get("module") is json


def test_plugins_satisfy_their_kinds_interface() -> None:
    for name in ENGINES:
        assert issubclass(ENGINES.get(name), Engine) and ENGINES.get(name).kind == name
    assert type(make_engine("sglang", "http://127.0.0.1:1/v1")).__name__ == "SGLangEngine"
    with pytest.raises(ConfigError, match="unknown engine 'tgi'; valid: vllm, sglang"):
        make_engine("tgi", "http://127.0.0.1:1/v1")
    for name in harnesses.NAMES:
        harness = harnesses.get(name)
        assert isinstance(harness, harnesses.Harness) and harness.name == name and harness.api in dialects.DIALECTS
    assert {RUNTIMES.get(name).__name__ for name in RUNTIMES} == {"LocalSandbox", "DockerSandbox"}
    assert all(issubclass(RUNTIMES.get(name), Sandbox) for name in RUNTIMES)


# -- builders
def test_builders_declare_the_builder_interface() -> None:
    parameters = [p for p in inspect.signature(Builder.build_session).parameters if p != "self"]
    for name in BUILDERS:
        builder = BUILDERS.get(name)
        assert builder.NAME == name
        assert isinstance(builder.SUPPORTS_LENIENT, bool)
        assert list(inspect.signature(builder.build_session).parameters)[: len(parameters)] == parameters
    assert [name for name in BUILDERS if BUILDERS.get(name).SUPPORTS_LENIENT] == ["prefix_merging"]


def test_assembler_refuses_an_unknown_builder_and_lenient_per_request_before_reading_anything() -> None:
    with pytest.raises(ConfigError, match="unknown builder 'greedy'; valid: per_request, prefix_merging"):
        Assembler("/nonexistent/store.duckdb", builder="greedy")
    with pytest.raises(ConfigError, match="lenient applies to the prefix_merging builder only"):
        Assembler("/nonexistent/store.duckdb", builder="per_request", lenient=True)


def exchange(seq: int, prompt: list[int], completion: list[int]) -> Exchange:
    return Exchange(
        exchange_id=f"x{seq}", session_id="s", seq=seq,
        prompt=np.array(prompt, dtype=np.int32), completion=np.array(completion, dtype=np.int32),
        logprobs=np.full(len(completion), -0.5), finish_reason="stop", roles=None, retry_count=None,
        api="openai_chat", harness=None, model_requested="m", model_engine="m",
    )


# turn 1; turn 2 extends turn 1's prompt + sample by one new context token (9); then turn 1's prompt re-sent
SESSION = [exchange(1, [1, 2, 3], [4, 5]), exchange(2, [1, 2, 3, 4, 5, 9], [7]), exchange(3, [1, 2, 3], [6])]


def no_messages(ids: list[str]) -> dict:
    raise AssertionError(f"a diagnosis was asked for {ids}, but no chain breaks in this session")


def build(name: str) -> list[Chain]:
    return BUILDERS.get(name).build_session(SESSION, Diagnoser(no_messages), lenient=False)


def test_per_request_gives_one_sequence_per_exchange_and_flags_the_resent_prompt() -> None:
    chains = build("per_request")
    assert [[e.exchange_id for e in c.exchanges] for c in chains] == [["x1"], ["x2"], ["x3"]]
    assert [c.tokens().tolist() for c in chains] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 9, 7], [1, 2, 3, 6]]
    assert [c.retry_of for c in chains] == [None, None, "x1"]
    assert {c.builder for c in chains} == {"per_request"}


def test_prefix_merging_merges_the_extension_and_keeps_the_resent_sample_apart() -> None:
    chains = build("prefix_merging")
    assert [[e.exchange_id for e in c.exchanges] for c in chains] == [["x1", "x2"], ["x3"]]
    merged = chains[0]
    assert merged.tokens().tolist() == [1, 2, 3, 4, 5, 9, 7]
    # the sampled regions: turn 1's [4, 5] and turn 2's [7], each trained where it was sampled
    assert [(start, end, e.exchange_id) for start, end, e in merged.spans] == [(3, 5, "x1"), (6, 7, "x2")]
    assert merged.break_diagnosis is None and merged.retry_of is None
    assert chains[1].retry_of == "x1" and chains[1].tokens().tolist() == [1, 2, 3, 6]


# -- the interfaces hold statically: a type checker accepts every registered module as its protocol
CHECK = """
from polar_mitm.assembler import Builder, per_request, prefix_merging
from polar_mitm.dialects import CountsTokens, Dialect, anthropic_messages, gemini, openai_chat, openai_responses

dialects: list[Dialect] = [openai_chat, openai_responses, anthropic_messages, gemini]
counting: list[CountsTokens] = [openai_responses, anthropic_messages, gemini]
builders: list[Builder] = [per_request, prefix_merging]
"""
BROKEN = """
from polar_mitm.dialects import Dialect
import half_a_dialect

dialect: Dialect = half_a_dialect
"""


def mypy(tmp_path: Path, source: str) -> tuple[int, str]:
    api = pytest.importorskip("mypy.api")
    (tmp_path / "check.py").write_text(source)
    (tmp_path / "half_a_dialect.py").write_text('API = "x"\nSTREAM_CONTENT_TYPE = "text/event-stream"\n\ndef recognizes(method: str, path: str) -> bool:\n    return True\n')
    # only check.py's own lines are reported (silent imports): the project's other typing debts do not count here
    stdout, stderr, status = api.run([str(tmp_path / "check.py"), "--follow-imports=silent", "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache"), "--python-executable", sys.executable])
    return status, stdout + stderr


def test_a_type_checker_accepts_every_module_as_its_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MYPYPATH", f"{tmp_path}{os.pathsep}{Path(__file__).resolve().parents[2]}")
    status, out = mypy(tmp_path, CHECK)
    assert status == 0, out
    status, out = mypy(tmp_path, BROKEN)
    assert status == 1 and 'has type Module, variable has type "Dialect"' in out, out
