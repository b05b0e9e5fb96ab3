"""Options whose values are a registry's names (engine kinds, render modes, tool parsers) take their choices from
that registry, in every target the option table generates: mitmproxy's option, the config model, the flags and
their --help; a value outside them is refused with the names. No engine needed."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.exceptions import OptionsError
from mitmproxy.test import taddons
from pydantic import ValidationError

from polar_mitm.cli import build_parser
from polar_mitm.engines import ENGINES
from polar_mitm.errors import ConfigError
from polar_mitm.gateway import options
from polar_mitm.gateway.addon import PolarAddon
from polar_mitm.gateway.config import GatewayConfig
from polar_mitm.render import parsers
from polar_mitm.render.serve import RENDER_MODES

# option -> the registry its values come from
REGISTRY_NAMES = {"engine": ENGINES.names(), "render": tuple(RENDER_MODES), "tool_parser": parsers.TOOL_FORMATS}
WITH_CHOICES = [option for option in options.OPTIONS if option.choices is not None]
POLAR_MITM = Path(sys.executable).with_name("polar-mitm")  # the installed console script


def test_each_option_with_choices_is_its_registrys_names_in_the_table_mitmproxy_and_the_config_model() -> None:
    assert {option.name: tuple(option.choices or ()) for option in WITH_CHOICES} == REGISTRY_NAMES
    assert REGISTRY_NAMES["engine"] == ("vllm", "sglang") and REGISTRY_NAMES["tool_parser"] == ("auto", "hermes", "qwen3_coder", "none")
    assert REGISTRY_NAMES["render"] == ("chat", "tokens", "auto") and parsers.TOOL_FORMATS[1:] == parsers.TOOL_PARSERS.names()
    schema = GatewayConfig.model_json_schema()["properties"]
    with taddons.context(Proxyserver(), PolarAddon()) as tctx:  # the proxy's options: configure() sets one
        for option in WITH_CHOICES:
            names = REGISTRY_NAMES[option.name]
            assert tctx.options._options[option.mitmproxy_name].choices == names, option.name  # what --options and the console list
            assert schema[option.name]["enum"] == list(names) and option.default in names, option.name


def test_mitmproxy_set_refuses_another_value_in_configure_naming_the_choices() -> None:
    """mitmproxy lists choices but accepts any string on --set: the addon's configure() refuses it, from the table."""
    addon = PolarAddon()
    with taddons.context(Proxyserver(), addon) as tctx:
        for option in WITH_CHOICES:
            names = ", ".join(REGISTRY_NAMES[option.name])
            with pytest.raises(OptionsError, match=f"^{option.mitmproxy_name} must be one of {names}, got 'nope'$"):
                tctx.configure(addon, **{option.mitmproxy_name: "nope"})
            assert getattr(tctx.options, option.mitmproxy_name) == option.default  # rolled back
        tctx.configure(addon, polar_render="tokens", polar_tool_parser="qwen3_coder")  # the registry's names pass


def test_the_config_model_refuses_another_value() -> None:
    with pytest.raises(ValidationError, match="Input should be 'vllm' or 'sglang'"):
        GatewayConfig(upstream="http://127.0.0.1:9/v1", engine="tgi")


def test_gateway_help_lists_each_options_choices() -> None:
    done = subprocess.run([str(POLAR_MITM), "gateway", "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps help lines
    for option in WITH_CHOICES:
        assert f"{option.flag_names[-1]} {option.name.upper()} {option.flag_help}; one of {', '.join(REGISTRY_NAMES[option.name])}" in text, option.name


def test_a_bad_flag_value_is_one_error_line_naming_the_choices_and_exit_code_2() -> None:
    done = subprocess.run([str(POLAR_MITM), "gateway", "--upstream", "http://127.0.0.1:9/v1", "--engine", "nope"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.splitlines()[-1] == "polar-mitm gateway: error: argument --engine: invalid choice: 'nope' (choose from 'vllm', 'sglang')"


@pytest.mark.parametrize("command", [["gateway"], ["rollout", "serve"], ["rollout", "run", "task.yaml"]])
@pytest.mark.parametrize("option", WITH_CHOICES, ids=[option.name for option in WITH_CHOICES])
def test_every_command_with_the_flag_refuses_another_value(command: list[str], option: options.Option) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command, "--upstream", "http://127.0.0.1:9/v1", option.flag_names[-1], "nope"])
    choices = ", ".join(repr(name) for name in REGISTRY_NAMES[option.name])
    assert exited.value.code == 2 and err.getvalue().splitlines()[-1].endswith(f"argument {option.flag_names[-1]}: invalid choice: 'nope' (choose from {choices})")


def test_building_the_cli_imports_no_registry_for_its_choices() -> None:
    """Every `polar-mitm` command builds every flag; the choices are read only when --help or a check needs them."""
    code = "import sys; from polar_mitm.cli import build_parser; build_parser(); print(sorted(m for m in sys.modules if m.startswith(('polar_mitm.engines', 'polar_mitm.render'))))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_tool_parsers_are_a_registry_of_tool_call_parsers() -> None:
    registry = parsers.TOOL_PARSERS
    assert registry.kind == "tool parser"
    with pytest.raises(ConfigError, match="unknown tool parser 'xml'; valid: hermes, qwen3_coder, none"):
        parsers.parse_output("text", "xml")
    tagged = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    assert [(name, registry.get(name)("plain text", [])) for name in registry] == [(name, ("plain text", [])) for name in registry]
    assert registry.get("none")(tagged, []) == (tagged, [])  # none: the markup stays content
    content, [call] = registry.get("hermes")("Listing.\n" + tagged, [])
    assert (content, call.name, call.arguments) == ("Listing.", "ls", "{}")
    with pytest.raises(ValueError, match="not JSON"):
        registry.get("hermes")("<tool_call>\n{oops\n</tool_call>", [])


def test_the_tool_call_format_is_read_from_the_chat_template() -> None:
    qwen3 = '{%- if tools %}<tools>{{ tools | tojson }}</tools>{%- endif %}{{ "<tool_call>\\n" }}{{ tool_call | tojson }}{{ "\\n</tool_call>" }}'
    coder = '{%- if tools %}<tools>{% endif %}<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>'
    assert parsers.format_of_template(qwen3) == "hermes"
    assert parsers.format_of_template(coder) == "qwen3_coder"  # inside <tool_call> too: XML first
    assert parsers.format_of_template("{% for m in messages %}{{ m.content }}{% endfor %}") == "none"  # renders no tools
    assert parsers.format_of_template("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]") is None  # unknown
