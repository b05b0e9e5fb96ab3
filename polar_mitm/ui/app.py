"""The dashboard's ASGI app: server-rendered pages (jinja2) and one small script for live updates and the token view.

    GET /                  Run: tasks and groups, sessions by status, policy versions, throughput, nodes, errors
    GET /session?id=S      Session: stage timeline, the conversation exchange by exchange, prompt diffs, sequences
    GET /sequence?id=Q     Trajectory: one assembled sequence token by token (&q= fills its search box)
    GET /static/...        ui.css, ui.js

Mounted at /ui everywhere (`polar-mitm ui`, `rollout serve`, `polar-mitm gateway`); links are relative to the
mount (the ASGI root_path). A page asked for with the header `X-Polar-Fragment: 1` answers only its <main>
content: how the script refreshes a live page in place. Every page reads through its source's StoreReader and
never writes. A store that cannot be read, a missing session or sequence, or a failing query is a page that
says so (the traceback goes to the server's log only).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from polar_mitm.ui import run_view, session_view, tokens
from polar_mitm.ui.reading import duration, when
from polar_mitm.ui.source import RolloutSource, StoreProblem, StoreView, UiSource

log = logging.getLogger("polar_mitm.ui")
HERE = Path(__file__).parent
MOUNT = "/ui"
REFRESH_S = 3  # how often a live page refreshes itself

_env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True, trim_blocks=True, lstrip_blocks=True)


def _number(value: Any) -> str:
    if value is None or isinstance(value, jinja2.Undefined):
        return ""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{int(value):,}"


def _fixed(value: Any, digits: int = 3) -> str:
    return "" if value is None or isinstance(value, jinja2.Undefined) else f"{float(value):.{digits}f}"


def text_of(content: Any) -> str:
    """A message's content as text: a string, or its parts' texts (other parts named)."""
    if content is None or isinstance(content, jinja2.Undefined):
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text") or f"[{p.get('type', 'part')}]" if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content, ensure_ascii=False)


def _pretty(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, indent=1, ensure_ascii=False)


def mitmweb_link(base: str | None, exchange_id: str) -> str | None:
    """mitmweb addresses one flow as #/flows/<flow id>/<tab>, and the store records no flow id; every flow the
    gateway answered carries its exchange id in the reply header x-polar-exchange-id, so the link is mitmweb's
    flow list filtered on that header (~hs): that one flow."""
    if not base:
        return None
    return f"{base}/#/flows?s={quote('~hs ' + exchange_id)}"


_env.filters.update(when=when, duration=duration, number=_number, fixed=_fixed, text=text_of, pretty=_pretty)
_env.globals.update(mitmweb_link=mitmweb_link, chart=run_view.chart, heat_legend=tokens.heat_legend)


def render(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    template = _env.get_template(name)
    context.update(base=request.scope.get("root_path", "").rstrip("/"), refresh_s=REFRESH_S, rendered_at=time.time())
    if request.headers.get("x-polar-fragment") and "main" in template.blocks:
        body = "".join(template.blocks["main"](template.new_context(context)))
    else:
        body = template.render(context)
    return HTMLResponse(body, status_code=status, headers={"cache-control": "no-store"})


def create_ui_app(source: UiSource) -> FastAPI:
    """The dashboard over `source`, to mount at /ui."""
    app = FastAPI(title="polar-mitm dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    async def page(request: Request, name: str, build: Callable[[StoreView], dict[str, Any]]) -> Response:
        started = time.perf_counter()
        try:
            view = await source.open()
        except StoreProblem as problem:
            return render(request, "problem.jinja", problem.status, problem=problem, view=None)
        try:
            context = await asyncio.to_thread(_build_and_close, build, view)
            response = await asyncio.to_thread(render, request, name, view=view, **context)  # a long sequence is MBs of HTML
        except StoreProblem as problem:
            return render(request, "problem.jinja", problem.status, problem=problem, view=view)
        except LookupError as error:
            return render(request, "problem.jinja", 404, problem=StoreProblem("Not found", str(error.args[0] if error.args else error), status=404), view=view)
        except Exception as error:  # noqa: BLE001 - a page, not a traceback; the log has it
            failed = _problem_of(error, view)
            return render(request, "problem.jinja", failed.status, problem=failed, view=view)
        response.headers["server-timing"] = f"page;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response

    @app.get("/", response_class=HTMLResponse)
    async def run(request: Request) -> Response:
        def build(view: StoreView) -> dict[str, Any]:
            found = run_view.run_page(view.reader, view.policy_version)
            tokens.warm_tokenizer(view.tokenizer, found.totals.get("model_engine"))  # for the pages a click away
            return {"run": found}

        return await page(request, "run.jinja", build)

    @app.get("/session", response_class=HTMLResponse)
    async def session(request: Request, id: str) -> Response:  # noqa: A002 - the URL's parameter
        def build(view: StoreView) -> dict[str, Any]:
            found = session_view.session_page(view.reader, view.db_path, id, view.tokenizer)
            if found is None:
                raise LookupError(f"this store has no session {id!r}")
            return {"s": found}

        return await page(request, "session.jinja", build)

    @app.get("/sequence", response_class=HTMLResponse)
    async def sequence(request: Request, id: str, q: str = "") -> Response:  # noqa: A002 - the URL's parameter
        return await page(request, "trajectory.jinja", lambda view: {"t": tokens.trajectory_page(view.reader, id, view.tokenizer), "query": q})

    return app


def _build_and_close(build: Callable[[StoreView], dict[str, Any]], view: StoreView) -> dict[str, Any]:
    try:
        return build(view)
    finally:
        view.close()


def _problem_of(error: Exception, view: StoreView) -> StoreProblem:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, duckdb.CatalogException) or "Catalog Error" in text:
        return StoreProblem("Not a polar-mitm store", f"{view.label} has no store tables ({text.splitlines()[0]})", status=404)
    log.exception(f"polar ui: a page failed on {view.label}")
    return StoreProblem("This page failed", text.splitlines()[0] if text else type(error).__name__, status=500)


def standalone_app(source: UiSource) -> Starlette:
    """`polar-mitm ui`: the dashboard at /ui, and / sends the browser there."""

    async def home(request: Request) -> Response:
        return RedirectResponse(MOUNT + "/")

    return Starlette(routes=[Route("/", home), Mount(MOUNT, create_ui_app(source))])


def rollout_dashboard(backend: object) -> FastAPI:
    """The dashboard for the rollout server, to mount at /ui, over its Backend (polar_mitm.rollout.backend)."""
    return create_ui_app(RolloutSource(backend))
