"""One gateway node at scale, beside plain mitmproxy in the same run: `python bench/scale.py [--quick]`.

Issue 29's bench. At each level (64, 256 and 1,000 concurrent sessions; `--quick`: 16 and 64) every session is a
harness's conversation: a ~20 KB first request (system prompt, tool list, task), then `--turns` turns whose history
grows as a harness's does (each turn adds the model's reply, its text and tool call echoed as the engine gave them,
and that call's ~3 KB output), one request at a time on its own keep-alive connection. Sessions cycle over the four
APIs (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages, Gemini) and half of them stream; they start
spread over `--ramp-s` rather than in one instant.

What answers: the soak's stand-in engine (bench/soak_engine.py, a fake, named as such), after `--engine-delay-s`
(seconds, as a busy GPU engine does, not milliseconds). Measured side by side, one proxy at a time per level:

    mitmproxy      plain `mitmdump` in reverse mode, TLS from the client, the same conversations as OpenAI Chat
                   Completions requests of the same size (plain mitmproxy cannot translate the other three APIs for
                   an OpenAI-shaped engine: it relays bytes); streamed ones get the engine's own stream
    gateway-chat   `polar-mitm gateway`, the harness's way in (CONNECT to the provider's host with the session's
                   proxy credentials, TLS with the gateway's CA), chat mode, keepalives on streamed replies
    gateway-tokens the same in tokens mode (--render tokens), where the local engine's model directory exists

Figures per proxy and level: exchanges/s, added latency p50/p99 (a reply's latency minus the engine's delay),
CPU per exchange (the proxy process's user + system time over the level / its exchanges), peak and end RSS, the
most client connections open at once, and errors by class. Each proxy process lives through all levels, as a node
does. The file-descriptor limit is raised to its hard limit first, and said. Results: bench/scale_results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shlex
import shutil
import ssl
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# `python bench/scale.py` (from any directory) puts bench/ first on sys.path; its modules are the package `bench`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import Conn, Target  # noqa: E402
from bench.common import ROOT, Service, check_alive, flags_and_env, free_port, percentile, raise_fd_limit, stop_all  # noqa: E402
from bench.report import machine  # noqa: E402
from bench.soak_client import API_KEYS, APIS, HOSTS, complete_success, read_body, read_head  # noqa: E402
from bench.stub_upstream import CONTENT, TOOL_ARGUMENTS, TOOL_NAME  # noqa: E402
from polar_mitm import session as sessions  # noqa: E402
from polar_mitm.local_engine import build  # noqa: E402

LEVELS = (64, 256, 1000)
QUICK_LEVELS = (16, 64)
SYSTEM_KB, TOOL_RESULT_KB = 16, 3
PATHS = {
    "openai_chat": "/v1/chat/completions", "openai_responses": "/v1/responses", "anthropic_messages": "/v1/messages",
    "gemini": "/v1beta/models/gemini-2.5-flash:{method}",
}
# the first of them is the one the stand-in's reply calls (bench/stub_upstream.py: its text, then one tool call)
TOOLS = [{"name": TOOL_NAME if i == 0 else f"tool_{i}", "description": "Run a shell command in the workspace. " * 6,
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}} for i in range(12)]


def filler(kb: int, seed: str) -> str:
    """kb x 1,000 characters of code-ish words."""
    words = random.Random(seed).choices(["file", "src", "test", "def", "return", "import", "class", "the", "value", "path"], k=kb * 250)
    return " ".join(words)[: kb * 1000]


def conversation(session: int, turns: int) -> tuple[str, list[str]]:
    """The system prompt and what the harness sends on each of `turns` turns: the task, then the output of the
    tool the model called on the turn before."""
    system = filler(SYSTEM_KB, f"system-{session % 7}")
    sent = [f"Task {session}: list the repository layout and fix the failing test." if turn == 0 else f"Tool output {turn}:\n" + filler(TOOL_RESULT_KB, f"{session}-{turn}") for turn in range(turns)]
    return system, sent


def body_for(api: str, stream: bool, system: str, sent: list[str]) -> dict[str, Any]:
    """The request of the last turn in `sent`, in `api`'s own shape. Each earlier turn's reply is in the history
    as the stand-in gave it (its text and its tool call), followed by that call's output, as a harness sends
    them back: so the gateway's tokens mode finds each turn's parent, as it does with real harnesses."""
    task, outputs = sent[0], sent[1:]
    arguments = json.loads(TOOL_ARGUMENTS)
    if api == "openai_chat":
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        for turn, output in enumerate(outputs):
            call = {"id": f"call_{turn}", "type": "function", "function": {"name": TOOL_NAME, "arguments": TOOL_ARGUMENTS}}
            messages += [{"role": "assistant", "content": CONTENT, "tool_calls": [call]}, {"role": "tool", "tool_call_id": f"call_{turn}", "content": output}]
        tools = [{"type": "function", "function": tool} for tool in TOOLS]
        return {"model": "gpt-4o-mini", "messages": messages, "tools": tools, "stream": stream}
    if api == "openai_responses":
        items: list[dict[str, Any]] = [{"role": "user", "content": task}]
        for turn, output in enumerate(outputs):
            items += [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": CONTENT}]},
                {"type": "function_call", "call_id": f"call_{turn}", "name": TOOL_NAME, "arguments": TOOL_ARGUMENTS},
                {"type": "function_call_output", "call_id": f"call_{turn}", "output": output},
            ]
        tools = [{"type": "function", **tool} for tool in TOOLS]
        return {"model": "gpt-4o-mini", "instructions": system, "input": items, "tools": tools, "stream": stream}
    if api == "anthropic_messages":
        messages = [{"role": "user", "content": task}]
        for turn, output in enumerate(outputs):
            messages += [
                {"role": "assistant", "content": [{"type": "text", "text": CONTENT}, {"type": "tool_use", "id": f"toolu_{turn}", "name": TOOL_NAME, "input": arguments}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": output}]},
            ]
        tools = [{"name": tool["name"], "description": tool["description"], "input_schema": tool["parameters"]} for tool in TOOLS]
        return {"model": "claude-sonnet-4-5", "max_tokens": 4096, "system": system, "messages": messages, "tools": tools, "stream": stream}
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": task}]}]
    for output in outputs:
        contents += [
            {"role": "model", "parts": [{"text": CONTENT}, {"functionCall": {"name": TOOL_NAME, "args": arguments}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": TOOL_NAME, "response": {"output": output}}}]},
        ]
    return {"systemInstruction": {"parts": [{"text": system}]}, "contents": contents, "tools": [{"functionDeclarations": TOOLS}]}


def raw_request(api: str, stream: bool, body: dict[str, Any], plain_chat: bool) -> tuple[str, bytes]:
    """(host, the whole HTTP/1.1 request)."""
    if plain_chat:
        host, path, (key_header, key) = "api.openai.com", PATHS["openai_chat"], API_KEYS["openai_chat"]
    else:
        host, path, (key_header, key) = HOSTS[api], PATHS[api], API_KEYS[api]
        if api == "gemini":
            path = path.format(method="streamGenerateContent?alt=sse" if stream else "generateContent")
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\nuser-agent: polar-scale/1\r\n{key_header}: {key}\r\n"
            f"anthropic-version: 2023-06-01\r\ncontent-length: {len(payload)}\r\n\r\n")
    return host, head.encode() + payload


@dataclass
class Level:
    proxy: str
    sessions: int
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    rss: list[float] = field(default_factory=list)
    connections: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    proxy_cpu_s: float = 0.0  # the proxy's own process, without its children (a store process: --store-process)


async def one_session(target: Target, index: int, api: str, stream: bool, turns: int, plain_chat: bool, ramp_s: float, level: Level, open_now: list[int]) -> None:
    await asyncio.sleep(random.Random(index).random() * ramp_s)
    system, sent = conversation(index, turns)
    conn: Conn | None = None
    try:
        for turn in range(1, turns + 1):
            body = body_for("openai_chat" if plain_chat else api, stream, system, sent[:turn])
            host, raw = raw_request(api, stream, body, plain_chat)
            try:
                if conn is None:
                    conn = await target.connect(host, index)
                    open_now[0] += 1
                    level.connections = max(level.connections, open_now[0])
                started = time.perf_counter()
                conn.writer.write(raw)
                status, headers = await asyncio.wait_for(read_head(conn.reader), 120)
                reply, keep = await asyncio.wait_for(read_body(conn.reader, headers), 120)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError, TimeoutError, ConnectionError, ValueError) as error:
                level.errors[type(error).__name__] += 1
                return
            if not complete_success("openai_chat" if plain_chat else api, stream, status, reply):
                level.errors[f"HTTP {status}" + (" incomplete stream" if status == 200 else "")] += 1
                return
            level.latencies.append(time.perf_counter() - started)
            if not keep:
                conn.close()
                conn, open_now[0] = None, open_now[0] - 1
    finally:
        if conn is not None:
            conn.close()
            open_now[0] -= 1


async def run_level(name: str, service: Service, target: Target, n: int, turns: int, ramp_s: float, plain_chat: bool) -> Level:
    level = Level(name, n)
    open_now = [0]
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            level.rss.append(service.rss_mb())
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    cpu0, own0, t0 = service.cpu_s(), service.own_cpu_s(), time.perf_counter()
    await asyncio.gather(*(one_session(target, i, APIS[i % len(APIS)], (i // len(APIS)) % 2 == 1, turns, plain_chat, ramp_s, level, open_now) for i in range(n)))
    level.wall_s, level.cpu_s, level.proxy_cpu_s = time.perf_counter() - t0, service.cpu_s() - cpu0, service.own_cpu_s() - own0
    done.set()
    await sampler
    level.rss.append(service.rss_mb())
    return level


def figures(level: Level, delay_s: float) -> dict[str, Any]:
    added = [latency - delay_s for latency in level.latencies]
    exchanges = len(level.latencies)
    return {
        "proxy": level.proxy, "sessions": level.sessions, "exchanges": exchanges, "exchanges_per_s": round(exchanges / level.wall_s, 1) if level.wall_s else 0,
        "added_p50_s": round(percentile(added, 50), 3), "added_p99_s": round(percentile(added, 99), 3),
        "cpu_ms_per_exchange": round(1000 * level.cpu_s / exchanges, 2) if exchanges else None,
        "proxy_process_cpu_ms_per_exchange": round(1000 * level.proxy_cpu_s / exchanges, 2) if exchanges else None,
        "rss_peak_mb": round(max(level.rss)), "rss_end_mb": round(level.rss[-1]), "connections_max": level.connections,
        "errors": sum(level.errors.values()), "error_classes": dict(level.errors), "wall_s": round(level.wall_s, 1),
    }


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Scale bench (`python bench/scale.py{' --quick' if results['quick'] else ''}`), {results['when']}, {results['machine']}. "
        f"{results['turns']} turns per session, engine delay {results['engine_delay_s']} s, ramp {results['ramp_s']} s, "
        f"file-descriptor limit {results['fd_limit']}.",
        "",
        "| sessions | proxy | exchanges | exchanges/s | added p50 / p99 (s) | CPU per exchange (ms) | ratio to mitmproxy | RSS peak / end (MB) | connections | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    floor = {row["sessions"]: row for row in results["rows"] if row["proxy"] == "mitmproxy"}
    for row in results["rows"]:
        base = floor.get(row["sessions"])
        ratio = f"{row['cpu_ms_per_exchange'] / base['cpu_ms_per_exchange']:.2f}x" if base and row["cpu_ms_per_exchange"] and base["cpu_ms_per_exchange"] else ""
        errors = f"{row['errors']} ({', '.join(f'{k}: {v}' for k, v in row['error_classes'].items())})" if row["errors"] else "0"
        lines.append(f"| {row['sessions']} | {row['proxy']} | {row['exchanges']} | {row['exchanges_per_s']} | {row['added_p50_s']} / {row['added_p99_s']} | "
                     f"{row['cpu_ms_per_exchange']} | {ratio if row['proxy'] != 'mitmproxy' else ''} | {row['rss_peak_mb']} / {row['rss_end_mb']} | {row['connections_max']} | {errors} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="polar-mitm at scale beside plain mitmproxy (see bench/scale.py's docstring)")
    parser.add_argument("--quick", action="store_true", help="levels 16 and 64, 4 turns")
    parser.add_argument("--levels", help="comma-separated session counts (default 64,256,1000)")
    parser.add_argument("--turns", type=int, help="turns per session (default 10; quick 4)")
    parser.add_argument("--engine-delay-s", type=float, default=2.0)
    parser.add_argument("--ramp-s", type=float, default=5.0, help="sessions start spread over this many seconds")
    parser.add_argument("--proxies", default="mitmproxy,gateway-chat,gateway-tokens")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=FLAGS",
                        help="a gateway variant to run beside the others: NAME starts with gateway-chat or gateway-tokens (its render mode), "
                             "FLAGS are added to its command line, e.g. --set gateway-chat-sp=--store-process --proxies mitmproxy,gateway-chat,gateway-chat-sp; "
                             "VAR=VALUE among them is that gateway's environment (PYTHONPATH=DIR: another source tree's polar_mitm)")
    parser.add_argument("--out", type=Path, help="write JSON here and markdown beside it (.md)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores); kept anyway when a level had errors")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")] if args.levels else list(QUICK_LEVELS if args.quick else LEVELS)
    turns = args.turns or (4 if args.quick else 10)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fd_limit = raise_fd_limit()  # inherited by every proxy: 1,000 sessions hold ~2,000 sockets
    tmp = Path(tempfile.mkdtemp(prefix="polar-scale-"))
    confdir = tmp / "confdir"
    model_dir = build.model_dir(build.engine_home(), build.DEFAULT_MODEL)
    has_model = (model_dir / "tokenizer.json").exists()
    python = sys.executable
    services: dict[str, Service] = {}
    rows: list[dict[str, Any]] = []
    print(f"scale: levels {levels}, {turns} turns, engine delay {args.engine_delay_s}s, fd limit {soft} -> {fd_limit} (logs in {tmp})", flush=True)
    try:
        engine_port = free_port()
        services["engine"] = Service("engine", engine_port, [python, "-m", "bench.soak_engine", "--port", str(engine_port), "--delay-ms", str(args.engine_delay_s * 1000),
                                                             *(["--model-dir", str(model_dir)] if has_model else [])], tmp / "engine.log", cwd=ROOT).start()
        services["engine"].wait(60)
        upstream = f"http://127.0.0.1:{engine_port}/v1"
        wanted = args.proxies.split(",")
        variants = dict(item.split("=", 1) for item in args.set)
        for name in wanted:
            if name != "mitmproxy" and not name.startswith(("gateway-chat", "gateway-tokens")):
                parser.error(f"--proxies {name}: a gateway's name starts with gateway-chat or gateway-tokens")
        for name in wanted:
            port = free_port()
            if name == "mitmproxy":
                mitmdump = Path(python).parent / "mitmdump"
                services[name] = Service(name, port, [str(mitmdump), "--mode", f"reverse:{upstream.removesuffix('/v1')}@{port}", "--set", f"confdir={confdir}", "-q"], tmp / f"{name}.log").start()
                continue
            tokens = name.startswith("gateway-tokens")
            if tokens and not has_model:
                print(f"  {name}: skipped, no model at {model_dir} (polar-mitm engine start builds it)", flush=True)
                continue
            render = ["--render", "tokens", "--render-model", str(model_dir)] if tokens else ["--render", "chat"]
            flags, env = flags_and_env(shlex.split(variants.get(name, "")))
            render += flags
            db = tmp / f"{name}.duckdb"
            services[name] = Service(name, port, [python, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", upstream, "--db", str(db), "--confdir", str(confdir),
                                                  "--require-auth", "--keepalive-interval", "0.5", *render], tmp / f"{name}.log", env=env,
                                     cwd=Path(env["PYTHONPATH"]) if "PYTHONPATH" in env else None).start()  # `python -m` puts its working directory first on sys.path
            services[name].wait(120, ready=lambda db=db: (confdir / "mitmproxy-ca-cert.pem").exists() and Path(str(db) + ".control.json").exists())
        for name in wanted:
            if name in services:
                services[name].wait(60)
        context = ssl.create_default_context(cafile=str(confdir / "mitmproxy-ca-cert.pem"))
        secret = sessions.load_secret(confdir)

        def target_for(name: str, n: int) -> Target:
            def credentials(index: int) -> tuple[str, str]:
                user = f"scale-{name}-{n}-{index:04d}"
                return user, sessions.session_token(secret, user)

            return Target(name, services[name].port, "tls" if name == "mitmproxy" else "connect", context, credentials=credentials)

        running = [name for name in wanted if name in services]
        for name in running:  # a first call of each API pays one-time costs (imports, the template): not measured
            warm = asyncio.run(run_level(name, services[name], target_for(name, 0), len(APIS) * 2, 1, 0.0, plain_chat=name == "mitmproxy"))
            if warm.errors:
                raise RuntimeError(f"{name}: the warm-up failed: {dict(warm.errors)}; log {services[name].log}")
        for n in levels:
            for name in running:
                level = asyncio.run(run_level(name, services[name], target_for(name, n), n, turns, args.ramp_s, plain_chat=name == "mitmproxy"))
                check_alive(services)
                row = figures(level, args.engine_delay_s)
                rows.append(row)
                print(f"  {n:>5} {name:<15} {row['exchanges']:>6} exchanges {row['exchanges_per_s']:>6}/s  added p50 {row['added_p50_s']}s p99 {row['added_p99_s']}s  "
                      f"CPU {row['cpu_ms_per_exchange']} ms/exchange ({row['proxy_process_cpu_ms_per_exchange']} in the proxy's process)  RSS {row['rss_peak_mb']}/{row['rss_end_mb']} MB  conns {row['connections_max']}  errors {row['errors']} {row['error_classes'] or ''}", flush=True)
    finally:
        stop_all(services)
    info = machine()
    results = {"when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": f"{info['cpu']}, {info['cores']} cores, {info['memory_gb']:.0f} GB, commit {info['commit']}",
               "quick": args.quick, "turns": turns, "engine_delay_s": args.engine_delay_s, "ramp_s": args.ramp_s, "fd_limit": fd_limit, "rows": rows}
    report = markdown(results)
    print()
    print(report)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
        args.out.with_suffix(".md").write_text(report)
    bad = [row for row in rows if row["errors"]]
    if bad or args.keep:
        print(f"logs and stores kept in {tmp}", flush=True)  # what the errors were is in the gateways' logs
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
