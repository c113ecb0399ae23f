"""Each family's tool-call format (tool_parsers/): the finished text, and the same text streamed split at
every character boundary, come out as the same content and calls; a call's text never streams as content;
malformed call text stays content; arguments are coerced to the tools' schemas; the parser is picked from the
chat template, the card, or the family name."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from skulk.api.chat_options import tool_family
from skulk.api.tool_calls import ToolCallStream, ToolFormat, could_be_tool_call, parse_tool_calls
from skulk.formats.tool_parsers import PARSERS, coerce_arguments, parser_for, pick_parser
from skulk.formats.tool_parsers.special_tokens import ds_token
from skulk.types.chat import ChatCompletionRequest
from skulk.types.memory import Memory
from skulk.types.models import ModelCard
from skulk.types.state import State
from tests.unit.factories import api_services

SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "zip": {"type": "string"}}},
    "run": {"type": "object", "properties": {
        "code": {"type": "string"}, "opts": {"type": "object"}, "ids": {"type": "array"}, "ratio": {"type": "number"}}},
}

DS = {k: ds_token(k.replace("_", " ")) for k in ("tool_calls_begin", "tool_call_begin", "tool_sep", "tool_call_end",
                                                  "tool_calls_end")}
_QC_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>")
_GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
             "\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n</tool_call>")
_KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
              '{"city": "Paris", "days": "3"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
              "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
_DS_CALL = (f'{DS["tool_calls_begin"]}{DS["tool_call_begin"]}get_weather{DS["tool_sep"]}{{"city": "Paris"}}'
            f'{DS["tool_call_end"]}{DS["tool_call_begin"]}get_time{DS["tool_sep"]}{{}}{DS["tool_call_end"]}'
            f'{DS["tool_calls_end"]}')
_HARMONY_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
PARIS = {"city": "Paris"}

# (parser, text, content, [(name, arguments)]): an empty call list means the whole text is content
CASES: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", PARIS)]),
    ("hermes", 'Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": {"days": "2"}}</tool_call>', "Let me look.", [("a", {}), ("b", {"days": "2"})]),
    ("hermes", "<tool_call>{not json}</tool_call>", "", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}', "", []),  # never closed: not a call
    ("hermes", "Use <b>bold</b> and <tool> tags.", "", []),
    ("qwen3_coder", _QC_CALL, "", [("get_weather", {"city": "Paris", "days": 3, "zip": "75001"})]),
    ("qwen3_coder", "Running it.\n" + _QC_CALL.replace("get_weather", "run", 1).replace("city", "code", 2)
     .replace("Paris", "x = 1\nprint(x)") + _QC_CALL, "Running it.",
     [("run", {"code": "x = 1\nprint(x)", "days": "3", "zip": "75001"}),
      ("get_weather", {"city": "Paris", "days": 3, "zip": "75001"})]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>", "", []),
    ("qwen3_coder", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "", [("f", {"a": 1})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", PARIS)]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"q": "x; y"}}; {"name": "b", "parameters": {}}', "",
     [("a", {"q": "x; y"}), ("b", {})]),
    ("llama3", '{"answer": 42}', "", []),
    ("llama3", "Sure, {x}", "", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", PARIS)]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b"}]', "Checking.",
     [("a", {}), ("b", {})]),
    ("mistral", "See [the docs](x)", "", []),
    ("mistral", "[TOOL_CALLS] [1, 2]", "", []),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[CALL_ID]x1y2z3w4v[ARGS]{}', "Sure.",
     [("get_weather", PARIS), ("b", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"', "", []),
    ("deepseek_v31", _DS_CALL, "", [("get_weather", PARIS), ("get_time", {})]),
    ("deepseek_v31", "Let me check." + _DS_CALL, "Let me check.", [("get_weather", PARIS), ("get_time", {})]),
    ("deepseek_v31", f'{DS["tool_calls_begin"]}{DS["tool_call_begin"]}function{DS["tool_sep"]}get_weather\n```json\n'
     f'{{"city": "Paris"}}\n```{DS["tool_call_end"]}{DS["tool_calls_end"]}', "", [("get_weather", PARIS)]),
    ("deepseek_v31", f'{DS["tool_calls_begin"]}{DS["tool_call_begin"]}f{DS["tool_sep"]}{{oops{DS["tool_call_end"]}',
     "", []),
    ("kimi_k2", _KIMI_CALL, "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("kimi_k2", "One moment. " + _KIMI_CALL, "One moment.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0 {}<|tool_call_end|>", "", []),
    ("glm45", _GLM_CALL, "", [("get_weather", {"city": "Paris", "days": 3, "metric": True})]),
    ("glm45", "Looking it up.\n" + _GLM_CALL + "\n<tool_call>get_time\n</tool_call>", "Looking it up.",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True}), ("get_time", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", "", []),
    ("glm45", "<tool_call>not a name</tool_call>", "", []),
    ("harmony", _HARMONY_CALL, "", [("get_weather", PARIS)]),
    ("harmony", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + _HARMONY_CALL,
     "<|channel|>analysis<|message|>Need weather.<|end|>", [("get_weather", PARIS)]),
    ("harmony", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
     "", [("get_weather", PARIS)]),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{broken<|call|>", "", []),
    ("harmony", "<|channel|>final<|message|>It is sunny.<|return|>", "", []),
]


def _ids(case: tuple[str, str, str, list[Any]]) -> str:
    """Stable across processes (str hashes are salted per process, and xdist's workers must collect alike)."""
    return f"{case[0]}-{'calls' if case[3] else 'text'}-{zlib.crc32(case[1].encode()) % 10_000}"


def _names_args(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_the_whole_text_reads_as_content_and_calls(case: tuple[str, str, str, list[Any]]) -> None:
    parser, text, content, calls = case
    left, got = parse_tool_calls(ToolFormat(parser, SCHEMAS), text, "x")
    assert _names_args(got) == calls
    assert left == (content if calls else text)  # malformed or absent calls: every character stays content
    assert [c.id for c in got] == [f"call_x_{i}" for i in range(len(calls))]


def _stream(parser: str, pieces: list[str]) -> tuple[str, str, list[Any]]:
    stream = ToolCallStream(ToolFormat(parser, SCHEMAS))
    out = "".join(stream.push(p) for p in pieces)
    tail, calls = stream.finish("x")
    return out, tail, calls


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_streamed_at_every_split_the_result_equals_the_whole_text(case: tuple[str, str, str, list[Any]]) -> None:
    parser, text, content, calls = case
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        out, tail, got = _stream(parser, pieces)
        assert _names_args(got) == calls, pieces
        if calls:
            assert out.strip() == content and tail == "", pieces  # no fragment of a call went out as text
        else:
            assert out + tail == text, pieces


@pytest.mark.parametrize(
    ("parser", "text"),
    [("hermes", "Hello there, this is plain."), ("llama3", "The answer is 4."), ("deepseek_v31", "No tools."),
     ("kimi_k2", "Plain <b>reply</b>."), ("harmony", "<|channel|>final<|message|>Hi"), ("glm45", "A < B")],
)
def test_plain_answers_stream_as_they_come(parser: str, text: str) -> None:
    stream = ToolCallStream(parser)
    out = [stream.push(ch) for ch in text]
    assert "".join(out) == text and stream.finish("x") == ("", [])  # nothing waited for the end
    assert (out[0] == text[0]) != could_be_tool_call(parser, text[:1])  # held only while it may start a call


@pytest.mark.parametrize(
    ("value", "schema", "want"),
    [("3", {"type": "integer"}, 3), ("3.0", {"type": "integer"}, 3), ("three", {"type": "integer"}, "three"),
     ("2.5", {"type": "integer"}, "2.5"), ("2.5", {"type": "number"}, 2.5), ("7", {"type": "number"}, 7),
     ("true", {"type": "boolean"}, True), ("False", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
     ('{"a": 1}', {"type": "object"}, {"a": 1}), ("[1, 2]", {"type": "array"}, [1, 2]),
     ("[1, 2]", {"type": "object"}, "[1, 2]"), ("null", {"type": ["integer", "null"]}, None),
     ("4", {"type": ["integer", "null"]}, 4), ("3", {"type": "string"}, "3"),
     ("3", {"type": ["string", "integer"]}, "3"),
     ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5), (3, {"type": "string"}, 3),
     ("3", {}, "3"), ({"n": "2"}, {"type": "object", "properties": {"n": {"type": "integer"}}}, {"n": 2})],
)
def test_arguments_are_coerced_to_the_schema_types(value: Any, schema: dict[str, Any], want: Any) -> None:
    got = coerce_arguments({"v": value, "other": "1"}, {"type": "object", "properties": {"v": schema}})
    assert got == {"v": want, "other": "1"} and type(got["v"]) is type(want)


QWEN3_CODER_TEMPLATE = ('{{- "<tool_call>\\n<function=" + tool_call.name + ">\\n" }}{%- for k, v in args %}'
                        '{{- "<parameter=" + k + ">\\n" }}')
GLM45_TEMPLATE = "{{- '<tool_call>' + tc.name }}{% for k, v in args %}\n<arg_key>{{ k }}</arg_key>"
TEMPLATES = [
    ("{{- '<tool_call>\\n' }}{{- tool_call | tojson }}{{- '\\n</tool_call>' }}", "hermes"),
    (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
    (GLM45_TEMPLATE, "glm45"),
    ("{{'" + DS["tool_calls_begin"] + DS["tool_call_begin"] + "' + tool['function']['name']}}", "deepseek_v31"),
    ("{{ '<|tool_calls_section_begin|>' }}{% for tc in tool_calls %}<|tool_call_begin|>", "kimi_k2"),
    ('{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}', "harmony"),
    ("{{- '[TOOL_CALLS][' }}{%- for tool_call in message.tool_calls %}", "mistral"),
    ("Given the following functions, please respond with a JSON for a function call {{ '<|python_tag|>' }}",
     "llama3"),
    ("{{ '<|im_start|>' + message.role }}", None),
    ("<|channel|>final without tools", None),
]


@pytest.mark.parametrize(("template", "name"), TEMPLATES)
def test_the_parser_is_picked_from_the_template_markers(template: str, name: str | None) -> None:
    picked = pick_parser(template, "some_family")
    assert picked.name == (name or "hermes")
    assert pick_parser(template, "some_family", "kimi_k2").name == "kimi_k2"  # the card's override wins


def test_without_a_template_the_family_name_picks() -> None:
    picks = {f: pick_parser(None, f).name for f in ("llama", "mistral", "gpt_oss", "glm4_moe", "deepseek_v3",
                                                    "qwen2", "qwen3_moe", "")}
    assert picks == {"llama": "llama3", "mistral": "mistral", "gpt_oss": "harmony", "glm4_moe": "glm45",
                     "deepseek_v3": "deepseek_v31", "qwen2": "hermes", "qwen3_moe": "hermes", "": "hermes"}
    assert all(parser_for(name) is p for name, p in PARSERS.items())


def _card(**fields: Any) -> ModelCard:
    return ModelCard.model_validate({"model_id": "org/tooly", "family": "qwen3_moe", "n_layers": 2, "hidden_size": 8,
                                     "num_attention_heads": 2, "num_key_value_heads": 1,
                                     "storage_size": Memory.from_bytes(1000), **fields})


def _request() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "org/tooly", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}]})


def test_a_request_reads_calls_by_the_template_on_this_node_or_the_cards_override(tmp_path: Path) -> None:
    node = api_services(State(model_cards={"org/tooly": _card()}), home=tmp_path)  # type: ignore[dict-item]
    fmt = tool_family(node, _request())
    assert fmt is not None and fmt.parser == "hermes" and fmt.schemas == {"get_weather": SCHEMAS["get_weather"]}
    where = node.files.store_dir("org/tooly")
    where.mkdir(parents=True)
    (where / "chat_template.jinja").write_text(QWEN3_CODER_TEMPLATE, encoding="utf-8")
    fmt = tool_family(node, _request())
    assert fmt is not None and fmt.parser == "qwen3_coder"
    _, calls = parse_tool_calls(fmt, _QC_CALL, "x")
    assert json.loads(calls[0].function.arguments)["days"] == 3  # coerced by the offered tool's schema
    node = api_services(State(model_cards={"org/tooly": _card(tool_parser="glm45")}), home=tmp_path)  # type: ignore[dict-item]
    assert (tool_family(node, _request()) or ToolFormat("")).parser == "glm45"
    assert "toolParser" not in _card().model_dump(by_alias=True, exclude_defaults=True)  # old cards unchanged


def test_decoding_keeps_the_special_tokens_calls_are_written_in(tmp_path: Path) -> None:
    """Kimi's and harmony's markers are special tokens: a reply keeps them (the parsers read them); other special
    tokens still drop; a vocabulary without such tokens decodes as before."""
    from transformers import AutoTokenizer

    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.models.demo import ensure_demo_model

    model = ensure_demo_model(tmp_path)
    plain = ChatTokenizer(model)
    text = "<|im_start|>hi"
    assert plain.decode(plain.encode(text)) == plain.hf.decode(plain.encode(text), skip_special_tokens=True)
    hf = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    hf.add_special_tokens({"additional_special_tokens": ["<|tool_call_begin|>", "<|channel|>", "<|secret|>"]})
    hf.save_pretrained(str(model))
    tok = ChatTokenizer(model)
    ids = tok.encode("<|im_start|>a<|secret|><|channel|>b<|tool_call_begin|>c")
    assert tok.decode(ids) == tok.hf.decode(tok.encode("a<|channel|>b<|tool_call_begin|>c"), skip_special_tokens=False)
    assert "<|secret|>" not in tok.decode(ids) and "<|im_start|>" not in tok.decode(ids)


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_every_format_reads_a_forced_call_in_hermes_tags(parser: str) -> None:
    """engines/constrained.py writes a forced call as Hermes JSON on every template but Llama's and Mistral's
    own, so each parser reads it too, whole and streamed."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _names_args(parse_tool_calls(parser, text, "x")[1]) == [("get_weather", PARIS)]
    out, tail, calls = _stream(parser, list(text))
    assert out == tail == "" and _names_args(calls) == [("get_weather", PARIS)]
