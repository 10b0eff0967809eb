"""Tool calls in each model family's own syntax: one module per family (its grammar and
its reader), and :mod:`.detect` to find a model's from its chat template::

    tool_format("qwen3_coder").grammar(tools, "required", parallel=True)
    reader = tool_format("mistral").reader({"get_weather": schema})
    reader.feed('[TOOL_CALLS][{"name": "get_weather", ') + reader.feed(...) + reader.finish()
"""

from __future__ import annotations

import functools
import importlib

from modelpool.shared.tool_formats.base import (
    GrammarTool,
    MalformedCall,
    Mode,
    Piece,
    RawCall,
    SyntaxReader,
    ToolFormat,
)
from modelpool.shared.tool_formats.detect import (
    DEFAULT_PARSER,
    KEPT_SPECIAL_TOKENS,
    TOOL_PARSERS,
    chat_template_of,
    detect_tool_parser,
    marker_tokens,
    resolve_tool_parser,
)
from modelpool.shared.tool_formats.streaming import ArgumentsPiece, CallStart

# By parser: the module and class of its syntax, imported when first used (the
# configuration imports this package for its names alone, and qwen3_coder's grammar
# needs the structured-output checks).
_FORMATS = {
    "hermes": ("hermes", "Hermes"),
    "llama3_json": ("llama3_json", "Llama3Json"),
    "mistral": ("mistral", "Mistral"),
    "qwen3_coder": ("qwen3_coder", "Qwen3Coder"),
    "gpt_oss": ("gpt_oss", "GptOss"),
}


@functools.cache
def tool_format(name: str) -> ToolFormat:
    """The syntax of a resolved ``tool_parser`` (not ``auto``)."""
    module, cls = _FORMATS[name]
    syntax: ToolFormat = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return syntax


__all__ = [
    "DEFAULT_PARSER",
    "KEPT_SPECIAL_TOKENS",
    "TOOL_PARSERS",
    "ArgumentsPiece",
    "CallStart",
    "GrammarTool",
    "MalformedCall",
    "Mode",
    "Piece",
    "RawCall",
    "SyntaxReader",
    "ToolFormat",
    "chat_template_of",
    "detect_tool_parser",
    "marker_tokens",
    "resolve_tool_parser",
    "tool_format",
]
