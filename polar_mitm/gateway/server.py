"""Run mitmproxy in-process with the polar addon."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from mitmproxy import options
from mitmproxy.tools.dump import DumpMaster

from polar_mitm.gateway.addon import PolarAddon
from polar_mitm.gateway.config import GatewayConfig


def make_master(config: GatewayConfig):
    opts = options.Options(listen_host=config.host, listen_port=config.port, confdir=str(Path(config.confdir).expanduser()))
    if config.web:
        from mitmproxy.tools.web.master import WebMaster

        master = WebMaster(opts, with_termlog=True)
    else:
        master = DumpMaster(opts, with_termlog=config.verbose, with_dumper=False)
    master.addons.add(PolarAddon())
    from polar_mitm.gateway import contentview

    contentview.register()
    updates = {
        "connection_strategy": "lazy",
        "polar_upstream": config.upstream,
        "polar_db": str(config.db),
        "polar_engine": config.engine,
        "polar_engine_model": config.engine_model or "",
        "polar_engine_timeout": config.engine_timeout,
        "polar_split_reasoning": config.split_reasoning,
        "polar_model_map": list(config.model_map),
        "polar_require_auth": config.require_auth,
        "polar_passthrough": list(config.passthrough),
        "polar_sql_port": config.sql_port,
        "polar_engine_hook": config.engine_hook,
        # the body must reach our hook whole; never stream it past the addon
        "stream_large_bodies": None,
    }
    if config.web:
        updates.update(web_open_browser=False, web_port=config.web_port, web_host="127.0.0.1")
    master.options.update(**updates)
    return master


async def serve(config: GatewayConfig) -> None:
    master = make_master(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)
    await master.run()


def run(config: GatewayConfig) -> None:
    # mitmproxy's termlog prints Python logging at info (as mitmproxy's own main sets it up): the proxy address,
    # and with --web the UI's URL with its access token; per-request httpx lines are noise
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("tornado").setLevel(logging.WARNING)
    asyncio.run(serve(config))
