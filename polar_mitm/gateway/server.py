"""Run mitmproxy in-process with the polar addon."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any, TextIO

from mitmproxy import master as mitmproxy_master
from mitmproxy import options
from mitmproxy.addons import (
    block,
    core,
    disable_h2c,
    dns_resolver,
    errorcheck,
    next_layer,
    proxyserver,
    tlsconfig,
)

from polar_mitm.gateway import options as gateway_options
from polar_mitm.gateway.addon import PolarAddon
from polar_mitm.gateway.config import GatewayConfig


def gateway_addons() -> list:
    """mitmproxy's addons that a gateway needs: the proxy itself, TLS interception, and its safety checks.

    The rest of mitmdump's 34 (flow rewriting, playback, cookies, export, ...) take options the gateway does not
    expose and cost every flow ~20 us each just to be asked; mitmweb (--web) keeps them all, for debugging.
    """
    return [core.Core(), block.Block(), disable_h2c.DisableH2C(), proxyserver.Proxyserver(), dns_resolver.DnsResolver(), next_layer.NextLayer(), tlsconfig.TlsConfig(), StartupCheck()]


class StartupCheck(errorcheck.ErrorCheck):
    """mitmproxy's startup check (exit 1 when an error was logged while starting), saying the cause in one line
    per error, with or without -v, instead of `Error logged during startup, exiting...`."""

    name = "errorcheck"  # the name mitmproxy's Master.run looks it up by

    async def shutdown_if_errored(self) -> None:
        await asyncio.sleep(0)  # let pending log records arrive, as mitmproxy's does
        if self.logger.has_errored:
            for record in self.logger.has_errored:
                print(f"polar-mitm gateway: {startup_message(record.getMessage())}", file=sys.stderr, flush=True)
            sys.exit(1)


def startup_message(message: str) -> str:
    """An error's cause in one line, without mitmproxy's hints for flags `polar-mitm gateway` does not take."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line.lstrip().startswith("Try specifying a different port")]
    if lines and lines[0].startswith("Addon error: "):
        lines = lines[:1]  # the traceback follows
    return " ".join(lines).removeprefix("Addon error: ")


class _NoModeHint(logging.Filter):
    """Drop mitmproxy's `--mode regular@PORT` hint from the port-in-use message (-v prints it too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "--mode " in record.msg:
            record.msg = startup_message(record.msg)
        return True


def make_master(config: GatewayConfig, start_line: TextIO | None = None, rollout_node: bool = False):
    """The gateway's mitmproxy master; `start_line`: where its 'listening on ...' line goes (default stdout);
    `rollout_node`: a rollout server's own gateway (left out of default discovery)."""
    opts = options.Options(listen_host=config.host, listen_port=config.port, confdir=str(Path(config.confdir).expanduser()))
    if config.web:
        from mitmproxy.tools.web.master import WebMaster

        master = WebMaster(opts, with_termlog=True)
        mitmweb_check = master.addons.get("errorcheck")
        mitmweb_check.finish()  # its log handler goes with it
        master.addons.remove(mitmweb_check)
        master.addons.add(StartupCheck())
    else:
        master = mitmproxy_master.Master(opts, with_termlog=config.verbose)
        master.addons.add(*gateway_addons())
    master.addons.add(PolarAddon(start_line, rollout_node))
    from polar_mitm.gateway import contentview

    contentview.register()
    updates = {
        **gateway_options.mitmproxy_updates(config),
        "connection_strategy": "lazy",
        # the body must reach our hook whole; never stream it past the addon
        "stream_large_bodies": None,
    }
    if config.transparent_port:
        # the regular mode keeps listen_host:listen_port; the transparent listener stays on loopback (capture.py DNATs
        # to it with route_localnet)
        updates["mode"] = ["regular", f"transparent@127.0.0.1:{config.transparent_port}"]
    if config.web:
        updates.update(web_open_browser=False, web_port=config.web_port, web_host="127.0.0.1")
    master.options.update(**updates)
    return master


def release_log_handlers(master: Any) -> None:
    """Take a master's log handlers off the root logger. mitmproxy does it in done(), which a master that exited
    while starting (a port in use) never reaches; left there, they would send every later log record of this
    process to the master's closed event loop (RuntimeError in the caller of `log.warning`)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "master", None) is master:
            root.removeHandler(handler)
    if check := master.addons.get("errorcheck"):
        check.finish()


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
    logging.getLogger("mitmproxy.addons.proxyserver").addFilter(_NoModeHint())
    asyncio.run(serve(config))
