"""OpenAI Chat Completions (`POST /v1/chat/completions`), also Qwen Code's DashScope-compatible path."""

from __future__ import annotations

from typing import Any

from polar_mitm.dialects._api import Reply
from polar_mitm.dialects.common import SSEEvent, expect, load_json_object, sse
from polar_mitm.exchange import Completion, DialectError, Notes, ParsedRequest, StreamState

API = "openai_chat"
STREAM_CONTENT_TYPE = "text/event-stream; charset=utf-8"
REQUEST_ID_HEADER = "x-request-id"

# fields the engine understands as they are
PASSTHROUGH = {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "presence_penalty", "frequency_penalty", "response_format",
    "logit_bias", "reasoning_effort", "top_logprobs",
    # vLLM/SGLang extensions a training setup may send on purpose
    "structured_outputs", "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "stop_token_ids", "ignore_eos",
}
# fields consumed by the gateway itself
CONSUMED = {"model", "stream", "stream_options", "logprobs", "n"}
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def recognizes(method: str, path: str) -> bool:
    return method == "POST" and path.endswith("/chat/completions")


def parse(body: bytes, path: str = "", query: dict[str, str] | None = None) -> ParsedRequest:
    data = load_json_object(body)
    model = expect(data, "model", str, required=True)
    stream = bool(expect(data, "stream", bool))
    messages = expect(data, "messages", list, required=True)
    if not messages:
        raise DialectError(400, "invalid_request_error", "'messages' must contain at least one message", "messages")
    n = expect(data, "n", int)
    if n not in (None, 1):
        raise DialectError(400, "invalid_request_error", f"n={n} is not supported: the gateway records exactly one sample per exchange", "n")
    for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("max_tokens", int), ("max_completion_tokens", int), ("seed", int), ("top_logprobs", int)):
        expect(data, key, kinds)
    stream_options = expect(data, "stream_options", dict) or {}
    tools = expect(data, "tools", list)
    notes = Notes()
    chat_messages = [_check_message(m, i, notes) for i, m in enumerate(messages)]
    for index, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
            raise DialectError(400, "invalid_request_error", f"tools[{index}] must be a function tool with a name", f"tools[{index}]")

    chat = {key: data[key] for key in PASSTHROUGH if key in data and data[key] is not None}
    chat["messages"] = chat_messages
    notes.ignored = sorted(key for key in data if key not in PASSTHROUGH and key not in CONSUMED)
    return ParsedRequest(
        api=API,
        model=model,
        stream=stream,
        chat=chat,
        notes=notes,
        render={"include_usage": bool(stream_options.get("include_usage")), "logprobs": bool(data.get("logprobs"))},
    )


def _check_message(message: Any, index: int, notes: Notes) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise DialectError(400, "invalid_request_error", f"'{where}' must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or an object is unhashable: no set lookup for it
        raise DialectError(400, "invalid_request_error", f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise DialectError(400, "invalid_request_error", f"'{where}.content' must be a string or an array of content parts", f"{where}.content")
    if isinstance(content, list):
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise DialectError(400, "invalid_request_error", f"'{where}.content[{part_index}]' must be a content part with a type", f"{where}.content[{part_index}]")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise DialectError(400, "invalid_request_error", f"'{where}.tool_call_id' is required for tool messages", f"{where}.tool_call_id")
    out = dict(message)
    if role == "developer":
        # chat templates know system, not developer
        out["role"] = "system"
        notes.normalize(f"{where}: developer -> system")
    return out


def render_body(parsed: ParsedRequest, completion: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    if completion.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in completion.tool_calls
        ]
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": completion.finish_reason, "logprobs": None}
    if parsed.render.get("logprobs"):
        choice["logprobs"] = {"content": completion.logprobs_content}
    return {
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": parsed.model,
        "choices": [choice],
        "usage": _usage(completion),
    }


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def _chunk(parsed: ParsedRequest, state: StreamState, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> bytes:
    event: dict[str, Any] = {
        "id": state.id,
        "object": "chat.completion.chunk",
        "created": state.created,
        "model": parsed.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if parsed.render.get("include_usage"):
        event["usage"] = None
    return sse(None, event)


def stream_opening(parsed: ParsedRequest, state: StreamState) -> bytes:
    """The assistant's role, as OpenAI's first chunk carries it."""
    return _chunk(parsed, state, {"role": "assistant", "content": ""})


def stream_keepalive(parsed: ParsedRequest, state: StreamState) -> bytes:
    """A chunk with an empty delta: a real event for SDKs whose idle timers skip SSE comments (Qwen Code's
    watchdog counts SDK chunks), and nothing to add for anyone assembling deltas."""
    return _chunk(parsed, state, {})


def stream_body(parsed: ParsedRequest, state: StreamState, completion: Completion) -> bytes:
    """Everything after the opening: the deltas, the finish chunk, the usage chunk if asked for, [DONE]."""
    parts = []
    if completion.reasoning:
        parts.append(_chunk(parsed, state, {"reasoning_content": completion.reasoning}))
    if completion.content:
        logprobs = {"content": completion.logprobs_content} if parsed.render.get("logprobs") else None
        parts.append(_chunk(parsed, state, {"content": completion.content}, logprobs=logprobs))
    # each call whole in one delta, as vLLM and Mistral's API send them: clients that accumulate deltas (the OpenAI
    # SDKs) take it as they take split ones, and Mistral's SDK (Mistral Vibe) requires the name in every tool delta
    for index, call in enumerate(completion.tool_calls):
        parts.append(_chunk(parsed, state, {"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}))
    parts.append(_chunk(parsed, state, {}, finish_reason=completion.finish_reason))
    if parsed.render.get("include_usage"):
        parts.append(sse(None, {"id": state.id, "object": "chat.completion.chunk", "created": state.created, "model": parsed.model, "choices": [], "usage": _usage(completion)}))
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


def stream_error(parsed: ParsedRequest, state: StreamState, error: DialectError) -> bytes:
    """OpenAI's mid-stream failure: a data line holding an `error` object, and no [DONE] (the SDK raises APIError)."""
    return sse(None, error_body(error))


def render_stream(parsed: ParsedRequest, completion: Completion) -> bytes:
    state = StreamState.of(completion)
    return stream_opening(parsed, state) + stream_body(parsed, state, completion)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 407: "authentication_error", 429: "rate_limit_error"}


def error_body(error: DialectError) -> dict[str, Any]:
    code = error.kind if error.kind not in ERROR_TYPES.values() else None
    kind = ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    if error.kind == "context_length_exceeded" and error.max_context:
        # OpenAI's own wording and code; clients (and harnesses that compact) key on code context_length_exceeded
        message = (
            f"This model's maximum context length is {error.max_context} tokens. However, your messages resulted in "
            f"{error.prompt_tokens} tokens. Please reduce the length of the messages."
        )
        return {"error": {"message": message, "type": kind, "param": "messages", "code": code}}
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def parse_reply(body: dict[str, Any]) -> Reply:
    if not body.get("choices"):
        return Reply(error="no choices in the body")
    choice = body["choices"][0]
    message = choice.get("message") or {}
    calls = [{"id": c.get("id"), "name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")} for c in message.get("tool_calls") or []]
    return Reply(message.get("content") or "", message.get("reasoning_content") or message.get("reasoning") or "", calls, choice.get("finish_reason"))


def parse_reply_stream(events: list[SSEEvent]) -> Reply:
    reply = Reply()
    calls: dict[int, dict[str, Any]] = {}  # by the stream's tool call index
    for _, chunk in events:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reply.content += delta.get("content") or ""
            reply.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += (call.get("function") or {}).get("name") or ""
                slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    reply.tool_calls = [calls[i] for i in sorted(calls)]
    return reply
