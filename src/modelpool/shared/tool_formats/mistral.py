"""Mistral: ``[TOOL_CALLS]`` and then the calls, to the end of the output. Two forms, both
read: a JSON list (Mistral 7B v0.3, Nemo, Small 3.1), which the grammar writes::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

and the tekken v11+ form (Small 3.2, Magistral, Devstral), one marker per call::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
"""

from __future__ import annotations

import json
import re
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
    free_text_or,
    json_object,
    lark_string,
    mark,
    named_call,
)
from modelpool.shared.tool_formats.streaming import ArgumentsScanner

OPEN = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\][A-Za-z0-9]*)?\s*\[ARGS\]", re.S)


@dataclass(frozen=True)
class Mistral:
    name: str = "mistral"

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        more = ' (", " call)*' if parallel else ""
        calls = f'"[" call{more} "]"'
        if mode == "auto":
            lines = free_text_or(OPEN, calls, tokens)
        else:
            lines = [f"start: {mark(OPEN, tokens)} {calls}"]
        lines += calls_rule(tools, _call)
        return "\n".join(["%llguidance {}", *lines]) + "\n"

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        return RegionReader(
            {OPEN: None}, _parse, scanner=lambda: ArgumentsScanner("named", first="[")
        )


def _call(tool: GrammarTool) -> str:
    head = lark_string(f'{{"name": "{tool.name}", "arguments": ')
    return f'{head} {tool.fragment} "}}"'


def _parse(opened: str, body: str) -> list[RawCall]:
    text = body.strip()
    if text.startswith("["):
        try:
            listed = json.loads(text)
        except ValueError:
            raise MalformedCall("the calls are not a JSON list", opened + body) from None
        if not isinstance(listed, list):
            raise MalformedCall("the calls are not a JSON list", opened + body)
        return [named_call(item, ("arguments", "parameters"), text) for item in listed]
    calls = []
    for part in text.split(OPEN):
        if not part.strip():
            continue
        head = _NAMED.match(part)
        if head is None:
            raise MalformedCall("a call without NAME[ARGS]", opened + part)
        arguments = json_object(part[head.end() :].strip(), "the arguments")
        calls.append(RawCall(head.group(1), arguments))
    return calls
