"""SGLang's OpenAI-compatible server (>= 0.5.13): token ids come back through its `meta_info` extension.

Request: `logprobs: true`, `return_meta_info: true`, `return_prompt_token_ids: true`.
Reply: `choices[0].prompt_token_ids`, and `choices[0].meta_info.output_token_logprobs` as
`[logprob, token_id, text]` triples, one per sampled token; `choices[0].matched_stop` names the stop that ended it.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.engines.base import Engine
from polar_mitm.exchange import Completion


class SGLangEngine(Engine):
    kind = "sglang"

    def token_id_fields(self) -> dict[str, Any]:
        return {"return_meta_info": True, "return_prompt_token_ids": True}

    def prompt_token_ids(self, raw: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        return choice.get("prompt_token_ids") or raw.get("prompt_token_ids")

    def completion_token_ids(self, raw: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
        triples = (choice.get("meta_info") or {}).get("output_token_logprobs")
        if triples is not None:
            return [int(triple[1]) for triple in triples]
        return choice.get("token_ids")

    def parse_completion(self, raw: dict[str, Any]) -> Completion:
        return super().parse_completion(_logprobs_from_meta_info(raw))

    def stop_sequence(self, choice: dict[str, Any]) -> str | None:
        # SGLang's `matched_stop`: the matched stop string, or a stop/EOS token id (not a sequence)
        matched = choice.get("matched_stop")
        return matched if isinstance(matched, str) else None

    def build_count_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        # SGLang has no chat /tokenize; a one-token generation reports the rendered prompt's length
        return self.build_request({**chat, "max_tokens": 1}, model)

    async def count_tokens(self, count_request: dict[str, Any]) -> int:
        raw = await self._send("POST", "/chat/completions", count_request)
        return int((raw.get("usage") or {}).get("prompt_tokens") or len(self.prompt_token_ids(raw, raw["choices"][0]) or []))

    async def complete_tokens(self, request: dict[str, Any]) -> dict[str, Any]:
        # SGLang's native generate endpoint (beside /v1) takes input_ids
        return await self._send("POST", "/generate", request, root=True)


def _logprobs_from_meta_info(raw: dict[str, Any]) -> dict[str, Any]:
    """Fill `logprobs.content` from meta_info when SGLang left it empty, so one parser serves both engines."""
    try:
        choice = raw["choices"][0]
    except (KeyError, IndexError, TypeError):
        return raw
    triples = (choice.get("meta_info") or {}).get("output_token_logprobs")
    if triples is None or (choice.get("logprobs") or {}).get("content"):
        return raw
    content: list[dict[str, Any]] = [{"token": text if isinstance(text, str) else "", "logprob": float(logprob), "bytes": None, "top_logprobs": []} for logprob, _, text in triples]
    return {**raw, "choices": [{**choice, "logprobs": {"content": content}}, *raw["choices"][1:]]}
