"""A store laid out as schema 2 wrote it (its segments as Parquet files in `<db>.segments/`, listed in
`exchange_segments`, the `exchanges` view naming them relative to the store's folder), made from a closed store of
today's schema: what a user upgrading from that version has on disk."""

from __future__ import annotations

from pathlib import Path

from polar_mitm.store import EXCHANGE_COLUMNS, SEGMENTS_TABLE, connect, segment_table, segments_dir
from polar_mitm.store.schema import MARKS_TABLE, quote
from polar_mitm.store.segments import with_marks


def downgrade_to_schema_2(db: Path, drop_columns: tuple[str, ...] = ()) -> list[Path]:
    """Rewrite closed store `db` (no journals left: a Store closed cleanly) as schema 2; `drop_columns`: left out of
    the Parquet files, as a version from before them wrote them. Returns the segment files."""
    con = connect(db)  # the view binds its relative paths against the store's folder
    try:
        folder = segments_dir(db)
        folder.mkdir(exist_ok=True)
        kept = [name for name in EXCHANGE_COLUMNS if name not in drop_columns]
        files = []
        for number, file in con.execute(f"SELECT segment, file FROM {SEGMENTS_TABLE} ORDER BY segment").fetchall():
            path = folder / file
            con.execute(f"COPY (SELECT {', '.join(kept)} FROM {segment_table(number)}) TO {quote(str(path))} (FORMAT parquet)")
            con.execute(f"DROP TABLE {segment_table(number)}")
            files.append(path)
        con.execute("DROP VIEW IF EXISTS exchanges")
        for (view,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal AND schema_name = 'main'").fetchall():
            con.execute(f"DROP VIEW {view}")  # schema 2's views were made after its exchanges view; a writer remakes them
        relative = ", ".join(quote(f"{folder.name}/{path.name}") for path in files)
        select = ", ".join(name if name in kept else f"NULL AS {name}" for name in EXCHANGE_COLUMNS)
        con.execute(f"CREATE VIEW exchanges AS {with_marks(f'SELECT {select} FROM read_parquet([{relative}], union_by_name = true)', MARKS_TABLE)}")
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', '2')")
    finally:
        con.close()
    return files
