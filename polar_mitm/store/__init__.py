"""The DuckDB store: one row per model exchange, committed before the client gets its reply.

Modules, bottom up (each imports only those above it in this list, and nothing of polar_mitm outside the store):
    schema     the contract: exchange and session columns, ExchangeRow, MATERIAL, the trajectories schema
    records    journal records: how a row is written into a journal table and read back typed
    commit_log the commit log beside the file: where a commit is durable before its row is in the file
    segments   segments (typed rows in the store file, exported to Parquet for snapshots), the `exchanges` view
               over journals and segments, compaction steps, migration, connect()
    sql_endpoint  the loopback read-only SQL endpoint a gateway serves, and its control file
    views      the documented SQL views (session_timeline, token_usage, breaks, ...)
    snapshots  the store as Parquet files at one instant (NodeSnapshot), and how another machine reads or pulls them
    writer     Store: the single writer of one file (writer thread, group commits, compactor)
    by_path    query() / query_dicts(): read a store by its path from any process (directly, or through its gateway)
    reading    StoreReader / SnapshotSource, the read interface everything above the store takes; ClosedStore
               (a file nobody writes), StorePath (a store by its path, from any process)
    union      UnionStore / write_catalog: several stores' snapshots read as one

Every name below is importable from `polar_mitm.store` as before the split.
"""

from polar_mitm.store import views
from polar_mitm.store.by_path import live_holder, query, query_dicts, recover
from polar_mitm.store.commit_log import commit_log_path
from polar_mitm.store.reading import (
    ClosedStore,
    ExchangeStore,
    SnapshotSource,
    StorePath,
    StoreReader,
    snapshot_closed_store,
)
from polar_mitm.store.records import (
    BODY_FIELDS,
    BODY_STRUCTURE,
    HEAD_FIELDS,
    HEAD_STRUCTURE,
    JOURNAL_ARROW_SCHEMA,
    JOURNAL_COLUMNS,
    JOURNAL_PREFIX,
    JOURNAL_SELECT,
    PROMPT_IDS_AT,
    journal_records,
    journal_source,
    journal_table,
)
from polar_mitm.store.schema import (
    COMPLETED_STATUSES,
    DOUBLE_LISTS,
    EXCHANGE_COLUMNS,
    EXCHANGES_DOC,
    JSON_COLUMNS,
    MATERIAL,
    SCHEMA_VERSION,
    SESSION_COLUMNS,
    TRAJECTORIES,
    TRAJECTORIES_SCHEMA,
    ExchangeRow,
    now,
)
from polar_mitm.store.segments import (
    MERGED_PREFIX,
    SEGMENT_PREFIX,
    SEGMENT_SELECT,
    SEGMENTS_TABLE,
    add_segment,
    connect,
    ensure_schema,
    exchanges_view_sql,
    merge_segments,
    segment_file,
    segment_table,
    segments_dir,
    write_parquet,
)
from polar_mitm.store.session_counts import SESSION_ARROW_SCHEMA
from polar_mitm.store.snapshots import NodeData, NodeSnapshot, pull_snapshot, read_range, snapshot_dir
from polar_mitm.store.sql_endpoint import READ_ONLY_STATEMENTS, check_read_only, control_file
from polar_mitm.store.union import UnionStore, write_catalog
from polar_mitm.store.writer import Store

__all__ = [
    "write_catalog",
    "UnionStore",
    "snapshot_dir",
    "read_range",
    "pull_snapshot",
    "NodeSnapshot",
    "NodeData",
    "snapshot_closed_store",
    "StoreReader",
    "StorePath",
    "ExchangeStore",
    "SnapshotSource",
    "ClosedStore",
    "BODY_FIELDS",
    "BODY_STRUCTURE",
    "COMPLETED_STATUSES",
    "DOUBLE_LISTS",
    "EXCHANGES_DOC",
    "EXCHANGE_COLUMNS",
    "HEAD_FIELDS",
    "HEAD_STRUCTURE",
    "JOURNAL_ARROW_SCHEMA",
    "JOURNAL_COLUMNS",
    "JOURNAL_PREFIX",
    "JOURNAL_SELECT",
    "JSON_COLUMNS",
    "MATERIAL",
    "PROMPT_IDS_AT",
    "READ_ONLY_STATEMENTS",
    "SCHEMA_VERSION",
    "SEGMENTS_TABLE",
    "SEGMENT_PREFIX",
    "MERGED_PREFIX",
    "merge_segments",
    "segment_table",
    "SEGMENT_SELECT",
    "SESSION_ARROW_SCHEMA",
    "SESSION_COLUMNS",
    "TRAJECTORIES",
    "TRAJECTORIES_SCHEMA",
    "ExchangeRow",
    "Store",
    "add_segment",
    "check_read_only",
    "connect",
    "control_file",
    "ensure_schema",
    "exchanges_view_sql",
    "journal_records",
    "commit_log_path",
    "recover",
    "journal_source",
    "journal_table",
    "live_holder",
    "now",
    "query",
    "query_dicts",
    "segment_file",
    "segments_dir",
    "views",
    "write_parquet",
]
