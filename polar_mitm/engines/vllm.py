"""vLLM's OpenAI-compatible server: `return_token_ids` gives prompt and sampled ids in one reply."""

from __future__ import annotations

from typing import Any

from polar_mitm.engines.base import Engine


class VLLMEngine(Engine):
    kind = "vllm"

    def token_id_fields(self) -> dict[str, Any]:
        return {"return_token_ids": True}

    def build_count_request(self, chat: dict[str, Any], model: str) -> dict[str, Any]:
        # /tokenize renders the chat template exactly as a completion would
        body = {"model": model, "messages": chat["messages"], "add_generation_prompt": True}
        # the fields that change the rendered prompt (e.g. enable_thinking adds an empty think block)
        for key in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
            if chat.get(key) is not None:
                body[key] = chat[key]
        return body

    async def count_tokens(self, count_request: dict[str, Any]) -> int:
        reply = await self._send("POST", "/tokenize", count_request, root=True)
        return int(reply["count"])

    async def complete_tokens(self, request: dict[str, Any]) -> dict[str, Any]:
        # the completions endpoint takes prompt ids and applies no chat template
        return await self._send("POST", "/completions", request)
