"""The parts of the CLI fixes of issue 31 that need no server: `control`'s parser (sub-commands, and the flag forms it
took before them), gateway discovery over a real gateway file, when a routed command's Node gets the flag that
quiets its proxy-agent warning, and the lines Ctrl-C leaves."""

from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path

import pytest

from polar_mitm import routing
from polar_mitm.cli import build_parser, rollout, rollout_tasks
from polar_mitm.cli.control import _control


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["control", "pause"], {"action": "pause"}),
        (["control", "pause", "--mode", "abort", "--timeout", "5"], {"action": "pause", "mode": "abort", "timeout": 5.0}),
        # the flags before the action, as `control ACTION` took them before it had sub-commands
        (["control", "--mode", "abort", "--gateway", "http://127.0.0.1:1", "pause"], {"action": "pause", "mode": "abort", "gateway": "http://127.0.0.1:1"}),
        (["control", "--gateway", "http://127.0.0.1:1", "resume", "--policy-version", "3"], {"action": "resume", "gateway": "http://127.0.0.1:1", "policy_version": 3}),
        (["control", "status", "--token", "t"], {"action": "status", "token": "t"}),
        (["control", "resume", "--timeout", "9"], {"action": "resume", "timeout": 9.0}),  # accepted by every action, as before
    ],
)
def test_control_takes_its_flags_before_and_after_the_action(argv: list[str], expected: dict[str, object]) -> None:
    args = parsed(*argv)
    assert args.func is _control
    assert {key: getattr(args, key) for key in expected} == expected
    # a flag not given is left to _control's defaults, never set by the action's parser over one given before it
    assert not hasattr(args, "mode") or "mode" in expected


def test_control_without_an_action_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parsed("control")
    assert exit_.value.code == 2 and "{pause,resume,status}" in capsys.readouterr().err


def test_discovery_leaves_node_gateways_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLAR_MITM_GATEWAY", raising=False)
    routing.announce_gateway(tmp_path, "http://127.0.0.1:1001", tmp_path / "user.duckdb")
    routing.announce_gateway(tmp_path, "http://127.0.0.1:1002", tmp_path / "rollout.duckdb", node=True)  # newer
    url, why = routing.find_gateway(tmp_path)
    assert url == "http://127.0.0.1:1001", why
    assert why.endswith("; left out: rollout server gateway node http://127.0.0.1:1002 (pass --gateway to use one)"), why
    # older readers take the file's "url": the user gateway's, though the node is newer
    assert json.loads((tmp_path / routing.GATEWAY_FILE).read_text())["url"] == "http://127.0.0.1:1001"
    routing.withdraw_gateway(tmp_path / routing.GATEWAY_FILE, "http://127.0.0.1:1001")
    url, why = routing.find_gateway(tmp_path)
    assert url == routing.DEFAULT_GATEWAY and "left out: rollout server gateway node http://127.0.0.1:1002" in why, why
    assert routing.find_gateway(tmp_path, "http://127.0.0.1:1002") == ("http://127.0.0.1:1002", "--gateway")


def stand_in_node(directory: Path, version: str) -> Path:
    """A stand-in for a Node release this machine does not have: a `node` that only answers --version."""
    directory.mkdir(parents=True)
    node = directory / "node"
    node.write_text(f"#!/bin/sh\necho v{version}\n")
    node.chmod(node.stat().st_mode | stat.S_IXUSR)
    return node


@pytest.mark.parametrize(("version", "accepts"), [("18.20.4", False), ("20.10.0", False), ("20.11.0", True), ("21.2.0", False), ("21.3.0", True), ("22.0.0", True), ("24.1.0", True)])
def test_only_a_node_that_knows_disable_warning_gets_it(tmp_path: Path, version: str, accepts: bool) -> None:
    assert routing.node_accepts_disable_warning(str(stand_in_node(tmp_path / version, version))) is accepts


def test_proxy_environment_quiets_the_proxy_agent_warning_of_a_new_node_only(tmp_path: Path) -> None:
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    (confdir / routing.CA_FILE).write_text("-----BEGIN CERTIFICATE-----\nstand-in\n-----END CERTIFICATE-----\n")
    new, old = stand_in_node(tmp_path / "new", "22.12.0").parent, stand_in_node(tmp_path / "old", "18.20.4").parent
    env = routing.proxy_environment("s1", confdir, "http://127.0.0.1:8080", base={"PATH": str(new), "NODE_OPTIONS": "--max-old-space-size=512"})
    assert env["NODE_OPTIONS"] == f"--max-old-space-size=512 {routing.QUIET_PROXY_WARNING}"
    assert routing.proxy_environment("s1", confdir, "http://127.0.0.1:8080", base=env)["NODE_OPTIONS"] == env["NODE_OPTIONS"]  # not twice
    assert "NODE_OPTIONS" not in routing.proxy_environment("s1", confdir, "http://127.0.0.1:8080", base={"PATH": str(old)})


def test_ctrl_c_lines_say_what_happened_to_the_task() -> None:
    args = argparse.Namespace(task=Path("hello.yaml"), server=rollout_tasks.DEFAULT_SERVER)
    named = rollout._submit_interrupted_line(args, {"task_id": "hello"}, {"task_id": "hello"})
    assert named.endswith("re-running `polar-mitm rollout submit hello.yaml --wait` re-attaches to it"), named
    assert "`polar-mitm rollout status hello` shows it" in named
    unnamed = rollout._submit_interrupted_line(args, {}, {"task_id": "task-1"})
    assert "`polar-mitm rollout status task-1 --wait` follows it again (re-running submit would start a new task" in unnamed, unnamed
    before = rollout._submit_interrupted_line(args, {}, None)
    assert "interrupted before the server answered" in before and "`polar-mitm rollout list`" in before
    other = argparse.Namespace(task=Path("t.yaml"), server="http://10.0.0.2:9000")
    assert "--server http://10.0.0.2:9000" in rollout._submit_interrupted_line(other, {"task_id": "t"}, {"task_id": "t"})

    serve = argparse.Namespace(gateway_db=Path("polar.duckdb"), ray=None)
    assert rollout._serve_stopped_line({}, serve) == "polar-mitm rollout: stopped (Ctrl-C); no task was running"
    two = rollout._serve_stopped_line({"a": ["a-0", "a-1"], "b": ["b-0"]}, serve)
    assert two.startswith("polar-mitm rollout: stopped (Ctrl-C): cancelled 3 unfinished sessions of tasks a (2), b (1); what they recorded is in /"), two


def test_task_table_lists_tasks_oldest_first() -> None:
    def task(task_id: str, created: str, statuses: list[str]) -> dict[str, object]:
        counts: dict[str, int] = {}
        for status in statuses:
            counts[status] = counts.get(status, 0) + 1
        return {"task_id": task_id, "status": "running", "created_at": created, "counts": counts, "sessions": [{"status": s} for s in statuses]}

    table = rollout_tasks.task_table([task("b", "2026-01-02T10:00:00", ["completed", "running"]), task("a", "2026-01-01T09:00:00.5", ["queued"])])
    assert [line.split()[:4] for line in table.splitlines()] == [["task", "status", "done", "sessions"], ["a", "running", "0/1", "queued"], ["b", "running", "1/2", "completed"]]
    assert table.splitlines()[1].endswith("2026-01-01 09:00:00")
