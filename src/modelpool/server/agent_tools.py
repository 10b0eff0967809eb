"""The function tools an agent offers, less those the grammar engine cannot constrain.

Coding agents send a dozen tools, some with JSON-schema keywords llguidance does not
implement (Claude Code's ``propertyNames``, say). Chat completions refuses such a tool
with a 400 naming the keyword; the agent APIs instead leave it out, logged, and serve the
turn with the rest: the model could not be held to that tool's arguments, so it is a tool
the model cannot call, and one tool is no reason to fail every turn of the agent::

    kept, left_out = constrainable(functions, ["tools[0]", "tools[1]"])
"""

from __future__ import annotations

from typing import Any

from modelpool.errors import GrammarError
from modelpool.structured import json_schema_grammar_fragment


def constrainable(
    functions: list[dict[str, Any]], wheres: list[str]
) -> tuple[list[int], list[str]]:
    """The positions of the chat function tools whose parameters the grammar engine takes,
    and a line for each left out (its field and the reason)."""
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
    return kept, left_out
