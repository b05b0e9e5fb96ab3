"""OpenAI Responses (`POST /v1/responses`, `/v1/responses/input_tokens`): the only API Codex CLI speaks.

Request: `instructions` and the input items become one chat-completions conversation. Codex's tool shapes
(namespaces, freeform `custom` tools, `local_shell`, client-side `tool_search`, the responses-lite
`additional_tools` input item) become chat function tools; a call to one is rendered back as the item type the
client declared. Reply: a Response object, or its SSE event stream (`event:` lines, increasing
`sequence_number`). The engine's reasoning travels sealed in a reasoning item's `encrypted_content`, so the next
turn restores it exactly.

Length: one wire dialect (the Responses API's request, reply and SSE event grammar), read top to bottom.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.dialects import openai_chat
from polar_mitm.dialects import reasoning as reasoning_carrier
from polar_mitm.dialects._api import Reply
from polar_mitm.dialects.common import SSEEvent, expect, load_json_object, sse
from polar_mitm.exchange import Completion, DialectError, Notes, ParsedRequest, StreamState

API = "openai_responses"
STREAM_CONTENT_TYPE = "text/event-stream; charset=utf-8"
REQUEST_ID_HEADER = "x-request-id"

# Responses name -> chat-completions name, same meaning
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens", "top_logprobs": "top_logprobs", "parallel_tool_calls": "parallel_tool_calls"}
# vLLM/SGLang extensions (not Responses API fields) a training setup sends on purpose, e.g. structured outputs
ENGINE_EXTENSIONS = {
    "structured_outputs", "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "min_tokens", "skip_special_tokens",
    "include_stop_str_in_output", "stop_token_ids", "ignore_eos", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
}
CONSUMED = {"model", "stream", "input", "instructions", "tools", "tool_choice", "reasoning", "text", "include"} | set(SAMPLING) | ENGINE_EXTENSIONS
# fields that need response state kept server-side; polar-mitm keeps none
STATEFUL = {"previous_response_id": "a stored response", "conversation": "a stored conversation", "prompt": "a stored prompt template"}
HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search", "image_generation", "code_interpreter", "computer_use_preview", "computer", "mcp", "shell", "apply_patch"}
INCLUDES = {"reasoning.encrypted_content": "encrypted", "message.output_text.logprobs": "logprobs"}
DEFAULT_NAMESPACE = "functions"
FREEFORM_ARGUMENT = "input"
LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "The command and its arguments (argv)."},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "user": {"type": "string"},
    },
    "required": ["command"],
}


def recognizes(method: str, path: str) -> bool:
    # GET /v1/responses is Codex's WebSocket attempt: not ours, it falls back to POST after a 404
    return method == "POST" and (path.endswith("/responses") or path.endswith("/responses/input_tokens"))


def _bad(message: str, param: str | None = None, kind: str = "invalid_request_error") -> DialectError:
    return DialectError(400, kind, message, param)


@dataclass
class _Translation:
    """What parsing accumulates: the chat conversation, its tools, and what was changed or left out on the way."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    # chat tool name -> how a call to it is rendered back:
    # kind (function/custom/local_shell/tool_search), name, namespace
    tool_kinds: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: Notes = field(default_factory=Notes)
    call_ids: set[str] = field(default_factory=set)
    # the assistant message that reasoning, text and calls of the current assistant turn are added to
    open_assistant: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def ignore(self, path: str, why: str | None = None) -> None:
        if path not in self.notes.ignored:
            self.notes.ignore(path)
        if why:
            self.note(f"{path}: {why}")

    def note(self, text: str) -> None:
        if text not in self.notes.normalizations:
            self.notes.normalize(text)

    def ignore_unknown(self, data: dict[str, Any], known: set[str], where: str) -> None:
        for key in data:
            if key not in known:
                self.ignore(f"{where}.{key}")


def parse(body: bytes, path: str = "", query: dict[str, str] | None = None) -> ParsedRequest:
    data = load_json_object(body)
    model = expect(data, "model", str, required=True)
    stream = bool(expect(data, "stream", bool))
    for key, why in STATEFUL.items():
        if data.get(key) is not None:
            raise _bad(f"'{key}' refers to {why}; polar-mitm keeps no response state: send the whole conversation in 'input' (store: false)", key)
    if data.get("background") is True:
        raise _bad("background responses are not supported: polar-mitm answers each request directly", "background")
    instructions = expect(data, "instructions", str)
    raw_input = data.get("input")
    if raw_input is None:
        raise _bad("missing required parameter 'input'", "input")
    if not isinstance(raw_input, (str, list)):
        raise _bad(f"'input' must be a string or an array of input items, not {type(raw_input).__name__}", "input")
    for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("max_output_tokens", int), ("top_logprobs", int), ("parallel_tool_calls", bool)):
        expect(data, key, kinds)
    tools = expect(data, "tools", list) or []
    include = expect(data, "include", list) or []
    reasoning = expect(data, "reasoning", dict) or {}
    text = expect(data, "text", dict) or {}

    t = _Translation()
    if instructions:
        t.messages.append({"role": "system", "content": instructions})
        t.note("instructions -> system message")
    for index, tool in enumerate(tools):
        _add_tool(tool, f"tools[{index}]", t)
    if isinstance(raw_input, str):
        t.messages.append({"role": "user", "content": raw_input})
    else:
        for index, item in enumerate(raw_input):
            _add_item(item, index, t)
    for message in t.messages:
        if message["role"] == "assistant" and message.get("content") is None and not message.get("tool_calls"):
            message["content"] = ""
    if not t.messages:
        raise _bad("'input' must contain at least one item", "input")

    chat: dict[str, Any] = {"messages": t.messages}
    for source, target in SAMPLING.items():
        if data.get(source) is not None:
            chat[target] = data[source]
    extensions = sorted(key for key in ENGINE_EXTENSIONS if data.get(key) is not None)
    for key in extensions:
        chat[key] = data[key]
        t.note(f"{key}: engine extension, passed through to the engine")
    if t.tools:
        chat["tools"] = t.tools
    tool_choice = _tool_choice(data.get("tool_choice"), t, chat)
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    # a configuration_update input item changes the effort from its position on: the last one holds for this answer
    effort = _reasoning(reasoning, t)
    if t.reasoning_effort is not None:
        effort = t.reasoning_effort
    if effort is not None:
        chat["reasoning_effort"] = effort
    response_format = _text_format(text, t)
    if response_format is not None:
        chat["response_format"] = response_format
    wanted = _includes(include, t)
    summary = reasoning.get("summary") or reasoning.get("generate_summary")
    if summary:
        t.note(f"reasoning.summary {summary!r}: the engine's reasoning is returned as the summary")

    for key in data:
        if key not in CONSUMED:
            t.ignore(key)
    render = {
        "tool_kinds": t.tool_kinds,
        "encrypted": "encrypted" in wanted,
        "logprobs": "logprobs" in wanted,
        "summary": bool(summary),
        "echo": _echo(data, tools, text, {"effort": effort, "summary": summary or None}),
    }
    return ParsedRequest(
        api=API,
        model=model,
        stream=stream,
        chat=chat,
        notes=t.notes,
        render=render,
        action="count_tokens" if path.endswith("/input_tokens") else "generate",
    )


def _echo(data: dict[str, Any], tools: list[Any], text: dict[str, Any], reasoning: dict[str, Any]) -> dict[str, Any]:
    """The request settings a Response object repeats back to the client."""
    return {
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data["metadata"] if isinstance(data.get("metadata"), dict) else {},
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "prompt_cache_key": data["prompt_cache_key"] if isinstance(data.get("prompt_cache_key"), str) else None,
        "reasoning": reasoning,
        "store": data.get("store", True) is not False,
        "temperature": data.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}, **({"verbosity": text["verbosity"]} if "verbosity" in text else {})},
        "tool_choice": data.get("tool_choice") or "auto",
        "tools": tools,
        "top_logprobs": data.get("top_logprobs"),
        "top_p": data.get("top_p"),
    }


# -- tools
def _add_tool(tool: Any, where: str, t: _Translation, namespace: str | None = None, loaded: bool = False) -> None:
    """One declared tool -> chat function tool(s); `loaded`: it comes from a tool_search output, deferred or not."""
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise _bad(f"'{where}' must be a tool object with a type", where)
    kind = tool["type"]
    if kind == "namespace":
        name = _required_str(tool, "name", where)
        inner = tool.get("tools")
        if not isinstance(inner, list):
            raise _bad(f"'{where}.tools' must be an array of tools", f"{where}.tools")
        if name == DEFAULT_NAMESPACE:
            t.note(f"{where}: namespace {name!r} is the default namespace; its tools keep their plain names")
        else:
            t.note(f"{where}: tools of namespace {name!r} are offered as '{name}__<tool>' and called back with namespace {name!r}")
        if tool.get("description"):
            t.ignore(f"{where}.description", "chat tools have no namespace description")
        t.ignore_unknown(tool, {"type", "name", "tools", "description"}, where)
        for index, member in enumerate(inner):
            _add_tool(member, f"{where}.tools[{index}]", t, namespace=name, loaded=loaded)
        return
    if kind == "function":
        name = _required_str(tool, "name", where)
        if tool.get("defer_loading") and not loaded:
            t.ignore(where, f"function {name!r} is deferred (defer_loading): offered only once a tool_search output loads it")
            return
        function: dict[str, Any] = {"name": _chat_tool_name(namespace, name)}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        t.ignore_unknown(tool, {"type", "name", "description", "parameters", "strict", "defer_loading"}, where)
        _offer(function, {"kind": "function", "name": name, "namespace": namespace}, where, t, loaded)
    elif kind == "custom":
        name = _required_str(tool, "name", where)
        function = {"name": _chat_tool_name(namespace, name), "parameters": _freeform_parameters(tool.get("format"), where)}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        t.note(f"{where}: freeform tool {name!r} -> function with one string argument '{FREEFORM_ARGUMENT}'")
        t.ignore_unknown(tool, {"type", "name", "description", "format", "defer_loading"}, where)
        _offer(function, {"kind": "custom", "name": name, "namespace": namespace}, where, t, loaded)
    elif kind == "local_shell":
        function = {"name": "local_shell", "description": "Run a command on the user's machine.", "parameters": LOCAL_SHELL_PARAMETERS}
        t.note(f"{where}: local_shell -> function 'local_shell' taking the exec action's fields")
        t.ignore_unknown(tool, {"type"}, where)
        _offer(function, {"kind": "local_shell", "name": "local_shell", "namespace": None}, where, t, loaded)
    elif kind == "tool_search" and tool.get("execution", "client") == "client":
        function = {"name": "tool_search", "parameters": tool.get("parameters") or {"type": "object", "properties": {"query": {"type": "string"}}}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        t.note(f"{where}: client tool_search -> function 'tool_search'; its outputs' tools are offered to the engine")
        t.ignore_unknown(tool, {"type", "execution", "description", "parameters"}, where)
        _offer(function, {"kind": "tool_search", "name": "tool_search", "namespace": None}, where, t, loaded)
    elif kind in HOSTED_TOOLS or kind == "tool_search":
        t.ignore(where, f"{kind} is a tool the provider runs itself; the engine cannot, so it is not offered")
    else:
        t.ignore(where, f"unknown tool type {kind!r}, not offered")


def _required_str(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    return value


def _chat_tool_name(namespace: str | None, name: str) -> str:
    # Codex's own Responses->Chat adapter names namespaced tools the same way
    return name if namespace in (None, DEFAULT_NAMESPACE) else f"{namespace}__{name}"


def _freeform_parameters(fmt: Any, where: str) -> dict[str, Any]:
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        description = f"Freeform input in this {fmt.get('syntax', '')} grammar:\n{fmt.get('definition', '')}"
    elif fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text":
        description = "Freeform text input."
    else:
        raise _bad(f"'{where}.format' must be a text or grammar format", f"{where}.format")
    return {"type": "object", "properties": {FREEFORM_ARGUMENT: {"type": "string", "description": description}}, "required": [FREEFORM_ARGUMENT]}


def _offer(function: dict[str, Any], kind: dict[str, Any], where: str, t: _Translation, loaded: bool) -> None:
    name = function["name"]
    if name in t.tool_kinds:
        if not loaded:
            raise _bad(f"duplicate tool name {name!r} ({where})", where)
        t.note(f"{where}: {name!r} is already offered; the first definition is kept")
        return
    t.tool_kinds[name] = kind
    t.tools.append({"type": "function", "function": function})


def _tool_choice(choice: Any, t: _Translation, chat: dict[str, Any]) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise _bad("'tool_choice' must be 'auto', 'none', 'required' or a tool choice object", "tool_choice")
    kind = choice["type"]
    if kind in ("function", "custom"):
        name = _required_str(choice, "name", "tool_choice")
        chat_name = _chat_tool_name(choice.get("namespace"), name)
        if t.tool_kinds.get(chat_name, {}).get("kind") != kind:
            raise _bad(f"tool_choice names {kind} tool {name!r}, which is not among the tools", "tool_choice")
        return {"type": "function", "function": {"name": chat_name}}
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        allowed = choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise _bad("'tool_choice' allowed_tools needs mode 'auto' or 'required' and a tools array", "tool_choice")
        names = {_chat_tool_name(a.get("namespace"), a.get("name", "")) for a in allowed if isinstance(a, dict)}
        t.tools[:] = [tool for tool in t.tools if tool["function"]["name"] in names]
        if not t.tools:
            chat.pop("tools", None)
        t.note("tool_choice allowed_tools: only the allowed tools are offered to the engine")
        return mode
    raise _bad(f"tool_choice {kind!r} names a tool the engine cannot run", "tool_choice")


# -- input items
ASSISTANT_SIDE = {"reasoning", "function_call", "custom_tool_call", "local_shell_call", "tool_search_call"}
TOOL_OUTPUTS = {"function_call_output", "custom_tool_call_output", "local_shell_call_output", "tool_search_output"}
ROLES = ("user", "assistant", "system", "developer")
SKIPPED_ITEMS = {
    "web_search_call": "a provider-run web search; the engine never made it",
    "image_generation_call": "a provider-run image generation",
    "file_search_call": "a provider-run file search",
    "code_interpreter_call": "a provider-run code interpreter call",
    "compaction": "an opaque provider compaction",
    "compaction_summary": "an opaque provider compaction",
    "context_compaction": "an opaque provider compaction",
    "compaction_trigger": "a provider compaction control",
}


def _add_item(item: Any, index: int, t: _Translation) -> None:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise _bad(f"'{where}' must be an input item object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str):
        raise _bad(f"'{where}.type' is missing", f"{where}.type")
    if kind != "message" and kind not in ASSISTANT_SIDE:
        t.open_assistant = None
    if kind == "message":
        _message(item, where, t)
    elif kind == "reasoning":
        _reasoning_item(item, where, t)
    elif kind == "function_call":
        call_id = _required_str(item, "call_id", where)
        name = _required_str(item, "name", where)
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise _bad(f"'{where}.arguments' must be a string of JSON", f"{where}.arguments")
        _add_call(call_id, _chat_tool_name(item.get("namespace"), name), arguments, t)
        t.ignore_unknown(item, {"type", "call_id", "name", "arguments", "namespace"}, "input[*]")
    elif kind == "custom_tool_call":
        call_id = _required_str(item, "call_id", where)
        name = _required_str(item, "name", where)
        if not isinstance(item.get("input"), str):
            raise _bad(f"'{where}.input' must be a string", f"{where}.input")
        _add_call(call_id, _chat_tool_name(item.get("namespace"), name), json.dumps({FREEFORM_ARGUMENT: item["input"]}, ensure_ascii=False), t)
        t.note(f"custom_tool_call: freeform input -> JSON argument '{FREEFORM_ARGUMENT}'")
        t.ignore_unknown(item, {"type", "call_id", "name", "input", "namespace"}, "input[*]")
    elif kind == "local_shell_call":
        call_id = item.get("call_id") or item.get("id")
        action = item.get("action")
        if not isinstance(call_id, str) or not call_id or not isinstance(action, dict):
            raise _bad(f"'{where}' needs a call_id and an action object", where)
        arguments = {key: value for key, value in action.items() if key != "type" and value is not None}
        _add_call(call_id, "local_shell", json.dumps(arguments, ensure_ascii=False), t)
        t.ignore_unknown(item, {"type", "call_id", "action"}, "input[*]")
    elif kind == "tool_search_call":
        call_id = _required_str(item, "call_id", where)
        arguments = item.get("arguments")
        _add_call(call_id, "tool_search", arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False), t)
        t.ignore_unknown(item, {"type", "call_id", "arguments"}, "input[*]")
    elif kind in TOOL_OUTPUTS:
        _tool_output(item, kind, where, t)
    elif kind == "additional_tools":
        tools = item.get("tools")
        if not isinstance(tools, list):
            raise _bad(f"'{where}.tools' must be an array of tools", f"{where}.tools")
        t.note(f"{where}: additional_tools -> engine tools")
        for tool_index, tool in enumerate(tools):
            _add_tool(tool, f"{where}.tools[{tool_index}]", t)
        t.ignore_unknown(item, {"type", "tools"}, where)
    elif kind == "configuration_update":
        effort = (item.get("reasoning") or {}).get("effort") if isinstance(item.get("reasoning"), dict) else None
        if isinstance(effort, str):
            t.reasoning_effort = effort
            t.note(f"{where}: configuration_update reasoning.effort {effort!r} -> reasoning_effort")
        t.ignore_unknown(item, {"type", "reasoning"}, where)
    elif kind == "item_reference":
        raise _bad(f"'{where}' is an item_reference; polar-mitm keeps no stored items: send the item itself", where)
    elif kind in SKIPPED_ITEMS:
        t.ignore(where, f"{kind} is {SKIPPED_ITEMS[kind]}; nothing the engine can read")
    else:
        raise _bad(f"Invalid value: {kind!r}. '{where}.type' must be one of: message, reasoning, function_call, function_call_output, custom_tool_call, custom_tool_call_output, local_shell_call, local_shell_call_output, tool_search_call, tool_search_output, additional_tools", f"{where}.type")


def _message(item: dict[str, Any], where: str, t: _Translation) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"Invalid value: {role!r}. '{where}.role' must be one of: {', '.join(ROLES)}", f"{where}.role")
    content = _content(item.get("content"), f"{where}.content", "input[*].content", t)
    t.ignore_unknown(item, {"type", "role", "content"}, "input[*]")
    if role != "assistant":
        t.open_assistant = None
        if role == "developer":
            t.note(f"{where}: developer -> system")
        t.messages.append({"role": "system" if role == "developer" else role, "content": content})
        return
    current = t.open_assistant
    if current is not None and current.get("content") is None and not current.get("tool_calls"):
        current["content"] = content
    else:
        t.open_assistant = {"role": "assistant", "content": content}
        t.messages.append(t.open_assistant)


def _content(content: Any, where: str, pattern: str, t: _Translation) -> str | list[dict[str, Any]]:
    """Responses content (a string or parts) -> chat content; one text part stays a plain string.
    `pattern` is `where` with item indices as [*], for recording ignored fields once per kind."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or an array of content parts", where)
    parts = [_part(part, f"{where}[{index}]", f"{pattern}[*]", t) for index, part in enumerate(content)]
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _part(part: Any, where: str, pattern: str, t: _Translation) -> dict[str, Any]:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise _bad(f"'{where}' must be a content part with a type", where)
    kind = part["type"]
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        if not isinstance(part.get("text"), str):
            raise _bad(f"'{where}.text' must be a string", f"{where}.text")
        t.ignore_unknown(part, {"type", "text"}, pattern)
        return {"type": "text", "text": part["text"]}
    if kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise _bad(f"'{where}.refusal' must be a string", f"{where}.refusal")
        t.note(f"{where}: refusal -> text")
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise _bad(f"'{where}': only input_image parts with an image_url (URL or data URL) are supported, not file_id", f"{where}.image_url")
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        t.ignore_unknown(part, {"type", "image_url", "detail"}, pattern)
        return {"type": "image_url", "image_url": image}
    raise _bad(f"Invalid value: {kind!r}. Content part type '{where}.type' is not supported; supported: input_text, output_text, refusal, input_image", f"{where}.type")


def _reasoning_item(item: dict[str, Any], where: str, t: _Translation) -> None:
    text = reasoning_carrier.unseal(item.get("encrypted_content"))
    if text is None and item.get("encrypted_content"):
        t.ignore(f"{where}.encrypted_content", "not sealed by polar-mitm (another provider's reasoning); the engine cannot read it")
    if text is None and isinstance(item.get("content"), list):
        texts = [part.get("text") for part in item["content"] if isinstance(part, dict) and isinstance(part.get("text"), str)]
        text = "\n".join(texts) if texts else None
    if item.get("summary"):
        t.ignore("input[*].summary")
    t.ignore_unknown(item, {"type", "encrypted_content", "content", "summary"}, "input[*]")
    if not text:
        return
    current = t.open_assistant
    if current is None or current.get("reasoning_content") or current.get("content") is not None or current.get("tool_calls"):
        current = t.open_assistant = {"role": "assistant", "content": None}
        t.messages.append(current)
    current["reasoning_content"] = text
    t.note("reasoning items -> reasoning_content of the assistant turn")


def _add_call(call_id: str, chat_name: str, arguments: str, t: _Translation) -> None:
    if t.open_assistant is None:
        t.open_assistant = {"role": "assistant", "content": None}
        t.messages.append(t.open_assistant)
    t.open_assistant.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": {"name": chat_name, "arguments": arguments}})
    t.call_ids.add(call_id)


def _tool_output(item: dict[str, Any], kind: str, where: str, t: _Translation) -> None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"'{where}.call_id' must be a non-empty string", f"{where}.call_id")
    if call_id not in t.call_ids:
        raise _bad(f"No tool call found for {kind.replace('_', ' ')} with call_id {call_id}.", "input")
    if kind == "tool_search_output":
        tools = item.get("tools")
        if not isinstance(tools, list):
            raise _bad(f"'{where}.tools' must be an array of tools", f"{where}.tools")
        for tool_index, tool in enumerate(tools):
            _add_tool(tool, f"{where}.tools[{tool_index}]", t, loaded=True)
        content: Any = json.dumps(tools, ensure_ascii=False)
        t.ignore_unknown(item, {"type", "call_id", "tools"}, "input[*]")
    else:
        output = item.get("output")
        if isinstance(output, str):
            content = output
        elif isinstance(output, list):
            content = _content(output, f"{where}.output", "input[*].output", t)
        else:
            raise _bad(f"'{where}.output' must be a string or an array of content parts", f"{where}.output")
        t.ignore_unknown(item, {"type", "call_id", "output"}, "input[*]")
    t.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})


# -- reasoning, text format, include
def _reasoning(reasoning: dict[str, Any], t: _Translation) -> str | None:
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _bad("'reasoning.effort' must be a string", "reasoning.effort")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            t.ignore(f"reasoning.{key}")
    return effort


def _text_format(text: dict[str, Any], t: _Translation) -> dict[str, Any] | None:
    for key in text:
        if key != "format":
            t.ignore(f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("'text.format.type' must be one of: text, json_object, json_schema", "text.format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), dict):
        raise _bad("'text.format.schema' must be a JSON schema object", "text.format.schema")
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    t.note("text.format json_schema -> response_format")
    return {"type": "json_schema", "json_schema": schema}


def _includes(include: list[Any], t: _Translation) -> set[str]:
    wanted = set()
    for index, value in enumerate(include):
        if not isinstance(value, str):
            raise _bad(f"'include[{index}]' must be a string", f"include[{index}]")
        if value in INCLUDES:
            wanted.add(INCLUDES[value])
            t.note(f"include {value!r}: rendered from the engine's answer")
        else:
            t.ignore(f"include[{index}]", f"{value!r} has nothing to include from the engine")
    return wanted


# -- rendering
def _ids(reply_id: str) -> str:
    # derived from the reply's id (the engine's, or the one a stream opened with): body and stream carry the same ids
    return reply_id.removeprefix("chatcmpl-").replace("-", "")


def _output(parsed: ParsedRequest, completion: Completion) -> list[dict[str, Any]]:
    base = _ids(completion.id)
    items: list[dict[str, Any]] = []
    truncated = completion.finish_reason == "length"
    if completion.reasoning:
        item: dict[str, Any] = {"id": f"rs_{base}", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": completion.reasoning}]}
        if parsed.render.get("summary"):
            item["summary"] = [{"type": "summary_text", "text": completion.reasoning}]
        if parsed.render.get("encrypted"):
            item["encrypted_content"] = reasoning_carrier.seal(completion.reasoning)
        items.append(item)
    if completion.content or not completion.tool_calls:
        only_text = not completion.reasoning and not completion.tool_calls
        logprobs = _logprobs(completion) if parsed.render.get("logprobs") and only_text else []
        part = {"type": "output_text", "annotations": [], "logprobs": logprobs, "text": completion.content or ""}
        items.append({"id": f"msg_{base}", "type": "message", "role": "assistant", "status": "incomplete" if truncated else "completed", "content": [part]})
    for index, call in enumerate(completion.tool_calls):
        items.append(_call_item(parsed, call.id, call.name, call.arguments, f"{base}_{index}"))
    return items


def _call_item(parsed: ParsedRequest, call_id: str, chat_name: str, arguments: str, suffix: str) -> dict[str, Any]:
    kind = parsed.render["tool_kinds"].get(chat_name) or {"kind": "function", "name": chat_name, "namespace": None}
    namespace = {"namespace": kind["namespace"]} if kind["namespace"] not in (None, DEFAULT_NAMESPACE) else {}
    parsed_arguments = _json_object(arguments)
    if kind["kind"] == "custom" and isinstance(parsed_arguments.get(FREEFORM_ARGUMENT), str):
        return {"id": f"ctc_{suffix}", "type": "custom_tool_call", "status": "completed", "call_id": call_id, "name": kind["name"], **namespace, "input": parsed_arguments[FREEFORM_ARGUMENT]}
    if kind["kind"] == "local_shell" and isinstance(parsed_arguments.get("command"), list):
        return {"id": f"lsh_{suffix}", "type": "local_shell_call", "status": "completed", "call_id": call_id, "action": {"type": "exec", **parsed_arguments}}
    if kind["kind"] == "tool_search" and parsed_arguments:
        return {"id": f"ts_{suffix}", "type": "tool_search_call", "status": "completed", "call_id": call_id, "execution": "client", "arguments": parsed_arguments}
    # a plain function, or the model's malformed call to a special tool: passed on as the model wrote it
    return {"id": f"fc_{suffix}", "type": "function_call", "status": "completed", "call_id": call_id, "name": kind["name"], **namespace, "arguments": arguments}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def _logprobs(completion: Completion) -> list[dict[str, Any]]:
    return [
        {
            "token": item.get("token", ""),
            "bytes": item.get("bytes") or [],
            "logprob": item.get("logprob", 0.0),
            "top_logprobs": [{"token": top.get("token", ""), "bytes": top.get("bytes") or [], "logprob": top.get("logprob", 0.0)} for top in item.get("top_logprobs") or []],
        }
        for item in completion.logprobs_content or []
    ]


def _usage(completion: Completion) -> dict[str, Any]:
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion.completion_tokens,
        # the engine reports no split of its sampled tokens into reasoning and answer
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def _envelope(parsed: ParsedRequest, reply_id: str, created: int) -> dict[str, Any]:
    """The response object as it stands before any output: what response.created carries."""
    echo = parsed.render["echo"]
    return {
        "id": f"resp_{_ids(reply_id)}",
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "max_tool_calls": None,
        "model": parsed.model,
        "output": [],
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": None,
        "prompt_cache_key": echo["prompt_cache_key"],
        "reasoning": echo["reasoning"],
        "service_tier": "default",
        "store": echo["store"],
        "temperature": echo["temperature"],
        "text": echo["text"],
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "top_logprobs": echo["top_logprobs"],
        "top_p": echo["top_p"],
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": echo["metadata"],
    }


def render_body(parsed: ParsedRequest, completion: Completion) -> dict[str, Any]:
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(completion.finish_reason)
    body = _envelope(parsed, completion.id, completion.created)
    body.update(
        status="incomplete" if incomplete else "completed",
        completed_at=completion.created,
        incomplete_details={"reason": incomplete} if incomplete else None,
        output=_output(parsed, completion),
        usage=_usage(completion),
    )
    return body


class _Events:
    """Renders events numbered on from `state.events` (sequence_number runs across opening, keepalives and body)."""

    def __init__(self, state: StreamState) -> None:
        self.parts: list[bytes] = []
        self.state = state

    def emit(self, kind: str, **fields: Any) -> None:
        self.parts.append(sse(kind, {"type": kind, "sequence_number": self.state.events, **fields}))
        self.state.events += 1

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def stream_opening(parsed: ParsedRequest, state: StreamState) -> bytes:
    """response.created and response.in_progress, as OpenAI sends them before any output."""
    events = _Events(state)
    started = _envelope(parsed, state.id, state.created)
    events.emit("response.created", response=started)
    events.emit("response.in_progress", response=started)
    return events.bytes()


def stream_keepalive(parsed: ParsedRequest, state: StreamState) -> bytes:
    """response.in_progress again: a real event (Codex's idle timer skips SSE comments) that changes nothing."""
    events = _Events(state)
    events.emit("response.in_progress", response=_envelope(parsed, state.id, state.created))
    return events.bytes()


def stream_body(parsed: ParsedRequest, state: StreamState, completion: Completion) -> bytes:
    """The output items, then response.completed (or response.incomplete)."""
    final = render_body(parsed, completion)
    events = _Events(state)
    for output_index, item in enumerate(final["output"]):
        _stream_item(events, output_index, item)
    events.emit("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
    return events.bytes()


def stream_error(parsed: ParsedRequest, state: StreamState, error: DialectError) -> bytes:
    """response.failed with the error: code `context_length_exceeded` for a prompt over the engine's context (Codex
    keys on it), else `server_error` (what else fails mid-stream is the engine or the gateway)."""
    events = _Events(state)
    failed = _envelope(parsed, state.id, state.created)
    body = error_body(error)["error"]
    code = "context_length_exceeded" if body.get("code") == "context_length_exceeded" else "server_error"
    failed.update(status="failed", error={"code": code, "message": body["message"]})
    events.emit("response.failed", response=failed)
    return events.bytes()


def render_stream(parsed: ParsedRequest, completion: Completion) -> bytes:
    state = StreamState.of(completion)
    return stream_opening(parsed, state) + stream_body(parsed, state, completion)


def _stream_item(events: _Events, output_index: int, item: dict[str, Any]) -> None:
    at = {"item_id": item["id"], "output_index": output_index}
    kind = item["type"]
    if kind == "message":
        events.emit("response.output_item.added", output_index=output_index, item={**item, "status": "in_progress", "content": []})
        for content_index, part in enumerate(item["content"]):
            events.emit("response.content_part.added", **at, content_index=content_index, part={**part, "text": "", "logprobs": []})
            if part["text"]:
                events.emit("response.output_text.delta", **at, content_index=content_index, delta=part["text"], logprobs=part["logprobs"])
            events.emit("response.output_text.done", **at, content_index=content_index, text=part["text"], logprobs=part["logprobs"])
            events.emit("response.content_part.done", **at, content_index=content_index, part=part)
    elif kind == "reasoning":
        events.emit("response.output_item.added", output_index=output_index, item={"id": item["id"], "type": "reasoning", "summary": [], "content": []})
        for content_index, part in enumerate(item["content"]):
            events.emit("response.content_part.added", **at, content_index=content_index, part={**part, "text": ""})
            events.emit("response.reasoning_text.delta", **at, content_index=content_index, delta=part["text"])
            events.emit("response.reasoning_text.done", **at, content_index=content_index, text=part["text"])
            events.emit("response.content_part.done", **at, content_index=content_index, part=part)
        for summary_index, part in enumerate(item["summary"]):
            events.emit("response.reasoning_summary_part.added", **at, summary_index=summary_index, part={**part, "text": ""})
            events.emit("response.reasoning_summary_text.delta", **at, summary_index=summary_index, delta=part["text"])
            events.emit("response.reasoning_summary_text.done", **at, summary_index=summary_index, text=part["text"])
            events.emit("response.reasoning_summary_part.done", **at, summary_index=summary_index, part=part)
    elif kind == "function_call":
        events.emit("response.output_item.added", output_index=output_index, item={**item, "status": "in_progress", "arguments": ""})
        events.emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
        events.emit("response.function_call_arguments.done", **at, arguments=item["arguments"])
    elif kind == "custom_tool_call":
        events.emit("response.output_item.added", output_index=output_index, item={**item, "status": "in_progress", "input": ""})
        events.emit("response.custom_tool_call_input.delta", **at, delta=item["input"])
        events.emit("response.custom_tool_call_input.done", **at, input=item["input"])
    else:  # local_shell_call, tool_search_call: no deltas in the provider's grammar
        events.emit("response.output_item.added", output_index=output_index, item={**item, "status": "in_progress"})
    events.emit("response.output_item.done", output_index=output_index, item=item)


def render_count_tokens(parsed: ParsedRequest, count: int) -> dict[str, Any]:
    return {"object": "response.input_tokens", "input_tokens": count}


def parse_reply(body: dict[str, Any]) -> Reply:
    reply = Reply(finish_reason=body.get("status"))
    for item in body.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            reply.content += "".join(part.get("text", "") for part in item.get("content") or [] if part.get("type") == "output_text")
        elif kind == "reasoning":
            reply.reasoning += "".join(part.get("text", "") for part in (item.get("content") or item.get("summary") or []))
        elif kind == "function_call":
            reply.tool_calls.append({"id": item.get("call_id"), "name": item.get("name"), "arguments": item.get("arguments")})
    return reply


def parse_reply_stream(events: list[SSEEvent]) -> Reply:
    # the terminal event carries the whole response object
    for name, data in events:
        if (name or data.get("type")) in ("response.completed", "response.incomplete", "response.failed"):
            return parse_reply(data.get("response") or {})
    return Reply(error="the stream has no response.completed event")


def error_body(error: DialectError) -> dict[str, Any]:
    """OpenAI's error shape, as Chat Completions has it; a prompt over the context in the Responses API's words."""
    if error.kind == "context_length_exceeded" and error.max_context:
        message = (
            f"Your input exceeds the context window of this model ({error.prompt_tokens} tokens > {error.max_context}). "
            "Please adjust your input and try again."
        )
        return {"error": {"message": message, "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}}
    return openai_chat.error_body(error)
