"""A byte relay between a TCP port and a unix socket: how a container with no network reaches the gateway.

    host:       gateway 127.0.0.1:P  <-  unix socket S   (the node: `serve_unix_to_tcp(S, "127.0.0.1", P)`)
    container:  127.0.0.1:3128       ->  unix socket S   (bind-mounted; `python3 relay.py tcp-to-unix S 3128`)

The container's HTTPS_PROXY points at its own loopback port; the socket is its only way out, and it ends at
the gateway, which answers model calls and nothing else. Standard library only: this file is also run by
the container's python3 as a script.
"""

from __future__ import annotations

import asyncio
import sys

CHUNK = 1 << 16
READY = "polar-mitm relay ready"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass


async def _splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connect) -> None:
    try:
        upstream_reader, upstream_writer = await connect()
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
    finally:
        writer.close()
        upstream_writer.close()


async def serve_unix_to_tcp(socket_path: str, host: str, port: int) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(lambda r, w: _splice(r, w, lambda: asyncio.open_connection(host, port)), socket_path)


async def serve_tcp_to_unix(port: int, socket_path: str) -> asyncio.AbstractServer:
    return await asyncio.start_server(lambda r, w: _splice(r, w, lambda: asyncio.open_unix_connection(socket_path)), "127.0.0.1", port)


async def _main(argv: list[str]) -> None:
    mode, socket_path, port = argv[0], argv[1], int(argv[2])
    if mode != "tcp-to-unix":
        raise SystemExit(f"usage: relay.py tcp-to-unix SOCKET PORT (got {mode!r})")
    server = await serve_tcp_to_unix(port, socket_path)
    print(READY, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1:]))
