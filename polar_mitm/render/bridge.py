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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from polar_mitm.render.renderer import Renderer

# bridge_reason values for rows that were not bridged
FIRST_TURN = "first_turn"  # no assistant turn in the conversation: nothing to extend
NO_LINEAGE = "no_lineage"  # assistant turns, but no exchange of this session answered this history (e.g. gateway restarted)
COMPACTION = "compaction"  # the history is shorter than one this session sent before: summarized or truncated
EDITED_HISTORY = "edited_history"  # an earlier message or our answer changed
TOOLS_CHANGED = "tools_changed"  # the same history, with other tools or template arguments
TEMPLATE_MISMATCH = "template_mismatch"  # the template does not render the new messages as an append


@dataclass
class Turn:
    """One answered exchange, as bridging needs it."""

    exchange_id: str
    prefix_key: str  # digest of its messages + our answer + tools/template kwargs
    history: list[dict[str, Any]]  # its conversation (as the template sees it) + our answer, reasoning left out
    keys: list[str]  # canonical key of each history message, for diagnosing a miss
    setup_key: str
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class Bridged:
    prompt_ids: list[int]
    tail_ids: list[int]


class Lineages:
    """The answered turns of recent sessions (in memory, bounded), looked up by conversation prefix."""

    def __init__(self, max_sessions: int = 2048, max_turns: int = 256):
        self.sessions: OrderedDict[str, OrderedDict[str, Turn]] = OrderedDict()
        self.max_sessions, self.max_turns = max_sessions, max_turns
        self._lock = threading.Lock()  # prompts are built in worker threads while the event loop remembers turns

    def remember(self, session_id: str, turn: Turn) -> None:
        with self._lock:
            self._remember(session_id, turn)

    def _remember(self, session_id: str, turn: Turn) -> None:
        turns = self.sessions.setdefault(session_id, OrderedDict())
        self.sessions.move_to_end(session_id)
        turns[turn.prefix_key] = turn  # a retried exchange replaces its first attempt
        turns.move_to_end(turn.prefix_key)
        while len(turns) > self.max_turns:
            turns.popitem(last=False)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def find(self, session_id: str, conversation: list[dict[str, Any]], setup: str) -> tuple[Turn | None, int, str | None]:
        """(the turn this conversation extends, how many messages it covers, None) or (None, 0, reason)."""
        keys = [message_key(message) for message in conversation]
        with self._lock:
            return self._find(session_id, conversation, keys, setup)

    def _find(self, session_id: str, conversation: list[dict[str, Any]], keys: list[str], setup: str) -> tuple[Turn | None, int, str | None]:
        turns = self.sessions.get(session_id) or {}
        # deepest first: the longest earlier history that this one extends, leaving at least one new message
        for end in range(len(keys) - 1, 0, -1):
            if conversation[end - 1]["role"] != "assistant":
                continue
            turn = turns.get(_digest(setup, keys[:end]))
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


def make_turn(exchange_id: str, conversation: list[dict[str, Any]], answer: dict[str, Any], setup: str, prompt_ids: list[int], completion_ids: list[int]) -> Turn:
    history = [_without_reasoning(message) for message in [*conversation, answer]]
    keys = [message_key(message) for message in history]
    return Turn(exchange_id, _digest(setup, keys), history, keys, setup, list(prompt_ids), list(completion_ids))


def bridge(renderer: Renderer, parent: Turn, conversation: list[dict[str, Any]], covered: int, tools: Any, kwargs: dict[str, Any]) -> Bridged | None:
    """The bridged prompt, or None if the template does not render the new messages as an append."""
    history = parent.history
    new = [_without_reasoning(message) for message in conversation[covered:]]
    head = renderer.render_text(history, tools, kwargs, add_generation_prompt=False)
    full = renderer.render_text(history + new, tools, kwargs, add_generation_prompt=True)
    end_of_turn = head.rfind(renderer.eos_token) if renderer.eos_token else -1
    if not full.startswith(head) or end_of_turn < 0 or head[end_of_turn + len(renderer.eos_token) :].strip():
        return None
    # a sample that ended with the template's own end-of-turn token gets only what follows it; one that ended
    # otherwise (max_tokens, a stop string, another stop token such as <|endoftext|>) gets the whole end of turn
    ended_turn = bool(parent.completion_ids) and parent.completion_ids[-1] == renderer.end_of_turn_id
    delimiter = head[end_of_turn + len(renderer.eos_token) :] if ended_turn else head[end_of_turn:]
    tail_ids = renderer.encode(delimiter + full[len(head) :])
    return Bridged(prompt_ids=parent.prompt_ids + parent.completion_ids + tail_ids, tail_ids=tail_ids)


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
