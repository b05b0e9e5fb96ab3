"""Anthropic Messages (`POST /v1/messages`, Claude Code adds `?beta=true`) and `POST /v1/messages/count_tokens`.

The engine's reasoning comes back as a `thinking` block whose `signature` seals it (reasoning.py): when the
client sends the block back, the engine sees that reasoning again, even where the client was told to omit the
thinking text (`thinking.display: "omitted"`). Claude Code's per-turn `cch=` billing line in the first system
block is passed on as it is.

Length: one wire dialect (the Messages API's request, reply and stream grammar), read top to bottom.
"""

from __future__ import annotations

import json
import re
from typing import Any

from polar_mitm.dialects import reasoning
from polar_mitm.dialects._api import Reply, error_text
from polar_mitm.dialects.common import SSEEvent, expect, load_json_object, sse
from polar_mitm.exchange import Completion, DialectError, Notes, ParsedRequest, StreamState

API = "anthropic_messages"
STREAM_CONTENT_TYPE = "text/event-stream; charset=utf-8"
REQUEST_ID_HEADER = "request-id"

# Anthropic sampling fields -> the engine's names
SAMPLING = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}
# vLLM/SGLang extensions a training setup may send on purpose (e.g. structured outputs to steer a test model)
ENGINE_EXTENSIONS = {"structured_outputs", "chat_template_kwargs", "min_p", "repetition_penalty", "seed", "min_tokens"}
CONSUMED = {"model", "messages", "system", "stream", "tools", "tool_choice", "thinking"}
THINKING_TYPES = {"enabled", "adaptive", "disabled"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
    404: "not_found_error", 407: "authentication_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}


def recognizes(method: str, path: str) -> bool:
    return method == "POST" and (path.endswith("/v1/messages") or path.endswith("/v1/messages/count_tokens"))


def _bad(message: str, param: str | None = None) -> DialectError:
    return DialectError(400, "invalid_request_error", message, param)


def parse(body: bytes, path: str = "", query: dict[str, str] | None = None) -> ParsedRequest:
    data = load_json_object(body)
    counting = path.endswith("/count_tokens")
    model = expect(data, "model", str, required=True)
    notes = Notes()
    chat: dict[str, Any] = {}
    if counting:
        # count_tokens takes no sampling fields
        consumed = CONSUMED - {"stream"}
    else:
        consumed = CONSUMED | set(SAMPLING)
        max_tokens = expect(data, "max_tokens", int, required=True)
        if max_tokens < 1:
            raise _bad("max_tokens: must be at least 1", "max_tokens")
        for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int)):
            expect(data, key, kinds)
        stops = expect(data, "stop_sequences", list)
        if stops is not None and not all(isinstance(stop, str) for stop in stops):
            raise _bad("stop_sequences: must be an array of strings", "stop_sequences")
        chat.update({engine_key: data[key] for key, engine_key in SAMPLING.items() if data.get(key) is not None})
    stream = bool(expect(data, "stream", bool)) and not counting

    thinking_display = _thinking(expect(data, "thinking", dict), chat, notes)
    tools = _tools(expect(data, "tools", list), notes)
    messages, tool_changes = _messages(expect(data, "messages", list, required=True), notes)
    system = _system(data.get("system"), notes)
    chat["messages"] = ([system] if system else []) + messages
    tools = _apply_tool_changes(tools, tool_changes)
    if tools:
        chat["tools"] = tools
    _tool_choice(expect(data, "tool_choice", dict), chat, notes)
    _continue_prefill(messages, chat, notes)

    for key in sorted(key for key in ENGINE_EXTENSIONS & data.keys() if data[key] is not None):
        if key == "chat_template_kwargs":
            # the client's own template arguments win over the thinking switch's
            chat[key] = {**chat.get(key, {}), **expect(data, key, dict)}
        else:
            chat[key] = data[key]
        notes.normalizations.append(f"{key}: engine extension passed through")
    notes.ignored = sorted(key for key in data if key not in consumed and key not in ENGINE_EXTENSIONS) + notes.ignored
    return ParsedRequest(
        api=API,
        model=model,
        stream=stream,
        chat=chat,
        notes=notes,
        render={"thinking_display": thinking_display},
        action="count_tokens" if counting else "generate",
    )


def _thinking(thinking: dict[str, Any] | None, chat: dict[str, Any], notes: Notes) -> str | None:
    """Anthropic's thinking switch -> the chat template's `enable_thinking`; absent: the engine's default."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in THINKING_TYPES:
        raise _bad(f"thinking.type: must be one of {sorted(THINKING_TYPES)}, got {kind!r}", "thinking.type")
    display = expect(thinking, "display", str, where="thinking.")
    if kind == "enabled":
        expect(thinking, "budget_tokens", int, required=True, where="thinking.")
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    notes.normalizations.append(f"thinking.type {kind} -> chat_template_kwargs.enable_thinking={kind != 'disabled'}")
    # the engine has no per-request thinking budget we rely on; the budget is recorded, not enforced
    notes.ignore_unknown(thinking, {"type", "display"}, "thinking")
    return display


def _system(system: Any, notes: Notes) -> dict[str, Any] | None:
    if system is None:
        return None
    if isinstance(system, str):
        return {"role": "system", "content": system} if system else None
    if not isinstance(system, list):
        raise _bad("system: must be a string or an array of text blocks", "system")
    parts = [_text_part(block, f"system[{index}]", notes) for index, block in enumerate(system)]
    return {"role": "system", "content": parts} if parts else None


def _block(block: Any, where: str) -> tuple[dict[str, Any], str]:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"{where}: must be a content block object with a type", where)
    return block, block["type"]


def _text_part(block: Any, where: str, notes: Notes) -> dict[str, Any]:
    block, kind = _block(block, where)
    if kind != "text":
        raise _bad(f"{where}.type: expected a text block, got {kind!r}", f"{where}.type")
    text = expect(block, "text", str, required=True, where=f"{where}.")
    notes.ignore_unknown(block, {"type", "text"}, where)
    return {"type": "text", "text": text}


def _image_part(block: dict[str, Any], where: str, notes: Notes) -> dict[str, Any]:
    source = expect(block, "source", dict, required=True, where=f"{where}.")
    kind = source.get("type")
    if kind == "base64":
        media_type = expect(source, "media_type", str, required=True, where=f"{where}.source.")
        data = expect(source, "data", str, required=True, where=f"{where}.source.")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = expect(source, "url", str, required=True, where=f"{where}.source.")
    else:
        raise _bad(f"{where}.source.type: image sources of type {kind!r} are not supported (base64 or url)", f"{where}.source.type")
    notes.ignore_unknown(block, {"type", "source"}, where)
    return {"type": "image_url", "image_url": {"url": url}}


def _content_blocks(content: Any, where: str) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or an array of content blocks", f"{where}.content")
    return content


def _messages(messages: list[Any], notes: Notes) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any], str]]]:
    if not messages:
        raise _bad("messages: at least one message is required", "messages")
    chat: list[dict[str, Any]] = []
    tool_changes: list[tuple[str, dict[str, Any], str]] = []
    # a tool_result answers a tool_use of the latest assistant turn
    open_tool_uses: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(f"{where}: must be an object", where)
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}", f"{where}.role")
        if "content" not in message:
            raise _bad(f"{where}.content: field required", f"{where}.content")
        notes.ignore_unknown(message, {"role", "content"}, where)
        if isinstance(message["content"], str) and role != "assistant":
            chat.append({"role": role, "content": message["content"]})
            continue
        blocks = _content_blocks(message["content"], where)
        if role == "system":
            chat += _system_turn(blocks, where, notes, tool_changes)
        elif role == "user":
            chat += _user_turn(blocks, where, notes, open_tool_uses)
        else:
            turn, open_tool_uses = _assistant_turn(blocks, where, notes)
            chat.append(turn)
    return chat, tool_changes


def _system_turn(blocks: list[Any], where: str, notes: Notes, tool_changes: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    """A mid-conversation system turn (Claude Code sends one); it may also add or remove tools."""
    parts = []
    for index, raw in enumerate(blocks):
        block_where = f"{where}.content[{index}]"
        block, kind = _block(raw, block_where)
        if kind in ("tool_addition", "tool_removal"):
            tool_changes.append((kind, expect(block, "tool", dict, required=True, where=f"{block_where}."), block_where))
            notes.ignore_unknown(block, {"type", "tool"}, block_where)
        else:
            parts.append(_text_part(block, block_where, notes))
    return [{"role": "system", "content": parts}] if parts else []


def _user_turn(blocks: list[Any], where: str, notes: Notes, open_tool_uses: set[str]) -> list[dict[str, Any]]:
    """Tool results become `tool` messages; the other blocks stay one user message, in order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, raw in enumerate(blocks):
        block_where = f"{where}.content[{index}]"
        block, kind = _block(raw, block_where)
        if kind == "text":
            parts.append(_text_part(block, block_where, notes))
        elif kind == "image":
            parts.append(_image_part(block, block_where, notes))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, block_where, notes, open_tool_uses))
        else:
            raise _unsupported(kind, block_where, "user")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _tool_result(block: dict[str, Any], where: str, notes: Notes, open_tool_uses: set[str]) -> dict[str, Any]:
    tool_use_id = expect(block, "tool_use_id", str, required=True, where=f"{where}.")
    if tool_use_id not in open_tool_uses:
        raise _bad(
            f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {tool_use_id}. "
            "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
            f"{where}.tool_use_id",
        )
    if expect(block, "is_error", bool, where=f"{where}."):
        # chat messages have no error flag; the text says what went wrong
        notes.ignored.append(f"{where}.is_error")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = [_tool_result_part(item, f"{where}.content[{index}]", notes) for index, item in enumerate(content)]
    elif not isinstance(content, str):
        raise _bad(f"{where}.content: must be a string or an array of content blocks", f"{where}.content")
    notes.ignore_unknown(block, {"type", "tool_use_id", "content", "is_error"}, where)
    return {"role": "tool", "tool_call_id": tool_use_id, "content": content}


def _tool_result_part(raw: Any, where: str, notes: Notes) -> dict[str, Any]:
    block, kind = _block(raw, where)
    if kind == "text":
        return _text_part(block, where, notes)
    if kind == "image":
        return _image_part(block, where, notes)
    if kind == "tool_reference":
        # a tool search result loading a deferred tool; vLLM hands it to the chat template as it is
        name = expect(block, "tool_name", str, required=True, where=f"{where}.")
        notes.ignore_unknown(block, {"type", "tool_name"}, where)
        return {"type": "tool_reference", "name": name}
    raise _unsupported(kind, where, "tool_result")


def _assistant_turn(blocks: list[Any], where: str, notes: Notes) -> tuple[dict[str, Any], set[str]]:
    texts: list[str] = []
    reasonings: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for index, raw in enumerate(blocks):
        block_where = f"{where}.content[{index}]"
        block, kind = _block(raw, block_where)
        if kind == "text":
            texts.append(_text_part(block, block_where, notes)["text"])
        elif kind == "thinking":
            reasonings.append(_reasoning_of(block, block_where, notes))
        elif kind == "redacted_thinking":
            expect(block, "data", str, required=True, where=f"{block_where}.")
            # a real provider's encrypted reasoning: nothing the engine can read
            notes.ignored.append(block_where)
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block, block_where, notes))
        else:
            raise _unsupported(kind, block_where, "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": texts[0] if len(texts) == 1 else [{"type": "text", "text": text} for text in texts]}
    if reasonings:
        # reasoning_content: the name SGLang reads (vLLM reads it too), as the other dialects send it
        turn["reasoning_content"] = "\n".join(reasonings)
    if tool_calls:
        turn["tool_calls"] = tool_calls
    return turn, {call["id"] for call in tool_calls}


def _reasoning_of(block: dict[str, Any], where: str, notes: Notes) -> str:
    text = expect(block, "thinking", str, required=True, where=f"{where}.")
    signature = expect(block, "signature", str, where=f"{where}.")
    notes.ignore_unknown(block, {"type", "thinking", "signature"}, where)
    sealed = reasoning.unseal(signature)
    if sealed is not None:
        if sealed != text:
            notes.normalizations.append(f"{where}: reasoning restored from the thinking signature")
        return sealed
    if signature:
        notes.normalizations.append(f"{where}: signature not issued by polar-mitm; reasoning taken from the thinking text")
    return text


def _tool_call(block: dict[str, Any], where: str, notes: Notes) -> dict[str, Any]:
    call_id = expect(block, "id", str, required=True, where=f"{where}.")
    name = expect(block, "name", str, required=True, where=f"{where}.")
    arguments = expect(block, "input", dict, required=True, where=f"{where}.")
    notes.ignore_unknown(block, {"type", "id", "name", "input"}, where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _unsupported(kind: str, where: str, container: str) -> DialectError:
    return _bad(f"{where}.type: content blocks of type {kind!r} are not supported in {container} content by polar-mitm", f"{where}.type")


def _tools(tools: list[Any] | None, notes: Notes) -> list[dict[str, Any]]:
    out = []
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where}: must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                raise _bad(f"{where}.type: must be a string", f"{where}.type")
            # Anthropic-hosted tools (web search, code execution, ...) have no engine equivalent
            notes.ignored.append(f"{where} ({kind})")
            continue
        out.append(_function_tool(tool, where, notes))
    return out


def _function_tool(tool: dict[str, Any], where: str, notes: Notes) -> dict[str, Any]:
    function: dict[str, Any] = {"name": expect(tool, "name", str, required=True, where=f"{where}.")}
    if (description := expect(tool, "description", str, where=f"{where}.")) is not None:
        function["description"] = description
    function["parameters"] = expect(tool, "input_schema", dict, required=True, where=f"{where}.")
    for key in ("strict", "defer_loading"):
        # vLLM passes a deferred tool to the chat template as such; a tool_reference loads it
        if (value := expect(tool, key, bool, where=f"{where}.")) is not None:
            function[key] = value
    notes.ignore_unknown(tool, {"type", "name", "description", "input_schema", "strict", "defer_loading"}, where)
    return {"type": "function", "function": function}


def _apply_tool_changes(tools: list[dict[str, Any]], changes: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    """Mid-conversation tool changes: the engine's chat template sees one tool list, the one in effect at the end."""
    by_name = {tool["function"]["name"]: tool for tool in tools}
    for kind, change, where in changes:
        if change.get("type") == "tool_definition" and kind == "tool_addition":
            tool = _function_tool(expect(change, "definition", dict, required=True, where=f"{where}.tool."), f"{where}.tool.definition", Notes())
            by_name[tool["function"]["name"]] = tool
        elif change.get("type") == "tool_reference":
            name = expect(change, "name", str, required=True, where=f"{where}.tool.")
            if name not in by_name:
                raise _bad(f"{where}: {kind} references tool {name!r}, which is not declared in tools", f"{where}.tool.name")
            if kind == "tool_removal":
                del by_name[name]
            else:
                function = {k: v for k, v in by_name[name]["function"].items() if k != "defer_loading"}
                by_name[name] = {"type": "function", "function": function}
        else:
            raise _bad(f"{where}.tool.type: {kind} takes a tool_reference{' or a tool_definition' if kind == 'tool_addition' else ''}", f"{where}.tool.type")
    return list(by_name.values())


def _tool_choice(choice: dict[str, Any] | None, chat: dict[str, Any], notes: Notes) -> None:
    if choice is None:
        return
    kind = choice.get("type")
    if kind == "tool":
        name = expect(choice, "name", str, required=True, where="tool_choice.")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif isinstance(kind, str) and kind in TOOL_CHOICES:
        chat["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise _bad(f"tool_choice.type: must be one of auto, any, tool, none; got {kind!r}", "tool_choice.type")
    if kind in ("any", "tool"):
        # forced tool choice is passed on; small engines may not honour it (guided decoding of the call)
        notes.normalizations.append(f"tool_choice {kind} -> {json.dumps(chat['tool_choice'])}")
    if expect(choice, "disable_parallel_tool_use", bool, where="tool_choice."):
        chat["parallel_tool_calls"] = False
    notes.ignore_unknown(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")


def _continue_prefill(messages: list[dict[str, Any]], chat: dict[str, Any], notes: Notes) -> None:
    """A final assistant turn is a prefill: Anthropic continues it, and so does the engine."""
    last = messages[-1] if messages else None
    if last and last["role"] == "assistant" and "tool_calls" not in last:
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
        notes.normalizations.append("final assistant turn: the engine continues it (continue_final_message)")


# -- rendering


def render_body(parsed: ParsedRequest, completion: Completion) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop_reason(completion)
    return {
        "id": "msg_" + _id_suffix(completion.id, "chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": parsed.model,
        "content": _content(parsed, completion),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(completion, completion.completion_tokens),
    }


def _usage(completion: Completion, output_tokens: int) -> dict[str, int]:
    # the engine serves no prompt cache accounting to report
    return {"input_tokens": completion.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": output_tokens}


def _id_suffix(engine_id: str, prefix: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "", engine_id.removeprefix(prefix))


def _content(parsed: ParsedRequest, completion: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if completion.reasoning:
        shown = "" if parsed.render.get("thinking_display") == "omitted" else completion.reasoning
        blocks.append({"type": "thinking", "thinking": shown, "signature": reasoning.seal(completion.reasoning)})
    if completion.content:
        blocks.append({"type": "text", "text": completion.content})
    for call in completion.tool_calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + _id_suffix(call.id, "chatcmpl-tool-"), "name": call.name, "input": _tool_input(call.arguments)})
    return blocks


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    # Anthropic's input is always an object; anything else is kept whole (the row has the engine's original)
    return value if isinstance(value, dict) else {"_arguments": arguments}


def _stop_reason(completion: Completion) -> tuple[str, str | None]:
    if completion.finish_reason == "length":
        return "max_tokens", None
    if completion.tool_calls:
        return "tool_use", None
    if completion.stop_sequence is not None:
        return "stop_sequence", completion.stop_sequence
    if completion.finish_reason == "content_filter":
        return "refusal", None
    return "end_turn", None


def stream_opening(parsed: ParsedRequest, state: StreamState) -> bytes:
    """message_start. The prompt's token count is not known before the engine answers: 0 here, the real count in
    message_delta's usage (the SDKs take input_tokens from there too)."""
    message = {
        "id": "msg_" + _id_suffix(state.id, "chatcmpl-"), "type": "message", "role": "assistant", "model": parsed.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0},
    }
    return sse("message_start", {"type": "message_start", "message": message})


def stream_keepalive(parsed: ParsedRequest, state: StreamState) -> bytes:
    """Anthropic's own keepalive; its SDKs drop pings before anyone sees them."""
    return _PING


def stream_body(parsed: ParsedRequest, state: StreamState, completion: Completion) -> bytes:
    """Everything after message_start; each block arrives whole in one delta (two for a thinking block)."""
    message = render_body(parsed, completion)
    events = []
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "thinking":
            opening: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = ([{"type": "thinking_delta", "thinking": block["thinking"]}] if block["thinking"] else []) + [{"type": "signature_delta", "signature": block["signature"]}]
        elif kind == "text":
            opening, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
        else:
            opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        events.append(sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening}))
        if index == 0:
            events.append(_PING)
        events += [sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}) for delta in deltas]
        events.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    if not message["content"]:
        events.append(_PING)
    events.append(
        sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}, "usage": message["usage"]})
    )
    events.append(sse("message_stop", {"type": "message_stop"}))
    return b"".join(events)


def stream_error(parsed: ParsedRequest, state: StreamState, error: DialectError) -> bytes:
    """Anthropic's mid-stream failure: an `error` event with the error body (the SDKs raise from it)."""
    return sse("error", error_body(error))


def render_stream(parsed: ParsedRequest, completion: Completion) -> bytes:
    state = StreamState.of(completion)
    return stream_opening(parsed, state) + stream_body(parsed, state, completion)


_PING = sse("ping", '{"type": "ping"}')


def render_count_tokens(parsed: ParsedRequest, count: int) -> dict[str, Any]:
    return {"input_tokens": count}


def error_body(error: DialectError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    if error.kind == "context_length_exceeded" and error.max_context:
        # Anthropic's wording, which Claude Code matches to offer compaction
        return {"type": "error", "error": {"type": kind, "message": f"prompt is too long: {error.prompt_tokens} tokens > {error.max_context} maximum"}}
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def parse_reply(body: dict[str, Any]) -> Reply:
    reply = Reply(finish_reason=body.get("stop_reason"))
    for block in body.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            reply.content += block.get("text", "")
        elif kind == "thinking":
            reply.reasoning += block.get("thinking", "")
        elif kind == "tool_use":
            reply.tool_calls.append({"id": block.get("id"), "name": block.get("name"), "arguments": block.get("input")})
    return reply


def parse_reply_stream(events: list[SSEEvent]) -> Reply:
    blocks: dict[int, dict[str, Any]] = {}
    finish = None
    for _, data in events:
        kind = data.get("type")
        if kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            block["partial_json"] = ""
            blocks[data.get("index", 0)] = block
        elif kind == "content_block_delta":
            block, delta = blocks.setdefault(data.get("index", 0), {"type": "text", "partial_json": ""}), data.get("delta") or {}
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif delta.get("type") == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif delta.get("type") == "input_json_delta":
                block["partial_json"] += delta.get("partial_json", "")
        elif kind == "message_delta":
            finish = (data.get("delta") or {}).get("stop_reason") or finish
        elif kind == "error":
            return Reply(error=error_text(data))
    for block in blocks.values():
        if block.get("type") == "tool_use" and block["partial_json"]:
            block["input"] = json.loads(block["partial_json"])
    return parse_reply({"content": [blocks[i] for i in sorted(blocks)], "stop_reason": finish})
