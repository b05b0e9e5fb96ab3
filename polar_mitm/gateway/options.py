"""The gateway's options, each declared once; everything else that names an option is generated from `OPTIONS`:

- the addon's mitmproxy options (`PolarAddon.load` -> `declare`): `polar_<name>`, as in
  `mitmdump -s addons/polar.py --set polar_engine_timeout=120`;
- the config model (`gateway/config.py` `GatewayConfig`), which `NodeConfig` of the rollout server embeds;
- the flags of `polar-mitm gateway`, `polar-mitm rollout serve` and `polar-mitm rollout run` (`add_arguments`);
- the option update `gateway/server.py` `make_master` applies (`mitmproxy_updates`).

Adding an option is one row here, then reading `ctx.options.polar_<name>` (and checking its value) in the
addon's `configure()`; e.g. a cap on concurrent engine calls:

    Option("engine_concurrency", int, 0, "At most this many engine calls at once (0: no limit).",
           flag_help="concurrent engine calls (default 0: no limit)"),

gives `--set polar_engine_concurrency=8`, `GatewayConfig(engine_concurrency=8)` and `--engine-concurrency 8` on
all three commands (the rollout commands leave out only what the node sets itself: cli/rollout.py NODE_SETS).
Checks on values stay in the addon's `configure()` (one place for mitmdump and the CLI).

An option whose values are a registry's names (engine kinds, render modes, tool parsers) names that registry in
`choices`, as mitmproxy's dumper names its content views: mitmproxy lists them (`--options`, its console), the
config field is a Literal of them, the flag accepts only them and its --help lists them, and `check_choices` refuses
another value in `configure()` (mitmproxy itself accepts any string on `--set`).

Options that are not the addon's (`addon=False`: the listen address, confdir, mitmweb, the terminal log) are
mitmproxy's own or the process's; `make_master` applies them, and they have no `polar_` name.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from polar_mitm.errors import ConfigError
from polar_mitm.session import DEFAULT_CONFDIR


class Choices(Sequence[str]):
    """The names of a registry ("module:attribute" of a `Registry` or a tuple of names), imported on first use.

    Lazy because every `polar-mitm` command builds every command's flags: importing the engines and the renderer
    for their names would add ~0.13 s to each (measured, `build_parser()` 0.30 -> 0.43 s)."""

    def __init__(self, source: str):
        self.source = source

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        module, _, attribute = self.source.partition(":")
        return tuple(getattr(importlib.import_module(module), attribute))

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self.names[index]

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"Choices({self.source!r})"


@dataclass(frozen=True)
class Option:
    name: str  # config field; the mitmproxy option is polar_<name>; the flag --<name with dashes>
    type: Any  # str, int, float, bool, Path or list[str]
    default: Any
    help: str  # the contract: mitmproxy's option help and the config field's description
    flag_help: str | None = None  # the short --help line (None: none)
    flags: tuple[str, ...] = ()  # default: ("--<name with dashes>",)
    choices: Choices | None = None  # the only valid values: a registry's names
    metavar: str | None = None
    required: bool = False  # the config model and `polar-mitm gateway` need it; the addon defaults to `default`
    addon: bool = True  # a polar_ option of the addon; False: mitmproxy's own or the process's
    cli: bool = True  # has a command-line flag
    joined: str | None = None  # a str option whose flag repeats: the values joined with this (e.g. several upstreams)

    @property
    def mitmproxy_name(self) -> str:
        return f"polar_{self.name}"

    @property
    def flag_names(self) -> tuple[str, ...]:
        return self.flags or ("--" + self.name.replace("_", "-"),)


OPTIONS: tuple[Option, ...] = (
    Option("port", int, 8080, "Proxy port on the listen host.", "proxy port on 127.0.0.1 (default 8080)", addon=False),
    Option(
        "host", str, "127.0.0.1", "Listen address; loopback by default. Beyond loopback the gateway needs a control token (it will not start without one).",
        "listen address (default 127.0.0.1; beyond loopback --control-token is required)", addon=False,
    ),
    Option(
        "transparent_port", int, 0,
        "Also listen in mitmproxy's transparent mode on 127.0.0.1:PORT, for capture without proxy settings (polar_mitm/capture.py: "
        "a namespace's HTTPS is DNATed there; the session is the namespace's registered address). 0: off.",
        "also capture transparently on 127.0.0.1:PORT, for `polar-mitm run --capture transparent` (default 0: off)", addon=False,
    ),
    Option(
        "upstream", str, "",
        "The inference engine's OpenAI-compatible base URL, e.g. http://127.0.0.1:8011/v1; several, comma-separated: each session stays "
        "on one engine, new sessions go to the least busy, an unreachable one is taken out and probed back (engines/pool.py).",
        "engine base URL, e.g. http://127.0.0.1:8011/v1; repeat it for several engines", required=True, joined=",",
    ),
    Option("db", Path, Path("polar.duckdb"), "The DuckDB file every exchange is committed to.", "DuckDB store (default polar.duckdb)"),
    Option(
        "confdir", str, DEFAULT_CONFDIR, "mitmproxy confdir: its CA and the session secret live here.",
        f"mitmproxy confdir, where its CA and the session secret live (default {DEFAULT_CONFDIR})", addon=False,
    ),
    Option(
        "engine", str, "vllm", "The engine kind behind polar_upstream.", "engine kind (default vllm)",
        choices=Choices("polar_mitm.engines:ENGINES"),
    ),
    Option(
        "engine_model", str, "", "The engine's served model name; empty: discovered from its /models.",
        "engine's served model name (default: discovered from /models)",
    ),
    Option(
        "engine_max_model_len", int, 0,
        "The engine's context length (prompt + output tokens); 0: read from the engine's /models (vLLM and SGLang report it). "
        "Output budgets are fitted to it, and a prompt that alone exceeds it gets the provider's context-length error.",
        "engine context length (default 0: from /models)",
    ),
    Option(
        "engine_timeout", float, 600.0,
        "Seconds to wait for one engine call before answering 504 (inside the stream, for a streamed call). A non-streamed "
        "call from a harness known to give up sooner gets until 5 s before that harness's limit.",
        "seconds per engine call (default 600)",
    ),
    Option(
        "keepalive_interval", float, 5.0,
        "Seconds between keepalive events on a streamed reply while the engine works (Anthropic ping, Responses "
        "response.in_progress, Chat an empty-delta chunk, Gemini an empty-text chunk). Status, headers and the opening "
        "events go out at once either way. 0: no keepalives.",
        "seconds between a streamed reply's keepalive events while the engine works (default 5; 0: none)", metavar="SECONDS",
    ),
    Option(
        "split_reasoning", bool, False,
        "Split a leading <think>...</think> out of the engine's content into reasoning, for engines served without a reasoning parser.",
        "split inline <think>...</think> from engine content into reasoning (engines without a reasoning parser)",
    ),
    Option(
        "model_map", list[str], (),
        "Which requested model names are served, as glob patterns, optionally '=ENGINE_MODEL'. Empty: every name is served by the "
        "engine's model; otherwise an unmatched name gets a 404 in the provider's shape.",
        "serve only these requested model names (repeatable)", metavar="GLOB[=MODEL]",
    ),
    Option(
        "require_auth", bool, False, "Answer 407 to requests without valid session credentials in the proxy URL.",
        "407 unless the proxy URL carries valid session credentials",
    ),
    Option(
        "passthrough", list[str], (),
        "Hosts (glob patterns) whose non-model traffic is forwarded to the real network. Empty: every non-model request is "
        "answered locally with a 404.",
        "forward non-model traffic to these hosts (repeatable)", metavar="HOST_GLOB",
    ),
    Option(
        "engine_hook", str, "",
        "A function 'module:name' or 'path/to/file.py:name' called as hook(engine_request, context) before each engine call; it "
        "may return a changed request (e.g. sampling params, structured outputs). The row records the request as sent.",
        "function applied to each engine request (sampling params, structured outputs)", metavar="MODULE:FUNC",
    ),
    Option(
        "render", str, "auto",
        "Who renders the prompt: auto, the default (tokens wherever the model's tokenizer and chat template load here and its "
        "tool-call format has a parser; chat otherwise, with one warning saying why), tokens (the gateway renders it with the "
        "model's template, bridges the turns of a lineage token-exactly and calls the engine with token ids), or chat (the "
        "engine applies its chat template to the messages). Auto is the default because it trains best: in chat mode a turn "
        "the engine re-renders differently from what it sampled splits the session's trajectory.",
        "auto: tokens where it can, else chat with a warning (default); tokens: the gateway renders prompts, bridges turns, "
        "calls the engine token-in; chat: the engine renders them",
        choices=Choices("polar_mitm.render.serve:RENDER_MODES"),
    ),
    Option(
        "render_model", str, "",
        "Tokens mode: the model directory or local Hugging Face id whose tokenizer and chat template render prompts; empty: the "
        "engine's own model directory (vLLM's /models root).",
        "tokens mode: model directory or local Hugging Face id for tokenizer + chat template (default: the engine's)",
        metavar="DIR_OR_ID",
    ),
    Option(
        "tool_parser", str, "auto",
        "Tokens mode: the model's tool-call format in sampled text (render/parsers.py); auto: the format its chat template "
        "writes tool calls in (Hermes <tool_call> JSON, Qwen3-Coder <function=...>), and a template whose format no parser "
        "knows is refused rather than its tool calls returned as text.",
        "tokens mode: the tool-call format the model samples (default auto: from the chat template)", choices=Choices("polar_mitm.render.parsers:TOOL_FORMATS"),
    ),
    Option(
        "lineage_mb", int, 192,
        "Tokens mode: how many MB the lineages of all sessions (each answered turn's token ids and history, for bridging the "
        "next turn token-exactly) may hold in memory; past it the least recently used session goes, and its next turn is "
        "read back from the store. Sized for ~100 sessions of 30 turns growing to 20k tokens.",
        "tokens mode: MB of session lineages held in memory (default 192; older sessions are read back from the store)", metavar="MB",
    ),
    Option(
        "heap_trim_s", float, 1.0,
        "Seconds between giving the memory the gateway's threads freed back to the OS (glibc's malloc_trim, from a thread of "
        "its own; nothing where the C library has none). Without it RSS stays where the busiest moment left it "
        "(polar_mitm/gateway/heap.py). 0: never.",
        "seconds between giving freed memory back to the OS (default 1; 0: never)", metavar="S",
    ),
    Option(
        "store_memory_mb", int, 512,
        "DuckDB's memory limit for the store, in MB: its block cache, the journal rows not yet compacted, a compaction and the SQL of "
        "readers of this gateway (beyond it DuckDB spills to <db>.tmp/ where it can, else fails the statement; a refused commit is "
        "answered 500 store_error). 0: DuckDB's default, 80% of RAM.",
        "the store's DuckDB memory limit in MB (default 512; 0: DuckDB's default, 80%% of RAM)", metavar="MB",
    ),
    Option(
        "store_journal_mb", int, 32,
        "A journal becomes a segment once its records reach this many MB (or 256 rows), so journal rows held in memory stay "
        "bounded whatever the rows' size. 0: by rows only.",
        "MB of records after which a journal becomes a segment (default 32; 0: 256 rows only)", metavar="MB",
    ),
    Option(
        "store_compact_slice_mb", int, 8,
        "How many MB of a journal's records a compaction parses at once (DuckDB held ~5x what it parses meanwhile). 0: the whole "
        "journal at once (less CPU, more memory).",
        "MB of records a compaction parses at once (default 8; 0: the whole journal)", metavar="MB",
    ),
    Option(
        "store_merge_fanin", int, 0,
        "Merge aged segments this many tables at a time (16 measured; 0: never), so the exchanges view, every read of it and "
        "the writer's re-pointing of it (at each segment) stay bounded in a run of days instead of growing "
        "with each segment (at 3,000 segments a read 2.2 s, a re-pointing 1 s, against 35 ms and 24 ms merged). A merge "
        "copies at most 4,096 rows and DuckDB holds them in memory while it does (~1.2 GB for harness-sized rows), so it is "
        "off by default (docs/store.md).",
        "merge aged segments this many at a time, for runs of days (default 0: off; 16 measured; each merge holds up to "
        "4,096 rows in memory)", metavar="N",
    ),
    Option(
        "store_process", bool, False,
        "Run the store (DuckDB's writer and compactor) in a process of its own beside the gateway's, so DuckDB's work "
        "does not compete with the proxy's event loop for one Python GIL; commit-before-reply still holds (bench/README.md, "
        "\"The store in its own process\").",
        "run the store's writer in a process of its own (see bench/README.md)",
    ),
    Option(
        "sql_port", int, 0, "Loopback port of the read-only SQL endpoint for other processes (0: any free port).",
        "loopback port for read-only SQL from other processes (default: any)",
    ),
    Option(
        "policy_version", int, 0, "The policy version stamped on engine calls until POST /control/resume sets another.",
        "policy version stamped on engine calls until /control/resume sets another (default 0)",
    ),
    Option(
        "control_token", str, "",
        "Bearer token required by /control/* and /ui on this gateway. Empty: the gateway listens on a loopback address only "
        "(it refuses to start beyond loopback without one). Never logged or stored.",
        "bearer token for /control/* and /ui (default $POLAR_MITM_CONTROL_TOKEN; required when listening beyond loopback)",
    ),
    Option("web", bool, False, "Serve mitmweb's UI too (mitmweb keeps all of mitmdump's addons).", "serve mitmweb's UI too", addon=False),
    Option("web_port", int, 8081, "mitmweb's UI port on 127.0.0.1 (with web).", addon=False),  # no help line, as before
    Option("verbose", bool, False, "The gateway's own log (mitmproxy's termlog) on the terminal.", "the gateway's own log on the terminal", flags=("-v", "--verbose"), addon=False),
)


def mitmproxy_type(option: Option) -> Any:
    """The typespec mitmproxy checks values against (it knows str, not Path; Sequence[str], not list[str])."""
    if option.type is Path:
        return str
    if option.type == list[str]:
        return Sequence[str]
    return option.type


def mitmproxy_value(option: Option, value: Any) -> Any:
    if option.type is Path:
        return str(value)
    if option.type == list[str]:
        return list(value)
    return value


def declare(loader: Any) -> None:
    """Declare the addon's options on mitmproxy's loader (PolarAddon.load)."""
    for option in OPTIONS:
        if option.addon:
            choices = tuple(option.choices) if option.choices is not None else None
            loader.add_option(option.mitmproxy_name, mitmproxy_type(option), mitmproxy_value(option, option.default), option.help, choices=choices)


def check_choices(values: Any, updated: Iterable[str]) -> None:
    """Raise ConfigError for an updated addon option (of mitmproxy's `values`) that is not one of its choices."""
    for option in OPTIONS:
        if option.addon and option.choices is not None and option.mitmproxy_name in updated:
            value = getattr(values, option.mitmproxy_name)
            if value not in option.choices:
                raise ConfigError(f"{option.mitmproxy_name} must be one of {', '.join(option.choices)}, got {value!r}")


def mitmproxy_updates(config: Any) -> dict[str, Any]:
    """The addon's options as `master.options.update(**...)` takes them, from a GatewayConfig."""
    return {option.mitmproxy_name: mitmproxy_value(option, getattr(config, option.name)) for option in OPTIONS if option.addon}


def add_arguments(parser: argparse.ArgumentParser, exclude: Iterable[str] = (), overrides: dict[str, dict[str, Any]] | None = None, prefix: str = "") -> None:
    """One flag per option with `cli`, named and explained by the table; its value lands in `args.<prefix><name>`.
    `overrides[name]` replaces argparse keyword arguments of that flag (e.g. another spelling in `flags`)."""
    excluded = set(exclude)
    for option in OPTIONS:
        if not option.cli or option.name in excluded:
            continue
        kwargs: dict[str, Any] = {"dest": prefix + option.name, "help": option.flag_help}
        if option.type is bool:
            kwargs.update(action="store_true")
        elif option.type == list[str]:
            kwargs.update(action="append", default=list(option.default), metavar=option.metavar)
        elif option.joined:
            kwargs.update(action="append", metavar=option.metavar or option.name.upper())
            kwargs.update({"required": True} if option.required else {"default": None})
        else:
            # a metavar of its own: argparse's {a,b} would read the choices (import their registry) while building
            kwargs.update(type=option.type, metavar=option.metavar or option.name.upper(), choices=option.choices)
            kwargs.update({"required": True} if option.required else {"default": option.default})
            if option.choices is not None and option.flag_help:
                kwargs["help"] = f"{option.flag_help}; one of %(choices)s"  # argparse reads them only for --help
        kwargs.update((overrides or {}).get(option.name, {}))
        flags = kwargs.pop("flags", option.flag_names)
        parser.add_argument(*flags, **{k: v for k, v in kwargs.items() if v is not None or k == "default"})


def flag_message(message: str) -> str:
    """An option error as the command line user sees it: `polar_<name>` becomes its flag, in one line."""
    for option in sorted(OPTIONS, key=lambda o: -len(o.name)):
        if option.cli:
            message = message.replace(option.mitmproxy_name, option.flag_names[-1])
    return " ".join(message.split())


def from_arguments(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The option values `add_arguments(..., prefix=prefix)` parsed, as GatewayConfig keyword arguments."""
    values = {option.name: getattr(args, prefix + option.name) for option in OPTIONS if hasattr(args, prefix + option.name)}
    for option in OPTIONS:
        if option.joined and isinstance(values.get(option.name), list):
            values[option.name] = option.joined.join(values[option.name])
    return values
