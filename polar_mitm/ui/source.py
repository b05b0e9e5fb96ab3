"""Where the dashboard reads a store from, and what it can tell about the store before reading it.

A `UiSource` opens one `StoreView` per page: a `StoreReader` (the store's public read interface) plus what the
page says about it (where it lives, whether something writes it, the cluster's nodes). Sources:

    PathSource     `polar-mitm ui --db STORE`: any store by its path. A file nobody holds is opened read-only and
                   closed KEEP_OPEN_S after the last page (a gateway starting on it waits for readers that briefly); a
                   file a live gateway holds is read through that gateway's SQL endpoint (StorePath).
    ReaderSource   a reader this process already has: the gateway's own Store (`/ui` on `polar-mitm gateway`).
    RolloutSource  `/ui` on `rollout serve`: the local node's Store, or on Ray a union of every node's snapshot.

A store that cannot be read raises `StoreProblem`, which the app shows as a page (never a traceback).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import duckdb

from polar_mitm.store import ClosedStore, StorePath, StoreReader, live_holder
from polar_mitm.store.by_path import query as query_path

# how long a page waits for a store file another process has locked (a gateway starting, `assemble` writing)
LOCK_WAIT_S = 5.0
# a cluster's union is rebuilt from fresh node snapshots at most this often (each refresh pulls every node's files)
CLUSTER_REFRESH_S = 3.0
KEEP_OPEN_S = 2.0  # a closed store file stays open this long after the last page that read it
DUCKDB_MAGIC = b"DUCK"  # bytes 8-12 of every DuckDB database file


class StoreProblem(Exception):
    """The store cannot be shown: `title` and `detail` are the page; `retry` says whether waiting may help (the
    page then reloads itself); `status` is the HTTP status of that page."""

    def __init__(self, title: str, detail: str, *, retry: bool = False, status: int = 503):
        super().__init__(f"{title}: {detail}")
        self.title, self.detail, self.retry, self.status = title, detail, retry, status


@dataclass
class StoreView:
    """One page's view of a store: read through `reader`, closed by `close()` when the page is done."""

    reader: StoreReader
    db_path: Path  # what polar_mitm.debug.diff reads (it takes a path, readable from any process)
    label: str  # where the store is, for the header
    state: str  # one line: closed file, written by gateway pid N, this gateway's own store, a cluster union
    live: bool  # something writes it now: the pages refresh themselves
    mitmweb: str | None = None  # mitmweb's base URL, when a gateway with --web serves these flows
    policy_version: int | None = None  # the gateway's current policy version, when known (else the store's newest)
    nodes: list[dict[str, Any]] | None = None  # a cluster's nodes (GET /nodes), when the source is a cluster
    tokenizer: str | None = None  # a tokenizer directory given by the user (else the engine model's own)
    closer: Callable[[], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.closer is not None:
            self.closer()
            self.closer = None


@runtime_checkable
class UiSource(Protocol):
    """Opens the store for one page (raises StoreProblem when it cannot be read)."""

    async def open(self) -> StoreView: ...


class _PromptStorePath(StorePath):
    """StorePath that waits at most LOCK_WAIT_S for a locked file (a page then says so) instead of a minute."""

    def query(self, sql: str, params: list[Any] | None = None) -> tuple[list[str], list[list[Any]]]:
        try:
            return query_path(self.path, sql, params, timeout=LOCK_WAIT_S)
        except duckdb.IOException as error:
            raise StoreProblem("The store is busy", f"{self.path} is locked by another process that serves no SQL endpoint "
                               f"(a gateway starting, or `polar-mitm assemble` writing): {_first_line(error)}", retry=True) from error


def check_path(db: Path) -> None:
    """StoreProblem for a path that is no store at all: missing, a folder, not a DuckDB file."""
    if db.is_dir():
        raise StoreProblem("Not a store", f"{db} is a directory; give the store's .duckdb file (the gateway's --db)", status=404)
    if not db.exists():
        raise StoreProblem("No store here", f"there is no file at {db}. A gateway creates it on start "
                           f"(`polar-mitm gateway --db {db.name}`); this page looks again every few seconds.", retry=True, status=404)
    with db.open("rb") as handle:
        head = handle.read(12)
    if len(head) < 12 or head[8:12] != DUCKDB_MAGIC:
        raise StoreProblem("Not a store", f"{db} is not a DuckDB database file (a polar-mitm store is the gateway's --db file)", status=404)


class PathSource:
    """A store by its path, from this process (`polar-mitm ui --db`)."""

    def __init__(self, db: str | os.PathLike[str], tokenizer: str | None = None, mitmweb: str | None = None):
        self.db = Path(db).expanduser().resolve()
        self.tokenizer = tokenizer
        self.mitmweb = mitmweb.rstrip("/") if mitmweb else None
        # a closed file is opened once for the pages that come within KEEP_OPEN_S of each other (opening it costs
        # tens of ms), then closed: a gateway starting on it waits for readers only that long
        self._shared: ClosedStore | None = None
        self._users = 0
        self._idle: threading.Timer | None = None
        self._lock = threading.Lock()

    async def open(self) -> StoreView:
        return await asyncio.to_thread(self._open)

    def _open(self) -> StoreView:
        check_path(self.db)
        holder = live_holder(self.db)
        if holder is not None:
            return self._view(_PromptStorePath(self.db), f"live: gateway pid {holder.get('pid')} writes this store; read through its SQL endpoint", True)
        try:
            closed = self._closed_store()
        except duckdb.IOException as error:
            if "lock" not in str(error).lower():
                raise StoreProblem("Not a store", f"{self.db} cannot be opened: {_first_line(error)}", status=404) from error
            # a writer holds it: a gateway between opening the file and writing its control file, or another writer
            return self._view(_PromptStorePath(self.db), "live: another process holds this store", True)
        view = self._view(closed, "closed file: no process writes it", False)
        view.closer = self._release
        return view

    def _closed_store(self) -> ClosedStore:
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if self._shared is None:
                self._shared = ClosedStore(self.db)
            self._users += 1
            return self._shared

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._idle = threading.Timer(KEEP_OPEN_S, self._close_if_idle)
                self._idle.daemon = True
                self._idle.start()

    def _close_if_idle(self) -> None:
        with self._lock:
            if self._users == 0 and self._shared is not None:
                self._shared.close()
                self._shared = None

    def close(self) -> None:
        """Close the file now if no page is reading it (else when the last one is done, as usual)."""
        if self._idle is not None:
            self._idle.cancel()
        self._close_if_idle()

    def _view(self, reader: StoreReader, state: str, live: bool) -> StoreView:
        return StoreView(reader, self.db, str(self.db), state, live, mitmweb=self.mitmweb, tokenizer=self.tokenizer)


class ReaderSource:
    """A reader this process holds already (the gateway's own Store), shown as live."""

    def __init__(self, reader: StoreReader, db: Path, state: str, mitmweb: Callable[[], str | None] | None = None,
                 policy_version: Callable[[], int | None] | None = None, tokenizer: str | None = None):
        self.reader, self.db, self.state = reader, db, state
        self.mitmweb, self.policy_version, self.tokenizer = mitmweb, policy_version, tokenizer

    async def open(self) -> StoreView:
        return StoreView(
            self.reader, self.db, str(self.db), self.state, live=True, mitmweb=self.mitmweb() if self.mitmweb else None,
            policy_version=self.policy_version() if self.policy_version else None, tokenizer=self.tokenizer,
        )


# -- `rollout serve`: what its Backend (polar_mitm.rollout.backend) offers, typed by shape: the UI imports nothing
# of the rollout server
@runtime_checkable
class StoreNode(Protocol):
    """A local rollout server's gateway node (polar_mitm.rollout.node.GatewayNode): its Store, in this process."""

    @property
    def store(self) -> StoreReader: ...

    def health(self) -> dict[str, Any]: ...


@runtime_checkable
class CatalogSql(Protocol):
    """A Ray backend's SQL over every node (rollout.backend.SqlSource): a query refreshes the catalog file."""

    @property
    def catalog(self) -> Path: ...

    async def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]: ...


@runtime_checkable
class NodeFleet(Protocol):
    def status(self) -> dict[str, Any]: ...


class RolloutSource:
    """`/ui` on the rollout server, over its backend: the local node's own Store, or on Ray the catalog of every
    node's snapshot (refreshed at most every CLUSTER_REFRESH_S) with the fleet's nodes and engines."""

    def __init__(self, backend: object):
        self.backend = backend
        self._refreshed = 0.0
        self._refreshing = asyncio.Lock()

    async def open(self) -> StoreView:
        node = getattr(self.backend, "node", None)
        if isinstance(node, StoreNode):
            try:
                store = node.store
            except RuntimeError as error:  # its gateway has not opened the store yet
                raise StoreProblem("Starting", f"the rollout server's gateway node is starting ({error})", retry=True) from error
            db = Path(node.health()["db"])
            return StoreView(store, db, str(db), "live: this rollout server's gateway node writes this store", live=True)
        sql = getattr(self.backend, "sql", None)
        if isinstance(sql, CatalogSql):
            await self._refresh(sql)
            fleet = getattr(self.backend, "fleet", None)
            nodes = fleet.status().get("nodes", []) if isinstance(fleet, NodeFleet) else None
            state = f"live: a Ray cluster of {len(nodes or [])} node(s), read as one store from their snapshots"
            return StoreView(StorePath(sql.catalog), sql.catalog, str(sql.catalog), state, live=True, nodes=nodes)
        raise StoreProblem("No store", f"this server's backend ({type(self.backend).__name__}) has no store to show", status=404)

    async def _refresh(self, sql: CatalogSql) -> None:
        async with self._refreshing:
            if time.monotonic() - self._refreshed < CLUSTER_REFRESH_S and sql.catalog.exists():
                return
            try:
                await sql.query("SELECT 1")  # takes fresh node snapshots and rewrites the catalog over them
            except Exception as error:  # noqa: BLE001 - no node reachable yet: the page says so and looks again
                raise StoreProblem("No node store yet", f"the cluster's stores cannot be read now: {_first_line(error)}", retry=True) from error
            self._refreshed = time.monotonic()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
