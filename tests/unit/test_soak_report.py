"""The soak's join of what clients got with the store's rows (bench/soak_report.py): each invariant counts what it
names, so a soak that loses a row, stores one twice or answers a fault as a success fails."""

from __future__ import annotations

from collections import Counter

from bench.soak import PhaseRun
from bench.soak_client import Sent
from bench.soak_report import render_markdown, rss_figures, summarize


def sent(n: int, fault: str | None = None, success: bool = True, exchange_id: str | None = None, stream: bool = False) -> Sent:
    return Sent(f"soakreq-chat-000-{n:05d}", "chat", "soak-chat-000", "openai_chat", stream, fault, 200 if success else 502, exchange_id or f"x{n}", success)


def row(n: int, status: str = "ok", exchange_id: str | None = None) -> dict:
    return {"exchange_id": exchange_id or f"x{n}", "session_id": "soak-chat-000", "status": status, "http_status": 200, "stream": False, "api": "openai_chat", "rid": f"soakreq-chat-000-{n:05d}"}


def run(sent_list: list[Sent], rows: list[dict]) -> PhaseRun:
    return PhaseRun("chat", sent_list, rows, [], [], Counter(), None, 1.0, {})


def invariants(sent_list: list[Sent], rows: list[dict]) -> dict[str, int]:
    return {name: check["value"] for name, check in summarize([run(sent_list, rows)], None)["invariants"].items()}


def test_a_clean_run_holds_every_invariant() -> None:
    clean = [sent(1), sent(2, "engine_5xx", success=False), sent(3, "hangup", success=False)]
    rows = [row(1), row(2, "engine_error"), row(3, "client_disconnected"), row(4, "aborted", "x4a"), row(4)]
    assert set(invariants(clean + [sent(4)], rows).values()) == {0}


def test_each_failure_is_counted_by_its_own_invariant() -> None:
    counted = invariants(
        [sent(1), sent(2), sent(3, "garbage"), sent(4, "hangup_stream", success=False, stream=True), sent(5, "malformed", success=False)],
        [row(1, "client_disconnected"), row(2), row(2, "ok", "x2b"), row(3), row(4), row(5, "ok")],
    )
    # 1: answered ok, its row not ok -> lost; 2: two ok rows for one request; 3: a garbage reply answered ok and
    # stored ok; 4: abandoned, stored ok; 5: a malformed body answered 502 and stored ok
    assert counted == {"lost": 1, "duplicates": 1, "faults_answered_as_success": 1, "faults_stored_ok": 2, "abandoned_stored_trainable": 1, "bodies_answered_5xx": 1}


def test_rss_slope_shows_a_leak_and_the_table_renders() -> None:
    leaking = [(float(t), 0, 200.0 + t) for t in range(0, 120, 2)]
    figures = rss_figures(leaking)
    assert figures["start_mb"] == 200 and figures["end_mb"] == 318 and 59 < figures["slope_mb_per_min"] < 61
    results = summarize([run([sent(1)], [row(1)])], None)
    results.update(machine={"commit": "abc", "cores": 2, "cpu": "cpu", "memory_gb": 1.0, "load": (1.0, 1.0, 1.0)}, when="now", seed=1, sessions=1, mode="quick", wall_s=1.0)
    table = render_markdown(results)
    assert "| **lost** (answered ok, no ok row) | 0 |" in table and "| lost | 0 | yes |" in table
