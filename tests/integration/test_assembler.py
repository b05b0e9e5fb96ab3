"""The assembler on real data: sessions recorded through the real gateway (official openai SDK, real mitmproxy)
against the real vLLM engine with the Qwen tokenizer, then assembled from the store.

The tiny random model's text is steered with structured outputs (a regex), so every token is still sampled
by the engine. A forced text is normally NOT sampled in its canonical tokenization (`H|ell|o` for `Hello`);
where a test needs an append-only history, it also biases the canonical ids of the text (logit_bias), and
checks that the text has no two canonical tokens that could both match at one position.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import openai
import pytest

from polar_mitm import store
from polar_mitm.assembler import assemble
from polar_mitm.assembler.diagnosis import common_prefix, load_tokenizer
from polar_mitm.assembler.export import store_trajectories, write_parquet
from polar_mitm.assembler.rewards import EPSILON
from polar_mitm.local_engine.steering import literal
from tests.support.gatewayproc import Gateway, proxy_env

pytestmark = pytest.mark.engine


@pytest.fixture
def gateway(chat_gateway: Gateway) -> Gateway:
    """The shared gateway in chat mode (`--render chat`): the breaks this module diagnoses are the engine re-rendering
    what it sampled (tokens mode bridges them: tests/integration/test_tokens_gateway.py)."""
    return chat_gateway

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]
SYSTEM = "You are terse."


def read_call(path: str, compact: bool = False) -> str:
    arguments = json.dumps({"path": path}, separators=(",", ":") if compact else None)
    return '<tool_call>\n{"name": "read_file", "arguments": ' + arguments + "}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    found = load_tokenizer(None, "qwen3-tiny")
    assert found is not None, "the local engine's qwen3-tiny model directory (tokenizer.json) is missing"
    return found


def canonical_bias(tokenizer, text: str, check: bool = True) -> dict[str, int]:
    """Bias the canonical ids of `text` (and <|im_end|>) so that the forced text is sampled canonically."""
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    pieces = {i: tokenizer.token_bytes(i) for i in ids}
    data, offset = text.encode(), 0
    for token in ids if check else []:
        rivals = {i for i, piece in pieces.items() if data.startswith(piece, offset)}
        assert len(rivals) == 1, f"{text!r}: canonical tokens {sorted(rivals)} all match at byte {offset}; pick another text"
        offset += len(pieces[token])
    return {str(i): 100 for i in ids} | {str(tokenizer.tokenizer.token_to_id("<|im_end|>")): 100}


class Conversation:
    """A chat through the gateway with the official openai SDK; each reply is forced to a given text."""

    def __init__(self, client: openai.OpenAI, tokenizer, system: str = SYSTEM):
        self.client = client
        self.tokenizer = tokenizer
        self.messages: list[dict] = [{"role": "system", "content": system}]

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def ask(self, text: str, canonical: bool = True, max_tokens: int = 64, check: bool = True, **extra):
        reply = self.client.chat.completions.create(
            model="gpt-4o",
            messages=self.messages,
            tools=TOOLS,
            tool_choice="auto",
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"structured_outputs": {"regex": literal(text)}},
            **({"logit_bias": canonical_bias(self.tokenizer, text, check)} if canonical else {}),
            **extra,
        )
        self.messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        return reply

    def tool_result(self, reply, content: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": content})


def client_for() -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-test-assembler")


def assert_every_sample_once(result, rows: list[dict]) -> None:
    """No sampled token is dropped or duplicated: the masks cover exactly the sampled tokens of every exchange."""
    sampled = {row["exchange_id"]: row for row in rows if row["status"] == "ok"}
    seen = []
    for sequence in result.sequences:
        positions = [i for i, m in enumerate(sequence.loss_mask) if m]
        cursor = iter(positions)
        for exchange_id in sequence.exchange_ids:
            row = sampled[exchange_id]
            at = [next(cursor) for _ in row["completion_token_ids"]]
            assert [sequence.input_ids[i] for i in at] == row["completion_token_ids"]
            assert [sequence.rollout_logprobs[i] for i in at] == row["completion_logprobs"]
            seen.append(exchange_id)
        assert next(cursor, None) is None
    assert sorted(seen) == sorted(sampled)


def test_append_only_session_is_one_sequence(gateway: Gateway, session_id: str, tokenizer) -> None:
    with proxy_env(gateway, session_id):
        client = client_for()
        chat = Conversation(client, tokenizer)
        chat.user("What do notes.txt and todo.txt say?")
        first = chat.ask(read_call("notes.txt"))
        assert first.choices[0].finish_reason == "tool_calls"
        chat.tool_result(first, "hello from the notes")
        # a side call between two turns (as harnesses generate titles): its own lineage
        side = Conversation(client, tokenizer, system="Write a title.")
        side.user("What do notes.txt and todo.txt say?")
        side.ask("Two files")
        second = chat.ask(read_call("todo.txt"))
        chat.tool_result(second, "buy milk")
        chat.ask("Notes: hello. Todo: buy milk")
    rows = gateway.exchanges(session_id)
    assert [r["status"] for r in rows] == ["ok"] * 4
    p1, p3, p4 = (rows[i]["prompt_token_ids"] for i in (0, 2, 3))
    c1, c3, c4 = (rows[i]["completion_token_ids"] for i in (0, 2, 3))

    result = assemble(gateway.db, "prefix_merging", session=session_id)
    assert [s.exchange_seqs for s in result.sequences] == [[1, 3, 4], [2]]
    main, title = result.sequences
    inter3 = p3[len(p1) + len(c1):]
    inter4 = p4[len(p3) + len(c3):]
    assert main.input_ids == p1 + c1 + inter3 + c3 + inter4 + c4
    assert main.loss_mask == [0] * len(p1) + [1] * len(c1) + [0] * len(inter3) + [1] * len(c3) + [0] * len(inter4) + [1] * len(c4)
    zeros = lambda ids: [0.0] * len(ids)  # noqa: E731
    logprobs = [rows[i]["completion_logprobs"] for i in (0, 2, 3)]
    assert main.rollout_logprobs == zeros(p1) + logprobs[0] + zeros(inter3) + logprobs[1] + zeros(inter4) + logprobs[2]
    # the interstitials are the tool results, rendered by the template
    assert "<tool_response>\nhello from the notes\n</tool_response>" in tokenizer.text(inter3)
    assert "<tool_response>\nbuy milk\n</tool_response>" in tokenizer.text(inter4)
    assert main.prompt_len == len(p1) and main.sampled_tokens == len(c1) + len(c3) + len(c4)
    assert main.break_diagnosis is None and main.finish_reason == "stop"
    assert title.input_ids == rows[1]["prompt_token_ids"] + rows[1]["completion_token_ids"]
    stats = result.stats
    assert (stats.exchanges, stats.sequences, stats.merged_exchanges, stats.new_lineages) == (4, 2, 2, 2)
    assert sum(stats.breaks.values()) == 0 and stats.compression_ratio == 2.0 and stats.merge_rate == 0.5
    assert stats.trainable_tokens == stats.sampled_tokens == sum(len(r["completion_token_ids"]) for r in rows)
    assert_every_sample_once(result, rows)

    per_request = assemble(gateway.db, "per_request", session=session_id)
    assert [s.input_ids for s in per_request.sequences] == [r["prompt_token_ids"] + r["completion_token_ids"] for r in rows]
    assert per_request.stats.compression_ratio == 1.0
    assert_every_sample_once(per_request, rows)
    # the history really is append-only, so the Polar-style mode agrees and stays faithful
    lenient = assemble(gateway.db, "prefix_merging", session=session_id, lenient=True)
    assert [s.input_ids for s in lenient.sequences] == [main.input_ids, title.input_ids]
    assert lenient.stats.unfaithful_merges == 0 and all(s.faithful for s in lenient.sequences)


def _single_break(gateway: Gateway, session: str):
    rows = gateway.exchanges(session)
    result = assemble(gateway.db, "prefix_merging", session=session)
    assert_every_sample_once(result, rows)
    broken = [s for s in result.sequences if s.break_diagnosis is not None]
    assert len(broken) == 1, [s.break_diagnosis for s in result.sequences]
    return rows, result, broken[0]


def _chain_tokens(rows: list[dict], seqs: list[int]) -> list[int]:
    """prompt + sampled tokens of the last of these exchanges: what a strict chain ending there holds."""
    last = rows[seqs[-1] - 1]
    return last["prompt_token_ids"] + last["completion_token_ids"]


def test_retokenized_break(gateway: Gateway, session_id: str, tokenizer) -> None:
    text = "Hello world, the answer is 42."
    with proxy_env(gateway, session_id):
        chat = Conversation(client_for(), tokenizer)
        chat.user("Say it.")
        chat.ask(text, canonical=False)  # the engine samples it as H|ello| |wo|rl|d...
        chat.user("Thanks.")
        chat.ask("You are welcome")
    rows, result, second = _single_break(gateway, session_id)
    canonical = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    assert rows[0]["completion_token_ids"][:-1] != canonical
    assert tokenizer.text(rows[0]["completion_token_ids"][:-1]) == text
    diagnosis = second.break_diagnosis
    assert diagnosis.kind == "retokenized" and diagnosis.region == "last_sample"
    assert diagnosis.index == common_prefix(_chain_tokens(rows, [1]), rows[1]["prompt_token_ids"])
    assert diagnosis.index > len(rows[0]["prompt_token_ids"])
    assert diagnosis.previous_exchange_id == rows[0]["exchange_id"]
    assert result.stats.breaks["retokenized"] == 1


def test_rerendered_breaks(gateway: Gateway, session_id: str, tokenizer) -> None:
    thinking, tool_args = f"{session_id}-think", f"{session_id}-args"
    with proxy_env(gateway, thinking):
        chat = Conversation(client_for(), tokenizer)
        chat.user("Greet me.")
        chat.ask("<think>\nI should greet\n</think>\n\nHello there", check=False)
        chat.user("Again.")  # Qwen3's template drops the reasoning of turns before the last user query
        chat.ask("Hi")
    with proxy_env(gateway, tool_args):
        chat = Conversation(client_for(), tokenizer)
        chat.user("Read notes.txt.")
        call = chat.ask(read_call("notes.txt", compact=True), check=False)  # {"path":"notes.txt"}, re-serialized with a space
        assert json.loads(call.choices[0].message.tool_calls[0].function.arguments) == {"path": "notes.txt"}
        chat.tool_result(call, "hello")
        chat.ask("It says hello")

    rows, _, second = _single_break(gateway, thinking)
    assert "<think>" in rows[1]["request_body"]  # the harness sent the reasoning back; the template dropped it
    diagnosis = second.break_diagnosis
    assert (diagnosis.kind, diagnosis.region) == ("rerendered", "last_sample")
    assert diagnosis.index == len(rows[0]["prompt_token_ids"])  # the very first sampled token, <think>
    assert tokenizer.text(diagnosis.chain_tokens).startswith("<think>")
    # the Polar-style lenient mode merges it anyway: turn 2 is then trained in a context it was not sampled in
    lenient = assemble(gateway.db, "prefix_merging", session=thinking, lenient=True)
    (merged,) = lenient.sequences
    p1, c1, p2, c2 = rows[0]["prompt_token_ids"], rows[0]["completion_token_ids"], rows[1]["prompt_token_ids"], rows[1]["completion_token_ids"]
    end_of_reply = p2.index(c1[-1], len(p1))  # the re-rendered reply's <|im_end|>
    assert merged.input_ids == p1 + c1 + p2[end_of_reply + 1:] + c2
    assert not merged.faithful and lenient.stats.unfaithful_merges == 1
    assert p1 + c1 != p2[: len(p1) + len(c1)]

    rows, _, second = _single_break(gateway, tool_args)
    diagnosis = second.break_diagnosis
    assert (diagnosis.kind, diagnosis.region) == ("rerendered", "last_sample")
    assert diagnosis.index == common_prefix(_chain_tokens(rows, [1]), rows[1]["prompt_token_ids"])
    assert re.search(r'"path":?$', tokenizer.text(rows[1]["prompt_token_ids"][: diagnosis.index]))  # where the space went in


def test_rewritten_breaks(gateway: Gateway, session_id: str, tokenizer) -> None:
    edited_user, edited_reply = f"{session_id}-user", f"{session_id}-reply"
    with proxy_env(gateway, edited_user):
        chat = Conversation(client_for(), tokenizer)
        chat.user("First question.")
        chat.ask("First answer")
        chat.user("Second question.")
        chat.ask("Second answer")
        chat.messages[1]["content"] = "First question, edited."  # the harness rewrites history
        chat.user("Third question.")
        chat.ask("Third answer")
    with proxy_env(gateway, edited_reply):
        chat = Conversation(client_for(), tokenizer)
        chat.user("Greet me.")
        chat.ask("Hello there")
        chat.messages[-1]["content"] = "Hello, there!"  # the harness changes the assistant's reply
        chat.user("Again.")
        chat.ask("Hi")

    rows, result, third = _single_break(gateway, edited_user)
    assert [s.exchange_seqs for s in result.sequences] == [[1, 2], [3]]
    diagnosis = third.break_diagnosis
    assert (diagnosis.kind, diagnosis.region) == ("rewritten", "context")
    assert diagnosis.index == common_prefix(_chain_tokens(rows, [1, 2]), rows[2]["prompt_token_ids"])
    assert diagnosis.previous_sequence_id == result.sequences[0].sequence_id
    assert tokenizer.text(rows[2]["prompt_token_ids"][diagnosis.index:]).startswith(",")

    rows, _, second = _single_break(gateway, edited_reply)
    assert (second.break_diagnosis.kind, second.break_diagnosis.region) == ("rewritten", "last_sample")


def test_truncated_break(gateway: Gateway, session_id: str, tokenizer) -> None:
    # max_tokens cuts the reply inside a character: "na" + the first byte of "ï" (biased so the cut lands there)
    pieces = [tokenizer.tokenizer.token_to_id("na"), next(i for i in range(512) if tokenizer.token_bytes(i) == "ï".encode()[:1])]
    with proxy_env(gateway, session_id):
        chat = Conversation(client_for(), tokenizer)
        chat.user("Say it.")
        cut = chat.ask("naïve", canonical=False, max_tokens=2, logit_bias={str(i): 100 for i in pieces})
        assert cut.choices[0].finish_reason == "length"
        chat.user("Go on.")
        chat.ask("Done")
    rows, _, second = _single_break(gateway, session_id)
    assert rows[0]["finish_reason"] == "length" and rows[0]["completion_token_ids"] == pieces
    diagnosis = second.break_diagnosis
    assert (diagnosis.kind, diagnosis.region) == ("truncated", "last_sample")
    assert diagnosis.index == common_prefix(_chain_tokens(rows, [1]), rows[1]["prompt_token_ids"]) == len(rows[0]["prompt_token_ids"]) + 1


def test_sdk_retry_does_not_fork(make_gateway, session_id: str, tokenizer) -> None:
    hook = Path(__file__).resolve().parents[1] / "support" / "assembler_hooks.py"
    gw = make_gateway("--engine-hook", f"{hook}:slow_first_attempt")
    with proxy_env(gw, session_id):
        chat = Conversation(openai.OpenAI(api_key="sk-test-assembler", timeout=120.0, max_retries=2), tokenizer)
        chat.user("Greet me.")
        chat.ask("Hello there")
        chat.user("Again.")
        # a short timeout on this turn only (a slow machine must not make the other turns retry): its slow first
        # attempt (800 forced tokens, ~5 s here) times out and the SDK sends the same request again
        chat.ask("Hi again", timeout=2.0)
        chat.user("Once more.")
        chat.ask("Hi")
    # on a loaded machine the retry can time out too (it shares the engine with the slow attempt), so the SDK may
    # have made a third attempt; every attempt that reached the gateway is in, the ones it gave up on as the client's
    # hang-up. An attempt can also time out before its request is sent (the SDK's connect timeout covers the CONNECT
    # and TLS handshake, 2 s here): the gateway never saw it, so its retry count is missing from the rows (seen in CI)
    deadline = time.monotonic() + 60
    while not _attempts_settled(rows := gw.exchanges(session_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    first, *attempts, last = rows
    assert [(r["seq"], r["status"], r["retry_count"]) for r in (first, last)] == [(1, "ok", 0), (len(rows), "ok", 0)]
    abandoned, answered = attempts[:-1], attempts[-1]
    # the engine call of an attempt the SDK gave up on is cancelled and recorded as such, never as ok
    assert len(abandoned) >= 1 and [r["status"] for r in attempts] == ["client_disconnected"] * len(abandoned) + ["ok"]
    retry_counts = [r["retry_count"] for r in attempts]
    assert retry_counts == sorted(set(retry_counts)) and retry_counts[0] == 0 and retry_counts[-1] <= 2  # max_retries=2
    assert len({r["request_body"] for r in attempts}) == 1

    result = assemble(gw.db, "prefix_merging", session=session_id)
    assert_every_sample_once(result, rows)
    # the conversation went on from the reply the SDK got: one chain; what the client never saw is not trained on
    [chain] = result.sequences
    assert chain.exchange_seqs == [1, answered["seq"], last["seq"]] and chain.break_diagnosis is None
    assert sum(result.stats.breaks.values()) == 0


def _attempts_settled(rows: list[dict]) -> bool:
    """Every attempt of the retried turn that reached the gateway is in: no hole in the seqs (a seq is taken when
    the request arrives, the row is committed when its attempt ends), the last turn after them, the last attempt
    answered."""
    if len(rows) < 4 or [r["seq"] for r in rows] != list(range(1, len(rows) + 1)):
        return False
    attempts = [r for r in rows if r["request_body"] == rows[1]["request_body"]]
    return len(attempts) == len(rows) - 2 and attempts[-1]["status"] == "ok"


def _one_turn(gw: Gateway, session: str, tokenizer) -> None:
    with proxy_env(gw, session):
        chat = Conversation(client_for(), tokenizer)
        chat.user("Solve the task.")
        chat.ask("Done")


def test_rewards_groups_parquet_and_table(make_gateway, session_id: str, tokenizer, tmp_path: Path) -> None:
    from datasets import load_dataset

    gw = make_gateway()
    task_a = {f"{session_id}-a{i}": reward for i, reward in enumerate([1.0, 0.0, 0.5, 0.25])}
    task_b = {f"{session_id}-b{i}": 1.0 for i in range(2)}  # same reward: no signal
    crashed = f"{session_id}-crashed"
    for session in [*task_a, *task_b, crashed]:
        _one_turn(gw, session, tokenizer)
    rewards_csv = tmp_path / "rewards.csv"
    with rewards_csv.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["session_id", "reward", "task_id"])
        writer.writerows([session, reward, "task-b"] for session, reward in task_b.items())

    command = [sys.executable, "-m", "polar_mitm.cli", "assemble", "--db", str(gw.db), "--builder", "per_request", "--rewards", str(rewards_csv)]
    # while the gateway holds the store: the gateway loads the table through its own writer
    held = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert held.returncode == 0, held.stderr
    assert f"loaded into table trajectories of {gw.db} through the writer of the gateway" in held.stdout
    assert not gw.db.with_name(gw.db.name + ".trajectories-per_request.parquet").exists()  # no --out: not kept
    assert gw.rows("SELECT count(*) AS n FROM trajectories WHERE builder = 'per_request'")[0]["n"] == 7
    assert gw.rows("SELECT count(*) AS n FROM breaks")[0]["n"] == 0  # the views over it work while it runs

    gw.stop()
    # what a rollout server records: task, status and reward of each session (the crashed one failed)
    con = duckdb.connect(str(gw.db))
    for session, reward in task_a.items():
        con.execute("UPDATE sessions SET task_id = 'task-a', status = 'completed', reward = ? WHERE session_id = ?", [reward, session])
    con.execute("UPDATE sessions SET task_id = 'task-a', status = 'failed' WHERE session_id = ?", [crashed])
    con.close()

    out = tmp_path / "trajectories.parquet"
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "loaded into table trajectories" in done.stdout
    table_rows = store.query_dicts(gw.db, "SELECT session_id, advantage FROM trajectories WHERE builder = 'per_request'")
    assert len(table_rows) == 7

    rows = {row["session_id"]: row for row in load_dataset("parquet", data_files=str(out), split="train")}
    assert set(rows) == {*task_a, *task_b, crashed}
    mean, std = statistics.mean(task_a.values()), statistics.stdev(task_a.values())
    for session, reward in task_a.items():
        row = rows[session]
        assert (row["group_id"], row["task_id"], row["reward"], row["trainable"], row["no_signal"]) == ("task-a", "task-a", reward, True, False)
        assert row["advantage"] == pytest.approx((reward - mean) / (std + EPSILON), abs=1e-12)
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["rollout_logprobs"]) and sum(row["loss_mask"]) > 0
    for session in task_b:
        assert (rows[session]["group_id"], rows[session]["advantage"], rows[session]["no_signal"]) == ("task-b", 0.0, True)
    failed = rows[crashed]
    assert (failed["trainable"], failed["reward"], failed["advantage"], sum(failed["loss_mask"])) == (False, 0.0, 0.0, 0)
    assert {row["session_id"]: row["advantage"] for row in table_rows} == {s: r["advantage"] for s, r in rows.items()}
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)  # replaces that builder's rows
    assert again.returncode == 0, again.stderr
    assert store.query(gw.db, "SELECT count(*) FROM trajectories")[1] == [[7]]
    assert store.query(gw.db, "SELECT count(*) FROM breaks")[1] == [[0]]  # the store's views read the table

    # in the process that holds the store (as the rollout server does): read and write through its Store
    live = store.Store(gw.db)
    try:
        merged = assemble(builder="prefix_merging", store=live, rewards_csv=rewards_csv)
        outcome = store_trajectories(None, write_parquet(merged.sequences, tmp_path / "live.parquet"), store_object=live)
        assert outcome.written
        assert live.query("SELECT builder, count(*) FROM trajectories GROUP BY builder ORDER BY builder")[1] == [("per_request", 7), ("prefix_merging", 7)]
    finally:
        live.close()

    # the Python API gives the same groups; opting in makes the crashed session count (reward 0)
    result = assemble(gw.db, "per_request", rewards_csv=rewards_csv, include_incomplete=True)
    groups = {g.group_id: g for g in result.groups}
    assert groups["task-b"].no_signal and not groups["task-a"].no_signal
    assert groups["task-a"].scored_sessions == 5 and groups["task-a"].mean == pytest.approx(statistics.mean([*task_a.values(), 0.0]))
