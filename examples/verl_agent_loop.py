"""verl's agent loop on polar-mitm, without verl's trainer: `PolarAgentLoop` made the way verl's AgentLoopWorker
makes every agent loop (hydra's instantiate of the registered config, verl's DictConfigWrap and dataset class),
then run on a dataset row per sample; each AgentLoopOutput is printed and written as JSON.

verl's trainer needs GPUs (its FSDP/Megatron workers and its own vLLM/SGLang servers); this is the part of verl
that meets polar-mitm, run for real. Runs in verl's environment (`polar-mitm engine build --with-verl` builds one:
Python 3.11, verl 0.9). From any folder:

    polar-mitm rollout serve --port 8070 --upstream http://127.0.0.1:8011/v1 --db verl.duckdb --render tokens
    ~/.cache/polar-mitm/verl-venv/bin/python $REPO/examples/verl_agent_loop.py --server http://127.0.0.1:8070 \\
        --task $REPO/examples/agents/facts/task.yaml --model ~/.cache/polar-mitm/models/qwen3-tiny \\
        --samples 2 --out verl.json

In a verl run, the same loop is named in the agent loop config file (polar_mitm/integrations/verl.py says how).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "polar_mitm").is_dir():
    sys.path.insert(0, str(CHECKOUT))  # this example's own polar_mitm, without PYTHONPATH (so from any folder)

import hydra  # noqa: E402
import yaml  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap, _agent_loop_registry  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402

import polar_mitm.integrations.verl  # noqa: E402, F401  (registers "polar_mitm")


async def run(args: argparse.Namespace) -> list[AgentLoopOutput]:
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": args.response_length, "prompt_length": args.prompt_length, "agent": {}}},
        "data": {"apply_chat_template_kwargs": {}},
    })
    loop_config = OmegaConf.create({**_agent_loop_registry["polar_mitm"], "server_url": args.server, "task_file": str(args.task.resolve())})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model_type = json.loads((args.model / "config.json").read_text()).get("model_type")  # verl picks its token builder by it
    instruction = yaml.safe_load(args.task.read_text())["instruction"]
    outputs = []
    for index in range(args.samples):  # verl's worker makes one loop per sample, as here
        loop = hydra.utils.instantiate(
            config=loop_config, trainer_config=DictConfigWrap(config=config), server_manager=None, tokenizer=tokenizer,
            processor=None, hf_model_type=model_type, dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data),
        )
        outputs.append(await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": instruction}], extra_info={"index": index}))
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the rollout server's URL")
    parser.add_argument("--task", required=True, type=Path, help="a task file (YAML TaskRequest): agent, runtime, evaluator")
    parser.add_argument("--model", required=True, type=Path, help="the served model's directory (its tokenizer)")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=8192, help="verl's rollout.response_length")
    parser.add_argument("--prompt-length", type=int, default=65536, help="verl's rollout.prompt_length")
    parser.add_argument("--out", type=Path, required=True, help="the outputs as JSON")
    args = parser.parse_args()
    outputs = asyncio.run(run(args))
    records = [{"type": f"{type(o).__module__}.{type(o).__qualname__}", **o.model_dump(mode="json"), "as_dict_keys": sorted(o.as_dict())} for o in outputs]
    args.out.write_text(json.dumps(records, indent=2))
    for record in records:
        print(json.dumps({k: record[k] for k in ("reward_score", "num_turns", "extra_fields")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
