"""Bridging: a request that extends an earlier exchange of its session continues that exchange's exact tokens.

If the request's messages are an earlier exchange's messages, then the assistant turn we answered it with, then
new messages (tool results, a user turn), its prompt is

    earlier prompt ids + earlier sampled ids, verbatim (reasoning the harness dropped included)
    + delimiter + the new messages rendered by the template (+ the generation prompt)

so consecutive exchanges of a lineage are strict token prefixes by construction. Messages are compared as the
template sees them (after `Renderer.conversation`), ignoring what the template cannot see or what the harness
may legitimately drop: tool-call ids, reasoning, and a tool call's argument formatting (compared as JSON).

The delimiter: the template renders the history up to and including our turn (reasoning left out, so
templates that strip earlier `<think>` render it the same either way), then the history plus the new messages
with the generation prompt. The first must be a text prefix of the second; what the second adds is the new
messages. The first ends with the template's end of our turn: the end-of-turn token (`<|im_end|>`) and what
follows it (`\\n`). If the sample stopped on that token, the sampled ids already hold it and only what follows
it is added; otherwise (cut off by max_tokens or a stop string, or stopped by another stop token such as
`<|endoftext|>`, kept verbatim) the whole end of turn is. Tokenizing that text
on its own gives the ids a full render would, since it starts right after a special token, where the
tokenizer splits anyway. Whatever does not hold (no end-of-turn token in the head, head not a prefix) is
`template_mismatch` and a full render.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from polar_mitm.render.renderer import Renderer

# bridge_reason values for rows that were not bridged
FIRST_TURN = "first_turn"  # no assistant turn in the conversation: nothing to extend
NO_LINEAGE = "no_lineage"  # assistant turns, but no exchange of this session answered this history (in memory or in the store)
COMPACTION = "compaction"  # the history is shorter than one this session sent before: summarized or truncated
EDITED_HISTORY = "edited_history"  # an earlier message or our answer changed
TOOLS_CHANGED = "tools_changed"  # the same history, with other tools or template arguments
TEMPLATE_MISMATCH = "template_mismatch"  # the template does not render the new messages as an append


@dataclass(slots=True)
class Turn:
    """One answered exchange, as bridging needs it.

    Held compactly, since a session keeps one per turn: token ids as 4-byte arrays (a list holds a 28-byte int object
    and an 8-byte pointer per id); a bridged turn keeps only the prompt ids it adds to its parent's prompt and sampled
    ids (`tail_ids`), so a session's 30th turn holds what its 3rd does beyond its own tokens, not its whole prompt
    again. No message text is kept: a request that extends a turn carries that turn's messages itself (they are what
    its key matched), and bridging renders them from there; a turn keeps one key per message, for finding and for
    saying why a request was not bridged."""

    exchange_id: str
    prefix_key: str  # digest of its messages + our answer + tools/template kwargs
    keys: list[str]  # canonical key of each message of its conversation + our answer (message_key)
    setup_key: str
    tail_ids: array  # its prompt after the parent's prompt + sampled ids (no parent: the whole prompt)
    completion_ids: array
    parent: Turn | None = None  # the turn its prompt extends
    nbytes: int = 0  # about what this turn holds of its own (_nbytes: its ids and keys)

    def prompt_ids(self) -> list[int]:
        """Its whole prompt: each ancestor's tail and sampled ids, then its own tail."""
        return self.prompt_array().tolist()

    def prompt_array(self) -> array:
        """prompt_ids() as 4-byte ids, joined without making a Python int of each."""
        chain: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            chain.append(turn)
            turn = turn.parent
        ids = array("I")
        for ancestor in reversed(chain[1:]):
            ids += ancestor.tail_ids
            ids += ancestor.completion_ids
        ids += self.tail_ids
        return ids


@dataclass
class Bridged:
    # 4-byte ids (bridge() makes arrays): a gateway at 1,000 sessions held hundreds of bridged prompts at once as
    # lists, rendered in worker threads and waiting for the event loop (bench/scale.py, tokens mode)
    prompt_ids: array
    tail_ids: array
    parent: Turn | None = None  # the turn it extends; its messages are the start of this one's


# What the lineages of all sessions may hold together before the least recently used sessions are dropped (a dropped
# session's next turn is looked up in the store by `bridge_key`, serve.py): about 2,000 sessions of 30 turns growing to
# 20k tokens each (~100 KB a session: 4 bytes an id, a few hundred bytes a turn).
MAX_LINEAGE_BYTES = 192 * 2**20


class Lineages:
    """The answered turns of recent sessions (in memory, bounded), looked up by conversation prefix.

    Bounded three ways, the least recently used session going first: `max_sessions`, `max_turns` per session (its
    oldest turns can no longer be found), and `max_bytes` over all sessions (`Turn.nbytes`), so a gateway's memory
    stays flat however many sessions pass through it. A turn no longer found may still be held, as the parent of
    later ones: a session's bytes (`session_bytes`) count every turn it remembered until the session goes."""

    def __init__(self, max_sessions: int = 2048, max_turns: int = 256, max_bytes: int = MAX_LINEAGE_BYTES):
        self.sessions: OrderedDict[str, OrderedDict[str, Turn]] = OrderedDict()
        self.session_bytes: dict[str, int] = {}
        self.max_sessions, self.max_turns, self.max_bytes = max_sessions, max_turns, max_bytes
        self.nbytes = 0
        self._lock = threading.Lock()  # prompts are built in worker threads while the event loop remembers turns

    def holds(self, session_id: str) -> bool:
        """Whether any turn of the session is in memory (a gateway restarted, or the session evicted: not)."""
        return session_id in self.sessions

    def remember(self, session_id: str, turn: Turn) -> None:
        with self._lock:
            self._remember(session_id, turn)

    def _remember(self, session_id: str, turn: Turn) -> None:
        turns = self.sessions.setdefault(session_id, OrderedDict())
        self.sessions.move_to_end(session_id)
        counted = turn.nbytes
        if (replaced := turns.pop(turn.prefix_key, None)) is not None:  # a retried exchange replaces its first attempt
            counted -= replaced.nbytes
        turns[turn.prefix_key] = turn
        self.session_bytes[session_id] = self.session_bytes.get(session_id, 0) + counted
        self.nbytes += counted
        while len(turns) > self.max_turns:
            turns.popitem(last=False)  # still counted: later turns may hold it as their parent
        while len(self.sessions) > self.max_sessions or (self.nbytes > self.max_bytes and len(self.sessions) > 1):
            dropped, _ = self.sessions.popitem(last=False)
            self.nbytes -= self.session_bytes.pop(dropped)

    def find(self, session_id: str, conversation: list[dict[str, Any]], setup: str) -> tuple[Turn | None, int, str | None]:
        """(the turn this conversation extends, how many messages it covers, None) or (None, 0, reason)."""
        keys = [message_key(message) for message in conversation]
        with self._lock:
            return self._find(session_id, conversation, keys, setup)

    def _find(self, session_id: str, conversation: list[dict[str, Any]], keys: list[str], setup: str) -> tuple[Turn | None, int, str | None]:
        turns = self.sessions.get(session_id) or {}
        for end, digest in prefix_digests(conversation, keys, setup):
            turn = turns.get(digest)
            if turn is not None:
                return turn, end, None
        return None, 0, self._why_not(turns.values(), conversation, keys, setup)

    @staticmethod
    def _why_not(turns: Any, conversation: list[dict[str, Any]], keys: list[str], setup: str) -> str:
        if not any(message["role"] == "assistant" for message in conversation):
            return FIRST_TURN
        best: Turn | None = None
        best_common = 0
        for turn in turns:  # oldest first: on a tie the newest wins
            common = _common_prefix(turn.keys, keys)
            if common and common >= best_common:
                best, best_common = turn, common
        if best is None:
            return NO_LINEAGE
        if best_common == len(best.keys) and best.setup_key != setup:
            return TOOLS_CHANGED
        if len(keys) < len(best.keys):
            return COMPACTION
        return EDITED_HISTORY


def prefix_digests(conversation: list[dict[str, Any]], keys: list[str], setup: str) -> Iterator[tuple[int, str]]:
    """(messages covered, the key an earlier turn answering them has) for each earlier history this conversation
    may extend: every prefix ending in an assistant turn and leaving at least one new message, deepest first
    (lazily: a hit in memory stops it)."""
    for end in range(len(keys) - 1, 0, -1):
        if conversation[end - 1]["role"] == "assistant":
            yield end, _digest(setup, keys[:end])


def setup_key(renderer: Renderer, chat: dict[str, Any]) -> str:
    """What besides the messages changes the rendered prompt: tools and the template's arguments."""
    return _hash([renderer.tools(chat), renderer.template_kwargs(chat)])


def message_key(message: dict[str, Any]) -> str:
    """A message as the template renders it, minus what may differ without changing what the model saw."""
    canonical: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"))}
    if message.get("name"):
        canonical["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        canonical["tool_calls"] = [[(call.get("function") or {}).get("name"), (call.get("function") or {}).get("arguments")] for call in calls]
    return _hash(canonical)


def answer_message(content: str | None, tool_calls: list[Any]) -> dict[str, Any]:
    """Our reply as the harness will send it back (tool calls with object arguments, as `conversation` makes them)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}} for call in tool_calls
        ]
    return message


def make_turn(
    exchange_id: str, conversation: list[dict[str, Any]], answer: dict[str, Any], setup: str, prompt_ids: Sequence[int],
    completion_ids: Sequence[int], bridged: Bridged | None = None,
) -> Turn:
    """The turn to remember for an answered exchange. When it was bridged, the keys of the messages it shares with
    its parent are the parent's (the same messages by `message_key`, which is what bridging matched), so only those
    of what follows are made anew."""
    parent = bridged.parent if bridged is not None else None
    shared = len(parent.keys) if parent is not None else 0
    own_keys = [message_key(message) for message in [*conversation[shared:], answer]]
    if parent is not None:
        assert bridged is not None
        keys = [*parent.keys, *own_keys]
        tail = _ids(bridged.tail_ids)
    else:
        keys = own_keys
        tail = _ids(prompt_ids)
    completion = _ids(completion_ids)
    return Turn(exchange_id, _digest(setup, keys), keys, setup, tail, completion, parent, _nbytes(tail, completion, keys, len(own_keys)))


def stored_turn(exchange_id: str, history: list[dict[str, Any]], setup: str, prompt_ids: list[int], completion_ids: list[int]) -> Turn:
    """A turn read back from the store (its row's `bridge_key` matched): `history` is the messages of the new
    request that the key covers, which are that turn's conversation and answer as the template sees them."""
    keys = [message_key(message) for message in history]
    prompt, completion = _ids(prompt_ids), _ids(completion_ids)
    return Turn(exchange_id, _digest(setup, keys), keys, setup, prompt, completion, None, _nbytes(prompt, completion, keys, len(keys)))


def _nbytes(tail: array, completion: array, keys: list[str], own_keys: int) -> int:
    """About what a turn holds of its own: itself and its two arrays and list (~250 bytes), its ids, a pointer per
    key and the keys it made (a 32-character str is 73 bytes; the ones it shares are its parent's objects)."""
    return 250 + 4 * (len(tail) + len(completion)) + 8 * len(keys) + 73 * own_keys


def _ids(values: Sequence[int]) -> array:
    """Token ids as 4-byte ones: an array of them as it is (tokens mode hands over the prompt's own; nothing changes
    an array once made), anything else copied into one."""
    return values if isinstance(values, array) and values.typecode == "I" else array("I", values)


def bridge(renderer: Renderer, parent: Turn, conversation: list[dict[str, Any]], covered: int, tools: Any, kwargs: dict[str, Any]) -> Bridged | None:
    """The bridged prompt, or None if the template does not render the new messages as an append. `covered`: how
    many of the conversation's messages are the parent's (its conversation and our answer, as `find` matched them)."""
    messages = [_without_reasoning(message) for message in conversation]
    head = renderer.render_text(messages[:covered], tools, kwargs, add_generation_prompt=False)
    full = renderer.render_text(messages, tools, kwargs, add_generation_prompt=True)
    end_of_turn = head.rfind(renderer.eos_token) if renderer.eos_token else -1
    if not full.startswith(head) or end_of_turn < 0 or head[end_of_turn + len(renderer.eos_token) :].strip():
        return None
    # a sample that ended with the template's own end-of-turn token gets only what follows it; one that ended
    # otherwise (max_tokens, a stop string, another stop token such as <|endoftext|>) gets the whole end of turn
    ended_turn = bool(parent.completion_ids) and parent.completion_ids[-1] == renderer.end_of_turn_id
    delimiter = head[end_of_turn + len(renderer.eos_token) :] if ended_turn else head[end_of_turn:]
    tail_ids = array("I", renderer.encode(delimiter + full[len(head) :]))
    prompt_ids = parent.prompt_array()
    prompt_ids += parent.completion_ids
    prompt_ids += tail_ids
    return Bridged(prompt_ids=prompt_ids, tail_ids=tail_ids, parent=parent)


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key not in ("reasoning", "reasoning_content")}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text") or "" for part in content)


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _digest(setup: str, keys: list[str]) -> str:
    return hashlib.sha256((setup + "|" + "|".join(keys)).encode()).hexdigest()


def _hash(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
