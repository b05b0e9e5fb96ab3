"""The types one model exchange passes through: session -> dialect -> engine -> store -> dialect."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from polar_mitm.errors import DialectError, EngineError

__all__ = ["Completion", "DialectError", "EngineError", "EngineRecord", "Notes", "ParsedRequest", "StreamState", "ToolCall"]


@dataclass
class Notes:
    """What a dialect left out of the engine request (`ignored`: request paths) or changed on the way
    (`normalizations`: one sentence each). Stored as they are, in this order, in the exchange row's
    `ignored_fields` and `normalizations` columns, and shown by the content view."""

    ignored: list[str] = field(default_factory=list)
    normalizations: list[str] = field(default_factory=list)

    def ignore(self, path: str) -> None:
        self.ignored.append(path)

    def normalize(self, text: str) -> None:
        self.normalizations.append(text)

    def ignore_unknown(self, data: dict[str, Any], known: set[str], where: str) -> None:
        """Every key of `data` (found at `where`) outside `known`."""
        self.ignored += [f"{where}.{key}" for key in data if key not in known]


@dataclass
class ParsedRequest:
    """A provider request translated into the engine's chat-completions form."""

    api: str
    model: str
    stream: bool
    chat: dict[str, Any]
    # what the dialect ignored or changed on the way (e.g. developer->system), recorded with the row
    notes: Notes = field(default_factory=Notes)
    # dialect-private facts the renderer needs (include_usage, requested logprobs, ...)
    render: dict[str, Any] = field(default_factory=dict)
    # "generate" calls the engine for a completion; "count_tokens" only tokenizes
    action: str = "generate"

    # the row's `ignored_fields` and `normalizations` columns
    @property
    def ignored(self) -> list[str]:
        return self.notes.ignored

    @property
    def normalizations(self) -> list[str]:
        return self.notes.normalizations


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Completion:
    """What the engine sampled, with its exact token ids and logprobs."""

    id: str
    created: int
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    logprobs_content: list[dict[str, Any]] | None
    prompt_tokens: int
    completion_tokens: int
    # the stop string that ended the sample (vLLM's `stop_reason` when it is a string), if one did
    stop_sequence: str | None = None


@dataclass
class EngineRecord:
    """What the engine side of one exchange puts on its row, filled in as the call goes.

    The gateway makes one per exchange and hands it to the engine call (chat mode in the addon, tokens mode in
    `render/serve.py`), which returns it; a call that fails or is cancelled raises instead, and the record keeps
    how far it got (the request sent, when it started). Either way the gateway writes it to the row in one
    place (`gateway/outcome.py` `settle`). None: not reached, the column stays as it was (NULL).
    """

    engine_request: Any = None  # as sent (often a WireJSON: the store keeps its exact text)
    engine_response: Any = None  # the raw reply
    completion: Completion | None = None  # token ids, logprobs, finish reason and counts go on the row from here
    policy_version: int | None = None
    model_engine: str | None = None
    engine_started_at: datetime | None = None
    engine_ended_at: datetime | None = None
    render_mode: str | None = None  # "chat" (the engine renders) or "tokens" (the gateway does)
    bridged: bool | None = None
    bridge_reason: str | None = None
    bridge_key: str | None = None  # tokens mode: what a later turn's history is matched against (render/bridge.py)
    output_parse_error: str | None = None


@dataclass
class StreamState:
    """What every event of one streamed reply shares from its first byte on, before the engine has answered.

    `id` and `created` name the reply (each dialect derives its own ids from `id`, as it does from an engine id);
    `events` counts the events already sent, for grammars that number them (Responses' `sequence_number`).
    """

    id: str
    created: int
    events: int = 0

    @classmethod
    def of(cls, completion: Completion) -> StreamState:
        """The state of a stream rendered in one piece from a finished completion."""
        return cls(id=completion.id, created=completion.created)
