"""The formats written in the model's own special tokens:

- DeepSeek V3.1: `<|tool▁calls▁begin|><|tool▁call▁begin|>f<|tool▁sep|>{json}<|tool▁call▁end|>…<|tool▁calls▁end|>`
  (the bars are U+FF5C, fullwidth, and U+2581 joins the words); V3's older body too,
  `function<|tool▁sep|>f\\n```json\\n{json}\\n````;
- Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{json}
  <|tool_call_end|>…<|tool_calls_section_end|>` (the call's id names the function and its index);
- gpt-oss (harmony): a message to a recipient, `<|channel|>commentary to=functions.f <|constrain|>json<|message|>
  {json}<|call|>`; the recipient may also stand in the role part (`<|start|>assistant to=functions.f<|channel|>
  commentary json<|message|>…`). `<|call|>` ends the turn and may be dropped as the stop token, so the end of the
  text also ends the arguments.

The tokens reach this text only where decoding keeps them (they are added tokens in these tokenizers)."""

from __future__ import annotations

import re

from skulk.formats.tool_parsers.base import RawCall, all_or_none, before, json_args


def ds_token(words: str) -> str:
    """A DeepSeek special token: `<|tool calls begin|>` written with U+FF5C bars and U+2581 between words."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


DS_MARKERS = (ds_token("tool calls begin"), ds_token("tool call begin"))
DS_CLOSE = ds_token("tool call end")
_DS_CALL = re.compile(
    re.escape(ds_token("tool call begin")) + "(.*?)" + re.escape(ds_token("tool sep")) + "(.*?)"
    + re.escape(ds_token("tool call end")), re.DOTALL)
_DS_V3_BODY = re.compile(r"\s*([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)
KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>")
KIMI_CLOSE = "<|tool_call_end|>"
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
HARMONY_MARKERS = (*(head + f"<|channel|>{channel} to=" for head in ("<|start|>assistant", "")
                      for channel in ("commentary", "analysis")), "<|start|>assistant to=")
HARMONY_CLOSE = "<|call|>"
_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?(?P<pre>[^<]*)<\|channel\|>(?P<channel>\w+)(?P<post>[^<]*)"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)(?:<\|call\|>|<\|end\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL)
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def _ds_call(name: str, body: str) -> RawCall | None:
    name = name.strip()
    if name == "function" and (v3 := _DS_V3_BODY.fullmatch(body)) is not None:  # V3: type, then name and JSON
        name, body = v3.group(1).strip(), v3.group(2)
    args = json_args(body)
    return (name, args) if name and args is not None else None


def deepseek_split(text: str) -> tuple[str, list[RawCall]] | None:
    found = before(text, DS_MARKERS)
    calls = all_or_none([_ds_call(n, b) for n, b in _DS_CALL.findall(found[1])]) if found else None
    return (found[0].strip(), calls) if found and calls is not None else None


def _kimi_call(ident: str, body: str) -> RawCall | None:
    name = ident.rpartition(":")[0] if ":" in ident else ident  # functions.get_weather:0
    name = name.removeprefix("functions.")
    args = json_args(body)
    return (name, args) if name and args is not None else None


def kimi_split(text: str) -> tuple[str, list[RawCall]] | None:
    found = before(text, KIMI_MARKERS)
    calls = all_or_none([_kimi_call(i, b) for i, b in _KIMI_CALL.findall(found[1])]) if found else None
    return (found[0].strip(), calls) if found and calls is not None else None


def _harmony_calls(section: str) -> list[RawCall | None]:
    out: list[RawCall | None] = []
    for m in _HARMONY_CALL.finditer(section):
        to = _RECIPIENT.search(m.group("pre") + " " + m.group("post"))
        if to is None:
            continue  # a message to nobody (a preamble, the final answer) among the calls is not a call
        args = json_args(m.group("body"))
        out.append((to.group(1), args) if args is not None else None)
    return out


def harmony_split(text: str) -> tuple[str, list[RawCall]] | None:
    found = before(text, HARMONY_MARKERS)
    calls = all_or_none(_harmony_calls(found[1])) if found else None
    if found is None or calls is None:
        return None
    return found[0].removesuffix("<|start|>assistant").strip(), calls
