"""A trip-budget planner on smolagents: plans a budget with a calculator tool.

    python examples/agents/planner/agent.py "INSTRUCTION"

A `ToolCallingAgent` with one tool, `calculator(expression)` (arithmetic only, evaluated by walking its syntax
tree); smolagents' own `final_answer` tool ends the run. The answer is written to answer.txt and every tool
call to tool_calls.jsonl, which the task's evaluator checks. The model is smolagents' `OpenAIServerModel` with
no api_base (the openai SDK's default, api.openai.com), routed by the proxy settings `polar-mitm run` sets
(HTTPS_PROXY, the CA in SSL_CERT_FILE); no base URL is changed.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from pathlib import Path

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

MODEL = os.environ.get("POLAR_AGENT_MODEL", "gpt-4.1-mini")  # the gateway answers with the engine's own model
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses) and return the result.

    Args:
        expression: the expression, e.g. "3 * 120 + 2 * 45.5".
    """
    value = evaluate(ast.parse(expression, mode="eval"))
    result = f"{value:g}" if isinstance(value, float) else str(value)
    with open("tool_calls.jsonl", "a") as log:
        log.write(json.dumps({"tool": "calculator", "arguments": {"expression": expression}, "result": result}) + "\n")
    return result


def main() -> int:
    agent = ToolCallingAgent(tools=[calculator], model=OpenAIServerModel(model_id=MODEL), max_steps=3, verbosity_level=0)
    answer = agent.run(sys.argv[1])
    Path("answer.txt").write_text(f"{answer}".strip() + "\n")
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
