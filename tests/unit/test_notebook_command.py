"""`polar-mitm notebook --db PATH`: JupyterLab on notebooks/, the store passed to the kernels as POLAR_MITM_DB.

Run as a user would (the console script, a relative --db, another working directory), without a browser: the
server must serve the notebooks, and a kernel started for a notebook (in the notebooks' folder, as JupyterLab
starts it) must get the store's absolute path and read the store with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from polar_mitm.store import Store
from polar_mitm.util import free_port
from tests.support.rows import exchange_row
from tests.support.user_stores import POLAR_MITM, polar_mitm, user_env

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def make_store(path: Path, rows: int) -> None:
    writer = Store(path)
    try:
        for seq in range(1, rows + 1):
            asyncio.run(writer.commit_exchange(exchange_row("nb", seq, prompt_len=20)))
    finally:
        writer.close()


def test_no_store_and_no_notebooks_folder_are_clear_errors(tmp_path: Path) -> None:
    done = polar_mitm("notebook", "--db", "missing.duckdb", "--no-browser", cwd=tmp_path)
    assert done.returncode == 2 and f"polar-mitm notebook: no store at {tmp_path / 'missing.duckdb'} (--db missing.duckdb)" in done.stderr
    make_store(tmp_path / "s.duckdb", 1)
    done = polar_mitm("notebook", "--db", "s.duckdb", "--notebooks", "nowhere", "--no-browser", cwd=tmp_path)
    assert done.returncode == 2 and f"no notebooks folder at {tmp_path / 'nowhere'}" in done.stderr


def run_in_kernel(base: str, token: str, kernel_id: str, code: str) -> str:
    """Execute `code` in the kernel over Jupyter's websocket protocol; returns what it printed."""
    import websocket

    channel = websocket.create_connection(f"{base.replace('http', 'ws', 1)}/api/kernels/{kernel_id}/channels?token={token}", timeout=120)
    try:
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex, "msg_type": "execute_request", "version": "5.3"}
        content = {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False}
        channel.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": "shell"}))
        printed = []
        while True:
            message = json.loads(channel.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            elif message["msg_type"] == "error":
                raise AssertionError("\n".join(message["content"]["traceback"]))
            elif message["msg_type"] == "execute_reply":
                return "".join(printed)
    finally:
        channel.close()


def test_serves_the_notebooks_and_hands_the_store_to_the_kernels(tmp_path: Path) -> None:
    pytest.importorskip("jupyterlab", reason="the notebooks extra (JupyterLab) is not installed")
    (tmp_path / "made").mkdir()
    make_store(tmp_path / "made" / "tiny.duckdb", 3)
    port, token = free_port(), uuid.uuid4().hex
    jupyter_home = {name: str(tmp_path / "jupyter" / name) for name in ("JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR")}
    extra = [f"--IdentityProvider.token={token}", *(["--allow-root"] if os.geteuid() == 0 else [])]  # Jupyter refuses root unless told
    log = tmp_path / "jupyter.log"  # a file, not a pipe: nothing reads a pipe while the server runs
    server = subprocess.Popen(
        [POLAR_MITM, "notebook", "--db", "made/tiny.duckdb", "--no-browser", "--port", str(port), "--", *extra],
        cwd=tmp_path, env=user_env(**jupyter_home), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, params={"token": token}, trust_env=False, timeout=60)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if client.get("/api/status").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "JupyterLab did not come up"
            time.sleep(0.5)
        assert client.get("/lab").status_code == 200  # the front end itself
        listed = client.get("/api/contents").json()["content"]
        assert sorted(item["name"] for item in listed) == ["1_inspect_session.ipynb", "2_explore_rollout.ipynb", "3_compare_harnesses.ipynb"]
        # a kernel as JupyterLab starts one for an open notebook: in the notebook's folder
        session = client.post("/api/sessions", json={"path": "2_explore_rollout.ipynb", "type": "notebook", "name": "", "kernel": {"name": "python3"}}).json()
        printed = run_in_kernel(base, token, session["kernel"]["id"], (
            "import os\nfrom polar_mitm import store\n"
            "print(os.environ['POLAR_MITM_DB'])\nprint(os.getcwd())\n"
            "print(store.query(os.environ['POLAR_MITM_DB'], 'SELECT count(*) FROM exchanges')[1][0][0])"
        ))
        assert printed.splitlines() == [str(tmp_path / "made" / "tiny.duckdb"), str(NOTEBOOKS), "3"]
        client.delete(f"/api/sessions/{session['id']}")
    finally:
        client.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # JupyterLab shuts its kernels down on SIGTERM
        server.wait(timeout=60)
    assert f"polar-mitm notebook: {NOTEBOOKS} on {tmp_path / 'made' / 'tiny.duckdb'} ($POLAR_MITM_DB)" in log.read_text()
