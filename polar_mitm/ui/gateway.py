"""/ui on `polar-mitm gateway`: the addon hands requests sent to the gateway itself under /ui to `answer_ui`, which
runs the dashboard's ASGI app in process (httpx's ASGITransport) over the gateway's own Store, no second server.

Served only while the gateway listens on loopback: the pages show prompts and replies, and a browser cannot send
the control token. A gateway that listens beyond loopback answers 403 and names `polar-mitm ui --db` instead.
With --web, each exchange links to its flow in mitmweb.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import httpx
from mitmproxy import ctx, http
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route

from polar_mitm.store import StoreReader
from polar_mitm.ui.app import MOUNT, create_ui_app
from polar_mitm.ui.source import ReaderSource

LOOPBACK = ("127.0.0.1", "localhost", "::1")
FORGET_AFTER_S = 1.0


class PolicyVersion(Protocol):
    policy_version: int


class UiHost(Protocol):
    """What the dashboard needs of the gateway's addon (polar_mitm.gateway.addon.PolarAddon)."""

    @property
    def store(self) -> StoreReader | None: ...

    @property
    def listen(self) -> tuple[str, int] | None: ...

    @property
    def control(self) -> PolicyVersion: ...


_app: tuple[StoreReader, Starlette] | None = None  # one app per open store (the store changes when polar_db does)


def _app_for(host: UiHost, store: StoreReader) -> Starlette:
    global _app
    if _app is None or _app[0] is not store:
        source = ReaderSource(store, Path(ctx.options.polar_db).resolve(), "live: this gateway's own store", mitmweb=_mitmweb_url,
                              policy_version=lambda: host.control.policy_version)

        async def home(request: Request) -> Response:
            return RedirectResponse(MOUNT + "/")

        _app = (store, Starlette(routes=[Route(MOUNT, home), Mount(MOUNT, create_ui_app(source))]))
    return _app[1]


def _mitmweb_url() -> str | None:
    """mitmweb's address when the gateway runs with --web (its options exist only then)."""
    port = getattr(ctx.options, "web_port", None)
    if not port:
        return None
    host = getattr(ctx.options, "web_host", "127.0.0.1") or "127.0.0.1"
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


async def answer_ui(flow: http.HTTPFlow, host: UiHost) -> None:
    """Answer one /ui request made to the gateway itself."""
    flow.metadata["polar_local"] = True
    if host.listen is None or host.listen[0] not in LOOPBACK:
        message = "the dashboard is served only by a gateway that listens on loopback; run `polar-mitm ui --db STORE` on this machine"
        flow.response = http.Response.make(403, message, {"content-type": "text/plain; charset=utf-8"})
        return
    if host.store is None:
        flow.response = http.Response.make(503, "the gateway's store is not open yet", {"content-type": "text/plain; charset=utf-8", "retry-after": "1"})
        return
    app = _app_for(host, host.store)
    headers = [(name, value) for name, value in flow.request.headers.items(multi=True) if name.lower() not in ("host", "proxy-authorization", "content-length")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        reply = await client.request(flow.request.method, flow.request.path, headers=headers, content=flow.request.get_content(strict=False) or b"")
    flow.response = http.Response.make(reply.status_code, reply.content, [(k.encode(), v.encode()) for k, v in reply.headers.multi_items()])
    _leave_out_of_mitmweb(flow)


def _leave_out_of_mitmweb(flow: http.HTTPFlow) -> None:
    """The dashboard refreshes itself every few seconds: with --web its own requests would fill mitmweb's flow list,
    so each leaves mitmweb's view once answered (a second later, when mitmproxy is done with it)."""
    view = ctx.master.addons.get("view")
    if view is None:
        return

    def forget() -> None:
        if view.get_by_id(flow.id) is not None:
            view.remove([flow])

    asyncio.get_running_loop().call_later(FORGET_AFTER_S, forget)
