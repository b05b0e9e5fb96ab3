"""Sampled text -> the assistant message: reasoning, content and tool calls, in the model family's formats.

Tool-call formats (`TOOL_PARSERS`, the names `--tool-parser` takes), each a `ToolCallParser`:
  hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5, Qwen3; vLLM's `hermes`)
  qwen3_coder  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
  none         all text is content
Reasoning: a leading `<think>...</think>` (also when the prompt already opened the block) is split off.

Contract: never raises on any sampled text and never drops text. When the text has a tool-call marker that does
not parse, the whole text (reasoning split off) is returned as content with no tool calls, and `problem` says why;
the gateway records it on the row.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from polar_mitm.exchange import ToolCall
from polar_mitm.registry import Registry

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@dataclass
class ParsedOutput:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    problem: str | None = None  # why the tool calls could not be parsed (the text is then content)


class ToolCallParser(Protocol):
    """One tool-call format: sampled text with its reasoning split off -> (content, tool calls). Raises ValueError
    when the text has a call marker that does not parse (parse_output then keeps the whole text as content)."""

    def __call__(self, text: str, tools: list[dict[str, Any]], /) -> tuple[str | None, list[ToolCall]]: ...


def parse_output(text: str, tool_format: str = "hermes", tools: list[dict[str, Any]] | None = None, think_opened: bool = False) -> ParsedOutput:
    """Split sampled text; `tool_format` is a name in TOOL_PARSERS (another raises ConfigError, a ValueError);
    `think_opened`: the prompt ended inside an open `<think>` block."""
    parse_tool_calls = TOOL_PARSERS.get(tool_format)
    reasoning, rest = split_reasoning(text, think_opened)
    try:
        content, calls = parse_tool_calls(rest, tools or [])
    except ValueError as error:
        return ParsedOutput(content=rest, reasoning=reasoning, problem=f"{tool_format} tool call not parsed: {error}")
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls)


def split_reasoning(text: str, think_opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, the rest) — whitespace as Qwen3-style templates render it back."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        stripped = stripped[len(THINK_OPEN):]
    elif not think_opened:
        return None, text
    if THINK_CLOSE not in stripped:
        return stripped.strip("\n") or None, ""  # cut off while thinking
    inner, _, rest = stripped.partition(THINK_CLOSE)
    return inner.strip("\n") or None, rest.lstrip("\n")


def hermes(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    return _tagged(text, _hermes_calls)


def qwen3_coder(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    return _tagged(text, lambda tagged: _qwen3_coder_calls(tagged, tools))  # argument types come from the tools' schemas


def no_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    return text or None, []


def _tagged(text: str, calls_in: Callable[[str], list[ToolCall]]) -> tuple[str | None, list[ToolCall]]:
    """Calls in `<tool_call>` blocks after the content; no block: all text is content."""
    if TOOL_CALL_OPEN not in text:
        return text or None, []
    calls = calls_in(text)
    # the template renders content, a newline, then the calls: the newline belongs to the calls
    return text[: text.index(TOOL_CALL_OPEN)].rstrip("\n") or None, calls


TOOL_PARSERS: Registry[ToolCallParser] = Registry("tool parser", {"hermes": hermes, "qwen3_coder": qwen3_coder, "none": no_tool_calls})

# --tool-parser: a parser's name, or `auto`: the format the model's chat template writes tool calls in
AUTO = "auto"
TOOL_FORMATS = (AUTO, *TOOL_PARSERS.names())


def format_of_template(template: str) -> str | None:
    """The tool-call format a chat template renders, which is what the model was trained to sample: Qwen3-Coder's
    XML (`<function=NAME>`, checked first: it sits inside `<tool_call>` too), Hermes' `<tool_call>` JSON, or `none`
    for a template that renders no tools at all. None: the template renders tools, in a format no parser knows (a
    tool call sampled in it would come back as text)."""
    if "<function=" in template:
        return "qwen3_coder"
    if TOOL_CALL_OPEN in template:
        return "hermes"
    if not re.search(r"\btools\b", template):
        return "none"
    return None


def _remainder_check(text: str, blocks: list[re.Match[str]]) -> None:
    """Only whitespace may follow the first call, between calls and after the last."""
    end = text.index(TOOL_CALL_OPEN)
    for block in blocks:
        if text[end : block.start()].strip():
            raise ValueError(f"text between tool calls: {text[end:block.start()].strip()[:80]!r}")
        end = block.end()
    tail = text[end:]
    if TOOL_CALL_OPEN in tail:
        raise ValueError("a <tool_call> is not closed")
    if tail.strip():
        raise ValueError(f"text after the tool calls: {tail.strip()[:80]!r}")


def _hermes_calls(text: str) -> list[ToolCall]:
    blocks = list(_BLOCK.finditer(text))
    _remainder_check(text, blocks)
    calls = []
    for block in blocks:
        try:
            value = json.loads(block.group(1))
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON ({error})") from error
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("a tool call must be a JSON object with a string 'name'")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                raise ValueError(f"'arguments' is a string that is not JSON ({error})") from error
        if not isinstance(arguments, dict):
            raise ValueError("'arguments' must be a JSON object")
        calls.append(_call(value["name"], arguments))
    return calls


def _qwen3_coder_calls(text: str, tools: list[dict[str, Any]]) -> list[ToolCall]:
    blocks = list(_BLOCK.finditer(text))
    _remainder_check(text, blocks)
    schemas = {(tool.get("function") or {}).get("name"): ((tool.get("function") or {}).get("parameters") or {}).get("properties") or {} for tool in tools}
    calls = []
    for block in blocks:
        functions = list(_FUNCTION.finditer(block.group(1)))
        if len(functions) != 1 or block.group(1).replace(functions[0].group(0), "").strip():
            raise ValueError("a <tool_call> must hold exactly one <function=NAME>...</function>")
        name, body = functions[0].group(1).strip(), functions[0].group(2)
        properties = schemas.get(name, {})
        arguments = {}
        for parameter in _PARAMETER.finditer(body):
            key = parameter.group(1).strip()
            arguments[key] = _typed(parameter.group(2).removeprefix("\n").removesuffix("\n"), properties.get(key) or {})
        if _PARAMETER.sub("", body).strip():
            raise ValueError(f"text in <function={name}> outside its parameters")
        calls.append(_call(name, arguments))
    return calls


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as its schema's type (strings stay text; anything else is read as JSON if it is)."""
    kind = schema.get("type")
    if kind == "string" or kind is None and not value.strip():
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _call(name: str, arguments: dict[str, Any]) -> ToolCall:
    # arguments re-serialized for the client; the sampled ids themselves stay verbatim in the row and the prompt
    return ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", name=name, arguments=json.dumps(arguments, ensure_ascii=False))

