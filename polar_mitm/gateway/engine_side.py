"""The engine's side of one exchange: which engine model serves it, and the one call (chat mode here, tokens mode
through render/serve.py) that fills the exchange's `EngineRecord`, held while the gateway is paused and issued
again after a pause(abort) (gateway/control.py). The addon writes the record to the row (gateway/outcome.py).
"""

from __future__ import annotations

import fnmatch
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polar_mitm import harnesses
from polar_mitm.engines import EngineClient
from polar_mitm.exchange import DialectError, EngineError, EngineRecord, ParsedRequest
from polar_mitm.gateway.control import EngineCallAborted, PolicyControl
from polar_mitm.gateway.outcome import apply_record
from polar_mitm.render.serve import TokenPath
from polar_mitm.store import ExchangeRow, ExchangeStore, now

# --engine-hook: (engine request, exchange context) -> the request to send instead, or None to keep it
EngineHook = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]
# how much sooner than the harness gives up the gateway answers a non-streamed call it cannot finish
UNSTREAMED_MARGIN_S = 5.0


@dataclass
class EngineSide:
    """What the gateway is configured with when an exchange starts: its engine (None: none configured), the
    pause/resume control, the store (for aborted attempts), tokens mode, the engine hook and the model map."""

    engine: EngineClient | None
    control: PolicyControl
    store: ExchangeStore
    tokens: TokenPath | None = None
    hook: EngineHook | None = None
    model_map: Sequence[tuple[str, str | None]] = ()

    def client(self) -> EngineClient:
        if self.engine is None:
            raise EngineError("engine_unreachable", "polar-mitm has no inference engine configured (polar_upstream)", 503)
        return self.engine

    async def model_for(self, requested: str) -> str:
        """The engine model that serves a request for `requested`: the model map's target, else the engine's own."""
        engine = self.client()
        if self.model_map:
            for pattern, target in self.model_map:
                if fnmatch.fnmatchcase(requested, pattern):
                    return target or await engine.discover()
            raise DialectError(404, "model_not_found", f"The model '{requested}' does not exist or is not served by this gateway", "model")
        return await engine.discover()

    async def count(self, parsed: ParsedRequest, engine_model: str, record: EngineRecord) -> int:
        """A token-count call (the APIs with a count endpoint), into `record`."""
        engine = self.client()
        count_request = engine.build_count_request(parsed.chat, engine_model)
        record.engine_request, record.engine_started_at = count_request, now()
        count = await engine.count_tokens(count_request)
        record.engine_ended_at, record.engine_response = now(), {"count": count}
        return count

    async def generate(self, parsed: ParsedRequest, engine_model: str, row: ExchangeRow, record: EngineRecord, timeout: float | None = None) -> EngineRecord:
        """The engine call of one exchange, into `record`, which it returns with its completion (`timeout`: this
        call's limit, if not the engine's). Raises what failed (EngineError, RenderError, ...); `record` keeps how
        far the call got. An attempt aborted for a weight update is committed as its own untrainable row (status
        'aborted') and the call is issued again after resume, under the new version and engine model."""
        engine = self.client()
        engine_request = engine.build_request(parsed.chat, engine_model)
        if self.hook is not None:
            context = {key: row.get(key) for key in ("session_id", "seq", "api", "model_requested", "harness", "path")}
            engine_request = self.hook(engine_request, context) or engine_request

        async def call(version: int, served_model: str | None) -> EngineRecord:
            request = dict(engine_request, model=served_model) if served_model else engine_request
            record.policy_version, record.model_engine, record.engine_started_at = version, request["model"], now()
            try:
                if self.tokens is not None and await self.tokens.in_use():
                    return await self.tokens.complete(
                        request, request["model"], record, session_id=row["session_id"], exchange_id=row["exchange_id"],
                        request_chars=len(row.get("request_body") or ""), notes=parsed.notes,
                    )
                record.engine_request, record.render_mode = request, "chat"
                # WireJSON: the store records the texts that crossed the wire, not encoded again (100+ KB of token ids)
                record.engine_request, record.engine_response, record.completion = await engine.complete(request, parsed.notes, timeout)
                return record
            finally:
                record.engine_ended_at = now()

        while True:
            try:
                _, result = await self.control.run(call)
                return result
            except EngineCallAborted as aborted:
                attempt = row.copy()
                apply_record(attempt, record)
                attempt["exchange_id"], attempt["status"], attempt["ended_at"] = str(uuid.uuid4()), "aborted", now()
                attempt["error"] = f"{aborted}; issued again after resume as exchange {row['exchange_id']}"
                await self.store.commit_exchange(attempt)
                row["seq"] = self.store.next_seq(row["session_id"])


def unstreamed_timeout(harness: str | None, engine_timeout: float) -> float | None:
    """A non-streamed call cannot be kept alive: when the calling harness is known to give up on one sooner than
    --engine-timeout, the engine gets until just before then, and the harness a provider-shaped 504 (recorded as
    engine_timeout) instead of a reply it would no longer read (recorded as ok, and then retried: a duplicate)."""
    limit = harnesses.get(harness).unstreamed_timeout if harness in harnesses.NAMES else None
    if limit is None or limit - UNSTREAMED_MARGIN_S >= engine_timeout:
        return None
    return limit - UNSTREAMED_MARGIN_S
