"""The Trajectory view: one assembled sequence, token by token.

The sequence comes from polar_mitm.assembler.assemble over its session (the builder its id names). Each token
shows the exact bytes it decodes to (a piece of a multi-byte character as \\x escapes), whether the engine sampled
it and whether it is in the loss (loss_mask), its logprob as heat, the policy version that sampled it, and where
each exchange's new prompt tokens and samples begin, bridged or not (tokens mode), and where the conversation
broke. The tokenizer is the one `polar-mitm assemble` and `polar-mitm diff` use (--tokenizer, else the local
engine's model directory); without one the ids are shown.
"""

from __future__ import annotations

import html
import json
import math
import os
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from polar_mitm.assembler import Sequence, assemble
from polar_mitm.assembler.diagnosis import TokenText, load_tokenizer
from polar_mitm.store import StoreReader
from polar_mitm.ui.reading import dicts, log

MAX_TOKENS = 120_000  # tokens drawn at most (the rest is summarised): a page stays a few MB
LENIENT_SUFFIX = "_lenient"


def tokenizer_for(spec: str | os.PathLike[str] | None, model_engine: str | None) -> TokenText | None:
    """The tokenizer for a store's rows, loaded once per process (a tokenizer.json takes ~0.3 s to parse)."""
    with _loading:  # a page waits for the background load (warm_tokenizer) rather than parsing the file again
        return _tokenizer(str(spec) if spec else None, model_engine)


def warm_tokenizer(spec: str | os.PathLike[str] | None, model_engine: str | None) -> None:
    """Load the tokenizer in the background (once), so the first Session or Trajectory page does not wait for it."""
    key = (str(spec) if spec else None, model_engine)
    if model_engine and key not in _warming:
        _warming.add(key)
        threading.Thread(target=tokenizer_for, args=key, name="polar-ui-tokenizer", daemon=True).start()


_warming: set[tuple[str | None, str | None]] = set()
_loading = threading.Lock()


@lru_cache(maxsize=8)
def _tokenizer(spec: str | None, model_engine: str | None) -> TokenText | None:
    try:
        return load_tokenizer(spec, model_engine)
    except (OSError, TypeError, ValueError, ImportError) as error:
        log.warning(f"polar ui: no tokenizer ({error}); token ids are shown")
        return None


@dataclass
class Span:
    """One exchange's part of the sequence: its new prompt tokens from `context_start`, its sample from `start`."""

    exchange_id: str
    seq: int
    context_start: int
    start: int
    end: int
    version: int | None
    render_mode: str | None
    bridged: bool | None
    bridge_reason: str | None


@dataclass
class TrajectoryPage:
    sequence: Sequence
    spans: list[Span]
    tokens_html: str
    data: str  # JSON for the page's script: ids, texts, logprobs, mask, versions, spans
    tokenizer: str | None
    shown: int
    others: list[str]  # the session's other sequences
    continued_in: list[str] = field(default_factory=list)  # sequences that start at a break from this one's tip


def split_sequence_id(sequence_id: str) -> tuple[str, str, bool]:
    """(session_id, builder, lenient) from '<session_id>:<builder>:<seq>' (a session id may contain ':')."""
    parts = sequence_id.rsplit(":", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        raise LookupError(f"{sequence_id!r} is not a sequence id ('<session_id>:<builder>:<seq>')")
    session_id, builder, _ = parts
    lenient = builder.endswith(LENIENT_SUFFIX)
    return session_id, builder.removesuffix(LENIENT_SUFFIX) if lenient else builder, lenient


def trajectory_page(reader: StoreReader, sequence_id: str, tokenizer_spec: str | os.PathLike[str] | None = None) -> TrajectoryPage:
    """LookupError when the store has no such sequence."""
    session_id, builder, lenient = split_sequence_id(sequence_id)
    model = reader.query("SELECT any_value(model_engine) FROM exchanges WHERE session_id = ?", [session_id])[1]
    tokenizer = tokenizer_for(tokenizer_spec, model[0][0] if model else None)
    try:
        assembly = assemble(None, builder, session=session_id, store=reader, tokenizer=tokenizer, lenient=lenient)
    except ValueError as error:  # an unknown builder (ConfigError is a ValueError)
        raise LookupError(str(error)) from error
    found = next((s for s in assembly.sequences if s.sequence_id == sequence_id), None)
    if found is None:
        raise LookupError(f"session {session_id!r} has no sequence {sequence_id!r} (it has: {', '.join(s.sequence_id for s in assembly.sequences) or 'none'})")
    spans = exchange_spans(reader, found, strict=not lenient)
    tip = found.exchange_ids[-1]
    continued = [s.sequence_id for s in assembly.sequences if s.break_diagnosis is not None and s.break_diagnosis.previous_exchange_id == tip]
    tokens_html, data, shown = render_tokens(found, spans, tokenizer)
    return TrajectoryPage(found, spans, tokens_html, data, tokenizer.name if tokenizer else None, shown,
                          [s.sequence_id for s in assembly.sequences if s.sequence_id != sequence_id], continued)


def exchange_spans(reader: StoreReader, sequence: Sequence, strict: bool = True) -> list[Span]:
    """Where each exchange's tokens are in the sequence. Strict builders put exchange k's sample right after its
    whole prompt (its prompt is the sequence so far), so its prompt length places it; otherwise (lenient) the
    samples are the loss mask's runs, in exchange order."""
    rows = {r["exchange_id"]: r for r in dicts(
        reader,
        "SELECT exchange_id, seq, len(prompt_token_ids) AS prompt_len, len(completion_token_ids) AS sampled, policy_version, render_mode, bridged, bridge_reason "
        "FROM exchanges WHERE exchange_id IN (SELECT unnest(?::VARCHAR[]))",
        [sequence.exchange_ids],
    )}
    spans: list[Span] = []
    end = 0
    for exchange_id in sequence.exchange_ids:
        row = rows.get(exchange_id)
        if row is None or not strict:
            break
        start = int(row["prompt_len"])
        if start < end or start + int(row["sampled"] or 0) > len(sequence.input_ids):
            break
        spans.append(Span(exchange_id, row["seq"], end, start, start + int(row["sampled"] or 0), row["policy_version"], row["render_mode"], row["bridged"], row["bridge_reason"]))
        end = spans[-1].end
    if len(spans) == len(sequence.exchange_ids):
        return spans
    # not placeable by prompt length: the mask's runs (empty when the session is untrainable: mask all 0)
    runs: list[tuple[int, int]] = []
    opened: int | None = None
    for index, value in enumerate([*sequence.loss_mask, 0]):
        if value and opened is None:
            opened = index
        elif not value and opened is not None:
            runs.append((opened, index))
            opened = None
    spans, end = [], 0
    for exchange_id, (first, stop) in zip(sequence.exchange_ids, runs, strict=False):
        row = rows.get(exchange_id) or {}
        spans.append(Span(exchange_id, row.get("seq", -1), end, first, stop, row.get("policy_version"), row.get("render_mode"), row.get("bridged"), row.get("bridge_reason")))
        end = stop
    return spans


def piece(tokenizer: TokenText | None, token_id: int) -> tuple[str, bool]:
    """(the exact text of one token, whether it is whole UTF-8); a character split over tokens: \\x escapes."""
    if tokenizer is None:
        return f"⟨{token_id}⟩", True
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), False


def _shown(text: str) -> str:
    """How a token's text is drawn: newlines and tabs visible (the search still runs on the exact text)."""
    return html.escape(text).replace("\n", "↵\n").replace("\t", "⇥\t") if text else "∅"


def render_tokens(sequence: Sequence, spans: list[Span], tokenizer: TokenText | None) -> tuple[str, str, int]:
    """(the token spans' HTML with markers between them, the JSON data the page's script reads, tokens drawn)."""
    ids, mask, logprobs = sequence.input_ids, sequence.loss_mask, sequence.rollout_logprobs
    shown = min(len(ids), MAX_TOKENS)
    sampled_at: list[Span | None] = [None] * len(ids)
    for span in spans:
        for index in range(span.start, min(span.end, len(ids))):
            sampled_at[index] = span
    markers = _markers(sequence, spans)
    out: list[str] = []
    texts: list[str] = []
    for index in range(shown):
        for marker in markers.get(index, ()):
            out.append(marker)
        text, whole = piece(tokenizer, ids[index])
        texts.append(text)
        at = sampled_at[index]
        if at is None and not mask[index]:
            out.append(f'<span class="t c{"" if whole else " b"}">{_shown(text)}</span>')
            continue
        kind = "s" if mask[index] else "u"  # in the loss, or sampled but masked (an untrainable session)
        version = f" v{at.version % 8}" if at is not None and at.version is not None else ""
        p = math.exp(logprobs[index]) if logprobs[index] <= 0 else 1.0
        out.append(f'<span class="t {kind}{version}{"" if whole else " b"}" style="--p:{p:.3f}">{_shown(text)}</span>')
    out.extend(markers.get(len(ids), ()))
    data = {
        "ids": ids[:shown], "text": texts, "lp": [round(v, 5) for v in logprobs[:shown]], "mask": mask[:shown],
        "spans": [{"seq": s.seq, "from": s.context_start, "start": s.start, "end": s.end, "version": s.version} for s in spans],
        "total": len(ids),
    }
    return "".join(out), json.dumps(data, separators=(",", ":")).replace("</", "<\\/"), shown


def _markers(sequence: Sequence, spans: list[Span]) -> dict[int, list[str]]:
    """Labels drawn before a token: each exchange's new prompt tokens (bridged or not) and sample, the break."""
    at: dict[int, list[str]] = {}

    def add(index: int, kind: str, text: str, title: str = "") -> None:
        at.setdefault(index, []).append(f'<b class="mk {kind}" title="{html.escape(title or text)}">{html.escape(text)}</b>')

    for number, span in enumerate(spans):
        new = span.start - span.context_start
        if span.render_mode == "tokens" and number:
            bridge = "bridged" if span.bridged else f"not bridged ({span.bridge_reason or 'unknown'})"
            title = ("the gateway continued the previous turn's exact tokens" if span.bridged
                     else "the gateway rendered this prompt whole; it still starts with the tokens so far")
            add(span.context_start, "ctx bridge" if span.bridged else "ctx nobridge", f"seq {span.seq} · {bridge} · +{new} prompt tokens", title)
        else:
            add(span.context_start, "ctx", f"seq {span.seq} · {'prompt' if not number else 'new prompt tokens'} +{new}")
        version = f" · policy v{span.version}" if span.version is not None else ""
        add(span.start, "smp", f"seq {span.seq} sampled {span.end - span.start}{version}")
    diagnosis = sequence.break_diagnosis
    if diagnosis is not None:
        add(diagnosis.index, "brk", f"✂ {diagnosis.kind} break (from {diagnosis.previous_sequence_id}, region {diagnosis.region})", diagnosis.detail)
    return at


def heat_legend() -> list[dict[str, Any]]:
    return [{"p": p, "label": f"p={p:g}"} for p in (0.01, 0.1, 0.3, 0.6, 0.9, 1.0)]
