"""A small real run for the debugging tools: harness-shaped clients through a real gateway and the real engine.

The clients are the official SDKs sending the system prompt and tools of recorded harness requests
(tests/fixtures/contentview/, trimmed) with that harness's User-Agent: stand-ins for the harness binaries,
which take minutes per run. Each session is a tool turn: the engine (steered by tests/support/debug_steer.py) calls
the shell tool, the client sends a fixed tool result back, the engine answers in text.

Two Qwen-Code-shaped sessions break on purpose: EDITED sends its second request with the first user message
edited ("files" -> "folders": a `rewritten` break at that word); CUT sends back a reply that max_tokens cut off.
After the run the gateway stops, the rewards a rollout server's evaluator would give are recorded in the
sessions table, and `polar-mitm assemble` writes the trajectories table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import duckdb
import openai

from polar_mitm.util import free_port
from tests.support import debug_steer
from tests.support.gatewayproc import Gateway, proxy_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "contentview"
HOOK = f"{Path(debug_steer.__file__).resolve()}:steer"
TASKS = {"list-files": "List the files in the repository.", "find-readme": "Find the README of this project."}
SAMPLES = 2
# what an evaluator would have scored: (task, harness) -> one reward per sample
REWARDS = {("list-files", "codex"): [1.0, 0.0], ("list-files", "claude"): [1.0, 1.0], ("find-readme", "codex"): [0.0, 0.0], ("find-readme", "claude"): [1.0, 0.0]}
TOOL_OUTPUT = "README.md\n"
EDIT_BEFORE = "Please list the files in the repository."
EDIT_AFTER = "Please list the folders in the repository."
EDITED = "qwen-edited"
CUT = "qwen-cut"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _user_agent(recorded: dict) -> str:
    return next(v for k, v in recorded["headers"].items() if k.lower() == "user-agent")


@dataclass
class DebugRun:
    db: Path
    gateway_log: Path
    sessions: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # session -> (task, harness)
    assemble_output: str = ""


def codex_session(gateway: Gateway, session_id: str, instruction: str) -> None:
    recorded = fixture("codex_responses_tool_turn.json")["body"]
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-polar-debug", default_headers={"User-Agent": _user_agent(fixture("codex_responses_tool_turn.json"))}, max_retries=0)
    items = [recorded["input"][0], {"type": "message", "role": "user", "content": [{"type": "input_text", "text": instruction}]}]
    for _ in range(2):
        final = None
        for event in client.responses.create(model=recorded["model"], input=items, tools=recorded["tools"], tool_choice="auto", parallel_tool_calls=False, store=False, stream=True):
            if event.type == "response.completed":
                final = event.response
        assert final is not None, "the Responses stream ended without response.completed"
        calls = [item for item in final.output if item.type == "function_call"]
        if not calls:
            return
        items += [item.model_dump(exclude_none=True) for item in final.output]
        items += [{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_OUTPUT} for call in calls]


def claude_session(gateway: Gateway, session_id: str, instruction: str) -> None:
    recorded = fixture("claude_code_messages_tool_turn.json")
    body = recorded["body"]
    with proxy_env(gateway, session_id):
        client = anthropic.Anthropic(api_key="sk-ant-polar-debug", default_headers={"User-Agent": _user_agent(recorded)}, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": instruction}]}]
    for _ in range(2):
        with client.messages.stream(model=body["model"], max_tokens=1024, system=body["system"], tools=body["tools"], messages=messages) as stream:
            message = stream.get_final_message()
        uses = [block for block in message.content if block.type == "tool_use"]
        if not uses:
            return
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_OUTPUT} for use in uses]})


def _qwen_client(gateway: Gateway, session_id: str) -> tuple[openai.OpenAI, dict]:
    recorded = fixture("qwen_code_chat_tool_turn.json")
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-polar-debug", default_headers={"User-Agent": _user_agent(recorded)}, max_retries=0)
    return client, recorded["body"]


def edited_session(gateway: Gateway, session_id: str) -> None:
    """Turn 2 re-sends the history with the first user message edited: a `rewritten` break."""
    client, body = _qwen_client(gateway, session_id)
    system = body["messages"][0]
    first = client.chat.completions.create(model=body["model"], messages=[system, {"role": "user", "content": EDIT_BEFORE}], tools=body["tools"])
    reply = first.choices[0].message
    assert reply.tool_calls, f"the steered engine did not call the shell tool: {reply}"
    history = [system, {"role": "user", "content": EDIT_AFTER}, reply.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": call.id, "content": TOOL_OUTPUT} for call in reply.tool_calls]
    client.chat.completions.create(model=body["model"], messages=history, tools=body["tools"])


def cut_session(gateway: Gateway, session_id: str) -> None:
    """Turn 1 is cut off by max_tokens; turn 2 sends the cut reply back."""
    client, body = _qwen_client(gateway, session_id)
    system = body["messages"][0]
    history = [system, {"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=body["model"], messages=history, max_tokens=5)
    assert first.choices[0].finish_reason == "length"
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model=body["model"], messages=history, max_tokens=32)


def build(engine_url: str, base: Path) -> DebugRun:
    base.mkdir(parents=True, exist_ok=True)
    # chat mode: its breaks are the engine re-rendering what was sent (the diff test finds the edit with the engine's
    # own detokenize); the debugging tools on a tokens-mode store are the README store's tests (test_notebooks)
    gateway = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "confdir", upstream=engine_url, args=["--render", "chat", "--engine-hook", HOOK]).start()
    run = DebugRun(db=gateway.db, gateway_log=gateway.log)
    try:
        for task, instruction in TASKS.items():
            for harness, drive in (("codex", codex_session), ("claude", claude_session)):
                for sample in range(SAMPLES):
                    session_id = f"{task}-{harness}-{sample}"
                    drive(gateway, session_id, instruction)
                    run.sessions[session_id] = (task, harness)
        edited_session(gateway, EDITED)
        cut_session(gateway, CUT)
        run.sessions[EDITED] = (None, "qwen")
        run.sessions[CUT] = (None, "qwen")
    finally:
        gateway.stop()
    # what the rollout server records once an evaluator has scored each session
    con = duckdb.connect(str(run.db))
    try:
        for (task, harness), rewards in REWARDS.items():
            for sample, reward in enumerate(rewards):
                con.execute("UPDATE sessions SET task_id = ?, status = 'completed', reward = ? WHERE session_id = ?", [task, reward, f"{task}-{harness}-{sample}"])
    finally:
        con.close()
    done = subprocess.run([sys.executable, "-m", "polar_mitm.cli", "assemble", "--db", str(run.db)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    run.assemble_output = done.stdout
    return run


if __name__ == "__main__":  # build one by hand: python -m tests.debug_run ENGINE_URL DIR
    print(build(sys.argv[1], Path(sys.argv[2])))
