"""A probe, not a feature: what the gateway costs without parts of its store, for bench/scale.py's floor runs.

Put this folder on a gateway's PYTHONPATH through `bench/scale.py --set` and pick what to take out by environment:

    FLOOR_NO_STORE=1     every exchange's commit returns at once: no record, no commit log, no compaction (nothing
                         is stored; the replies are what the gateway would send)
    FLOOR_NO_COMPACT=1   commits go to the commit log as usual, but no segment is ever due (the compactor idles)

e.g. `--set "gateway-chat-nostore=PYTHONPATH=bench/floor FLOOR_NO_STORE=1"`. Python imports the first `sitecustomize`
on its path at start, so this runs before the gateway does. bench/README.md, "What the gateway costs without its
store", has the runs and what they say about issue 29's CPU bound.
"""

import os

if os.environ.get("FLOOR_NO_STORE"):
    from polar_mitm.store import writer

    async def _no_commit(self: writer.Store, row: object) -> None:
        return None

    writer.Store.commit_exchange = _no_commit  # type: ignore[method-assign,assignment]

if os.environ.get("FLOOR_NO_COMPACT"):
    from polar_mitm.store import writer as _writer

    _init = _writer.Store.__init__

    def _never_due(self: _writer.Store, *args: object, **kwargs: object) -> None:
        kwargs.update(segment_rows=10**9, journal_mb=0)  # a segment is due at this many rows or MB (0: rows only)
        _init(self, *args, **kwargs)  # type: ignore[arg-type]

    _writer.Store.__init__ = _never_due  # type: ignore[method-assign]
