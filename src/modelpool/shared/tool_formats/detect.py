"""Which call syntax a model was trained on, read from its chat template.

``tool_parser = "auto"`` (a model's default) is resolved here, on the supervisor's side,
before any worker loads: the template is read from the model's files (a local directory's
``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``, or the same
files of a hub model already in the local cache, or a GGUF file's embedded
``tokenizer.chat_template``); a template that shows none of the families' markers (or no
template found) keeps Hermes, the syntax the generic tool preamble teaches.
"""

from __future__ import annotations

import json
from pathlib import Path

TOOL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "gpt_oss")
DEFAULT_PARSER = "hermes"

# In order: the first family whose markers a template holds is its syntax (Qwen3-Coder's
# templates also hold <tool_call>, and gpt-oss's and Llama's may mention JSON).
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gpt_oss", ("<|channel|>", "to=functions.")),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|python_tag|>", "ipython")),
    ("hermes", ("<tool_call>",)),
)
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def check_tool_parser(value: object) -> None:
    """A model's ``tool_parser`` setting: ``auto`` or one of the parsers (ValueError)."""
    if value not in TOOL_PARSERS:
        raise ValueError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {value!r}")


def detect_tool_parser(template: str | None) -> str | None:
    """The family whose markers ``template`` holds, or None."""
    if not template:
        return None
    for name, markers in _MARKERS:
        if any(marker in template for marker in markers):
            return name
    return None


def resolve_tool_parser(configured: str, model: str) -> str:
    """The parser a model's ``tool_parser`` setting means: itself, or for ``auto`` the one
    detected from ``model``'s chat template (Hermes when none is)."""
    if configured != "auto":
        return configured
    detected = _DETECTED.get(model)
    if detected is None:
        template = chat_template_of(model)
        detected = detect_tool_parser(template) or DEFAULT_PARSER
        if template is not None:
            # Kept once read: a hub model not downloaded yet is read again next time.
            _DETECTED[model] = detected
    return detected


# By model: the parser its template showed (a daemon serves a handful of models).
_DETECTED: dict[str, str] = {}


# The markers the grammars write: where one is a special token of the model, the grammar
# writes that token (llguidance does not match a special token by its text).
GRAMMAR_MARKERS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "<|start|>",
        "<|end|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        "<|call|>",
    }
)


# What the readers read: a worker decoding a request with tools keeps these special
# tokens in the text (every other special token is dropped).
KEPT_SPECIAL_TOKENS = GRAMMAR_MARKERS | {
    "<|python_tag|>",
    "[ARGS]",
    "[CALL_ID]",
    "<|return|>",
}


def marker_tokens(model: str) -> tuple[tuple[str, int], ...]:
    """The grammar markers that are special tokens of ``model``'s tokenizer, with their ids
    (read from its tokenizer files; none when there are none)."""
    known = _MARKER_TOKENS.get(model)
    if known is not None:
        return known
    added = _added_tokens(model)
    found = tuple(
        sorted(
            {
                content: token
                for content, token, special in added
                if special and content in GRAMMAR_MARKERS
            }.items()
        )
    )
    if added:
        _MARKER_TOKENS[model] = found  # kept once its tokenizer was read
    return found


_MARKER_TOKENS: dict[str, tuple[tuple[str, int], ...]] = {}


def _added_tokens(model: str) -> list[tuple[str, int, bool]]:
    """The added tokens of a tokenizer (``tokenizer.json``'s ``added_tokens``, else an
    older ``tokenizer_config.json``'s ``added_tokens_decoder``): content, id, special."""
    tokens: list[tuple[str, int, bool]] = []
    data = _json_file(model, "tokenizer.json")
    for token in data.get("added_tokens", []) if isinstance(data, dict) else []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            tokens.append((str(token.get("content")), token["id"], bool(token.get("special"))))
    if tokens:
        return tokens
    data = _json_file(model, "tokenizer_config.json")
    decoder = data.get("added_tokens_decoder") if isinstance(data, dict) else None
    for key, token in decoder.items() if isinstance(decoder, dict) else []:
        if isinstance(token, dict) and str(key).isdigit():
            tokens.append((str(token.get("content")), int(key), bool(token.get("special"))))
    return tokens


def _json_file(model: str, name: str) -> object:
    path = _model_file(model, name)
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def chat_template_of(model: str) -> str | None:
    """The chat template text of a model directory, a cached hub model or a GGUF file
    (its ``tokenizer.chat_template``), or None."""
    local = Path(model).expanduser()
    if local.suffix == ".gguf" and local.is_file():
        return _gguf_template(local)
    for name in _TEMPLATE_FILES:
        path = _model_file(model, name)
        if path is None:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        template = text if name.endswith(".jinja") else _template_in(text)
        if template:
            return template
    return None


def _gguf_template(path: Path) -> str | None:
    from modelpool.shared.lora_gguf import read_gguf_header

    try:
        metadata = read_gguf_header(path)[0]
    except (OSError, ValueError):
        return None
    template = metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None


def _model_file(model: str, name: str) -> Path | None:
    local = Path(model).expanduser()
    if local.is_dir():
        path = local / name
        return path if path.is_file() else None
    if local.exists() or model.count("/") != 1:
        return None  # a file (GGUF) or not a hub id
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, name)
    return Path(cached) if isinstance(cached, str) else None


def _template_in(text: str) -> str | None:
    """``chat_template`` of a tokenizer config: one template, or a list of named ones."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):
        texts = [item.get("template") for item in template if isinstance(item, dict)]
        return "\n".join(text for text in texts if isinstance(text, str)) or None
    return template if isinstance(template, str) else None
