"""One tool-offering request per provider API as its clients send it, and one fixed engine Completion: the samples
the pure dialect tests parse and render (tests/unit/test_dialect_protocol.py, tests/unit/test_stream_parts.py)."""

from __future__ import annotations

import json
from typing import Any

from polar_mitm import dialects
from polar_mitm.exchange import Completion, ToolCall

SHELL = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}

# one tool-offering request per API, as its clients send it: (path, query, body)
REQUESTS: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {
    "openai_chat": ("/v1/chat/completions", {}, {
        "model": "gpt-4o", "stream": True, "stream_options": {"include_usage": True}, "metadata": {"run": "7"},
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "List files"}],
        "tools": [{"type": "function", "function": {"name": "run_shell", "parameters": SHELL}}],
    }),
    "openai_responses": ("/v1/responses", {}, {
        "model": "gpt-5", "stream": True, "instructions": "Be brief.", "input": "List files",
        "tools": [{"type": "function", "name": "run_shell", "parameters": SHELL}],
        "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
    }),
    "anthropic_messages": ("/v1/messages", {}, {
        "model": "claude-x", "stream": True, "max_tokens": 100, "system": "Be brief.",
        "messages": [{"role": "user", "content": "List files"}],
        "tools": [{"name": "run_shell", "input_schema": SHELL}], "thinking": {"type": "enabled", "budget_tokens": 1024},
    }),
    "gemini": ("/v1beta/models/gemini-2.5-flash:streamGenerateContent", {"alt": "sse"}, {
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "contents": [{"role": "user", "parts": [{"text": "List files"}]}],
        "tools": [{"functionDeclarations": [{"name": "run_shell", "parameters": SHELL}]}],
        "generationConfig": {"thinkingConfig": {"includeThoughts": True}},
    }),
}


COMPLETION = Completion(
    id="chatcmpl-0123456789abcdef",
    created=1_700_000_000,
    content="Listing.",
    reasoning="The user wants the files.",
    tool_calls=[ToolCall("call_1", "run_shell", '{"command": "ls -la"}')],
    finish_reason="tool_calls",
    prompt_token_ids=[11, 12, 13],
    completion_token_ids=[21, 22, 23],
    completion_logprobs=[-0.5, -0.25, -0.125],
    logprobs_content=None,
    prompt_tokens=3,
    completion_tokens=3,
)


def parsed_request(api: str) -> Any:
    path, query, body = REQUESTS[api]
    return dialects.get(api).parse(json.dumps(body).encode(), path, query)
