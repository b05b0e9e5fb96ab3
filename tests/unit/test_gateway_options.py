"""The gateway's options come from one table (polar_mitm/gateway/options.py): the addon's mitmproxy options, the
config model, the flags of `polar-mitm gateway` / `rollout serve` / `rollout run` and make_master's update are
generated from it. No engine needed."""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest

from polar_mitm.cli import build_parser
from polar_mitm.cli import rollout as rollout_cli
from polar_mitm.gateway import options
from polar_mitm.gateway.addon import PolarAddon
from polar_mitm.gateway.config import GatewayConfig
from polar_mitm.util import free_port

ADDON_OPTIONS = [option for option in options.OPTIONS if option.addon]


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return out.getvalue()


def _values(tmp_path: Path) -> dict[str, Any]:
    """A value other than the default for every addon option (a new option needs one here)."""
    hook = tmp_path / "hook.py"
    hook.write_text("def hook(request, context):\n    return request\n")
    return {
        "upstream": "http://127.0.0.1:9/v1", "db": tmp_path / "store.duckdb", "engine": "sglang", "engine_model": "served",
        "engine_timeout": 12.5, "engine_max_model_len": 32768, "split_reasoning": True, "model_map": ["gpt-*=served"], "require_auth": True,
        "passthrough": ["*.example.org"], "engine_hook": f"{hook}:hook", "sql_port": free_port(),
        "render": "tokens", "render_model": str(tmp_path / "model"), "tool_parser": "qwen3_coder",
        "policy_version": 7, "control_token": "t0k", "keepalive_interval": 2.5,
        "heap_trim_s": 0.5, "store_memory_mb": 300, "store_journal_mb": 16, "store_compact_slice_mb": 4, "store_merge_fanin": 16, "store_process": True, "lineage_mb": 48,
    }


def test_every_addon_option_is_declared_by_load_with_the_tables_type_default_and_help() -> None:
    declared: dict[str, tuple] = {}

    class Loader:
        def add_option(self, name: str, typespec: Any, default: Any, help: str, choices: Any = None) -> None:
            declared[name] = (typespec, default, help)

    PolarAddon().load(Loader())
    assert set(declared) == {option.mitmproxy_name for option in ADDON_OPTIONS}
    for option in ADDON_OPTIONS:
        _, default, help = declared[option.mitmproxy_name]
        assert help == option.help and default == options.mitmproxy_value(option, option.default)
    assert declared["polar_engine_timeout"][:2] == (float, 600.0) and declared["polar_db"][:2] == (str, "polar.duckdb")


def test_the_config_model_and_the_gateway_flags_are_the_table() -> None:
    assert list(GatewayConfig.model_fields) == [option.name for option in options.OPTIONS]
    for option in options.OPTIONS:
        field = GatewayConfig.model_fields[option.name]
        assert field.is_required() == option.required and field.description == option.help
        if not option.required:
            assert field.get_default(call_default_factory=True) == (list(option.default) if option.type == list[str] else option.default)
    gateway_help = _help("gateway")
    for option in options.OPTIONS:
        assert all(flag in gateway_help for flag in option.flag_names) == option.cli, option.name
    # parsed defaults are the model's defaults
    args = build_parser().parse_args(["gateway", "--upstream", "http://127.0.0.1:9/v1"])
    assert GatewayConfig(**options.from_arguments(args)) == GatewayConfig(upstream="http://127.0.0.1:9/v1")


@pytest.mark.parametrize("command", ["serve", "run"])
def test_rollout_serve_and_run_list_every_gateway_option_but_those_the_node_sets(command: str) -> None:
    from polar_mitm.rollout.node import NODE_OPTIONS

    text = _help("rollout", command)
    assert set(NODE_OPTIONS) <= set(rollout_cli.NODE_SETS)
    for option in options.OPTIONS:
        if not option.cli:
            continue
        if option.name == "host" and command == "serve":
            continue  # serve's --host is its API's listen address (as --port is its API's), not the node's gateway's
        flag = "--gateway-port" if option.name == "port" else option.flag_names[-1]
        assert (flag in text) == (option.name not in rollout_cli.NODE_SETS), option.name
    for flag in ("--engine-timeout", "--split-reasoning", "--model-map", "--passthrough", "--sql-port"):  # missing before the table
        assert flag in text


def test_rollout_flags_reach_the_nodes_gateway(tmp_path: Path) -> None:
    from polar_mitm.rollout.node import GatewayNode

    argv = ["rollout", "serve", "--port", "8071", "--upstream", "http://127.0.0.1:9/v1", "--db", str(tmp_path / "s.duckdb"), "--confdir", str(tmp_path / "conf"),
            "--engine-timeout", "12.5", "--split-reasoning", "--model-map", "gpt-*=served", "--model-map", "claude-*", "--prepare-limit", "3"]
    args = build_parser().parse_args(argv)
    node = GatewayNode(rollout_cli._node_config(args))  # not started: configuration only
    config = node.gateway.config
    assert (args.port, config.engine_timeout, config.split_reasoning, config.model_map) == (8071, 12.5, True, ["gpt-*=served", "claude-*"])
    assert config.require_auth is True and config.web is False and config.port == node.port != 0
    assert config.confdir == str((tmp_path / "conf").resolve()) and node.config.limits.prepare == 3


def test_make_master_sets_every_addon_option_from_the_config(tmp_path: Path) -> None:
    from polar_mitm.gateway import server

    values = _values(tmp_path)
    assert set(values) == {option.name for option in ADDON_OPTIONS}

    async def main() -> None:
        master = server.make_master(GatewayConfig(confdir=str(tmp_path / "confdir"), **values))
        try:
            for option in ADDON_OPTIONS:
                expected = str(values[option.name]) if option.type is Path else values[option.name]
                assert getattr(master.options, option.mitmproxy_name) == expected, option.name
        finally:
            # the store opens in running(), once every option is set and checked: nothing is opened before
            assert master.addons.get("polaraddon").store is None
            assert not Path(values["db"]).exists()

    asyncio.run(main())


def test_values_are_checked_in_the_addons_configure(tmp_path: Path) -> None:
    """The table declares; configure() checks, for mitmdump --set and the CLI alike."""
    from mitmproxy.exceptions import OptionsError

    from polar_mitm.gateway import server

    async def main() -> None:
        master = server.make_master(GatewayConfig(upstream="http://127.0.0.1:9/v1", db=tmp_path / "store.duckdb", confdir=str(tmp_path / "confdir")))
        try:
            for option, value, message in [
                ("polar_engine_timeout", 0.0, "must be positive"),
                ("polar_store_journal_mb", -1, "must be 0"),
                ("polar_heap_trim_s", -1.0, "polar_heap_trim_s must be 0 \\(never\\) or positive"),
                ("polar_store_merge_fanin", 1, "must be 0 \\(off\\) or at least 2"),
                ("polar_store_merge_fanin", -16, "must be 0 \\(off\\) or at least 2"),
                ("polar_engine", "tgi", "must be one of vllm, sglang"),
                ("polar_engine_hook", "no-function-named", "polar_engine_hook: must be 'module:function'"),
                ("polar_model_map", ["=served"], "has no pattern"),
            ]:
                with pytest.raises(OptionsError, match=message):
                    master.options.update(**{option: value})
        finally:
            assert master.addons.get("polaraddon").store is None and not (tmp_path / "store.duckdb").exists()

    asyncio.run(main())


def test_lineage_mb_bounds_the_tokens_modes_lineages_and_defaults_to_the_bridges_bound(tmp_path: Path) -> None:
    from mitmproxy.exceptions import OptionsError

    from polar_mitm.gateway import server
    from polar_mitm.render import bridge

    assert {option.name: option.default for option in options.OPTIONS}["lineage_mb"] << 20 == bridge.MAX_LINEAGE_BYTES

    async def main() -> None:
        config = GatewayConfig(upstream="http://127.0.0.1:9/v1", db=tmp_path / "store.duckdb", confdir=str(tmp_path / "confdir"), render="tokens", lineage_mb=48)
        addon = server.make_master(config).addons.get("polaraddon")
        assert addon.tokens is not None and addon.tokens.lineages.max_bytes == 48 << 20
        master = server.make_master(config)
        tokens = master.addons.get("polaraddon").tokens
        master.options.update(polar_lineage_mb=64)  # changed while running: the same token path (its renderer, its lineages), a new bound
        assert master.addons.get("polaraddon").tokens is tokens and tokens.lineages.max_bytes == 64 << 20
        with pytest.raises(OptionsError, match="polar_lineage_mb must be at least 1"):
            master.options.update(polar_lineage_mb=0)

    asyncio.run(main())
