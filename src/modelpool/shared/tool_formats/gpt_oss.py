"""gpt-oss (OpenAI's Harmony format): each message of the answer has a header, ended by
``<|message|>``; a call is a ``commentary`` message addressed to ``functions.NAME``, its
JSON arguments ended by ``<|call|>``::

    <|channel|>analysis<|message|>The user wants...<|end|><|start|>assistant<|channel|>
    commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(one line: broken here after ``<|channel|>``).
The recipient may come before the channel too (``<|start|>assistant to=functions.X
<|channel|>commentary json<|message|>``). The text of the other messages (``final``,
``analysis``) is content here, their headers and ends dropped; a reasoning parser, when
one runs first, takes ``analysis`` away.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelpool.shared.tool_formats.base import (
    GrammarTool,
    MalformedCall,
    Mode,
    Piece,
    RawCall,
    SyntaxReader,
    calls_rule,
    grammar_text,
    json_object,
    lark_string,
    mark,
    partial_suffix,
    with_written,
)
from modelpool.shared.tool_formats.streaming import ArgumentsScanner

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RECIPIENT = "to=functions."
# Ends of a message: dropped from the content.
_ENDS = (END, "<|return|>", CALL)
_HEADS = (START, CHANNEL, RECIPIENT)
_NAME = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")


@dataclass(frozen=True)
class GptOss:
    name: str = "gpt_oss"

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        # A message of analysis, then the final answer or (Harmony ends the answer at a
        # call: <|call|> is a stop token) one call; ``required``: the call. One analysis at
        # most: once thinking ended (the model's end or the worker's forced one, which
        # stops at ``<|start|>assistant``), the next channel is the answer's or the call's.
        analysis_end = (
            [f"analysis_end: BODY {mark(END, tokens)}"]
            if END in tokens
            else [f"analysis_end[lazy]: BODY {lark_string(END)}"]
        )
        lines = [
            "start: analysis? " + ("(final | called)" if mode == "auto" else "called"),
            f'analysis: {mark(CHANNEL, tokens)} "analysis" {mark(MESSAGE, tokens)} analysis_end '
            f'{mark(START, tokens)} "assistant"',
            *analysis_end,
            f'final: {mark(CHANNEL, tokens)} "final" {mark(MESSAGE, tokens)} BODY',
            f"called: {mark(CHANNEL, tokens)} {lark_string('commentary ' + RECIPIENT)} call",
            "BODY: /(.|\\n)*/",
        ]
        lines += calls_rule(tools, lambda tool: _call(tool, tokens))
        return grammar_text(lines)

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        return HarmonyReader()


def _call(tool: GrammarTool, tokens: Mapping[str, int]) -> str:
    name = lark_string(f"{tool.name} ")
    head = f'{name} {mark(CONSTRAIN, tokens)} "json" {mark(MESSAGE, tokens)}'
    return f"{head} {tool.fragment} {mark(CALL, tokens)}"


@dataclass
class HarmonyReader:
    """Content, headers and calls; a header is held until its ``<|message|>``."""

    _buffer: str = ""
    _state: str = "text"  # "text", "header" or "call"
    _header: str = ""
    _name: str = ""
    _calls: int = 0
    _scanning: ArgumentsScanner | None = None
    _scanned: int = 0

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return pieces

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self._state == "call":
            # <|call|> is a stop token: the output may end without it.
            self._scan(self._buffer, pieces)
            pieces.append(self._read_call(self._buffer))
        elif self._state == "header":
            header = self._header + self._buffer
            if RECIPIENT in header:
                raise MalformedCall("the output ends in a call's header", header)
        elif self._buffer and not (self._calls and not self._buffer.strip()):
            pieces.append(self._buffer)
        self._buffer, self._state, self._header = "", "text", ""
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        if self._state == "call":
            end = self._buffer.find(CALL)
            if end < 0:
                keep = partial_suffix(self._buffer, (CALL,))
                self._scan(self._buffer[: len(self._buffer) - keep], pieces)
                return False
            self._scan(self._buffer[:end], pieces)
            pieces.append(self._read_call(self._buffer[:end]))
            self._buffer = self._buffer[end + len(CALL) :]
            self._state = "text"
            return True
        if self._state == "header":
            end = self._buffer.find(MESSAGE)
            if end < 0:
                return False
            header = self._header + self._buffer[:end]
            self._buffer = self._buffer[end + len(MESSAGE) :]
            named = _NAME.search(header)
            self._state = "call" if named else "text"
            self._name = named.group(1) if named else ""
            self._header = ""
            self._scanning = ArgumentsScanner("bare", name=self._name) if named else None
            self._scanned = 0
            return True
        found = [(self._buffer.find(m), m) for m in (*_HEADS, *_ENDS) if m in self._buffer]
        if found:
            start, marker = min(found)
            self._content(self._buffer[:start], pieces)
            self._buffer = self._buffer[start + len(marker) :]
            if marker in _HEADS:
                self._state = "header"
                self._header = marker
            return True
        keep = partial_suffix(self._buffer, (*_HEADS, *_ENDS))
        self._content(self._buffer[: len(self._buffer) - keep], pieces)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _content(self, text: str, pieces: list[Piece]) -> None:
        if text and not (self._calls and not text.strip()):
            pieces.append(text)

    def _scan(self, body: str, pieces: list[Piece]) -> None:
        """Stream the open call's arguments (``body``: its text so far)."""
        if self._scanning is not None and len(body) > self._scanned:
            pieces += self._scanning.feed(body[self._scanned :])
            self._scanned = len(body)

    def _read_call(self, body: str) -> RawCall:
        self._calls += 1
        call = RawCall(self._name, json_object(body.strip(), "the arguments"))
        scanning, self._scanning = self._scanning, None
        (read,) = with_written([call], scanning, body)
        return read
