"""A Responses API body (``POST /v1/responses``) translated into a chat body.

The translation is the whole of this module: ``input`` items become chat messages,
``instructions`` the system message, function ``tools`` and ``tool_choice`` chat's,
``text.format`` chat's ``response_format``, ``max_output_tokens`` ``max_tokens``; the
chat body then goes through ``core.generation_body.parse_chat``, the same checks, templates,
tool grammar and structured outputs as ``/v1/chat/completions``. A refusal there is
renamed back to the field the client sent (``max_tokens`` → ``max_output_tokens``,
``messages[3]`` → ``input[2]``)::

    request = parse_responses(body, store, owner="alice")   # the tenant's name
    request.job          # the pool's Job
    request.messages     # the conversation (previous response's, then this input)

Tools the model cannot call (``web_search``, ``file_search``, Codex's ``custom`` and
``local_shell``...) are accepted and left out, logged by name: a client that offers them
is never refused for it. Fields that do not change what is generated (``reasoning``,
``include``, ``prompt_cache_key``...) are accepted, left out and logged the same way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpool.server.agent_tools import constrainable, renamed
from modelpool.server.core.fields import check_ignored_fields
from modelpool.server.core.generation_body import parse_chat
from modelpool.server.core.job import Job
from modelpool.server.http import ApiError, invalid
from modelpool.server.reasoning import apply_controls
from modelpool.server.responses.store import ResponseStore
from modelpool.shared.errors import ImageRefused
from modelpool.shared.image_input import image_from_url
from modelpool.shared.reasoning.controls import responses_controls

logger = logging.getLogger(__name__)

# The chat fields a refusal may name, by the Responses API's names.
_CHAT_FIELDS = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"))

# Fields translated onto the chat body, or read here.
RESPONSES_FIELDS = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "store",
        "previous_response_id",
        "cache_salt",  # vLLM's, passed to the chat body as it is
    }
)
# Accepted, and without effect on what is generated: echoed where the response object
# has them, logged as ignored.
IGNORED_RESPONSES_FIELDS = frozenset(
    {
        "model",
        "metadata",
        "user",
        "reasoning",
        "include",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "truncation",
        "max_tool_calls",
        "stream_options",
        "client_metadata",
    }
)
# What these ignored fields may be (their OpenAI shapes, and a bound on their size).
_IGNORED_OBJECTS = frozenset({"reasoning", "stream_options", "client_metadata"})
_MAX_INCLUDE = 16
# Kinds of input item that carry nothing the model reads again (our models reason in
# their text, if at all): left out of the conversation.
_DROPPED_ITEMS = frozenset({"reasoning"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass
class ResponsesRequest:
    """A parsed Responses request: the pool's job and what its answer echoes."""

    job: Job
    response_id: str
    created_at: int
    body: dict[str, Any]
    # The conversation as chat messages, without the instructions (which a later
    # response does not inherit, as on OpenAI).
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # the function tools, as the client sent them
    store: bool
    owner: str  # whose answer this is (the store's owner: the tenant's name)
    ignored: list[str] = field(default_factory=list)


def parse_responses(
    body: Mapping[str, Any], store: ResponseStore, *, owner: str
) -> ResponsesRequest:
    """The request; its ``previous_response_id`` is looked up among ``owner``'s."""
    for name in body:
        if name not in RESPONSES_FIELDS and name not in IGNORED_RESPONSES_FIELDS:
            raise invalid(f"unsupported field {name!r}", param=name, code="unsupported_field")
    _check_ignored(body)
    if "input" not in body:
        raise invalid("missing field 'input'", param="input", code="missing_field")
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise invalid("previous_response_id must be a string", "previous_response_id")
        entry = store.get(previous, owner=owner)
        if entry is None:
            raise ApiError(
                404,
                f"previous response {previous!r} not found: it was never stored (store: "
                "false), or was deleted, evicted or expired",
                type="invalid_request_error",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        history = [dict(message) for message in entry.messages]
    # Where each chat message came from, to name the client's field in a refusal.
    sources: list[str] = []
    chat_messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions must be a string", "instructions")
        chat_messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    for index, message in enumerate(history):
        chat_messages.append(message)
        sources.append(f"previous_response_id (message {index})")
    new_messages, new_sources = _input_messages(body["input"])
    chat_messages += new_messages
    sources += new_sources
    if not new_messages:
        raise invalid("input must hold at least one message or tool output", "input")
    tools, tool_sources, dropped = _tools(body.get("tools"))
    functions = [
        {
            "type": "function",
            "function": {
                key: tool[key] for key in ("name", "description", "parameters") if key in tool
            },
        }
        for tool in tools
    ]
    wheres = [f"tools[{index}].parameters" for index in tool_sources]
    kept, unconstrainable = constrainable(functions, wheres, "/v1/responses")
    tools = [tools[position] for position in kept]
    functions = [functions[position] for position in kept]
    tool_sources = [tool_sources[position] for position in kept]
    chat: dict[str, Any] = {"messages": chat_messages}
    if functions:
        chat["tools"] = functions
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice, bool(tools))
    for name, chat_name in (
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_tokens"),
        ("stream", "stream"),
        ("cache_salt", "cache_salt"),
    ):
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        job = parse_chat(chat)
    except ApiError as exc:
        raise renamed(exc, sources, tool_sources, _CHAT_FIELDS) from None
    apply_controls(job.params, responses_controls, body.get("reasoning"))
    stored = body.get("store")
    ignored = sorted((IGNORED_RESPONSES_FIELDS - {"reasoning"}) & body.keys())
    ignored += [f"tools[{index}] (type {kind!r})" for index, kind in dropped]
    ignored += [line.partition(" ")[0] + " (schema)" for line in unconstrainable]
    if ignored:
        logger.info("POST /v1/responses: accepted and ignored: %s", ", ".join(ignored))
    return ResponsesRequest(
        job=job,
        response_id=f"resp_{uuid.uuid4().hex}",
        created_at=int(time.time()),
        body=dict(body),
        messages=chat_messages[1:] if instructions is not None else chat_messages,
        tools=tools,
        store=stored is not False,
        owner=owner,
        ignored=ignored,
    )


def _check_ignored(body: Mapping[str, Any]) -> None:
    """The ignored fields still have their OpenAI shapes and bounded sizes."""
    check_ignored_fields(
        {
            name: body[name]
            for name in ("model", "metadata", "user", "prompt_cache_key", "safety_identifier")
            if name in body
        }
    )
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise invalid("store must be true or false", "store")
    for name in _IGNORED_OBJECTS & body.keys():
        if body[name] is not None and not isinstance(body[name], dict):
            raise invalid(f"{name} must be an object", name)
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list)
        or len(include) > _MAX_INCLUDE
        or not all(isinstance(item, str) for item in include)
    ):
        raise invalid(f"include must be a list of at most {_MAX_INCLUDE} strings", "include")


def _input_messages(value: object) -> tuple[list[dict[str, Any]], list[str]]:
    """``input`` as chat messages, and the ``input[i]`` each came from."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list):
        raise invalid("input must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
            sources.append(where)
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            # A turn's calls follow its text: one assistant message holds them all.
            if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                last["tool_calls"] = [call]
                last.setdefault("content", "")
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                sources.append(where)
        elif kind == "function_call_output":
            messages.append(_function_output(item, where))
            sources.append(where)
        elif kind in _DROPPED_ITEMS:
            continue
        else:
            raise invalid(
                f"{where}.type {kind!r} is not supported (supported: message, function_call, "
                "function_call_output; reasoning items are accepted and left out)",
                f"{where}.type",
                "unsupported_value",
            )
    return messages, sources


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(
            f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {role!r}",
            f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", f"{where}.content")
    parts: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        part_where = f"{where}.content[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and role == "user":
            parts.append(_input_image(part, part_where))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(
                f"{part_where}: {kind} is not supported"
                + (" here: images are read in user messages" if kind == "input_image" else ""),
                f"{part_where}.type",
                "unsupported_value",
            )
        else:
            raise invalid(
                f"{part_where} must be an input_text, output_text or input_image part",
                part_where,
            )
    if any(part["type"] == "image" for part in parts):
        return {"role": role, "content": parts}
    return {"role": role, "content": "\n".join(part["text"] for part in parts)}


def _input_image(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``{"type": "input_image", "image_url": "data:...", "detail": ...}``; a ``file_id``
    names a file uploaded to OpenAI's Files API, which this server does not keep."""
    if part.get("file_id") is not None:
        raise ImageRefused(
            f"{where}: file_id is not supported (this server keeps no uploaded files): send "
            "the image as image_url, a data: URL",
            part=where,
            reason="unsupported_file_id",
        )
    detail = part.get("detail")
    if detail not in (None, "auto", "low", "high"):
        raise invalid(
            f"{where}.detail must be 'auto', 'low' or 'high', got {detail!r}", f"{where}.detail"
        )
    if part.get("image_url") is None:
        raise ImageRefused(f"{where}: missing image_url", part=where, reason="invalid_image_url")
    return image_from_url(part["image_url"], where)


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise invalid(f"{where}.{name} must be a string", f"{where}.{name}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _function_output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise invalid(f"{where}.call_id must be a string", f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for number, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise invalid(
                    f"{where}.output[{number}]: only text parts are supported",
                    f"{where}.output",
                    "unsupported_value",
                )
            texts.append(str(part.get("text", "")))
        output = "\n".join(texts)
    if not isinstance(output, str):
        raise invalid(f"{where}.output must be a string or text parts", f"{where}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _tools(
    value: object,
) -> tuple[list[dict[str, Any]], list[int], list[tuple[int, str]]]:
    """The function tools; the client's index of each; the (index, type) of the others,
    which are left out: a tool the model cannot call is not a reason to refuse."""
    if value is None:
        return [], [], []
    if not isinstance(value, list):
        raise invalid("tools must be a list", "tools")
    functions: list[dict[str, Any]] = []
    indexes: list[int] = []
    dropped: list[tuple[int, str]] = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid(f"{where} must be an object with a 'type'", where)
        if tool["type"] != "function":
            dropped.append((index, tool["type"]))
            continue
        for key in tool:
            if key not in ("type", "name", "description", "parameters", "strict"):
                raise invalid(f"{where}.{key} is not supported", f"{where}.{key}")
        functions.append(tool)
        indexes.append(index)
    if dropped:
        logger.warning(
            "POST /v1/responses: tools the model cannot call, left out: %s",
            ", ".join(f"tools[{index}] ({kind})" for index, kind in dropped),
        )
    return functions, indexes, dropped


def _tool_choice(value: object, has_tools: bool) -> object:
    if value in ("none", "auto", "required"):
        # Every tool offered may have been left out (hosted ones): then auto is none.
        return "none" if value == "auto" and not has_tools else value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise invalid(
        "tool_choice must be none, auto, required or {'type': 'function', 'name': ...} "
        "(hosted tools are not called here)",
        "tool_choice",
        "unsupported_value",
    )


def _text_format(value: object) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``text.verbosity`` has no effect)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("text must be an object", "text")
    for key in value:
        if key not in ("format", "verbosity"):
            raise invalid(f"text.{key} is not supported", f"text.{key}", "unsupported_field")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(
            "text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
            "text.format",
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}
