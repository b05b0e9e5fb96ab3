"""A headless OpenHands SDK agent: the SDK's default agent and tools in the working directory, one instruction.

    openhands-run [--model LITELLM_MODEL] INSTRUCTION        (key: $LLM_API_KEY; user agent: $OPENHANDS_USER_AGENT)

The SDK ships no command line; this is its documented standalone use (`get_default_agent`: terminal, file editor,
task tracker, the default condenser; no browser), with the terminal on a plain subprocess shell instead of tmux
(a tmux server would outlive the run). Installed by sandboxes/agents-py/install.sh as the venv's `openhands-run`;
exits 0 when the conversation finished, 1 otherwise.
"""

import argparse
import os
import sys

from openhands.sdk import LLM, Conversation, Tool
from openhands.sdk.conversation.state import ConversationExecutionStatus
from openhands.tools.preset.default import get_default_agent


def main() -> int:
    parser = argparse.ArgumentParser(prog="openhands-run")
    parser.add_argument("--model", default=os.environ.get("LLM_MODEL", "openai/qwen3-coder-plus"))
    parser.add_argument("instruction")
    args = parser.parse_args()
    user_agent = os.environ.get("OPENHANDS_USER_AGENT")
    llm = LLM(model=args.model, api_key=os.environ.get("LLM_API_KEY"), usage_id="agent", extra_headers={"User-Agent": user_agent} if user_agent else None)
    agent = get_default_agent(llm, cli_mode=True)
    agent = agent.model_copy(update={"tools": [Tool(name=t.name, params={"terminal_type": "subprocess"}) if t.name == "terminal" else t for t in agent.tools]})
    conversation = Conversation(agent=agent, workspace=os.getcwd(), visualizer=None)
    conversation.send_message(args.instruction)
    conversation.run()
    status = conversation.state.execution_status
    print(f"openhands-run: {status.value}", file=sys.stderr)
    return 0 if status == ConversationExecutionStatus.FINISHED else 1


if __name__ == "__main__":
    sys.exit(main())
