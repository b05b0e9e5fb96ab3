"""What changed in the prompt between a turn and the next one: messages and tokens, with the assembler's verdict.

A turn is one trajectory exchange of the session (status 'ok', action 'generate', not a replay), named by its
seq. For turn K and the turn after it, `diff_turns` compares
  - messages: turn K's messages plus its reply, against what the next turn sent — unchanged, re-sent, edited,
    added, removed (the chat form the engine saw, whichever API the harness used);
  - tokens: whether the next prompt starts with turn K's prompt + sampled tokens (a strict prefix: the two merge
    into one training sequence), else the first token index where they differ, and the break class from the
    assembler's diagnosis (retokenized, rerendered, rewritten, truncated, unknown).

API (`polar-mitm diff` and the notebooks use it): `load_turns(db, session)`, `diff_turns(db, session, turn)`
-> TurnDiff, `format_diff(diff)`, `summary_line(diff)`, `overview(db, session)` (every consecutive pair).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from polar_mitm import store
from polar_mitm.store.schema import MATERIAL

EXCERPT_TOKENS = 10
MAX_TEXT_DIFF_LINES = 12


@dataclass
class Turn:
    exchange_id: str
    seq: int
    api: str | None
    harness: str | None
    model_engine: str | None
    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    prompt: list[int]
    completion: list[int]
    finish_reason: str | None
    render_mode: str | None = None  # tokens: the gateway rendered the prompt; bridged says whether it continued a turn
    bridged: bool | None = None
    bridge_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt + sampled tokens: what the next turn's prompt must start with to merge."""
        return self.prompt + self.completion


@dataclass
class MessageOp:
    op: str  # same | resent | edited | added | removed
    role: str
    before: int | None  # index in turn K's messages (its reply counts as the one after them)
    after: int | None  # index in the next turn's messages
    note: str = ""
    text_diff: list[str] = field(default_factory=list)


@dataclass
class TurnDiff:
    session_id: str
    before: Turn
    after: Turn
    messages: list[MessageOp]
    shared: int  # tokens the next prompt shares with turn K's prompt + sampled tokens, from the start
    break_kind: str | None = None  # the assembler's class, when it diagnosed a break here
    break_detail: str | None = None
    assembler_note: str = ""
    # what the assembler made of the next turn: merged (into `relation_seq`'s chain), break, retry (of
    # `relation_seq`), new_lineage (a side call or sub-agent), or "" when it was not asked
    relation: str = ""
    relation_seq: int | None = None
    parent_seq: int | None = None  # a bridged next turn: the latest turn whose prompt + sampled tokens its prompt starts with
    tokenizer: Any = None

    @property
    def extends(self) -> bool:
        return self.shared == len(self.before.tokens)

    @property
    def break_index(self) -> int | None:
        return None if self.extends else self.shared


# -- loading
def load_turns(db: str | os.PathLike[str], session_id: str) -> list[Turn]:
    _, rows = store.query(
        db,
        "SELECT exchange_id, seq, api, harness, model_engine, engine_request -> '$.messages' AS messages, "
        "engine_response -> '$.choices[0].message' AS reply, prompt_token_ids, completion_token_ids, finish_reason, "
        "render_mode, bridged, bridge_reason, method, path, request_body, response_body "
        f"FROM exchanges WHERE session_id = ? AND {MATERIAL} ORDER BY seq",
        [session_id],
    )
    turns = []
    for r in rows:
        messages, reply = _json(r[5]) or [], _json(r[6]) or {}
        if r[10] == "tokens":  # the engine got token ids: the messages are the dialect's reading of the request
            messages, reply = _tokens_mode_messages(r[13], r[14], r[15], r[7] or [], r[8] or [], r[4])
        turns.append(Turn(r[0], r[1], r[2], r[3], r[4], messages, reply, r[7] or [], r[8] or [], r[9], r[10], r[11], r[12]))
    return turns


def _tokens_mode_messages(method: str, path: str, body: str, prompt: list[int], completion: list[int], model: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A tokens-mode row's chat messages (its request parsed again by its dialect, as the gateway did) and its
    reply (the sampled text split as the gateway split it, Hermes tool calls)."""
    from polar_mitm import dialects
    from polar_mitm.assembler.diagnosis import load_tokenizer
    from polar_mitm.render.parsers import parse_output

    route, _, query = path.partition("?")
    dialect = dialects.dialect_for(method, route)
    try:
        messages = dialect.parse((body or "").encode(), route, dict(parse_qsl(query))).chat["messages"] if dialect else []
    except Exception:  # noqa: BLE001 - a row whose request no longer parses still diffs on tokens
        messages = []
    tokenizer = load_tokenizer(None, model)
    if tokenizer is None:
        return messages, {}
    text = re.sub(r"(<\|[a-z_]+\|>)+$", "", tokenizer.text(completion))  # the stop token that ended the sample
    out = parse_output(text, "hermes")
    reply: dict[str, Any] = {"content": out.content}
    if out.reasoning:
        reply["reasoning_content"] = out.reasoning
    if out.tool_calls:
        reply["tool_calls"] = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in out.tool_calls]
    return messages, reply


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# -- message level
def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", f"[{p.get('type')}]") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ("" if content is None else json.dumps(content))


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        calls.append((function.get("name"), arguments))
    return calls


def _key(message: dict[str, Any]) -> str:
    """Messages are compared on what the template renders: role, text, reasoning, tool calls, tool call id."""
    return json.dumps(
        [message.get("role"), _text(message.get("content")), message.get("reasoning_content") or message.get("reasoning") or "", _calls(message), message.get("tool_call_id")],
        sort_keys=True,
        ensure_ascii=False,
    )


def _preview(message: dict[str, Any], limit: int = 70) -> str:
    text = _text(message.get("content")).strip()
    if not text and message.get("tool_calls"):
        text = ", ".join(f"{name}({json.dumps(arguments, ensure_ascii=False)})" for name, arguments in _calls(message))
    text = text.replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


def diff_messages(before: Turn, after: Turn) -> list[MessageOp]:
    from polar_mitm.assembler.diagnosis import same_assistant_message

    reply = {"role": "assistant", **{k: v for k, v in before.reply.items() if k in ("content", "reasoning_content", "reasoning", "tool_calls")}}
    expected = [*before.messages, reply]
    reply_index = len(before.messages)
    ops: list[MessageOp] = []
    matcher = difflib.SequenceMatcher(None, [_key(m) for m in expected], [_key(m) for m in after.messages], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2), strict=True):
                ops.append(MessageOp("resent" if i == reply_index else "same", expected[i].get("role", "?"), i, j, "turn's reply, sent back as sampled" if i == reply_index else ""))
            continue
        pairs = list(zip(range(i1, i2), range(j1, j2), strict=False)) if tag == "replace" else []
        for i, j in pairs:
            old, new = expected[i], after.messages[j]
            if old.get("role") != new.get("role"):
                ops += [MessageOp("removed", old.get("role", "?"), i, None, _preview(old)), MessageOp("added", new.get("role", "?"), None, j, _preview(new))]
            elif i == reply_index and same_assistant_message(new, old):
                ops.append(MessageOp("resent", "assistant", i, j, "turn's reply, sent back re-rendered (reasoning, whitespace or JSON formatting differ)", _text_diff(old, new)))
            else:
                note = "turn's reply, changed before it was sent back" if i == reply_index else "edited"
                ops.append(MessageOp("edited", new.get("role", "?"), i, j, note, _text_diff(old, new)))
        for i in range(i1 + len(pairs), i2):
            ops.append(MessageOp("removed", expected[i].get("role", "?"), i, None, _preview(expected[i])))
        for j in range(j1 + len(pairs), j2):
            ops.append(MessageOp("added", after.messages[j].get("role", "?"), None, j, _preview(after.messages[j])))
    return ops


def _text_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    def lines(message: dict[str, Any]) -> list[str]:
        parts = []
        if reasoning := message.get("reasoning_content") or message.get("reasoning"):
            parts += [f"reasoning: {line}" for line in reasoning.splitlines()]
        parts += _text(message.get("content")).splitlines()
        parts += [f"tool call: {json.dumps(call, ensure_ascii=False)}" for call in message.get("tool_calls") or []]
        return parts

    changed = [line for line in difflib.ndiff(lines(old), lines(new)) if line[:1] in "-+"]
    return changed[:MAX_TEXT_DIFF_LINES] + ([f"  … {len(changed) - MAX_TEXT_DIFF_LINES} more changed lines"] if len(changed) > MAX_TEXT_DIFF_LINES else [])


# -- token level
def diff_turns(db: str | os.PathLike[str], session_id: str, turn: int, tokenizer: Any = None, turns: list[Turn] | None = None, assembly: Any = None) -> TurnDiff:
    """Turn `turn` (a seq) against the session's next trajectory exchange."""
    from polar_mitm.assembler.diagnosis import common_prefix, load_tokenizer

    turns = turns if turns is not None else load_turns(db, session_id)
    position = next((i for i, t in enumerate(turns) if t.seq == turn), None)
    if position is None:
        raise LookupError(f"session {session_id!r} has no trajectory exchange with seq {turn} (seqs: {', '.join(str(t.seq) for t in turns) or 'none'})")
    if position + 1 >= len(turns):
        raise LookupError(f"seq {turn} is the last trajectory exchange of session {session_id!r}: no next turn to diff against")
    before, after = turns[position], turns[position + 1]
    result = TurnDiff(session_id, before, after, diff_messages(before, after), common_prefix(before.tokens, after.prompt))
    if after.bridged:  # tokens mode: which turn's exact tokens the gateway continued
        result.parent_seq = before.seq if result.extends else next((t.seq for t in reversed(turns[:position]) if t.tokens and after.prompt[: len(t.tokens)] == t.tokens), None)
    result.tokenizer = load_tokenizer(tokenizer, before.model_engine)
    _explain(result, turns, assembly if assembly is not None else _assemble(db, session_id, result.tokenizer))
    return result


def _assemble(db: str | os.PathLike[str], session_id: str, tokenizer: Any) -> Any:
    from polar_mitm.assembler import assemble

    return assemble(db, builder="prefix_merging", session=session_id, tokenizer=tokenizer)


def _explain(result: TurnDiff, turns: list[Turn], assembly: Any) -> None:
    """What the assembler made of the next turn: merged into which chain, a break (with its class), or a new lineage."""
    seq_of = {t.exchange_id: t.seq for t in turns}
    after = result.after.exchange_id
    for sequence in assembly.sequences:
        if after not in sequence.exchange_ids:
            continue
        position = sequence.exchange_ids.index(after)
        if position > 0:
            previous = seq_of.get(sequence.exchange_ids[position - 1])
            result.relation, result.relation_seq = "merged", previous
            result.assembler_note = f"the assembler merges seq {result.after.seq} after seq {previous} in sequence {sequence.sequence_id}"
        elif sequence.break_diagnosis is not None:
            diagnosis = sequence.break_diagnosis
            result.break_kind, result.break_detail = diagnosis.kind, diagnosis.detail
            source = seq_of.get(diagnosis.previous_exchange_id)
            result.relation, result.relation_seq = "break", source
            result.assembler_note = f"the assembler starts sequence {sequence.sequence_id} at a {diagnosis.kind} break from the chain ending at seq {source} (token {diagnosis.index})"
        elif sequence.retry_of is not None:
            result.relation, result.relation_seq = "retry", seq_of.get(sequence.retry_of)
            result.assembler_note = f"the assembler keeps seq {result.after.seq} as a retry of seq {result.relation_seq}"
        else:
            result.relation = "new_lineage"
            result.assembler_note = f"the assembler starts a new lineage at seq {result.after.seq} (no shared history: a sub-agent or side call)"
        return


def overview(db: str | os.PathLike[str], session_id: str, tokenizer: Any = None) -> list[TurnDiff]:
    """Every consecutive pair of the session's turns."""
    from polar_mitm.assembler.diagnosis import load_tokenizer

    turns = load_turns(db, session_id)
    if not turns:
        raise LookupError(f"session {session_id!r} has no trajectory exchanges in {db}")
    loaded = load_tokenizer(tokenizer, turns[0].model_engine)
    assembly = _assemble(db, session_id, loaded) if len(turns) > 1 else None
    return [diff_turns(db, session_id, t.seq, loaded, turns, assembly) for t in turns[:-1]]


# -- text
def _show(diff: TurnDiff, ids: list[int], with_ids: bool = False) -> str:
    if diff.tokenizer is None:
        return str(ids)
    text = repr(diff.tokenizer.text(ids))
    return f"{text}  {ids}" if with_ids else text


def _token(diff: TurnDiff, tokens: list[int], seq: int) -> str:
    if diff.shared >= len(tokens):
        return f"seq {seq} has none (it ends there)"
    token_id = tokens[diff.shared]
    return f"seq {seq} has id {token_id}" + (f" {diff.tokenizer.text([token_id])!r}" if diff.tokenizer is not None else "")


def _differing_ids(diff: TurnDiff) -> str:
    before, after = diff.before.tokens, diff.after.prompt
    first = str(before[diff.shared]) if diff.shared < len(before) else "end"
    second = str(after[diff.shared]) if diff.shared < len(after) else "end"
    return f"id {first} → {second}"


def _message_counts(ops: list[MessageOp]) -> str:
    counts: dict[str, int] = {}
    for op in ops:
        if op.op != "same":
            counts[op.op] = counts.get(op.op, 0) + 1
    return ", ".join(f"{n} {op}" for op, n in counts.items()) or "none changed"


def summary_line(diff: TurnDiff) -> str:
    before, after = diff.before, diff.after
    head = f"seq {before.seq} → {after.seq}"
    if diff.extends:
        tokens = f"extends (+{len(after.prompt) - len(before.tokens)} prompt tokens)"
    elif diff.relation == "new_lineage":
        # nothing broke: a harness's own side call (a title, Gemini CLI's router), a sub-agent, or (tokens mode says
        # so) a history the harness rewrote, e.g. compacted
        why = after.bridge_reason if after.bridge_reason not in (None, "first_turn") else "side call or sub-agent"
        tokens = f"new lineage ({why}; {diff.shared} tokens shared with seq {before.seq})"
    elif diff.relation == "merged":
        # the turn after a side call: it goes on with an earlier turn, not with the side call before it
        tokens = f"continues seq {diff.relation_seq}, not seq {before.seq}"
    elif diff.relation == "retry":
        tokens = f"retry of seq {diff.relation_seq}"
    else:
        tokens = f"BREAK at token {diff.shared} of {len(before.tokens)} ({_differing_ids(diff)}): {diff.break_kind or 'no break class (' + (diff.assembler_note or 'not diagnosed') + ')'}"
    return f"{head}  {tokens}; messages: {_message_counts(diff.messages)}{_bridge_note(after)}"


def _bridge_note(turn: Turn) -> str:
    if turn.render_mode != "tokens":
        return ""
    return "; bridged" if turn.bridged else f"; not bridged ({turn.bridge_reason or 'unknown'})"


def format_diff(diff: TurnDiff) -> str:
    before, after = diff.before, diff.after
    out = [f"session {diff.session_id} · seq {before.seq} → seq {after.seq} · {after.api} · harness {after.harness or '?'}"]
    if after.render_mode == "tokens":
        parent = f"seq {diff.parent_seq}'s" if diff.parent_seq is not None else "an earlier turn's"
        out.append(f"render: tokens · seq {after.seq} " + (f"bridged: its prompt is {parent} prompt + sampled ids + the new messages" if after.bridged else f"not bridged ({after.bridge_reason or 'unknown'}): a full render"))
    out.append("")
    out.append(f"messages  (seq {before.seq} sent {len(before.messages)} + its reply; seq {after.seq} sent {len(after.messages)})")
    run: list[MessageOp] = []

    def flush() -> None:
        if run:
            span = f"[{run[0].after}]" if len(run) == 1 else f"[{run[0].after}-{run[-1].after}]"
            out.append(f"  = {span} unchanged: {', '.join(op.role for op in run)}")
            run.clear()

    for op in diff.messages:
        if op.op == "same":
            run.append(op)
            continue
        flush()
        mark = {"resent": "=", "edited": "~", "added": "+", "removed": "-"}[op.op]
        where = f"[{op.after}]" if op.after is not None else f"(was [{op.before}])"
        out.append(f"  {mark} {where} {op.role}: {op.note or op.op}")
        out += [f"      {line}" for line in op.text_diff]
    flush()

    out += ["", f"tokens  (seq {before.seq}: {len(before.prompt)} prompt + {len(before.completion)} sampled = {len(before.tokens)}; seq {after.seq}: {len(after.prompt)} prompt)"]
    n = EXCERPT_TOKENS
    if diff.extends:
        added = after.prompt[len(before.tokens):]
        out.append(f"  strict prefix: yes — seq {after.seq}'s prompt starts with all {len(before.tokens)} tokens of seq {before.seq} and adds {len(added)}")
        out.append(f"    new      {_show(diff, added[: 3 * n])}{' …' if len(added) > 3 * n else ''}")
    else:
        where = f"in seq {before.seq}'s prompt" if diff.shared < len(before.prompt) else f"in seq {before.seq}'s sampled tokens"
        out.append(f"  strict prefix broken at token {diff.shared} ({where})")
        out.append(f"    shared   …{_show(diff, before.tokens[max(0, diff.shared - n): diff.shared])}")
        # ids too: a retokenized break has the same text on both sides
        out.append(f"    seq {before.seq:<4} → {_show(diff, before.tokens[diff.shared: diff.shared + n], True)}")
        out.append(f"    seq {after.seq:<4} → {_show(diff, after.prompt[diff.shared: diff.shared + n], True)}")
        # the excerpts' texts can look alike (same words, other ids; two end-of-turn tokens): name the first pair
        out.append(f"    first different token: {_token(diff, before.tokens, before.seq)}, {_token(diff, after.prompt, after.seq)}")
        if diff.break_kind:
            out.append(f"  break class: {diff.break_kind}")
            if diff.break_detail:
                out.append(f"    {diff.break_detail}")
    if diff.assembler_note:
        out.append(f"  {diff.assembler_note}")
    if diff.tokenizer is None:
        out.append("  (no tokenizer here: token ids shown; pass --tokenizer DIR for text)")
    return "\n".join(out)
