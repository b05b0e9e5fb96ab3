"""`polar-mitm demo`: the whole loop on embedded defaults, in one command.

Starts (or reuses) the local engine, starts a gateway, sends a streamed chat request through the proxy with
the official `openai` SDK (HTTPS_PROXY + the mitmproxy CA, no base-URL change), and prints the exchange that
was recorded in DuckDB, token ids included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="engine + gateway + one streamed SDK call, then show the stored exchange")
    parser.add_argument("--db", type=Path, default=Path("polar-demo.duckdb"), help="store to write (default polar-demo.duckdb)")
    parser.add_argument("--engine-url", help="use this engine instead of starting the local one")
    parser.add_argument("--prompt", default="Write one short sentence about the sea.")
    parser.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    engine_url = args.engine_url
    if not engine_url:
        from polar_mitm.local_engine import LocalEngine

        print("demo: starting the local engine (first run builds it; later runs reuse it)...", flush=True)
        engine = LocalEngine()
        engine_url = engine.start()
        try:
            return _demo_on(args, engine_url)
        finally:
            if note := engine.left_running():
                print(f"demo: {note}", file=sys.stderr)
    if problem := _engine_problem(engine_url):
        print(f"demo: no engine at --engine-url {engine_url} ({problem}); start one (`polar-mitm engine start`) or leave out --engine-url", file=sys.stderr)
        return 1
    return _demo_on(args, engine_url)


def _demo_on(args: argparse.Namespace, engine_url: str) -> int:
    import openai

    from polar_mitm import session, store
    from polar_mitm.debug.tables import format_table
    from polar_mitm.util import free_port

    # a private confdir: the demo's CA (its private key too) lives only as long as the demo
    confdir = Path(tempfile.mkdtemp(prefix="polar-demo-"))
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "polar_mitm.cli", "gateway", "--port", str(port), "--upstream", engine_url, "--db", str(args.db), "--confdir", str(confdir)],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (confdir / "mitmproxy-ca-cert.pem").exists() or not store.control_file(args.db).exists():
            if gateway.poll() is not None or time.monotonic() > deadline:
                print("demo: the gateway did not start", file=sys.stderr)
                return 1
            time.sleep(0.1)
        session_id = f"demo-{int(time.time())}"
        token = session.session_token(session.load_secret(confdir), session_id)
        os.environ["HTTPS_PROXY"] = f"http://{session_id}:{token}@127.0.0.1:{port}"
        os.environ["SSL_CERT_FILE"] = str(confdir / "mitmproxy-ca-cert.pem")
        os.environ.pop("OPENAI_BASE_URL", None)
        client = openai.OpenAI(api_key="sk-demo-not-a-real-key")
        print(f"demo: gpt-4o via https://api.openai.com (intercepted), session {session_id}")
        print("demo: streamed answer: ", end="", flush=True)
        try:
            for chunk in client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": args.prompt}], max_tokens=32, temperature=0, stream=True):
                for choice in chunk.choices:
                    print(choice.delta.content or "", end="", flush=True)
        except openai.APIError as error:
            print(f"\ndemo: the call failed: {' '.join(str(error).split())}", file=sys.stderr)
            return 1
        print()
        columns, rows = store.query(args.db, "SELECT session_id, seq, api, stream, status, model_requested, model_engine, finish_reason, prompt_token_ids, completion_token_ids, completion_logprobs FROM exchanges WHERE session_id = ?", [session_id])
        print(format_table(columns, rows, max_width=80))
        record = dict(zip(columns, rows[0], strict=True))
        print(json.dumps({"prompt_token_ids": record["prompt_token_ids"], "completion_token_ids": record["completion_token_ids"]}))
        print(f"demo: store at {args.db.resolve()}; try: polar-mitm sql --db {args.db.resolve()} session_timeline")
        return 0
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        shutil.rmtree(confdir, ignore_errors=True)


def _engine_problem(engine_url: str) -> str | None:
    """Why the engine at `engine_url` cannot serve the demo, or None when its /models answers."""
    import httpx

    try:
        response = httpx.get(engine_url.rstrip("/") + "/models", timeout=10)
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    if response.status_code != 200:
        return f"GET /models answered HTTP {response.status_code}; the URL is the engine's API root, e.g. http://127.0.0.1:8011/v1"
    return None
