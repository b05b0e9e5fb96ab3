"""One exchange in tokens mode: render (or bridge) the prompt, call the engine token-in, parse the sample.

The gateway hands over the engine's chat request after its engine hook and the exchange's `EngineRecord`; the
record comes back with the request as sent, the raw reply and a `Completion` the dialects render like any other,
and `render_mode`, `bridged`, `bridge_reason`, `bridge_key` and, when the sample's tool calls did not parse,
`output_parse_error` (the gateway writes it to the row).

Lineages live in memory; a request of a session the gateway holds none of (it restarted, or evicted the session)
that extends an earlier turn is matched against the store's rows by `bridge_key` and bridged onto their tokens.

Rendering and tokenizing run in a worker thread unless the request is tiny (a cold 12k-token first turn took
50-160 ms of CPU here, a bridged turn 2-9 ms; the Rust tokenizer releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polar_mitm.engines._api import EngineClient
from polar_mitm.errors import RenderError
from polar_mitm.exchange import Completion, EngineRecord, Notes
from polar_mitm.render import bridge, parsers, token_engine
from polar_mitm.render.renderer import Renderer
from polar_mitm.store import now
from polar_mitm.store.reading import ExchangeStore

log = logging.getLogger("polar_mitm.render")

# auto: tokens mode wherever a tokenizer and chat template can be loaded (--render-model, or the engine's model
# directory on this machine) and the template's tool-call format has a parser; chat mode otherwise, saying why once
RENDER_MODES = ("chat", "tokens", "auto")
# request bodies above this many characters are rendered off the event loop (a cold 5k-token render took ~20-70 ms
# here, bench/tokens_bench.py); below it the thread hop would cost more than the render
INLINE_RENDER_CHARS = 4_000


class TokenPath:
    """`fallback` (--render auto): when the renderer cannot be had, the gateway renders in chat mode (`in_use`)
    instead of answering every call with the error."""

    def __init__(
        self, engine: EngineClient, model: str | None = None, tool_format: str = parsers.AUTO,
        stored: Callable[[], ExchangeStore | None] | None = None, fallback: bool = False, lineage_bytes: int = bridge.MAX_LINEAGE_BYTES,
    ):
        if tool_format != parsers.AUTO:
            parsers.TOOL_PARSERS.get(tool_format)  # an unknown format: ConfigError naming the valid ones, before any request
        self.engine = engine
        self.fallback = fallback
        self._said_fallback = False
        self.stored = stored  # the store a lineage no longer in memory is read back from (the gateway's, when open)
        self.model = model  # a model directory or local Hugging Face id; None: the engine's own model directory
        self.tool_format = tool_format
        self.lineages = bridge.Lineages(max_bytes=lineage_bytes)
        self._renderer: Renderer | None = None
        self._load_error: RenderError | None = None
        self._loading: asyncio.Lock | None = None
        self.max_model_len: int | None = None  # the engine's context length, from its /models

    async def renderer(self) -> Renderer:
        """The renderer, loaded on first use (a failure is kept and raised again: every request gets the same error)."""
        if self._renderer is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if self._renderer is None and self._load_error is None:
                    try:
                        source = self.model or await self._engine_model_dir()
                        renderer = await asyncio.to_thread(Renderer.load, source)
                        self.tool_format = self._tool_format(renderer)
                        self._renderer = renderer
                        # the tokenizer is millions of objects that live as long as the gateway: out of the
                        # collector's view (as the addon does at start), or the next full collection walks them
                        # all and stalls the event loop for seconds (measured: 3-10 s on this machine)
                        gc.freeze()
                    except RenderError as error:
                        self._load_error = _again(error)  # kept without this call's frames
        if self._load_error is not None:
            raise _again(self._load_error)
        assert self._renderer is not None
        return self._renderer

    async def in_use(self) -> bool:
        """Whether this call is rendered here: always in tokens mode (a renderer that cannot be had is every call's
        error); in auto mode only once the renderer loaded, chat mode otherwise (said once, with the reason)."""
        if not self.fallback:
            return True
        if self._said_fallback:
            return False  # said once; nothing raised per call
        try:
            await self.renderer()
        except RenderError as error:
            if not self._said_fallback:
                self._said_fallback = True
                log.warning(f"polar: --render auto: chat mode (the engine renders prompts), since {error.message}")
            return False
        return True

    @property
    def chosen(self) -> str | None:
        """The mode the calls get, once known: tokens (the renderer loaded, or tokens mode was asked for), chat (auto
        mode fell back), None (auto mode, and the engine has not answered yet: chosen at the first call)."""
        if not self.fallback or self._renderer is not None:
            return "tokens"
        return "chat" if self._load_error is not None else None

    def _tool_format(self, renderer: Renderer) -> str:
        """The tool parser: the one asked for, or (auto) the one for the format the template writes tool calls in."""
        if self.tool_format != parsers.AUTO:
            return self.tool_format
        found = parsers.format_of_template(renderer.template)
        if found is None:
            raise RenderError(
                500, "unknown_tool_format",
                f"the chat template of {renderer.source} writes tool calls in a format no tool parser knows (known: "
                f"{', '.join(parsers.TOOL_PARSERS.names())}); tool calls would come back as text: set --tool-parser",
            )
        return found

    async def _engine_model_dir(self) -> str:
        """vLLM's /models names the directory it loaded (`root`); usable when the engine runs on this machine."""
        for model in await self._models():
            root = model.get("root")
            if isinstance(root, str) and Path(root).is_dir():
                return root
        raise RenderError(500, "tokenizer_unavailable", "tokens mode: the engine's model directory is not on this machine; set the render model (--render-model PATH_OR_ID)")

    async def _models(self) -> list[dict[str, Any]]:
        models = await self.engine.models()
        if self.max_model_len is None:
            self.max_model_len = next((int(m["max_model_len"]) for m in models if m.get("max_model_len")), None)
        return models

    async def complete(
        self, chat: dict[str, Any], model: str, record: EngineRecord, *, session_id: str, exchange_id: str,
        request_chars: int = 0, notes: Notes | None = None,
    ) -> EngineRecord:
        """The exchange's engine call in tokens mode, filling `record` as it goes; returns it, completion set.
        `request_chars`: the size of the client's request (a big one is rendered off the event loop)."""
        record.render_mode, record.bridged = "tokens", False
        renderer = await self.renderer()
        # a session with earlier turns and none in memory: its lineage is read from the store, never on the event loop
        restore = self.stored is not None and not self.lineages.holds(session_id) and any(m.get("role") == "assistant" for m in chat["messages"])
        big = request_chars > INLINE_RENDER_CHARS or restore
        prompt, conversation, setup, bridged, reason = await asyncio.to_thread(self._prompt, renderer, session_id, chat, restore) if big else self._prompt(renderer, session_id, chat)
        record.bridged, record.bridge_reason = bridged is not None, reason
        if self.max_model_len is None:
            self.max_model_len = self.engine.max_model_len  # configured (--engine-max-model-len) or read at discovery
        if self.max_model_len is None:
            await self._models()
        max_tokens = token_engine.max_new_tokens(chat, len(prompt), self.max_model_len, notes)
        record.engine_request = token_engine.encode_request(self.engine, chat, model, prompt, max_tokens)
        record.engine_started_at = now()
        raw, sampled = await token_engine.call(self.engine, record.engine_request)
        record.engine_response = raw
        text = renderer.sampled_text(sampled.completion_ids)
        output = parsers.parse_output(text, self.tool_format, chat.get("tools"), think_opened=_opens_think(renderer, prompt))
        record.output_parse_error = output.problem or None
        finish = "tool_calls" if output.tool_calls else sampled.finish_reason
        completion = Completion(
            id=sampled.id,
            created=sampled.created,
            content=output.content,
            reasoning=output.reasoning,
            tool_calls=output.tool_calls,
            finish_reason=finish,
            prompt_token_ids=_engine_echo(raw, prompt),
            completion_token_ids=sampled.completion_ids,
            completion_logprobs=sampled.logprobs,
            logprobs_content=[{"token": text, "logprob": lp, "bytes": None, "top_logprobs": []} for text, lp in zip(renderer.token_texts(sampled.completion_ids), sampled.logprobs, strict=True)],
            prompt_tokens=len(prompt),
            completion_tokens=len(sampled.completion_ids),
            stop_sequence=sampled.stop_sequence,
        )
        answer = bridge.answer_message(output.content, output.tool_calls)
        turn = bridge.make_turn(exchange_id, conversation, answer, setup, prompt, sampled.completion_ids, bridged)
        self.lineages.remember(session_id, turn)
        record.bridge_key = turn.prefix_key
        record.completion = completion
        return record

    def _prompt(
        self, renderer: Renderer, session_id: str, chat: dict[str, Any], restore: bool = False,
    ) -> tuple[array, list[dict[str, Any]], str, bridge.Bridged | None, str | None]:
        """(prompt ids, the conversation as the template sees it, its setup key, the bridge or None, why not).

        The ids are 4-byte ones from here on, the engine's seconds included: a list holds a 28-byte int and an 8-byte
        pointer per id, and at 1,000 sessions (bench/scale.py, tokens mode) every exchange in flight held one, as did
        each render a worker thread had finished while the event loop was busy.
        `restore`: on a miss, look for the turn in the store (a worker thread only)."""
        conversation = renderer.conversation(chat["messages"])
        setup = bridge.setup_key(renderer, chat)
        parent, covered, reason = self.lineages.find(session_id, conversation, setup)
        if parent is None and reason == bridge.NO_LINEAGE and restore:
            parent, covered = self._restore(session_id, conversation, setup)
        if parent is not None:
            bridged = bridge.bridge(renderer, parent, conversation, covered, renderer.tools(chat), renderer.template_kwargs(chat))
            if bridged is not None:
                return bridged.prompt_ids, conversation, setup, bridged, None
            reason = bridge.TEMPLATE_MISMATCH
        text = renderer.render_text(conversation, renderer.tools(chat), renderer.template_kwargs(chat), add_generation_prompt=True)
        return array("I", renderer.encode(text)), conversation, setup, None, reason


    def _restore(self, session_id: str, conversation: list[dict[str, Any]], setup: str) -> tuple[bridge.Turn | None, int]:
        """The deepest earlier turn of the session that this conversation extends, from the store's ok rows by
        `bridge_key` (remembered again, so the turns after it bridge in memory); (None, 0) if none is there."""
        reader = self.stored() if self.stored is not None else None
        wanted = list(bridge.prefix_digests(conversation, [bridge.message_key(m) for m in conversation], setup))
        if reader is None or not wanted:
            return None, 0
        sql = (
            "SELECT bridge_key, exchange_id, prompt_token_ids, completion_token_ids FROM exchanges "
            f"WHERE status = 'ok' AND bridge_key IN ({', '.join('?' for _ in wanted)}) ORDER BY seq DESC"
        )
        try:
            _, rows = reader.query(sql, [digest for _, digest in wanted], session=session_id)
        except Exception as error:  # noqa: BLE001 - the store in trouble (its writer reports that): a full render
            log.warning(f"polar-mitm: tokens mode could not read session {session_id}'s lineage from the store: {error}")
            return None, 0
        found: dict[str, Any] = {}
        for row in rows:
            found.setdefault(row[0], row)  # a retried exchange: its latest row
        for end, digest in wanted:
            match = found.get(digest)
            if match is not None and match[2] is not None and match[3] is not None:
                turn = bridge.stored_turn(match[1], conversation[:end], setup, list(match[2]), list(match[3]))
                self.lineages.remember(session_id, turn)
                return turn, end
        return None, 0


def _engine_echo(raw: dict[str, Any], prompt_ids: array) -> Any:
    """The prompt ids as the engine echoed them (lazily parsed text the store keeps once), else ours."""
    choices = raw.get("choices") if isinstance(raw, dict) else None
    echo = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    return echo if echo is not None and len(echo) == len(prompt_ids) else prompt_ids.tolist()


def _again(error: RenderError) -> RenderError:
    """The kept load failure as a new exception for this call. Raising the kept one again chained every caller's
    frames onto its traceback, so it held each exchange's request and reply for the gateway's life (measured: RSS
    0.37 -> 1.4 GB in 10 s at 64 sessions, chat mode under --render auto, bench/memory_bench.py)."""
    return RenderError(error.status, error.kind, error.message, error.param)


def _opens_think(renderer: Renderer, prompt_ids: array) -> bool:
    """Whether the generation prompt left a `<think>` block open (templates that start the model thinking)."""
    tail = renderer.decode(prompt_ids[-4:].tolist())
    return tail.rstrip().endswith(parsers.THINK_OPEN)


