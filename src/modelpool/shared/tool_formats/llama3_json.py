"""Llama 3.1/3.2/3.3 JSON tool calling: the answer is the call, a JSON object with
``parameters``, after ``<|python_tag|>`` or alone; several are separated by ``;``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The call is the whole rest of the output (Llama ends it with ``<|eom_id|>`` or
``<|eot_id|>``), so an output that starts with ``{`` is a call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelpool.shared.tool_formats.base import (
    GrammarTool,
    MalformedCall,
    Mode,
    RawCall,
    RegionReader,
    SyntaxReader,
    calls_rule,
    grammar_text,
    json_call,
    named_call,
)
from modelpool.shared.tool_formats.streaming import ArgumentsScanner

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Llama3Json:
    name: str = "llama3_json"

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        more = ' ("; " call)*' if parallel else ""
        if mode == "auto":
            # Free text that neither starts like a call nor holds the tag, or the calls.
            lines = [
                f"start: plain | call{more}",
                "plain: PLAIN",
                "PLAIN: /(.|\\n)*/ & ~/\\s*\\{(.|\\n)*/ & ~/(.|\\n)*<\\|python_tag\\|>(.|\\n)*/",
            ]
        else:
            lines = [f"start: call{more}"]
        lines += calls_rule(tools, lambda tool: json_call(tool, "parameters"))
        return grammar_text(lines)

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        return RegionReader(
            {PYTHON_TAG: None}, _parse, start_opens="{", scanner=lambda: ArgumentsScanner("named")
        )


def _parse(opened: str, body: str) -> list[RawCall]:
    text = body  # after the tag, or from the bare "{" on
    calls: list[RawCall] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return calls
        try:
            value, position = _DECODER.raw_decode(text, position)
        except ValueError:
            raise MalformedCall("a call that is not JSON", opened + body) from None
        calls.append(named_call(value, ("parameters", "arguments"), text))
