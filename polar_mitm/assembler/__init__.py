"""The assembler: token-faithful training sequences from the store.

    from polar_mitm.assembler import assemble
    result = assemble("runs/store.duckdb", builder="prefix_merging", session=None, rewards="rewards.csv")
    result.sequences      # list[Sequence]: input_ids, loss_mask, rollout_logprobs, reward, advantage, ...
    result.stats          # AssemblyStats: exchanges, sequences, compression_ratio, merge_rate, breaks, ...
    result.groups         # list[GroupStats]: one per GRPO group (task)

Builders: `per_request` (one sequence per exchange) and `prefix_merging` (strict; `lenient=True` gives a
Polar-style, not token-faithful variant for comparison). Only exchanges with status 'ok', action
'generate' and no replay flag are trajectory material. The store is read through `polar_mitm.store.query`,
so this works while a gateway writes to it; pass `store=` (any `polar_mitm.store.StoreReader`: the open
`Store` in the gateway's own process, a cluster's `UnionStore`) to read that instead. For runs too large to
hold in memory, iterate `Assembler(...).batches()`.

Scope: the whole store, one `session`, or `session_ids=` (a task's sessions: one pass over just those). A
GRPO group is a task's sessions across the whole store, so a scoped run also reads the rewards of the other
sessions of its groups (their session rows, not their tokens), and a session's advantage is the same however
it is assembled; its cost follows the sessions asked for, not the size of the store.
`polar-mitm assemble` (polar_mitm/cli/assemble.py) writes Parquet and the store's `trajectories` table (export.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
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
from polar_mitm.store import StoreReader

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


# what a run reads before it builds: the sizes of the sessions to build (in order), the sessions their GRPO groups
# are scored over, those sessions' rows, and how many of the exchanges asked for are not trajectory material
_Scope = tuple[list[tuple[str, int]], list[str], dict[str, source.SessionInfo], int]


class Assembler:
    """One assembly run; `batches()` yields the sequences of a few sessions at a time and fills `stats`."""

    def __init__(
        self,
        db_path: str | os.PathLike[str] | None = None,
        builder: str = prefix_merging.NAME,
        session: str | None = None,
        *,
        session_ids: Iterable[str] | None = None,
        lenient: bool = False,
        rewards_csv: str | os.PathLike[str] | None = None,
        include_incomplete: bool = False,
        tokenizer: Any = None,
        store: StoreReader | None = None,
        batch_tokens: int = source.BATCH_TOKENS,
        max_staleness: int | None = None,
        current_version: int | None = None,
    ):
        self.build = BUILDERS.get(builder)  # ConfigError (a ValueError) naming the builders
        if lenient and not self.build.SUPPORTS_LENIENT:
            raise ConfigError(f"lenient applies to the {prefix_merging.NAME} builder only")
        if (max_staleness is None) != (current_version is None):
            raise ConfigError("max_staleness and current_version go together")
        if max_staleness is not None and max_staleness < 0:
            raise ConfigError("max_staleness must be >= 0")
        self.max_staleness = max_staleness
        self.current_version = current_version
        if session is not None and session_ids is not None:
            raise ConfigError("give session or session_ids, not both")
        self.builder = builder
        self.session = session
        if session is not None:
            session_ids = [session]
        # None: the whole store; else these sessions, in this order (a session without material yields nothing)
        self.session_ids = None if session_ids is None else list(dict.fromkeys(session_ids))
        self.lenient = lenient
        self.include_incomplete = include_incomplete
        self.batch_tokens = batch_tokens
        self.read = source.open_reader(db_path, store)
        self.csv_rewards = rewards.read_rewards_csv(rewards_csv) if rewards_csv else None
        self.diagnoser = Diagnoser(lambda ids: source.load_messages(self.read, ids), tokenizer)
        self.stats = AssemblyStats(builder=prefix_merging.LENIENT_NAME if lenient else builder)
        self.groups: list[GroupStats] = []

    def batches(self) -> Iterator[list[Sequence]]:
        sizes, members, infos, self.stats.exchanges_skipped = self._whole_store() if self.session_ids is None else self._scoped(self.session_ids)
        if self.session is not None and not sizes:
            raise LookupError(f"session {self.session!r} has no trajectory material (no exchange with status 'ok' and action 'generate')")
        wanted = [s for s, _ in sizes]
        scores, groups = rewards.score_sessions(members, infos, self.csv_rewards, self.include_incomplete)
        wanted_groups = {scores[s].group_id for s in wanted}
        self.groups = [group for group in groups if group.group_id in wanted_groups]
        self.stats.groups = len(wanted_groups)
        self.stats.no_signal_groups = len({scores[s].group_id for s in wanted if scores[s].no_signal})
        self.stats.untrainable_sessions = sum(not scores[s].trainable for s in wanted)
        for session_ids in source.batches(sizes, self.batch_tokens):
            by_session = source.load_exchanges(self.read, session_ids)
            batch = []
            for session_id in session_ids:
                exchanges = by_session.get(session_id, [])
                for chain in self.build.build_session(exchanges, self.diagnoser, lenient=self.lenient):
                    sequence = chain.to_sequence(scores[session_id])
                    if self._stale(sequence):
                        self.stats.stale_sequences += 1
                        continue
                    self._count(chain, sequence)
                    batch.append(sequence)
                self.stats.sessions += 1
                self.stats.exchanges += len(exchanges)
                self.stats.exchange_tokens += sum(len(e.prompt) + len(e.completion) for e in exchanges)
            yield batch
        self.stats.tokenizer = self.diagnoser.tokenizer.name if self.diagnoser.tokenizer else None

    def _whole_store(self) -> _Scope:
        sizes = source.session_sizes(self.read)
        every = [s for s, _ in sizes]
        return sizes, every, source.load_sessions(self.read, every), source.skipped_count(self.read)

    def _scoped(self, session_ids: list[str]) -> _Scope:
        """These sessions, and for their advantages every other session with trajectory material of their tasks
        (groups span the store): the session rows first (cheap), then one query over these sessions' exchanges."""
        infos = source.load_sessions(self.read, session_ids)
        tasks = sorted({task for s in session_ids if (task := rewards.task_of(s, infos.get(s), self.csv_rewards)) is not None})
        of_tasks = source.sessions_of_tasks(self.read, tasks)
        # the CSV can move a session into a task (or out of the one the store gives it): score_sessions regroups
        candidates = (set(of_tasks) | {s for s, row in (self.csv_rewards or {}).items() if row.task_id in tasks}) - set(session_ids)
        counts = source.session_counts(self.read, [*session_ids, *sorted(candidates)])
        sizes = [(s, counts[s].tokens) for s in session_ids if s in counts and counts[s].material]
        mates = sorted(s for s in candidates if s in counts and counts[s].material)
        infos.update({s: of_tasks[s] for s in mates if s in of_tasks})
        if missing := [s for s in mates if s not in infos]:  # moved into a task by the CSV
            infos.update(source.load_sessions(self.read, missing))
        skipped = sum(counts[s].skipped for s in session_ids if s in counts)
        return sizes, [s for s, _ in sizes] + mates, infos, skipped

    def _stale(self, sequence: Sequence) -> bool:
        """Sampled (at least in part) more than max_staleness versions before current_version: dropped."""
        if self.max_staleness is None or sequence.min_policy_version is None:
            return False
        assert self.current_version is not None
        return self.current_version - sequence.min_policy_version > self.max_staleness

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
    """Assemble a store (or one session of it, or `session_ids=`) into sequences; options as for `Assembler`."""
    assembler = Assembler(db_path, builder, session, **options)
    sequences = [sequence for batch in assembler.batches() for sequence in batch]
    return Assembly(sequences=sequences, stats=assembler.stats, groups=assembler.groups)
