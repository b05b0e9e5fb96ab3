"""The local vLLM engine, exercised for real: its tokenizer directory, token ids, logprobs and forced outputs."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from polar_mitm.cli import main as polar_mitm_main
from polar_mitm.local_engine import LocalEngine

pytestmark = pytest.mark.engine

SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}
# A multi-turn agent conversation: system prompt, reasoning, a tool call and its result.
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should run ls.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": json.dumps({"cmd": "ls"})}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsetup.py"},
    {"role": "user", "content": "Thanks. Now say hi — en français, s'il te plaît 🙂"},
]


def post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def served(engine_url: str) -> dict:
    """The engine's one served model: `id` is its name, `root` its directory (tokenizer included)."""
    models = httpx.get(f"{engine_url}/models", timeout=10, trust_env=False).json()["data"]
    assert len(models) == 1
    return models[0]


@pytest.fixture(scope="module")
def tokenizer(served: dict):
    return AutoTokenizer.from_pretrained(served["root"])


def chat(engine_url: str, served: dict, **body) -> dict:
    return post(f"{engine_url}/chat/completions", {"model": served["id"], "temperature": 0, **body})


def test_tokenizer_dir_matches_engine_tokenize(engine_url, served, tokenizer):
    expected = tokenizer.apply_chat_template(
        CONVERSATION, tools=[SHELL_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    server_root = engine_url.removesuffix("/v1")
    engine_ids = post(
        f"{server_root}/tokenize",
        {"model": served["id"], "messages": CONVERSATION, "tools": [SHELL_TOOL], "add_generation_prompt": True},
    )["tokens"]
    assert engine_ids == expected

    text = "def main():\n    print('héllo  wörld')  # 42\n"
    assert post(f"{server_root}/tokenize", {"model": served["id"], "prompt": text})["tokens"] == tokenizer.encode(text)


def test_greedy_chat_returns_token_ids_and_one_logprob_per_token(engine_url, served, tokenizer):
    body = dict(messages=CONVERSATION, tools=[SHELL_TOOL], max_tokens=8, logprobs=True, top_logprobs=0, return_token_ids=True)
    first, second = chat(engine_url, served, **body), chat(engine_url, served, **body)

    assert first["prompt_token_ids"] == tokenizer.apply_chat_template(
        CONVERSATION, tools=[SHELL_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    choice = first["choices"][0]
    token_ids, logprobs = choice["token_ids"], choice["logprobs"]["content"]
    assert 1 <= len(token_ids) <= 8
    assert len(logprobs) == len(token_ids)
    assert all(entry["logprob"] <= 0.0 for entry in logprobs)
    # Per-token bytes (a token may hold part of a UTF-8 character) add up to the text of the ids.
    text_entries = [entry for entry, token_id in zip(logprobs, token_ids, strict=True) if token_id not in tokenizer.all_special_ids]
    assert b"".join(bytes(entry["bytes"]) for entry in text_entries) == tokenizer.decode(
        token_ids, skip_special_tokens=True
    ).encode()
    assert second["choices"][0]["token_ids"] == token_ids  # greedy is deterministic


def test_regex_forced_tool_call_is_parsed(engine_url, served, tokenizer):
    forced = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "echo hi"}}\n</tool_call>'
    response = chat(
        engine_url, served,
        messages=[{"role": "user", "content": "Say hi using the shell."}],
        tools=[SHELL_TOOL], tool_choice="auto", max_tokens=64, logprobs=True, return_token_ids=True,
        structured_outputs={"regex": re.escape(forced)},
    )
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "shell"
    assert json.loads(call["function"]["arguments"]) == {"cmd": "echo hi"}
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == forced


def test_regex_forcing_covers_reasoning(engine_url, served, tokenizer):
    """No reasoning parser: `<think>` text is plain content and the regex constrains the whole output."""
    forced = "<think>r</think>answer"
    response = chat(
        engine_url, served,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=32, return_token_ids=True, structured_outputs={"regex": re.escape(forced)},
    )
    choice = response["choices"][0]
    assert choice["message"]["content"] == forced
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == forced


def test_harness_sized_prompt_fits(engine_url, served):
    """Real harness prompts run to 20-40k tokens; the default model must take them whole."""
    if served["max_model_len"] < 40_000:
        pytest.skip(f"{served['id']} serves only {served['max_model_len']} tokens")
    prompt = " ".join(f"word{i}" for i in range(6000))  # ~30k tokens
    response = chat(engine_url, served, messages=[{"role": "user", "content": prompt}], max_tokens=1, return_token_ids=True)
    assert len(response["prompt_token_ids"]) > 25_000
    assert len(response["choices"][0]["token_ids"]) == 1


def test_start_reuses_the_live_engine(engine_url, served):
    engine = LocalEngine(model=served["id"])
    if engine_url != engine.base_url:
        pytest.skip("the engine under test is not the local one on the default port")
    assert engine.start() == engine_url
    assert not engine.started_here
    assert engine.running()
    assert polar_mitm_main(["engine", "status"]) == 0
