"""Tokens mode's parts against the local engine's real tokenizer and chat template (a Qwen3-style one that
drops earlier <think>): the renderer equals the engine's own rendering, the parsers, bridging and its reasons."""

from __future__ import annotations

import json
import shutil
import urllib.parse
import urllib.request
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st

from polar_mitm import dialects
from polar_mitm.errors import RenderError
from polar_mitm.exchange import ToolCall
from polar_mitm.render import bridge, parsers
from polar_mitm.render import renderer as renderer_module
from polar_mitm.render.renderer import Renderer

FIXTURES = sorted((Path(__file__).parent.parent / "fixtures").glob("*/*.json"))
TOOLS = [{"type": "function", "function": {"name": "run_shell_command", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def served(engine_url: str) -> dict:
    with urllib.request.urlopen(engine_url + "/models", timeout=30) as reply:
        return json.load(reply)["data"][0]


@pytest.fixture(scope="module")
def model_dir(served: dict) -> str:
    """The directory the engine serves (vLLM's /models `root`): its tokenizer and chat template."""
    return served["root"]


@pytest.fixture(scope="module")
def renderer(model_dir: str) -> Renderer:
    return Renderer.load(model_dir)


def parse_fixture(path: Path):
    recorded = json.loads(path.read_text())
    route, _, query = recorded["path"].partition("?")
    dialect = dialects.dialect_for(recorded.get("method", "POST"), route)
    body = recorded["body"]
    return dialect.parse(body.encode() if isinstance(body, str) else json.dumps(body).encode(), route, dict(urllib.parse.parse_qsl(query)))


def engine_ids(engine_url: str, served: dict, chat: dict, endpoint: str) -> list[int]:
    """The engine's own rendering: `render` is what its chat completions generate from (vLLM's
    /v1/chat/completions/render), `tokenize` its /tokenize."""
    body = {"model": served["id"], "messages": chat["messages"], **{k: chat[k] for k in ("tools", "chat_template_kwargs") if chat.get(k) is not None}}
    if endpoint == "tokenize":
        url, body, key = engine_url.removesuffix("/v1") + "/tokenize", {**body, "add_generation_prompt": True}, "tokens"
    else:
        url, key = engine_url + "/chat/completions/render", "token_ids"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)[key]


@pytest.mark.engine
@pytest.mark.parametrize("path", FIXTURES, ids=[f"{p.parent.name}/{p.stem}" for p in FIXTURES])
def test_first_turn_rendering_equals_the_engines(path: Path, renderer: Renderer, engine_url: str, served: dict) -> None:
    """Every recorded harness request shape, after its dialect parses it: our ids == vLLM's /tokenize ids."""
    chat = parse_fixture(path).chat
    ours = renderer.prompt_ids(chat)
    assert ours == engine_ids(engine_url, served, chat, "render")
    assert ours == engine_ids(engine_url, served, chat, "tokenize")
    assert ours == renderer._encode(renderer.prompt_text(chat)) == renderer.prompt_ids(chat)  # turn by turn, cached, = the whole text at once
    text = renderer.decode(ours)
    for tool in chat.get("tools") or []:  # tool schemas survive
        assert json.dumps(tool["function"]["name"]) in text
    for message in chat["messages"]:
        if message["role"] == "system" and isinstance(message["content"], str) and message["content"]:
            assert message["content"][:200] in text  # system prompts survive


@pytest.mark.engine
def test_reasoning_and_billing_header_render_as_the_engine_does(renderer: Renderer, engine_url: str, served: dict) -> None:
    chat = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc12;"}, {"type": "text", "text": "You are a coder."}]},
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "", "reasoning_content": "I should run ls.", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.txt"}]},
        ],
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    ours = renderer.prompt_ids(chat)
    # /tokenize drops `reasoning_content` (only the chat request renames it `reasoning`): the chat path is the reference
    assert ours == engine_ids(engine_url, served, chat, "render")
    text = renderer.decode(ours)
    assert "cch=" not in text and "I should run ls." in text and text.endswith("<think>\n\n</think>\n\n")


def test_each_sampled_token_s_text_is_that_token_decoded_alone_also_once_kept_and_past_the_bound(renderer: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    """logprobs' `token` texts: whole words, an emoji's byte tokens (each alone is not UTF-8), special tokens."""
    ids = renderer.encode("héllo wörld 🦜 naïve <think>x</think>") + [renderer.end_of_turn_id] + renderer.encode("🦜 héllo 🫠")
    expected = [renderer.tokenizer.decode([token], skip_special_tokens=False) for token in ids]
    assert "\ufffd" in expected and "<|im_end|>" in expected  # the cases this is about are in it
    fresh = Renderer.load(renderer.source)
    assert fresh.token_texts(ids) == expected  # from the tokenizer
    assert fresh.token_texts(ids) == expected and set(fresh._token_texts) == set(ids)  # from what it kept
    monkeypatch.setattr(renderer_module, "TOKEN_TEXTS", 5)
    more = renderer.encode("a different sentence with other words")
    assert fresh.token_texts(more) == [renderer.tokenizer.decode([token], skip_special_tokens=False) for token in more]
    assert fresh.token_texts(ids) == expected and len(fresh._token_texts) <= max(5, len(set(ids)))


def test_images_are_rejected_when_the_model_has_no_vision(renderer: Renderer) -> None:
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    with pytest.raises(RenderError) as caught:
        renderer.prompt_ids(chat)
    assert caught.value.status == 400 and "no vision input" in caught.value.message


def test_a_model_without_a_chat_template_is_refused(model_dir: str, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, tmp_path / name)
    with pytest.raises(RenderError) as caught:
        Renderer.load(str(tmp_path))
    assert caught.value.kind == "no_chat_template" and "has no chat template" in caught.value.message


def test_a_template_that_fails_is_a_clear_400(model_dir: str, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{%- if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}{{ messages[0].content }}")
    renderer = Renderer.load(str(tmp_path))
    with pytest.raises(RenderError) as caught:
        renderer.prompt_ids({"messages": [{"role": "user", "content": "hi"}]})
    assert caught.value.status == 400 and "a system message must come first" in caught.value.message


# -- bridging
def sample(renderer: Renderer, text: str) -> list[int]:
    """Sampled ids as a forced (non-canonical) decoding would give them: one token per character, then <|im_end|>."""
    ids = [token for char in text for token in renderer.encode(char)]
    assert renderer.decode(ids) == text and ids != renderer.encode(text)
    return ids + [renderer.tokenizer.eos_token_id]


def first_exchange(renderer: Renderer, lineages: bridge.Lineages, chat: dict, sampled_text: str, session: str = "s"):
    conversation = renderer.conversation(chat["messages"])
    setup = bridge.setup_key(renderer, chat)
    parent, _, reason = lineages.find(session, conversation, setup)
    assert parent is None and reason == bridge.FIRST_TURN
    prompt = renderer.prompt_ids(chat)
    completion = sample(renderer, sampled_text)
    out = parsers.parse_output(renderer.sampled_text(completion), "hermes")
    lineages.remember(session, bridge.make_turn("x1", conversation, bridge.answer_message(out.content, out.tool_calls), setup, prompt, completion))
    return prompt, completion, out


def harness_reply(out: parsers.ParsedOutput, keep_reasoning: bool) -> dict:
    """Our answer as a harness sends it back: tool-call arguments re-serialized its way, reasoning kept or dropped."""
    message = {"role": "assistant", "content": out.content, "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(json.loads(c.arguments), separators=(",", ":"))}} for c in out.tool_calls]}
    if keep_reasoning and out.reasoning:
        message["reasoning_content"] = out.reasoning
    return message


@pytest.mark.parametrize("keep_reasoning", [False, True])
def test_qwen3_think_stripping_is_bridged_with_exact_prefixes(renderer: Renderer, keep_reasoning: bool) -> None:
    """The template drops the first turn's <think> once a user turn follows; the bridge keeps the sampled ids."""
    lineages = bridge.Lineages()
    chat = {"messages": [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "list files"}], "tools": TOOLS}
    sampled = '<think>\nI will run ls.\n</think>\n\n<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls"}}\n</tool_call>'
    prompt1, completion1, out = first_exchange(renderer, lineages, chat, sampled)
    assert out.reasoning == "I will run ls." and out.tool_calls
    turn2 = chat["messages"] + [harness_reply(out, keep_reasoning), {"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "a.txt"}, {"role": "user", "content": "now count them"}]
    chat2 = {**chat, "messages": turn2}
    conversation = renderer.conversation(turn2)
    parent, covered, reason = lineages.find("s", conversation, bridge.setup_key(renderer, chat2))
    assert (parent is not None, covered, reason) == (True, 3, None)
    bridged = bridge.bridge(renderer, parent, conversation, covered, renderer.tools(chat2), renderer.template_kwargs(chat2))
    assert bridged.prompt_ids.tolist()[: len(prompt1) + len(completion1)] == prompt1 + completion1  # exact prefix, reasoning included
    full = renderer.prompt_ids(chat2)
    assert full[: len(prompt1) + len(completion1)] != prompt1 + completion1  # what a re-render would have broken
    assert "I will run ls." not in renderer.decode(full) and "I will run ls." in renderer.decode(bridged.prompt_ids)
    # the delimiter and new messages are exactly what the template renders after our turn
    assert renderer.decode(bridged.tail_ids) == "\n<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>\n<|im_start|>user\nnow count them<|im_end|>\n<|im_start|>assistant\n"


def test_without_reasoning_the_bridge_decodes_to_the_full_render(renderer: Renderer) -> None:
    """Where the template keeps everything, the bridged prompt is the full render's text, tokenized as sampled."""
    lineages = bridge.Lineages()
    chat = {"messages": [{"role": "user", "content": "list files"}], "tools": TOOLS}
    _, _, out = first_exchange(renderer, lineages, chat, '<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls -la"}}\n</tool_call>')
    turn2 = chat["messages"] + [harness_reply(out, False), {"role": "tool", "tool_call_id": "whatever", "content": "a.txt"}]
    chat2 = {**chat, "messages": turn2}
    conversation = renderer.conversation(turn2)
    parent, covered, _ = lineages.find("s", conversation, bridge.setup_key(renderer, chat2))
    bridged = bridge.bridge(renderer, parent, conversation, covered, renderer.tools(chat2), renderer.template_kwargs(chat2))
    assert renderer.decode(bridged.prompt_ids) == renderer.prompt_text(chat2)


@pytest.mark.parametrize("ending", ["cut_off", "endoftext"])
def test_a_turn_not_ended_by_the_templates_token_is_closed_as_the_template_closes_it(renderer: Renderer, ending: str) -> None:
    """Cut off by max_tokens, or stopped by another of the engine's stop tokens (<|endoftext|>): kept verbatim,
    then the template's whole end of turn."""
    lineages = bridge.Lineages()
    chat = {"messages": [{"role": "user", "content": "say hi"}]}
    conversation = renderer.conversation(chat["messages"])
    setup = bridge.setup_key(renderer, chat)
    completion = renderer.encode("hi th") + ([renderer.tokenizer.convert_tokens_to_ids("<|endoftext|>")] if ending == "endoftext" else [])
    assert renderer.sampled_text(completion) == "hi th"
    prompt = renderer.prompt_ids(chat)
    lineages.remember("s", bridge.make_turn("x1", conversation, bridge.answer_message("hi th", []), setup, prompt, completion))
    turn2 = chat["messages"] + [{"role": "assistant", "content": "hi th"}, {"role": "user", "content": "go on"}]
    parent, covered, _ = lineages.find("s", renderer.conversation(turn2), setup)
    bridged = bridge.bridge(renderer, parent, renderer.conversation(turn2), covered, None, {})
    assert bridged.prompt_ids.tolist()[: len(prompt) + len(completion)] == prompt + completion
    assert renderer.decode(bridged.tail_ids) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_unbridged_turns_say_why(renderer: Renderer) -> None:
    lineages = bridge.Lineages()
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "task"}], "tools": TOOLS}
    _, _, out = first_exchange(renderer, lineages, chat, '<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls"}}\n</tool_call>')
    reply = harness_reply(out, False)
    result = {"role": "tool", "tool_call_id": "c", "content": "a.txt"}

    def reason(messages: list[dict], tools=TOOLS, session: str = "s") -> str | None:
        chat2 = {"messages": messages, "tools": tools}
        parent, _, why = lineages.find(session, renderer.conversation(messages), bridge.setup_key(renderer, chat2))
        return None if parent else why

    assert reason(chat["messages"] + [reply, result]) is None  # append-only: bridged
    edited = {**reply, "tool_calls": [{**reply["tool_calls"][0], "function": {"name": "run_shell_command", "arguments": '{"command": "ls -la"}'}}]}
    assert reason(chat["messages"] + [edited, result]) == bridge.EDITED_HISTORY
    assert reason([chat["messages"][0], {"role": "user", "content": "other task"}, reply, result]) == bridge.EDITED_HISTORY
    assert reason(chat["messages"] + [reply, result], tools=TOOLS + [{"type": "function", "function": {"name": "read", "parameters": {}}}]) == bridge.TOOLS_CHANGED
    assert reason(chat["messages"] + [reply, result], session="other") == bridge.NO_LINEAGE
    # a compacted history: shorter than one sent before, its summary in place of the turns
    longer = chat["messages"] + [reply, result, {"role": "assistant", "content": "done"}, {"role": "user", "content": "more"}]
    setup = bridge.setup_key(renderer, chat)
    conversation = renderer.conversation(longer)
    lineages.remember("s", bridge.make_turn("x2", conversation, bridge.answer_message("ok", []), setup, [1], [2]))
    assert reason([chat["messages"][0], {"role": "user", "content": "Summary: ran ls."}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]) == bridge.COMPACTION
    assert reason([{"role": "user", "content": "hi"}]) == bridge.FIRST_TURN


def test_answer_message_matches_what_harnesses_send_back(renderer: Renderer) -> None:
    call = ToolCall(id="a", name="run_shell_command", arguments='{"command": "ls", "timeout": 5}')
    ours = bridge.message_key(renderer.conversation([bridge.answer_message(None, [call])])[0])
    theirs = renderer.conversation([{"role": "assistant", "content": [], "tool_calls": [{"id": "other-id", "type": "function", "function": {"name": "run_shell_command", "arguments": '{"timeout":5,"command":"ls"}'}}]}])[0]
    assert bridge.message_key(theirs) == ours


# -- the direct render (the compiled template without apply_chat_template's deep copies)

_text = st.lists(st.sampled_from(["a", "é", "漢", "😀", " ", "\n", "<|im_end|>", "<think>", "</think>", "{", "\"", "\\"]), max_size=12).map("".join)
_arguments = st.dictionaries(st.sampled_from(["path", "command", "n"]), st.one_of(_text, st.integers(-3, 3), st.none()), max_size=2)
_call = st.fixed_dictionaries({"id": st.text("abc", min_size=1, max_size=3), "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": st.sampled_from(["read_file", "run"]), "arguments": _arguments.map(json.dumps)})})
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": st.one_of(_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=2))}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), _text)},
                          optional={"tool_calls": st.lists(_call, max_size=2), "reasoning_content": st.one_of(st.none(), _text), "reasoning": _text}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": _text, "tool_call_id": st.text("abc", max_size=3)}, optional={"name": st.sampled_from(["read_file", "run"])}),
)


@hypothesis.settings(max_examples=300, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(
    messages=st.lists(_message, min_size=1, max_size=8), prepared=st.booleans(), with_tools=st.booleans(), thinking=st.sampled_from([None, True, False]),
    generation=st.booleans(),
)
def test_the_direct_render_gives_apply_chat_templates_text(renderer: Renderer, messages: list, prepared: bool, with_tools: bool, thinking: bool | None, generation: bool) -> None:
    """render_text's direct way (the model's compiled template, no deep copies) against transformers'
    apply_chat_template, on conversations of every shape a request may carry, as `conversation` prepares them and
    as they come (None values, reasoning under one name): the same text, or the same refusal."""
    conversation = renderer.conversation(messages) if prepared else messages
    tools = Renderer.tools({"tools": TOOLS}) if with_tools else None
    kwargs = renderer.template_kwargs({"chat_template_kwargs": {"enable_thinking": thinking}} if thinking is not None else {})
    try:
        expected = renderer._apply_chat_template(conversation, tools, kwargs, generation)
    except Exception as error:  # noqa: BLE001 - the template refuses this conversation: so must the direct way
        with pytest.raises(type(error)):
            renderer._render_direct(conversation, tools, kwargs, generation)
        return
    assert renderer._render_direct(conversation, tools, kwargs, generation) == expected


def test_a_renderer_whose_direct_render_disagrees_takes_apply_chat_template(renderer: Renderer, model_dir: str) -> None:
    """A transformers that prepares the data some other way (a later version): the first renders, done both ways,
    turn the direct way off, and every render is apply_chat_template's."""
    assert renderer._compiled is not None  # this transformers: the direct way is on
    other = Renderer.load(model_dir)
    template, alias = other._compiled
    other._compiled = (template, lambda chat: [{**message, "content": "changed"} for message in alias(chat)])
    chat = [{"role": "user", "content": "hi"}]
    assert other.render_text(chat, None, {}, True) == renderer._apply_chat_template(chat, None, {}, True)
    assert other._compiled is None
