"""A forced tool call (tool_choice required or a named function) is written in the family's own syntax, the one the
parser that the chat template selects reads (engines/constrained.py's TOKEN_STYLES, tool_parsers/): per family
the grammar accepts that family's call text, spelled in ordinary tokens or in the vocabulary's special tokens, and
refuses another family's; the parser turns the text back into the call. The XML families (Qwen3-Coder, GLM-4.5)
write each argument in its own tags: the tool's parameters only, in any order, each once, the required ones
present (in the schema's order past ANY_ORDER_MAX parameters), a string as raw text
without the closing tags, any other value as JSON of its schema, read back typed. Then one reply through the torch
engine per family: the demo checkpoint with a DeepSeek-V3.1-, Qwen3-Coder- or GLM-4.5-style template (it renders the
tools and writes calls in the family's syntax), its forced call read back by the template's parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skulk.api.tool_calls import ToolFormat, parse_tool_calls
from skulk.engines.constrained import HERMES, TOKEN_STYLES, Grammars, tool_call_style
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.tokenizer import KEPT_SPECIAL_TOKENS, ChatTokenizer
from skulk.engines.xml_call_grammar import ANY_ORDER_MAX, XML_STYLES, text_without_ebnf, written_sets_ebnf
from skulk.formats.tool_parsers import pick_parser
from skulk.formats.tool_parsers.special_tokens import ds_token
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import ChatCompletionRequest, ChatMessage, OutputConstraint
from tests.fake_hub import set_chat_template

pytestmark = pytest.mark.timeout(120)

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
          "required": ["city", "metric"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": PARAMS}, {"name": "get_time", "parameters": {"type": "object"}}]
ARGS = '{"city": "Paris", "metric": true}'  # the grammar's JSON: no free whitespace, xgrammar's separators
DS = {w: ds_token(w) for w in ("tool calls begin", "tool call begin", "tool sep", "tool call end", "tool calls end")}
# family: (a template showing its call syntax and rendering the tools, model type, its forced call's text)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "hermes": ("{% if tools %}{{ tools|tojson }}{% endif %}{{ '<tool_call>\\n' }}", "qwen2",
               '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call>"),
    "deepseek_v31": ("{% if tools %}{{ tools|tojson }}{% endif %}{{'" + DS["tool calls begin"] + DS["tool call begin"]
                     + "'}}", "deepseek_v3",
                     DS["tool calls begin"] + DS["tool call begin"] + "get_weather" + DS["tool sep"] + ARGS
                     + DS["tool call end"] + DS["tool calls end"]),
    "kimi_k2": ("{% if tools %}{{ tools|tojson }}{% endif %}<|tool_calls_section_begin|><|tool_call_begin|>",
                "kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                "<|tool_call_argument_begin|>" + ARGS + "<|tool_call_end|><|tool_calls_section_end|>"),
    "harmony": ("{% if tools %}{{ tools|tojson }}{% endif %}<|start|>assistant<|channel|>commentary to="
                "{{ 'functions.' + name }}", "gpt_oss",
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + ARGS),
    "qwen3_coder": ("{% if tools %}{{ tools|tojson }}{% endif %}<tool_call>\n<function={{ name }}>\n<parameter=",
                    "qwen3_moe", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"),
    "glm45": ("{% if tools %}{{ tools|tojson }}{% endif %}<tool_call>{{ name }}\n<arg_key>", "glm4_moe",
              "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"),
}
FORCED = OutputConstraint(kind="tool_call", tools=TOOLS, tool_name="get_weather")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def _tokenizer(demo: Path, specials: bool) -> Any:
    """The demo model's tokenizer; with `specials`, the formats' tokens added as special tokens, as the families'
    own vocabularies have them."""
    hf = ChatTokenizer(demo).hf
    if specials:
        hf.add_special_tokens({"additional_special_tokens": sorted(KEPT_SPECIAL_TOKENS)})
    return hf


def _accepts(grammars: Grammars, ids: list[int], eos: int) -> bool:
    matcher = grammars.matcher(FORCED)
    return all(matcher.advance(t) for t in ids) and matcher.advance(eos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_style_is_the_templates_parser(family: str) -> None:
    template, model_type, _ = FAMILIES[family]
    assert pick_parser(template, model_type).name == family
    assert tool_call_style(model_type, True, template) == family
    assert tool_call_style(model_type, False, template) == HERMES  # we rendered the tools, in Hermes' words
    assert tool_call_style("qwen2", True, "", "kimi_k2") == "kimi_k2"  # the card's tool_parser wins


@pytest.mark.parametrize("specials", [False, True], ids=["spelled", "special-tokens"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_grammar_accepts_the_familys_call_and_its_parser_reads_it(demo: Path, family: str, specials: bool) -> None:
    hf = _tokenizer(demo, specials)
    eos = int(hf.eos_token_id)
    grammars = Grammars(hf, len(hf), [eos], family)
    text = FAMILIES[family][2]
    ids = list(hf.encode(text, add_special_tokens=False))
    if specials and family in TOKEN_STYLES:
        assert len(ids) < len(ChatTokenizer(demo).hf.encode(text, add_special_tokens=False)) - 3
    assert _accepts(grammars, ids, eos), text
    for other, (_, _, wrong) in FAMILIES.items():
        if other != family:
            assert not _accepts(grammars, list(hf.encode(wrong, add_special_tokens=False)), eos), other
    content, calls = parse_tool_calls(ToolFormat(family, {"get_weather": PARAMS}), text, "x")
    assert content == "" and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "metric": True})]


EDIT = {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "note": {"type": ["string", "null"]},
    "opts": {"type": "object", "properties": {"deep": {"$ref": "#/$defs/flag"}}, "required": ["deep"]}},
    "required": ["path", "line"], "additionalProperties": False, "$defs": {"flag": {"type": "boolean"}}}
EDIT_TOOLS = [{"name": "edit", "parameters": EDIT}, {"name": "get_weather", "parameters": PARAMS}]
PATH = "src/a.html\n<div></div> <para"  # text with newlines and other closing tags stays raw text
# family: how it writes (key, value) pairs between the call's head and tail
XML: dict[str, tuple[str, str, str]] = {
    "qwen3_coder": ("<tool_call>\n<function=edit>\n", "<parameter={k}>\n{v}\n</parameter>\n",
                    "</function>\n</tool_call>"),
    "glm45": ("<tool_call>edit\n", "<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n", "</tool_call>"),
}


def _xml(family: str, pairs: list[tuple[str, str]]) -> str:
    head, pair, tail = XML[family]
    return head + "".join(pair.replace("{k}", k).replace("{v}", v) for k, v in pairs) + tail


@pytest.mark.parametrize("family", sorted(XML_STYLES))
def test_an_xml_call_has_the_tools_parameters_with_values_of_their_types(demo: Path, family: str) -> None:
    hf = _tokenizer(demo, True)
    eos = int(hf.eos_token_id)
    grammars = Grammars(hf, len(hf), [eos], family)
    required = OutputConstraint(kind="tool_call", tools=EDIT_TOOLS)

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(required)
        return all(matcher.advance(t) for t in hf.encode(text, add_special_tokens=False)) and matcher.advance(eos)

    good = _xml(family, [("path", PATH), ("line", "3"), ("opts", '{"deep": true}')])  # in the schema's order
    assert accepts(good) and accepts(_xml(family, [("path", ""), ("line", "-4"), ("note", "null")]))
    close = "</parameter>" if family == "qwen3_coder" else "</arg_value>"
    for bad in ([("line", "3")], [("path", "a"), ("line", "three")], [("path", "a"), ("line", '"3"')],
                [("path", "a"), ("line", "3"), ("opts", "{}")], [("path", "a"), ("line", "3"), ("opts", '{"deep": 1}')],
                [("path", "a"), ("line", "3"), ("size", "1")], [("path", "a" + close + "b"), ("line", "3")],
                [("path", "a</tool_call>"), ("line", "3")]):
        assert not accepts(_xml(family, bad)), bad
    assert not accepts(good.replace("edit", "delete", 1))
    schemas = {"edit": EDIT}
    content, calls = parse_tool_calls(ToolFormat(family, schemas), "I will edit it.\n" + good, "x")
    assert content == "I will edit it." and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("edit", {"path": PATH, "line": 3, "opts": {"deep": True}})]


def _xml_accepts(demo: Path, family: str, constraint: OutputConstraint) -> Any:
    hf = _tokenizer(demo, True)
    eos = int(hf.eos_token_id)
    grammars = Grammars(hf, len(hf), [eos], family)

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(constraint)
        return all(matcher.advance(t) for t in hf.encode(text, add_special_tokens=False)) and matcher.advance(eos)

    return accepts


@pytest.mark.parametrize("family", sorted(XML_STYLES))
def test_an_xml_call_writes_its_parameters_in_any_order_each_once(demo: Path, family: str) -> None:
    """The parsers read the parameters in any order, and so does the grammar: every order of the parameters a
    call writes, the required ones in each, none twice, none that the tool does not have."""
    accepts = _xml_accepts(demo, family, OutputConstraint(kind="tool_call", tools=EDIT_TOOLS, tool_name="edit"))
    path, line, note, opts = ("path", "a.txt"), ("line", "3"), ("note", "later"), ("opts", '{"deep": false}')
    for pairs in ([opts, line, path], [line, path], [line, note, path, opts], [note, path, opts, line],
                  [path, opts, note, line]):
        assert accepts(_xml(family, pairs)), pairs
        _, calls = parse_tool_calls(ToolFormat(family, {"edit": EDIT}), _xml(family, pairs), "x")
        assert [json.loads(c.function.arguments) for c in calls] == [
            {"path": "a.txt", "line": 3, **{k: {"note": "later", "opts": {"deep": False}}[k] for k, _ in pairs
                                            if k in ("note", "opts")}}]
    for bad in ([line, path, line], [path, line, path], [opts, note, line], [note, opts, path],
                [line, ("size", "1"), path], [line, path, note, note], [opts, line, path, ("line", "4")]):
        assert not accepts(_xml(family, bad)), bad


def test_the_rules_of_the_sets_written_end_only_once_the_required_ones_are_in() -> None:
    rules = written_sets_ebnf(["a", "b", "c"], [True, False, True])
    assert len(rules) == 7  # every set of the three but the full one
    assert rules[0] == "xml_call_written_0 ::= a xml_call_written_1 | b xml_call_written_2 | c xml_call_written_4"
    assert rules[5] == 'xml_call_written_5 ::= "" | b'  # a and c written: the end, or b last
    assert rules[1] == "xml_call_written_1 ::= b xml_call_written_3 | c xml_call_written_5"  # c still needed


@pytest.mark.parametrize("family", sorted(XML_STYLES))
def test_a_tool_with_more_parameters_than_any_order_allows_keeps_the_schemas_order(demo: Path, family: str) -> None:
    """Past ANY_ORDER_MAX parameters (2^n rules) the grammar is the schema's order: still every required one, none
    twice, none other."""
    n = ANY_ORDER_MAX + 1
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}, "required": ["p0", "p2"]}
    accepts = _xml_accepts(demo, family, OutputConstraint(kind="tool_call", tools=[{"name": "edit",
                                                                                     "parameters": many}]))
    assert accepts(_xml(family, [(f"p{i}", str(i)) for i in range(n)])) and accepts(_xml(family, [("p0", "1"),
                                                                                                  ("p2", "1")]))
    for bad in ([("p2", "1"), ("p0", "1")], [("p0", "1")], [("p0", "1"), ("p0", "1"), ("p2", "1")],
                [("p0", "1"), ("p2", "1"), (f"p{n}", "1")]):
        assert not accepts(_xml(family, bad)), bad


@pytest.mark.parametrize("words", [("</parameter>", "</function>", "</tool_call>"), ("</arg_value>", "</tool_call>")],
                         ids=["qwen3_coder", "glm45"])
def test_a_text_value_holds_no_closing_tag(words: tuple[str, ...]) -> None:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1).compile_grammar(
        xgr.Grammar.from_ebnf(text_without_ebnf(words)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_completed()

    for text in ("", "<", "a<</b", "</", "</tool", "<<</function", "x</param>y", "if a </b> c\n<x>", "\u00e9</"):
        assert accepts(text), text
    for word in words:
        for text in (word, "a" + word, "<" + word + "b", "x\n" + word + "\n"):
            assert not accepts(text), text


def test_any_offered_tool_is_one_alternative(demo: Path) -> None:
    hf = _tokenizer(demo, True)
    eos = int(hf.eos_token_id)
    grammars = Grammars(hf, len(hf), [eos], "kimi_k2")
    required = OutputConstraint(kind="tool_call", tools=TOOLS)
    for name, args in (("get_weather", ARGS), ("get_time", "{}")):
        text = (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
                f"{args}<|tool_call_end|><|tool_calls_section_end|>")
        matcher = grammars.matcher(required)
        assert all(matcher.advance(t) for t in hf.encode(text, add_special_tokens=False)) and matcher.advance(eos)


DS_TEMPLATE = (  # DeepSeek V3.1's shape over the demo vocabulary: tools in the system turn, calls in its tokens
    "{%- if tools %}## Tools\n{% for tool in tools %}{{ tool|tojson }}\n{% endfor %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}<\uff5cUser\uff5c>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}<\uff5cAssistant\uff5c>"
    "{{- '" + DS["tool calls begin"] + "' }}{%- for tc in message['tool_calls'] %}"
    "{{- '" + DS["tool call begin"] + "' + tc['function']['name'] + '" + DS["tool sep"] + "' }}"
    "{{- tc['function']['arguments']|tojson }}{{- '" + DS["tool call end"] + "' }}{%- endfor %}"
    "{{- '" + DS["tool calls end"] + "' }}"
    "{%- else %}{{ message['content'] }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<\uff5cAssistant\uff5c></think>{%- endif %}"
)


_TURNS = ("{%- if tools %}## Tools\n{% for tool in tools %}{{ tool|tojson }}\n{% endfor %}{%- endif %}"
          "{%- for message in messages %}{%- if message['role'] == 'user' %}User: {{ message['content'] }}\n"
          "{%- elif message.get('tool_calls') %}{%- for tc in message['tool_calls'] %}CALL{%- endfor %}"
          "{%- else %}{{ message['content'] }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}A: {%- endif %}")
XML_TEMPLATES = {  # the XML families' call shapes over the demo vocabulary: each renders the tools
    "qwen3_coder": _TURNS.replace("CALL", "<tool_call>\n<function={{ tc['function']['name'] }}>\n{%- for k, v in "
                                  "tc['function']['arguments'].items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
                                  "{%- endfor %}</function>\n</tool_call>"),
    "glm45": _TURNS.replace("CALL", "<tool_call>{{ tc['function']['name'] }}\n{%- for k, v in "
                            "tc['function']['arguments'].items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}"
                            "</arg_value>\n{%- endfor %}</tool_call>"),
}
ENGINE_CASES = {"deepseek_v31": (DS_TEMPLATE, DS["tool calls begin"]),  # (template, how its forced call starts)
                "qwen3_coder": (XML_TEMPLATES["qwen3_coder"], "<tool_call>\n<function=get_weather>\n<parameter="),
                "glm45": (XML_TEMPLATES["glm45"], "<tool_call>get_weather\n<arg_key>")}


@pytest.mark.parametrize("family", sorted(ENGINE_CASES))
def test_a_forced_call_through_the_engine_is_read_by_the_templates_parser(tmp_path: Path, family: str) -> None:
    template, start = ENGINE_CASES[family]
    model = ensure_demo_model(tmp_path)
    set_chat_template(model, template)
    engine = TorchEngine(model, max_seq=1024)
    assert engine.tokenizer.renders_tools
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
        "max_tokens": 400, "tools": [{"type": "function", "function": t} for t in TOOLS],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    prompt = engine.encode_chat([ChatMessage(role="user", content="Weather in Paris?")], request.tool_specs())
    engine.add_request("r", prompt, request.sampling())
    outs = []
    while engine.has_work():
        outs += engine.step()
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop", text
    parser = pick_parser(engine.tokenizer.template_text, "llama")
    assert parser.name == family and text.startswith(start), text
    content, calls = parse_tool_calls(ToolFormat(parser.name, {"get_weather": PARAMS}), text, "x")
    assert content == "" and [c.function.name for c in calls] == ["get_weather"], text
    args = json.loads(calls[0].function.arguments)
    assert args["city"] in ("Paris", "Rome") and isinstance(args["metric"], bool), text


ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather; Paris it is.<|end|><|start|>assistant"


@pytest.mark.parametrize("specials", [False, True], ids=["spelled", "special-tokens"])
def test_a_harmony_call_opens_with_the_call_or_an_analysis_header_and_the_call_follows_the_analysis(
        demo: Path, specials: bool) -> None:
    """gpt-oss reasons in its analysis channel, then calls. The reply's opening grammar allows the call or an
    analysis message's header (nothing else: not a final answer); the grammar after the analysis is the next
    message's start and the call. The API splits the reasoning off and reads the call."""
    from skulk.engines.reasoning import splitter_for

    hf = _tokenizer(demo, specials)
    eos = int(hf.eos_token_id)
    grammars = Grammars(hf, len(hf), [eos], "harmony")
    assert grammars.matcher(OutputConstraint(kind="json")).after_analysis is None  # not split as harmony's
    assert grammars.matcher(FORCED).after_analysis is None  # a reply not split as harmony's: the call alone
    call, header = FAMILIES["harmony"][2], "<|channel|>analysis<|message|>"

    def takes(text: str, after: bool = False, end: bool = True) -> bool:
        opening = grammars.matcher(FORCED, harmony_reply=True)
        matcher = opening.after_analysis if after else opening
        assert matcher is not None
        ids = list(hf.encode(text, add_special_tokens=False))
        return all(matcher.advance(t) for t in ids) and (not end or matcher.advance(eos))

    assert takes(call) and takes(header, end=False)  # once the header is out the engine lets the reasoning be
    assert takes("<|start|>assistant" + call, after=True) and not takes(call, after=True)
    for bad in ("<|channel|>final<|message|>It is sunny.", "<|channel|>commentary<|message|>Checking.", "Hi"):
        assert not takes(bad, end=False), bad
    assert not takes("<|start|>assistant<|channel|>final<|message|>Sunny.", after=True, end=False)
    reasoning, content = splitter_for("harmony").push(ANALYSIS + call)
    assert reasoning == "The user wants the weather; Paris it is."
    left, calls = parse_tool_calls(ToolFormat("harmony", {"get_weather": PARAMS}), content, "x")
    assert left == "" and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "metric": True})]


HARMONY_TOOLS_TEMPLATE = (  # gpt-oss' headers over the demo vocabulary: the tools in a developer message
    "{%- if tools %}<|start|>developer<|message|>{{ tools|tojson }}<|end|>{%- endif %}"
    "{%- for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
    "{#- calls: <|start|>assistant<|channel|>commentary to=functions.f -#}"
)


def _scripted_harmony_reply(engine: TorchEngine, prompt: list[int], request: ChatCompletionRequest, opening: str
                            ) -> tuple[str, str, str, Any]:
    """The reply's first tokens scripted (`opening`), the rest sampled under its grammar: (its text, the reasoning
    and content harmony's split reads from it, the split's tally)."""
    from skulk.engines.reasoning import ReasoningTally

    script = engine.tokenizer.encode(opening)
    engine.fault_hook = lambda where, req: script[req.generated] if where == "sample" and req.generated < len(
        script) else None
    engine.add_request("r", prompt, request.sampling())
    outs = []
    while engine.has_work():
        outs += engine.step()
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop" and all(o.error is None for o in outs), text
    tally = ReasoningTally("harmony")
    pieces = [tally.push(o.text) for o in outs] + [tally.splitter.finish()]
    return text, "".join(r for r, _ in pieces), "".join(c for _, c in pieces), tally


HARMONY_OPENINGS = {  # case: (the reply's scripted first tokens, reasoning budget)
    "budget-closes": ("<|channel|>analysis<|message|>", 60),
    "model-closes": ("<|channel|>analysis<|message|>I should call it.<|end|>", None),
    "no-analysis": ("<|channel|>c", None),
}


@pytest.mark.parametrize("case", sorted(HARMONY_OPENINGS))
def test_a_harmony_reply_may_reason_before_the_grammar_writes_its_forced_call(tmp_path: Path, case: str) -> None:
    """Through the torch engine, the reply's first tokens scripted as a model would write them, the rest sampled by
    the random model under the grammar: an analysis message opened, its reasoning free, ended by the reasoning
    budget (HARMONY_TO_CALL, whose `<|start|>assistant` the grammar after it takes) or by the model's own `<|end|>`;
    or no analysis at all. Each time the grammar then writes the forced call, and the API's split reads the
    reasoning apart from it."""
    opening, budget = HARMONY_OPENINGS[case]
    model = ensure_demo_model(tmp_path)
    set_chat_template(model, HARMONY_TOOLS_TEMPLATE)
    engine = TorchEngine(model, max_seq=1024)
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
        "max_tokens": 400, "reasoning_budget": budget, "tools": [{"type": "function", "function": t} for t in TOOLS],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    prompt = engine.encode_chat([ChatMessage(role="user", content="Weather in Paris?")], request.tool_specs())
    assert engine.tokenizer.reasoning_mode(prompt) == "harmony" and engine.grammars.tool_style == "harmony"
    text, reasoning, content, tally = _scripted_harmony_reply(engine, prompt, request, opening)
    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    if case == "no-analysis":
        assert reasoning == "" and text.startswith(call), text
    else:
        assert reasoning and f"<|end|><|start|>assistant{call}" in text, text
        assert tally.tokens <= 60 if budget else reasoning == "I should call it.", text
    left, calls = parse_tool_calls(ToolFormat("harmony", {"get_weather": PARAMS}), content, "x")
    assert left == "" and [c.function.name for c in calls] == ["get_weather"], text
    args = json.loads(calls[0].function.arguments)
    assert args["city"] in ("Paris", "Rome") and isinstance(args["metric"], bool), text


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}


@pytest.mark.parametrize("specials", [False, True], ids=["spelled", "special-tokens"])
def test_a_harmony_json_answer_opens_with_the_final_header_or_an_analysis_and_the_schema_applies_after_it(
        demo: Path, specials: bool) -> None:
    """A JSON response_format on gpt-oss: the reply opens with an analysis message's header or the final channel's
    header and the JSON; after the analysis, the next message's start, the final header and the JSON. Plain text,
    or JSON without the final header, is refused."""
    hf = _tokenizer(demo, specials)
    eos = int(hf.eos_token_id)
    grammars = Grammars(hf, len(hf), [eos], "harmony")
    constraint = OutputConstraint(kind="json", json_schema=SCHEMA)
    answer = '<|channel|>final<|message|>{"city": "Paris"}'

    def takes(text: str, after: bool = False, end: bool = True) -> bool:
        opening = grammars.matcher(constraint, harmony_reply=True)
        matcher = opening.after_analysis if after else opening
        assert matcher is not None
        ids = list(hf.encode(text, add_special_tokens=False))
        return all(matcher.advance(t) for t in ids) and (not end or matcher.advance(eos))

    assert takes(answer) and takes("<|channel|>analysis<|message|>", end=False)
    assert takes("<|start|>assistant" + answer, after=True) and not takes(answer, after=True)
    for bad in ('{"city":"Paris"}', "<|channel|>final<|message|>Paris", '<|channel|>final<|message|>{"town":"x"}'):
        assert not takes(bad), bad


@pytest.mark.parametrize("case", ["budget-closes", "model-closes", "no-analysis"])
def test_a_harmony_reply_may_reason_before_its_json_answer(tmp_path: Path, case: str) -> None:
    """Through the torch engine: a response_format's schema applies to the final channel, after an analysis the
    model opened (ended by itself or by the reasoning budget) or without one; the API's split reads the reasoning
    apart and the content is the schema's JSON."""
    opening, budget = {"budget-closes": ("<|channel|>analysis<|message|>", 40),
                       "model-closes": ("<|channel|>analysis<|message|>Paris, surely.<|end|>", None),
                       "no-analysis": ("<|channel|>f", None)}[case]
    model = ensure_demo_model(tmp_path)
    set_chat_template(model, HARMONY_TOOLS_TEMPLATE)
    engine = TorchEngine(model, max_seq=1024)
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Which city?"}], "temperature": 0,
        "max_tokens": 300, "reasoning_budget": budget,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}})
    prompt = engine.encode_chat([ChatMessage(role="user", content="Which city?")])
    assert engine.tokenizer.reasoning_mode(prompt) == "harmony"
    text, reasoning, content, tally = _scripted_harmony_reply(engine, prompt, request, opening)
    if case == "no-analysis":
        assert reasoning == "", text
    else:
        assert reasoning and "<|end|><|start|>assistant<|channel|>final<|message|>" in text, text
        assert tally.tokens <= 40 if budget else reasoning == "Paris, surely.", text
    assert set(json.loads(content)) == {"city"}, text
