"""Tool calling: OpenAI's ``tools``/``tool_choice`` in, the model's calls out.

A call is written in the syntax of the model's family (:mod:`modelpool.shared.tool_formats`:
``hermes``, ``llama3_json``, ``mistral``, ``qwen3_coder``, ``gpt_oss``; the plan's
``parser``, Hermes unless bound to the model's with :meth:`ToolPlan.for_model`, as the
daemon does)::

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
  are written in the Hermes form when the template cannot render them.
- :class:`CallReader` (supervisor side) reads the generated text, streamed or
  whole, into content and :class:`ToolCall` s with the plan's syntax; text that opens
  a call but does not parse, names no offered tool or does not validate against its
  tool's ``parameters`` (``jsonschema``) raises :class:`~modelpool.shared.errors.
  MalformedToolCall` naming the model: a call is never dropped nor passed as content.

Every mode but ``none`` is constrained: ``auto`` lets the model write free text
(which cannot open a call) or open a call, and an opened call is held to the grammar;
``required`` and a named function must start with a call. With ``none`` the text is
not read for calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import (
    GrammarError,
    InvalidRequest,
    MalformedToolCall,
    SchemaTooComplex,
)
from modelpool.shared.structured import json_schema_grammar_fragment
from modelpool.shared.tool_formats import (
    DEFAULT_PARSER,
    ArgumentsPiece,
    CallStart,
    GrammarTool,
    MalformedCall,
    Mode,
    Piece,
    RawCall,
    marker_tokens,
    resolve_tool_parser,
    tool_format,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"
# OpenAI's limits on a request's tools and their names.
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

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
    parser: str = DEFAULT_PARSER  # the call syntax (a resolved ``tool_parser``)
    model: str = ""  # whose calls these are, for the error of one that does not parse
    # The syntax's markers that are special tokens of the model, and their ids.
    marker_tokens: tuple[tuple[str, int], ...] = ()

    def bound(
        self, parser: str, model: str, marker_tokens: tuple[tuple[str, int], ...]
    ) -> ToolPlan:
        """This plan in ``model``'s call syntax."""
        return dataclasses.replace(self, parser=parser, model=model, marker_tokens=marker_tokens)

    def for_model(self, config: PoolConfig, name: str | None = None) -> ToolPlan:
        """This plan in the call syntax of the model ``config`` serves (its ``tool_parser``;
        for ``auto``, detected from its chat template), named ``name`` in errors."""
        parser = resolve_tool_parser(config.tool_parser, config.model)
        return self.bound(parser, name or config.model, marker_tokens(config.model))

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
        offered = [
            GrammarTool(tool.name, tool.parameters, tool.fragment)
            for tool in self.tools
            if self.choice != "named" or tool.name == self.named
        ]
        mode: Mode = "auto" if self.choice == "auto" else "required"
        parallel = self.parallel and self.choice != "named"
        tokens = dict(self.marker_tokens)
        return tool_format(self.parser).grammar(offered, mode, parallel, tokens)


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


def chat_message(
    message: Mapping[str, Any], where: str, content: str | list[dict[str, Any]]
) -> dict[str, Any] | None:
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
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, with ``tools`` offered to the model;
    ``template_kwargs`` are the request's own template variables (``enable_thinking``)."""
    features = template_features(tokenizer)
    rendered = template_messages(messages, features)
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools and features.tools:
        kwargs["tools"] = tools
    elif tools:
        preamble = generic_preamble(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{preamble}"
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    text: str = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    return text


def generic_preamble(tools: Sequence[Mapping[str, Any]]) -> str:
    """:data:`GENERIC_PREAMBLE` offering ``tools`` (OpenAI's shape), for a template that
    does not render them."""
    return GENERIC_PREAMBLE.format(tools="\n".join(json.dumps(tool["function"]) for tool in tools))


def template_messages(
    messages: Sequence[Mapping[str, Any]], features: TemplateFeatures
) -> list[dict[str, Any]]:
    """The conversation as a template with ``features`` renders it: tool calls and results
    it cannot render written as text in the assistant's and the user's turns (a result's
    image parts kept as parts), the rest as they are."""
    return [_for_template(dict(message), features) for message in messages]


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
        content = message["content"]
        if isinstance(content, list):
            # A result holding images (Claude Code's Read of a picture) keeps them as parts,
            # in the turn that carries the result, for a vision model's template to place.
            opened = {"type": "text", "text": f"{RESULT_OPEN}\n"}
            closed = {"type": "text", "text": f"\n{RESULT_CLOSE}"}
            return {"role": "user", "content": [opened, *content, closed]}
        return {"role": "user", "content": f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"}
    return message


# --------------------------------------------------------------------------------------------
# Reading the output (supervisor side)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the model's JSON text of the arguments
    # Its CallOpened and ArgumentsDelta events went out before it (the writer only ends it).
    streamed: bool = False
    index: int = 0  # its place among the answer's calls, in the order they were announced

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallOpened:
    """A call whose name is read, as it streams: its arguments follow as
    :class:`ArgumentsDelta` s, then the whole :class:`ToolCall` (validated) ends it."""

    index: int  # its place among the answer's calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next piece of the open call's arguments, as the model wrote it."""

    index: int
    id: str
    text: str


Event = str | ToolCall | CallOpened | ArgumentsDelta
"""What :class:`CallReader` yields: content text, a whole call that validated, and (with
``stream_arguments``) a call's start and its arguments piece by piece before it."""


@dataclass
class CallReader:
    """The generated text, fed as it streams (or whole), read into content and calls.

    Content is passed on at once except what could be the start of a call in the plan's
    syntax; a call is held until it ends, then validated against its tool's
    ``parameters``. Text that opens a call and is not one (malformed, an unknown tool,
    arguments that do not validate, an output that ends inside it) raises
    :class:`MalformedToolCall`. With ``tool_choice: none`` the text is all content.

    ``stream_arguments``: a call is also yielded as it is written (qwen3_coder's as
    the JSON its parameters make): :class:`CallOpened` once its name is
    read (an unknown tool is an error at once), :class:`ArgumentsDelta` s, then the
    :class:`ToolCall` whose ``arguments`` the deltas add up to. Arguments that turn out
    not to validate are the same error as before, after their pieces went out.
    """

    plan: ToolPlan
    stream_arguments: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    # Calls opened and not yet whole, in order (a region read at its end, as Mistral's
    # list, streams several before the first is read).
    _open: list[CallOpened] = field(default_factory=list)
    _announced: int = 0  # calls opened or read whole so far: the next call's index

    def __post_init__(self) -> None:
        schemas = {tool.name: tool.parameters for tool in self.plan.tools}
        self._reader = tool_format(self.plan.parser).reader(schemas)

    def feed(self, text: str) -> list[Event]:
        if self.plan.choice == "none":
            return [text] if text else []
        return self._events(self._reader.feed, text)

    def finish(self) -> list[Event]:
        """The text held back at the end (an unfinished call is an error)."""
        if self.plan.choice == "none":
            return []
        return self._events(lambda _: self._reader.finish(), "")

    def _events(self, read: Callable[[str], list[Piece]], text: str) -> list[Event]:
        try:
            pieces = read(text)
        except MalformedCall as exc:
            raise self._malformed(exc.reason, exc.text) from None
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, str):
                events.append(piece)
            elif isinstance(piece, CallStart):
                self._tool(piece.name)
                opened = CallOpened(self._announced, _call_id(), piece.name)
                self._open.append(opened)
                self._announced += 1
                if self.stream_arguments:
                    events.append(opened)
            elif isinstance(piece, ArgumentsPiece):
                if self.stream_arguments and self._open:
                    last = self._open[-1]  # the pieces are the latest call's
                    events.append(ArgumentsDelta(last.index, last.id, piece.text))
            else:
                events.append(self._call(piece))
        return events

    def _tool(self, name: str) -> Tool:
        tool = self.plan.by_name().get(name)
        if tool is None:
            raise self._malformed(f"a call of {name!r}, which is not among the tools", "")
        if self.plan.choice == "named" and name != self.plan.named:
            raise self._malformed(f"a call of {name!r}, not of {self.plan.named!r}", "")
        return tool

    def _call(self, raw: RawCall) -> ToolCall:
        tool = self._tool(raw.name)
        error = _invalid(raw.arguments, tool.parameters)
        if error is not None:
            raise self._malformed(f"arguments of {raw.name!r} that do not validate: {error}", "")
        # The arguments as written when they were streamed (the deltas add up to them).
        if raw.written is not None and self._open:
            opened = self._open.pop(0)
            call = ToolCall(opened.id, tool.name, raw.written, self.stream_arguments, opened.index)
        else:
            arguments = json.dumps(raw.arguments, ensure_ascii=False)
            call = ToolCall(_call_id(), tool.name, arguments, index=self._announced)
            self._announced += 1
        self.calls.append(call)
        return call

    def _malformed(self, reason: str, text: str) -> MalformedToolCall:
        model = self.plan.model or "the model"
        written = f" ({text[:120]!r})" if text else ""
        return MalformedToolCall(
            f"{model} wrote a tool call in its {self.plan.parser} syntax that cannot be "
            f"read: {reason}{written}",
            model=self.plan.model,
            parser=self.plan.parser,
        )


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _invalid(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    from jsonschema import Draft202012Validator

    error = next(iter(Draft202012Validator(schema).iter_errors(arguments)), None)
    return None if error is None else error.message[:200]


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
    with empty arguments first, then the arguments (a call read whole: both at once)."""
    return [
        opened_delta(plan, CallOpened(index, call.id, call.name)),
        arguments_delta(plan, index, call.arguments),
    ]


def opened_delta(plan: ToolPlan, opened: CallOpened) -> dict[str, Any]:
    """A streamed call's first ``delta``: its id, type and name, its arguments empty."""
    if plan.legacy:
        return {"function_call": {"name": opened.name, "arguments": ""}}
    function = {"name": opened.name, "arguments": ""}
    call = {"index": opened.index, "id": opened.id, "type": "function", "function": function}
    return {"tool_calls": [call]}


def arguments_delta(plan: ToolPlan, index: int, text: str) -> dict[str, Any]:
    """The ``delta`` of a piece of a call's arguments."""
    if plan.legacy:
        return {"function_call": {"arguments": text}}
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
