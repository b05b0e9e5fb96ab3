"""Google Gemini generateContent (`POST /v1beta/models/M:generateContent`, `:streamGenerateContent?alt=sse`,
`:countTokens`; also under /v1/ and /v1alpha/), the API Gemini CLI and google-genai speak.

Gemini function calls carry no ids: calls get stable ids from their position in `contents`, and each
functionResponse is paired with the earliest unanswered earlier call of the same name. The engine's reasoning
travels in `thoughtSignature` (sealed, see reasoning.py, and base64-encoded: the field is bytes) on the thought
part and, as Google places it, on the first functionCall part or else the last text part: Gemini CLI drops thought
parts from its history but keeps signatures on the others.

Length: one wire dialect (generateContent's request, reply and stream grammar), read top to bottom.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any
from urllib.parse import unquote

from polar_mitm.dialects import reasoning
from polar_mitm.dialects._api import Reply
from polar_mitm.dialects.common import SSEEvent, expect, load_json_object
from polar_mitm.exchange import Completion, DialectError, Notes, ParsedRequest, StreamState

API = "gemini"
STREAM_CONTENT_TYPE = "text/event-stream"

PATH = re.compile(r"^/(?:v1|v1beta|v1alpha)/models/(?P<model>[^/:]+):(?P<method>generateContent|streamGenerateContent|countTokens)$")

GENERATION_PASSTHROUGH = {
    "temperature": "temperature", "topP": "top_p", "topK": "top_k", "maxOutputTokens": "max_tokens",
    "stopSequences": "stop", "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty", "seed": "seed",
}
# generationConfig fields consumed here (response format, candidates, logprobs, modalities)
GENERATION_CONSUMED = {"candidateCount", "responseMimeType", "responseSchema", "responseJsonSchema", "_responseJsonSchema", "responseLogprobs", "logprobs", "responseModalities"}
FINISH_REASONS = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}
ERROR_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 407: "UNAUTHENTICATED",
    409: "ABORTED", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}
# OpenAPI schema fields Google sends as int64 strings ("1")
INT64_SCHEMA_FIELDS = {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
OPENAPI_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"}


def recognizes(method: str, path: str) -> bool:
    return method == "POST" and PATH.match(path) is not None


def _bad(message: str, field: str | None = None) -> DialectError:
    return DialectError(400, "invalid_request_error", message, field)


def parse(body: bytes, path: str = "", query: dict[str, str] | None = None) -> ParsedRequest:
    match = PATH.match(path)
    if match is None:
        raise DialectError(404, "not_found", f"polar-mitm's Gemini dialect does not serve {path!r}")
    model, method = unquote(match["model"]), match["method"]
    data = load_json_object(body)
    notes = Notes()
    data = _camel_keys(data, "request", notes)
    if method == "countTokens":
        # CountTokensRequest: either plain `contents`, or a whole `generateContentRequest`
        inner = expect(data, "generateContentRequest", dict)
        if inner is not None:
            parsed = _parse_request(_camel_keys(inner, "generateContentRequest", notes), model, notes, "generateContentRequest.")
            parsed.notes.ignored = sorted(parsed.notes.ignored + [key for key in data if key != "generateContentRequest"])
        else:
            parsed = _parse_request(data, model, notes)
        parsed.action = "count_tokens"
        return parsed
    stream = method == "streamGenerateContent"
    if stream and (query or {}).get("alt") != "sse":
        raise _bad("streamGenerateContent is served as server-sent events only; add ?alt=sse (JSON-array streaming is not supported)", "alt")
    parsed = _parse_request(data, model, notes)
    parsed.stream = stream
    return parsed


def _parse_request(data: dict[str, Any], model: str, notes: Notes, where: str = "") -> ParsedRequest:
    contents = expect(data, "contents", list, required=True, where=where)
    if not contents:
        raise _bad(f"'{where}contents' must not be empty", f"{where}contents")
    messages: list[dict[str, Any]] = []
    system = data.get("systemInstruction")
    if system is not None:
        messages.append({"role": "system", "content": _system_text(system, f"{where}systemInstruction", notes)})
    messages += _messages(contents, notes, where)

    chat: dict[str, Any] = {"messages": messages}
    tools = _tools(expect(data, "tools", list, where=where) or [], notes, where)
    if tools:
        chat["tools"] = tools
    _tool_choice(expect(data, "toolConfig", dict, where=where), chat, notes, where)
    render = _generation_config(expect(data, "generationConfig", dict, where=where), chat, notes, where)
    known = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig"}
    notes.ignored += [f"{where}{key}" for key in data if key not in known]
    notes.ignored.sort()
    return ParsedRequest(api=API, model=model, stream=False, chat=chat, notes=notes, render=render)


def _camel_keys(obj: dict[str, Any], where: str, notes: Notes) -> dict[str, Any]:
    """Google's JSON accepts snake_case field names too (its own curl examples use them); one spelling here."""
    # one search over the joined keys first: called on every part of the history (py-spy, bench/scale.py: ~1% of the
    # event loop as a generator per part)
    if "_" not in "".join(obj) or not any("_" in key.strip("_") for key in obj):
        return obj
    out: dict[str, Any] = {}
    for key, value in obj.items():
        camel = re.sub(r"(?<=[a-z0-9])_([a-z])", lambda m: m[1].upper(), key) if not key.startswith("_") else key
        if camel != key:
            notes.normalize(f"{where}.{key} -> {camel}")
        out[camel] = value
    return out


def _system_text(system: Any, where: str, notes: Notes) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, dict):
        raise _bad(f"'{where}' must be a Content object or a string", where)
    system = _camel_keys(system, where, notes)
    parts = system.get("parts")
    if not isinstance(parts, list):
        raise _bad(f"'{where}.parts' must be an array of parts", f"{where}.parts")
    texts = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise _bad(f"'{where}.parts[{index}]' must be a text part: a system instruction holds text only", f"{where}.parts[{index}]")
        texts.append(part["text"])
        notes.ignored += [f"{where}.parts[{index}].{key}" for key in part if key != "text"]
    # the Content's role is implied: it becomes the system message
    notes.ignored += [f"{where}.{key}" for key in system if key not in ("parts", "role")]
    if len(texts) > 1:
        notes.normalize(f"{where}: {len(texts)} text parts joined with newlines")
    return "\n".join(texts)


def _messages(contents: list[Any], notes: Notes, where: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, name) of earlier calls with no response yet, in order
    for index, content in enumerate(contents):
        at = f"{where}contents[{index}]"
        if not isinstance(content, dict):
            raise _bad(f"'{at}' must be a Content object", at)
        content = _camel_keys(content, at, notes)
        role = content.get("role", "user")
        if role not in ("user", "model", "function"):
            raise _bad(f"'{at}.role' must be 'user', 'model' or 'function', got {role!r}", f"{at}.role")
        parts = content.get("parts")
        if not isinstance(parts, list) or not parts:
            raise _bad(f"'{at}.parts' must be a non-empty array of parts", f"{at}.parts")
        parts = [_camel_keys(p, f"{at}.parts[{i}]", notes) if isinstance(p, dict) else p for i, p in enumerate(parts)]
        if role == "model":
            messages.append(_assistant(parts, index, at, notes, unanswered))
        else:
            messages += _user_turn(parts, at, notes, unanswered)
        notes.ignored += [f"{at}.{key}" for key in content if key not in ("role", "parts")]
    return messages


def _assistant(parts: list[Any], index: int, at: str, notes: Notes, unanswered: list[tuple[str, str]]) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    restored: str | None = None
    calls: list[dict[str, Any]] = []
    for part_index, part in enumerate(parts):
        here = f"{at}.parts[{part_index}]"
        if not isinstance(part, dict):
            raise _bad(f"'{here}' must be a Part object", here)
        if "thoughtSignature" in part:
            sealed = _unseal_signature(part["thoughtSignature"])
            if sealed is None:
                notes.ignore(f"{here}.thoughtSignature")  # a real provider's (or a synthetic) signature: nothing to restore
            elif restored is None:
                restored = sealed
        kind = _part_kind(part, here)
        if kind == "thoughtSignature":
            continue
        if kind == "text" and part.get("thought") is True:
            thoughts.append(part["text"])
        elif kind == "text":
            texts.append(part["text"])
        elif kind == "functionCall":
            call = part["functionCall"]
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
                raise _bad(f"'{here}.functionCall' must have a name", f"{here}.functionCall.name")
            args = call.get("args", {})
            if not isinstance(args, dict):
                raise _bad(f"'{here}.functionCall.args' must be an object", f"{here}.functionCall.args")
            call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{index}_{part_index}"
            calls.append({"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
            unanswered.append((call_id, call["name"]))
            notes.ignored += [f"{here}.functionCall.{key}" for key in call if key not in ("name", "args", "id")]
        else:
            raise _bad(f"'{here}': a model turn may hold text, thought and functionCall parts, not {kind}", here)
        notes.ignored += [f"{here}.{key}" for key in part if key not in (kind, "thought", "thoughtSignature")]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if len(texts) > 1:
        notes.normalize(f"{at}: {len(texts)} text parts joined")
    if restored is not None:
        message["reasoning_content"] = restored
        notes.normalize(f"{at}: reasoning restored from thoughtSignature")
    elif thoughts:
        message["reasoning_content"] = "".join(thoughts)
        notes.normalize(f"{at}: reasoning taken from thought parts")
    if calls:
        message["tool_calls"] = calls
    return message


def _user_turn(parts: list[Any], at: str, notes: Notes, unanswered: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Part order is kept: runs of text/media become user messages, each functionResponse a tool message."""
    messages: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        if pending:
            only_text = len(pending) == 1 and pending[0]["type"] == "text"
            messages.append({"role": "user", "content": pending[0]["text"] if only_text else list(pending)})
            pending.clear()

    for part_index, part in enumerate(parts):
        here = f"{at}.parts[{part_index}]"
        if not isinstance(part, dict):
            raise _bad(f"'{here}' must be a Part object", here)
        kind = _part_kind(part, here)
        if kind == "thoughtSignature":
            notes.ignore(f"{here}.thoughtSignature")
            continue
        if kind == "functionResponse":
            flush()
            messages.append(_tool_message(part["functionResponse"], here, notes, unanswered))
        elif kind == "functionCall":
            raise _bad(f"'{here}': functionCall parts belong to role 'model' contents", here)
        elif part.get("thought") is True:
            raise _bad(f"'{here}': thought parts belong to role 'model' contents", here)
        else:
            pending.append(_media_part(part, kind, here, notes))
        notes.ignored += [f"{here}.{key}" for key in part if key not in (kind, "thought")]
    flush()
    return messages


def _tool_message(response: Any, here: str, notes: Notes, unanswered: list[tuple[str, str]]) -> dict[str, Any]:
    where = f"{here}.functionResponse"
    if not isinstance(response, dict) or not isinstance(response.get("name"), str):
        raise _bad(f"'{where}' must have a name", f"{where}.name")
    name = response["name"]
    wanted_id = response.get("id") if isinstance(response.get("id"), str) else None
    match = next((i for i, (call_id, _) in enumerate(unanswered) if call_id == wanted_id), None) if wanted_id else None
    if match is None:
        match = next((i for i, (_, call_name) in enumerate(unanswered) if call_name == name), None)
    if match is None:
        raise _bad(f"'{where}' answers a call of {name!r}, but no earlier functionCall of {name!r} is waiting for a response", where)
    call_id, _ = unanswered.pop(match)
    if wanted_id and wanted_id != call_id:
        # an id that names no call in the history (the client dropped or never sent the call's id)
        notes.ignore(f"{where}.id")
        notes.normalize(f"{where}: id {wanted_id!r} names no call; paired by name with {call_id}")
    result = response.get("response", {})
    if not isinstance(result, dict):
        raise _bad(f"'{where}.response' must be an object", f"{where}.response")
    text = json.dumps(result, ensure_ascii=False)
    message: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": text}
    extra_parts = response.get("parts") or []
    if not isinstance(extra_parts, list):
        raise _bad(f"'{where}.parts' must be an array", f"{where}.parts")
    if extra_parts:
        content = [{"type": "text", "text": text}]
        for index, part in enumerate(extra_parts):
            at = f"{where}.parts[{index}]"
            if not isinstance(part, dict):
                raise _bad(f"'{at}' must be a Part object", at)
            part = _camel_keys(part, at, notes)
            content.append(_media_part(part, _part_kind(part, at), at, notes))
        message["content"] = content
    notes.ignored += [f"{where}.{key}" for key in response if key not in ("name", "id", "response", "parts")]
    return message


PART_DATA = ("text", "functionCall", "functionResponse", "inlineData", "fileData", "executableCode", "codeExecutionResult")


PART_KINDS = frozenset(PART_DATA)


def _part_kind(part: dict[str, Any], here: str) -> str:
    kinds = [key for key in part if key in PART_KINDS]  # a part's few keys, not the seven kinds, are looked through
    if len(kinds) > 1:
        kinds.sort(key=PART_DATA.index)
        raise _bad(f"'{here}' holds {' and '.join(kinds)}; a part holds exactly one kind of data", here)
    if kinds == ["text"] and not isinstance(part["text"], str):
        raise _bad(f"'{here}.text' must be a string", f"{here}.text")
    if kinds:
        return kinds[0]
    if "thoughtSignature" in part:
        return "thoughtSignature"  # a signature alone, holding no data
    raise _bad(f"'{here}' has no supported data: expected text, functionCall, functionResponse or inlineData", here)


def _media_part(part: dict[str, Any], kind: str, here: str, notes: Notes) -> dict[str, Any]:
    if kind == "text":
        return {"type": "text", "text": part["text"]}
    if kind != "inlineData":
        raise _bad(f"'{here}': {kind} parts are not supported by polar-mitm (the engine serves text and inline images)", here)
    blob = part["inlineData"]
    if not isinstance(blob, dict):
        raise _bad(f"'{here}.inlineData' must be an object", f"{here}.inlineData")
    blob = _camel_keys(blob, f"{here}.inlineData", notes)
    mime, data = blob.get("mimeType"), blob.get("data")
    if not isinstance(mime, str) or not isinstance(data, str):
        raise _bad(f"'{here}.inlineData' needs a mimeType and base64 data", f"{here}.inlineData")
    if mime.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}
    if mime.startswith("text/") or mime in ("application/json", "application/xml"):
        try:
            text = base64.b64decode(data, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as error:
            raise _bad(f"'{here}.inlineData.data' is not base64 of UTF-8 text: {error}", f"{here}.inlineData.data") from error
        notes.normalize(f"{here}: inline {mime} decoded to text")
        return {"type": "text", "text": text}
    raise _bad(f"'{here}': inlineData of type {mime!r} is not supported by polar-mitm (images and text only)", f"{here}.inlineData.mimeType")


def _tools(tools: list[Any], notes: Notes, where: str) -> list[dict[str, Any]]:
    chat_tools: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        at = f"{where}tools[{index}]"
        if not isinstance(tool, dict):
            raise _bad(f"'{at}' must be a Tool object", at)
        tool = _camel_keys(tool, at, notes)
        declarations = tool.get("functionDeclarations") or []
        if not isinstance(declarations, list):
            raise _bad(f"'{at}.functionDeclarations' must be an array", f"{at}.functionDeclarations")
        for number, declaration in enumerate(declarations):
            chat_tools.append(_function_tool(declaration, f"{at}.functionDeclarations[{number}]", notes))
        # googleSearch, codeExecution, urlContext...: Google runs those itself; our engine cannot
        notes.ignored += [f"{at}.{key}" for key in tool if key != "functionDeclarations"]
    return chat_tools


def _function_tool(declaration: Any, at: str, notes: Notes) -> dict[str, Any]:
    if not isinstance(declaration, dict) or not isinstance(declaration.get("name"), str) or not declaration["name"]:
        raise _bad(f"'{at}' must be a function declaration with a name", f"{at}.name")
    declaration = _camel_keys(declaration, at, notes)
    if declaration.get("parameters") is not None and declaration.get("parametersJsonSchema") is not None:
        raise _bad(f"'{at}': set parameters or parametersJsonSchema, not both", at)
    function: dict[str, Any] = {"name": declaration["name"]}
    if isinstance(declaration.get("description"), str):
        function["description"] = declaration["description"]
    schema = declaration.get("parametersJsonSchema", declaration.get("parameters"))
    if schema is None:
        schema = {"type": "object", "properties": {}}
    elif not isinstance(schema, dict):
        raise _bad(f"'{at}.parameters' must be a schema object", f"{at}.parameters")
    function["parameters"] = _json_schema(schema, f"{at}.parameters", notes)
    notes.ignored += [f"{at}.{key}" for key in declaration if key not in ("name", "description", "parameters", "parametersJsonSchema")]
    return {"type": "function", "function": function}


def _json_schema(schema: dict[str, Any], at: str, notes: Notes) -> dict[str, Any]:
    """Gemini's OpenAPI-style schema (types "OBJECT", "STRING", `nullable`, int64 strings) as JSON Schema."""
    changed: list[bool] = []

    def convert(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        kind = out.get("type")
        if isinstance(kind, str) and kind.upper() in OPENAPI_TYPES and kind != kind.lower():
            out["type"] = kind.lower()
            changed.append(True)
        elif kind == "TYPE_UNSPECIFIED":
            del out["type"]
            changed.append(True)
        if out.get("nullable") is True and isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
            del out["nullable"]
            changed.append(True)
        for key in INT64_SCHEMA_FIELDS:
            if isinstance(out.get(key), str) and out[key].isdigit():
                out[key] = int(out[key])
                changed.append(True)
        for key in ("properties", "$defs", "definitions", "patternProperties"):
            if isinstance(out.get(key), dict):
                out[key] = {name: convert(sub) for name, sub in out[key].items()}
        for key in ("items", "additionalProperties", "not"):
            if isinstance(out.get(key), dict):
                out[key] = convert(out[key])
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(out.get(key), list):
                out[key] = [convert(sub) for sub in out[key]]
        return out

    result = convert(schema)
    if changed:
        notes.normalize(f"{at}: OpenAPI schema types -> JSON Schema")
    return result


def _tool_choice(config: dict[str, Any] | None, chat: dict[str, Any], notes: Notes, where: str) -> None:
    if config is None:
        return
    at = f"{where}toolConfig"
    config = _camel_keys(config, at, notes)
    notes.ignored += [f"{at}.{key}" for key in config if key != "functionCallingConfig"]
    calling = config.get("functionCallingConfig")
    if calling is None:
        return
    if not isinstance(calling, dict):
        raise _bad(f"'{at}.functionCallingConfig' must be an object", f"{at}.functionCallingConfig")
    calling = _camel_keys(calling, f"{at}.functionCallingConfig", notes)
    notes.ignored += [f"{at}.functionCallingConfig.{key}" for key in calling if key not in ("mode", "allowedFunctionNames")]
    mode = calling.get("mode", "MODE_UNSPECIFIED")
    allowed = calling.get("allowedFunctionNames")
    if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed)):
        raise _bad(f"'{at}.functionCallingConfig.allowedFunctionNames' must be an array of names", f"{at}.functionCallingConfig.allowedFunctionNames")
    if allowed and mode != "ANY":
        raise _bad(f"'{at}.functionCallingConfig.allowedFunctionNames' is only allowed with mode ANY", f"{at}.functionCallingConfig.allowedFunctionNames")
    if mode in ("AUTO", "MODE_UNSPECIFIED"):
        return
    if mode == "VALIDATED":
        chat["tool_choice"] = "auto"
        notes.normalize(f"{at}: mode VALIDATED served as tool_choice auto")
    elif mode == "NONE":
        chat["tool_choice"] = "none"
    elif mode == "ANY":
        names = {tool["function"]["name"] for tool in chat.get("tools", [])}
        if unknown := [name for name in allowed or [] if name not in names]:
            raise _bad(f"'{at}.functionCallingConfig.allowedFunctionNames' names undeclared functions: {unknown}", f"{at}.functionCallingConfig.allowedFunctionNames")
        if allowed and len(set(allowed)) == 1:
            chat["tool_choice"] = {"type": "function", "function": {"name": allowed[0]}}
        else:
            chat["tool_choice"] = "required"
            if allowed and set(allowed) != names:
                chat["tools"] = [tool for tool in chat["tools"] if tool["function"]["name"] in allowed]
                notes.normalize(f"{at}: tools narrowed to allowedFunctionNames {sorted(set(allowed))}")
    else:
        raise _bad(f"'{at}.functionCallingConfig.mode' must be AUTO, ANY, NONE or VALIDATED, got {mode!r}", f"{at}.functionCallingConfig.mode")


def _generation_config(config: dict[str, Any] | None, chat: dict[str, Any], notes: Notes, where: str) -> dict[str, Any]:
    render: dict[str, Any] = {"include_thoughts": False, "response_logprobs": False}
    if config is None:
        return render
    at = f"{where}generationConfig"
    config = _camel_keys(config, at, notes)
    for key, kinds in (("temperature", (int, float)), ("topP", (int, float)), ("topK", (int, float)), ("maxOutputTokens", int), ("seed", int),
                       ("presencePenalty", (int, float)), ("frequencyPenalty", (int, float)), ("candidateCount", int), ("logprobs", int),
                       ("stopSequences", list), ("responseMimeType", str), ("responseLogprobs", bool), ("responseModalities", list)):
        expect(config, key, kinds, where=f"{at}.")
    for key, name in GENERATION_PASSTHROUGH.items():
        if config.get(key) is not None:
            chat[name] = config[key]
    if isinstance(chat.get("top_k"), float):
        if not chat["top_k"].is_integer():
            raise _bad(f"'{at}.topK' must be a whole number", f"{at}.topK")
        chat["top_k"] = int(chat["top_k"])
    if not all(isinstance(s, str) for s in config.get("stopSequences") or []):
        raise _bad(f"'{at}.stopSequences' must be an array of strings", f"{at}.stopSequences")
    if config.get("candidateCount") not in (None, 1):
        raise _bad(f"candidateCount={config['candidateCount']} is not supported: the gateway records exactly one sample per exchange", f"{at}.candidateCount")
    modalities = config.get("responseModalities") or []
    if any(m != "TEXT" for m in modalities):
        raise _bad(f"'{at}.responseModalities' {modalities} is not supported: the engine answers with text only", f"{at}.responseModalities")
    _response_format(config, chat, at, notes)
    if config.get("responseLogprobs"):
        render["response_logprobs"] = True
        if config.get("logprobs"):
            chat["top_logprobs"] = config["logprobs"]
    render["include_thoughts"] = _thinking(expect(config, "thinkingConfig", dict, where=f"{at}."), chat, f"{at}.thinkingConfig", notes)
    known = set(GENERATION_PASSTHROUGH) | GENERATION_CONSUMED | {"thinkingConfig"}
    notes.ignored += [f"{at}.{key}" for key in config if key not in known]
    return render


def _thinking(thinking: dict[str, Any] | None, chat: dict[str, Any], at: str, notes: Notes) -> bool:
    """thinkingConfig -> the chat template's `enable_thinking` (budget 0 turns thinking off); absent: the engine's
    default. Returns includeThoughts, which only shapes the reply."""
    if thinking is None:
        return False
    thinking = _camel_keys(thinking, at, notes)
    budget = expect(thinking, "thinkingBudget", int, where=f"{at}.")
    include = expect(thinking, "includeThoughts", bool, where=f"{at}.") is True
    enable = budget != 0
    chat["chat_template_kwargs"] = {"enable_thinking": enable}
    notes.normalize(f"{at} -> chat_template_kwargs.enable_thinking={enable}")
    # the engine has no per-request budget or level we rely on: recorded, not enforced
    notes.ignored += [f"{at}.{key}" for key in thinking if key != "includeThoughts" and not (key == "thinkingBudget" and budget == 0)]
    return include


def _response_format(config: dict[str, Any], chat: dict[str, Any], at: str, notes: Notes) -> None:
    mime = config.get("responseMimeType") or "text/plain"
    schema_key = next((key for key in ("responseJsonSchema", "_responseJsonSchema", "responseSchema") if config.get(key) is not None), "responseSchema")
    schema = config.get(schema_key)
    if schema is not None and not isinstance(schema, dict):
        raise _bad(f"'{at}.{schema_key}' must be a schema object", f"{at}.{schema_key}")
    if mime == "application/json":
        if schema is None:
            chat["response_format"] = {"type": "json_object"}
        else:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": _json_schema(schema, f"{at}.{schema_key}", notes)}}
    elif mime == "text/x.enum":
        choices = (schema or {}).get("enum")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise _bad(f"'{at}': responseMimeType text/x.enum needs a responseSchema with a string enum", f"{at}.responseSchema")
        chat["structured_outputs"] = {"choice": choices}
        notes.normalize(f"{at}: text/x.enum served as structured_outputs choice")
    elif mime == "text/plain":
        if schema is not None:
            raise _bad(f"'{at}': a response schema needs responseMimeType application/json or text/x.enum", f"{at}.responseMimeType")
    else:
        raise _bad(f"'{at}.responseMimeType' {mime!r} is not supported: use text/plain, application/json or text/x.enum", f"{at}.responseMimeType")


# -- rendering

def _parts(parsed: ParsedRequest, completion: Completion) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The reply's (thought, text, functionCall) parts, in the order Google sends them."""
    thought_parts: list[dict[str, Any]] = []
    text_parts: list[dict[str, Any]] = []
    call_parts = [{"functionCall": {"name": call.name, "args": _arguments(call.arguments)}} for call in completion.tool_calls]
    if completion.content or not call_parts:
        text_parts.append({"text": completion.content or ""})
    if completion.reasoning:
        signature = _seal_signature(completion.reasoning)
        if parsed.render.get("include_thoughts"):
            thought_parts.append({"text": completion.reasoning, "thought": True, "thoughtSignature": signature})
        (call_parts[0] if call_parts else text_parts[-1])["thoughtSignature"] = signature
    return thought_parts, text_parts, call_parts


def _seal_signature(text: str) -> str:
    """thoughtSignature is a bytes field (base64 in JSON): google-genai decodes it and re-encodes it URL-safe, so the
    sealed reasoning travels as base64 of its bytes."""
    return base64.b64encode(reasoning.seal(text).encode()).decode()


def _unseal_signature(signature: Any) -> str | None:
    """The reasoning in a signature we issued, in either base64 alphabet, padded or not; None for anyone else's."""
    if not isinstance(signature, str):
        return None
    standard = signature.replace("-", "+").replace("_", "/")
    try:
        sealed = base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True).decode()
    except ValueError:  # not base64 (binascii.Error), not ASCII, not UTF-8
        return None
    return reasoning.unseal(sealed)


def _arguments(arguments: str) -> dict[str, Any]:
    """functionCall.args is always an object (a Struct). Arguments that are not one (a model's malformed call) are
    kept whole, as the Anthropic dialect keeps them (the row has the engine's original): the harness gets the call
    and its tool's error, not an HTTP 500 for a sample the engine did make."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        args = None
    return args if isinstance(args, dict) else {"_arguments": arguments}


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "promptTokenCount": completion.prompt_tokens,
        "candidatesTokenCount": completion.completion_tokens,
        "totalTokenCount": completion.prompt_tokens + completion.completion_tokens,
    }


def _logprobs(completion: Completion) -> dict[str, Any]:
    content = completion.logprobs_content or []
    result: dict[str, Any] = {"chosenCandidates": [{"token": item.get("token"), "logProbability": item.get("logprob")} for item in content]}
    if any(item.get("top_logprobs") for item in content):
        result["topCandidates"] = [{"candidates": [{"token": top.get("token"), "logProbability": top.get("logprob")} for top in item.get("top_logprobs") or []]} for item in content]
    return result


def _candidate(parsed: ParsedRequest, completion: Completion, parts: list[dict[str, Any]], final: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}}
    if final:
        candidate["finishReason"] = FINISH_REASONS.get(completion.finish_reason, "OTHER")
        if parsed.render.get("response_logprobs"):
            candidate["logprobsResult"] = _logprobs(completion)
    candidate["index"] = 0
    return candidate


def render_body(parsed: ParsedRequest, completion: Completion) -> dict[str, Any]:
    thoughts, texts, calls = _parts(parsed, completion)
    return {
        "candidates": [_candidate(parsed, completion, thoughts + texts + calls, final=True)],
        "usageMetadata": _usage(completion),
        "modelVersion": parsed.model,
        "responseId": completion.id,
    }


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\r\n\r\n"


def stream_opening(parsed: ParsedRequest, state: StreamState) -> bytes:
    """Google's grammar has no opening event (the first chunk already carries content): a streamed reply starts with
    its status and headers alone, and a reply ready before the first keepalive is byte for byte what it was."""
    return b""


def stream_keepalive(parsed: ParsedRequest, state: StreamState) -> bytes:
    """A chunk whose only part is an empty text. google-genai turns every SSE line into a JSON chunk (an SSE comment
    fails its parse), so a keepalive must be a real chunk; its text adds nothing to the reply's, and Gemini CLI
    leaves parts with an empty text out of the turn it records."""
    return _event({"candidates": [{"content": {"role": "model", "parts": [{"text": ""}]}, "index": 0}], "modelVersion": parsed.model, "responseId": state.id})


def stream_body(parsed: ParsedRequest, state: StreamState, completion: Completion) -> bytes:
    """One GenerateContentResponse per SSE event, `data: {...}` + CRLF CRLF as Google sends them, no `event:`
    lines; the last chunk carries finishReason and the usage."""
    groups = [group for group in _parts(parsed, completion) if group]
    chunks = []
    for number, group in enumerate(groups):
        final = number == len(groups) - 1
        chunk: dict[str, Any] = {"candidates": [_candidate(parsed, completion, group, final)]}
        if final:
            chunk["usageMetadata"] = _usage(completion)
        chunk["modelVersion"] = parsed.model
        chunk["responseId"] = state.id
        chunks.append(_event(chunk))
    return b"".join(chunks)


def stream_error(parsed: ParsedRequest, state: StreamState, error: DialectError) -> bytes:
    """Google's error object as a chunk of its own; google-genai raises the APIError subclass of its code."""
    return _event(error_body(error))


def render_stream(parsed: ParsedRequest, completion: Completion) -> bytes:
    state = StreamState.of(completion)
    return stream_opening(parsed, state) + stream_body(parsed, state, completion)


def render_count_tokens(parsed: ParsedRequest, count: int) -> dict[str, Any]:
    return {"totalTokens": count}


def error_body(error: DialectError) -> dict[str, Any]:
    status = ERROR_STATUS.get(error.status, "INTERNAL" if error.status >= 500 else "INVALID_ARGUMENT")
    if error.kind == "context_length_exceeded" and error.max_context:
        message = f"The input token count ({error.prompt_tokens}) exceeds the maximum number of tokens allowed ({error.max_context})."
        return {"error": {"code": error.status, "message": message, "status": status}}
    return {"error": {"code": error.status, "message": error.message, "status": status}}


def parse_reply(body: dict[str, Any]) -> Reply:
    return parse_reply_stream([(None, body)])


def parse_reply_stream(events: list[SSEEvent]) -> Reply:
    # each chunk is a GenerateContentResponse holding the next parts of the first candidate
    reply = Reply()
    for _, chunk in events:
        for candidate in (chunk.get("candidates") or [])[:1]:
            for part in (candidate.get("content") or {}).get("parts") or []:
                if "functionCall" in part:
                    call = part["functionCall"]
                    reply.tool_calls.append({"id": call.get("id"), "name": call.get("name"), "arguments": call.get("args")})
                elif part.get("thought"):
                    reply.reasoning += part.get("text", "")
                else:
                    reply.content += part.get("text", "")
            reply.finish_reason = candidate.get("finishReason") or reply.finish_reason
    return reply
