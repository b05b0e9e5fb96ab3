"""Regenerate docs/mitmweb-llm-request.png and docs/mitmweb-llm-response.png: mitmweb showing the "LLM" view.

    .venv/bin/python docs/mitmweb_screenshot.py [ENGINE_URL]      (needs `apt-get install chromium`)

Runs `polar-mitm gateway --web` against the engine (default: the local one), sends one Claude-Code-shaped tool
turn through it (tests/support/debug_run.py), and has headless Chromium open the second request and the first response.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polar_mitm.util import free_port  # noqa: E402
from tests.support import debug_run  # noqa: E402
from tests.support.gatewayproc import Gateway  # noqa: E402

SHOTS = {"request": ("mitmweb-llm-request.png", 1, 1480), "response": ("mitmweb-llm-response.png", 0, 1000)}


def main(engine_url: str = "http://127.0.0.1:8011/v1") -> None:
    base = Path(tempfile.mkdtemp(prefix="polar-screenshot-"))
    web_port = free_port()
    gateway = Gateway(port=free_port(), db=base / "store.duckdb", confdir=base / "conf", upstream=engine_url, args=["--web", "--web-port", str(web_port), "--engine-hook", debug_run.HOOK]).start()
    try:
        while not (found := re.search(r"Web server listening at (\S+)", gateway.log.read_text())):
            time.sleep(0.1)
        url = found.group(1)
        debug_run.claude_session(gateway, "claude-demo", "List the files in the repository.")
        web = httpx.Client(base_url=f"http://127.0.0.1:{web_port}", trust_env=False)
        web.get(url)
        flows = web.get("/flows").json()
        for part, (name, index, height) in SHOTS.items():
            target = f"{url}#/flows/{flows[index]['id']}/{part}"
            command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size=1600,{height}", "--virtual-time-budget=15000", f"--screenshot={REPO / 'docs' / name}", target]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            print(f"wrote docs/{name}")
    finally:
        gateway.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
