"""A tokens-mode bridge step as sessions grow: `python bench/bridge_bench.py [--turns 30] [--reps 10]`.

In-process, no gateway: one session of a real Qwen Code request (bench/requests/qwen-multi-turn.json, its 11 tools)
grows by an answer with a tool call and a ~2 KB tool result per turn, each turn found in the lineage and bridged as
render/serve.py does (the real local model's template and tokenizer: `polar-mitm engine start` builds it). Then,
at several history lengths, the bridge step alone (two renders of the history by the chat template, the new tail
tokenized) timed both ways a render can go, alternating in one process: the template compiled by transformers and
called directly (`Renderer.render_text`, after its first checked renders), and transformers' `apply_chat_template`
(which deep-copies the conversation and tools twice per call). Medians of `--reps` runs of 20 steps each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polar_mitm.local_engine import build  # noqa: E402
from polar_mitm.render import bridge, parsers  # noqa: E402
from polar_mitm.render.renderer import Renderer  # noqa: E402


def grow(renderer: Renderer, chat: dict, turns: int) -> tuple[bridge.Lineages, list[list[dict]]]:
    """The session's turns, each remembered as tokens mode remembers it; the messages of every turn."""
    lineages, histories, messages = bridge.Lineages(), [], list(chat["messages"])
    for turn in range(turns):
        chat["messages"] = messages
        conversation = renderer.conversation(messages)
        setup = bridge.setup_key(renderer, chat)
        parent, covered, _ = lineages.find("s", conversation, setup)
        bridged = bridge.bridge(renderer, parent, conversation, covered, renderer.tools(chat), renderer.template_kwargs(chat)) if parent else None
        ids = bridged.prompt_ids if bridged else renderer.encode(renderer.render_text(conversation, renderer.tools(chat), renderer.template_kwargs(chat), True))
        call = f'<tool_call>\n{{"name": "read_file", "arguments": {{"absolute_path": "/w/file{turn}.py"}}}}\n</tool_call>'
        sampled = renderer.encode(f"Let me read file{turn}.py\n{call}") + [renderer.end_of_turn_id]
        output = parsers.parse_output(renderer.sampled_text(sampled), "hermes", chat.get("tools"))
        answer = bridge.answer_message(output.content, output.tool_calls)
        lineages.remember("s", bridge.make_turn(f"e{turn}", conversation, answer, setup, ids, sampled, bridged))
        histories.append(messages)
        calls = [{"id": f"c{turn}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in output.tool_calls]
        messages = [*messages, {"role": "assistant", "content": output.content, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": f"c{turn}", "content": f"line {turn} of the file\n" * 100}]
    return lineages, histories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--model-dir", default=str(build.model_dir(build.engine_home(), build.DEFAULT_MODEL)))
    args = parser.parse_args()
    renderer = Renderer.load(args.model_dir)
    request = json.loads((REPO / "bench" / "requests" / "qwen-multi-turn.json").read_text())
    chat = dict(request.get("body", request))
    lineages, histories = grow(renderer, chat, args.turns)
    compiled = renderer._compiled
    print(f"one session, {args.turns} turns, {args.model_dir}; ms per bridge step, median of {args.reps} x 20:")
    print("| messages | template called directly | apply_chat_template | ratio |\n|---|---|---|---|")
    for turn in sorted({1, args.turns // 3, 2 * args.turns // 3, args.turns - 1}):
        chat["messages"] = histories[turn]
        conversation = renderer.conversation(histories[turn])
        setup = bridge.setup_key(renderer, chat)
        parent, covered, _ = lineages.find("s", conversation, setup)
        timings: dict[str, list[float]] = {"direct": [], "apply": []}
        for _ in range(args.reps):
            for way in timings:
                renderer._compiled = compiled if way == "direct" else None
                started = time.perf_counter()
                for _ in range(20):
                    bridge.bridge(renderer, parent, conversation, covered, renderer.tools(chat), renderer.template_kwargs(chat))
                timings[way].append((time.perf_counter() - started) / 20 * 1000)
        direct, apply = statistics.median(timings["direct"]), statistics.median(timings["apply"])
        print(f"| {len(conversation)} | {direct:.2f} | {apply:.2f} | {direct / apply:.2f} |", flush=True)
    renderer._compiled = compiled


if __name__ == "__main__":
    main()
