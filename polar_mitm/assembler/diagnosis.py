"""Why a chain broke: the first token where the new prompt leaves the chain, and a class.

A chain's tokens are prompt(1) + sampled(1) + ... + sampled(k). When prompt(k+1) does not start with
them, the first differing token index `d` is looked at, in this order:

- `truncated`   the tip's sample ended on a length limit and `d` lies in its assistant turn (a cut-off
                sample rarely renders back as the same ids: half a word, no end-of-turn token).
- `retokenized` the text is the same, the ids are not: from `d` on, the chain's bytes are a prefix of the
                prompt's bytes (e.g. the engine sampled `H|ell|o`, the template renders `Hello`).
- `rerendered`  the first differing byte lies in an earlier sampled turn and the harness sent that
                assistant message back as the engine produced it (visible text and tool calls equal after
                dropping `<think>` reasoning and outer whitespace): the chat template rendered it
                differently — reasoning dropped, tool-call arguments re-serialized, whitespace.
- `rewritten`   anything else: the harness edited, dropped or compacted history, or changed an assistant
                message before sending it back.
- `unknown`     no tokenizer was available to compare text (only `truncated` can be told without one).

Text is compared as bytes from the tokenizer's vocabulary (byte-level BPE: exact, no decode/re-encode).
The tokenizer is the engine's: `--tokenizer DIR` (a directory with tokenizer.json, or the file), else the
local engine's model directory for the exchange's engine model (`polar_mitm.local_engine`).

Whether a non-extending exchange is a break at all (rather than a new lineage: a sub-agent, a side call
such as title generation) is decided by `predecessor()`: it must share tokens with the chain, and either
repeat the chain's whole first prompt (up to the generation prompt) or carry the chain's message history
by role (the roles of the tip's request, then an assistant turn).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polar_mitm.assembler.records import BreakDiagnosis
from polar_mitm.assembler.source import Exchange

EXCERPT_TOKENS = 8
# a prompt's generation-prompt tail (`<|im_start|>assistant\n`, maybe `<think>\n`) is never longer than this
MAX_GENERATION_TAIL = 16


class TokenText:
    """Token ids -> the exact bytes they stand for, from a Hugging Face `tokenizers` tokenizer."""

    def __init__(self, tokenizer: Any, name: str = ""):
        self.tokenizer = tokenizer
        self.name = name
        self.byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self.added = {index: token.content for index, token in tokenizer.get_added_tokens_decoder().items()}
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        if token_id in self.added:
            value = self.added[token_id].encode()
        else:
            piece = self.tokenizer.id_to_token(token_id)
            if piece is None:
                value = b""
            elif self.byte_level and all(char in _UNICODE_TO_BYTE for char in piece):
                value = bytes(_UNICODE_TO_BYTE[char] for char in piece)
            else:
                value = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        self._bytes[token_id] = value
        return value

    def bytes_of(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def text(self, ids: list[int]) -> str:
        return self.bytes_of(ids).decode("utf-8", "replace")


def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode table, used by every byte-level BPE vocabulary
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_UNICODE_TO_BYTE = _byte_decoder()


def load_tokenizer(spec: Any = None, model_engine: str | None = None) -> TokenText | None:
    """A TokenText from a directory / tokenizer.json path / tokenizer object, else the local engine's model."""
    from tokenizers import Tokenizer

    if spec is None:
        if not model_engine:
            return None
        from polar_mitm.local_engine import build

        candidate = build.model_dir(build.engine_home(), model_engine) / "tokenizer.json"
        if not candidate.exists():
            return None
        spec = candidate
    if isinstance(spec, TokenText):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return TokenText(Tokenizer.from_file(str(path)), str(path))
    backend = getattr(spec, "backend_tokenizer", spec)  # a transformers fast tokenizer wraps one
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"cannot use {type(spec).__name__} as a tokenizer: give a directory with tokenizer.json")
    return TokenText(backend, getattr(spec, "name_or_path", "") or type(spec).__name__)


def common_prefix(a: Any, b: Any) -> int:
    """Length of the common prefix of two token sequences (lists or arrays)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


def generation_tail(prompts: list[np.ndarray]) -> int:
    """Tokens every prompt of a session ends with (the generation prompt), at most MAX_GENERATION_TAIL."""
    if len(prompts) < 2:
        return 0
    tail = 0
    shortest = min(len(p) for p in prompts)
    while tail < min(MAX_GENERATION_TAIL, shortest) and len({int(p[-1 - tail]) for p in prompts}) == 1:
        tail += 1
    return tail


def predecessor(chains: list[Any], exchange: Exchange, tail: int) -> tuple[Any, int] | None:
    """The chain `exchange` continues although it does not extend it, with their common prefix; None: a new lineage."""
    best = None
    for chain in chains:
        shared = common_prefix(chain.tokens(), exchange.prompt)
        if shared and (best is None or shared >= best[1]):
            best = (chain, shared)
    if best is None:
        return None
    chain, shared = best
    repeats_opening = shared >= len(chain.exchanges[0].prompt) - tail
    roles = exchange.roles or []
    tip_roles = chain.tip.roles
    carries_history = tip_roles is not None and roles[: len(tip_roles) + 1] == [*tip_roles, "assistant"]
    return best if repeats_opening or carries_history else None


MessageLoader = Callable[[list[str]], dict[str, dict[str, Any]]]


class Diagnoser:
    """Classifies breaks; the tokenizer is loaded at the first break (`tokenizer`: see load_tokenizer)."""

    def __init__(self, load_messages: MessageLoader, tokenizer: Any = None):
        self.load_messages = load_messages
        self._spec = tokenizer
        # a tokenizer given by the user is loaded now, so that a wrong path fails before any work
        self._loaded: dict[str | None, TokenText | None] = {None: load_tokenizer(tokenizer)} if tokenizer is not None else {}
        self.tokenizer: TokenText | None = None

    def _tokenizer_for(self, model_engine: str | None) -> TokenText | None:
        key = None if self._spec is not None else model_engine
        if key not in self._loaded:
            self._loaded[key] = load_tokenizer(self._spec, model_engine)
        return self._loaded[key]

    def diagnose(self, chain: Any, shared: int, exchange: Exchange, tail: int) -> BreakDiagnosis:
        tokens, prompt, tip = chain.tokens().tolist(), exchange.prompt.tolist(), chain.tip
        self.tokenizer = self._tokenizer_for(tip.model_engine)
        d = shared
        tip_start = chain.tip_start
        region = self._region(chain, d, tip_start)
        kind, why = self._classify(chain, tokens, exchange, prompt, d, tip_start, tail)
        show = self.tokenizer.text if self.tokenizer else (lambda ids: str(ids))
        detail = f"{why}; token {d}: chain {show(tokens[d:d + EXCERPT_TOKENS])!r} vs prompt {show(prompt[d:d + EXCERPT_TOKENS])!r}"
        return BreakDiagnosis(
            kind=kind,
            index=d,
            previous_sequence_id=chain.sequence_id,
            previous_exchange_id=tip.exchange_id,
            region=region,
            chain_tokens=tokens[d:d + EXCERPT_TOKENS],
            prompt_tokens=prompt[d:d + EXCERPT_TOKENS],
            detail=detail,
        )

    @staticmethod
    def _region(chain: Any, index: int, tip_start: int) -> str:
        if index >= tip_start:
            return "last_sample"
        if any(start <= index < end for start, end, _ in chain.spans[:-1]):
            return "earlier_sample"
        return "context"

    def _classify(self, chain: Any, tokens: list[int], exchange: Exchange, prompt: list[int], d: int, tip_start: int, tail: int) -> tuple[str, str]:
        tip = chain.tip
        if tip.finish_reason == "length" and d >= tip_start - tail:
            return "truncated", f"the previous sample (seq {tip.seq}) ended on a length limit"
        if self.tokenizer is None:
            return "unknown", "no tokenizer to compare text"
        chain_bytes = self.tokenizer.bytes_of(tokens[d:])
        prompt_bytes = self.tokenizer.bytes_of(prompt[d:])
        if prompt_bytes.startswith(chain_bytes):
            return "retokenized", "same text, different token ids"
        differ = _first_difference(chain_bytes, prompt_bytes)
        index = d
        consumed = 0
        for token in tokens[d:]:
            consumed += len(self.tokenizer.token_bytes(token))
            if consumed > differ:
                break
            index += 1
        for start, end, sampled in chain.spans:
            if start <= index < end:
                return self._sampled_turn(sampled, exchange)
        return "rewritten", "the history differs outside any sampled turn (a message edited, dropped or compacted)"

    def _sampled_turn(self, sampled: Exchange, exchange: Exchange) -> tuple[str, str]:
        at = len(sampled.roles or [])
        roles = exchange.roles or []
        if sampled.roles is None or len(roles) <= at or roles[at] != "assistant":
            return "rewritten", f"the assistant turn of seq {sampled.seq} is not where it was in the history sent back"
        messages = self.load_messages([exchange.exchange_id, sampled.exchange_id])
        history = messages.get(exchange.exchange_id, {}).get("messages") or []
        sent = history[at] if len(history) > at else None
        reply = messages.get(sampled.exchange_id, {}).get("reply") or {}
        if isinstance(sent, dict) and same_assistant_message(sent, reply):
            return "rerendered", f"the chat template rendered the assistant turn of seq {sampled.seq} differently from what was sampled (the message sent back equals the engine's reply)"
        return "rewritten", f"the assistant message of seq {sampled.seq} was changed before it was sent back"


def _first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n))
    return int(differ[0]) if differ.size else n


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def _visible_text(content: Any) -> str:
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return _THINK.sub("", content or "").strip()


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or call
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = arguments.strip()
        calls.append((function.get("name"), arguments))
    return calls


def same_assistant_message(sent: dict[str, Any], reply: dict[str, Any]) -> bool:
    """The harness sent the engine's reply back unchanged, up to reasoning, whitespace and JSON formatting."""
    return _visible_text(sent.get("content")) == _visible_text(reply.get("content")) and _calls(sent) == _calls(reply)
