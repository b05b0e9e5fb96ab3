"""What the rollout server's HTTP API (server.py) serves: a `Backend`.

Two implement it: `server.LocalBackend`, this machine's one gateway node (`polar-mitm rollout serve`), and
`polar_mitm.rollout.ray.RolloutCluster`, a gateway node on every Ray node (`rollout serve --ray`). The HTTP
module knows nothing else of either: tasks go to `scheduler`, `/control/*` to `control` (every gateway the backend
owns), `/nodes` to `fleet` and `/sql` to `sql` where the backend has them (None: the route answers 404 saying why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from polar_mitm.rollout.scheduler import Scheduler


class ControlCall(BaseModel):
    """One gateway control call (gateway/control.py), as the trainer sent it to the rollout server."""

    method: Literal["GET", "POST"]
    action: Literal["pause", "resume", "status"]
    body: str | None = Field(None, description="The JSON body, passed on unchanged (pause's mode, resume's policy_version).")
    authorization: str | None = Field(None, description="The caller's Authorization header, for gateways started with a control token.")


class GatewayReply(BaseModel):
    """One gateway's answer to a ControlCall: its HTTP status and JSON body (a ControlStatus, or its refusal)."""

    status: int
    body: dict[str, Any]


class Fleet(Protocol):
    """The gateway nodes of a backend that has several (`GET /nodes`, `DELETE /nodes/NAME`, engines in/out)."""

    def status(self) -> dict[str, Any]:
        """Every node (alive, draining, sessions by stage, engines) and the head's queue."""
        ...

    def drain(self, node: str, draining: bool = True) -> dict[str, Any]:
        """Send nothing new to `node` (draining=False: take it back); its status. KeyError: no such node."""
        ...

    async def set_engine_service(self, node: str, url: str, in_service: bool) -> list[dict[str, Any]]:
        """Take one of the node's engines out of service or put it back; the node's engines. KeyError: no such
        node; ValueError: the node refused (an unknown URL, a node with one engine)."""
        ...


class SqlSource(Protocol):
    """Read-only SQL over every store a backend owns (`GET /sql`)."""

    @property
    def catalog(self) -> Path:
        """A DuckDB file of views over those stores, for `polar-mitm sql --db`."""
        ...

    async def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """One read-only statement: (columns, rows). ValueError / DuckDB errors: the caller's statement."""
        ...


class Backend(Protocol):
    """The rollout server's backend. All methods run on the event loop that opened it.

    Contract: `open` starts it (idempotent; a backend that cannot start raises BackendStartError, one line, having
    left nothing behind); `close` stops it and its sessions. `control` sends the call to every gateway it owns, at
    once, and returns when each has answered (a pause(drain) answers once that gateway has nothing in flight):
    gateway name -> reply. `health()` includes `engine_reachable` (False: a gateway cannot reach its engine;
    None: not known yet)."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def fleet(self) -> Fleet | None: ...

    @property
    def sql(self) -> SqlSource | None: ...

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def health(self) -> dict[str, Any]: ...

    async def control(self, call: ControlCall) -> dict[str, GatewayReply]: ...
