"""What the assembler hands out: pydantic records, one per trainable sequence, plus run statistics.

These are the boundary types of `polar_mitm.assembler.assemble()` (the rollout server calls it) and the
rows of the Parquet file / `trajectories` table (see docs/trainers.md for the columns).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr

BreakKind = Literal["retokenized", "rerendered", "rewritten", "truncated", "unknown"]
BREAK_KINDS: tuple[str, ...] = ("retokenized", "rerendered", "rewritten", "truncated", "unknown")


class BreakDiagnosis(BaseModel):
    """Why a sequence could not continue the chain before it, and where the two first differ.

    `index` is a position in both token lists: the previous chain's tokens (prompt + sampled tokens so far)
    and this sequence's first prompt agree on every token before it.
    """

    kind: BreakKind
    index: int
    previous_sequence_id: str
    previous_exchange_id: str = Field(description="the exchange at the tip of the previous chain")
    region: Literal["last_sample", "earlier_sample", "context"] = Field(
        description="where `index` lies in the previous chain: in the tip's own sampled tokens, in an earlier sampled turn, or in non-sampled context"
    )
    chain_tokens: list[int] = Field(description="a few of the previous chain's tokens from `index` on")
    prompt_tokens: list[int] = Field(description="a few of this prompt's tokens from `index` on")
    detail: str


class Sequence(BaseModel):
    """One trainable token sequence: the exact tokens one or more exchanges were sampled in.

    `input_ids`, `loss_mask` and `rollout_logprobs` have the same length. `loss_mask` is 1 exactly on
    tokens the engine sampled; `rollout_logprobs` holds the engine's logprob there and 0.0 elsewhere.
    """

    sequence_id: str = Field(description="'<session_id>:<builder>:<seq of the first exchange>'")
    builder: str
    session_id: str
    task_id: str | None = None
    group_id: str | None = None
    exchange_ids: list[str]
    exchange_seqs: list[int]
    input_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    prompt_len: int = Field(description="tokens before the first sampled token")
    sampled_tokens: int = Field(description="tokens the engine sampled in this sequence (before any reward masking)")
    n_exchanges: int
    finish_reason: str | None = Field(None, description="finish reason of the last exchange")
    break_diagnosis: BreakDiagnosis | None = Field(None, description="set when this sequence restarts a conversation whose chain broke")
    retry_of: str | None = Field(
        None,
        description="set on a sample of a repeated prompt (SDK retry, same request re-sent): the exchange_id of the sample of that prompt which the conversation went on from",
    )
    faithful: bool = Field(True, description="False only in lenient mode: some sampled tokens sit in a context that differs from the one they were sampled in")
    api: str | None = None
    harness: str | None = None
    model_requested: str | None = None
    model_engine: str | None = None
    session_status: str | None = None
    session_metadata: str | None = Field(None, description="the session's metadata JSON, as stored")
    reward: float | None = None
    advantage: float | None = None
    trainable: bool = True
    no_signal: bool = Field(False, description="the session's group has no reward variance: its advantages are 0")
    # (input_ids, loss_mask, rollout_logprobs) as numpy arrays, when the assembler built it:
    # Parquet is written from these
    _arrays: Any = PrivateAttr(default=None)


class GroupStats(BaseModel):
    """One GRPO group (sessions of one task): the reward statistics its advantages come from."""

    group_id: str
    sessions: int
    scored_sessions: int = Field(description="trainable sessions with a reward: the ones the mean and std are taken over")
    mean: float | None
    std: float | None
    no_signal: bool


class AssemblyStats(BaseModel):
    builder: str
    sessions: int = 0
    exchanges: int = Field(0, description="exchanges that are trajectory material (status ok, generate, not a replay)")
    exchanges_skipped: int = Field(0, description="other exchanges of the same sessions: errors, count_tokens, replays")
    sequences: int = 0
    merged_exchanges: int = Field(0, description="exchanges appended to an existing chain")
    retries: int = Field(0, description="samples of a repeated prompt, kept as their own sequence")
    new_lineages: int = Field(0, description="sequences that start a conversation (first call, sub-agent, side call)")
    breaks: dict[str, int] = Field(default_factory=lambda: {kind: 0 for kind in BREAK_KINDS})
    unfaithful_merges: int = Field(0, description="lenient mode only: merges whose training context differs from the sampled one")
    sampled_tokens: int = 0
    trainable_tokens: int = Field(0, description="tokens with loss_mask 1 after reward masking")
    sequence_tokens: int = Field(0, description="sum of len(input_ids)")
    exchange_tokens: int = Field(0, description="sum over exchanges of prompt + sampled tokens: what per_request would train on")
    groups: int = 0
    no_signal_groups: int = 0
    untrainable_sessions: int = 0
    tokenizer: str | None = Field(None, description="tokenizer the diagnosis used; None: break kinds other than truncated are 'unknown'")

    @property
    def compression_ratio(self) -> float:
        """Exchanges per sequence: how many trainer updates merging saves."""
        return self.exchanges / self.sequences if self.sequences else 0.0

    @property
    def merge_rate(self) -> float:
        """Share of exchanges that were appended to an existing chain."""
        return self.merged_exchanges / self.exchanges if self.exchanges else 0.0

    @property
    def token_ratio(self) -> float:
        """Exchange tokens per sequence token: how much shorter the merged data is than per-request data."""
        return self.exchange_tokens / self.sequence_tokens if self.sequence_tokens else 0.0

    def summary(self) -> dict[str, object]:
        data = self.model_dump()
        data.update(compression_ratio=round(self.compression_ratio, 3), merge_rate=round(self.merge_rate, 3), token_ratio=round(self.token_ratio, 3))
        return data


class Assembly(BaseModel):
    """The result of one assembly run."""

    sequences: list[Sequence]
    stats: AssemblyStats
    groups: list[GroupStats] = Field(default_factory=list)
