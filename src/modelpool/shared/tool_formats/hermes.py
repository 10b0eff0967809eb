"""Hermes (Qwen2.5, Hermes, many fine-tunes): a JSON object between tags, one per call::

<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelpool.shared.tool_formats.base import (
    GrammarTool,
    Mode,
    RawCall,
    RegionReader,
    SyntaxReader,
    calls_rule,
    grammar_text,
    json_call,
    json_object,
    mark,
    marked_calls,
    named_call,
)
from modelpool.shared.tool_formats.streaming import ArgumentsScanner

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class Hermes:
    name: str = "hermes"

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        more = f' ("\\n" {mark(OPEN, tokens)} call)*' if parallel else ""
        lines = marked_calls(OPEN, f"call{more}", mode, tokens)
        lines += calls_rule(
            tools, lambda tool: f"{json_call(tool, 'arguments')} {mark(CLOSE, tokens)}"
        )
        return grammar_text(lines)

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        return RegionReader({OPEN: CLOSE}, _parse, scanner=lambda: ArgumentsScanner("named"))


def _parse(opened: str, body: str) -> list[RawCall]:
    return [named_call(json_object(body.strip(), "the call"), ("arguments", "parameters"), body)]
