"""A call's arguments as the model writes them: the JSON call syntaxes read character by
character, so that a streamed answer sends each call's name as soon as it is known and its
arguments piece by piece, before the call is whole (and validated).

:class:`ArgumentsScanner` is fed a call region's text in pieces; it yields
:class:`CallStart` (a call's name, its arguments about to come) and
:class:`ArgumentsPiece` (the next characters of the arguments' JSON text, exactly as
written). Where the name follows the arguments in the object, the arguments are held until
the name is read. What it streams is only ever a preview: the call is still read whole
when its region ends (:class:`~modelpool.shared.tool_formats.base.RawCall`), and
``written`` there is the arguments' text the pieces add up to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass(frozen=True)
class CallStart:
    """A call's name is read: its arguments follow as :class:`ArgumentsPiece` s."""

    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """The next characters of the open call's arguments (JSON text as written)."""

    text: str


Streamed = CallStart | ArgumentsPiece


class CallScanner(Protocol):
    """A call region's scanner: fed the region's text in pieces, it streams each call's
    start and its arguments' JSON text; ``written``: each finished call's arguments as
    streamed (None: a call not streamed)."""

    written: list[str | None]

    def feed(self, text: str) -> list[Streamed]:
        """The calls' starts and argument pieces that ``text`` (the next piece) makes."""
        ...

    def end(self) -> list[Streamed]:
        """The region ended (its closing marker, or the output's end)."""
        ...


Layout = Literal["named", "bare"]
"""``named``: JSON objects ``{"name": ..., "arguments": {...}}`` (alone, in a list, or
one after another); ``bare``: the text is the arguments object itself (the name is known
from elsewhere: Harmony's header)."""


@dataclass
class ArgumentsScanner:
    """One call region's JSON, read as it streams. ``first``: the characters a region of
    this syntax may start with (after whitespace): any other start is not scanned (it is
    read whole at the end, as before). ``keys``: the arguments' keys in a named call."""

    layout: Layout
    first: str = "{"
    keys: tuple[str, ...] = ("arguments", "parameters")
    name: str = ""  # the call's name, for ``bare``
    # Each finished call's arguments as streamed (None: a call not streamed, its arguments
    # not an object: a string holding one, say).
    written: list[str | None] = field(default_factory=list)
    _started: bool = False
    _off: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    # Within a named call's object (the call's depth), the key being read and its value.
    _call_depth: int = 0
    _key: str | None = None
    _token: list[str] = field(default_factory=list)
    _expect: Literal["key", "colon", "value", "next"] = "key"
    _current_key: str = ""
    _call_name: str | None = None
    _arguments: list[str] = field(default_factory=list)
    _in_arguments: bool = False
    _opened: bool = False  # CallStart sent for the current call
    _sent: int = 0  # characters of _arguments sent

    def feed(self, text: str) -> list[Streamed]:
        out: list[Streamed] = []
        for char in text:
            if self._off:
                break
            if not self._started:
                if char.isspace():
                    continue
                self._started = True
                if char not in self.first:
                    self._off = True
                    break
            self._char(char, out)
        self._flush(out)
        return out

    def end(self) -> list[Streamed]:
        return []  # a JSON call ends at its own closing brace

    def _char(self, char: str, out: list[Streamed]) -> None:
        if self.layout == "bare":
            self._bare(char, out)
            return
        if self._in_arguments:
            self._arguments.append(char)
            self._track(char)
            if self._depth == self._call_depth:
                self._in_arguments = False
                self._expect = "next"
            return
        self._track_named(char, out)

    def _bare(self, char: str, out: list[Streamed]) -> None:
        if self._depth == 0 and not self._arguments:
            if char != "{":
                return
            self._call_name = self.name
        elif self._depth == 0:
            return  # after the object: whitespace before the call's end
        self._arguments.append(char)
        self._track(char)
        if self._depth == 0:
            self._flush(out)
            self._finish_call()

    def _track(self, char: str) -> None:
        """Depth and strings of the JSON text."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _track_named(self, char: str, out: list[Streamed]) -> None:
        at_call = bool(self._call_depth) and self._depth == self._call_depth
        if at_call and not self._in_string:
            if self._expect == "value" and char == "{" and self._current_key in self.keys:
                self._in_arguments = True
                self._arguments.append(char)
                self._track(char)
                return
            if self._expect == "value" and not char.isspace():
                self._expect = "next"
        was_string = self._in_string
        self._track(char)
        if not self._call_depth:
            if char == "{":
                self._call_depth = self._depth
                self._expect = "key"
            return
        if self._depth < self._call_depth:
            self._flush(out)
            self._finish_call()
            return
        if not at_call:
            return
        if was_string and self._in_string:
            self._token.append(char)
        elif was_string:  # a string ended at the call's depth: a key or a value
            token, self._token = "".join(self._token), []
            if self._expect == "key":
                self._current_key, self._expect = token, "colon"
            elif self._current_key == "name" and self._call_name is None:
                self._call_name = token
        elif char == ":" and self._expect == "colon":
            self._expect = "value"
        elif char == ",":
            self._expect = "key"

    def _flush(self, out: list[Streamed]) -> None:
        if self._call_name is None or not self._arguments:
            return
        if not self._opened:
            out.append(CallStart(self._call_name))
            self._opened = True
        if self._sent < len(self._arguments):
            out.append(ArgumentsPiece("".join(self._arguments[self._sent :])))
            self._sent = len(self._arguments)

    def _finish_call(self) -> None:
        self.written.append("".join(self._arguments) if self._opened else None)
        self._call_depth = 0
        self._call_name = None
        self._arguments = []
        self._opened = False
        self._sent = 0
        self._current_key = ""
        self._expect = "key"
