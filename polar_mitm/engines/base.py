"""What every engine client does: call an OpenAI-compatible chat endpoint once, non-streaming.

`Engine` satisfies `engines._api.EngineClient` for one engine URL; every HTTP call goes through `_send`, which
also keeps the URL's `Reachability` (answered / unreachable) for the gateway's log and status.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import orjson

from polar_mitm.engines._api import Reachability
from polar_mitm.exchange import Completion, EngineError, Notes, ToolCall
from polar_mitm.util import exact_bytes

# how each engine request spells the output budget (every dialect maps its own spelling onto these)
BUDGET_KEYS = ("max_tokens", "max_completion_tokens")


class WireJSON(dict):
    """A JSON object together with the exact text it crossed the wire as.

    The engine request is encoded once and the reply decoded once; the store records these texts as they are
    instead of encoding 100+ KB of token ids and logprobs again on every exchange. A request keeps the bytes it was
    encoded to (`data`: the object the HTTP client sends, and holds for the whole call) and makes its `text` from them
    when the store asks, rather than holding the request twice while the engine works; a reply keeps the text it was
    decoded from.
    """

    __slots__ = ("_text", "_data", "strict")

    def __init__(self, value: dict[str, Any], text: str | None = None, strict: bool = True):
        super().__init__(value)
        self._text, self._data, self.strict = text, None, strict
        if text is None:
            try:
                self._data = exact_bytes(orjson.dumps(value))  # held through the engine call
            except (orjson.JSONEncodeError, TypeError):  # non-string keys, ints beyond 64 bits
                self._text, self.strict = json.dumps(value, ensure_ascii=False, separators=(",", ":")), False

    @property
    def text(self) -> str:
        if self._text is None:
            assert self._data is not None
            return self._data.decode()
        return self._text

    @property
    def data(self) -> bytes:
        return self._data if self._data is not None else self.text.encode()

    def texts(self) -> tuple[str | None, bytes | None, bool, dict[str, Any] | None]:
        """What `restored` rebuilds it from for the store: the wire text or bytes, strictness, and the object only
        when its text is not strict JSON (the store then encodes the object again)."""
        return self._text, self._data, self.strict, None if self.strict else dict(self)

    @classmethod
    def restored(cls, text: str | None, data: bytes | None, strict: bool, value: dict[str, Any] | None) -> WireJSON:
        """A copy carrying `texts()` only (the store reads the text, never the object): what a store in another
        process gets instead of the parsed reply, which would cost the gateway its pickling."""
        wire = cls.__new__(cls)
        if value:
            dict.update(wire, value)
        wire._text, wire._data, wire.strict = text, data, strict
        return wire


class TokenIds(Sequence[int]):
    """Prompt token ids left as their JSON text until someone reads them.

    A long prompt's ids are most of an engine reply (14k ids: ~90 KB), and the gateway only hands them to the
    store, which records where they are in the reply's text instead of a second copy. Parsing them into Python
    ints was the largest single cost on the event loop; now it happens only if something reads them.
    """

    __slots__ = ("source", "start", "end", "_ids")

    def __init__(self, source: str, start: int, end: int):
        self.source, self.start, self.end = source, start, end  # source[start:end] is the array, brackets included
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = orjson.loads(self.source[self.start : self.end])
        return self._ids

    def __len__(self) -> int:
        if self._ids is not None:
            return len(self._ids)
        return 0 if not self.source[self.start + 1 : self.end - 1].strip() else self.source.count(",", self.start, self.end) + 1

    def __getitem__(self, index: Any) -> Any:
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self.ids() == list(other)

    def __repr__(self) -> str:
        return f"TokenIds({self.ids()!r})"


def _decode(text: str) -> Any:
    lazy = _decode_with_lazy_prompt_ids(text)
    if lazy is not None:
        return lazy
    strict = True
    try:
        # orjson: ~2.5x faster on replies that are mostly token-id arrays (the decode was a fifth of the event loop)
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = json.loads(text)  # what orjson refuses and json accepts (NaN, lone surrogates, huge ints)
        strict = False
    return WireJSON(value, text, strict) if isinstance(value, dict) else value


PROMPT_IDS_KEY = '"prompt_token_ids"'


def _decode_with_lazy_prompt_ids(text: str) -> WireJSON | None:
    """Parse a reply with its prompt-id array left out, then put it back as TokenIds; None if that is not safe."""
    key = text.find(PROMPT_IDS_KEY)
    # a key inside a string value would be escaped (\"), so a single occurrence is a real key
    if key < 0 or text.find(PROMPT_IDS_KEY, key + 1) >= 0:
        return None
    start = text.find("[", key)
    end = text.find("]", start) + 1
    if start < 0 or end <= 0 or text[key + len(PROMPT_IDS_KEY) : start].strip() != ":" or text.find("[", start + 1, end) >= 0:
        return None
    try:
        value = orjson.loads(text[:start] + "[]" + text[end:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    ids = TokenIds(text, start, end)
    choices = value.get("choices")
    if value.get("prompt_token_ids") == []:  # vLLM
        value["prompt_token_ids"] = ids
    elif isinstance(choices, list) and choices and isinstance(choices[0], dict) and choices[0].get("prompt_token_ids") == []:  # SGLang
        choices[0]["prompt_token_ids"] = ids
    else:
        return None
    return WireJSON(value, text, True)


# how long a new connection to the engine may take: past it, the call fails as engine_timeout, saying so
CONNECT_TIMEOUT_S = 10.0


class Engine:
    kind = "openai"

    def __init__(
        self, base_url: str, served_model: str | None = None, timeout: float = 600.0, split_reasoning: bool = False,
        max_model_len: int | None = None,
    ):
        # engines served without a reasoning parser return `<think>...</think>` inline in content
        self.split_reasoning = split_reasoning
        self.base_url = base_url.rstrip("/")
        # some engine endpoints (/tokenize, /health) live beside /v1, not under it
        self.root_url = self.base_url.removesuffix("/v1")
        self.served_model = served_model
        self.timeout = timeout
        # aiohttp, not httpx: at 32 concurrent exchanges httpx's connection pool spent ~1.9 ms of CPU per request
        # (it scans every pooled connection for each one), aiohttp ~0.1 ms; bench/run.py measures the difference
        self.client: aiohttp.ClientSession | None = None
        # the engine's context length (prompt + output), configured or read from /models; None: unknown
        self.max_model_len: int | None = max_model_len
        self._models_read = False
        self._reachability = Reachability(self.base_url)

    def reachability(self) -> list[Reachability]:
        return [self._reachability]

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def _http(self) -> aiohttp.ClientSession:
        # made on first use: an aiohttp session belongs to the running event loop
        if self.client is None or self.client.closed:
            self.client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self.timeout),
                # idle connections close before uvicorn's 5 s keep-alive does, so a reused one is never half-closed
                connector=aiohttp.TCPConnector(limit=512, keepalive_timeout=4.0),
            )
        return self.client

    async def discover(self) -> str:
        """The engine's own model name (from /models, unless one was configured) and its context length.

        vLLM and SGLang report `max_model_len` per model in /models; a configured value wins. With a configured
        model name /models is still read once for the length, but an engine without it is no error.
        """
        if self.served_model and (self.max_model_len is not None or self._models_read):
            return self.served_model
        try:
            response = await self._send("GET", "/models")
        except EngineError:
            if self.served_model:
                self._models_read = True
                return self.served_model
            raise
        self._models_read = True
        models = response.get("data") or []
        if not self.served_model:
            if not models:
                raise EngineError("engine_error", "the engine serves no model", 502, response)
            self.served_model = models[0]["id"]
        served = next((m for m in models if isinstance(m, dict) and m.get("id") == self.served_model), None)
        if self.max_model_len is None and served and isinstance(served.get("max_model_len"), int):
            self.max_model_len = served["max_model_len"]
        return self.served_model

    async def list_models(self) -> list[str]:
        """Every model name the engine serves now (its base model and any loaded LoRA adapters)."""
        return [model["id"] for model in await self.models()]

    async def models(self) -> list[dict[str, Any]]:
        """The /models entries (vLLM's name the directory it loaded as `root`, and `max_model_len`)."""
        response = await self._send("GET", "/models")
        return [model for model in response.get("data") or [] if isinstance(model, dict)]

    def build_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        """The exact body sent to the engine: never streaming, always token ids and logprobs."""
        request = dict(chat)
        request["model"] = model
        request["stream"] = False
        request.pop("stream_options", None)
        request["logprobs"] = True
        request["top_logprobs"] = chat.get("top_logprobs") or 0
        request.update(self.token_id_fields())
        return request

    def token_id_fields(self) -> dict[str, Any]:
        return {}

    async def complete(self, engine_request: dict[str, Any], notes: Notes | None = None, timeout: float | None = None) -> tuple[dict[str, Any], dict[str, Any], Completion]:
        """One engine call: (the request as finally sent, the engine's raw reply, the parsed completion). `timeout`:
        seconds for this call instead of the engine's own.

        The output budget is fitted to the engine's context, never refused: harnesses ask for what their provider
        allows (Claude Code 128000, Qwen Code 32768), training engines often serve 32k-64k. The harness gets
        min(requested, max_model_len - prompt_tokens), the most the engine can sample, and `notes` records the
        requested and the granted value. A budget at or above max_model_len is left out of the request: the
        engine then samples up to the room left, which is exactly that minimum, with no extra call. A budget
        below it that still overflows with the prompt is sampled up to the context's end by vLLM 0.32; an engine
        that rejects it instead gets the prompt counted and the call made once more with the room left. A prompt
        that alone fills the context raises `context_length_exceeded`, which each dialect answers in its
        provider's own shape.
        """
        limit = self.max_model_len
        requested = {key: engine_request[key] for key in BUDGET_KEYS if isinstance(engine_request.get(key), int)}
        fitted = dict(engine_request)
        for key, value in requested.items():
            if limit is not None and value >= limit:
                del fitted[key]
        # encoded once: the same text is sent and recorded
        sent = WireJSON(fitted) if fitted != engine_request or not isinstance(engine_request, WireJSON) else engine_request
        try:
            raw = await self._send("POST", "/chat/completions", sent, timeout=timeout)
        except EngineError as error:
            if error.status_class != "engine_rejected" or limit is None:
                raise
            prompt_tokens = await self._prompt_tokens(sent)
            if prompt_tokens is None:
                raise
            if prompt_tokens >= limit:
                raise EngineError(
                    "context_length_exceeded",
                    f"the prompt has {prompt_tokens} tokens; the engine's context holds {limit}",
                    400, error.engine_body, prompt_tokens=prompt_tokens, max_context=limit,
                ) from error
            room = limit - prompt_tokens
            if not any(isinstance(sent.get(key), int) and sent[key] > room for key in BUDGET_KEYS):
                raise  # rejected for another reason
            sent = WireJSON({**sent, **{key: min(sent[key], room) for key in BUDGET_KEYS if isinstance(sent.get(key), int)}})
            raw = await self._send("POST", "/chat/completions", sent, timeout=timeout)
        completion = self.parse_completion(raw)
        if notes is not None and limit is not None:
            room = limit - completion.prompt_tokens
            for key, value in requested.items():
                # what the engine could sample: vLLM 0.32 accepts a budget that overflows with the prompt and
                # stops at the context's end, so the room left bounds it whatever the request said
                granted = min(sent[key], room) if isinstance(sent.get(key), int) else room
                if granted < value:
                    notes.normalize(
                        f"{key} {value} -> {granted}: the engine's context is {limit} tokens and the prompt "
                        f"{completion.prompt_tokens}"
                    )
        return sent, raw, completion

    async def _prompt_tokens(self, engine_request: dict[str, Any]) -> int | None:
        """The rendered prompt's length, or None when the engine cannot tell (counting refused too)."""
        try:
            return await self.count_tokens(self.build_count_request(engine_request, engine_request.get("model") or ""))
        except EngineError:
            return None

    async def complete_tokens(self, request: dict[str, Any]) -> dict[str, Any]:
        """One token-in call (tokens mode): the raw reply. Each engine kind has its own endpoint."""
        raise EngineError("engine_error", f"{self.kind} engine has no token-in endpoint (tokens mode needs vllm or sglang)", 501)

    def build_count_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        """The exact body count_tokens sends for this prompt (recorded as the row's engine_request)."""
        raise EngineError("engine_error", f"{self.kind} engine cannot count tokens", 501)

    async def count_tokens(self, count_request: dict[str, Any]) -> int:
        raise EngineError("engine_error", f"{self.kind} engine cannot count tokens", 501)

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None, root: bool = False, timeout: float | None = None) -> dict[str, Any]:
        url = (self.root_url if root else self.base_url) + path
        data = None
        if body is not None:
            data = body.data if isinstance(body, WireJSON) else json.dumps(body, ensure_ascii=False).encode()
        limit = self.timeout if timeout is None else timeout
        # only a call's own limit is passed: aiohttp reads timeout=None as "no limit", not as the session's
        per_call: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=limit)} if timeout is not None else {}
        try:
            async with self._http().request(method, url, data=data, headers={"content-type": "application/json"} if data is not None else None, **per_call) as response:
                status = response.status
                text = (await response.read()).decode("utf-8", "replace")
        except aiohttp.ConnectionTimeoutError as error:  # a TimeoutError too, but not the engine's slowness: say which
            # seen in bench/scale.py at 1,000 sessions in tokens mode, where the event loop was so far behind that
            # connections took longer than this, and the message blamed the 600 s read limit
            raise EngineError("engine_timeout", f"no connection to the inference engine at {self.base_url} within {CONNECT_TIMEOUT_S:g}s", 504) from error
        except TimeoutError as error:  # aiohttp's socket timeouts are TimeoutErrors too
            raise EngineError("engine_timeout", f"the inference engine did not answer within {limit:g}s ({type(error).__name__})", 504) from error
        except aiohttp.ClientError as error:
            self._reachability.unreachable(f"{type(error).__name__}: {error}")
            raise EngineError("engine_unreachable", f"the inference engine at {self.base_url} is unreachable: {error!r}", 503) from error
        self._reachability.answered()  # any HTTP answer, an error status too: the engine is there
        try:
            payload = _decode(text)
        except json.JSONDecodeError:
            payload = {"text": text[:4000]}
        if status >= 500:
            raise EngineError("engine_error", f"the inference engine failed with HTTP {status}: {_engine_message(payload)}", 502, payload)
        if status == 404 and path == "/models" and not root:
            # a server, but no OpenAI API at this URL: typically the base URL without its /v1
            raise EngineError("engine_url_wrong", f"{url} answered 404: the engine URL must be its OpenAI-compatible API root, e.g. http://127.0.0.1:8011/v1", 503, payload)
        if status >= 400:
            # the engine refused this request (context too long, bad tool schema...): the client's to fix
            raise EngineError("engine_rejected", f"the inference engine rejected the request: {_engine_message(payload)}", 400, payload)
        return payload

    def parse_completion(self, raw: dict[str, Any]) -> Completion:
        try:
            choice = raw["choices"][0]
            message = choice.get("message") or {}
            logprobs_content = (choice.get("logprobs") or {}).get("content") or []
            completion_ids = self.completion_token_ids(raw, choice)
            prompt_ids = self.prompt_token_ids(raw, choice)
        except (KeyError, IndexError, TypeError) as error:
            raise EngineError("engine_error", f"the engine's reply has no usable choice: {error!r}", 502, raw) from error
        if completion_ids is None or prompt_ids is None:
            raise EngineError("engine_error", f"the {self.kind} engine returned no token ids; is it configured to return them?", 502, raw)
        logprobs = [float(item.get("logprob", 0.0)) for item in logprobs_content]
        if len(logprobs) != len(completion_ids):
            raise EngineError("engine_error", f"the engine returned {len(completion_ids)} token ids but {len(logprobs)} logprobs", 502, raw)
        tool_calls = [
            ToolCall(id=call.get("id") or f"call_{index}", name=call["function"]["name"], arguments=call["function"].get("arguments") or "{}")
            for index, call in enumerate(message.get("tool_calls") or [])
        ]
        usage = raw.get("usage") or {}
        content = message.get("content")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if self.split_reasoning and reasoning is None and content:
            content, reasoning = split_think(content)
        return Completion(
            id=raw.get("id") or f"chatcmpl-{int(time.time() * 1000)}",
            created=int(raw.get("created") or time.time()),
            content=content,
            reasoning=reasoning,
            tool_calls=tool_calls,
            finish_reason=choice.get("finish_reason") or "stop",
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion_ids,
            completion_logprobs=logprobs,
            logprobs_content=logprobs_content,
            prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids)),
            completion_tokens=int(usage.get("completion_tokens") or len(completion_ids)),
            stop_sequence=self.stop_sequence(choice),
        )

    def prompt_token_ids(self, raw: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        return raw.get("prompt_token_ids")

    def completion_token_ids(self, raw: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        return choice.get("token_ids")

    def stop_sequence(self, choice: dict[str, Any]) -> str | None:
        # vLLM's `stop_reason`: the matched stop string, or a stop token id (not a sequence)
        matched = choice.get("stop_reason")
        return matched if isinstance(matched, str) else None


def split_think(content: str) -> tuple[str | None, str | None]:
    """(content, reasoning) from `<think>reasoning</think>content`, whitespace as Qwen3-style templates re-render it."""
    stripped = content.lstrip()
    if not stripped.startswith("<think>") or "</think>" not in stripped:
        return content, None
    inner, _, rest = stripped[len("<think>"):].partition("</think>")
    return rest.lstrip("\n") or None, inner.strip("\n")


def _engine_message(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return str(error.get("message") or error)
        if error:
            return str(error)
        return str(payload.get("message") or payload.get("detail") or payload.get("text") or payload)[:2000]
    return str(payload)[:2000]
