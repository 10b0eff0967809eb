"""Mistral: ``[TOOL_CALLS]`` and then the calls, to the end of the output. Two forms, both
read: a JSON list (Mistral 7B v0.3, Nemo, Small 3.1), which the grammar writes::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

and the tekken v11+ form (Small 3.2, Magistral, Devstral), one marker per call::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Both stream their arguments as the model writes them (:class:`MistralScanner`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    json_object,
    marked_calls,
    named_call,
)
from modelpool.shared.tool_formats.streaming import ArgumentsPiece, ArgumentsScanner, Streamed

OPEN = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\][A-Za-z0-9]*)?\s*\[ARGS\]", re.S)
ARGS = "[ARGS]"
_MAX_HEAD = 200  # characters of a NAME[ARGS] head: a longer one is not followed


@dataclass(frozen=True)
class Mistral:
    name: str = "mistral"

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        more = ' (", " call)*' if parallel else ""
        calls = f'"[" call{more} "]"'
        lines = marked_calls(OPEN, calls, mode, tokens)
        lines += calls_rule(tools, lambda tool: json_call(tool, "arguments"))
        return grammar_text(lines)

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        return RegionReader({OPEN: None}, _parse, scanner=MistralScanner)


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


@dataclass
class MistralScanner:
    """The calls after ``[TOOL_CALLS]`` as they stream: a JSON list (the region starts
    with ``[``) by one named scanner; ``NAME[ARGS]{...}`` calls (each after its own
    marker) by a bare scanner per call, once its name is read."""

    written: list[str | None] = field(default_factory=list)
    _list: ArgumentsScanner | None = None
    _call: ArgumentsScanner | None = None
    _head: str = ""
    _off: bool = False

    def feed(self, text: str) -> list[Streamed]:
        if self._list is not None:
            return self._list.feed(text)
        out: list[Streamed] = []
        for index, char in enumerate(text):
            if self._off:
                break
            if self._call is not None:
                self._call_char(self._call, char, out)
                continue
            if char == "[" and not self._head.strip() and not self.written:
                self._list = ArgumentsScanner("named", first="[", written=self.written)
                return out + self._list.feed(text[index:])
            self._head_char(char)
        return out

    def end(self) -> list[Streamed]:
        return []

    def _head_char(self, char: str) -> None:
        self._head += char
        if not self._head.endswith(ARGS):
            self._off = len(self._head) > _MAX_HEAD
            return
        head = self._head.strip().removeprefix(OPEN)
        named = _NAMED.fullmatch(head)
        if named is None:
            self._off = True  # read whole at the region's end: the error is raised there
            return
        self._call, self._head = ArgumentsScanner("bare", name=named.group(1)), ""

    def _call_char(self, call: ArgumentsScanner, char: str, out: list[Streamed]) -> None:
        for piece in call.feed(char):
            last = out[-1] if out else None
            if isinstance(piece, ArgumentsPiece) and isinstance(last, ArgumentsPiece):
                out[-1] = ArgumentsPiece(last.text + piece.text)
            else:
                out.append(piece)
        if call.written:
            self.written.append(call.written[0])
            self._call = None
