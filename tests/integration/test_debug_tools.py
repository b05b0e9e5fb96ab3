"""The debugging tools: the mitmproxy content view for LLM calls (offline on recorded harness requests, live in
mitmweb), mitmweb replay recorded as a replay, `polar-mitm sql` views while the gateway runs, and
`polar-mitm diff` on sessions that broke for real through the gateway (tests/support/debug_run.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import openai
import pytest
from google import genai
from google.genai import types
from mitmproxy import http
from mitmproxy.contentviews import Metadata
from mitmproxy.test import tflow

from polar_mitm import store
from polar_mitm.assembler import assemble
from polar_mitm.assembler.diagnosis import load_tokenizer
from polar_mitm.gateway.contentview import LLMContentview, tool_signature
from polar_mitm.util import free_port
from tests.support import debug_run
from tests.support.gatewayproc import Gateway, proxy_env

pytestmark = pytest.mark.engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "contentview"
CLI = [sys.executable, "-m", "polar_mitm.cli"]


@pytest.fixture(scope="module")
def tokenizer():
    found = load_tokenizer(None, "qwen3-tiny")
    assert found is not None, "the local engine's qwen3-tiny model directory (tokenizer.json) is missing: run `polar-mitm engine build`"
    return found


def count(tokenizer, text: str) -> int:
    return len(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)


def recorded_flow(name: str) -> http.HTTPFlow:
    recorded = json.loads((FIXTURES / name).read_text())
    flow = tflow.tflow()
    flow.request = http.Request.make(recorded["method"], "https://provider.example" + recorded["path"], json.dumps(recorded["body"]), recorded["headers"])
    flow.response = None
    return flow


def render(view: LLMContentview, flow: http.HTTPFlow, message: http.Message) -> str:
    metadata = Metadata(flow=flow, http_message=message, content_type="application/json")
    assert view.render_priority(message.content, metadata) > 1, "the LLM view must win over the JSON view (priority 1)"
    return view.prettify(message.content, metadata)


# -- the content view on the four APIs' real request shapes
REQUEST_SHAPES = {
    "qwen_code_chat_tool_turn.json": [
        "openai_chat request · model qwen3-coder-plus · stream",
        "4 messages · 3 tools",
        "ignored: metadata, preserve_thinking",
        "── tools (3) ──",
        "  run_shell_command(command: string, is_background?: boolean, timeout?: integer, description?: string, directory?: string)",
        "── [0] system · ",
        "  You are Qwen Code, a non-interactive CLI agent developed by Alibaba Group",
        '  → run_shell_command({"command": "ls; echo capture-qwen > proof_qwen.txt", "description": "List files"})  [call_cdc3bb35]',
        "── [3] tool result · run_shell_command · call_cdc3bb35 · ",
        "  Output: README.md",
    ],
    "codex_responses_tool_turn.json": [
        "openai_responses request · model qwen3-coder-plus · stream",
        "6 messages · 3 tools",
        "normalized: input[0]: developer -> system",
        "  exec_command(cmd: string, justification?: string, login?: boolean, max_output_tokens?: number,",
        "      Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "── [3] user · 14 chars · ~3 tok ──",
        "  List the files",
        '  → exec_command({"cmd": "ls; echo capture-codex > proof_codex.txt"})  [call_f877b59d]',
        "── [5] tool result · exec_command · call_f877b59d · ",
    ],
    "claude_code_messages_tool_turn.json": [
        "anthropic_messages request · model claude-opus-5-5 · stream",
        "5 messages · 3 tools",
        "normalized: thinking.type adaptive -> chat_template_kwargs.enable_thinking=True",
        'settings: max_tokens=128000, chat_template_kwargs={"enable_thinking":true}',
        "  Bash(command: string, timeout?: number, description?: string, run_in_background?: boolean, dangerouslyDisableSandbox?: boolean)",
        "  You are a Claude agent, built on Anthropic's Claude Agent SDK.",
        '  → Bash({"command": "ls; echo capture-claude > proof_claude.txt", "description": "List files"})  [toolu_5bf87ba46f0b]',
        "── [4] tool result · Bash · toolu_5bf87ba46f0b · 9 chars · ~2 tok ──",
        "  README.md",
    ],
    "gemini_cli_tool_turn.json": [
        "gemini request · model gemini-3.8-flash · stream",
        "4 messages · 5 tools",
        "ignored: contents[1].parts[1].thoughtSignature",
        "  list_directory(dir_path: string, ignore?: string[], file_filtering_options?: {respect_git_ignore, respect_gemini_ignore})",
        "── [0] system · 104 chars",
        "  Listing.",
        '  → list_directory({"dir_path": "/tmp/gemcli/work"})  [list_directory_1795957213998_0]',
        "── [3] tool result · list_directory · list_directory_1795957213998_0 · ",
    ],
}


@pytest.mark.parametrize("name", sorted(REQUEST_SHAPES))
def test_contentview_renders_recorded_harness_requests(name: str, tokenizer) -> None:
    flow = recorded_flow(name)
    text = render(LLMContentview(tokenizer=tokenizer), flow, flow.request)
    for expected in REQUEST_SHAPES[name]:
        assert expected in text, f"{expected!r} missing from:\n{text}"
    # one header per message, in order, each with its token count: the message text in the engine's tokenizer
    headers = re.findall(r"^── \[(\d+)\] (\S+)[^\n]* · ([\d,]+) chars · ~([\d,]+) tok ──$", text, re.M)
    assert [int(h[0]) for h in headers] == list(range(int(re.search(r"(\d+) messages", text).group(1))))
    assert all(int(h[3].replace(",", "")) > 0 for h in headers)
    total = int(re.search(r"prompt ~([\d,]+) tokens of message text", text).group(1).replace(",", ""))
    assert total == sum(int(h[3].replace(",", "")) for h in headers)


def test_contentview_counts_and_signatures_are_exact(tokenizer) -> None:
    flow = recorded_flow("codex_responses_tool_turn.json")
    text = render(LLMContentview(tokenizer=tokenizer), flow, flow.request)
    assert f"── [3] user · 14 chars · ~{count(tokenizer, 'List the files')} tok ──" in text
    schema = {"type": "object", "properties": {"path": {"type": "string"}, "mode": {"enum": ["r", "w"]}, "lines": {"type": "array", "items": {"type": "integer"}}}, "required": ["path"]}
    assert tool_signature({"name": "read", "parameters": schema}) == 'read(path: string, mode?: "r"|"w", lines?: integer[])'


def test_contentview_shows_a_refused_request() -> None:
    flow = recorded_flow("claude_code_messages_tool_turn.json")
    flow.request.content = json.dumps({"model": "claude-x", "messages": "not a list", "max_tokens": 5}).encode()
    text = render(LLMContentview(), flow, flow.request)
    assert text.startswith("anthropic_messages request · refused by the gateway: 400")
    assert '"messages": "not a list"' in text


# -- mitmweb, live: the view on real flows, replay
class MitmWeb:
    """mitmweb's REST API, authenticated the way its UI is (token URL -> cookie; XSRF header on writes)."""

    def __init__(self, gateway: Gateway, port: int):
        deadline = time.monotonic() + 30
        while not (found := re.search(r"Web server listening at (http://\S+)", gateway.log.read_text())):
            assert time.monotonic() < deadline, gateway.log.read_text()[-2000:]
            time.sleep(0.1)
        self.url = found.group(1)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30)
        assert self.client.get(self.url).status_code == 200
        self.client.cookies.set("_mitmproxy_xsrf", "0123abcd")

    def flows(self) -> list[dict]:
        return self.client.get("/flows").json()

    def view(self, flow_id: str, part: str, name: str = "auto") -> dict:
        return self.client.get(f"/flows/{flow_id}/{part}/content/{name}.json").json()

    def post(self, path: str) -> httpx.Response:
        response = self.client.post(path, headers={"X-XSRFToken": "0123abcd"})
        assert response.status_code == 200, response.text
        return response


def _gemini_call(gateway: Gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = genai.Client(api_key="polar-debug")
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(name="run_shell_command", description="Run a shell command.", parameters=types.Schema(type=types.Type.OBJECT, properties={"command": types.Schema(type=types.Type.STRING)}, required=["command"]))])
    list(client.models.generate_content_stream(model="gemini-2.5-flash", contents="List the files.", config=types.GenerateContentConfig(tools=[tool], system_instruction="You are a CLI agent.")))


def _chat_call(gateway: Gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-polar-debug", max_retries=0)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], max_tokens=8)


def _assistant_block(text: str) -> str:
    return text.split("── assistant ──", 1)[1].split("\n\n── sampled tokens", 1)[0]


def test_mitmweb_shows_the_conversation_and_records_replays(make_gateway, session_id: str) -> None:
    web_port = free_port()
    gateway = make_gateway("--web", "--web-port", str(web_port), "--engine-hook", debug_run.HOOK)
    web = MitmWeb(gateway, web_port)
    sessions = {api: f"{session_id}-{api}" for api in ("openai_responses", "anthropic_messages", "gemini", "openai_chat")}
    debug_run.codex_session(gateway, sessions["openai_responses"], "List the files.")
    debug_run.claude_session(gateway, sessions["anthropic_messages"], "List the files.")
    _gemini_call(gateway, sessions["gemini"])
    _chat_call(gateway, sessions["openai_chat"])

    rows = {row["exchange_id"]: row for row in gateway.rows("SELECT * FROM exchanges")}
    flows = web.flows()
    assert len(flows) == len(rows) == 6
    no_row = LLMContentview(read=lambda sql, params: ([], []), tokenizer=load_tokenizer(None, "qwen3-tiny"))
    for flow in flows:
        exchange_id = dict((k.lower(), v) for k, v in flow["response"]["headers"])["x-polar-exchange-id"]
        row = rows[exchange_id]
        request, response = web.view(flow["id"], "request"), web.view(flow["id"], "response")
        assert request["view_name"] == response["view_name"] == "LLM", (request, response)
        assert request["text"].startswith(f"{row['api']} request · model {row['model_requested']}")
        assert f"session {row['session_id']} · seq {row['seq']}" in request["text"]
        assert f"prompt {len(row['prompt_token_ids']):,} tokens (the engine's)" in request["text"]
        text = response["text"]
        assert text.startswith(f"{row['api']} response · HTTP 200 · ok")
        ids, logprobs = row["completion_token_ids"], row["completion_logprobs"]
        assert f"── sampled tokens ({len(ids):,}) · logprob mean {sum(logprobs) / len(logprobs):.3f}" in text
        table = re.findall(r"^\s+(\d+)\s+(\d+)\s+(-?\d+\.\d{4})  ", text, re.M)
        assert [(int(i), int(t)) for i, t, _ in table] == list(enumerate(ids))
        assert [float(lp) for _, _, lp in table] == pytest.approx(logprobs, abs=5e-5)
        # the same assistant turn read back from the provider's own JSON or SSE body, without the store
        raw = web.client.get(f"/flows/{flow['id']}/response/content.data").content
        local = tflow.tflow(resp=True)
        local.request = http.Request.make("POST", "https://provider.example" + flow["request"]["path"], b"{}")
        local.response = http.Response.make(200, raw, dict(flow["response"]["headers"]))
        from_body = render(no_row, local, local.response)
        assert "no stored row" in from_body
        assert _assistant_block(text).strip() == from_body.split("── assistant ──", 1)[1].strip(), (text, from_body)
    by_api = {row["api"]: row for row in rows.values() if row["finish_reason"] == "tool_calls"}
    assert set(by_api) == {"openai_responses", "anthropic_messages", "gemini"}
    shown = {api: web.view(next(f["id"] for f in flows if rows[dict((k.lower(), v) for k, v in f["response"]["headers"])["x-polar-exchange-id"]] is row), "response")["text"] for api, row in by_api.items()}
    assert '  → exec_command({"cmd": "ls"})' in shown["openai_responses"]
    assert '  → Bash({"command": "ls"})' in shown["anthropic_messages"]
    assert '  → run_shell_command({"command": "ls"})' in shown["gemini"]

    # mitmweb's Replay of a flow, and of a duplicate of it: same session, flagged replay, not trajectory material
    codex = sessions["openai_responses"]
    first = next(f for f in flows if rows[dict((k.lower(), v) for k, v in f["response"]["headers"])["x-polar-exchange-id"]]["session_id"] == codex)
    duplicate = web.post(f"/flows/{first['id']}/duplicate").text
    web.post(f"/flows/{first['id']}/replay")
    web.post(f"/flows/{duplicate}/replay")
    deadline = time.monotonic() + 60
    while len(replays := gateway.rows("SELECT * FROM exchanges WHERE replay ORDER BY seq")) < 2:
        assert time.monotonic() < deadline, gateway.log.read_text()[-3000:]
        time.sleep(0.2)
    original = rows[dict((k.lower(), v) for k, v in first["response"]["headers"])["x-polar-exchange-id"]]
    for replay in replays:
        assert (replay["session_id"], replay["api"], replay["status"], replay["request_body"]) == (codex, "openai_responses", "ok", original["request_body"])
    assert [r["seq"] for r in gateway.exchanges(codex)] == [1, 2, 3, 4]
    replayed_view = web.view(first["id"], "response")["text"]
    assert "REPLAY (not trajectory material)" in replayed_view and replays[0]["exchange_id"] in replayed_view
    result = assemble(gateway.db, builder="prefix_merging", session=codex)
    assert (result.stats.exchanges, result.stats.exchanges_skipped) == (2, 2)
    assert {e for s in result.sequences for e in s.exchange_ids} == {r["exchange_id"] for r in rows.values() if r["session_id"] == codex}
    timeline = store.query_dicts(gateway.db, "SELECT seq, replay FROM session_timeline WHERE session_id = ?", [codex])
    assert [(t["seq"], t["replay"]) for t in timeline] == [(1, False), (2, False), (3, True), (4, True)]


# -- SQL views
def sql(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "sql", "--db", str(db), *args], capture_output=True, text=True, timeout=60)


def test_sql_views_while_the_gateway_runs(gateway, session_id: str) -> None:
    with proxy_env(gateway, session_id):
        client = openai.OpenAI(api_key="sk-polar-debug", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Again"}]
    client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4)
    assert gateway.process.poll() is None and store.control_file(gateway.db).exists()

    listed = sql(gateway.db, "--list")
    assert listed.returncode == 0, listed.stderr
    for name in ("session_timeline", "token_usage", "harness_prompt_sizes", "breaks", "breaks_by_class", "reward_by_harness_task", "rollout_stats", "errors"):
        assert re.search(rf"^{name}\n    \S", listed.stdout, re.M), listed.stdout
    rows = gateway.exchanges(session_id)
    timeline = sql(gateway.db, "--json", f"SELECT * FROM session_timeline WHERE session_id = '{session_id}'")
    assert timeline.returncode == 0, timeline.stderr
    shown = [json.loads(line) for line in timeline.stdout.splitlines()]
    # on the default gateway (tokens mode here) the engine got token ids: the messages counted are the harness's
    assert {r["render_mode"] for r in rows} == {"tokens"}
    assert [(s["seq"], s["messages"], s["prompt_len"], s["completion_len"]) for s in shown] == [(r["seq"], len(json.loads(r["request_body"])["messages"]), len(r["prompt_token_ids"]), len(r["completion_token_ids"])) for r in rows]
    assert shown[0]["extends_previous"] is None and isinstance(shown[1]["extends_previous"], bool)

    table = sql(gateway.db, "token_usage", "--limit", "1000")
    assert table.returncode == 0, table.stderr
    line = next(line for line in table.stdout.splitlines() if line.startswith(session_id))
    cells = [c.strip() for c in line.split("|")]
    assert cells[2:5] == ["2", str(sum(len(r["prompt_token_ids"]) for r in rows)), str(sum(len(r["completion_token_ids"]) for r in rows))]
    assert re.search(r"^\(\d+ rows?\)$", table.stdout, re.M)

    missing = sql(gateway.db, "breaks_by_class")
    assert missing.returncode == 1 and f"polar-mitm assemble --db {gateway.db}" in missing.stderr


def test_views_on_a_real_run(debug_store) -> None:
    db = debug_store.db
    rewards = {(r["task_id"], r["harness"]): r for r in store.query_dicts(db, "SELECT * FROM reward_by_harness_task")}
    for (task, harness), values in debug_run.REWARDS.items():
        row = rewards[(task, harness)]
        assert (row["sessions"], row["scored"], row["mean_reward"]) == (len(values), len(values), pytest.approx(sum(values) / len(values)))
    assert rewards[("(no task)", "qwen")]["scored"] == 0
    breaks = store.query_dicts(db, "SELECT harness, break_kind, breaks FROM breaks_by_class WHERE builder = 'prefix_merging' ORDER BY break_kind")
    assert [(b["harness"], b["break_kind"], b["breaks"]) for b in breaks] == [("qwen", "rewritten", 1), ("qwen", "truncated", 1)]
    sizes = {r["harness"]: r for r in store.query_dicts(db, "SELECT * FROM harness_prompt_sizes")}
    firsts = store.query_dicts(db, "SELECT harness, len(prompt_token_ids) AS n FROM exchanges WHERE seq = 1")
    for harness in ("codex", "claude"):
        lengths = [f["n"] for f in firsts if f["harness"] == harness]
        assert sizes[harness]["avg_first_prompt_tokens"] == round(sum(lengths) / len(lengths))
        assert (sizes[harness]["sessions"], sizes[harness]["avg_tools"]) == (4, 3)
    # with no gateway holding it, the file is plain DuckDB, opened bare: views, their documentation, pandas
    con = duckdb.connect(str(db), read_only=True)
    try:
        frame = con.sql("SELECT * FROM token_usage").df()
        documented = dict(con.sql("SELECT view_name, comment FROM duckdb_views() WHERE NOT internal").fetchall())
    finally:
        con.close()
    assert sorted(frame.session_id) == sorted(debug_store.sessions) and frame.exchanges.sum() == 20
    assert documented["breaks_by_class"].startswith("Prefix breaks counted by builder, harness and class")
    merged = store.query_dicts(db, "SELECT session_id, extends_previous FROM session_timeline WHERE seq = 2")
    assert {m["session_id"]: m["extends_previous"] for m in merged} == {s: s not in (debug_run.EDITED, debug_run.CUT) for s in debug_store.sessions}


# -- polar-mitm diff
def engine(engine_url: str, path: str, body: dict) -> dict:
    response = httpx.post(engine_url.removesuffix("/v1") + path, json={"model": "qwen3-tiny", **body}, timeout=60, trust_env=False)
    response.raise_for_status()
    return response.json()


def diff(db: Path, session: str, *args: str) -> str:
    done = subprocess.run([*CLI, "diff", session, "--db", str(db), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_diff_names_the_index_and_class_of_a_real_break(debug_store, engine_url: str) -> None:
    db = debug_store.db
    turn1 = store.query_dicts(db, "SELECT prompt_token_ids, completion_token_ids FROM exchanges WHERE session_id = ? AND seq = 1", [debug_run.EDITED])[0]
    # where the edit is, found independently: the engine's own detokenize/tokenize of turn 1's rendered prompt
    rendered = engine(engine_url, "/detokenize", {"tokens": turn1["prompt_token_ids"]})["prompt"]
    cut = rendered.index(debug_run.EDIT_BEFORE) + len("Please list the")  # " files" -> " folders": the next token differs
    prefix = engine(engine_url, "/tokenize", {"prompt": rendered[:cut], "add_special_tokens": False})["tokens"]
    assert turn1["prompt_token_ids"][: len(prefix)] == prefix
    expected = len(prefix)

    detail = diff(db, debug_run.EDITED, "--turn", "1")
    assert f"strict prefix broken at token {expected} (in seq 1's prompt)" in detail
    assert "break class: rewritten" in detail
    assert "  ~ [1] user: edited\n      - Please list the files in the repository.\n      + Please list the folders in the repository." in detail
    assert "  = [2] assistant: turn's reply, sent back as sampled" in detail
    assert re.search(r"seq 1 +→ ' files in the repository", detail) and re.search(r"seq 2 +→ ' folders in the repository", detail)
    turn2_prompt = store.query_dicts(db, "SELECT prompt_token_ids FROM exchanges WHERE session_id = ? AND seq = 2", [debug_run.EDITED])[0]["prompt_token_ids"]
    ids = (turn1["prompt_token_ids"][expected], turn2_prompt[expected])
    # the first differing ids are named, with their text: excerpts can read alike when only the ids differ
    assert f"first different token: seq 1 has id {ids[0]} ' files', seq 2 has id {ids[1]} ' folders'" in detail
    summary = diff(db, debug_run.EDITED)
    assert f"seq 1 → 2  BREAK at token {expected} of {len(turn1['prompt_token_ids']) + len(turn1['completion_token_ids'])} (id {ids[0]} → {ids[1]}): rewritten; messages: 1 edited, 1 resent, 1 added" in summary

    # a sample cut off by max_tokens and sent back: the break lies at its first sampled token
    cut_turn = store.query_dicts(db, "SELECT prompt_token_ids, finish_reason FROM exchanges WHERE session_id = ? AND seq = 1", [debug_run.CUT])[0]
    assert cut_turn["finish_reason"] == "length"
    truncated = diff(db, debug_run.CUT, "--turn", "1")
    assert f"strict prefix broken at token {len(cut_turn['prompt_token_ids'])} (in seq 1's sampled tokens)" in truncated
    assert "break class: truncated" in truncated

    # an unbroken tool turn: the next prompt extends the previous tokens, and the assembler merged it
    merged = diff(db, "list-files-claude-0", "--turn", "1")
    assert "strict prefix: yes — seq 2's prompt starts with all" in merged
    assert "  + [3] tool: 'README.md'" in merged
    assert "the assembler merges seq 2 after seq 1" in merged

    missing = subprocess.run([*CLI, "diff", debug_run.EDITED, "--db", str(db), "--turn", "2"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "seq 2 is the last trajectory exchange" in missing.stderr
