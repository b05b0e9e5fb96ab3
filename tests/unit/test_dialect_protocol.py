"""Every registered dialect satisfies the `Dialect` protocol, and its pure logic holds without an engine:
a provider request parses into the engine's chat form; a fixed Completion renders into a body and a stream
that the provider's official SDK models accept; and the dialect's own parse_reply reads back what it rendered
(the content view's path). No engine, gateway or network: these run anywhere."""

from __future__ import annotations

import inspect
import json
from typing import Any

import anthropic
import openai
import pytest
from google.genai import errors as genai_errors
from google.genai import types as genai_types
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import (
    InputTokenCountResponse,
    Response,
    ResponseStreamEvent,
)
from pydantic import TypeAdapter

from polar_mitm import dialects
from polar_mitm.dialects import CountsTokens, Dialect, Reply, read_reply
from polar_mitm.dialects.common import sse_events
from polar_mitm.errors import ConfigError
from polar_mitm.exchange import DialectError, Notes
from tests.support.dialect_samples import COMPLETION, REQUESTS, SHELL, parsed_request

# what each parse must note: (ignored, normalizations)
NOTES = {
    "openai_chat": (["metadata"], ["messages[0]: developer -> system"]),
    "openai_responses": ([], ["instructions -> system message", "include 'reasoning.encrypted_content': rendered from the engine's answer"]),
    "anthropic_messages": (["thinking.budget_tokens"], ["thinking.type enabled -> chat_template_kwargs.enable_thinking=True"]),
    "gemini": ([], ["generationConfig.thinkingConfig -> chat_template_kwargs.enable_thinking=True"]),
}
MODELS = {"openai_chat": "gpt-4o", "openai_responses": "gpt-5", "anthropic_messages": "claude-x", "gemini": "gemini-2.5-flash"}
# each provider's word for "the turn ended to call a tool"
TOOL_FINISH = {"openai_chat": "tool_calls", "openai_responses": "completed", "anthropic_messages": "tool_use", "gemini": "STOP"}

# -- the registry and the protocol
def test_the_registry_holds_the_four_apis_each_satisfying_the_protocol() -> None:
    assert list(dialects.DIALECTS) == ["openai_chat", "openai_responses", "anthropic_messages", "gemini"]
    for name in dialects.DIALECTS:
        dialect = dialects.get(name)
        assert isinstance(dialect, Dialect), name
        assert dialect.API == name
        # the same parameter names as the protocol's, so keyword calls work on every dialect
        for method in ("recognizes", "parse", "render_body", "render_stream", "error_body", "parse_reply", "parse_reply_stream"):
            expected = [p for p in inspect.signature(getattr(Dialect, method)).parameters if p != "self"]
            assert list(inspect.signature(getattr(dialect, method)).parameters) == expected, f"{name}.{method}"
    counting = [name for name in dialects.DIALECTS if isinstance(dialects.get(name), CountsTokens)]
    assert counting == ["openai_responses", "anthropic_messages", "gemini"]


def test_an_unknown_dialect_name_is_a_config_error_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="unknown dialect 'bedrock'; valid: openai_chat, openai_responses, anthropic_messages, gemini"):
        dialects.get("bedrock")


@pytest.mark.parametrize(("method", "path", "api"), [
    ("POST", "/v1/chat/completions", "openai_chat"),
    ("POST", "/compatible-mode/v1/chat/completions", "openai_chat"),
    ("POST", "/v1/responses", "openai_responses"),
    ("POST", "/v1/responses/input_tokens", "openai_responses"),
    ("GET", "/v1/responses", None),
    ("POST", "/v1/messages", "anthropic_messages"),
    ("POST", "/v1/messages/count_tokens", "anthropic_messages"),
    ("POST", "/v1beta/models/gemini-2.5-flash:generateContent", "gemini"),
    ("POST", "/v1beta/models/gemini-2.5-flash:countTokens", "gemini"),
    ("POST", "/v1/models", None),
])
def test_dialect_for_picks_the_dialect_by_path(method: str, path: str, api: str | None) -> None:
    found = dialects.dialect_for(method, path)
    assert (found.API if found is not None else None) == api


# -- request parsing
@pytest.mark.parametrize("api", list(REQUESTS))
def test_parse_gives_the_engine_chat_form_and_notes(api: str) -> None:
    parsed = parsed_request(api)
    assert (parsed.api, parsed.model, parsed.stream, parsed.action) == (api, MODELS[api], True, "generate")
    assert parsed.chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List files"}]
    assert [tool["function"]["name"] for tool in parsed.chat["tools"]] == ["run_shell"]
    assert parsed.chat["tools"][0]["function"]["parameters"]["properties"] == SHELL["properties"]
    ignored, normalizations = NOTES[api]
    assert parsed.notes == Notes(ignored=ignored, normalizations=normalizations)
    # the stored columns read the same lists
    assert (parsed.ignored, parsed.normalizations) == (ignored, normalizations)


@pytest.mark.parametrize("api", list(REQUESTS))
def test_a_malformed_request_is_a_dialect_error_in_the_providers_shape(api: str) -> None:
    path, query, _ = REQUESTS[api]
    dialect = dialects.get(api)
    with pytest.raises(DialectError) as raised:
        dialect.parse(b"[1, 2]", path, query)
    assert raised.value.status == 400
    body = dialect.error_body(raised.value)
    assert read_reply(dialect, json.dumps(body).encode()).error == raised.value.message
    if api.startswith("openai"):
        openai.types.shared.ErrorObject.model_validate(body["error"])
    elif api == "anthropic_messages":
        anthropic.types.ErrorResponse.model_validate(body)
    else:
        error = genai_errors.APIError(400, body)
        assert (error.status, error.message) == ("INVALID_ARGUMENT", raised.value.message)


# -- rendering, checked by the official SDKs' models, and read back
def sdk_view(api: str, body: dict[str, Any]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(text, [(tool name, arguments)]) of a reply body as the provider's SDK parses it."""
    if api == "openai_chat":
        message = ChatCompletion.model_validate(body).choices[0].message
        return message.content or "", [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    if api == "openai_responses":
        response = Response.model_validate(body)
        return response.output_text, [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
    if api == "anthropic_messages":
        message = anthropic.types.Message.model_validate(body)
        return "".join(b.text for b in message.content if b.type == "text"), [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    response = genai_types.GenerateContentResponse.model_validate(body)
    parts = response.candidates[0].content.parts
    return "".join(p.text for p in parts if p.text and not p.thought), [(p.function_call.name, p.function_call.args) for p in parts if p.function_call]


def validate_stream_event(api: str, name: str | None, data: dict[str, Any]) -> None:
    if api == "openai_chat":
        ChatCompletionChunk.model_validate(data)
    elif api == "openai_responses":
        assert name == data["type"]
        TypeAdapter(ResponseStreamEvent).validate_python(data)
    elif api == "anthropic_messages":
        assert name == data["type"]
        if name != "ping":  # the SDK skips pings; they have no model
            TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python(data)
    else:
        genai_types.GenerateContentResponse.model_validate(data)


EXPECTED_CALL = ("run_shell", {"command": "ls -la"})


@pytest.mark.parametrize("api", list(REQUESTS))
def test_a_fixed_completion_renders_what_the_sdk_parses_and_reads_back(api: str) -> None:
    dialect, parsed = dialects.get(api), parsed_request(api)
    body = dialect.render_body(parsed, COMPLETION)
    assert sdk_view(api, body) == ("Listing.", [EXPECTED_CALL])

    reply = dialect.parse_reply(json.loads(json.dumps(body)))
    assert (reply.content, reply.reasoning, reply.finish_reason, reply.error) == ("Listing.", "The user wants the files.", TOOL_FINISH[api], None)
    assert [(call["name"], _arguments(call["arguments"])) for call in reply.tool_calls] == [EXPECTED_CALL]

    stream = dialect.render_stream(parsed, COMPLETION)
    events = sse_events(stream)
    assert events, stream
    for name, data in events:
        validate_stream_event(api, name, data)
    # the stream reads back as the same turn as the body (what the content view shows for either)
    assert read_reply(dialect, stream, dialect.STREAM_CONTENT_TYPE) == reply
    assert read_reply(dialect, stream) == reply  # recognized as SSE without the header too
    assert read_reply(dialect, json.dumps(body).encode(), "application/json") == reply


def _arguments(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


@pytest.mark.parametrize(("api", "path"), [
    ("openai_responses", "/v1/responses/input_tokens"),
    ("anthropic_messages", "/v1/messages/count_tokens"),
    ("gemini", "/v1beta/models/gemini-2.5-flash:countTokens"),
])
def test_token_count_replies_are_the_sdks_shape(api: str, path: str) -> None:
    dialect = dialects.get(api)
    assert isinstance(dialect, CountsTokens)
    _, _, body = REQUESTS[api]
    request = {k: v for k, v in body.items() if k not in ("stream", "max_tokens", "generationConfig", "include")}
    parsed = dialect.parse(json.dumps(request).encode(), path, {})
    assert parsed.action == "count_tokens" and not parsed.stream
    counted = dialect.render_count_tokens(parsed, count=42)
    if api == "openai_responses":
        assert InputTokenCountResponse.model_validate(counted).input_tokens == 42
    elif api == "anthropic_messages":
        assert anthropic.types.MessageTokensCount.model_validate(counted).input_tokens == 42
    else:
        assert genai_types.CountTokensResponse.model_validate(counted).total_tokens == 42


def test_read_reply_reports_an_error_body_and_a_stream_without_its_end() -> None:
    chat, responses = dialects.get("openai_chat"), dialects.get("openai_responses")
    assert read_reply(chat, b'{"error": {"message": "overloaded", "type": "server_error"}}') == Reply(error="overloaded")
    assert read_reply(chat, b'{"id": "x", "choices": []}') == Reply(error="no choices in the body")
    cut = b'event: response.created\ndata: {"type": "response.created", "response": {}}\n\n'
    assert read_reply(responses, cut) == Reply(error="the stream has no response.completed event")
