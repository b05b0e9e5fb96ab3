"""The token-in engine call: prompt ids in, sampled ids + logprobs out, no chat template on the engine side.

    vLLM    POST {base}/completions  {"prompt": [ids], "logprobs": 0, "return_token_ids": true, sampling...}
            -> choices[0].token_ids, choices[0].logprobs.token_logprobs, finish_reason, stop_reason
    SGLang  POST {root}/generate     {"input_ids": [ids], "sampling_params": {...}, "return_logprob": true}
            -> meta_info.output_token_logprobs [[logprob, id, text]], meta_info.finish_reason {"type", "matched"}

Sampling parameters come from the engine's chat request after the engine hook (so hooks written for chat mode
steer tokens mode too): the chat-only fields (messages, tools, tool_choice) are left out.
"""

from __future__ import annotations

import json
import time
from array import array
from dataclasses import dataclass
from typing import Any

from polar_mitm.engines._api import EngineClient
from polar_mitm.engines.base import WireJSON
from polar_mitm.errors import EngineError
from polar_mitm.exchange import Notes

# chat request fields that mean the same on vLLM's completions endpoint
VLLM_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "structured_outputs", "include_stop_str_in_output",
)
SGLANG_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "seed": "sampling_seed",
}


@dataclass
class Sampled:
    """What one token-in call returned."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    stop_sequence: str | None
    id: str
    created: int


def max_new_tokens(chat: dict[str, Any], prompt_len: int, max_model_len: int | None, notes: Notes | None = None) -> int:
    """The harness's limit, cut to the room the context leaves, as chat mode fits it (engines/base.py `complete`):
    the requested and granted values go to `notes`; a prompt that fills the context is `context_length_exceeded`."""
    key = "max_completion_tokens" if chat.get("max_completion_tokens") else "max_tokens"
    requested = chat.get(key)
    room = (max_model_len - prompt_len) if max_model_len else None
    if room is not None and room <= 0:
        raise EngineError(
            "context_length_exceeded", f"the prompt has {prompt_len} tokens; the engine's context holds {max_model_len}", 400,
            prompt_tokens=prompt_len, max_context=max_model_len,
        )
    if requested is None:
        if room is None:
            raise EngineError("engine_rejected", "tokens mode needs max_tokens when the engine's context length is unknown", 400)
        return room
    if room is not None and int(requested) > room and notes is not None:
        notes.normalize(f"{key} {requested} -> {room}: the engine's context is {max_model_len} tokens and the prompt {prompt_len}")
    return min(int(requested), room) if room is not None else int(requested)


def build_request(engine: EngineClient, chat: dict[str, Any], model: str, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    if engine.kind == "sglang":
        params = {target: chat[source] for source, target in SGLANG_SAMPLING.items() if chat.get(source) is not None}
        structured = chat.get("structured_outputs") or {}
        if structured.get("regex"):
            params["regex"] = structured["regex"]
        elif structured.get("json") is not None:
            params["json_schema"] = structured["json"] if isinstance(structured["json"], str) else json.dumps(structured["json"])
        params.update(max_new_tokens=max_tokens, skip_special_tokens=False)
        return {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}
    request = {key: chat[key] for key in VLLM_SAMPLING if chat.get(key) is not None}
    response_format = chat.get("response_format") or {}
    if "structured_outputs" not in request and response_format.get("type") == "json_schema":
        request["structured_outputs"] = {"json": (response_format.get("json_schema") or {}).get("schema") or {}}
    elif "structured_outputs" not in request and response_format.get("type") == "json_object":
        request["structured_outputs"] = {"json_object": True}
    request.update(model=model, prompt=prompt_ids, max_tokens=max_tokens, logprobs=0, return_token_ids=True, stream=False)
    return request


def encode_request(engine: EngineClient, chat: dict[str, Any], model: str, prompt: array, max_tokens: int) -> WireJSON:
    """build_request's request, encoded once (the same text is sent and recorded); the object then holds `prompt`
    itself, 4-byte ids, where the list was (a list holds 36 bytes an id) for as long as the engine works."""
    sent = WireJSON(build_request(engine, chat, model, prompt.tolist(), max_tokens))
    sent["input_ids" if engine.kind == "sglang" else "prompt"] = prompt
    return sent


async def call(engine: EngineClient, request: WireJSON) -> tuple[dict[str, Any], Sampled]:
    """(the raw reply, what was sampled) for a request made by encode_request."""
    raw = await engine.complete_tokens(request)
    return raw, _sglang_sampled(raw) if engine.kind == "sglang" else _vllm_sampled(raw)


def _vllm_sampled(raw: dict[str, Any]) -> Sampled:
    try:
        choice = raw["choices"][0]
        ids = [int(token) for token in choice["token_ids"]]
        logprobs = [float(lp) if lp is not None else 0.0 for lp in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise EngineError("engine_error", f"the engine's completions reply has no sampled token ids: {error!r}", 502, raw) from error
    if len(logprobs) != len(ids):
        raise EngineError("engine_error", f"the engine returned {len(ids)} token ids but {len(logprobs)} logprobs", 502, raw)
    stop = choice.get("stop_reason")
    return Sampled(ids, logprobs, "length" if choice.get("finish_reason") == "length" else "stop", stop if isinstance(stop, str) else None, raw.get("id") or _id(), int(raw.get("created") or time.time()))


def _sglang_sampled(raw: dict[str, Any]) -> Sampled:
    try:
        meta = raw["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(triple[1]) for triple in triples]
        logprobs = [float(triple[0]) if triple[0] is not None else 0.0 for triple in triples]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise EngineError("engine_error", f"the engine's /generate reply has no sampled token ids: {error!r}", 502, raw) from error
    finish = meta.get("finish_reason") or {}
    matched = finish.get("matched") if isinstance(finish, dict) else None
    kind = finish.get("type") if isinstance(finish, dict) else finish
    return Sampled(ids, logprobs, "length" if kind == "length" else "stop", matched if isinstance(matched, str) else None, meta.get("id") or _id(), int(time.time()))


def _id() -> str:
    return f"cmpl-{int(time.time() * 1000)}"
