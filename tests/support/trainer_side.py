"""Trainer-side steps the training tests run in the engine venv (torch + transformers + peft), as a user's trainer
would: only `polar_mitm.client` and `polar_mitm.grpo` of polar-mitm are imported. Prints one JSON object.

    python tests/support/trainer_side.py adapter OUT_DIR --model-dir DIR [--seed 0] [--scale 0.05]
    python tests/support/trainer_side.py recompute PARQUET --model-dir DIR [--adapter DIR] [--shift 1]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from polar_mitm.client import load_batch, logprob_mismatch
from polar_mitm.grpo import token_logprobs


def adapter(args: argparse.Namespace) -> dict:
    """A LoRA adapter with random (non-zero) B: a stand-in for a trained update, big enough to move logprobs."""
    torch.manual_seed(args.seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, args.scale)
    model.save_pretrained(args.out)
    return {"adapter": args.out}


def recompute(args: argparse.Namespace) -> dict:
    """fp32 logprobs of every sampled token under the weights that sampled them, against the stored ones."""
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    if args.adapter:
        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    batch = load_batch(args.parquet)
    tensors = batch.to_torch()
    with torch.no_grad():
        recomputed = token_logprobs(model, tensors["input_ids"], tensors["attention_mask"]).numpy()
    if args.shift:
        # the classic off-by-one: the mask (and the logprobs with it) moved by `shift` tokens
        batch.loss_mask = np.roll(batch.loss_mask, args.shift, axis=1)
        batch.rollout_logprobs = np.roll(batch.rollout_logprobs, args.shift, axis=1)
    per_sequence = []
    for b in range(len(batch)):
        mask = batch.loss_mask[b].astype(bool)
        per_sequence.append(float(np.abs(recomputed[b][mask] - batch.rollout_logprobs[b][mask]).max()) if mask.any() else None)
    return {"sequences": len(batch), **logprob_mismatch(batch, recomputed), "max_abs_per_sequence": per_sequence}


def main() -> None:
    torch.set_num_threads(1)  # on a shared 2-core machine one thread is several times faster than two
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("adapter")
    make.add_argument("out")
    make.add_argument("--model-dir", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--scale", type=float, default=0.05)
    check = sub.add_parser("recompute")
    check.add_argument("parquet")
    check.add_argument("--model-dir", required=True)
    check.add_argument("--adapter")
    check.add_argument("--shift", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(adapter(args) if args.command == "adapter" else recompute(args)))


if __name__ == "__main__":
    sys.exit(main())
