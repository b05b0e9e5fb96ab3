"""The assembler: token-faithful training sequences from the store.

    from polar_mitm.assembler import assemble
    result = assemble("runs/store.duckdb", builder="prefix_merging", session=None, rewards="rewards.csv")
    result.sequences      # list[Sequence]: input_ids, loss_mask, rollout_logprobs, reward, advantage, ...
    result.stats          # AssemblyStats: exchanges, sequences, compression_ratio, merge_rate, breaks, ...
    result.groups         # list[GroupStats]: one per GRPO group (task)

Builders: `per_request` (one sequence per exchange) and `prefix_merging` (strict; `lenient=True` gives a
Polar-style, not token-faithful variant for comparison). Only exchanges with status 'ok', action
'generate' and no replay flag are trajectory material. The store is read through `polar_mitm.store.query`,
so this works while a gateway writes to it; pass `store=` (an open `polar_mitm.store.Store`) when running
in the gateway's own process. For runs too large to hold in memory, iterate `Assembler(...).batches()`.
`polar-mitm assemble` (polar_mitm/cli/assemble.py) writes Parquet and the store's `trajectories` table (export.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol

from polar_mitm.assembler import per_request, prefix_merging, rewards, source
from polar_mitm.assembler.chain import Chain
from polar_mitm.assembler.diagnosis import Diagnoser
from polar_mitm.assembler.records import (
    Assembly,
    AssemblyStats,
    BreakDiagnosis,
    GroupStats,
    Sequence,
)
from polar_mitm.errors import ConfigError
from polar_mitm.registry import Registry
from polar_mitm.store import Store

__all__ = ["BUILDERS", "Assembler", "Assembly", "AssemblyStats", "BreakDiagnosis", "Builder", "GroupStats", "Sequence", "assemble"]


class Builder(Protocol):
    """A trajectory builder: one module that turns one session's exchanges (seq order) into chains."""

    NAME: str  # the `--builder` value
    SUPPORTS_LENIENT: bool  # whether `lenient=True` means anything to it

    def build_session(self, exchanges: list[source.Exchange], diagnoser: Diagnoser, lenient: bool = False) -> list[Chain]:
        """Every sampled token of `exchanges` in exactly one chain; `diagnoser` explains why a chain breaks."""
        ...


_MODULES: tuple[Builder, ...] = (per_request, prefix_merging)
BUILDERS: Registry[Builder] = Registry("builder", {module.NAME: module for module in _MODULES})


class Assembler:
    """One assembly run; `batches()` yields the sequences of a few sessions at a time and fills `stats`."""

    def __init__(
        self,
        db_path: str | os.PathLike[str] | None = None,
        builder: str = prefix_merging.NAME,
        session: str | None = None,
        *,
        lenient: bool = False,
        rewards_csv: str | os.PathLike[str] | None = None,
        include_incomplete: bool = False,
        tokenizer: Any = None,
        store: Store | None = None,
        batch_tokens: int = source.BATCH_TOKENS,
    ):
        self.build = BUILDERS.get(builder)  # ConfigError (a ValueError) naming the builders
        if lenient and not self.build.SUPPORTS_LENIENT:
            raise ConfigError(f"lenient applies to the {prefix_merging.NAME} builder only")
        self.builder = builder
        self.session = session
        self.lenient = lenient
        self.include_incomplete = include_incomplete
        self.batch_tokens = batch_tokens
        self.read = source.Reader(db_path, store)
        self.csv_rewards = rewards.read_rewards_csv(rewards_csv) if rewards_csv else None
        self.diagnoser = Diagnoser(lambda ids: source.load_messages(self.read, ids), tokenizer)
        self.stats = AssemblyStats(builder=prefix_merging.LENIENT_NAME if lenient else builder)
        self.groups: list[GroupStats] = []

    def batches(self) -> Iterator[list[Sequence]]:
        all_sizes = source.session_sizes(self.read)
        sizes = all_sizes if self.session is None else [(s, n) for s, n in all_sizes if s == self.session]
        if self.session is not None and not sizes:
            raise LookupError(f"session {self.session!r} has no trajectory material (no exchange with status 'ok' and action 'generate')")
        # groups span the whole store, so one session's advantage is the same whether assembled alone or not
        every = [s for s, _ in all_sizes]
        scores, self.groups = rewards.score_sessions(every, source.load_sessions(self.read, every), self.csv_rewards, self.include_incomplete)
        wanted = {s for s, _ in sizes}
        self.stats.groups = len({scores[s].group_id for s in wanted})
        self.stats.no_signal_groups = len({scores[s].group_id for s in wanted if scores[s].no_signal})
        self.stats.untrainable_sessions = sum(not scores[s].trainable for s in wanted)
        self.stats.exchanges_skipped = source.skipped_count(self.read, self.session)
        for session_ids in source.batches(sizes, self.batch_tokens):
            by_session = source.load_exchanges(self.read, session_ids)
            batch = []
            for session_id in session_ids:
                exchanges = by_session.get(session_id, [])
                for chain in self.build.build_session(exchanges, self.diagnoser, lenient=self.lenient):
                    sequence = chain.to_sequence(scores[session_id])
                    self._count(chain, sequence)
                    batch.append(sequence)
                self.stats.sessions += 1
                self.stats.exchanges += len(exchanges)
                self.stats.exchange_tokens += sum(len(e.prompt) + len(e.completion) for e in exchanges)
            yield batch
        self.stats.tokenizer = self.diagnoser.tokenizer.name if self.diagnoser.tokenizer else None

    def _count(self, chain: Chain, sequence: Sequence) -> None:
        stats = self.stats
        stats.sequences += 1
        stats.merged_exchanges += len(chain.exchanges) - 1
        stats.unfaithful_merges += chain.unfaithful_merges
        stats.sampled_tokens += sequence.sampled_tokens
        stats.trainable_tokens += sequence.sampled_tokens if sequence.trainable else 0
        stats.sequence_tokens += len(sequence.input_ids)
        if chain.retry_of is not None:
            stats.retries += 1
        elif chain.break_diagnosis is not None:
            stats.breaks[chain.break_diagnosis.kind] += 1
        else:
            stats.new_lineages += 1


def assemble(
    db_path: str | os.PathLike[str] | None = None,
    builder: str = prefix_merging.NAME,
    session: str | None = None,
    **options: Any,
) -> Assembly:
    """Assemble a store (or one session of it) into sequences; options as for `Assembler`."""
    assembler = Assembler(db_path, builder, session, **options)
    sequences = [sequence for batch in assembler.batches() for sequence in batch]
    return Assembly(sequences=sequences, stats=assembler.stats, groups=assembler.groups)
