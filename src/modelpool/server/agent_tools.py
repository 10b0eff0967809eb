"""What the agent APIs (Responses, Messages) share as they translate onto the chat path:
the function tools an agent offers, less those the grammar engine cannot constrain, and a
chat refusal renamed to the field the client sent.

Coding agents send a dozen tools, some with JSON-schema keywords llguidance does not
implement (Claude Code's ``propertyNames``, say). Chat completions refuses such a tool
with a 400 naming the keyword; the agent APIs instead leave it out, logged, and serve the
turn with the rest: the model could not be held to that tool's arguments, so it is a tool
the model cannot call, and one tool is no reason to fail every turn of the agent::

    kept, left_out = constrainable(functions, ["tools[0]", "tools[1]"], "/v1/responses")

A chat body's refusal names a chat field (``messages[3].content``, ``tools[1].function.
parameters``, ``max_tokens``); :func:`renamed` gives it back as the client's own
(``input[5]``, ``tools[2].input_schema``, ``max_output_tokens``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from modelpool.server.http import ApiError
from modelpool.shared.errors import GrammarError
from modelpool.shared.structured import json_schema_grammar_fragment

logger = logging.getLogger(__name__)

_CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\]")
_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.function")


def constrainable(
    functions: list[dict[str, Any]], wheres: list[str], route: str
) -> tuple[list[int], list[str]]:
    """The positions of the chat function tools whose parameters the grammar engine takes,
    and a line for each left out (its field and the reason), logged as ``route``'s."""
    kept: list[int] = []
    left_out: list[str] = []
    for position, (tool, where) in enumerate(zip(functions, wheres, strict=True)):
        parameters = tool.get("function", {}).get("parameters")
        if parameters is None:
            kept.append(position)
            continue
        try:
            json_schema_grammar_fragment(parameters, param=where)
        except GrammarError as exc:
            left_out.append(f"{where} ({tool['function'].get('name')!r}: {exc.message})")
            continue
        kept.append(position)
    if left_out:
        logger.warning(
            "POST %s: tools the grammar engine cannot constrain, left out: %s",
            route,
            "; ".join(left_out),
        )
    return kept, left_out


def renamed(
    error: ApiError,
    sources: Sequence[str],
    tool_sources: Sequence[int],
    fields: Sequence[tuple[str, str]],
    schema: str = ".parameters",
) -> ApiError:
    """``error``, a refusal of the translated chat body, naming the client's field:
    ``sources[i]`` for chat message i, ``tools[tool_sources[j]]`` for chat tool j (its
    parameters called ``schema``), and each ``(chat_name, name)`` of ``fields``."""
    param = error.param
    if param is None:
        return error
    name = param
    found = _CHAT_MESSAGE.match(param)
    if found and int(found.group(1)) < len(sources):
        name = sources[int(found.group(1))] + param[found.end() :]
    found = _CHAT_TOOL.match(param)
    if found and int(found.group(1)) < len(tool_sources):
        rest = param[found.end() :]
        if rest.startswith(".parameters"):
            rest = schema + rest[len(".parameters") :]
        name = f"tools[{tool_sources[int(found.group(1))]}]" + rest
    for chat_name, client_name in fields:
        if name == chat_name or name.startswith((chat_name + "[", chat_name + ".")):
            name = client_name + name[len(chat_name) :]
    message = error.message.replace(param, name) if param in error.message else error.message
    return ApiError(
        error.status,
        message,
        type=error.type,
        code=error.code,
        param=name,
        headers=error.headers,
        extra=error.extra,
    )
