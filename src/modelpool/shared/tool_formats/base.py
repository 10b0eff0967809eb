"""What every tool-call syntax gives: a grammar of its calls and a reader of its text.

A family's module writes the llguidance grammar (Lark) that holds the model to valid
arguments in that family's own call syntax, and reads the generated text, whole or
streamed in pieces of any size, into content and :class:`RawCall` s. A text that opens a
call and cannot be read as one raises :class:`MalformedCall`: it is never content.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from modelpool.shared.tool_formats.streaming import ArgumentsPiece, CallScanner, CallStart


@dataclass(frozen=True)
class RawCall:
    """A call as the model wrote it: the tool's name and its arguments, read; ``written``:
    the arguments' JSON text as the model wrote it, when it was streamed in pieces
    (:mod:`.streaming`: the pieces add up to it)."""

    name: str
    arguments: dict[str, Any]
    written: str | None = None


class MalformedCall(ValueError):
    """Text that opens a call in the family's syntax but cannot be read as one."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(f"{reason}: {text[:200]!r}")
        self.reason = reason
        self.text = text


@dataclass(frozen=True)
class GrammarTool:
    """One offered tool, as a grammar needs it."""

    name: str
    parameters: dict[str, Any]
    fragment: str  # the parameters as an llguidance grammar expression (``%json {...}``)


Mode = Literal["auto", "required"]
"""``auto``: free text, or calls; ``required``: the output starts with a call."""

Piece = str | RawCall | CallStart | ArgumentsPiece
"""What a reader yields: content text, a call, or (from a syntax whose arguments are
JSON, as the model writes them) the start of a call and its arguments' next piece."""


class SyntaxReader(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """The content and calls that ``text`` (the next piece) completes."""

    def finish(self) -> list[Piece]:
        """What was held back at the end of the output."""


class ToolFormat(Protocol):
    """One family's call syntax."""

    @property
    def name(self) -> str:
        """Its ``tool_parser`` name."""

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        """The llguidance (Lark) grammar of the output; ``tokens`` are the ids of the
        syntax's markers that are special tokens of the model (written as those tokens)."""

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        """A reader of one output; ``parameters`` are the offered tools' schemas by name
        (a syntax that writes arguments as text reads them by their types)."""


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def calls_rule(tools: Sequence[GrammarTool], call: Callable[[GrammarTool], str]) -> list[str]:
    """``call: call_0 | call_1 ...`` and each tool's rule, written by ``call``."""
    lines = ["call: " + " | ".join(f"call_{index}" for index in range(len(tools)))]
    lines += [f"call_{index}: {call(tool)}" for index, tool in enumerate(tools)]
    return lines


# Characters a Lark regex (Rust's regex syntax) reads as syntax; ``<`` and ``>`` are not
# escaped there, since ``\\<`` and ``\\>`` mean word boundaries.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def mark(marker: str, tokens: Mapping[str, int]) -> str:
    """A marker in a grammar: the special token it is for the model (a special token is
    not its text's bytes to llguidance), else its text."""
    token = tokens.get(marker)
    return lark_string(marker) if token is None else f"<[{token}]>"


def grammar_text(lines: Sequence[str]) -> str:
    """The llguidance (Lark) grammar of ``lines``."""
    return "\n".join(["%llguidance {}", *lines]) + "\n"


def marked_calls(marker: str, calls: str, mode: Mode, tokens: Mapping[str, int]) -> list[str]:
    """The start of a syntax whose calls follow ``marker``: ``auto``, free text or text up
    to the marker and then ``calls`` (:func:`free_text_or`); ``required``, the marker and
    ``calls`` first."""
    if mode == "auto":
        return free_text_or(marker, calls, tokens)
    return [f"start: {mark(marker, tokens)} {calls}"]


def json_call(tool: GrammarTool, arguments_key: str) -> str:
    """A call as one JSON object, its name first: ``{"name": NAME, KEY: ARGUMENTS}``."""
    head = lark_string(f'{{"name": "{tool.name}", "{arguments_key}": ')
    return f'{head} {tool.fragment} "}}"'


def free_text_or(marker: str, rest: str, tokens: Mapping[str, int]) -> list[str]:
    """``auto``: free text that never holds ``marker``, or text up to the marker (a lazy
    lexeme: it ends at the first marker; text, then the marker's special token) followed
    by ``rest``."""
    escaped = "".join("\\" + char if char in _REGEX_META else char for char in marker)
    if marker in tokens:
        # A text lexeme cannot hold a special token: it ends where the token comes.
        start, opened = f"start: plain | opened {mark(marker, tokens)} {rest}", "opened: TEXT"
    else:
        start, opened = f"start: plain | opened {rest}", f"opened[lazy]: TEXT {lark_string(marker)}"
    return [
        start,
        "plain: PLAIN",
        f"PLAIN: /(.|\\n)*/ & ~/(.|\\n)*{escaped}(.|\\n)*/",
        opened,
        "TEXT: /(.|\\n)*/",
    ]


def json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise MalformedCall(f"{what} is not JSON", text) from None
    if not isinstance(value, dict):
        raise MalformedCall(f"{what} is not a JSON object", text)
    return value


def named_call(value: object, arguments_key: tuple[str, ...], text: str) -> RawCall:
    """``{"name": ..., "arguments": {...}}`` (or another arguments key) as a call; the
    arguments may be a JSON object or a string holding one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise MalformedCall("a call without a name", text)
    key = next((key for key in arguments_key if key in value), None)
    arguments = value.get(key, {}) if key is not None else {}
    if isinstance(arguments, str):
        arguments = json_object(arguments, "the arguments")
    if not isinstance(arguments, dict):
        raise MalformedCall("the arguments are not a JSON object", text)
    return RawCall(value["name"], arguments)


def with_written(
    calls: Sequence[RawCall], scanning: CallScanner | None, text: str
) -> Sequence[RawCall]:
    """``calls`` with the arguments' text their streamed pieces added up to; a region
    whose streamed calls are not the calls it reads is malformed (the pieces went out)."""
    written = scanning.written if scanning is not None else []
    if not any(arguments is not None for arguments in written):
        return calls
    if len(written) != len(calls):
        raise MalformedCall("the calls streamed are not the calls read", text)
    read = []
    for call, arguments in zip(calls, written, strict=True):
        if arguments is None:
            read.append(call)
            continue
        try:
            same = json.loads(arguments) == call.arguments
        except ValueError:
            same = False
        if not same:
            raise MalformedCall("the arguments streamed are not the arguments read", text)
        read.append(RawCall(call.name, call.arguments, arguments))
    return read


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of one of ``markers``."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest


RegionParser = Callable[[str, str], list[RawCall]]
"""Reads one call region: its opening marker and the text after it (to its close)."""


@dataclass
class RegionReader:
    """A reader for the syntaxes whose calls are regions of text: from an opening marker
    to its closing marker (None: to the end of the output). ``start_opens`` is a text
    that opens a region when the output starts with it (after whitespace), kept in the
    region's text (Llama's bare ``{``).

    Content is passed on at once except what could be the start of a marker; whitespace
    between calls (and after the last) is not content.
    """

    opens: Mapping[str, str | None]
    parse: RegionParser
    start_opens: str | None = None
    # A scanner of a region's calls as they stream, made per region.
    scanner: Callable[[], CallScanner] | None = None
    _buffer: str = ""
    _scanning: CallScanner | None = None
    _scanned: int = 0
    _open: str | None = None
    _seen_text: bool = False
    _calls: int = 0
    _markers: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        self._markers = tuple(self.opens)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._open is not None:
                close = self.opens.get(self._open)
                if close is None:
                    # Read whole at the end; its arguments stream meanwhile.
                    self._scan(self._buffer, pieces)
                    return pieces
                end = self._buffer.find(close)
                if end < 0:
                    keep = partial_suffix(self._buffer, (close,))
                    self._scan(self._buffer[: len(self._buffer) - keep], pieces)
                    return pieces
                body = self._buffer[:end]
                self._scan(body, pieces)
                self._buffer = self._buffer[end + len(close) :]
                pieces += self._calls_of(self._open, body)
                self._open = None
                continue
            if self.start_opens is not None and not self._seen_text and not self._calls:
                stripped = self._buffer.lstrip()
                if not stripped:
                    return pieces
                if stripped.startswith(self.start_opens):
                    self._open, self._buffer = self.start_opens, stripped
                    self._opened()
                    continue
                if self.start_opens.startswith(stripped):
                    return pieces
            found = [(self._buffer.find(m), m) for m in self._markers if m in self._buffer]
            if found:
                start, marker = min(found)
                self._content(self._buffer[:start], pieces)
                self._buffer = self._buffer[start + len(marker) :]
                self._open = marker
                self._opened()
                continue
            keep = partial_suffix(self._buffer, self._markers)
            ready = self._buffer[: len(self._buffer) - keep]
            if self._calls and not ready.strip():
                return pieces  # whitespace after a call waits to see what follows
            self._content(ready, pieces)
            self._buffer = self._buffer[len(ready) :]
            return pieces

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self._open is not None:
            opened, body = self._open, self._buffer
            self._open, self._buffer = None, ""
            if self.opens.get(opened) is not None:
                raise MalformedCall("the output ends inside a call", opened + body)
            self._scan(body, pieces)
            return pieces + self._calls_of(opened, body)
        rest, self._buffer = self._buffer, ""
        if rest and not (self._calls and not rest.strip()):
            pieces.append(rest)
        return pieces

    def _opened(self) -> None:
        self._scanning = self.scanner() if self.scanner is not None else None
        self._scanned = 0

    def _scan(self, body: str, pieces: list[Piece]) -> None:
        """Stream the arguments of the open region's ``body`` (its text so far)."""
        if self._scanning is not None and len(body) > self._scanned:
            pieces += self._scanning.feed(body[self._scanned :])
            self._scanned = len(body)

    def _calls_of(self, opened: str, body: str) -> list[Piece]:
        calls = self.parse(opened, body)
        if not calls:
            raise MalformedCall("a call region without a call", opened + body)
        self._calls += len(calls)
        scanning, self._scanning = self._scanning, None
        ending: list[Piece] = [] if scanning is None else list(scanning.end())
        return [*ending, *with_written(calls, scanning, opened + body)]

    def _content(self, text: str, pieces: list[Piece]) -> None:
        if self._calls and not text.strip():
            return  # the separator between calls
        if text:
            self._seen_text = self._seen_text or bool(text.strip())
            pieces.append(text)
