"""Tool calling: OpenAI's ``tools``/``tool_choice`` in, the model's calls out.

The one place that knows the format the model writes a call in (Hermes/Qwen style)::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

- :func:`parse_tool_request` reads ``tools``, ``tool_choice``, ``parallel_tool_calls``
  (and the legacy ``functions``/``function_call``) into a :class:`ToolPlan`;
  :meth:`ToolPlan.grammar` is the llguidance grammar that constrains the output
  (params["grammar"]), and :meth:`ToolPlan.template_tools` what the worker renders.
- :func:`chat_message` reads one OpenAI message of a conversation that carries
  assistant ``tool_calls`` and ``tool`` results into the pool's message form.
- :func:`render_chat` (worker side) renders messages and tools with the model's chat
  template: its own ``tools=`` rendering when the template uses it, otherwise
  :data:`GENERIC_PREAMBLE` in the system message; calls and results in the history
  are written in the call format above when the template cannot render them.
- :class:`CallReader` (supervisor side) reads the generated text, streamed or
  whole, into content and :class:`ToolCall` s; a call that does not parse or does
  not validate against its tool's ``parameters`` (``jsonschema``) is never passed
  on as a call: it stays text.

Every mode but ``none`` is constrained: ``auto`` lets the model write free text
(which cannot contain ``<tool_call>``) or open a call, and an opened call is held
to the grammar; ``required`` and a named function must start with a call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from modelpool.shared.errors import GrammarError, InvalidRequest, SchemaTooComplex
from modelpool.shared.structured import json_schema_grammar_fragment

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"
# OpenAI's limits on a request's tools and their names.
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:')

GENERIC_PREAMBLE = """You can call functions. These are the functions available, as JSON:
{tools}
To call a function, write exactly
<tool_call>{{"name": "FUNCTION_NAME", "arguments": {{ARGUMENTS AS JSON}}}}</tool_call>
and nothing after it; the result comes back in the next message. To answer without \
calling a function, write the answer as plain text."""
"""Put into the system message when the chat template does not render ``tools``."""

Choice = Literal["none", "auto", "required", "named"]


class ToolRequestError(InvalidRequest):
    """A ``tools``/``tool_choice``/message field that cannot be honoured; ``param`` names
    the OpenAI field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fragment: str  # the parameters as an llguidance grammar expression (checked)


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request asks of tool calling."""

    tools: tuple[Tool, ...]
    choice: Choice
    named: str | None = None
    parallel: bool = True
    legacy: bool = False  # ``functions``/``function_call``: answered as ``function_call``

    def by_name(self) -> dict[str, Tool]:
        return {tool.name: tool for tool in self.tools}

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                },
            }
            for tool in self.tools
        ]

    def pool_params(self) -> dict[str, Any]:
        """The pool's keyword arguments for this plan: the tools to render and the
        grammar (none for ``none``: then the tools are not offered either)::

            plan = parse_tool_request({"tools": [...], "tool_choice": "required"})
            result = pool.generate(messages, **plan.pool_params())
            content, calls = read_answer(plan, result.text)
        """
        if self.choice == "none":
            return {}
        return {"tools": self.template_tools(), "grammar": self.grammar()}

    def grammar(self) -> str | None:
        """The llguidance grammar (Lark syntax) of this request's output; None for
        ``none`` (unconstrained, and the answer is text)."""
        if self.choice == "none":
            return None
        offered = [t for t in self.tools if self.choice != "named" or t.name == self.named]
        lines = ["%llguidance {}"]
        more = ' ("\\n" "<tool_call>" call)*' if self.parallel and self.choice != "named" else ""
        if self.choice == "auto":
            # Free text that never holds the call marker, or text up to the marker (a
            # lazy lexeme: it ends at the first marker) and then constrained calls.
            lines += [
                f"start: plain | opened call{more}",
                "plain: PLAIN",
                "PLAIN: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/",
                'opened[lazy]: TEXT "<tool_call>"',
                "TEXT: /(.|\\n)*/",
            ]
        else:
            lines.append(f'start: "<tool_call>" call{more}')
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(offered))))
        for index, tool in enumerate(offered):
            head = json.dumps(f'{{"name": "{tool.name}", "arguments": ')
            lines.append(f'call_{index}: {head} {tool.fragment} "}}{CALL_CLOSE}"')
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Requests


def parse_tool_request(body: Mapping[str, Any]) -> ToolPlan | None:
    """``tools``/``tool_choice``/``parallel_tool_calls`` (or the legacy ``functions``/
    ``function_call``) as a plan; None when the request offers no tools."""
    legacy = body.get("functions") is not None
    if legacy and body.get("tools") is not None:
        raise ToolRequestError("send tools or functions, not both", "functions")
    tools_name, choice_name = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    offered = body.get(tools_name)
    choice_value = body.get(choice_name)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if offered is None or offered == []:
        if choice_value not in (None, "none"):
            raise ToolRequestError(f"{choice_name} needs {tools_name}", choice_name)
        return None
    if not isinstance(offered, list) or len(offered) > MAX_TOOLS:
        raise ToolRequestError(f"{tools_name} must be a list of at most {MAX_TOOLS}", tools_name)
    tools = tuple(_tool(item, f"{tools_name}[{i}]", legacy) for i, item in enumerate(offered))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError(f"{tools_name}: function names must be unique", tools_name)
    choice, named = _choice(choice_value, choice_name, names, legacy)
    return ToolPlan(tools, choice, named, parallel is not False and not legacy, legacy)


def _tool(item: object, where: str, legacy: bool) -> Tool:
    function = item
    if not legacy:
        if not isinstance(item, dict) or item.get("type") != "function":
            raise ToolRequestError(f"{where} must be {{'type': 'function', ...}}", where)
        function = item.get("function")
        where += ".function"
    if not isinstance(function, dict):
        raise ToolRequestError(f"{where} must be an object", where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolRequestError(
            f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            f"{where}.name",
        )
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ToolRequestError(f"{where}.description must be a string", f"{where}.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolRequestError(f"{where}.parameters must be a JSON schema", f"{where}.parameters")
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        raise ToolRequestError(
            f"{where}.parameters is not a valid JSON schema: {exc.message}", f"{where}.parameters"
        ) from None
    try:
        fragment = json_schema_grammar_fragment(parameters, param=f"{where}.parameters")
    except SchemaTooComplex:
        raise  # its own answer (400 schema_too_complex, naming the bound)
    except GrammarError as exc:
        # A keyword the grammar engine cannot honour: refused, naming it and its path.
        raise ToolRequestError(exc.message, exc.param or f"{where}.parameters") from None
    return Tool(name, description, parameters, fragment)


def _choice(value: object, where: str, names: list[str], legacy: bool) -> tuple[Choice, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto") or (value == "required" and not legacy):
        return value, None
    function = value.get("function") if isinstance(value, dict) and not legacy else value
    name = function.get("name") if isinstance(function, dict) else None
    if not legacy and isinstance(value, dict) and value.get("type") != "function":
        name = None
    if not isinstance(name, str):
        shape = '{"name": ...}' if legacy else '{"type": "function", "function": {"name": ...}}'
        modes = "none, auto" if legacy else "none, auto, required"
        raise ToolRequestError(f"{where} must be one of {modes} or {shape}", where)
    if name not in names:
        raise ToolRequestError(f"{where} names {name!r}, which is not among the tools", where)
    return "named", name


def chat_message(message: Mapping[str, Any], where: str, content: str) -> dict[str, Any] | None:
    """An OpenAI message that belongs to tool calling, in the pool's message form, or None
    for a plain one. Assistant ``tool_calls`` (or a legacy ``function_call``) keep
    ``arguments`` as a JSON object (what chat templates expect); a ``tool`` (or legacy
    ``function``) result keeps its ``tool_call_id``/``name``."""
    role = message.get("role")
    if role == "assistant" and ("tool_calls" in message or "function_call" in message):
        calls = message.get("tool_calls")
        if calls is None:
            calls = [{"id": "", "type": "function", "function": message.get("function_call")}]
            where_calls = f"{where}.function_call"
        else:
            where_calls = f"{where}.tool_calls"
        if not isinstance(calls, list):
            raise ToolRequestError(f"{where_calls} must be a list", where_calls)
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [_history_call(c, f"{where_calls}[{i}]") for i, c in enumerate(calls)],
        }
    if role in ("tool", "function"):
        key = "tool_call_id" if role == "tool" else "name"
        if not isinstance(message.get(key), str):
            raise ToolRequestError(f"{where}.{key} must be a string", f"{where}.{key}")
        result = {"role": "tool", "content": content}
        for name in ("tool_call_id", "name"):
            if isinstance(message.get(name), str):
                result[name] = message[name]
        return result
    return None


def _history_call(call: object, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError(f"{where}.function must have a name", where)
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ToolRequestError(
            f"{where}.function.arguments must be a JSON object (as a string)",
            f"{where}.function.arguments",
        )
    call_id = call.get("id", "") if isinstance(call, dict) else ""
    return {
        "id": call_id if isinstance(call_id, str) else "",
        "type": "function",
        "function": {"name": function["name"], "arguments": parsed},
    }


def fill_result_names(messages: list[dict[str, Any]]) -> None:
    """Give each ``tool`` result the name of the call it answers (templates print it)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls", ()):
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id", ""))
            if name is not None:
                message["name"] = name


# --------------------------------------------------------------------------------------------
# Rendering (worker side)


@dataclass(frozen=True)
class TemplateFeatures:
    """What a chat template renders of tool calling (found by rendering probes)."""

    tools: bool
    calls: bool
    results: bool


_PROBE = "modelpool_probe_7f3a"
# By template text: a worker serves one model, so this holds one or two entries.
_FEATURES: dict[str, TemplateFeatures] = {}


def template_features(tokenizer: Any) -> TemplateFeatures:
    """Render probe conversations once per template and look for the probe's name."""
    template = str(tokenizer.chat_template)
    features = _FEATURES.get(template)
    if features is not None:
        return features

    def renders(messages: list[dict[str, Any]], **kwargs: Any) -> str:
        try:
            text: str = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception:  # a template that raises on what it does not know
            return ""
        return text

    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": _PROBE, "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
    asked = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "c1", "name": _PROBE, "content": _PROBE + "_r"}
    features = TemplateFeatures(
        tools=_PROBE in renders([user], tools=[tool]),
        calls=_PROBE in renders([user, asked]),
        results=_PROBE + "_r" in renders([user, asked, result]),
    )
    _FEATURES[template] = features
    return features


def check_template_tools(tools: object) -> None:
    """The pool's ``tools`` keyword is OpenAI's list of function tools (what
    :meth:`ToolPlan.template_tools` gives); refused before dispatch otherwise."""
    valid = isinstance(tools, list) and all(
        isinstance(tool, dict)
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
        for tool in tools
    )
    if not valid:
        raise InvalidRequest(
            "tools must be a list of {'type': 'function', 'function': {'name': ..., "
            "'parameters': ...}} (see modelpool.shared.tools.ToolPlan.pool_params)"
        )


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a conversation, with ``tools`` offered to the model."""
    features = template_features(tokenizer)
    rendered = [_for_template(dict(message), features) for message in messages]
    kwargs: dict[str, Any] = {}
    if tools and features.tools:
        kwargs["tools"] = tools
    elif tools:
        preamble = GENERIC_PREAMBLE.format(
            tools="\n".join(json.dumps(tool["function"]) for tool in tools)
        )
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{preamble}"
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    text: str = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    return text


def _for_template(message: dict[str, Any], features: TemplateFeatures) -> dict[str, Any]:
    if "tool_calls" in message and not features.calls:
        written = "\n".join(
            CALL_OPEN
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + CALL_CLOSE
            for c in message["tool_calls"]
        )
        content = message.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{written}" if content else written}
    if message["role"] == "tool" and not features.results:
        return {"role": "user", "content": f"{RESULT_OPEN}\n{message['content']}\n{RESULT_CLOSE}"}
    return message


# --------------------------------------------------------------------------------------------
# Reading the output (supervisor side)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the model's JSON text of the arguments

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Event = str | ToolCall
"""What :class:`CallReader` yields: content text, or a whole call that validated."""


@dataclass
class CallReader:
    """The generated text, fed as it streams (or whole), read into content and calls.

    Content is passed on at once except what could be the start of ``<tool_call>``;
    a call is held until its ``</tool_call>``, then parsed and validated against its
    tool's ``parameters``. One that does not (or that the text ends inside) is given
    back as the text it was, marker included: never as a call.
    """

    plan: ToolPlan
    _buffer: str = ""
    _in_call: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return events
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(CALL_CLOSE) :]
                self._in_call = False
                call = self._parse(body)
                events.append(call if call is not None else CALL_OPEN + body + CALL_CLOSE)
                continue
            start = self._buffer.find(CALL_OPEN)
            if start >= 0:
                before = self._buffer[:start]
                if not self.calls or before.strip():  # the separator between calls is not content
                    self._content(before, events)
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_marker(self._buffer)
            if self.calls and not self._buffer[: len(self._buffer) - keep].strip():
                return events  # whitespace between calls waits to see what follows
            self._content(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return events

    def finish(self) -> list[Event]:
        """The text held back at the end: an unfinished call is given back as text."""
        rest = (CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        if self.calls and not rest.strip():
            return []
        return [rest] if rest else []

    def _content(self, text: str, events: list[Event]) -> None:
        if text:
            events.append(text)

    def _parse(self, body: str) -> ToolCall | None:
        if self.plan.choice == "none":
            return None
        head = _CALL_HEAD.match(body)
        tool = self.plan.by_name().get(head.group(1)) if head else None
        if head is None or tool is None:
            return None
        rest = body[head.end() :].rstrip()
        if not rest.endswith("}"):
            return None
        arguments = rest[:-1].strip()
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(parsed, dict) or not _valid(parsed, tool.parameters):
            return None
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", tool.name, arguments)
        self.calls.append(call)
        return call


def _valid(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    from jsonschema import Draft202012Validator

    return bool(Draft202012Validator(schema).is_valid(arguments))


def _partial_marker(text: str) -> int:
    """Length of the longest end of ``text`` that is a start of ``<tool_call>``."""
    for length in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:length]):
            return length
    return 0


def read_answer(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when it is only calls) and its calls."""
    reader = CallReader(plan)
    events = reader.feed(text) + reader.finish()
    content = "".join(event for event in events if isinstance(event, str))
    calls = [event for event in events if isinstance(event, ToolCall)]
    if calls and not content.strip():
        return None, calls
    return content, calls


def answer_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The chat ``message`` of an answer, and its ``finish_reason`` ("tool_calls" when it
    holds calls; ``function_call`` for the legacy form)."""
    content, calls = read_answer(plan, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return message, finish_reason
    if plan.legacy:
        message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        return message, "function_call"
    message["tool_calls"] = [call.openai() for call in calls]
    return message, "tool_calls"


def call_deltas(plan: ToolPlan, call: ToolCall, index: int) -> list[dict[str, Any]]:
    """The ``delta`` objects that stream one call as OpenAI streams it: id, type and name
    with empty arguments first, then the arguments."""
    if plan.legacy:
        return [
            {"function_call": {"name": call.name, "arguments": ""}},
            {"function_call": {"arguments": call.arguments}},
        ]
    return [
        {
            "tool_calls": [
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]
