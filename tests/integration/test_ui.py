"""The dashboard in a real browser: Debian's headless Chromium (tests/support/browser.py) drives `polar-mitm ui` on a
real run's store (the `debug_store` fixture: harness-shaped sessions through the real gateway and engine, two broken
on purpose, rewards recorded) and follows a live gateway writing a store, also through the gateway's own /ui and its
link to mitmweb. Each view's content is checked against the store, the assembler and `polar-mitm diff`; the
screenshots docs/ui.md and the README show are taken here (docs/img/ui-*.png: rewritten with
POLAR_MITM_SCREENSHOTS=1, else written to the test's own folder)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from polar_mitm import store
from polar_mitm.assembler import assemble
from polar_mitm.assembler.diagnosis import load_tokenizer
from polar_mitm.util import free_port
from tests.support import debug_run
from tests.support.browser import Browser, find_chromium
from tests.support.gatewayproc import proxy_env
from tests.support.processes import stop_process_group

pytestmark = pytest.mark.engine

CLI = [sys.executable, "-m", "polar_mitm.cli"]
# the screenshots docs/ui.md and the README show: written there with POLAR_MITM_SCREENSHOTS=1, else beside the test
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"
PROBLEM_READY = "document.readyState === 'complete' && !!document.querySelector('#problem, #empty, #totals')"


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return DOCS_IMAGES if os.environ.get("POLAR_MITM_SCREENSHOTS") == "1" else tmp_path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium here: scripts/setup.sh installs Debian's `chromium` package")
    with Browser(binary, width=1280, height=900) as tab:
        yield tab


class UiServer:
    """`polar-mitm ui --db DB` as a user runs it, on a free port."""

    def __init__(self, db: Path, log: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/ui/"
        self.log = log
        self.process = subprocess.Popen([*CLI, "ui", "--db", str(db), "--port", str(self.port), *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "static/ui.css", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"polar-mitm ui did not come up:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process_group(self.process, 10)
        assert "Traceback" not in self.log.read_text(), self.log.read_text()[-3000:]


def cells(tab: Browser, table: str) -> list[list[str]]:
    return tab.evaluate(f"[...document.querySelectorAll({json.dumps(table + ' tr')})].slice(1).map(r => [...r.cells].map(c => c.innerText.trim()))")


def test_run_session_and_trajectory_views_on_a_real_run(debug_store: debug_run.DebugRun, browser: Browser, images: Path, tmp_path: Path) -> None:
    ui = UiServer(debug_store.db, tmp_path / "ui.log")
    try:
        # -- Run: totals, GRPO groups and advantages as the assembler has them, sessions by status, the breaks
        browser.goto(ui.url)
        [[exchanges, sessions, sampled]] = store.query(debug_store.db, "SELECT count(*), count(DISTINCT session_id), sum(completion_tokens) FROM exchanges")[1]
        totals = browser.text("#totals")
        assert f"{exchanges}\nexchanges" in totals and f"{sessions}\nsessions" in totals and f"{sampled:,}\nsampled tokens" in totals
        assembly = assemble(debug_store.db)
        groups = {row[0]: row for row in cells(browser, "#groups table")}
        for group in assembly.groups:
            row = groups[group.group_id]
            assert row[5] == ("no signal" if group.no_signal else "signal")
            if group.mean is not None and group.std is not None:
                assert (row[3], row[4]) == (f"{group.mean:.3f}", f"{group.std:.3f}")
        assert groups["list-files"][3] == "0.750" and groups["find-readme"][3] == "0.250"  # debug_run.REWARDS
        sessions_table = {row[0]: row for row in cells(browser, "#session-table")}
        for sequence in assembly.sequences:
            if sequence.advantage is not None:
                assert sessions_table[sequence.session_id][5] == f"{sequence.advantage:.2f}"
        assert ["completed", "8"] in cells(browser, "#session-statuses table")
        breaks = browser.text("#breaks")
        assert "rewritten" in breaks and "truncated" in breaks
        assert 10_000 < browser.screenshot(images / "ui-run.png", height=1100).stat().st_size < 300_000

        # -- Session: a real click on the broken session; its conversation, the diff `polar-mitm diff` prints, sequences
        browser.mark_page()
        browser.click(f'#session-table a[href$="{debug_run.EDITED}"]')
        browser.wait_for_page()
        assert browser.evaluate("document.body.dataset.page") == "session"
        assert "You are Qwen Code" in browser.text("details.system")
        assert browser.text("details.tools summary") == "3 tools: glob, read_file, run_shell_command"
        assert debug_run.EDIT_BEFORE in browser.text("#seq-1") and debug_run.EDIT_AFTER in browser.text("#seq-2")
        assert "run_shell_command" in browser.text("#seq-1 .reply") and debug_run.TOOL_OUTPUT.strip() in browser.text("#seq-2")
        said = subprocess.run([*CLI, "diff", debug_run.EDITED, "--db", str(debug_store.db)], capture_output=True, text=True, timeout=120)
        assert said.returncode == 0, said.stderr
        [line] = [line.strip() for line in said.stdout.splitlines() if line.strip().startswith("seq 1 →")]
        assert browser.text("#diff-2 summary") == f"diff {line}"
        assert browser.evaluate("document.getElementById('diff-2').open")  # a break's diff is open
        detail = subprocess.run([*CLI, "diff", debug_run.EDITED, "--db", str(debug_store.db), "--turn", "1"], capture_output=True, text=True, timeout=120).stdout
        assert browser.text("#diff-2 pre") == detail.strip() and "break class: rewritten" in detail
        edited = [s for s in assembly.sequences if s.session_id == debug_run.EDITED]
        rows = cells(browser, "#sequences table")
        assert [r[0] for r in rows] == [s.sequence_id for s in edited]
        broken = next(s for s in edited if s.break_diagnosis is not None)
        assert f"rewritten break at token {broken.break_diagnosis.index}" in browser.text("#sequences")
        assert 10_000 < browser.screenshot(images / "ui-session.png", height=1000).stat().st_size < 300_000

        # -- Trajectory: every token, the loss mask, the exact text, the break point, logprob heat, search
        browser.mark_page()
        browser.click(f'#sequences a[href$="{broken.sequence_id.replace(":", "%3A")}"]')
        browser.wait_for_page()
        assert browser.evaluate("document.body.dataset.page") == "trajectory"
        data = browser.evaluate("JSON.parse(document.getElementById('token-data').textContent)")
        assert data["ids"] == broken.input_ids and data["mask"] == broken.loss_mask
        assert browser.count("#tokens span.t") == len(broken.input_ids) and browser.count("#tokens span.t.s") == sum(broken.loss_mask)
        tokenizer = load_tokenizer(None, broken.model_engine)
        assert tokenizer is not None, "the local engine's tokenizer"
        assert "".join(data["text"]) == tokenizer.text(broken.input_ids)  # each token's exact text, end to end
        at_break = browser.evaluate("(() => { let e = document.querySelector('#tokens .mk.brk'); while (e && !e.matches('span.t')) e = e.nextElementSibling; "
                                    "return [...document.querySelectorAll('#tokens span.t')].indexOf(e); })()")
        assert at_break == broken.break_diagnosis.index
        sampled = browser.evaluate("getComputedStyle(document.querySelector('#tokens span.t.s')).backgroundColor")
        browser.click('input[name="mode"][value="heat"]')
        assert browser.evaluate("document.getElementById('tokens').classList.contains('mode-heat')")
        assert browser.evaluate("getComputedStyle(document.querySelector('#tokens span.t.s')).backgroundColor") != sampled
        browser.click('input[name="mode"][value="mask"]')
        browser.hover("#tokens span.t.s")
        assert "sampled by seq 2" in browser.text("#token-info") and "logprob" in browser.text("#token-info")
        word = debug_run.EDIT_AFTER.split()[3]  # "folders": the word the edit put in
        browser.type_into("#token-search", word)
        expected = "".join(data["text"]).lower().count(word)
        assert browser.text("#search-count") == f"{expected} match" + ("" if expected == 1 else "es")
        assert word in "".join(data["text"][i] for i in browser.evaluate("[...document.querySelectorAll('#tokens span.t')].flatMap((s, i) => s.classList.contains('cur') ? [i] : [])"))
        browser.press("Enter")
        assert browser.text("#token-info").startswith(f"match 1 of {expected}" if expected == 1 else f"match 2 of {expected}")
        browser.type_into("#token-search", f"#{broken.input_ids[0]}")
        assert browser.text("#search-count").startswith(str(broken.input_ids.count(broken.input_ids[0])) + " match")
        browser.type_into("#token-search", word)
        assert 10_000 < browser.screenshot(images / "ui-trajectory.png").stat().st_size < 300_000
    finally:
        ui.stop()


def say(gateway, session_id: str, text: str) -> None:
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-polar-ui", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": text}], max_tokens=8)


def test_the_pages_follow_a_live_gateway_and_link_to_mitmweb(make_gateway, browser: Browser, images: Path, tmp_path: Path) -> None:
    db = tmp_path / "live" / "store.duckdb"
    db.parent.mkdir()
    ui = UiServer(db, tmp_path / "ui.log")
    try:
        # a bad path first: a clear page that looks again by itself
        browser.goto(ui.url, ready=PROBLEM_READY)
        assert browser.text("#problem h1") == "No store here" and "Traceback" not in browser.text("body")
        # an empty store: the run page says there is nothing yet
        store.Store(db).close()
        browser.wait_for("!!document.querySelector('#empty')", timeout=30)  # the problem page reloaded itself
        assert "No exchanges yet" in browser.text("#empty")

        # a gateway starts writing: the page notices (its reads go through the gateway's SQL endpoint)
        web_port = free_port()
        gateway = make_gateway("--web", "--web-port", str(web_port), db=db)
        browser.goto(ui.url, ready=PROBLEM_READY)
        assert browser.text("#store-state").startswith(f"live: gateway pid {gateway.process.pid}")
        assert browser.evaluate("document.getElementById('live').checked")
        session_id = f"ui-live-{uuid.uuid4().hex[:8]}"
        say(gateway, session_id, "Say hello.")
        # no reload: the live page swaps its content in place
        browser.wait_for(f"!!document.querySelector('#session-table a[href$=\"{session_id}\"]')", timeout=30)
        assert int(browser.evaluate("document.body.dataset.refreshed || '0'")) >= 1
        assert "1\nexchanges" in browser.text("#totals")

        browser.goto(ui.url + f"session?id={session_id}")
        assert "Say hello." in browser.text("#seq-1") and browser.count("#seq-2") == 0
        say(gateway, session_id, "Say goodbye.")
        browser.wait_for("!!document.querySelector('#seq-2')", timeout=30)
        assert "Say goodbye." in browser.text("#seq-2") and "ok" in browser.text("#seq-2 .ex-head")

        # the gateway serves the same pages itself, over its own store, linking each exchange to its mitmweb flow
        gateway_ui = f"http://127.0.0.1:{gateway.port}/ui/"
        browser.goto(gateway_ui + f"session?id={session_id}")
        assert browser.text("#store-state") == "live: this gateway's own store"
        exchange_id = store.query(db, "SELECT exchange_id FROM exchanges WHERE session_id = ? AND seq = 2", [session_id])[1][0][0]
        link = browser.evaluate("document.querySelector('#seq-2 a.mitmweb').href")
        assert link == f"http://127.0.0.1:{web_port}/#/flows?s=~hs%20{exchange_id}"
        assert 10_000 < browser.screenshot(images / "ui-live.png", height=800).stat().st_size < 300_000
        token = re.search(r"token=([0-9a-f]+)", gateway.log.read_text())
        assert token, "mitmweb printed no access token"
        browser.goto(f"http://127.0.0.1:{web_port}/?token={token[1]}", ready="document.readyState === 'complete'")
        browser.goto("about:blank", ready="true")
        browser.goto(link, ready="document.querySelectorAll('.flow-table tbody tr td').length > 0")
        time.sleep(1)  # mitmweb applies the filter from the URL once its flows have arrived
        urls = browser.evaluate("[...document.querySelectorAll('.flow-table tbody tr')].map(r => r.innerText).filter(t => t.includes('http'))")
        assert len(urls) == 1 and "/v1/chat/completions" in urls[0], urls  # that flow only
        browser.goto("about:blank", ready="true")
        browser.goto(f"http://127.0.0.1:{web_port}/#/flows", ready="document.querySelectorAll('.flow-table tbody tr td').length > 0")
        time.sleep(1)
        listed = browser.evaluate("[...document.querySelectorAll('.flow-table tbody tr')].map(r => r.innerText).join(' ')")
        assert "/ui/" not in listed, "the dashboard's own requests stay out of mitmweb's flow list"
    finally:
        ui.stop()
