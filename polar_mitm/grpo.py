"""GRPO's trainer-side maths in PyTorch, for batches from `polar_mitm.client.load_batch`.

Import it in the trainer's environment (torch required; nothing else of polar-mitm's server side). The
contract with the stored data: `rollout_logprobs[b, t]` scores token `input_ids[b, t]`, so the trainer's
logprob for it comes from the logits at position t - 1 (`token_logprobs` does that shift once, here).
"""

from __future__ import annotations

from typing import Any

import torch


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: the model's logprob of each token given the ones before it (0 at position 0)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    scored = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(scored[:, :1]), scored], dim=1)


def grpo_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss with the importance ratio against the engine's own rollout logprobs.

    ratio = exp(logprob - rollout_logprob) per sampled token; loss = -min(ratio * A, clip(ratio) * A), averaged
    over every sampled token of the batch (loss_mask 1). Using the stored rollout logprobs as the old policy
    corrects for the train/inference mismatch as well as for staleness."""
    mask = loss_mask.float()
    ratio = torch.exp((logprobs - rollout_logprobs) * mask)
    adv = advantages[:, None].float()
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip).float() * mask
        stats = {"ratio_mean": float((ratio * mask).sum() / tokens), "clip_fraction": float(clipped.sum() / tokens)}
    return loss, stats
