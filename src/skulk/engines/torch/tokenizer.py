"""Tokenizer, chat template and streaming text for the torch engine.

Streaming has two traps this module handles: a token can end mid-codepoint (byte-level vocabularies split
emoji across tokens), so text is only released once it decodes cleanly; and a stop string can arrive split
across tokens, so any tail that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from skulk.engines.errors import PromptRejected
from skulk.engines.reasoning import ReasoningMode, ReasoningOverride, reasoning_mode
from skulk.engines.tool_prompt import PROBE_TOOL, inline_tools
from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import read_config
from skulk.formats.images import ImageRefused, image_bytes, open_image
from skulk.types.chat import ChatMessage, TextPart

_REPLACEMENT = "\ufffd"
_TEMPLATE_OWN = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages"}
"""apply_chat_template's own arguments (and the messages): a client's chat_template_kwargs cannot set them."""


KEPT_SPECIAL_TOKENS = frozenset({
    "<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>",
    *("<\uff5c" + w.replace(" ", "\u2581") + "\uff5c>" for w in (  # DeepSeek V3.1's tool tokens
        "tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep")),
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_section_begin|>",  # Kimi K2's
    "<|tool_call_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",  # gpt-oss harmony's message headers
})
"""Special tokens a reply keeps when decoded: the ones its reasoning and tool calls are written in, which the API
reads (engines/reasoning.py, tool_parsers/). Every other special token is dropped, as before; an end-of-turn
token is never decoded into the text at all (requests.accept_token)."""


class ChatTokenizer:
    """The model directory's own tokenizer and chat template; never touches the network."""

    def __init__(self, model_dir: Path) -> None:
        self._tok: Any = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._model_dir = model_dir
        self.eos_ids = frozenset(_eos_ids(model_dir, self._tok.eos_token_id))
        self.card_reasoning: ReasoningOverride | None = None
        """The card's `reasoning_parser` (the runner sets it): the engine decides a reasoning budget's mode by it."""
        self.card_tool_parser: str | None = None
        """The card's `tool_parser` (the runner sets it): a forced call is written in that format."""

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (the grammar compiler reads its vocabulary)."""
        return self._tok

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template has a tools section: a probe tool changes what it renders."""
        probe = [{"role": "user", "content": "hi"}]
        try:
            plain = self._tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            with_tool = self._tok.apply_chat_template(probe, tools=[PROBE_TOOL], add_generation_prompt=True,
                                                      tokenize=False)
        except Exception:  # a template that fails on the probe cannot be trusted with tools either
            return False
        return bool(plain != with_tool)

    def encode_chat(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render the chat template with the generation prompt and the tools offered; a template without a tools
        section gets them in the system message (engines/tool_prompt.py), never silently dropped. Tokenized
        without adding specials twice. template_kwargs are the request's template variables (Qwen3's
        enable_thinking, gpt-oss's reasoning_effort, a client's chat_template_kwargs); a template ignores the ones
        it does not read."""
        return self.encode(self.render_chat(messages, tools, template_kwargs))

    def render_chat(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template's text for encode_chat, each image's marker expanded to its placeholder run
        (image_run, or image_pad's per image): the runner's prompt and the API node's count_tokens are the same
        tokens."""
        rendered = self._render(messages, tools, template_kwargs)
        if not any(m.images for m in messages):
            return rendered
        if (run := self.image_run) is not None:
            return rendered.replace(run[0], run[1])
        if (pad := self.image_pad) is not None:
            return _expand(rendered, pad[0], [pad[0] * pad[1](url) for m in messages for url in m.images])
        return rendered

    @functools.cached_property
    def image_run(self) -> tuple[str, str] | None:
        """(marker, run): the image marker a Gemma 3 template writes once per image and the placeholder run the
        model reads in its place, as transformers' Gemma3Processor writes it (the marker, that many image tokens and
        the end marker, between blank lines); None for a model without a vision config, or another family's."""
        config = self._vision_config()
        if config is None:
            return None
        numbers = [getattr(config, k, None) for k in ("boi_token_index", "eoi_token_index", "image_token_id",
                                                      "mm_tokens_per_image")]
        if not all(isinstance(n, int) for n in numbers):  # a vision family other than Gemma 3's: markers unknown
            return None
        boi, eoi, image = (self._tok.convert_ids_to_tokens(i) for i in numbers[:3])
        return boi, f"\n\n{boi}{image * numbers[3]}{eoi}\n\n"

    @functools.cached_property
    def image_pad(self) -> tuple[str, Callable[[str], int]] | None:
        """Qwen2.5-VL's (pad, count): the template writes <|image_pad|> once per image and the processor repeats it
        once per merged patch of the image as its image processor resizes it (min/max pixels, patch and merge
        sizes: get_number_of_image_patches / merge²), which only the image's size decides; count(url) is that for
        one image. None for any other model."""
        config = self._vision_config()
        if config is None or getattr(config, "model_type", None) != "qwen2_5_vl":
            return None
        from transformers import AutoImageProcessor

        processor: Any = AutoImageProcessor.from_pretrained(str(self._model_dir), local_files_only=True)

        def count(url: str) -> int:
            try:
                width, height = open_image(image_bytes(url)).size
            except ImageRefused as exc:
                raise PromptRejected(str(exc)) from exc
            return int(processor.get_number_of_image_patches(height, width)) // int(processor.merge_size) ** 2

        return self._tok.convert_ids_to_tokens(config.image_token_id), count

    def _vision_config(self) -> Any:
        """transformers' config of a vision-language checkpoint; None without a vision config."""
        path = self._model_dir / "config.json"
        if not path.exists() or not read_config(path).get("vision_config"):
            return None
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self._model_dir), local_files_only=True)

    def _render(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None,
                template_kwargs: dict[str, Any] | None) -> str:
        items = template_messages(messages)
        if tools and not self.renders_tools:
            items, tools = inline_tools(items, tools), None
        try:
            rendered: str = self._tok.apply_chat_template(
                items,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **{k: v for k, v in (template_kwargs or {}).items() if k not in _TEMPLATE_OWN},
            )
        except TemplateSyntaxError:
            raise  # the model's template is broken: not the client's to fix
        except TemplateError as exc:  # the template's own raise_exception, or a message it cannot read
            raise PromptRejected(f"the model's chat template rejected the messages: {exc}") from exc
        return rendered

    @functools.cached_property
    def template_text(self) -> str:
        """The chat template's text (all of a named set's, joined), for the format choices made from it."""
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(str(t) for t in template.values())
        return str(template or "")

    def reasoning_mode(self, prompt: Sequence[int], override: ReasoningOverride | None = None) -> ReasoningMode | None:
        """How the reply to this rendered prompt is split into reasoning and content (engines/reasoning.py)."""
        tail = self._tok.decode(list(prompt[-8:]), skip_special_tokens=False)
        return reasoning_mode(self.template_text, tail, override)

    def encode(self, text: str) -> list[int]:
        """The text's ids without specials added. A fast tokenizer's own Rust object is asked directly: the same
        ids at half the cost of transformers' wrapper around it (0.27 against 0.13 ms for the bench prompt, on a
        request's path to its first token; issue 43)."""
        backend = self._backend
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self._tok.encode(text, add_special_tokens=False))

    @functools.cached_property
    def _backend(self) -> Any:
        """The `tokenizers.Tokenizer` a fast tokenizer wraps, or None (a slow or custom tokenizer)."""
        backend = getattr(self._tok, "_tokenizer", None)
        return backend if isinstance(backend, tokenizers.Tokenizer) else None

    @functools.cached_property
    def _dropped_ids(self) -> frozenset[int] | None:
        """The special ids decoding drops when this vocabulary has a kept one (None: it has none, all drop)."""
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        special = {int(i) for i, t in added.items() if getattr(t, "special", False)} | set(self._tok.all_special_ids)
        kept = {i for i in special if self._tok.convert_ids_to_tokens(i) in KEPT_SPECIAL_TOKENS} - self.eos_ids
        return frozenset(special - kept) if kept else None

    def decode(self, ids: Sequence[int]) -> str:
        dropped = self._dropped_ids
        if dropped is None:
            return self._tok.decode(list(ids), skip_special_tokens=True)
        return self._tok.decode([i for i in ids if i not in dropped], skip_special_tokens=False)


def _expand(rendered: str, marker: str, runs: Sequence[str]) -> str:
    """The rendered prompt with its n-th image marker replaced by runs[n]; PromptRejected when the template wrote a
    marker for other than every image (they could not be told apart)."""
    pieces = rendered.split(marker)
    if len(pieces) != len(runs) + 1:
        raise PromptRejected(f"the chat template wrote {len(pieces) - 1} image markers for {len(runs)} images")
    return "".join(p + r for p, r in zip(pieces, [*runs, ""], strict=True))


def _content(message: ChatMessage) -> str | list[dict[str, str]]:
    """The message's text, or where it holds images its parts in order as templates read them ({"type": "image"}
    where the template writes its image marker)."""
    if not message.images or not isinstance(message.content, list):
        return message.text
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in message.content]


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates read them: an assistant's tool calls with their arguments as an
    object (Qwen and Llama 3 templates serialise them with `tojson`), a tool result with its call id.

    Call ids are rewritten to nine alphanumerics, the same id to the same one, because Mistral's templates
    refuse any other shape and clients send whatever ids they hold (ours, `toolu_…` from Claude clients, ids
    from another provider); no other family here renders ids at all. A tool result without an id (Ollama's
    messages carry none) answers the earliest unanswered call of the assistant turn before it."""
    out: list[dict[str, Any]] = []
    unanswered: list[str] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": _content(message)}
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": template_call_id(c.id), "type": "function",
                 "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                for c in message.tool_calls
            ]
            unanswered = [c["id"] for c in item["tool_calls"]]
        if message.role == "tool":
            call_id = template_call_id(message.tool_call_id) if message.tool_call_id else None
            call_id = call_id or (unanswered[0] if unanswered else None)
            if call_id is not None:
                item["tool_call_id"] = call_id
                unanswered = [u for u in unanswered if u != call_id]
        out.append(item)
    return out


def template_call_id(call_id: str) -> str:
    """A call id as nine alphanumerics: kept when it already is, else the start of its SHA-256 (stable, so a
    call and its result still match)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> set[int]:
    """End-of-generation ids from the tokenizer, config.json and generation_config.json (chat models list
    several, e.g. Llama 3's <|eot_id|> next to <|end_of_text|>)."""
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            value = read_config(path).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InvalidModelFile(f"{model_dir.name}: eos_token_id must be token ids, not {sorted(map(repr, ids))}")
    return set(ids)


class IncrementalDecoder:
    """Turns a token stream into text deltas that never end inside a UTF-8 codepoint.

    Decodes a short window (from the last released boundary) rather than the whole output each token, keeping
    a little left context because some tokenizers render a token differently at the start of a string.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: context already released
        self._read = 0  # tokens up to here are released as text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._release(final=False)

    def piece(self, token_id: int) -> str:
        """One token decoded alone (the text logprobs report for it; part of a codepoint decodes as U+FFFD)."""
        return self._decode([token_id])

    def flush(self) -> str:
        """Whatever is left at the end of generation, even an incomplete codepoint."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        released = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(released) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(released) :]


class StopMatcher:
    """Cuts the stream before the first stop string, holding back tails that may be one's beginning.

    `matched` names the stop string that ended the text (the earliest in it, the first listed on a tie): APIs that
    report which sequence stopped a reply (Anthropic's `stop_sequence`) need it, and the cut text no longer shows it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """The text safe to emit now, and whether a stop string was reached (emit nothing after it)."""
        pending = self._held + text
        hits = [(i, n) for n, i in enumerate(pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            at, which = min(hits)
            self._held, self.matched = "", self._stops[which]
            return pending[:at], True
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
