"""How one exchange ends: its row's status and error, and what its client is told. Pure: no mitmproxy, no I/O.

The addon serves a call one of two ways, as a JSON reply or as a stream whose headers went out before the engine
answered (gateway/streaming.py). Both end here: `outcome_of` maps what happened to one `Outcome`, and `settle`
writes it, with the engine call's `EngineRecord`, to the row in one place. The two paths differ only in how the
answer travels: a JSON reply carries `Outcome.http_status`; a stream already said 200, so its row's http_status is
200 and the same error goes out in the provider's in-stream grammar instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from polar_mitm.errors import CallAbandoned, DialectError, EngineError, PolarError, RenderError
from polar_mitm.exchange import EngineRecord
from polar_mitm.store import ExchangeRow


class CommitFailed(PolarError):
    """The store refused the exchange's row: the client must not take an unrecorded reply for a recorded one."""

    def __init__(self, cause: BaseException):
        self.message = f"polar-mitm could not record the exchange: {cause}"
        super().__init__(self.message)
        self.cause = cause


@dataclass(frozen=True)
class Outcome:
    """The row's `status` and `error`, and `answer`: the error the client gets in its provider's shape (None: the
    reply itself). `engine_response`: an engine error's body, recorded as the row's engine_response."""

    status: str
    error: str | None = None
    answer: DialectError | None = None
    engine_response: Any = None

    @property
    def http_status(self) -> int:
        """The status line of a JSON reply (a stream's was 200 before the outcome was known)."""
        return 200 if self.answer is None else self.answer.status

    def answer_or_raise(self) -> DialectError:
        """The answer of a failure's outcome (every failure has one)."""
        if self.answer is None:
            raise ValueError(f"the outcome {self.status!r} has no error answer")
        return self.answer


OK = Outcome("ok")


def outcome_of(failure: BaseException | None, client_gone: str | None = None) -> Outcome:
    """The outcome of an exchange that raised `failure` (None: the engine's reply is ready to send).

    `client_gone`: why nobody reads the reply any more, when the client left after the reply was made (kept,
    but it never reached the harness); only asked about a reply, since a failure says what happened itself. Asked
    of the client's socket (gateway/delivery.py), not only of mitmproxy's view of it, which lags under load.
    A client can still leave after the commit: then the committed `ok` row gets a mark, its later status (the
    table's third row; schema.MARKS_TABLE), which the `exchanges` view shows instead.

    | outcome                                   | row status          | row error       | client: status, kind    |
    |-------------------------------------------|---------------------|-----------------|-------------------------|
    | a reply                                   | ok                  | -               | the reply, 200          |
    | a reply whose client left (client_gone)   | client_disconnected | client_gone     | the reply, 200 (unread) |
    | a reply committed ok, then not delivered  | client_disconnected | "the reply was  | the reply (unread)      |
    |   (its client closed or reset before or   |   (a mark, after    |  committed ok   |                         |
    |   while it was written: delivery.py)      |   the commit)       |  but not ..."   |                         |
    | CallAbandoned client_disconnected         | client_disconnected | its message     | 499 client_disconnected |
    | CallAbandoned gateway_shutdown            | gateway_shutdown    | its message     | 503 gateway_shutdown    |
    | RenderError (tokens mode cannot render)   | render_error        | its message     | its status and kind     |
    | DialectError, status < 500                | bad_request         | its message     | its status and kind     |
    | DialectError, status >= 500               | internal_error      | its message     | its status and kind     |
    | EngineError                               | its status_class    | its message     | http_status, the class  |
    | CommitFailed (the store refused the row)  | store_error         | its message     | 500 store_error         |
    | any other Exception (a bug of ours)       | internal_error      | "Type: message" | 500 internal_error      |

    499 is nginx's "client closed request": nobody reads it, but the recorded response_body says what happened.
    A CommitFailed row is never stored (the store refused it); the client gets the error instead of the reply.
    """
    if failure is None:
        return Outcome("client_disconnected", client_gone) if client_gone else OK
    if isinstance(failure, CallAbandoned):
        status = 499 if failure.status_class == "client_disconnected" else 503
        return Outcome(failure.status_class, failure.message, DialectError(status, failure.status_class, failure.message))
    if isinstance(failure, RenderError):
        return Outcome("render_error", failure.message, failure)
    if isinstance(failure, DialectError):
        return Outcome("bad_request" if failure.status < 500 else "internal_error", failure.message, failure)
    if isinstance(failure, EngineError):
        return Outcome(failure.status_class, failure.message, failure.for_client(), failure.engine_body)
    if isinstance(failure, CommitFailed):
        return Outcome("store_error", failure.message, DialectError(500, "store_error", failure.message))
    described = f"{type(failure).__name__}: {failure}"
    return Outcome("internal_error", described, DialectError(500, "internal_error", f"polar-mitm internal error: {described}"))


def forget_tracebacks(failure: BaseException | None) -> None:
    """Drop the tracebacks of a failure whose outcome is decided (and, for a bug, logged), and of the exceptions it
    chains. A failure held in a local of a frame its traceback holds is a reference cycle (so is an engine call's
    task that holds its exception), and the cycle kept the frames, and with them the flow, the request's body and
    the engine's reply, until the cyclic collector came by: ~100 frames of failed calls per 40 s in the soak."""
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        failure.__traceback__ = None
        failure = failure.__cause__ or failure.__context__


def settle(
    row: ExchangeRow, record: EngineRecord, outcome: Outcome, *, http_status: int, response_body: Any,
    response_stream: str | None, ended_at: datetime,
) -> None:
    """Write an exchange's end to its row: what the engine call recorded, then its outcome and reply. With
    `apply_record` the one place the addon writes these columns (what the request gave is there already)."""
    apply_record(row, record)
    if outcome.engine_response is not None:
        row["engine_response"] = outcome.engine_response
    row["status"] = outcome.status
    if outcome.error is not None:
        row["error"] = outcome.error
    row["http_status"] = http_status
    row["response_body"] = response_body
    if response_stream is not None:
        row["response_stream"] = response_stream
    row["ended_at"] = ended_at


# EngineRecord fields that are row columns of the same name; a Completion's go on the row as a whole
RECORD_COLUMNS = (
    "engine_request", "engine_response", "policy_version", "model_engine", "engine_started_at", "engine_ended_at",
    "render_mode", "bridged", "bridge_reason", "bridge_key", "output_parse_error",
)
COMPLETION_COLUMNS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "finish_reason", "prompt_tokens", "completion_tokens")


def apply_record(row: ExchangeRow, record: EngineRecord) -> None:
    """The engine call's columns, as far as it got (also for an attempt aborted by pause(abort), a row of its own)."""
    for column in RECORD_COLUMNS:
        if (value := getattr(record, column)) is not None:
            row[column] = value  # type: ignore[literal-required]
    if (completion := record.completion) is not None:
        for column in COMPLETION_COLUMNS:
            row[column] = getattr(completion, column)  # type: ignore[literal-required]
