"""The soak's figures: each request joined with the store's rows, the invariants, and the table (markdown).

Joins: a reply's `x-polar-exchange-id` header names its row; every row also keeps the request's text, whose
`soakreq-...` id names the request (also for requests whose client never saw a header).

    lost                        answered ok (a complete successful reply read) without an ok row of its exchange id
    duplicates                  an exchange id in two rows, or a request with two rows besides pause-aborted attempts
    faults answered as success  a request with a fault that must fail (engine faults, malformed, bad credentials)
                                whose client read a complete successful reply
    faults stored ok            such a request with an ok (trainable) row
    abandoned stored trainable  a call whose client hung up before its reply, stored ok
    bodies answered 5xx         a malformed or oversized body answered with a 5xx
"""

from __future__ import annotations

import subprocess
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from bench.common import ROOT
from bench.report import machine as bench_machine
from bench.soak_client import HANGUPS, MUST_FAIL

if TYPE_CHECKING:
    from bench.soak import PhaseRun


def machine() -> dict[str, Any]:
    """bench/report.py's machine, and whether the tree had changes beyond its commit (then the commit is not all)."""
    found = bench_machine()
    try:
        status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        status = ""
    found["uncommitted_changes"] = len(status.splitlines())
    return found


def rss_figures(samples: list[tuple[float, int, float]], generation: int = 0) -> dict[str, Any]:
    """start / middle / end / max MB of one gateway process's samples, and the slope (MB per minute) after warm-up."""
    points = [(t, mb) for t, g, mb in samples if g == generation and mb > 0]
    if len(points) < 3:
        return {"samples": len(points)}
    warm = points[max(1, len(points) // 10) :]
    middle_t = (points[0][0] + points[-1][0]) / 2
    middle = min(points, key=lambda p: abs(p[0] - middle_t))
    mean_t = sum(t for t, _ in warm) / len(warm)
    mean_mb = sum(mb for _, mb in warm) / len(warm)
    spread = sum((t - mean_t) ** 2 for t, _ in warm)
    slope = sum((t - mean_t) * (mb - mean_mb) for t, mb in warm) / spread * 60 if spread else 0.0
    return {
        "samples": len(points), "start_mb": round(points[0][1]), "middle_mb": round(middle[1]), "end_mb": round(points[-1][1]),
        "max_mb": round(max(mb for _, mb in points)), "slope_mb_per_min": round(slope, 1), "over_s": round(points[-1][0] - points[0][0]),
    }


def phase_summary(run: PhaseRun) -> dict[str, Any]:
    by_exchange: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_request: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for row in run.rows:
        by_exchange[row["exchange_id"]].append(row)
        by_request[row["rid"] or None].append(row)
    faults = {s.rid: s.fault for s in run.sent}
    answered = [s for s in run.sent if s.success]
    lost = [s.rid for s in answered if not any(r["status"] == "ok" for r in by_exchange.get(s.exchange_id or "", []))]
    duplicate_exchanges = [x for x, rows in by_exchange.items() if len(rows) > 1]
    duplicate_requests = [rid for rid, rows in by_request.items() if rid and sum(r["status"] != "aborted" for r in rows) > 1]
    ok_requests = {rid for rid, rows in by_request.items() if rid and any(r["status"] == "ok" for r in rows)}
    abandoned = [s for s in run.sent if s.fault in HANGUPS and not s.success]
    abandoned_ok = [s for s in abandoned if s.rid in ok_requests]
    after_kill = [s for s in answered if s.generation > 0]
    return {
        "seconds": round(run.seconds, 1),
        "requests": len(run.sent),
        "streamed": sum(s.stream for s in run.sent),
        "by_api": dict(Counter(s.api for s in run.sent)),
        "faults_planned": dict(sorted(Counter(s.fault for s in run.sent if s.fault).items())),
        "engine_faults_seen": run.engine_faults,
        "pause_cycles": dict(run.pauses),
        "answered_ok": len(answered),
        "rows": len(run.rows),
        "rows_by_status": dict(sorted(Counter(r["status"] for r in run.rows).items())),
        "rows_without_request_id": len(by_request.get(None, [])),
        "lost": len(lost), "lost_requests": lost[:20],
        "duplicates": len(duplicate_exchanges) + len(duplicate_requests), "duplicate_ids": (duplicate_exchanges + duplicate_requests)[:20],
        "faults_answered_as_success": sum(s.fault in MUST_FAIL and s.success for s in run.sent),
        "faults_answered_as_success_requests": [s.as_dict() for s in run.sent if s.fault in MUST_FAIL and s.success][:20],
        "faults_stored_ok": sum(faults.get(rid) in MUST_FAIL for rid in ok_requests),
        "faults_stored_ok_rows": [r for rid in sorted(ok_requests) if faults.get(rid) in MUST_FAIL for r in by_request[rid]][:20],
        "abandoned": len(abandoned),
        "abandoned_stored_trainable": len(abandoned_ok),
        "abandoned_stored_trainable_by_kind": dict(Counter(s.fault for s in abandoned_ok)),
        "bodies_answered_5xx": sum(s.fault in ("malformed", "oversized") and (s.status or 0) >= 500 for s in run.sent),
        "gateway_killed_at_s": round(run.kill_at_s, 1) if run.kill_at_s is not None else None,
        "gateway_restarts_s": [round(r, 2) for r in run.restarts_s],
        "gateway_restart_errors": run.restart_errors,
        "answered_ok_after_restart": len(after_kill),
        "rss": rss_figures(run.rss, 0),
        "rss_after_restart": rss_figures(run.rss, 1) if run.restarts_s else None,
        "rss_samples": [(round(t), g, round(mb)) for t, g, mb in run.rss[:: max(1, len(run.rss) // 60)]],  # ~60 of them
        "failed_by_the_sigkill": sum(s.across_kill and not s.success for s in run.sent),
        "errors_unplanned": dict(Counter(s.error for s in run.sent if not s.success and not s.fault and not s.across_kill).most_common(12)),
        "errors_planned": dict(sorted(Counter(f"{s.fault}: {s.error}" for s in run.sent if not s.success and s.fault).items())),
    }


INVARIANTS = ("lost", "duplicates", "faults_answered_as_success", "faults_stored_ok", "abandoned_stored_trainable", "bodies_answered_5xx")


def summarize(runs: list[PhaseRun], rollout: dict[str, Any] | None) -> dict[str, Any]:
    phases = {run.name: phase_summary(run) for run in runs}
    invariants: dict[str, dict[str, Any]] = {}
    for name in INVARIANTS:
        value = sum(p[name] for p in phases.values())
        invariants[name] = {"value": value, "holds": value == 0}
    for name, phase in phases.items():
        if phase["gateway_killed_at_s"] is not None:  # the phase SIGKILLed its gateway: it came back and served
            restarted = phase["answered_ok_after_restart"]
            invariants[f"gateway_serves_after_sigkill ({name})"] = {"value": restarted, "holds": bool(phase["gateway_restarts_s"]) and restarted > 0}
    if rollout is not None:
        for name, value in rollout["invariants"].items():
            invariants[f"rollout_{name}"] = value
    return {"phases": phases, "rollout": rollout, "invariants": invariants}


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    return "-" if value is None else str(value)


ROWS = (
    ("requests", "requests"), ("streamed", "of them streamed"), ("faults_planned", "faults injected, by kind"),
    ("engine_faults_seen", "engine faults the stand-in served"), ("pause_cycles", "pause/resume cycles"), ("answered_ok", "answered ok"),
    ("rows", "rows"), ("rows_by_status", "rows by status"), ("lost", "**lost** (answered ok, no ok row)"), ("duplicates", "**duplicates**"),
    ("faults_answered_as_success", "**faults answered as success**"), ("faults_stored_ok", "faults stored ok"),
    ("abandoned", "calls abandoned by their client"), ("abandoned_stored_trainable", "**abandoned calls stored trainable**"),
    ("bodies_answered_5xx", "malformed/oversized bodies answered 5xx"), ("gateway_killed_at_s", "gateway SIGKILLed at (s into the phase)"),
    ("gateway_restarts_s", "gateway restart after SIGKILL (s)"),
    ("answered_ok_after_restart", "answered ok after the restart"), ("failed_by_the_sigkill", "requests in flight at the SIGKILL, failed"),
)


def _load(load: Any) -> str:
    return " / ".join(f"{x:.1f}" for x in load) if load else "?"


def render_markdown(results: dict[str, Any]) -> str:
    phases = results["phases"]
    names = list(phases)
    m = results["machine"]
    lines = [
        f"Soak ({results['mode']}, seed {results['seed']}, {results['sessions']} sessions), {results['when']}, commit {m['commit']}"
        f"{' with ' + str(m['uncommitted_changes']) + ' files changed beyond it' if m.get('uncommitted_changes') else ''}: "
        f"{m['cores']} cores ({m['cpu']}, {m['memory_gb']:.0f} GiB), load average (1/5/15 min) at the start {_load(results.get('load_at_start'))} and at the end "
        f"{_load(m['load'])}, {results['wall_s']:.0f} s in all.",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(phases[n].get(key)) for n in names) + " |")
    for key, label in (("rss", "gateway RSS MB start / middle / end (max), slope"), ("rss_after_restart", "... after the restart")):
        cells = []
        for n in names:
            r = phases[n].get(key) or {}
            cells.append(f"{r['start_mb']} / {r['middle_mb']} / {r['end_mb']} ({r['max_mb']}), {r['slope_mb_per_min']:+} MB/min over {r['over_s']} s" if "start_mb" in r else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| errors by class (no fault planned) | " + " | ".join(_cell(phases[n]["errors_unplanned"]) for n in names) + " |")
    rollout = results.get("rollout")
    if rollout:
        lines += ["", "Rollout server (`polar-mitm rollout serve`, SIGKILL mid-run, restart on the same store):", "", "| | |", "|---|---|"]
        lines += [f"| {key.replace('_', ' ')} | {_cell(value)} |" for key, value in rollout["figures"].items()]
    lines += ["", "| invariant | value | holds |", "|---|---|---|"]
    lines += [f"| {name} | {_cell(check['value'])} | {'yes' if check['holds'] else '**NO**'} |" for name, check in results["invariants"].items()]
    lines += ["", "Client errors where a fault was planned (what each fault looked like to its client):", ""]
    for n in names:
        lines.append(f"- {n}: " + _cell(phases[n]["errors_planned"]))
    return "\n".join(lines) + "\n"
