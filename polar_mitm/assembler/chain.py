"""A trainable sequence under construction: the exchanges it holds and the pieces of its token stream."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from polar_mitm.assembler.records import BreakDiagnosis, Sequence
from polar_mitm.assembler.rewards import SessionScore
from polar_mitm.assembler.source import Exchange


@dataclass
class Chain:
    builder: str
    exchanges: list[Exchange]
    # the token stream, as consecutive pieces: context (mask 0) and samples (mask 1) alternate
    pieces: list[np.ndarray]
    # (start, end, exchange) of each sampled region in the stream
    spans: list[tuple[int, int, Exchange]]
    length: int
    break_diagnosis: BreakDiagnosis | None = None
    retry_of: str | None = None
    faithful: bool = True
    unfaithful_merges: int = 0
    # other samples of the tip's prompt (retries) that this chain did not go on from (yet)
    alternates: list[Exchange] = field(default_factory=list)
    # those samples once the chain has moved on: each its own sequence, flagged retry_of
    released: list[Chain] = field(default_factory=list)

    @classmethod
    def start(cls, builder: str, exchange: Exchange, retry_of: str | None = None) -> Chain:
        prompt_len = len(exchange.prompt)
        end = prompt_len + len(exchange.completion)
        return cls(builder, [exchange], [exchange.prompt, exchange.completion], [(prompt_len, end, exchange)], end, retry_of=retry_of)

    @property
    def tip(self) -> Exchange:
        return self.exchanges[-1]

    @property
    def tip_start(self) -> int:
        """Index of the tip's first sampled token."""
        return self.spans[-1][0]

    @property
    def sequence_id(self) -> str:
        first = self.exchanges[0]
        return f"{first.session_id}:{self.builder}:{first.seq}"

    def tokens(self) -> np.ndarray:
        return np.concatenate(self.pieces)

    def append(self, exchange: Exchange, interstitial: np.ndarray) -> None:
        """Add the context tokens between the last sample and this exchange's sample (mask 0), then its sample."""
        self.release_alternates()
        start = self.length + len(interstitial)
        self.length = start + len(exchange.completion)
        self.pieces += [interstitial, exchange.completion]
        self.spans.append((start, self.length, exchange))
        self.exchanges.append(exchange)

    def swap_tip(self, alternate: Exchange) -> None:
        """Go on from another sample of the tip's prompt (the one the harness actually continued)."""
        start = self.tip_start
        self.alternates.remove(alternate)
        self.alternates.append(self.tip)
        self.length = start + len(alternate.completion)
        self.pieces[-1] = alternate.completion
        self.spans[-1] = (start, self.length, alternate)
        self.exchanges[-1] = alternate

    def release_alternates(self) -> None:
        """Each other sample of the tip's prompt becomes its own sequence, flagged with the tip kept here."""
        self.released.extend(Chain.start(self.builder, alternate, retry_of=self.tip.exchange_id) for alternate in self.alternates)
        self.alternates = []

    def to_sequence(self, score: SessionScore) -> Sequence:
        input_ids = self.tokens().astype(np.int32, copy=False)
        loss_mask = np.zeros(self.length, dtype=np.int8)
        logprobs = np.zeros(self.length, dtype=np.float64)
        for start, end, exchange in self.spans:
            loss_mask[start:end] = score.trainable
            logprobs[start:end] = exchange.logprobs
        tip, first = self.tip, self.exchanges[0]
        versions = [e.policy_version for e in self.exchanges if e.policy_version is not None]
        token_versions = None
        if versions and min(versions) != max(versions):
            spread = np.full(self.length, -1, dtype=np.int64)
            for start, end, exchange in self.spans:
                spread[start:end] = -1 if exchange.policy_version is None else exchange.policy_version
            token_versions = spread.tolist()
        # built from data that is valid by construction: no validation pass over every token
        sequence = Sequence.model_construct(
            sequence_id=self.sequence_id,
            builder=self.builder,
            session_id=first.session_id,
            task_id=score.task_id,
            group_id=score.group_id,
            exchange_ids=[e.exchange_id for e in self.exchanges],
            exchange_seqs=[e.seq for e in self.exchanges],
            input_ids=input_ids.tolist(),
            loss_mask=loss_mask.tolist(),
            rollout_logprobs=logprobs.tolist(),
            prompt_len=len(first.prompt),
            sampled_tokens=sum(end - start for start, end, _ in self.spans),
            n_exchanges=len(self.exchanges),
            finish_reason=tip.finish_reason,
            break_diagnosis=self.break_diagnosis,
            retry_of=self.retry_of,
            faithful=self.faithful,
            api=first.api,
            harness=first.harness,
            model_requested=first.model_requested,
            model_engine=tip.model_engine,
            min_policy_version=min(versions) if versions else None,
            max_policy_version=max(versions) if versions else None,
            token_policy_versions=token_versions,
            session_status=score.status,
            session_metadata=score.metadata,
            reward=score.reward,
            advantage=score.advantage,
            trainable=score.trainable,
            no_signal=score.no_signal,
        )
        sequence._arrays = (input_ids, loss_mask, logprobs)
        return sequence
