"""One exchange in tokens mode: render (or bridge) the prompt, call the engine token-in, parse the sample.

The gateway hands over the engine's chat request after its engine hook and the exchange's `EngineRecord`; the
record comes back with the request as sent, the raw reply and a `Completion` the dialects render like any other,
and `render_mode`, `bridged`, `bridge_reason` and, when the sample's tool calls did not parse,
`output_parse_error` (the gateway writes it to the row).

Rendering and tokenizing run in a worker thread unless the request is tiny (a cold 12k-token first turn took
50-160 ms of CPU here, a bridged turn 2-9 ms; the Rust tokenizer releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

from polar_mitm.engines._api import EngineClient
from polar_mitm.errors import RenderError
from polar_mitm.exchange import Completion, EngineRecord, Notes
from polar_mitm.render import bridge, parsers, token_engine
from polar_mitm.render.renderer import Renderer
from polar_mitm.store import now

RENDER_MODES = ("chat", "tokens")
# request bodies above this many characters are rendered off the event loop (a cold 5k-token render took ~20-70 ms
# here, bench/tokens_bench.py); below it the thread hop would cost more than the render
INLINE_RENDER_CHARS = 4_000


class TokenPath:
    def __init__(self, engine: EngineClient, model: str | None = None, tool_format: str = "hermes"):
        parsers.TOOL_PARSERS.get(tool_format)  # an unknown format: ConfigError naming the valid ones, before any request
        self.engine = engine
        self.model = model  # a model directory or local Hugging Face id; None: the engine's own model directory
        self.tool_format = tool_format
        self.lineages = bridge.Lineages()
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
                        self._renderer = await asyncio.to_thread(Renderer.load, source)
                        # the tokenizer is millions of objects that live as long as the gateway: out of the
                        # collector's view (as the addon does at start), or the next full collection walks them
                        # all and stalls the event loop for seconds (measured: 3-10 s on this machine)
                        gc.freeze()
                    except RenderError as error:
                        self._load_error = error
        if self._load_error is not None:
            raise self._load_error
        assert self._renderer is not None
        return self._renderer

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
        big = request_chars > INLINE_RENDER_CHARS
        prompt = await asyncio.to_thread(self._prompt, renderer, session_id, chat) if big else self._prompt(renderer, session_id, chat)
        prompt_ids, conversation, setup, bridged, reason = prompt
        record.bridged, record.bridge_reason = bridged is not None, reason
        if self.max_model_len is None:
            self.max_model_len = self.engine.max_model_len  # configured (--engine-max-model-len) or read at discovery
        if self.max_model_len is None:
            await self._models()
        max_tokens = token_engine.max_new_tokens(chat, len(prompt_ids), self.max_model_len, notes)
        request = token_engine.build_request(self.engine, chat, model, prompt_ids, max_tokens)
        record.engine_request, record.engine_started_at = request, now()
        sent, raw, sampled = await token_engine.call(self.engine, request)
        record.engine_request, record.engine_response = sent, raw
        text = renderer.sampled_text(sampled.completion_ids)
        output = parsers.parse_output(text, self.tool_format, chat.get("tools"), think_opened=_opens_think(renderer, prompt_ids))
        record.output_parse_error = output.problem or None
        finish = "tool_calls" if output.tool_calls else sampled.finish_reason
        completion = Completion(
            id=sampled.id,
            created=sampled.created,
            content=output.content,
            reasoning=output.reasoning,
            tool_calls=output.tool_calls,
            finish_reason=finish,
            prompt_token_ids=_engine_echo(raw, prompt_ids),
            completion_token_ids=sampled.completion_ids,
            completion_logprobs=sampled.logprobs,
            logprobs_content=[{"token": text, "logprob": lp, "bytes": None, "top_logprobs": []} for text, lp in zip(renderer.token_texts(sampled.completion_ids), sampled.logprobs, strict=True)],
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(sampled.completion_ids),
            stop_sequence=sampled.stop_sequence,
        )
        answer = bridge.answer_message(output.content, output.tool_calls)
        self.lineages.remember(session_id, bridge.make_turn(exchange_id, conversation, answer, setup, prompt_ids, sampled.completion_ids))
        record.completion = completion
        return record

    def _prompt(self, renderer: Renderer, session_id: str, chat: dict[str, Any]) -> tuple[list[int], list[dict[str, Any]], str, bridge.Bridged | None, str | None]:
        """(prompt ids, the conversation as the template sees it, its setup key, the bridge or None, why not)."""
        conversation = renderer.conversation(chat["messages"])
        setup = bridge.setup_key(renderer, chat)
        parent, covered, reason = self.lineages.find(session_id, conversation, setup)
        if parent is not None:
            bridged = bridge.bridge(renderer, parent, conversation, covered, renderer.tools(chat), renderer.template_kwargs(chat))
            if bridged is not None:
                return bridged.prompt_ids, conversation, setup, bridged, None
            reason = bridge.TEMPLATE_MISMATCH
        text = renderer.render_text(conversation, renderer.tools(chat), renderer.template_kwargs(chat), add_generation_prompt=True)
        return renderer.encode(text), conversation, setup, None, reason


def _engine_echo(raw: dict[str, Any], prompt_ids: list[int]) -> Any:
    """The prompt ids as the engine echoed them (lazily parsed text the store keeps once), else ours."""
    choices = raw.get("choices") if isinstance(raw, dict) else None
    echo = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    return echo if echo is not None and len(echo) == len(prompt_ids) else prompt_ids


def _opens_think(renderer: Renderer, prompt_ids: list[int]) -> bool:
    """Whether the generation prompt left a `<think>` block open (templates that start the model thinking)."""
    tail = renderer.decode(prompt_ids[-4:])
    return tail.rstrip().endswith(parsers.THINK_OPEN)


