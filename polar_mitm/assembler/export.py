"""Parquet output, one row per trainable sequence, and the store's `trajectories` table.

Columns (docs/trainers.md maps them to TRL, verl and slime):
    sequence_id, builder, session_id, task_id, group_id    identity and GRPO group
    input_ids int32[], loss_mask int8[], rollout_logprobs double[]   same length; mask 1 = sampled
    prompt_len, sampled_tokens, n_exchanges, exchange_ids, exchange_seqs, finish_reason
    break_kind, break_index, break_region, break_from, break_exchange_id, break_detail    null: no break
    retry_of, faithful
    reward, advantage, trainable, no_signal, session_status, session_metadata
    api, harness, model_requested, model_engine

Writing the table. DuckDB lets one process write a file. The Parquet file is always written first; then
  - no process holds the store: `polar-mitm assemble` opens it and loads the rows into `trajectories`
    (rows of the same builder and sessions are replaced);
  - a gateway holds it: the gateway loads the Parquet file through its writer (its control endpoint,
    `polar_mitm.store.by_path.load_trajectories`), so `breaks`, `breaks_by_class` work while it runs;
  - in-process (the rollout server passes its open `Store`): the same statements go through
    `Store.load_trajectories`, serialised with the gateway's exchange commits;
  - another process holds it without an endpoint: the Parquet file is the result (its absolute path printed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.assembler.records import Sequence
from polar_mitm.store import Store, connect, views
from polar_mitm.store.by_path import load_trajectories
from polar_mitm.store.schema import TRAJECTORIES as TABLE
from polar_mitm.store.schema import TRAJECTORIES_SCHEMA as SCHEMA
from polar_mitm.store.schema import trajectory_statements

TOKEN_COLUMNS = ("input_ids", "loss_mask", "rollout_logprobs")
_PLAIN = [name for name in SCHEMA.names if not name.startswith("break_") and name not in TOKEN_COLUMNS]


def _token_column(sequences: list[Sequence], index: int) -> pa.Array:
    kind = SCHEMA.field(TOKEN_COLUMNS[index]).type
    if any(s._arrays is None for s in sequences):
        return pa.array([getattr(s, TOKEN_COLUMNS[index]) for s in sequences], type=kind)
    arrays = [s._arrays[index] for s in sequences]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=kind.value_type))


def to_table(sequences: list[Sequence]) -> pa.Table:
    columns: dict[str, Any] = {name: [getattr(s, name) for s in sequences] for name in _PLAIN}
    breaks = [s.break_diagnosis for s in sequences]
    columns["break_kind"] = [b.kind if b else None for b in breaks]
    columns["break_index"] = [b.index if b else None for b in breaks]
    columns["break_region"] = [b.region if b else None for b in breaks]
    columns["break_from"] = [b.previous_sequence_id if b else None for b in breaks]
    columns["break_exchange_id"] = [b.previous_exchange_id if b else None for b in breaks]
    columns["break_detail"] = [b.detail if b else None for b in breaks]
    arrays = {name: pa.array(values, type=SCHEMA.field(name).type) for name, values in columns.items()}
    arrays.update({name: _token_column(sequences, index) for index, name in enumerate(TOKEN_COLUMNS)})
    return pa.table({name: arrays[name] for name in SCHEMA.names}, schema=SCHEMA)


class ParquetSink:
    """Write sequences batch by batch (one row group each), so a large run never sits in memory whole."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(str(self.path), SCHEMA, compression="zstd")
        self.rows = 0

    def write(self, sequences: list[Sequence]) -> None:
        if sequences:
            self._writer.write_table(to_table(sequences))
            self.rows += len(sequences)

    def close(self) -> None:
        self._writer.close()


def write_parquet(sequences: list[Sequence], path: str | os.PathLike[str]) -> Path:
    sink = ParquetSink(path)
    try:
        sink.write(sequences)
    finally:
        sink.close()
    return sink.path


@dataclass
class StoreWrite:
    written: bool
    message: str


def store_trajectories(db_path: str | os.PathLike[str] | None, parquet: Path, store_object: Store | None = None) -> StoreWrite:
    """Load a Parquet file written by this module into the store's `trajectories` table, if the store can be written."""
    if store_object is not None:
        store_object.load_trajectories(parquet)
        return StoreWrite(True, f"loaded into table {TABLE} of {store_object.path} through the running store's writer")
    db = Path(db_path).resolve()  # type: ignore[arg-type]
    if load_trajectories(db, parquet):
        return StoreWrite(True, f"loaded into table {TABLE} of {db} through the writer of the gateway that holds it")
    try:
        con = connect(db)
    except duckdb.IOException as error:
        if "lock" not in str(error).lower():
            raise
        # absolute paths: the SQL may run in another process, in another working directory
        return StoreWrite(
            False,
            f"another process holds {db}, so table {TABLE} was not written; the trajectories are in {parquet.resolve()} — "
            f"read them with: polar-mitm sql --db {db} \"SELECT * FROM read_parquet('{parquet.resolve()}')\"",
        )
    try:
        con.execute("BEGIN TRANSACTION")
        for sql in trajectory_statements(parquet):
            con.execute(sql)
        con.execute("COMMIT")
        views.create_views(con)  # the views over trajectories (breaks, breaks_by_class) bind to the new table
    finally:
        con.close()
    return StoreWrite(True, f"loaded into table {TABLE} of {db}")
