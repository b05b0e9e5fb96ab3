"""bench/scale.py's conversations are what a harness sends: each API's request parses with that API's dialect into
the same conversation (system prompt, history, tools), its history grows turn by turn, and each earlier reply in
it is the stand-in engine's own (its text and tool call), as a harness echoes what it got."""

from __future__ import annotations

import json
from urllib.parse import parse_qsl, urlsplit

import pytest

from bench import scale
from bench.soak_client import APIS
from bench.stub_upstream import CONTENT, TOOL_ARGUMENTS, TOOL_NAME
from polar_mitm import dialects


def parsed(api: str, stream: bool, turns: int):
    system, sent = scale.conversation(7, turns)
    host, raw = scale.raw_request(api, stream, scale.body_for(api, stream, system, sent), plain_chat=False)
    head, _, payload = raw.partition(b"\r\n\r\n")
    target = urlsplit(head.split(b" ")[1].decode())
    assert int(dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])["content-length"]) == len(payload)
    return host, dialects.get(api).parse(payload, target.path, dict(parse_qsl(target.query))), system, sent


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_each_apis_turn_parses_into_the_same_growing_conversation(api: str, stream: bool) -> None:
    host, request, system, sent = parsed(api, stream, 3)
    assert host == scale.HOSTS[api] and request.api == api and request.stream is stream
    messages = request.chat["messages"]
    assert messages[0] == {"role": "system", "content": system}
    # the task, then two turns of (the stand-in's reply, the output of the tool it called)
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert messages[1]["content"] == sent[0]
    for reply in (messages[2], messages[4]):
        assert reply["content"] == CONTENT
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply["tool_calls"]] == [(TOOL_NAME, json.loads(TOOL_ARGUMENTS))]
    for output, message in zip(sent[1:], (messages[3], messages[5]), strict=True):
        # Gemini's functionResponse is an object: it arrives as its JSON
        assert (json.loads(message["content"])["output"] if api == "gemini" else message["content"]) == output
    assert [tool["function"]["name"] for tool in request.chat["tools"]] == [tool["name"] for tool in scale.TOOLS]
    assert TOOL_NAME in [tool["name"] for tool in scale.TOOLS]
    # a harness-sized first request, and each turn adds its reply and a tool result
    sizes = [len(json.dumps(parsed(api, stream, turns)[1].chat["messages"])) for turns in (1, 2, 3)]
    assert sizes[0] > scale.SYSTEM_KB * 1000 and sizes[2] - sizes[1] > scale.TOOL_RESULT_KB * 1000


def test_plain_mitmproxy_gets_the_same_turn_as_openai_chat_of_the_same_size() -> None:
    system, sent = scale.conversation(3, 4)
    native = scale.raw_request("anthropic_messages", True, scale.body_for("anthropic_messages", True, system, sent), plain_chat=False)[1]
    host, plain = scale.raw_request("anthropic_messages", True, scale.body_for("openai_chat", True, system, sent), plain_chat=True)
    assert host == "api.openai.com" and plain.startswith(b"POST /v1/chat/completions ")
    assert abs(len(plain) - len(native)) < 0.1 * len(native)
