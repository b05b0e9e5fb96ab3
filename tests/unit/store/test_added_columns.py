"""A store whose segments were all written before a column was added still opens, reading it as NULL (the
`exchanges` view named every contract column, so a column no segment had made the view fail to build), by a
writer, a read-only reader and a head's union of node snapshots. A real DuckDB store."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from polar_mitm.store import Store

SELECT = "SELECT exchange_id, bridge_key, prompt_token_ids FROM exchanges ORDER BY seq"


def test_segments_without_a_later_column_read_it_as_null(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    writer = Store(db)

    async def commit() -> None:
        for seq in range(3):
            await writer.commit_exchange({"exchange_id": f"e{seq}", "session_id": "s", "seq": seq, "status": "ok", "bridge_key": f"k{seq}", "prompt_token_ids": [1, 2, seq]})

    asyncio.run(commit())
    assert writer.query(SELECT)[1] == [(f"e{seq}", f"k{seq}", [1, 2, seq]) for seq in range(3)]
    writer.close()  # every journal becomes a segment
    files = sorted((tmp_path / "old.duckdb.segments").glob("*.parquet"))
    assert files
    for file in files:  # as a version before `bridge_key` wrote them
        pq.write_table(pq.read_table(file).drop_columns(["bridge_key"]), file)
    # a later process (this one has seen the files with the column): a writer re-points the view at open, then a
    # read-only reader and a head's union of the node's snapshot read it
    script = f"""
import json
from pathlib import Path
from polar_mitm.store import Store
from polar_mitm.store.reading import ClosedStore
from polar_mitm.store.union import UnionStore
db = Path({str(db)!r})
reopened = Store(db)
try:
    answers = [reopened.query({SELECT!r})[1]]
    snapshot = reopened.snapshot("n0", db.parent / "snapshots")
finally:
    reopened.close()
with ClosedStore(db) as closed:
    answers.append(closed.query({SELECT!r})[1])
with UnionStore([snapshot]) as union:
    answers.append(union.query({SELECT!r})[1])
print(json.dumps([[list(row) for row in rows] for rows in answers]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    old = [[f"e{seq}", None, [1, 2, seq]] for seq in range(3)]
    assert json.loads(done.stdout) == [old, old, old]
