"""Rewards per session, GRPO groups per task, group-normalised advantages.

Reward of a session: the `--rewards` CSV's (columns `session_id,reward`, optional `task_id`), else the
store's `sessions.reward`. Group: the session's `task_id` (CSV first, then the store); a session without
one is a group of its own.

A session is complete when its `sessions.status` is one of COMPLETED_STATUSES or no status was recorded
(a plain gateway, no rollout server); any other status (failed, timeout, running...) is incomplete. An
incomplete session is not trainable: reward 0, advantage 0, loss_mask all 0 — unless
`include_incomplete`, which scores it like the others (a missing reward counts as 0).

Advantage, as in verl's GRPO: A = (r - mean) / (std + EPSILON) over the group's scored sessions (trainable,
with a reward), std the sample standard deviation (n - 1). A group with fewer than two scored sessions or
std < EPSILON has no signal: `no_signal` is set and its advantages are 0. A completed session without a
reward keeps reward and advantage None (usable for SFT, not for policy gradients).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass

from polar_mitm.assembler.records import GroupStats
from polar_mitm.assembler.source import SessionInfo
from polar_mitm.store.schema import COMPLETED_STATUSES

EPSILON = 1e-6


@dataclass
class CsvReward:
    reward: float
    task_id: str | None


def read_rewards_csv(path: str | os.PathLike[str]) -> dict[str, CsvReward]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"session_id", "reward"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: the rewards CSV needs columns session_id and reward (missing: {', '.join(sorted(missing))})")
        out = {}
        for line, row in enumerate(reader, start=2):
            try:
                reward = float(row["reward"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: reward {row['reward']!r} is not a number") from None
            if not math.isfinite(reward):
                raise ValueError(f"{path}:{line}: reward {row['reward']!r} is not finite")
            out[row["session_id"]] = CsvReward(reward, row.get("task_id") or None)
        return out


def is_completed(status: str | None) -> bool:
    return status is None or status.lower() in COMPLETED_STATUSES


def group_advantages(rewards: list[float]) -> tuple[float | None, float | None, bool, list[float]]:
    """(mean, std, no_signal, advantages) of one group's rewards."""
    n = len(rewards)
    if n == 0:
        return None, None, True, []
    mean = sum(rewards) / n
    if n < 2:
        return mean, None, True, [0.0]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    if std < EPSILON:
        return mean, std, True, [0.0] * n
    return mean, std, False, [(r - mean) / (std + EPSILON) for r in rewards]


def task_of(session_id: str, info: SessionInfo | None, csv_rewards: dict[str, CsvReward] | None = None) -> str | None:
    """The session's task: the CSV's task_id, else the store's (None: the session is a group of its own)."""
    from_csv = (csv_rewards or {}).get(session_id)
    return (from_csv.task_id if from_csv else None) or (info.task_id if info else None)


@dataclass
class SessionScore:
    group_id: str
    task_id: str | None
    reward: float | None
    trainable: bool
    advantage: float | None = None
    no_signal: bool = False
    status: str | None = None
    metadata: str | None = None


def score_sessions(
    session_ids: list[str],
    sessions: dict[str, SessionInfo],
    csv_rewards: dict[str, CsvReward] | None = None,
    include_incomplete: bool = False,
) -> tuple[dict[str, SessionScore], list[GroupStats]]:
    """Reward, group and advantage of every session, before any sequence is built. A group's advantages are
    over the sessions of it that are in `session_ids`: give every member of a group whose advantages you need."""
    csv_rewards = csv_rewards or {}
    scores: dict[str, SessionScore] = {}
    for session_id in session_ids:
        info = sessions.get(session_id) or SessionInfo(session_id, None, None, None, None)
        from_csv = csv_rewards.get(session_id)
        reward = from_csv.reward if from_csv else info.reward
        task_id = task_of(session_id, info, csv_rewards)
        group = task_id or f"session:{session_id}"
        if is_completed(info.status):
            score = SessionScore(group, task_id, reward, True)
        elif include_incomplete:
            score = SessionScore(group, task_id, 0.0 if reward is None else reward, True)
        else:
            score = SessionScore(group, task_id, 0.0, False, advantage=0.0)
        score.status, score.metadata = info.status, info.metadata
        scores[session_id] = score

    members: dict[str, list[str]] = {}
    for session_id, score in scores.items():
        members.setdefault(score.group_id, []).append(session_id)
    groups = []
    for group, session_ids_in_group in members.items():
        counted = [s for s in session_ids_in_group if scores[s].trainable and scores[s].reward is not None]
        mean, std, no_signal, values = group_advantages([scores[s].reward for s in counted])
        for session_id, value in zip(counted, values, strict=True):
            scores[session_id].advantage = value
        for session_id in session_ids_in_group:
            scores[session_id].no_signal = no_signal
        groups.append(GroupStats(group_id=group, sessions=len(session_ids_in_group), scored_sessions=len(counted), mean=mean, std=std, no_signal=no_signal))
    return scores, groups
