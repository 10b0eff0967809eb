"""An Anthropic Messages body (``POST /v1/messages``, ``/v1/messages/count_tokens``)
translated into a chat body.

``system`` becomes the system message; each message's content blocks become chat
messages (``text`` the content, an assistant's ``tool_use`` its ``tool_calls``, a user's
``tool_result`` a ``tool`` message before its text); ``tools`` with ``input_schema``
become function tools, ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) chat's,
``stop_sequences`` ``stop``. The chat body then goes through
``core.generation_body.parse_chat``, the same path as ``/v1/chat/completions``; a refusal
there is renamed back to the field the client sent::

    request = parse_messages(body)               # max_tokens required
    request = parse_messages(body, count=True)   # count_tokens: no max_tokens

Claude Code's fields that do not change what is generated (``thinking``, ``metadata``,
``cache_control`` markers) are accepted, left out and logged; so are server tools
(``web_search_...``, ``bash_...``) the model cannot call. ``image`` blocks (and text
``document`` blocks) become the pool's parts (``sources``), in a user message or a
tool result.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpool.server.agent_tools import constrainable, renamed
from modelpool.server.anthropic.sources import source_block
from modelpool.server.core.fields import check_ignored_fields
from modelpool.server.core.generation_body import parse_chat
from modelpool.server.core.job import Job
from modelpool.server.http import ApiError, invalid
from modelpool.server.reasoning import apply_controls
from modelpool.shared.reasoning.controls import messages_controls
from modelpool.shared.validation import is_int

logger = logging.getLogger(__name__)

# The chat fields a refusal may name, by the Messages API's names.
_CHAT_FIELDS = (
    ("stop", "stop_sequences"),
    ("response_format", "output_format"),
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
)

MESSAGES_FIELDS = frozenset(
    {
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "output_format",
        "output_config",
        "cache_salt",  # vLLM's, passed to the chat body as it is
    }
)
COUNT_FIELDS = frozenset({"messages", "system", "tools", "tool_choice", "output_format"})
# Accepted without effect on what is generated, and logged as ignored.
IGNORED_MESSAGES_FIELDS = frozenset(
    {
        "model",
        "metadata",
        "thinking",
        "service_tier",
        "context_management",
        "container",
        "mcp_servers",
        "betas",
    }
)
_TOOL_KEYS = frozenset(
    {
        "name",
        "description",
        "input_schema",
        "type",
        "cache_control",
        "strict",
        "input_examples",
        "defer_loading",
        "eager_input_streaming",
    }
)
# Blocks an assistant turn may carry that the model does not read back (earlier turns'
# thinking, as chat templates leave it out too): left out, never rendered as answer text.
_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass
class MessagesRequest:
    """A parsed Messages request: the pool's job and what the answer needs."""

    job: Job
    stop_sequences: list[str]
    ignored: list[str] = field(default_factory=list)


def parse_messages(body: Mapping[str, Any], *, count: bool = False) -> MessagesRequest:
    allowed = COUNT_FIELDS if count else MESSAGES_FIELDS
    for name in body:
        if name not in allowed and name not in IGNORED_MESSAGES_FIELDS:
            raise invalid(f"unsupported field {name!r}", param=name, code="unsupported_field")
    check_ignored_fields({"model": body["model"]} if "model" in body else {})
    for name in ("metadata", "thinking", "context_management", "output_config"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise invalid(f"{name} must be an object", name)
    if not count and "max_tokens" not in body:
        raise invalid("max_tokens: field required", "max_tokens", "missing_field")
    if "messages" not in body:
        raise invalid("messages: field required", "messages", "missing_field")
    if body.get("top_k") is not None and not is_int(body["top_k"], minimum=0):
        raise invalid("top_k must be an integer >= 0", "top_k")
    sources: list[str] = []
    chat_messages: list[dict[str, Any]] = []
    system = _system(body.get("system"))
    if system is not None:
        chat_messages.append({"role": "system", "content": system})
        sources.append("system")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    for index, message in enumerate(messages):
        for converted in _message(message, f"messages[{index}]"):
            chat_messages.append(converted)
            sources.append(f"messages[{index}]")
    tools, tool_sources, dropped = _tools(body.get("tools"))
    wheres = [f"tools[{i}].input_schema" for i in tool_sources]
    kept, unconstrainable = constrainable(tools, wheres, "/v1/messages")
    tools = [tools[position] for position in kept]
    tool_sources = [tool_sources[position] for position in kept]
    chat: dict[str, Any] = {"messages": chat_messages}
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice, bool(tools)))
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid("stop_sequences must be a list of strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    for name, chat_name in (
        ("max_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
        ("cache_salt", "cache_salt"),
    ):
        if body.get(name) is not None and not count:
            chat[chat_name] = body[name]
    response_format = _output_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        job = parse_chat(chat)
    except ApiError as exc:
        raise renamed(exc, sources, tool_sources, _CHAT_FIELDS, ".input_schema") from None
    apply_controls(job.params, messages_controls, body.get("thinking"))
    ignored = sorted((IGNORED_MESSAGES_FIELDS - {"thinking"}) & body.keys())
    ignored += [f"tools[{index}] (type {kind!r})" for index, kind in dropped]
    ignored += [line.partition(" ")[0] + " (schema)" for line in unconstrainable]
    if _has_cache_control(body):
        ignored.append("cache_control")
    if ignored:
        route = "/v1/messages/count_tokens" if count else "/v1/messages"
        logger.info("POST %s: accepted and ignored: %s", route, ", ".join(ignored))
    return MessagesRequest(job, list(stops or []), ignored)


def _system(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise invalid(f"system[{index}] must be a text block", f"system[{index}]")
            if not isinstance(block.get("text"), str):
                raise invalid(f"system[{index}].text must be a string", f"system[{index}].text")
            texts.append(block["text"])
        return "\n\n".join(texts)
    raise invalid("system must be a string or a list of text blocks", "system")


def _message(message: object, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results first (one ``tool``
    message each), then its text; an assistant's text with its ``tool_use`` calls."""
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", where)
    role = message.get("role")
    # Claude Code puts "system" messages in the conversation too (its reminders): read
    # as chat's system messages.
    if role not in ("user", "assistant", "system"):
        raise invalid(
            f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}", f"{where}.role"
        )
    for key in message:
        if key not in ("role", "content"):
            raise invalid(f"{where}.{key} is not supported", f"{where}.{key}", "unsupported_field")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    parts: list[dict[str, Any]] = []  # text and image parts, in order
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(content):
        block_where = f"{where}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, block_where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, block_where))
        elif kind in _DROPPED_BLOCKS and role == "assistant":
            continue
        elif kind in ("image", "document") and role == "user":
            parts.append(source_block(block, block_where))
        else:
            raise invalid(
                f"{block_where}: a {role} message takes text"
                + {"assistant": ", tool_use", "user": ", image, document, tool_result"}.get(
                    role, ""
                )
                + f" blocks, got {kind!r}",
                f"{block_where}.type",
                "unsupported_value",
            )
    converted: list[dict[str, Any]] = list(results)
    text = "\n".join(part["text"] for part in parts if part["type"] == "text")
    if calls:
        converted.append({"role": "assistant", "content": text, "tool_calls": calls})
    elif any(part["type"] == "image" for part in parts):
        converted.append({"role": role, "content": parts})
    elif parts or not results:
        converted.append({"role": role, "content": text})
    return converted


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str):
            raise invalid(f"{where}.{name} must be a string", f"{where}.{name}")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input must be an object", f"{where}.input")
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": json.dumps(arguments)},
    }


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        # Claude Code's Read of an image file answers with an image block here.
        parts = [
            _result_part(part, f"{where}.content[{number}]") for number, part in enumerate(content)
        ]
        if any(part["type"] == "image" for part in parts):
            if block.get("is_error") is True:
                parts.insert(0, {"type": "text", "text": "Error:"})
            return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": parts}
        content = "\n".join(part["text"] for part in parts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or text blocks", f"{where}.content")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _result_part(part: object, where: str) -> dict[str, Any]:
    """A tool result's block: text, or an image (``source_block``)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(part, dict) and kind == "text":
        return {"type": "text", "text": str(part.get("text", ""))}
    if isinstance(part, dict) and kind in ("image", "document"):
        return source_block(part, where)
    raise invalid(
        f"{where}: a tool result takes text, image and document blocks, got {kind!r}",
        where,
        "unsupported_value",
    )


def _tools(value: object) -> tuple[list[dict[str, Any]], list[int], list[tuple[int, str]]]:
    """Custom tools as chat's function tools; the client's index of each; the (index,
    type) of server tools, left out: a tool the model cannot call is no reason to refuse."""
    if value is None:
        return [], [], []
    if not isinstance(value, list):
        raise invalid("tools must be a list", "tools")
    functions: list[dict[str, Any]] = []
    indexes: list[int] = []
    dropped: list[tuple[int, str]] = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where} must be an object", where)
        kind = tool.get("type", "custom")
        if kind != "custom":
            dropped.append((index, str(kind)))
            continue
        for key in tool:
            if key not in _TOOL_KEYS:
                raise invalid(f"{where}.{key} is not supported", f"{where}.{key}")
        if "input_schema" not in tool:
            raise invalid(f"{where}.input_schema: field required", f"{where}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
        indexes.append(index)
    if dropped:
        logger.warning(
            "POST /v1/messages: server tools the model cannot call, left out: %s",
            ", ".join(f"tools[{index}] ({kind})" for index, kind in dropped),
        )
    return functions, indexes, dropped


def _tool_choice(value: object, has_tools: bool) -> dict[str, Any]:
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid(
            "tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none', ...}", "tool_choice"
        )
    chat: dict[str, Any] = {}
    disable = value.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise invalid(
                "tool_choice.disable_parallel_tool_use must be true or false",
                "tool_choice.disable_parallel_tool_use",
            )
        if has_tools:
            chat["parallel_tool_calls"] = not disable
    kind = value["type"]
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise invalid("tool_choice.name must be a string", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    elif kind == "auto" and not has_tools:
        chat["tool_choice"] = "none"
    else:
        chat["tool_choice"] = _TOOL_CHOICES[kind]
    return chat


def _output_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``output_format`` (or ``output_config.format``), ``json_schema``: structured
    output through the grammar engine, as chat's ``response_format``."""
    fmt = body.get("output_format")
    where = "output_format"
    config = body.get("output_config")
    if fmt is None and isinstance(config, dict):
        fmt, where = config.get("format"), "output_config.format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid(f"{where} must be {{'type': 'json_schema', 'schema': ...}}", where)
    if not isinstance(fmt.get("schema"), dict):
        raise invalid(f"{where}.schema must be a JSON schema", f"{where}.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _has_cache_control(value: object) -> bool:
    """Whether the body marks any block with ``cache_control`` (the prefix cache needs no
    marker: a repeated prefix is read from it anyway)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "cache_control" in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
