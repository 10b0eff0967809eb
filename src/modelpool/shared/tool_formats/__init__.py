"""Tool calls in each model family's own syntax: one module per family (its grammar and
its reader), and :mod:`.detect` to find a model's from its chat template::

    tool_format("qwen3_coder").grammar(tools, "required", parallel=True)
    reader = tool_format("mistral").reader({"get_weather": schema})
    reader.feed('[TOOL_CALLS][{"name": "get_weather", ') + reader.feed(...) + reader.finish()
"""

from __future__ import annotations

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
from modelpool.shared.tool_formats.gpt_oss import GptOss
from modelpool.shared.tool_formats.hermes import Hermes
from modelpool.shared.tool_formats.llama3_json import Llama3Json
from modelpool.shared.tool_formats.mistral import Mistral
from modelpool.shared.tool_formats.qwen3_coder import Qwen3Coder

_FORMATS: dict[str, ToolFormat] = {
    format.name: format for format in (Hermes(), Llama3Json(), Mistral(), Qwen3Coder(), GptOss())
}


def tool_format(name: str) -> ToolFormat:
    """The syntax of a resolved ``tool_parser`` (not ``auto``)."""
    return _FORMATS[name]


__all__ = [
    "DEFAULT_PARSER",
    "KEPT_SPECIAL_TOKENS",
    "TOOL_PARSERS",
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
