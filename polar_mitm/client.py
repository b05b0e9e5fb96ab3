"""The trainer's side of polar-mitm: drive gateways and the rollout server, and turn trajectories into batches.

Importable in a trainer's environment without the gateway's dependencies: it needs only the standard library,
httpx, pydantic, numpy and pyarrow (torch is optional: `TrajectoryBatch.to_torch()` imports it when called).
It talks to polar-mitm over HTTP and reads its Parquet files; nothing of the server is imported.

    from polar_mitm.client import GatewayControl, RolloutClient, load_batch

    gateway = GatewayControl("http://127.0.0.1:8080")
    gateway.pause(mode="drain")                      # returns once no engine call is in flight
    ...                                              # update the engine's weights
    gateway.resume(policy_version=7, engine_model="policy-v7")

    rollouts = RolloutClient("http://127.0.0.1:8070")
    task = rollouts.submit({"instruction": "...", "num_samples": 8, "agent": {"harness": "qwen"},
                            "metadata": {"policy_version": 7}})
    result = rollouts.wait(task["task_id"])
    batch = load_batch(result["trajectories"])      # numpy arrays, right-padded
    batch.to_torch()["input_ids"]

`AsyncRolloutClient` and `AsyncGatewayControl` are the same clients for an event loop (`await rollouts.wait(...)`).
A server started with a bearer token (`rollout serve --api-token`, `gateway --control-token`; required beyond
loopback) takes it as `RolloutClient(url, token=...)` / `GatewayControl(url, token=...)`.
"""

from __future__ import annotations

import csv
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from polar_mitm import session

# the HTTP clients live in one module, sync and async on one base; the trainer imports them from here
from polar_mitm.api_clients import AsyncGatewayControl, AsyncRolloutClient, GatewayControl, RolloutClient
from polar_mitm.errors import ClientError

__all__ = [
    "AsyncGatewayControl", "AsyncRolloutClient", "GatewayControl", "RolloutClient", "TrajectoryBatch", "load_batch",
    "logprob_mismatch", "session_proxy_url", "write_rewards_csv", "assemble",
]


@dataclass
class TrajectoryBatch:
    """Sequences as right-padded arrays, ready for a policy-gradient step.

    Shapes: [B, T] for per-token arrays, [B] for per-sequence ones. `rollout_logprobs[b, t]` is the engine's
    logprob of token `input_ids[b, t]` where `loss_mask[b, t]` is 1 (0 elsewhere): the logits that score it are
    those at position t - 1. `policy_versions[b, t]` is the version that sampled token t (-1 where not sampled
    or not recorded).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    policy_versions: np.ndarray
    advantages: np.ndarray
    rewards: np.ndarray
    session_ids: list[str]
    sequence_ids: list[str]
    group_ids: list[str | None]
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.session_ids)

    @property
    def sampled_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The array fields as torch tensors (ids int64, masks and logprobs float32)."""
        import torch

        out: dict[str, Any] = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, np.ndarray):
                out[spec.name] = torch.as_tensor(value, device=device)
        return out


def load_batch(
    source: str | os.PathLike[str] | Any,
    sessions: Iterable[str] | None = None,
    trainable_only: bool = True,
    pad_id: int = 0,
    token_versions: Mapping[str, int] | None = None,
) -> TrajectoryBatch:
    """Read assembled trajectories (a Parquet path from `polar-mitm assemble` / TaskResult.trajectories, or a
    pyarrow Table) into a TrajectoryBatch. `sessions` keeps only those sessions; `trainable_only` drops rows
    with `trainable = false`. `token_versions` (exchange_id -> policy_version) fills `policy_versions` for
    assemblies that do not carry them."""
    table = source if hasattr(source, "to_pylist") else pq.read_table(source)
    rows = table.to_pylist()
    wanted = set(sessions) if sessions is not None else None
    rows = [r for r in rows if (wanted is None or r["session_id"] in wanted) and (not trainable_only or r.get("trainable", True))]
    if not rows:
        raise ClientError("no trajectories to batch (none assembled, or all filtered out)")
    width = max(len(r["input_ids"]) for r in rows)
    n = len(rows)
    input_ids = np.full((n, width), pad_id, dtype=np.int64)
    attention = np.zeros((n, width), dtype=np.int64)
    loss_mask = np.zeros((n, width), dtype=np.float32)
    logprobs = np.zeros((n, width), dtype=np.float32)
    versions = np.full((n, width), -1, dtype=np.int64)
    for b, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[b, :length] = row["input_ids"]
        attention[b, :length] = 1
        loss_mask[b, :length] = row["loss_mask"]
        logprobs[b, :length] = row["rollout_logprobs"]
        versions[b, :length] = _token_versions(row, length, token_versions)
    known = {"input_ids", "loss_mask", "rollout_logprobs", "advantage", "reward", "session_id", "sequence_id", "group_id", "token_policy_versions"}
    extra = {name: [r.get(name) for r in rows] for name in rows[0] if name not in known}
    return TrajectoryBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        policy_versions=versions,
        advantages=np.array([r.get("advantage") or 0.0 for r in rows], dtype=np.float32),
        rewards=np.array([r.get("reward") if r.get("reward") is not None else np.nan for r in rows], dtype=np.float32),
        session_ids=[r["session_id"] for r in rows],
        sequence_ids=[r["sequence_id"] for r in rows],
        group_ids=[r.get("group_id") for r in rows],
        extra=extra,
    )


def _token_versions(row: Mapping[str, Any], length: int, by_exchange: Mapping[str, int] | None) -> np.ndarray:
    """Per-token policy versions of one row: its own list if the assembly wrote one, else its exchanges' versions
    laid over their sampled spans (a sampled span is a run of loss_mask 1 tokens, one per exchange, in order)."""
    own = row.get("token_policy_versions")
    if own is not None:
        return np.asarray(own, dtype=np.int64)
    out = np.full(length, -1, dtype=np.int64)
    if by_exchange is None:
        single = row.get("min_policy_version")
        if single is not None and single == row.get("max_policy_version"):
            out[np.asarray(row["loss_mask"], dtype=bool)] = single
        return out
    mask = np.asarray(row["loss_mask"], dtype=np.int8)
    starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
    ends = np.flatnonzero(np.diff(np.concatenate([mask, [0]])) == -1) + 1
    for exchange_id, start, end in zip(row["exchange_ids"], starts, ends, strict=False):
        version = by_exchange.get(exchange_id)
        if version is not None:
            out[start:end] = version
    return out


def write_rewards_csv(path: str | os.PathLike[str], rewards: Mapping[str, float], groups: Mapping[str, str] | None = None) -> Path:
    """The `--rewards` CSV of `polar-mitm assemble`: session_id, reward and (for GRPO groups) task_id."""
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["session_id", "reward", "task_id"])
        for session_id, reward in rewards.items():
            writer.writerow([session_id, reward, (groups or {}).get(session_id, "")])
    return path


def assemble(db: str | os.PathLike[str], out: str | os.PathLike[str], rewards_csv: str | os.PathLike[str] | None = None,
             builder: str = "prefix_merging", command: Sequence[str] = ("polar-mitm",), timeout: float = 600.0) -> Path:
    """Run `polar-mitm assemble` (from the environment polar-mitm is installed in: `command`) into `out`.

    Works while a gateway holds the store (it answers the reads). The trainer's environment needs no DuckDB."""
    argv = [*command, "assemble", "--db", str(db), "--builder", builder, "--out", str(out)]
    if rewards_csv is not None:
        argv += ["--rewards", str(rewards_csv)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ClientError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return Path(out)


def logprob_mismatch(batch: TrajectoryBatch, recomputed: np.ndarray) -> dict[str, float]:
    """Train/inference mismatch over the sampled tokens: the trainer's recomputed logprobs ([B, T], same layout as
    `batch.rollout_logprobs`) against the engine's. Returns tokens, mean_abs and max_abs of the difference, and
    kl: the k3 estimate of KL(rollout policy || trainer policy), mean(exp(d) - 1 - d) with d = trainer - rollout."""
    mask = batch.loss_mask.astype(bool)
    delta = (np.asarray(recomputed, dtype=np.float64) - batch.rollout_logprobs.astype(np.float64))[mask]
    if delta.size == 0:
        raise ClientError("no sampled tokens to compare")
    return {
        "tokens": int(delta.size),
        "mean_abs": float(np.abs(delta).mean()),
        "max_abs": float(np.abs(delta).max()),
        "kl": float(np.mean(np.expm1(delta) - delta)),
    }


def session_proxy_url(gateway_url: str, session_id: str, confdir: str | os.PathLike[str] | None = None) -> str:
    """The proxy URL that attributes calls to `session_id`: its token is the HMAC of the gateway confdir's
    session secret (needed with --require-auth; without a confdir any token is accepted otherwise)."""
    token = session.session_token(session.load_secret(confdir), session_id) if confdir is not None else "x"
    scheme, _, rest = gateway_url.partition("://")
    return f"{scheme}://{session_id}:{token}@{rest}"
