"""The DuckDB store alone: `polar_mitm.store.Store` committing 4k-token rows from 64 sessions while another process
runs live SQL through `store.query`.

`measure_ingest` runs the two sides as processes of their own (the writer is a process like the gateway; the reader
is a researcher's session; and a --baseline source tree's polar_mitm is imported cleanly in each), through this
module's two subcommands, which print one JSON line each:

    python -m bench.ingest write DB SECONDS [--source DIR]   # commit rows for SECONDS; prints {"rate": ...}
    python -m bench.ingest query DB SECONDS [--source DIR]   # live SQL on DB for SECONDS; prints {probe: {"p50": ...}}

from the repository root (`measure_ingest` runs them so); DIR: the polar_mitm source tree to import (default: this one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, STUB_MODEL, Plan, load_requests, percentile


def measure_ingest(tmp: Path, plan: Plan, source: Path = ROOT) -> dict[str, Any]:
    """Store ingest with live SQL beside it; `source`: the polar_mitm source tree whose Store is measured."""
    db = tmp / f"ingest-{abs(hash(source))}.duckdb"
    write_log = db.with_suffix(".write.log")
    with write_log.open("wb") as log:
        ingest = subprocess.Popen(_subcommand("write", db, plan.ingest_seconds, source), stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (Path(str(db) + ".control.json").exists() or time.monotonic() > deadline or ingest.poll() is not None):
        time.sleep(0.1)
    probe = subprocess.run(_subcommand("query", db, plan.ingest_seconds - 1, source), capture_output=True, cwd=ROOT)
    out, _ = ingest.communicate(timeout=plan.ingest_seconds + 120)
    result = _last_json_line("write", ingest.returncode, out, write_log.read_bytes())
    result["sql"] = _last_json_line("query", probe.returncode, probe.stdout, probe.stderr)
    print(f"  DuckDB ingest: {result['rate']:.0f} exchanges/s; live SQL p50 " + ", ".join(f"{q['p50'] * 1000:.0f} ms" for q in result["sql"].values()), flush=True)
    return result


def _last_json_line(side: str, returncode: int, stdout: bytes, stderr: bytes) -> dict[str, Any]:
    """What a subcommand printed last, or an error that shows why it printed nothing."""
    lines = stdout.decode().strip().splitlines()
    if returncode != 0 or not lines:
        raise RuntimeError(f"`python -m bench.ingest {side}` exited with {returncode}:\n{stderr.decode(errors='replace')[-3000:]}")
    return json.loads(lines[-1])


def _subcommand(name: str, db: Path, seconds: float, source: Path) -> list[str]:
    return [sys.executable, "-m", "bench.ingest", name, str(db), str(seconds), "--source", str(source)]


def write(db: str, seconds: float) -> None:
    """Commit exchanges with 4k-token arrays through Store, as the gateway does, 64 in flight; prints the rate."""
    from polar_mitm.store import Store, now

    spec = load_requests()[0]
    rng = random.Random(1)
    tokens = 4096
    prompt_ids = [rng.randrange(151000) for _ in range(tokens)]
    completion_ids = [rng.randrange(151000) for _ in range(tokens)]
    logprobs = [round(-rng.random() * 3, 6) for _ in range(tokens)]
    engine_request = {**spec["body"], "model": STUB_MODEL, "stream": False, "logprobs": True, "top_logprobs": 0, "return_token_ids": True}
    engine_response = {
        "id": "chatcmpl-ingest",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 2000}, "finish_reason": "length", "token_ids": completion_ids,
                     "logprobs": {"content": [{"token": "tok", "logprob": lp, "bytes": [116, 111, 107], "top_logprobs": []} for lp in logprobs]}}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": tokens, "total_tokens": 2 * tokens},
        "prompt_token_ids": prompt_ids,
    }
    request_body = json.dumps(spec["body"])
    # the gateway records the engine request and reply as the texts that crossed the wire
    engine_request_text = json.dumps(engine_request, separators=(",", ":"))
    engine_response_text = json.dumps(engine_response, separators=(",", ":"))
    try:  # what the gateway hands the store: the engine's request and reply as WireJSON (text + parsed value)
        from polar_mitm.engines.base import WireJSON, _decode
        from polar_mitm.store import journal_records  # noqa: F401 - present since the journal store
    except ImportError:  # an older tree (--baseline): its gateway handed over the texts
        engine_request_wire, engine_response_wire = engine_request_text, engine_response_text
    else:
        engine_request_wire, engine_response_wire = WireJSON(engine_request, engine_request_text), _decode(engine_response_text)
        prompt_ids = engine_response_wire["prompt_token_ids"]
    store = Store(db)
    store.serve_sql(0)
    count = 0

    async def one_session(index: int, deadline: float) -> None:
        nonlocal count
        session_id = f"ingest-{index}"
        while time.perf_counter() < deadline:
            row = {
                "exchange_id": f"{index}-{count}-{rng.random()}", "session_id": session_id, "seq": store.next_seq(session_id), "api": "openai_chat",
                "action": "generate", "stream": False, "status": "ok", "http_status": 200, "model_requested": "qwen3-coder-plus", "model_engine": STUB_MODEL,
                "engine_kind": "vllm", "method": "POST", "host": "api.openai.com", "path": "/v1/chat/completions", "harness": "qwen",
                "request_headers": spec["headers"], "request_body": request_body, "engine_request": engine_request_wire, "engine_response": engine_response_wire,
                "response_body": {"choices": [{"message": {"content": "x" * 2000}}]}, "prompt_token_ids": prompt_ids, "completion_token_ids": completion_ids,
                "completion_logprobs": logprobs, "finish_reason": "length", "prompt_tokens": tokens, "completion_tokens": tokens,
                "started_at": now(), "engine_started_at": now(), "engine_ended_at": now(), "ended_at": now(),
            }
            await store.commit_exchange(row)
            count += 1

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_session(i, t0 + seconds) for i in range(64)))
        return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    writes_done(db).touch()  # before close() stops the SQL endpoint: the reader's next failed query is the end
    store.close()
    # the DuckDB file and what lies beside it (schema 2 kept its Parquet segments there)
    size = Path(db).stat().st_size + sum(f.stat().st_size for f in Path(db + ".segments").glob("*") if f.is_file())
    print(json.dumps({"rate": count / elapsed, "exchanges": count, "group_commits": store.commits, "db_mb": size / 2**20, "tokens": tokens}))


SQL_PROBES = {
    "sessions overview": "SELECT session_id, count(*) AS n, sum(prompt_tokens + completion_tokens) AS tokens, max(ended_at) AS last FROM exchanges GROUP BY session_id ORDER BY n DESC LIMIT 10",
    "one trajectory's last 4 turns (token ids + logprobs)": "SELECT seq, completion_token_ids, completion_logprobs FROM exchanges WHERE session_id = 'ingest-7' ORDER BY seq DESC LIMIT 4",
}


def writes_done(db: str) -> Path:
    """The file the writer creates when its timed writes end: live SQL is measured only while it is absent."""
    return Path(db + ".writes-done")


def query(db: str, seconds: float) -> None:
    """From another process, the way a researcher watches a run: store.query through the gateway's endpoint, for
    `seconds` or until the writer's timed writes end; prints each probe's p50, p95 and count."""
    from polar_mitm import store

    latencies: dict[str, list[float]] = {name: [] for name in SQL_PROBES}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not writes_done(db).exists():
        for name, sql in SQL_PROBES.items():
            t0 = time.perf_counter()
            try:
                store.query(db, sql)
            except Exception:
                if writes_done(db).exists():  # the writer finished first (this process started late on a busy machine)
                    break
                raise
            latencies[name].append(time.perf_counter() - t0)
        time.sleep(0.1)
    print(json.dumps({name: {"p50": percentile(v, 50), "p95": percentile(v, 95), "n": len(v)} for name, v in latencies.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description="one side of bench/run.py's DuckDB ingest measurement (see bench/ingest.py)")
    parser.add_argument("side", choices=("write", "query"))
    parser.add_argument("db")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--source", type=Path, default=ROOT, help="the polar_mitm source tree to import (default: this one)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.source))  # before polar_mitm is first imported: that tree's Store is measured
    (write if args.side == "write" else query)(args.db, args.seconds)


if __name__ == "__main__":
    main()
