"""A form-filling agent on pydantic-ai: reads a document and fills a typed form from it.

    python examples/agents/form/agent.py "INSTRUCTION"     # in a folder holding documents/<name>.txt

Its tool, `read_document(name)`, returns documents/<name>.txt from the working directory; the form is the
agent's typed output (`InvoiceForm`, returned through pydantic-ai's output tool), written to form.json, and every
tool call to tool_calls.jsonl, which the task's evaluator checks. The model is pydantic-ai's OpenAI Chat
Completions model on its default provider (api.openai.com), routed by the proxy settings `polar-mitm run` sets
(HTTPS_PROXY, the CA in SSL_CERT_FILE); no base URL is changed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel

MODEL = os.environ.get("POLAR_AGENT_MODEL", "gpt-4.1-mini")  # the gateway answers with the engine's own model


class InvoiceForm(BaseModel):
    vendor: str
    invoice_number: str
    date: str
    total: str


def record(tool: str, arguments: dict, result: str) -> None:
    with open("tool_calls.jsonl", "a") as log:
        log.write(json.dumps({"tool": tool, "arguments": arguments, "result": result}) + "\n")


agent = Agent(
    OpenAIChatModel(MODEL),
    output_type=InvoiceForm,
    instructions="Fill the invoice form from the document: call read_document, then return the form.",
)


@agent.tool_plain
def read_document(name: str) -> str:
    """Return the text of a document (one of the names in the documents/ folder)."""
    path = Path("documents") / f"{Path(name).name}.txt"
    result = path.read_text() if path.is_file() else f"no document {name!r}"
    record("read_document", {"name": name}, result)
    return result


def main() -> int:
    result = agent.run_sync(sys.argv[1])
    Path("form.json").write_text(result.output.model_dump_json(indent=2) + "\n")
    print(result.output.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
