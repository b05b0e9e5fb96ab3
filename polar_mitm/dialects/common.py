"""Small helpers shared by the dialect modules."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from polar_mitm.exchange import DialectError


def load_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise DialectError(400, "invalid_request_error", "the request body is empty; a JSON object was expected")
    try:
        # orjson first: a harness body is 20-60 KB and stdlib json took ~0.4 ms of the event loop for it
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = _load_json_leniently(body)
    if not isinstance(data, dict):
        raise DialectError(400, "invalid_request_error", f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def _load_json_leniently(body: bytes) -> Any:
    """What orjson refuses, json may accept: integers beyond 64 bits, and lone surrogates (a JavaScript harness
    that cut a string inside an emoji sends "\\ud83d"), which become U+FFFD, since neither the engine's JSON nor the
    store takes them. NaN and Infinity are refused, as JSON and the providers do: the engine would get them as
    they are and fail. Otherwise json words the error."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DialectError(400, "invalid_request_error", f"the request body is not valid JSON: {error}") from error
    except RecursionError as error:
        raise DialectError(400, "invalid_request_error", "the request body nests JSON too deeply") from error
    return _without_lone_surrogates(data)


def _refuse_constant(name: str) -> Any:
    raise DialectError(400, "invalid_request_error", f"the request body is not valid JSON: {name} is not a JSON number")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads has joined the valid pairs already


def _without_lone_surrogates(data: Any) -> Any:
    """`data` with every lone surrogate in its strings and keys replaced by U+FFFD (a stack, not recursion: json
    parsed it, so it may nest as deep as the interpreter's limit)."""
    if isinstance(data, str):
        return _LONE_SURROGATE.sub("\ufffd", data)
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in [key for key in node if _LONE_SURROGATE.search(key)]:
                node[_LONE_SURROGATE.sub("\ufffd", key)] = node.pop(key)
        for at, value in list(node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()):
            if isinstance(value, str):
                node[at] = _LONE_SURROGATE.sub("\ufffd", value)
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return data


def expect(data: dict[str, Any], key: str, kinds: type | tuple[type, ...], required: bool = False, where: str = "") -> Any:
    """Type-check one field; bool is not accepted where a number is meant."""
    name = f"{where}{key}"
    if key not in data or data[key] is None:
        if required:
            raise DialectError(400, "invalid_request_error", f"missing required parameter '{name}'", name)
        return None
    value = data[key]
    kinds_tuple = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds_tuple:
        raise DialectError(400, "invalid_request_error", f"'{name}' must be {_kind_names(kinds_tuple)}, not a boolean", name)
    if not isinstance(value, kinds_tuple):
        raise DialectError(400, "invalid_request_error", f"'{name}' must be {_kind_names(kinds_tuple)}, not {type(value).__name__}", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


# one server-sent event: its `event:` name (None when it has none) and its `data:` JSON
SSEEvent = tuple[str | None, Any]


def sse_events(data: bytes) -> list[SSEEvent]:
    """The events of an SSE stream (the inverse of `sse`); the `[DONE]` sentinel is dropped."""
    events = []
    for block in data.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
        name, lines = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                lines.append(line[5:].strip())
        if lines and lines != ["[DONE]"]:
            events.append((name, json.loads("\n".join(lines))))
    return events
