"""A trainable sequence under construction: the exchanges it holds and its aligned token lists."""

from __future__ import annotations

from dataclasses import dataclass, field

from polar_mitm.assembler.records import BreakDiagnosis, Sequence
from polar_mitm.assembler.source import Exchange


@dataclass
class Chain:
    builder: str
    exchanges: list[Exchange]
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    # (start, end, exchange) of each sampled region in input_ids
    spans: list[tuple[int, int, Exchange]]
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
        return cls(
            builder=builder,
            exchanges=[exchange],
            input_ids=exchange.prompt + exchange.completion,
            loss_mask=[0] * prompt_len + [1] * len(exchange.completion),
            logprobs=[0.0] * prompt_len + list(exchange.logprobs),
            spans=[(prompt_len, prompt_len + len(exchange.completion), exchange)],
            retry_of=retry_of,
        )

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

    def append(self, exchange: Exchange, interstitial: list[int]) -> None:
        """Add the context tokens between the last sample and this exchange's sample (mask 0), then its sample."""
        self.release_alternates()
        self.input_ids.extend(interstitial)
        self.loss_mask.extend([0] * len(interstitial))
        self.logprobs.extend([0.0] * len(interstitial))
        start = len(self.input_ids)
        self.input_ids.extend(exchange.completion)
        self.loss_mask.extend([1] * len(exchange.completion))
        self.logprobs.extend(exchange.logprobs)
        self.spans.append((start, len(self.input_ids), exchange))
        self.exchanges.append(exchange)

    def swap_tip(self, alternate: Exchange) -> None:
        """Go on from another sample of the tip's prompt (the one the harness actually continued)."""
        start = self.tip_start
        previous = self.tip
        del self.input_ids[start:], self.loss_mask[start:], self.logprobs[start:]
        self.spans.pop()
        self.exchanges.pop()
        self.alternates.remove(alternate)
        self.alternates.append(previous)
        self.input_ids.extend(alternate.completion)
        self.loss_mask.extend([1] * len(alternate.completion))
        self.logprobs.extend(alternate.logprobs)
        self.spans.append((start, len(self.input_ids), alternate))
        self.exchanges.append(alternate)

    def release_alternates(self) -> None:
        """Each other sample of the tip's prompt becomes its own sequence, flagged with the tip kept here."""
        self.released.extend(Chain.start(self.builder, alternate, retry_of=self.tip.exchange_id) for alternate in self.alternates)
        self.alternates = []

    def to_sequence(self) -> Sequence:
        tip, first = self.tip, self.exchanges[0]
        return Sequence(
            sequence_id=self.sequence_id,
            builder=self.builder,
            session_id=first.session_id,
            exchange_ids=[e.exchange_id for e in self.exchanges],
            exchange_seqs=[e.seq for e in self.exchanges],
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.logprobs,
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
        )
