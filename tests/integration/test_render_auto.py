"""`--render auto` (issue 27): tokens mode wherever the model's tokenizer and chat template load on this machine and
the template's tool-call format has a parser; chat mode otherwise, with one warning line saying why. One test per
reason it falls back, each through a real gateway with the official openai SDK as the client, against the real
engine except where the reason is the engine itself (a stand-in whose /models names no directory, as SGLang's and
a remote engine's do). And `--tool-parser auto` (the default): the format read from the template, a template whose
format no parser knows refused in tokens mode rather than its tool calls returned as text.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.tokens_sessions import HOOKS, assert_one_sequence_per_session, chat_session, rows_of
from tests.support.upstream_standins import StandinUpstream

FALLBACK = "polar: --render auto: chat mode (the engine renders prompts), since "
# a template that renders tools, in a format no parser knows (Mistral's markers)
UNKNOWN_FORMAT = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"


def engine_model_dir(engine_url: str) -> Path:
    with urllib.request.urlopen(engine_url + "/models", timeout=30) as reply:
        return Path(json.load(reply)["data"][0]["root"])


def render_model(engine_url: str, where: Path, template: str | None, tokenizer: bool = True) -> Path:
    """A copy of the engine's tokenizer files (`tokenizer`), with `template` as its chat template (None: none)."""
    where.mkdir()
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(engine_model_dir(engine_url) / name, where / name)
    if template is not None:
        (where / "chat_template.jinja").write_text(template)
    return where


def two_calls(gateway: Gateway, session_id: str) -> list[dict]:
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-auto", max_retries=0)
    for text in ("hi", "again"):
        reply = client.chat.completions.create(model="qwen3-coder-plus", messages=[{"role": "user", "content": text}], max_tokens=8)
        assert reply.choices[0].message is not None
    return rows_of(gateway, session_id)


def fallback_lines(gateway: Gateway) -> list[str]:
    return [line[line.index(FALLBACK):] for line in gateway.log.read_text().splitlines() if FALLBACK in line]


@pytest.mark.engine
def test_auto_is_tokens_mode_where_the_engines_model_is_here(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--render", "auto", "--engine-hook", HOOKS["steer"])
    chat_session(gateway, session_id)
    rows = rows_of(gateway, session_id)
    assert [(r["render_mode"], r["bridged"]) for r in rows] == [("tokens", False), ("tokens", True), ("tokens", True)]
    assert_one_sequence_per_session(gateway, session_id, rows)
    assert not fallback_lines(gateway)
    assert gateway.start_line().endswith("render auto: tokens")
    assert "tokens mode renders with the chat template of" in gateway.log.read_text() and "(tool parser hermes)" in gateway.log.read_text()


@pytest.mark.engine
@pytest.mark.parametrize(
    "setup, reason",
    [
        ("no_tokenizer", "cannot load the tokenizer of"),
        ("no_chat_template", "has no chat template"),
        ("unknown_tool_format", "writes tool calls in a format no tool parser knows"),
    ],
)
def test_auto_falls_back_to_chat_mode_saying_why_once(make_gateway, session_id: str, engine_url: str, tmp_path: Path, setup: str, reason: str) -> None:
    template = {"no_tokenizer": None, "no_chat_template": None, "unknown_tool_format": UNKNOWN_FORMAT}[setup]
    model = render_model(engine_url, tmp_path / setup, template, tokenizer=setup != "no_tokenizer")
    gateway = make_gateway("--render", "auto", "--render-model", str(model))
    rows = two_calls(gateway, session_id)
    assert [(r["status"], r["render_mode"]) for r in rows] == [("ok", "chat")] * 2, rows
    [line] = fallback_lines(gateway)  # said once, at start, not per call
    assert reason in line, line
    assert gateway.start_line().endswith("render auto: chat")


def test_auto_falls_back_when_the_engines_model_directory_is_not_here(make_gateway, session_id: str) -> None:
    upstream = StandinUpstream("sglang")  # its /models names no directory, like SGLang's and any remote engine's
    try:
        gateway = make_gateway("--render", "auto", "--engine", "sglang", upstream=upstream.url)
        rows = two_calls(gateway, session_id)
        assert [(r["status"], r["render_mode"]) for r in rows] == [("ok", "chat")] * 2, rows
        [line] = fallback_lines(gateway)
        assert "the engine's model directory is not on this machine" in line, line
    finally:
        upstream.close()


@pytest.mark.engine
def test_auto_falls_back_with_several_upstreams(make_gateway, session_id: str, engine_url: str) -> None:
    gateway = make_gateway("--render", "auto", upstream=f"{engine_url},{engine_url}")
    rows = two_calls(gateway, session_id)
    assert [(r["status"], r["render_mode"]) for r in rows] == [("ok", "chat")] * 2, rows
    [line] = fallback_lines(gateway)
    assert "several upstream engines" in line, line
    assert gateway.start_line().endswith("render auto: chat")


@pytest.mark.engine
def test_tokens_mode_refuses_a_template_whose_tool_format_no_parser_knows(make_gateway, session_id: str, engine_url: str, tmp_path: Path) -> None:
    model = render_model(engine_url, tmp_path / "unknown", UNKNOWN_FORMAT)
    gateway = make_gateway("--render", "tokens", "--render-model", str(model))
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-auto", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="qwen3-coder-plus", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert "no tool parser knows" in caught.value.body["message"] and "--tool-parser" in caught.value.body["message"]
    [row] = rows_of(gateway, session_id)
    assert (row["status"], row["http_status"], row["render_mode"]) == ("render_error", 500, "tokens")
    # named at start, before any call
    assert "polar: tokens mode: the chat template of" in gateway.log.read_text()
    # told which parser, it renders (and parses what is sampled with that one)
    told = make_gateway("--render", "tokens", "--render-model", str(model), "--tool-parser", "none")
    assert [(r["status"], r["render_mode"]) for r in two_calls(told, f"{session_id}-told")] == [("ok", "tokens")] * 2
