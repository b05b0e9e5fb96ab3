"""The gateway with its store in a process of its own (`--store-process`, polar_mitm/gateway/store_process.py):
commit-before-reply, tokens mode's rows, the child's lifetime (it dies with its gateway, and closes the store when the
gateway stops), and a child that dies under a running gateway."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import duckdb
import httpx
import pytest

from polar_mitm.util import free_port
from tests.support.gatewayproc import Gateway

pytestmark = pytest.mark.engine

BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def _post(gateway: Gateway, session_id: str, body: dict, stream: bool = False) -> httpx.Response:
    with httpx.Client(proxy=gateway.proxy_url(session_id), verify=gateway.ssl_context(), trust_env=False, timeout=60) as client:
        return client.post(
            "https://api.openai.com/v1/chat/completions", content=json.dumps({**body, "stream": stream}).encode(),
            headers={"content-type": "application/json", "authorization": "Bearer sk-x"},
        )


def _store_children(pid: int) -> list[int]:
    """The gateway's store processes: its children running polar_mitm.gateway.store_process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"polar_mitm.gateway.store_process" in command:
            found.append(int(entry.name))
    return found


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; its parent (gone) has not reaped it yet
            return True
        time.sleep(0.05)
    return False


def test_rows_are_committed_by_the_store_process_before_each_reply_and_survive_a_crash(make_gateway, session_id: str) -> None:
    gateway = make_gateway("--store-process")
    [child] = _store_children(gateway.process.pid)
    replies = [_post(gateway, session_id, BODY), _post(gateway, session_id, BODY, stream=True), _post(gateway, session_id, BODY)]
    assert [r.status_code for r in replies] == [200, 200, 200]
    ids = [r.headers["x-polar-exchange-id"] for r in replies]
    rows = gateway.exchanges(session_id)  # through the SQL endpoint, which the store process answers
    assert [r["exchange_id"] for r in rows] == ids and [r["seq"] for r in rows] == [1, 2, 3]
    assert all(r["status"] == "ok" and r["prompt_token_ids"] and r["completion_token_ids"] and r["completion_logprobs"] for r in rows)
    # the engine's reply is stored as the text it crossed the wire as, its prompt ids spliced back by the view
    engine = json.loads(rows[0]["engine_response"])
    assert engine["choices"][0]["token_ids"] == rows[0]["completion_token_ids"]

    os.kill(gateway.process.pid, signal.SIGKILL)  # the gateway alone: its store process must not outlive it
    gateway.process.wait(timeout=30)
    assert _gone(child, 10), "the store process outlived its gateway"
    restarted = Gateway(port=free_port(), db=gateway.db, confdir=gateway.confdir, upstream=gateway.upstream, args=["--store-process"]).start()
    try:
        assert [r["exchange_id"] for r in restarted.exchanges(session_id)] == ids
        assert _post(restarted, session_id, BODY).status_code == 200
        assert [r["seq"] for r in restarted.exchanges(session_id)] == [1, 2, 3, 4]
        [child] = _store_children(restarted.process.pid)
    finally:
        restarted.stop()  # SIGTERM to the whole group: the store process waits for its gateway to close it
    assert _gone(child, 10)
    with duckdb.connect(str(gateway.db), read_only=True) as con:
        assert con.execute("SELECT value FROM meta WHERE key = 'closed_cleanly'").fetchall() == [("true",)]
        assert con.execute("SELECT count(*) FROM exchanges WHERE session_id = ?", [session_id]).fetchall() == [(4,)]


def _wait_for(gateway: Gateway, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in gateway.log.read_text():
        assert time.monotonic() < deadline, f"the gateway never said {text!r}:\n{gateway.log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_a_store_process_that_dies_refuses_commits_in_the_providers_shape_until_a_new_one_opens_the_store(make_gateway, session_id: str) -> None:
    """While no store process holds the store, a reply is a 500 in the provider's shape, never a 200 without its row;
    the gateway starts a new one, which opens the store as soon as it can (here: once a reader lets go of it)."""
    gateway = make_gateway("--store-process")
    first = _post(gateway, session_id, BODY)
    assert first.status_code == 200
    # a read through the gateway has the store move what its commit log holds into the file, which the reader
    # below opens bare (a bare reader of a crashed store sees only what was moved: docs/store.md)
    assert [r["exchange_id"] for r in gateway.exchanges(session_id)] == [first.headers["x-polar-exchange-id"]]
    [child] = _store_children(gateway.process.pid)
    # the gateway held still while its store process dies and a reader takes the file, so the new process must wait
    os.kill(gateway.process.pid, signal.SIGSTOP)
    try:
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                reader = duckdb.connect(str(gateway.db), read_only=True)
                break
            except duckdb.IOException:  # the lock goes with the process, a moment after the signal
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        os.kill(gateway.process.pid, signal.SIGCONT)
    try:
        _wait_for(gateway, "the store's process exited")
        refused = _post(gateway, session_id, BODY)
        assert refused.status_code == 500, refused.text
        error = refused.json()["error"]
        assert error["type"] == "server_error" and "could not record the exchange" in error["message"]
        assert reader.execute("SELECT count(*) FROM exchanges WHERE session_id = ?", [session_id]).fetchall() == [(1,)]
    finally:
        reader.close()
    _wait_for(gateway, "a new store process")
    again = _post(gateway, session_id, BODY)
    assert again.status_code == 200, again.text
    rows = gateway.exchanges(session_id)
    assert [(r["exchange_id"], r["status"]) for r in rows] == [(first.headers["x-polar-exchange-id"], "ok"), (again.headers["x-polar-exchange-id"], "ok")]
    assert rows[1]["seq"] > rows[0]["seq"] and _store_children(gateway.process.pid) != [child]
