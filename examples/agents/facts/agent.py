"""A fact-lookup agent on the OpenAI Agents SDK (`openai-agents`): answers a question from local files.

    python examples/agents/facts/agent.py "QUESTION"      # in a folder holding facts/<topic>.txt

Its one tool, `lookup(topic)`, reads facts/<topic>.txt from the working directory; the agent's final answer is
written to answer.txt and every tool call (with what it returned) to tool_calls.jsonl, which the task's
evaluator checks. The model is reached the SDK's normal way: its default OpenAI client (the Responses API at
api.openai.com), routed by the proxy settings `polar-mitm run` sets (HTTPS_PROXY, the CA in SSL_CERT_FILE); no
base URL is changed. Tracing is off: its exporter would post traces to api.openai.com, which is not a model call.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

MODEL = os.environ.get("POLAR_AGENT_MODEL", "gpt-4.1-mini")  # the gateway answers with the engine's own model
# The agent's own output budget per model call (the Responses API's max_output_tokens); unset: none, the SDK's default
MAX_TOKENS = int(os.environ["POLAR_AGENT_MAX_TOKENS"]) if os.environ.get("POLAR_AGENT_MAX_TOKENS") else None


def record(tool: str, arguments: dict, result: str) -> None:
    with open("tool_calls.jsonl", "a") as log:
        log.write(json.dumps({"tool": tool, "arguments": arguments, "result": result}) + "\n")


@function_tool
def lookup(topic: str) -> str:
    """Return the facts file for a topic (one of the names in the facts/ folder)."""
    path = Path("facts") / f"{Path(topic).name}.txt"
    result = path.read_text().strip() if path.is_file() else f"no facts about {topic!r}; topics: {sorted(p.stem for p in Path('facts').glob('*.txt'))}"
    record("lookup", {"topic": topic}, result)
    return result


def main() -> int:
    set_tracing_disabled(True)
    agent = Agent(
        name="facts",
        instructions="Answer the question using only the local facts files: call lookup, then answer with the fact.",
        tools=[lookup],
        model=MODEL,
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    result = Runner.run_sync(agent, sys.argv[1], max_turns=4)
    Path("answer.txt").write_text(str(result.final_output).strip() + "\n")
    print(result.final_output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
