"""Output budgets fitted to the engine's context, and prompts over it answered in each provider's own words.

Against a second real engine served with a context (24576) shorter than what Claude Code (max_tokens 128000)
and Qwen Code (32768) ask for but longer than their prompts, as GPU training engines often are. The steering
hook only forces the text (tests/support/harness_steering.py): each harness's own max_tokens and sampling reach
the gateway, which fits the budget to the context and records the requested and granted values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors

from polar_mitm.local_engine import LocalEngine
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway, proxy_env
from tests.support.harness_runs import HOOK, check_run, run_harness
from tests.support.harness_steering import SIDE_CALL_TEXT
from tests.support.matrix import harness_matrix

CONTEXT = 24576
NOTE = re.compile(r"^(max_tokens|max_completion_tokens) (\d+) -> (\d+): the engine's context is (\d+) tokens and the prompt (\d+)$")


@pytest.fixture(scope="module")
def short_engine() -> str:
    engine = LocalEngine(port=free_port(), max_model_len=CONTEXT)
    url = engine.start()
    yield url
    engine.stop()


@pytest.fixture
def short_gateway(make_gateway, short_engine: str) -> Gateway:
    return make_gateway("--engine-hook", HOOK, upstream=short_engine)


def budget_notes(row: dict) -> list[tuple[str, int, int, int, int]]:
    return [tuple(int(g) if g.isdigit() else g for g in m.groups()) for n in row["normalizations"] or [] if (m := NOTE.match(n))]


@pytest.mark.harness
# default suite: the two harnesses whose own max_tokens exceed the short context (Claude Code 128000, Qwen Code 32768)
@pytest.mark.parametrize("name", harness_matrix(["claude", "qwen", "codex", "gemini"], default=("claude", "qwen")))
def test_harness_runs_unmodified_against_a_short_context_engine(installed, short_gateway, session_id, tmp_path, name):
    result = run_harness(short_gateway, name, session_id, tmp_path)
    rows = check_run(short_gateway, name, session_id, tmp_path, result, side_calls=1 if name == "gemini" else 0)
    asked = {"claude": 128000, "qwen": 32768}.get(name)
    for row in rows:
        engine_request = row["engine_request"]
        granted = CONTEXT - row["prompt_tokens"]
        assert row["prompt_tokens"] < CONTEXT
        for key in ("max_tokens", "max_completion_tokens"):
            # never more than the room left: either fitted, or left to the engine (which fills the room)
            assert engine_request.get(key) is None or engine_request[key] <= granted, (key, engine_request.get(key))
        if asked is not None:
            # the harness's own budget reached the gateway, and the row says what it got instead
            body = json.loads(row["request_body"])
            assert body["max_tokens"] == asked
            assert budget_notes(row) == [("max_tokens", asked, granted, CONTEXT, row["prompt_tokens"])], row["normalizations"]


def long_text(tokens: int) -> str:
    return "hello " * tokens  # " hello" is one token in the Qwen tokenizer


def test_a_budget_that_overflows_with_the_prompt_gets_the_room_left(short_gateway, session_id):
    with proxy_env(short_gateway, session_id):
        reply = openai.OpenAI(api_key="sk-test").chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": long_text(12000)}], max_tokens=20000
        )
    assert reply.choices[0].message.content == SIDE_CALL_TEXT
    [row] = short_gateway.exchanges(session_id)
    assert row["status"] == "ok" and 12000 <= row["prompt_tokens"] < CONTEXT - 1000
    room = CONTEXT - row["prompt_tokens"]
    # vLLM 0.32 takes the overflowing budget and stops at the context's end (an engine that refuses it is asked
    # again with the room left); either way the row records what the engine could grant
    assert json.loads(row["engine_request"])["max_tokens"] in (20000, room)
    assert budget_notes(row) == [("max_tokens", 20000, room, CONTEXT, row["prompt_tokens"])]


def test_a_budget_within_the_room_is_untouched(short_gateway, session_id):
    with proxy_env(short_gateway, session_id):
        openai.OpenAI(api_key="sk-test").chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=500)
    [row] = short_gateway.exchanges(session_id)
    assert json.loads(row["engine_request"])["max_tokens"] == 500 and not budget_notes(row)


def over_context(client_call) -> Exception:
    with pytest.raises(Exception) as caught:
        client_call()
    return caught.value


def test_a_prompt_over_the_context_gets_each_providers_error_and_the_gateway_keeps_serving(short_gateway, session_id, tmp_path: Path):
    prompt = long_text(CONTEXT + 2000)
    with proxy_env(short_gateway, session_id):
        oa = openai.OpenAI(api_key="sk-test", max_retries=0)
        chat = over_context(lambda: oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": prompt}], stream=True))
        responses = over_context(lambda: oa.responses.create(model="gpt-5", input=prompt, stream=True))
        ac = anthropic.Anthropic(api_key="sk-ant-test", max_retries=0)
        claude = over_context(lambda: ac.messages.create(
            model="claude-sonnet-4-6", max_tokens=64000, messages=[{"role": "user", "content": prompt}], stream=True
        ))
        gc = genai.Client(api_key="test")
        gemini = over_context(lambda: gc.models.generate_content(model="gemini-2.5-pro", contents=prompt))
        # the gateway keeps serving: a short request right after is answered
        ok = oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])

    assert isinstance(chat, openai.BadRequestError) and chat.code == "context_length_exceeded"
    assert re.match(rf"This model's maximum context length is {CONTEXT} tokens\. However, your messages resulted in \d+ tokens", chat.message.split(" - ")[-1].removeprefix("Error code: 400"))
    assert isinstance(responses, openai.BadRequestError) and responses.code == "context_length_exceeded" and responses.param == "input"
    assert isinstance(claude, anthropic.BadRequestError)
    assert re.search(rf"prompt is too long: \d+ tokens > {CONTEXT} maximum", str(claude))
    assert isinstance(gemini, genai_errors.ClientError) and gemini.code == 400 and gemini.status == "INVALID_ARGUMENT"
    assert re.search(rf"The input token count \(\d+\) exceeds the maximum number of tokens allowed \({CONTEXT}\)", str(gemini))
    assert ok.choices[0].message.content == SIDE_CALL_TEXT

    rows = short_gateway.exchanges(session_id)
    assert [(r["api"], r["status"], r["http_status"]) for r in rows] == [
        ("openai_chat", "context_length_exceeded", 400),
        ("openai_responses", "context_length_exceeded", 400),
        ("anthropic_messages", "context_length_exceeded", 400),
        ("gemini", "context_length_exceeded", 400),
        ("openai_chat", "ok", 200),
    ]
    assert all(re.search(rf"the prompt has \d+ tokens; the engine's context holds {CONTEXT}", r["error"]) for r in rows[:4])
