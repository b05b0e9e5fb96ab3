"""Run mitmproxy in-process with the polar addon."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from mitmproxy import master as mitmproxy_master
from mitmproxy import options
from mitmproxy.addons import block, core, disable_h2c, dns_resolver, errorcheck, next_layer, proxyserver, tlsconfig

from polar_mitm.gateway import options as gateway_options
from polar_mitm.gateway.addon import PolarAddon
from polar_mitm.gateway.config import GatewayConfig


def gateway_addons() -> list:
    """mitmproxy's addons that a gateway needs: the proxy itself, TLS interception, and its safety checks.

    The rest of mitmdump's 34 (flow rewriting, playback, cookies, export, ...) take options the gateway does not
    expose and cost every flow ~20 us each just to be asked; mitmweb (--web) keeps them all, for debugging.
    """
    return [core.Core(), block.Block(), disable_h2c.DisableH2C(), proxyserver.Proxyserver(), dns_resolver.DnsResolver(), next_layer.NextLayer(), tlsconfig.TlsConfig(), errorcheck.ErrorCheck()]


def make_master(config: GatewayConfig):
    opts = options.Options(listen_host=config.host, listen_port=config.port, confdir=str(Path(config.confdir).expanduser()))
    if config.web:
        from mitmproxy.tools.web.master import WebMaster

        master = WebMaster(opts, with_termlog=True)
    else:
        master = mitmproxy_master.Master(opts, with_termlog=config.verbose)
        master.addons.add(*gateway_addons())
    master.addons.add(PolarAddon())
    from polar_mitm.gateway import contentview

    contentview.register()
    updates = {
        **gateway_options.mitmproxy_updates(config),
        "connection_strategy": "lazy",
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
