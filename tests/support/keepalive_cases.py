"""How each real harness is made to give up on a silent stream quickly (its own settings, shrunk), and the keepalive
event each dialect sends: shared by the keepalive tests (tests/integration/test_harness_keepalives.py) and the pause
tests with real harnesses (tests/integration/test_control.py)."""

from __future__ import annotations


def has_tool_result(engine_request: dict) -> bool:
    return any(m.get("role") == "tool" for m in engine_request.get("messages", []))


def first_agent_turn(engine_request: dict) -> bool:
    """The agent's turn that asks for the tool call: it offers tools and carries no tool result yet."""
    return bool(engine_request.get("tools")) and not has_tool_result(engine_request)


def every_call(engine_request: dict) -> bool:
    return True


# harness -> its limit shrunk with its own setting (env, subcommand options), the engine's delay, which engine calls
# the relay slows (default: all), the side calls (not agent turns) of a run, and whether its silent run is stopped
# once it retries the call it abandoned
CASES = {
    # QWEN_STREAM_IDLE_TIMEOUT_MS: the no-chunk watchdog on its SDK's chunks (default 240 s)
    "qwen": {"env": {"QWEN_STREAM_IDLE_TIMEOUT_MS": "4000"}, "delay": 10.0},
    # stream_idle_timeout_ms wraps each eventsource.next() (default 300 s); one retry keeps the failing run short
    "codex": {"options": ("-c", "model_providers.polar_openai.stream_idle_timeout_ms=4000", "-c", "model_providers.polar_openai.stream_max_retries=1"), "delay": 10.0},
    # CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS: the byte watchdog on every SSE reply (on by default, floor 10 s; default
    # 180 s to api.anthropic.com). When it fires, Claude Code sends the request again non-streamed, which nothing can
    # keep alive, and gives that call API_TIMEOUT_MS (default 300 s): both shrunk below the engine's delay, or the
    # silent run would complete its turn through that fallback (at the cost of a second engine call)
    "claude": {"env": {"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000", "API_TIMEOUT_MS": "12000", "CLAUDE_CODE_MAX_RETRIES": "1"}, "delay": 16.0},
    # nothing shrinks Gemini CLI's limit on a stream, undici's bodyTimeout of 300 s between body bytes (its request
    # timeout, an experiment flag, sets only headersTimeout). So its first agent turn takes 320 s; its router's
    # non-streamed call (60 s to headers) and its final turn are not slowed. Once it has abandoned the slowed call it
    # sends it again (general.maxAttempts 1 did not stop that, tried with --model gemini-2.5-pro), to be abandoned
    # again after 300 s: the silent run is stopped when that retry is on its way
    "gemini": {"delay": 320.0, "slowed": first_agent_turn, "side_calls": 1, "stop_at_retry": True},
}


# one keepalive event per dialect, and how often it appears in a reply that needed none
KEEPALIVE_MARK = {"qwen": '"delta":{},"logprobs":null,"finish_reason":null', "codex": "event: response.in_progress", "claude": "event: ping", "gemini": '"parts":[{"text":""}]'}
BASELINE_MARKS = {"qwen": 0, "codex": 1, "claude": 1, "gemini": 0}
