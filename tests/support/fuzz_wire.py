"""Fuzz over the wire (issue 28): hypothesis-made requests for every dialect, sent through a real gateway process.

Each case is a whole HTTP request to a provider's host (never resolved: the gateway answers it): a body that is
structurally plausible for its API (the request's real shape, then mutated: wrong types, missing and junk keys,
extreme numbers, huge strings, lone surrogates, nested junk) and an encoding on the wire (plain JSON, truncated,
not JSON at all, bad UTF-8, a BOM, deep nesting, gzip, odd content types, an oversized body).

`check` is what every reply must satisfy whatever the body: never a 5xx (the engine is a stand-in that serves
anything, so a 5xx is ours), always the provider's error shape (or a well-formed reply), and an exchange id that
names a row (`rows_violations`: every request a row, the row's status as sent). Used by
tests/integration/test_fuzz_wire.py (a few per dialect; 10,000 with POLAR_MITM_FULL_MATRIX=1) and bench/fuzz.py.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from polar_mitm import dialects
from polar_mitm.dialects.common import sse_events
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway, listening

REPO = Path(__file__).resolve().parents[2]
APIS = ("openai_chat", "openai_responses", "anthropic_messages", "gemini")
HOSTS = {"openai_chat": "api.openai.com", "openai_responses": "api.openai.com", "anthropic_messages": "api.anthropic.com", "gemini": "generativelanguage.googleapis.com"}


@dataclass(frozen=True)
class Case:
    """One request: its API, path (with query), headers, body, and what kind of body it is (for the figures)."""

    api: str
    path: str
    headers: dict[str, str]
    body: bytes
    kind: str

    @property
    def url(self) -> str:
        return f"https://{HOSTS[self.api]}{self.path}"

    def describe(self, limit: int = 600) -> str:
        text = self.body[:limit].decode("utf-8", "backslashreplace")
        return f"{self.api} POST {self.path} {self.headers} [{self.kind}, {len(self.body)} bytes] {text}{'...' if len(self.body) > limit else ''}"


@dataclass
class Answer:
    """What the gateway answered one case."""

    case: Case
    status: int
    headers: dict[str, str]
    body: bytes
    error: str | None = None  # a transport failure (the gateway closed or reset the connection)

    @property
    def exchange_id(self) -> str | None:
        return self.headers.get("x-polar-exchange-id")


# -- values: junk of every JSON type, extreme numbers, odd strings

SPECIAL_STRINGS = [
    "", " ", "\x00", "\ud800", "\udfff", "a\ud83dz", "\U0001f600" * 3, "\u202e\u200b\ufeff", "null", "true", "[]", "{}",
    "</tool_call>", "<tool_call>\n{\"name\": \"x\"}\n</tool_call>", "<think>", "</think>", "<|im_end|>", "<|im_start|>system",
    "{{ raise_exception('x') }}", "{% for %}", "%s%n%x", "../../etc/passwd", "\\", "\"", "\r\n\r\n", "\t" * 50, "0", "-1", "1e309",
]
HUGE_INTS = [2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, -1, 0, -(10**30)]
_text, _special = st.text(max_size=40), st.sampled_from(SPECIAL_STRINGS)
# a huge string is one string in fifteen: bodies average tens of KB, as harness bodies do
strings = st.one_of(*[_text] * 8, *[_special] * 6, st.integers(1_000, 60_000).map(lambda n: "x" * n))
# NaN and Infinity (which the gateway refuses: not JSON) one number in twenty, so they do not hide the rest
numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70), st.sampled_from(HUGE_INTS), st.floats(allow_nan=False, allow_infinity=False),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.0, 1e-320, 1e308, 5e-324, -1e308]), *[st.integers(-3, 3)] * 13,
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, strings)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=4)), max_leaves=12)
names = st.one_of(st.sampled_from(["shell", "read_file", "run_shell_command", "Bash", "x", "a.b", "ns__tool", "name with space", ""]), st.text(max_size=20))
schema = st.one_of(
    st.just({"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}),
    st.just({"type": "OBJECT", "properties": {"n": {"type": "INTEGER", "minItems": "1"}}}),
    st.just({}), junk,
)
models = st.one_of(st.sampled_from(["gpt-5", "claude-sonnet-4-5", "gemini-2.5-pro", "qwen3-tiny", "qwen3-coder-plus"]), strings)
small_ints = st.integers(-5, 5000)


def optional(required: dict[str, Any], extra: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(required, optional=extra)


# -- each API's request shape

def _openai_chat() -> st.SearchStrategy[dict[str, Any]]:
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": strings}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "https://x/y.png", ""])})}),
        st.fixed_dictionaries({"type": strings}),
    )
    call = st.fixed_dictionaries({"id": strings, "type": st.just("function"), "function": st.fixed_dictionaries({"name": names, "arguments": st.one_of(st.just('{"cmd": "ls"}'), strings)})})
    message = st.one_of(
        optional({"role": st.sampled_from(["system", "developer", "user"]), "content": st.one_of(strings, st.lists(part, max_size=3))}, {"name": names}),
        optional({"role": st.just("assistant")}, {"content": st.one_of(st.none(), strings), "tool_calls": st.lists(call, max_size=2), "reasoning_content": strings}),
        optional({"role": st.just("tool"), "content": strings}, {"tool_call_id": strings}),
    )
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": optional({"name": names}, {"description": strings, "parameters": schema, "strict": st.booleans()})})
    return optional({"model": models, "messages": st.lists(message, min_size=1, max_size=4)}, {
        "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "max_tokens": small_ints,
        "max_completion_tokens": small_ints, "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "n": st.integers(0, 3),
        "tools": st.lists(tool, max_size=3), "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": names})})),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "stop": st.one_of(strings, st.lists(strings, max_size=3)), "seed": st.integers(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]),
        "parallel_tool_calls": st.booleans(), "reasoning_effort": st.sampled_from(["low", "medium", "high", "minimal"]), "user": strings, "metadata": junk,
    })


def _openai_responses() -> st.SearchStrategy[dict[str, Any]]:
    content_part = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": strings}),
        st.fixed_dictionaries({"type": st.just("input_image"), "image_url": strings}),
        st.fixed_dictionaries({"type": st.just("refusal"), "refusal": strings}),
    )
    item = st.one_of(
        optional({"role": st.sampled_from(["user", "assistant", "system", "developer"]), "content": st.one_of(strings, st.lists(content_part, max_size=3))}, {"type": st.just("message")}),
        optional({"type": st.just("function_call"), "call_id": strings, "name": names, "arguments": st.one_of(st.just('{"cmd": "ls"}'), strings)}, {"namespace": names}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": strings, "output": st.one_of(strings, st.lists(content_part, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("custom_tool_call"), "call_id": strings, "name": names, "input": strings}),
        st.fixed_dictionaries({"type": st.just("custom_tool_call_output"), "call_id": strings, "output": strings}),
        optional({"type": st.just("reasoning"), "summary": st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": strings}), max_size=2)}, {"encrypted_content": strings, "content": junk}),
        st.fixed_dictionaries({"type": st.just("local_shell_call"), "call_id": strings, "action": st.fixed_dictionaries({"type": st.just("exec"), "command": st.lists(strings, max_size=3)})}),
        st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "additional_tools", "configuration_update", "tool_search_call", "web_search_call"]), "id": strings}),
    )
    tool = st.one_of(
        optional({"type": st.just("function"), "name": names}, {"parameters": schema, "description": strings, "strict": st.booleans(), "defer_loading": st.booleans()}),
        optional({"type": st.just("custom"), "name": names}, {"format": st.one_of(st.just({"type": "text"}), st.just({"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}), junk)}),
        st.fixed_dictionaries({"type": st.sampled_from(["local_shell", "web_search", "web_search_preview", "tool_search", "file_search", "image_generation"])}),
        st.fixed_dictionaries({"type": st.just("namespace"), "name": names, "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": names}), max_size=2)}),
    )
    return optional({"model": models, "input": st.one_of(strings, st.lists(item, min_size=1, max_size=4))}, {
        "instructions": strings, "stream": st.booleans(), "tools": st.lists(tool, max_size=3),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "allowed_tools"]), "name": names}), junk),
        "max_output_tokens": small_ints, "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_logprobs": st.integers(0, 20),
        "reasoning": optional({}, {"effort": st.sampled_from(["low", "medium", "high", "none", "xhigh"]), "summary": st.sampled_from(["auto", "detailed", "concise"])}),
        "text": optional({}, {"format": st.sampled_from([{"type": "text"}, {"type": "json_schema", "name": "x", "schema": {"type": "object"}}, {"type": "json_object"}]), "verbosity": st.sampled_from(["low", "high"])}),
        "include": st.lists(st.sampled_from(["reasoning.encrypted_content", "message.output_text.logprobs", "x"]), max_size=2),
        "store": st.booleans(), "metadata": junk, "previous_response_id": st.sampled_from([None, None, None, None, "resp_1"]), "background": st.booleans(), "parallel_tool_calls": st.booleans(),
        "prompt_cache_key": strings, "truncation": st.sampled_from(["auto", "disabled"]),
    })


def _anthropic_messages() -> st.SearchStrategy[dict[str, Any]]:
    block = st.one_of(
        optional({"type": st.just("text"), "text": strings}, {"cache_control": st.just({"type": "ephemeral"})}),
        st.fixed_dictionaries({"type": st.just("image"), "source": st.one_of(
            st.fixed_dictionaries({"type": st.just("base64"), "media_type": st.just("image/png"), "data": st.just("iVBORw0KGgo=")}),
            st.fixed_dictionaries({"type": st.sampled_from(["url", "file"]), "url": strings}),
        )}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": strings, "name": names, "input": junk}),
        optional({"type": st.just("tool_result"), "tool_use_id": strings}, {"content": st.one_of(strings, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": strings}), max_size=2), junk), "is_error": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("thinking"), "thinking": strings, "signature": strings}),
        st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": strings}),
        st.fixed_dictionaries({"type": st.sampled_from(["document", "server_tool_use", "web_search_tool_result", "search_result"])}),
    )
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": st.one_of(strings, st.lists(block, max_size=3))})
    tool = st.one_of(
        optional({"name": names, "input_schema": schema}, {"description": strings, "type": st.just("custom"), "cache_control": st.just({"type": "ephemeral"})}),
        st.fixed_dictionaries({"type": st.sampled_from(["web_search_20250305", "bash_20250124", "text_editor_20250124"]), "name": names}),
    )
    return optional({"model": models, "max_tokens": small_ints, "messages": st.lists(message, min_size=1, max_size=4)}, {
        "system": st.one_of(strings, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": strings}), max_size=2)),
        "stream": st.booleans(), "tools": st.lists(tool, max_size=3),
        "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}, optional={"name": names, "disable_parallel_tool_use": st.booleans()}),
        "thinking": optional({"type": st.sampled_from(["enabled", "adaptive", "disabled"])}, {"budget_tokens": small_ints, "display": st.sampled_from(["summarized", "omitted"])}),
        "temperature": st.floats(0, 1), "top_p": st.floats(0, 1), "top_k": small_ints, "stop_sequences": st.lists(strings, max_size=3),
        "metadata": st.fixed_dictionaries({"user_id": strings}), "chat_template_kwargs": junk, "seed": st.integers(), "service_tier": strings,
    })


def _gemini() -> st.SearchStrategy[dict[str, Any]]:
    part = st.one_of(
        optional({"text": strings}, {"thought": st.booleans(), "thoughtSignature": st.one_of(st.just("c2lnbmF0dXJl"), strings)}),
        optional({"functionCall": optional({"name": names}, {"args": junk, "id": strings})}, {"thoughtSignature": strings}),
        st.fixed_dictionaries({"functionResponse": optional({"name": names}, {"response": junk, "id": strings})}),
        st.fixed_dictionaries({"inlineData": st.fixed_dictionaries({"mimeType": st.just("image/png"), "data": st.sampled_from(["iVBORw0KGgo=", "!!notbase64"])})}),
        st.fixed_dictionaries({"fileData": st.fixed_dictionaries({"fileUri": strings})}),
        st.fixed_dictionaries({"executableCode": junk}),
    )
    content = optional({"parts": st.lists(part, min_size=1, max_size=3)}, {"role": st.sampled_from(["user", "model", "user", "model", "function", "system"])})
    declaration = optional({"name": names}, {"description": strings, "parameters": schema, "parametersJsonSchema": schema, "response": schema})
    tool = st.one_of(
        st.fixed_dictionaries({"functionDeclarations": st.lists(declaration, max_size=3)}),
        st.sampled_from(["googleSearch", "codeExecution", "urlContext", "google_search"]).map(lambda name: {name: {}}),
    )
    generation = optional({}, {
        "temperature": st.floats(0, 2), "topP": st.floats(0, 1), "topK": small_ints, "maxOutputTokens": small_ints, "stopSequences": st.lists(strings, max_size=3),
        "candidateCount": st.integers(0, 3), "responseMimeType": st.sampled_from(["application/json", "text/plain", "text/x.enum"]), "responseSchema": schema,
        "responseJsonSchema": schema, "thinkingConfig": optional({}, {"thinkingBudget": st.integers(-1, 30000), "includeThoughts": st.booleans(), "thinkingLevel": strings}),
        "seed": st.integers(), "responseLogprobs": st.booleans(), "logprobs": st.integers(0, 20), "responseModalities": st.lists(st.sampled_from(["TEXT", "IMAGE"]), max_size=2),
    })
    config = st.fixed_dictionaries({"functionCallingConfig": optional({}, {"mode": st.sampled_from(["AUTO", "ANY", "NONE", "VALIDATED", "auto"]), "allowedFunctionNames": st.lists(names, max_size=2)})})
    return optional({"contents": st.lists(content, min_size=1, max_size=4)}, {
        "systemInstruction": st.one_of(strings, st.fixed_dictionaries({"parts": st.lists(st.fixed_dictionaries({"text": strings}), max_size=2)}, optional={"role": strings})),
        "tools": st.lists(tool, max_size=2), "toolConfig": config, "generationConfig": generation, "generation_config": generation,
        "safetySettings": st.lists(junk, max_size=2), "cachedContent": strings, "labels": junk,
    })


REQUESTS: dict[str, Callable[[], st.SearchStrategy[dict[str, Any]]]] = {
    "openai_chat": _openai_chat, "openai_responses": _openai_responses, "anthropic_messages": _anthropic_messages, "gemini": _gemini,
}


# -- each API's paths (the count endpoints included; Gemini's model is in the path, fuzzed too)

gemini_models = st.one_of(
    st.sampled_from(["gemini-2.5-pro", "gemini-2.5-flash", "qwen3-tiny"]),
    st.text(min_size=1, max_size=30).map(lambda text: quote(text, safe="")),
    st.sampled_from(["%00", "%ZZ", "%F0%9F%98%80", "%ff%fe", "..", "%2e%2e", "a%3Ab"]),
)


def paths(api: str) -> st.SearchStrategy[str]:
    if api == "openai_chat":
        return st.sampled_from(["/v1/chat/completions", "/compatible-mode/v1/chat/completions", "/v1/chat/completions?x=%ff"])
    if api == "openai_responses":
        return st.sampled_from(["/v1/responses", "/v1/responses", "/v1/responses/input_tokens", "/backend-api/codex/responses"])
    if api == "anthropic_messages":
        return st.sampled_from(["/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens", "/v1/messages/count_tokens?beta=true"])
    version = st.sampled_from(["v1beta", "v1beta", "v1", "v1alpha"])
    method = st.sampled_from([":generateContent", ":generateContent", ":streamGenerateContent?alt=sse", ":streamGenerateContent?alt=sse", ":streamGenerateContent", ":countTokens"])
    return st.tuples(version, gemini_models, method).map(lambda t: f"/{t[0]}/models/{t[1]}{t[2]}")


# -- mutations of a plausible body, then its encoding on the wire

def _locations(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _locations(inner, (*at, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _locations(inner, (*at, index))
    return found


def _replace(value: Any, at: tuple[Any, ...], new: Callable[[Any], Any]) -> Any:
    if not at:
        return new(value)
    head, rest = at[0], at[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


_DELETED = object()


def _drop_deleted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_deleted(v) for k, v in value.items() if v is not _DELETED}
    if isinstance(value, list):
        return [_drop_deleted(v) for v in value if v is not _DELETED]
    return value


@st.composite
def mutated(draw: st.DrawFn, plausible: st.SearchStrategy[Any]) -> Any:
    """A plausible body with 0-4 changes anywhere in it: a node replaced by junk, deleted, wrapped, stringified,
    a junk key added, a node repeated."""
    body = draw(plausible)
    for _ in range(draw(st.integers(0, 4))):
        places = _locations(body)
        at = places[draw(st.integers(0, len(places) - 1))]
        op = draw(st.sampled_from(["junk", "junk", "delete", "none", "wrap", "stringify", "add_key", "repeat"]))
        if op == "junk":
            replacement = draw(junk)
            body = _replace(body, at, lambda _, replacement=replacement: replacement)
        elif op == "delete" and at:
            body = _drop_deleted(_replace(body, at, lambda _: _DELETED))
        elif op == "none":
            body = _replace(body, at, lambda _: None)
        elif op == "wrap":
            body = _replace(body, at, lambda v: [v])
        elif op == "stringify":
            body = _replace(body, at, lambda v: json.dumps(v, allow_nan=True))
        elif op == "add_key":
            key, extra = draw(strings), draw(junk)
            body = _replace(body, at, lambda v, key=key, extra=extra: {**v, key: extra} if isinstance(v, dict) else v)
        elif op == "repeat":
            times = draw(st.integers(2, 50))
            body = _replace(body, at, lambda v, times=times: [v] * times if not isinstance(v, list) else v * times)
    return body


def _dumps(value: Any, ascii_only: bool) -> bytes:
    # lone surrogates: escaped with ensure_ascii, raw (invalid UTF-8) without
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


NON_JSON = [
    b"", b" ", b"null", b"[]", b"0", b'"text"', b"true", b"{", b"}", b"{}", b"[{}]", b"<xml/>", b"model=gpt&messages=hi", b"\x00" * 64,
    b"\xff\xfe{\x00}\x00", b"\xef\xbb\xbf", b"{'model': 'x'}", b'{"a":1}{"b":2}', b"NaN", b"-Infinity", b"1e999", b'{"model":"x",}',
    b"--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ngpt\r\n--x--\r\n",
]
CONTENT_TYPES = ["application/json", "application/json", "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/octet-stream", ""]


@st.composite
def cases(draw: st.DrawFn, api: str, oversized_bytes: int = 2_000_000) -> Case:
    """One request for `api`: a mutated plausible body (mostly) in one of several wire encodings."""
    path = draw(paths(api))
    body_value = draw(mutated(REQUESTS[api]()))
    ascii_only = draw(st.sampled_from([True, True, True, False]))  # raw lone surrogates (invalid UTF-8) one in four
    # mostly plausible JSON; an oversized body (1-2 MB) one in ~80, so a run of 10,000 stays in minutes
    kind = draw(st.sampled_from(["json"] * 40 + ["truncated", "non_json", "bad_utf8", "bom", "deep", "duplicate_keys", "gzip", "bad_gzip", "top_level_junk"] * 4 + ["oversized"]))
    headers = {"content-type": draw(st.sampled_from(CONTENT_TYPES))}
    if kind == "json":
        body = _dumps(body_value, ascii_only)
    elif kind == "truncated":
        whole = _dumps(body_value, ascii_only)
        body = whole[: draw(st.integers(0, max(0, len(whole) - 1)))]
    elif kind == "non_json":
        body = draw(st.one_of(st.sampled_from(NON_JSON), st.binary(max_size=200)))
    elif kind == "bad_utf8":
        whole = _dumps(body_value, False)
        at = draw(st.integers(0, len(whole)))
        body = whole[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80\x80"])) + whole[at:]
    elif kind == "bom":
        body = b"\xef\xbb\xbf" + _dumps(body_value, ascii_only)
    elif kind == "deep":
        depth = draw(st.sampled_from([200, 1_000, 1_025, 5_000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        inner = opener * depth + b"1" + closer * depth
        body = b'{"model": "m", "messages": ' + inner + b', "contents": ' + inner + b', "input": ' + inner + b"}"
    elif kind == "duplicate_keys":
        whole = _dumps(body_value, ascii_only)
        body = whole[:-1] + b', "model": 5, "stream": "yes", "messages": null}' if whole.endswith(b"}") else whole
    elif kind in ("gzip", "bad_gzip"):
        whole = _dumps(body_value, ascii_only)
        body = gzip.compress(whole) if kind == "gzip" else b"\x1f\x8b\x08\x00garbage" + whole[:50]
        headers["content-encoding"] = draw(st.sampled_from(["gzip", "gzip", "br", "deflate", "zstd", "x-junk"]))
    elif kind == "oversized":
        size = draw(st.integers(oversized_bytes // 2, oversized_bytes))
        padded = body_value if isinstance(body_value, dict) else {"value": body_value}
        body = _dumps({**padded, "pad": "\u00e9" * (size // 2)}, ascii_only)
    else:  # top_level_junk
        body = _dumps(draw(st.one_of(st.lists(junk, max_size=3), scalars)), ascii_only)
    if len(body) > oversized_bytes:  # a mutation that repeated a huge string: still oversized, cut to size
        body, kind = body[:oversized_bytes], "oversized_truncated"
    if not headers["content-type"]:
        del headers["content-type"]
    return Case(api, path, headers, body, kind)


def generate(api: str, count: int, seed: int | None = None) -> list[Case]:
    """`count` cases for `api`, the same ones every run (derandomized, or from `seed`); no example database."""
    made: list[Case] = []

    @settings(
        max_examples=count, database=None, deadline=None, derandomize=seed is None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
    )
    @given(cases(api))
    def collect(case: Case) -> None:
        made.append(case)

    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    while len(made) < count:  # hypothesis may stop early on a small space; never here, but be exact
        collect()
    return made[:count]


# -- sending a batch over keep-alive connections

def client(gateway: Gateway, session_id: str, connections: int = 4, timeout: float = 120) -> httpx.Client:
    """What a harness is: HTTPS_PROXY with session credentials, the gateway's CA."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=timeout, limits=limits)


def send(http: httpx.Client, case: Case) -> Answer:
    try:
        response = http.post(case.url, content=case.body, headers=case.headers)
    except httpx.HTTPError as error:
        return Answer(case, 0, {}, b"", f"{type(error).__name__}: {error}")
    return Answer(case, response.status_code, {k.lower(): v for k, v in response.headers.items()}, response.content)


def send_all(http: httpx.Client, batch: Iterable[Case], concurrency: int = 4) -> list[Answer]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda case: send(http, case), batch))


# -- what every answer must be

def error_shape_violation(api: str, status: int, body: Any) -> str | None:
    """Why `body` is not `api`'s provider error shape for HTTP `status`, or None."""
    if not isinstance(body, dict):
        return f"an error body that is not an object: {body!r:.200}"
    error = body.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return f"no error.message: {body!r:.300}"
    if api in ("openai_chat", "openai_responses"):
        if set(body) != {"error"} or not isinstance(error.get("type"), str) or not {"message", "type", "param", "code"} <= set(error):
            return f"not OpenAI's {{error: {{message, type, param, code}}}}: {body!r:.300}"
    elif api == "anthropic_messages":
        if body.get("type") != "error" or set(body) != {"type", "error"} or not isinstance(error.get("type"), str):
            return f"not Anthropic's {{type: error, error: {{type, message}}}}: {body!r:.300}"
    elif set(body) != {"error"} or error.get("code") != status or not isinstance(error.get("status"), str) or not error["status"].isupper():
        return f"not Google's {{error: {{code={status}, message, status}}}}: {body!r:.300}"
    return None


def _stream_violation(api: str, data: bytes) -> str | None:
    try:
        events = sse_events(data)
    except (ValueError, UnicodeDecodeError) as error:
        return f"a stream that is not SSE JSON: {error}"
    for name, event in events:
        failed = name in ("error", "response.failed") or (isinstance(event, dict) and ("error" in event and event.get("error") is not None and api != "openai_responses"))
        if failed:
            return f"a 200 stream that ended in an error: {event!r:.400}"
    if not events:
        return "an empty 200 stream"
    reply = dialects.get(api).parse_reply_stream(events)
    return f"the stream reads back as an error: {reply.error}" if reply.error else None


def check(answer: Answer) -> list[str]:
    """Every invariant one answer breaks (empty: all held)."""
    case, problems = answer.case, []
    if answer.error is not None:
        return [f"no HTTP answer: {answer.error}"]
    if answer.status >= 500:
        problems.append(f"HTTP {answer.status} for a body")
    if not answer.exchange_id:
        problems.append(f"HTTP {answer.status} without x-polar-exchange-id (no row)")
    content_type = answer.headers.get("content-type", "")
    if answer.status == 200 and content_type.startswith("text/event-stream"):
        if (why := _stream_violation(case.api, answer.body)) is not None:
            problems.append(why)
        return problems
    try:
        body = json.loads(answer.body)
    except ValueError:
        return [*problems, f"HTTP {answer.status} {content_type!r} with a body that is not JSON: {answer.body[:200]!r}"]
    if answer.status == 200:
        if isinstance(body, dict) and body.get("error"):
            problems.append(f"HTTP 200 with an error body: {body!r:.300}")
        elif isinstance(body, dict) and not ({"input_tokens", "totalTokens"} & set(body)):
            reply = dialects.get(case.api).parse_reply(body)
            if reply.error:
                problems.append(f"HTTP 200 that reads back as an error: {reply.error}")
    elif (why := error_shape_violation(case.api, answer.status, body)) is not None:
        problems.append(why)
    return problems


def rows_violations(gateway: Gateway, session_id: str, answers: list[Answer]) -> list[str]:
    """Every request a row (by the exchange id each answer named), no row without a request, each row's
    http_status the status its client got."""
    rows = {row["exchange_id"]: row for row in gateway.rows("SELECT exchange_id, http_status, status FROM exchanges WHERE session_id = ?", [session_id])}
    problems = []
    if len(rows) != len(answers):
        problems.append(f"{len(answers)} requests but {len(rows)} rows in session {session_id}")
    for answer in answers:
        row = rows.get(answer.exchange_id or "")
        if row is None:
            problems.append(f"no row for HTTP {answer.status} ({answer.exchange_id}): {answer.case.describe(200)}")
        elif row["http_status"] != answer.status:
            problems.append(f"row {answer.exchange_id} has http_status {row['http_status']}, its client got {answer.status}")
    return problems


@dataclass
class Figures:
    """What one dialect's batch did, for bench/fuzz_results.md."""

    api: str
    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    violations: list[str] = field(default_factory=list)
    generate_s: float = 0.0
    send_s: float = 0.0

    def add(self, answers: list[Answer]) -> None:
        self.requests += len(answers)
        for answer in answers:
            self.statuses[f"{answer.status // 100}xx" if answer.status else "no answer"] += 1
            self.kinds[answer.case.kind] += 1
            self.violations += [f"{why}\n    request: {answer.case.describe()}" for why in check(answer)]


# -- the gateway and its stand-in engine

class StubEngine:
    """bench/stub_upstream.py (a stand-in engine: a fixed vLLM-shaped reply with token ids, at once) in a process of
    its own, so it takes no time from the test's client. Named as a stand-in: the gateway is what is fuzzed."""

    def __init__(self, log: Path, model_dir: str | None = None):
        """`model_dir`: also serve token-in /completions, for a gateway in tokens mode (it renders with that model's
        chat template)."""
        self.port = free_port()
        command = [sys.executable, str(REPO / "bench" / "stub_upstream.py"), "--port", str(self.port), "--delay-ms", "0", *(["--model-dir", model_dir] if model_dir else [])]
        self.process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not listening(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stand-in engine did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def start_gateway(base: Path, upstream: str, *args: str) -> Gateway:
    return Gateway(port=free_port(), db=base / "fuzz.duckdb", confdir=base / "confdir", upstream=upstream, args=list(args)).start()


def tokens_model_dir() -> str:
    """The bundled local engine's model directory (its tokenizer and chat template), for tokens mode."""
    from polar_mitm.local_engine import build

    return str(build.model_dir(build.engine_home(), build.DEFAULT_MODEL))


def serves(gateway: Gateway, session_id: str) -> bool:
    """The gateway is alive and still answers a plain request with a reply."""
    if gateway.process is None or gateway.process.poll() is not None:
        return False
    with client(gateway, session_id, connections=1, timeout=60) as http:
        response = http.post("https://api.openai.com/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "still there?"}]})
    return response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None
