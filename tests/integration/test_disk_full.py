"""Disk trouble for the store: its filesystem fills up (a size-limited tmpfs each test mounts, filled with a file).

- The store itself (polar_mitm.store.Store, small segments so compactions run while the disk is full): a commit
  that could not be made raises (never a silent success), whether DuckDB refused the WAL write, a compaction's
  segment table, or a checkpoint (after which DuckDB invalidates the database and the writer must open it again);
  the store says so in one line per episode; once space returns it writes again; every committed row is there
  after a reopen, nothing is left beside the file, and the compactor is still alive.
- A real gateway (the real engine behind it): each API's non-streamed call is answered 500 in that provider's
  error shape and a streamed call ends in the provider's in-stream error, never a 200 without a row; the gateway
  says so in one log line, without a traceback per request; it recovers when the filler goes; every reply it
  answered 200 has its ok row, after the recovery and after a restart.

Needs root (it mounts tmpfs); skipped with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_mitm import dialects
from polar_mitm.dialects.common import sse_events
from polar_mitm.store import Store
from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway
from tests.support.rows import exchange_row


@contextmanager
def small_disk(directory: Path, size: str = "8m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `directory` for the block; unmounted after, whatever happened."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def fill(directory: Path, leave: int) -> Path:
    """A file that takes all but `leave` bytes of the filesystem's free space."""
    filler = directory / "filler"
    stat = os.statvfs(directory)
    remaining = max(0, stat.f_bavail * stat.f_frsize - leave)
    try:
        # unbuffered: the store writes meanwhile (its commit log's moves, compactions), so the disk can fill before
        # the filler has written all it planned; a buffered file's close would then raise the ENOSPC
        with filler.open("wb", buffering=0) as out:
            while remaining > 0:
                out.write(b"\0" * min(remaining, 1 << 20))
                remaining -= 1 << 20
    except OSError:
        pass  # full already
    return filler


# -- the store -------------------------------------------------------------------------------------------

# what is left free when the disk fills: nothing (the WAL write fails), or a little (a compaction's WAL write or
# a checkpoint fails first; the checkpoint's failure makes DuckDB invalidate the database)
@pytest.mark.parametrize("leave", [0, 400_000, 1_500_000])
def test_a_full_disk_refuses_commits_says_so_once_and_loses_nothing_when_space_returns(tmp_path: Path, leave: int) -> None:
    with small_disk(tmp_path / "disk") as disk:
        reports: list[str] = []
        db = disk / "store.duckdb"
        store = Store(db, segment_rows=8, report=reports.append)
        committed, refused = asyncio.run(_commit_through_a_full_disk(store, disk, leave))
        assert store._compactor.is_alive() and store._writer.is_alive()
        store.close()
        assert refused, "the disk never filled: nothing was refused"
        # one line when it could not write, one when it could again; not one per refused commit. A compaction
        # that failed is an episode of its own, which never claims that commits are refused
        commits = [line for line in reports if "cannot write" in line or "writes again" in line]
        compactions = [line for line in reports if "cannot compact" in line or "compacts again" in line]
        assert commits and "cannot write" in commits[0] and any("writes again" in line for line in commits), reports
        assert all("commits go on" in line for line in compactions if "cannot compact" in line), reports
        assert len(commits) + len(compactions) == len(reports) and len(commits) <= 4 and len(compactions) <= 4 < len(refused), reports
        reopened = Store(db)
        try:
            stored = {r[0]: r[1] for r in reopened.query("SELECT exchange_id, status FROM exchanges")[1]}
            journals = reopened.query("SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE 'exchange_journal_%'")[1][0][0]
        finally:
            reopened.close()
        assert set(committed) <= set(stored), f"{len(set(committed) - set(stored))} committed rows lost"
        assert set(stored) <= set(committed) | set(refused)
        assert journals == 2  # every full journal became a segment (the open one and its spare are empty)
        assert not (disk / "store.duckdb.segments").exists()  # no snapshot was taken: no Parquet export either


async def _commit_through_a_full_disk(store: Store, disk: Path, leave: int) -> tuple[list[str], list[str]]:
    committed: list[str] = []
    refused: list[str] = []
    last_refusal: list[str] = []

    def state() -> str:  # what a failure below shows: why the last commit was refused, and what holds the disk
        usage = os.statvfs(disk)
        files = {path.name: path.stat().st_size for path in disk.rglob("*") if path.is_file()}
        return (f"last refusal: {last_refusal}; store invalid: {store._invalid!r}; writer alive {store._writer.is_alive()}, compactor alive "
                f"{store._compactor.is_alive()}; {usage.f_bavail * usage.f_frsize} bytes free; files {files}")

    async def commit() -> bool:
        row = exchange_row("disk", store.next_seq("disk"))
        try:
            await store.commit_exchange(row)
        except Exception as error:  # noqa: BLE001 - a refused commit is what this test counts
            refused.append(row["exchange_id"])
            last_refusal[:] = [f"{type(error).__name__}: {error}"]
            return False
        committed.append(row["exchange_id"])
        return True

    for _ in range(20):
        assert await commit()
    filler = fill(disk, leave)
    for _ in range(60):
        await commit()
        await asyncio.sleep(0.01)
    filler.unlink()
    # the first write after space returns says the store recovered (within 15 s); the rest only need to land (a
    # commit on a loaded 2-core machine can take a good part of a second: the deadline is not a speed test)
    recovered = time.monotonic() + 15
    deadline = time.monotonic() + 90
    ok_after = 0
    while ok_after < 30:
        assert ok_after or time.monotonic() < recovered, f"the store did not write again within 15 s of space returning ({state()})"
        assert time.monotonic() < deadline, f"only {ok_after} of 30 commits landed within 90 s of space returning ({state()})"
        if await commit():
            ok_after += 1
        else:
            await asyncio.sleep(0.05)
    return committed, refused


# -- a real gateway --------------------------------------------------------------------------------------

CALLS: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {
    "openai_chat": ("https://api.openai.com/v1/chat/completions", {"authorization": "Bearer sk-test"},
                    {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    "openai_responses": ("https://api.openai.com/v1/responses", {"authorization": "Bearer sk-test"}, {"model": "gpt-4o", "input": "hi", "max_output_tokens": 2}),
    "anthropic_messages": ("https://api.anthropic.com/v1/messages", {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"},
                           {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    "gemini": ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:generateContent", {"x-goog-api-key": "test"},
               {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 2}}),
}


# A row bigger than a memory page: on a full tmpfs a write that fits in the slack of the WAL file's last page takes no
# new space, so a tiny row can still be committed there (durably: it is on the disk), and whether one fits depends on
# where the WAL's last write ended. A header of this size is in the row (request_headers) whatever the API.
PAGE_FILLER = {"x-test-padding": "x" * 6000}


def call(client: httpx.Client, api: str, stream: bool = False, padded: bool = False) -> httpx.Response:
    url, headers, body = CALLS[api]
    if padded:
        headers = {**headers, **PAGE_FILLER}
    if stream:
        if api == "gemini":
            url = url.replace(":generateContent", ":streamGenerateContent?alt=sse")
        else:
            body = {**body, "stream": True}
    return client.post(url, json=body, headers=headers)


def provider_error(api: str, body: Any) -> str | None:
    """Why `body` is not `api`'s error shape for a 500 store_error, or None."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or "could not record the exchange" not in str(error.get("message")):
        return f"no error.message saying the exchange was not recorded: {body!r:.300}"
    if api == "anthropic_messages":
        return None if body.get("type") == "error" and isinstance(error.get("type"), str) else f"not Anthropic's error shape: {body!r:.300}"
    if api == "gemini":
        return None if error.get("code") == 500 and str(error.get("status", "")).isupper() else f"not Google's error shape: {body!r:.300}"
    shaped = set(body) == {"error"} and {"message", "type", "param", "code"} <= set(error) and error["code"] == "store_error"
    return None if shaped else f"not OpenAI's error shape: {body!r:.300}"


def test_a_gateway_on_a_full_disk_answers_store_errors_says_so_once_and_recovers_without_loss(tmp_path: Path, engine_url: str) -> None:
    with small_disk(tmp_path / "disk") as disk:
        # the gateway's log stays off the full disk (Gateway names it after the store): its lines are what is checked
        (disk / "store.gateway.log").symlink_to(tmp_path / "gateway.log")
        gw = Gateway(port=free_port(), db=disk / "store.duckdb", confdir=tmp_path / "confdir", upstream=engine_url).start()
        try:
            _full_disk_through_the_gateway(gw, disk)
        finally:
            gw.stop()


def _full_disk_through_the_gateway(gw: Gateway, disk: Path) -> None:
    answered_ok: list[str] = []
    with httpx.Client(proxy=gw.proxy_url("disk-full"), verify=gw.ssl_context(), trust_env=False, timeout=120) as client:
        for api in CALLS:
            response = call(client, api)
            assert response.status_code == 200, response.text
            answered_ok.append(response.headers["x-polar-exchange-id"])

        filler = fill(disk, 0)
        refused: list[str] = []
        for api in CALLS:
            response = call(client, api, padded=True)
            assert response.status_code == 500, f"{api}: HTTP {response.status_code} on a full disk: {response.text[:300]}"
            assert (why := provider_error(api, response.json())) is None, f"{api}: {why}"
            refused.append(response.headers["x-polar-exchange-id"])
        streamed = call(client, "anthropic_messages", stream=True, padded=True)
        # its 200 went out before the commit: the stream ends in Anthropic's error event instead of the reply
        assert streamed.status_code == 200
        assert dialects.get("anthropic_messages").parse_reply_stream(sse_events(streamed.content)).error, streamed.text[-400:]

        filler.unlink()
        deadline = time.monotonic() + 20
        while (response := call(client, "openai_chat")).status_code != 200:
            assert time.monotonic() < deadline, f"no recovery within 20 s of space returning: {response.text[:300]}"
            time.sleep(0.2)
        answered_ok.append(response.headers["x-polar-exchange-id"])
        for api in CALLS:
            response = call(client, api)
            assert response.status_code == 200, response.text
            answered_ok.append(response.headers["x-polar-exchange-id"])

    assert gw.log is not None
    log = gw.log.read_text()
    assert log.count("cannot write") == 1 and log.count("writes again") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    rows = {r["exchange_id"]: r["status"] for r in gw.rows("SELECT exchange_id, status FROM exchanges")}
    assert all(rows.get(exchange_id) == "ok" for exchange_id in answered_ok), {i: rows.get(i) for i in answered_ok}
    assert not set(refused) & set(rows)  # a refused commit left no row

    gw.stop()
    gw.start()
    rows = {r["exchange_id"]: r["status"] for r in gw.rows("SELECT exchange_id, status FROM exchanges")}
    assert all(rows.get(exchange_id) == "ok" for exchange_id in answered_ok), {i: rows.get(i) for i in answered_ok}
    assert json.loads(json.dumps(sorted(rows.values()))).count("ok") == len(answered_ok)
