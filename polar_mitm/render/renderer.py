"""The model's chat template and tokenizer, applied in the gateway exactly as vLLM applies them.

Contract: for a first turn, `Renderer.prompt_ids(chat)` equals the ids vLLM's `/tokenize` (and its chat
completions) produce for the same chat request (tests/integration/test_render.py checks it for every recorded harness
request shape). The message preparation below mirrors vLLM 0.32's (`vllm/renderers/chat_utils.py`): content
parts as the template expects them (a list of text parts when the template iterates over content, else one
string joined with newlines), tool results as one string, assistant tool-call arguments as JSON objects,
Claude Code's per-request billing header line dropped from system text, `reasoning` for `reasoning_content`.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from polar_mitm.errors import RenderError

# a template that loops over a message's content expects OpenAI-style content parts (vLLM's "openai" format)
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+[\w.\[\]'\"]*content\b")
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"
# turns at least this long are cached by their text (system prompts, tool schemas), at most this many
CACHED_SEGMENT_CHARS = 4096
CACHED_SEGMENTS = 64
# renders done both ways (apply_chat_template, and transformers' compiled template directly) before the direct way alone
CHECKED_RENDERS = 8
# single tokens' texts kept (logprobs' `token` field), at most this many (then started afresh): a run samples a few
# thousand distinct tokens; ~100 bytes each
TOKEN_TEXTS = 65536


class Renderer:
    """Chat request (engine chat-completions form) -> prompt text and token ids, for one model."""

    def __init__(self, tokenizer: Any, source: str, vision: bool = False, stop_token_ids: Sequence[int] = ()):
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        if not template:
            raise RenderError(500, "no_chat_template", f"the model at {source} has no chat template; tokens mode needs one (add chat_template.jinja to the model directory)")
        self.tokenizer = tokenizer
        self.source = source
        self.template: str = template
        self.vision = vision
        self.parts_format = "openai" if _ITERATES_CONTENT.search(template) else "string"
        self.template_variables = _template_variables(template)
        # the template's end of an assistant turn (<|im_end|>), and every token the engine stops on (the generation
        # config's eos ids too, e.g. <|endoftext|>, which a sample may end with instead)
        self.eos_token: str = tokenizer.eos_token or ""
        self.end_of_turn_id: int | None = tokenizer.eos_token_id
        self.stop_token_ids: set[int] = {*stop_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        self._fast = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: encode without Python per-token work
        self._special_tokens = dict(tokenizer.special_tokens_map)
        self._compiled = _compiled_template(template)
        # the probe, then the first real renders, go both ways: a transformers that prepares the data otherwise
        # (a later version) turns the direct way off
        self._unchecked = CHECKED_RENDERS
        if self._compiled is not None:
            self._direct_agrees(*_PROBE)
        self._segments: OrderedDict[str, array] = OrderedDict()
        self._cache_lock = threading.Lock()  # renders run in worker threads
        self._token_texts: dict[int, str] = {}

    @classmethod
    def load(cls, model: str) -> Renderer:
        """From a model directory or a Hugging Face id available locally (never downloads)."""
        try:
            from transformers import AutoTokenizer
        except ImportError as error:  # pragma: no cover - transformers is a dependency
            raise RenderError(500, "render_unavailable", f"tokens mode needs transformers: {error}") from error
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as error:
            raise RenderError(500, "tokenizer_unavailable", f"cannot load the tokenizer of {model!r} locally: {error}") from error
        return cls(tokenizer, model, vision=_has_vision(model), stop_token_ids=_generation_eos_ids(model))

    # -- rendering
    def conversation(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as vLLM hands them to the chat template."""
        return [self._message(message, index) for index, message in enumerate(messages)]

    def _message(self, message: dict[str, Any], index: int) -> dict[str, Any]:
        role = message["role"]
        texts = self._texts(message.get("content"), index)
        if role == "system":
            texts = _without_billing_header(texts)
        out: dict[str, Any] = {"role": role}
        if role == "tool" or self.parts_format == "string":
            out["content"] = "\n".join(texts)
        else:
            out["content"] = [{"type": "text", "text": text} for text in texts]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        if role == "assistant":
            if message.get("tool_calls"):
                out["tool_calls"] = [_tool_call_with_object_arguments(call) for call in message["tool_calls"]]
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        return out

    def _texts(self, content: Any, index: int) -> list[str]:
        if content is None:
            return []
        if isinstance(content, str):
            return [content]
        texts = []
        for part in content:
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                texts.append(part.get("text") or "")
            elif kind in ("image_url", "input_image", "image") and not self.vision:
                raise RenderError(400, "invalid_request_error", f"messages[{index}] has an image, but the model at {self.source} has no vision input", f"messages[{index}].content")
            else:
                raise RenderError(400, "invalid_request_error", f"messages[{index}] has a {kind!r} content part, which tokens mode cannot render (only text)", f"messages[{index}].content")
        return texts

    def template_kwargs(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The request's chat_template_kwargs the template reads (vLLM drops the others)."""
        given = chat.get("chat_template_kwargs") or {}
        return {key: value for key, value in given.items() if key in self.template_variables and key not in ("chat_template", "tokenize")}

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], add_generation_prompt: bool) -> str:
        """The template applied to already-prepared messages (see `conversation`): what transformers'
        `apply_chat_template` renders, without its two deep copies of the whole conversation and tools per call
        (a third of a render of a long history), which plain JSON data needs none of."""
        try:
            if self._compiled is not None and self._unchecked <= 0:
                return self._render_direct(messages, tools, kwargs, add_generation_prompt)
            expected = self._apply_chat_template(messages, tools, kwargs, add_generation_prompt)
            if self._compiled is not None:
                self._unchecked -= 1
                self._direct_agrees(messages, tools, kwargs, add_generation_prompt, expected)
            return expected
        except jinja2.TemplateError as error:
            raise RenderError(400, "invalid_request_error", f"the model's chat template could not render this conversation: {error}") from error
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise RenderError(400, "invalid_request_error", f"the model's chat template could not render this conversation: {type(error).__name__}: {error}") from error

    def _apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _direct_agrees(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], add_generation_prompt: bool, expected: str | None = None) -> None:
        """Render both ways; the direct way is off for good unless it gives apply_chat_template's text (a conversation
        the template refuses either way says nothing)."""
        try:
            if expected is None:
                expected = self._apply_chat_template(messages, tools, kwargs, add_generation_prompt)
        except Exception:  # noqa: BLE001 - the template refuses the probe (e.g. roles must alternate): no verdict
            return
        try:
            agrees = self._render_direct(messages, tools, kwargs, add_generation_prompt) == expected
        except Exception:  # noqa: BLE001 - it fails where apply_chat_template did not: not the same
            agrees = False
        if not agrees:
            self._compiled = None

    def _render_direct(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], add_generation_prompt: bool) -> str:
        """transformers' compiled template (its sandboxed environment) on the data as apply_chat_template prepares
        it for a text render: keys whose value is None dropped, reasoning under each of its names."""
        assert self._compiled is not None
        template, alias_reasoning = self._compiled
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return template.render(
            messages=alias_reasoning(chat), tools=tools or None, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self._special_tokens, **kwargs},
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, one turn at a time.

        The tokenizer splits text at special tokens before anything else, so the ids of the text cut after each
        end-of-turn token, concatenated, are the ids of the whole. Long turns (a harness's system prompt and tool
        schemas: ~10k tokens, ~0.1 s to tokenize here) repeat across the sessions of a run and are cached.
        """
        if not self.eos_token or self.eos_token not in text:
            return self._encode(text)
        ids: list[int] = []
        pieces = text.split(self.eos_token)
        for index, piece in enumerate(pieces):
            segment = piece + self.eos_token if index < len(pieces) - 1 else piece
            if len(segment) < CACHED_SEGMENT_CHARS:
                ids += self._encode(segment)
                continue
            with self._cache_lock:
                cached = self._segments.get(segment)
                if cached is not None:
                    self._segments.move_to_end(segment)
            if cached is None:
                cached = array("i", self._encode(segment))
                with self._cache_lock:
                    self._segments[segment] = cached
                    while len(self._segments) > CACHED_SEGMENTS:
                        self._segments.popitem(last=False)
            ids += cached.tolist()
        return ids

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's text on its own (logprobs' `token` field), as decoding it alone gives it. Kept by id: this
        runs on the event loop after each engine call, where the tokenizer's batch decode took ~1 ms of its time per
        exchange at 64 sessions (py-spy, bench/scale.py tokens mode: its threads wait for the busy cores) and 0.11 ms
        alone per 200 tokens, against 0.01 ms from the dict."""
        known = self._token_texts
        missing = [token for token in dict.fromkeys(ids) if token not in known]
        if missing:
            if len(known) + len(missing) > TOKEN_TEXTS:
                known.clear()
                missing = list(dict.fromkeys(ids))
            texts = self._fast.decode_batch([[token] for token in missing], skip_special_tokens=False) if self._fast is not None else [self.decode([token]) for token in missing]
            known.update(zip(missing, texts, strict=True))
        return [known[token] for token in ids]

    def prompt_text(self, chat: dict[str, Any]) -> str:
        return self.render_text(self.conversation(chat["messages"]), self.tools(chat), self.template_kwargs(chat), add_generation_prompt=True)

    @staticmethod
    def tools(chat: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tools as vLLM's request model dumps them: its fields, in its order, description and parameters always."""
        tools = chat.get("tools")
        return [_tool_as_vllm_dumps_it(tool) for tool in tools] if tools else None

    def prompt_ids(self, chat: dict[str, Any]) -> list[int]:
        """A full render of the request's conversation, ready for generation."""
        return self.encode(self.prompt_text(chat))

    def sampled_text(self, ids: Sequence[int]) -> str:
        """The text of sampled ids, without the end-of-turn token that stopped them."""
        ids = list(ids)
        while ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return self.decode(ids)


# a conversation that takes every step of the data's preparation (None values, reasoning, tool calls, a tool's
# result, content parts), rendered both ways when a renderer is made
_PROBE: tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], bool] = (
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "u <|im_end|>"}], "name": None},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "t", "tool_call_id": "c"},
        {"role": "assistant", "content": "a", "reasoning": "r2"},
        {"role": "user", "content": "u2"},
    ],
    [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
    {},
    True,
)


def _compiled_template(template: str) -> tuple[Any, Any] | None:
    """transformers' own compiled template (cached by its text) and its reasoning aliasing; None where this
    transformers lacks them (a render then takes apply_chat_template itself)."""
    try:
        from transformers.utils import chat_template_utils

        return chat_template_utils._compile_jinja_template(template), chat_template_utils._alias_reasoning_fields
    except (ImportError, AttributeError, jinja2.TemplateError):
        return None


def _template_variables(template: str) -> set[str]:
    try:
        return set(jinja2.meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)))
    except jinja2.TemplateSyntaxError as error:
        raise RenderError(500, "bad_chat_template", f"the model's chat template does not parse: {error}") from error


def _without_billing_header(texts: list[str]) -> list[str]:
    # its cch= nonce changes every request; vLLM drops the line (and the part, if nothing else is in it)
    out = []
    for text in texts:
        if text.startswith(_CLAUDE_CODE_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _tool_call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            arguments = {}  # vLLM coerces unparsable history arguments to {} rather than failing every later turn
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def _tool_as_vllm_dumps_it(tool: dict[str, Any]) -> dict[str, Any]:
    given = tool.get("function") or {}
    function = {"name": given.get("name"), "description": given.get("description"), "parameters": given.get("parameters")}
    for optional in ("strict", "defer_loading"):
        if given.get(optional) is not None:
            function[optional] = given[optional]
    if tool.get("defer_loading") is not None and "defer_loading" not in function:
        function["defer_loading"] = tool["defer_loading"]
    out: dict[str, Any] = {"type": "function", "function": function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _generation_eos_ids(model: str) -> list[int]:
    try:
        eos = json.loads((Path(model) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [eos] if isinstance(eos, int) else [token for token in eos or [] if isinstance(token, int)]


def _has_vision(model: str) -> bool:
    config = Path(model) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False
