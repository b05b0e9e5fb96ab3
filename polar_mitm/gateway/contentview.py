"""mitmproxy content view "LLM": a model call's request and response as a conversation, for all four APIs.

Request: what the gateway sends the engine — the dialect's own parse into the chat form — by role: system
prompt, messages, tool calls and tool results, reasoning; the tools as collapsed signatures; the fields the
gateway ignored or normalized. Response: the assistant turn as the client got it, then the sampled token ids and
logprobs of the stored row (found by the response's `x-polar-exchange-id` header). Without a row (a flow file
opened elsewhere), the reply is read from the provider's JSON body or SSE stream itself. Each dialect reads its
own provider's bodies and streams (`parse`, `parse_reply`): the view has no parser of its own.

Token counts: the prompt and sampled totals are the engine's own, from the row. Per message, `~N tok` counts
the message's text (no template tokens) with the engine's tokenizer, when it is on this machine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import contentviews, http
from mitmproxy.contentviews import Contentview, Metadata

from polar_mitm import dialects
from polar_mitm.dialects import Dialect, Reply, read_reply
from polar_mitm.exchange import DialectError

log = logging.getLogger("polar_mitm.contentview")

EXCHANGE_HEADER = "x-polar-exchange-id"
MAX_TOKEN_ROWS = 2000
DESCRIPTION_CHARS = 100
RULE = "──"

# (sql, params) -> (columns, rows): Store.query in the gateway, polar_mitm.store.query elsewhere
Reader = Callable[[str, list[Any]], tuple[list[str], list[Any]]]

ROW_SQL = """
    SELECT exchange_id, session_id, seq, api, action, status, error, http_status, harness, replay, model_engine,
           engine_response ->> '$.count' AS counted,
           prompt_token_ids, completion_token_ids, completion_logprobs, finish_reason, response_body,
           date_diff('millisecond', engine_started_at, engine_ended_at) AS engine_ms,
           date_diff('millisecond', started_at, ended_at) AS total_ms
    FROM exchanges WHERE exchange_id = ?"""


class LLMContentview(Contentview):
    name = "LLM"
    syntax_highlight = "none"

    def __init__(self, read: Reader | None = None, tokenizer: Any = None):
        """`read` answers SQL on the store (default: the running gateway's); `tokenizer` as for the assembler's
        `load_tokenizer` (default: the local engine's tokenizer for the row's engine model)."""
        self._read = read
        self._tokenizer_spec = tokenizer
        self._tokenizers: dict[str | None, Any] = {}

    def render_priority(self, data: bytes, metadata: Metadata) -> float:
        if not data or not isinstance(metadata.flow, http.HTTPFlow) or metadata.http_message is None:
            return -1
        return 2 if _dialect_of(metadata.flow) is not None else -1  # above JSON (1) for model calls

    def prettify(self, data: bytes, metadata: Metadata) -> str:
        flow = metadata.flow
        if not isinstance(flow, http.HTTPFlow) or (dialect := _dialect_of(flow)) is None:
            raise ValueError("not a model API call")
        row = self.row(flow)
        if metadata.http_message is flow.request:
            return self.render_request(dialect, flow, data, row)
        return self.render_response(dialect, flow, data, row)

    # -- the stored exchange
    def row(self, flow: http.HTTPFlow) -> dict[str, Any] | None:
        exchange_id = flow.response.headers.get(EXCHANGE_HEADER) if flow.response is not None else None
        read = self._read or _gateway_reader()
        if not exchange_id or read is None:
            return None
        try:
            columns, rows = read(ROW_SQL, [exchange_id])
        except Exception as error:  # noqa: BLE001 - the view still renders from the bodies
            log.warning(f"polar contentview: cannot read exchange {exchange_id}: {error}")
            return None
        return dict(zip(columns, rows[0], strict=True)) if rows else None

    def tokenizer(self, row: dict[str, Any] | None) -> Any:
        model = row.get("model_engine") if row else None
        key = None if self._tokenizer_spec is not None else model
        if key not in self._tokenizers:
            try:
                from polar_mitm.assembler.diagnosis import load_tokenizer

                self._tokenizers[key] = load_tokenizer(self._tokenizer_spec, model)
            except Exception as error:  # noqa: BLE001 - counts fall back to characters
                log.warning(f"polar contentview: no tokenizer for {model!r}: {error}")
                self._tokenizers[key] = None
        return self._tokenizers[key]

    # -- request
    def render_request(self, dialect: Dialect, flow: http.HTTPFlow, data: bytes, row: dict[str, Any] | None) -> str:
        path = flow.request.path.split("?", 1)[0]
        out = []
        try:
            parsed = dialect.parse(data, path, dict(flow.request.query.items(multi=True)))
        except DialectError as error:
            out.append(f"{dialect.API} request · refused by the gateway: {error.status} {error.kind}: {error.message}")
            out += _row_lines(row)
            return "\n".join([*out, "", _pretty_json(data)])
        chat = parsed.chat
        messages, tools = chat.get("messages") or [], chat.get("tools") or []
        tokenizer = self.tokenizer(row)
        out.append(f"{dialect.API} request · model {parsed.model}" + (" · stream" if parsed.stream else "") + ("" if parsed.action == "generate" else f" · {parsed.action}"))
        out += _row_lines(row)
        if row and row.get("prompt_token_ids"):
            size = f"prompt {len(row['prompt_token_ids']):,} tokens (the engine's)"
        elif tokenizer is not None:
            size = f"prompt ~{sum(_count(tokenizer, _message_text(m)) for m in messages):,} tokens of message text"
        else:
            size = f"prompt {sum(len(_message_text(m)) for m in messages):,} chars"
        out.append(f"{size} · {len(messages)} messages · {len(tools)} tools")
        settings = {k: v for k, v in chat.items() if k not in ("messages", "tools", "model", "stream")}
        if settings:
            out.append("settings: " + ", ".join(f"{k}={_compact(v)}" for k, v in settings.items()))
        if parsed.ignored:
            out.append("ignored: " + ", ".join(parsed.ignored))
        for note in parsed.normalizations:
            out.append(f"normalized: {note}")
        if tools:
            out += ["", f"{RULE} tools ({len(tools)}) {RULE}"]
            for tool in tools:
                function = tool.get("function") or tool
                out.append(f"  {tool_signature(function)}")
                if description := (function.get("description") or "").strip():
                    out.append(f"      {_first_line(description, DESCRIPTION_CHARS)}")
        names = {call.get("id"): (call.get("function") or {}).get("name") for m in messages for call in m.get("tool_calls") or []}
        for index, message in enumerate(messages):
            out += ["", _message_header(index, message, names, tokenizer)]
            out += _message_body(message)
        return "\n".join(out)

    # -- response
    def render_response(self, dialect: Dialect, flow: http.HTTPFlow, data: bytes, row: dict[str, Any] | None) -> str:
        status = flow.response.status_code if flow.response is not None else None
        out = [f"{dialect.API} response · HTTP {status}" + (f" · {row['status']}" if row else " · no stored row")]
        out += _row_lines(row)
        if row is not None:
            # the reply as the client got it (provider tool call ids), from the provider-shaped body the row keeps
            body = row.get("response_body")
            reply = read_reply(dialect, body.encode() if isinstance(body, str) else json.dumps(body).encode()) if body else Reply()
            if row.get("error"):
                reply.error = row["error"]
            reply.finish_reason = row.get("finish_reason") or reply.finish_reason
            sampled = row.get("completion_token_ids") or []
            facts = [f"finish {reply.finish_reason}"] if reply.finish_reason else []
            if row.get("prompt_token_ids"):
                facts += [f"{len(sampled):,} sampled tokens", f"prompt {len(row['prompt_token_ids']):,} tokens"]
            if row.get("action") == "count_tokens" and row.get("counted") is not None:
                facts.append(f"count_tokens: {int(row['counted']):,} prompt tokens (the engine's)")
            if row.get("engine_ms") is not None:
                facts.append(f"engine {row['engine_ms']} ms")
            if row.get("total_ms") is not None:
                facts.append(f"total {row['total_ms']} ms")
            if facts:
                out.append(" · ".join(facts))
        else:
            content_type = flow.response.headers.get("content-type", "") if flow.response is not None else ""
            reply = read_reply(dialect, data, content_type)
            if reply.finish_reason:
                out.append(f"finish {reply.finish_reason}")
        if reply.error:
            out += ["", f"error: {reply.error}"]
        if reply.content or reply.reasoning or reply.tool_calls:
            out += ["", f"{RULE} assistant {RULE}"]
            out += _message_body({"content": reply.content, "reasoning": reply.reasoning, "tool_calls": [_as_chat_call(c) for c in reply.tool_calls]})
        if row is not None and row.get("completion_token_ids"):
            out += ["", *token_table(row["completion_token_ids"], row.get("completion_logprobs") or [], self.tokenizer(row))]
        return "\n".join(out)


def token_table(ids: list[int], logprobs: list[float], tokenizer: Any = None) -> list[str]:
    """The sampled tokens, one a line: index, token id, logprob, the token's text (when a tokenizer is here)."""
    header = f"{RULE} sampled tokens ({len(ids):,})"
    if logprobs:
        low = min(range(len(logprobs)), key=logprobs.__getitem__)
        header += f" · logprob mean {sum(logprobs) / len(logprobs):.3f}, min {logprobs[low]:.3f} at {low}"
    out = [f"{header} {RULE}", f"{'index':>7}  {'token id':>8}  {'logprob':>9}  text"]
    for index, token in enumerate(ids[:MAX_TOKEN_ROWS]):
        logprob = f"{logprobs[index]:9.4f}" if index < len(logprobs) else " " * 9
        text = repr(tokenizer.text([token])) if tokenizer is not None else ""
        out.append(f"{index:>7}  {token:>8}  {logprob}  {text}")
    if len(ids) > MAX_TOKEN_ROWS:
        out.append(f"  … {len(ids) - MAX_TOKEN_ROWS:,} more (polar-mitm sql: completion_token_ids of this exchange)")
    return out


def tool_signature(function: dict[str, Any]) -> str:
    """`name(a: string, b?: integer[])` from a JSON-schema tool: the schema collapsed to one line."""
    schema = function.get("parameters") or function.get("parametersJsonSchema") or function.get("input_schema") or {}
    properties = schema.get("properties") or {} if isinstance(schema, dict) else {}
    required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
    params = [f"{name}{'' if name in required else '?'}: {_schema_type(spec)}" for name, spec in properties.items()]
    return f"{function.get('name')}({', '.join(params)})"


def _schema_type(spec: Any) -> str:
    if not isinstance(spec, dict):
        return "any"
    if "enum" in spec:
        values = [json.dumps(v) for v in spec["enum"][:4]]
        return "|".join(values) + ("|…" if len(spec["enum"]) > 4 else "")
    for union in ("anyOf", "oneOf"):
        if isinstance(spec.get(union), list):
            return "|".join(_schema_type(s) for s in spec[union])
    kind = spec.get("type", "any")
    if isinstance(kind, list):
        return "|".join(map(str, kind))
    if kind == "array":
        return f"{_schema_type(spec.get('items'))}[]"
    if kind == "object" and spec.get("properties"):
        return "{" + ", ".join(spec["properties"]) + "}"
    return str(kind)


# -- chat-form messages
def _message_text(message: dict[str, Any]) -> str:
    parts = [_content_text(message.get("content"))]
    parts.append(message.get("reasoning_content") or message.get("reasoning") or "")
    parts += [(call.get("function") or {}).get("arguments") or "" for call in message.get("tool_calls") or []]
    return "\n".join(p for p in parts if p)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict):
                texts.append(f"[{part.get('type', 'part')}]")
        return "\n".join(texts)
    return json.dumps(content, ensure_ascii=False)


def _message_header(index: int, message: dict[str, Any], tool_names: dict[Any, Any], tokenizer: Any) -> str:
    role = message.get("role", "?")
    label = role
    if role == "tool":
        call_id = message.get("tool_call_id")
        label = f"tool result · {tool_names.get(call_id) or '?'} · {call_id}"
    text = _message_text(message)
    size = f"{len(text):,} chars" + (f" · ~{_count(tokenizer, text):,} tok" if tokenizer is not None else "")
    return f"{RULE} [{index}] {label} · {size} {RULE}"


def _message_body(message: dict[str, Any]) -> list[str]:
    out = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out.append("  reasoning:")
        out += _indent(reasoning, "    ")
    if text := _content_text(message.get("content")):
        out += _indent(text, "  ")
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        out.append(f"  → {function.get('name')}({_arguments(function.get('arguments'))})  [{call.get('id')}]")
    return out


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, ensure_ascii=False)


def _as_chat_call(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": call.get("id"), "function": {"name": call.get("name"), "arguments": call.get("arguments")}}


def _indent(text: str, prefix: str) -> list[str]:
    return [prefix + line for line in text.splitlines()] or [prefix]


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids) if text else 0


def _first_line(text: str, limit: int) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) if not isinstance(value, str) else value


def _pretty_json(data: bytes) -> str:
    try:
        return json.dumps(json.loads(data), indent=2, ensure_ascii=False)
    except ValueError:
        return data.decode("utf-8", "replace")


def _row_lines(row: dict[str, Any] | None) -> list[str]:
    if row is None:
        return []
    line = f"session {row['session_id']} · seq {row['seq']} · harness {row.get('harness') or '?'} · exchange {row['exchange_id']}"
    return [line + (" · REPLAY (not trajectory material)" if row.get("replay") else "")]


def _dialect_of(flow: http.HTTPFlow) -> Dialect | None:
    return dialects.dialect_for(flow.request.method, flow.request.path.split("?", 1)[0])


def _gateway_reader() -> Reader | None:
    from mitmproxy import ctx

    master = getattr(ctx, "master", None)
    addon = master.addons.get("polaraddon") if master is not None else None
    store = getattr(addon, "store", None)
    return store.query if store is not None else None


_registered: LLMContentview | None = None


def register() -> None:
    """Add the view to mitmproxy's registry (once per process)."""
    global _registered
    if _registered is None:
        _registered = LLMContentview()
        contentviews.add(_registered)
