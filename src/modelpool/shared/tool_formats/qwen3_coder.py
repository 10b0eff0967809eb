"""Qwen3-Coder (and Qwen3.5/Next's XML style): one element per argument, its value as
text (a string) or JSON (any other type), inside ``<tool_call>``::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A ``<function=...>`` without the ``<tool_call>`` around it is read too. Streamed, a
call's arguments go out as the JSON object its parameters make (:class:`ParameterScanner`):
``{`` once the name is read, ``"KEY": `` as a parameter opens, a string's text as it
comes and any other value's JSON as it closes, ``}`` at the call's end; the pieces add
up to the call's ``arguments``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from modelpool.shared.structured import json_schema_grammar_fragment
from modelpool.shared.tool_formats.base import (
    GrammarTool,
    MalformedCall,
    Mode,
    RawCall,
    RegionReader,
    SyntaxReader,
    calls_rule,
    grammar_text,
    lark_string,
    mark,
    marked_calls,
    partial_suffix,
)
from modelpool.shared.tool_formats.streaming import ArgumentsPiece, CallStart, Streamed

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_CLOSE = "</function>"
_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.S)
_END = lark_string("\n</parameter>\n")
_PLAIN_STRING = frozenset({"type", "description", "title"})
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
PARAMETER = "<parameter="
PARAMETER_CLOSE = "</parameter>"


@dataclass(frozen=True)
class Qwen3Coder:
    name: str = "qwen3_coder"

    def grammar(
        self, tools: Sequence[GrammarTool], mode: Mode, parallel: bool, tokens: Mapping[str, int]
    ) -> str:
        more = f' ("\\n" {mark(OPEN, tokens)} call)*' if parallel else ""
        lines = marked_calls(OPEN, f"call{more}", mode, tokens)
        values: list[str] = []
        lines += calls_rule(tools, lambda tool: _call(tool, values, tokens))
        lines += values
        # A text value ends at the first "</parameter>" (a lazy lexeme).
        lines += ['text_param[lazy]: ANY_TEXT "\\n</parameter>\\n"', "ANY_TEXT: /(.|\\n)*/"]
        return grammar_text(lines)

    def reader(self, parameters: Mapping[str, dict[str, Any]]) -> SyntaxReader:
        def parse(opened: str, body: str) -> list[RawCall]:
            text = body if opened == OPEN else FUNCTION + body + FUNCTION_CLOSE
            return _parse(text, parameters, opened + body)

        return RegionReader(
            {OPEN: CLOSE, FUNCTION: FUNCTION_CLOSE},
            parse,
            scanner=lambda: ParameterScanner(parameters),
        )


def _call(tool: GrammarTool, values: list[str], tokens: Mapping[str, int]) -> str:
    """A tool's ``<function=...>`` element: its required parameters in order, each optional
    one optional; a string's value is text without ``</parameter>``, any other its JSON."""
    properties = tool.parameters.get("properties")
    required = tool.parameters.get("required", [])
    parts = [lark_string(f"\n<function={tool.name}>\n")]
    if isinstance(properties, dict):
        for key, schema in properties.items():
            rule = f"value_{len(values)}"
            values.append(f"{rule}: {_value_rule(schema, f'{tool.name}.{key}')}")
            element = f'{lark_string(f"<parameter={key}>")} "\\n" {rule}'
            parts.append(element if key in required else f"({element})?")
    parts.append(f"{lark_string(FUNCTION_CLOSE + chr(10))} {mark(CLOSE, tokens)}")
    return " ".join(parts)


def _value_rule(schema: object, where: str) -> str:
    """A plain string is its text; a string of a few values one of them, as text; any
    other value (and a string held to a pattern or a length) its JSON."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        if set(schema) <= _PLAIN_STRING:
            return "text_param"
        choices = schema.get("enum")
        if (
            set(schema) <= {*_PLAIN_STRING, "enum"}
            and isinstance(choices, list)
            and all(isinstance(choice, str) and choice for choice in choices)
        ):
            return "(" + " | ".join(lark_string(c) for c in choices) + f") {_END}"
    return f"{json_schema_grammar_fragment(schema, param=where)} {_END}"


def _parse(text: str, parameters: Mapping[str, dict[str, Any]], raw: str) -> list[RawCall]:
    found = _FUNCTION.fullmatch(text)
    if found is None:
        raise MalformedCall("a call without <function=NAME>...</function>", raw)
    name, inner = found.group(1), found.group(2)
    properties = parameters.get(name, {}).get("properties", {})
    arguments: dict[str, Any] = {}
    for parameter in _PARAMETER.finditer(inner):
        key, value = parameter.group(1), parameter.group(2)
        schema = properties.get(key) if isinstance(properties, dict) else None
        arguments[key] = _value(value, schema, raw)
    if _PARAMETER.sub("", inner).strip():
        raise MalformedCall("text in a call outside its <parameter=...> elements", raw)
    return [RawCall(name, arguments)]


def _value(text: str, schema: object, raw: str) -> Any:
    """A parameter's text as its type: a string as written, anything else as JSON (a
    string-typed one given as a JSON string is read as that string)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        if text.startswith('"'):
            try:
                quoted = json.loads(text)
            except ValueError:
                return text
            return quoted if isinstance(quoted, str) else text
        return text
    try:
        return json.loads(text)
    except ValueError:
        if kind is None:
            return text
        raise MalformedCall(f"a {kind} parameter that is not JSON", raw) from None


@dataclass
class ParameterScanner:
    """One call region read as it streams (``<tool_call>``'s, its text from after the
    marker; or ``<function=``'s, from the name on): its arguments as the JSON text of the
    parameters read so far. A string parameter's text streams as written, escaped into
    a JSON string (a last newline, which the syntax drops, held until the next
    character); any other value goes out whole as it closes. A region this cannot
    follow is left to be read whole at its end."""

    parameters: Mapping[str, dict[str, Any]]
    written: list[str | None] = field(default_factory=list)
    _buffer: str = ""
    _state: Literal["name", "body", "value", "done"] = "name"
    _name: str = ""
    _key: str = ""
    _text: bool | None = None  # the open value streams as text (None: not yet known)
    _arguments: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[Streamed]:
        out: list[Streamed] = []
        if self._state != "done":
            self._buffer += text
            while self._step(out):
                pass
        return out

    def end(self) -> list[Streamed]:
        """``<function=``'s region ends at ``</function>``, which it does not hold."""
        out: list[Streamed] = []
        if self._state == "body":
            self._close(out)
        return out

    def _step(self, out: list[Streamed]) -> bool:
        if self._state == "name":
            end = self._buffer.find(">")
            if end < 0:
                return False
            name = self._buffer[:end].rpartition(FUNCTION)[2].strip()
            if not name or any(char.isspace() or char in "<>" for char in name):
                self._stop()
                return False
            self._name, self._buffer, self._state = name, self._buffer[end + 1 :], "body"
            out.append(CallStart(name))
            self._emit("{", out)
            return True
        if self._state == "body":
            found = [(self._buffer.find(m), m) for m in (PARAMETER, FUNCTION_CLOSE)]
            present = [(index, marker) for index, marker in found if index >= 0]
            if not present:
                keep = partial_suffix(self._buffer, (PARAMETER, FUNCTION_CLOSE))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            index, marker = min(present)
            if marker == FUNCTION_CLOSE:
                self._close(out)
                return False
            end = self._buffer.find(">", index)
            if end < 0:
                return False
            self._key = self._buffer[index + len(PARAMETER) : end]
            self._buffer, self._state = self._buffer[end + 1 :], "value"
            separator = ", " if len(self._arguments) > 1 else ""
            self._emit(f"{separator}{json.dumps(self._key, ensure_ascii=False)}: ", out)
            return True
        return self._value_step(out)

    def _value_step(self, out: list[Streamed]) -> bool:
        end = self._buffer.find(PARAMETER_CLOSE)
        if self._text is None and end < 0:
            # A plain string's text streams as written; anything else (a JSON value, a
            # string written as JSON) goes out whole at its close.
            if len(self._buffer) < 2:
                return False  # the value's first character, after the newline dropped
            body = self._buffer.removeprefix("\n")
            self._text = self._schema_type() == "string" and not body.startswith('"')
            if self._text:
                self._buffer = body
                self._emit('"', out)
        if self._text:
            if end < 0:
                keep = partial_suffix(self._buffer, (PARAMETER_CLOSE,))
                ready = self._buffer[: len(self._buffer) - keep].removesuffix("\n")
                self._buffer = self._buffer[len(ready) :]
                if ready:
                    self._emit(_escaped(ready), out)
                return False
            self._emit(_escaped(self._buffer[:end].removesuffix("\n")) + '"', out)
            self._next_parameter(end)
            return True
        if end < 0:
            return False
        text = self._buffer[:end].removeprefix("\n").removesuffix("\n")
        self._next_parameter(end)
        try:
            value = _value(text, {"type": self._schema_type()}, text)
        except MalformedCall:
            self._stop()  # read whole at the region's end: the error is raised there
            return False
        self._emit(json.dumps(value, ensure_ascii=False), out)
        return True

    def _schema_type(self) -> object:
        properties = self.parameters.get(self._name, {}).get("properties", {})
        schema = properties.get(self._key) if isinstance(properties, dict) else None
        return schema.get("type") if isinstance(schema, dict) else None

    def _next_parameter(self, end: int) -> None:
        self._buffer = self._buffer[end + len(PARAMETER_CLOSE) :]
        self._state, self._text = "body", None

    def _emit(self, text: str, out: list[Streamed]) -> None:
        self._arguments.append(text)
        out.append(ArgumentsPiece(text))

    def _close(self, out: list[Streamed]) -> None:
        self._emit("}", out)
        self.written.append("".join(self._arguments))
        self._state, self._buffer = "done", ""

    def _stop(self) -> None:
        self._state, self._buffer = "done", ""


def _escaped(text: str) -> str:
    """``text`` inside a JSON string (escaping is character by character, so that the
    pieces of a string add up to the whole one's JSON)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
