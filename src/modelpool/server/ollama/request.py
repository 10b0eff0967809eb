"""Ollama's ``/api/chat`` and ``/api/generate`` bodies translated onto the chat and
completion paths.

``/api/chat`` becomes a chat body (messages, ``tools``, ``format`` as ``response_format``,
``options`` as the sampling fields) and ``/api/generate`` one too (``system`` and
``prompt`` as two messages, the model's template applied), or a completion body with
``raw: true`` (the prompt continued as it is). Either then goes through
``core.generation_body.parse_chat`` or ``parse_completion``, the same checks, templates, tool
grammar and structured outputs as ``/v1/chat/completions``; a refusal there is renamed
back to the field the client sent (``max_tokens`` → ``options.num_predict``)::

    request = parse_chat_body(body)        # keep_alive is the registry's, taken out before
    request.job                            # the pool's Job; request.runs False: load/unload

A body without messages (or with an empty prompt) runs nothing: it loads the model, or
unloads it with ``keep_alive: 0``, as Ollama's clients ask for it (``api.OllamaApi``).
``images`` (base64 files) become the pool's image parts, before the message's text.
What cannot be honoured is a 400 naming the field: ``think`` with ``raw`` (a raw prompt
is no chat: nothing thinks apart), ``suffix`` (none fills in the middle), ``template``,
sampling options without a counterpart (``mirostat``, ``min_p``...). Options that tune
Ollama's own runtime (``num_thread``, ``num_gpu``...) and ``context`` are accepted and
ignored, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from modelpool.server.agent_tools import renamed
from modelpool.server.core.generation_body import parse_chat, parse_completion
from modelpool.server.core.job import Job
from modelpool.server.http import ApiError, invalid
from modelpool.server.reasoning import apply_controls
from modelpool.shared.image_input import image_from_base64
from modelpool.shared.reasoning.controls import ollama_controls
from modelpool.shared.validation import is_int, is_number

logger = logging.getLogger(__name__)

# Ollama's fields read here (keep_alive is taken out before: the registry's).
CHAT_FIELDS = frozenset(
    {"model", "messages", "tools", "format", "options", "stream", "think", "truncate", "shift"}
)
GENERATE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "suffix",
        "images",
        "format",
        "options",
        "system",
        "template",
        "stream",
        "raw",
        "context",
        "think",
        "truncate",
        "shift",
    }
)
# Accepted without effect: the prompt is never cut or shifted (past the context it is a
# 400 context_length_exceeded), and a previous answer's ``context`` is not read back.
_IGNORED_FIELDS = ("truncate", "shift", "context")
_MESSAGE_KEYS = frozenset(
    {"role", "content", "images", "tool_calls", "tool_name", "tool_call_id", "thinking"}
)

# options -> the chat field of the same meaning.
_SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Options of Ollama's runtime (threads, GPU layers, memory mapping, batch size...): they
# do not change what is generated; each pool's workers are configured in its table.
_RUNTIME_OPTIONS = frozenset(
    {
        "num_keep",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "numa",
        "low_vram",
        "f16_kv",
        "vocab_only",
        "logits_all",
        "embedding_only",
        "penalize_newline",
        # The window of repeat_penalty: here the penalty reads the whole text.
        "repeat_last_n",
    }
)
# Sampling options with no counterpart here, accepted only at the value that turns them off.
_OFF_VALUES: dict[str, float] = {"min_p": 0.0, "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
# Read only with mirostat on.
_MIROSTAT_OPTIONS = frozenset({"mirostat_tau", "mirostat_eta"})

# A chat body's fields, as a refusal names them, by Ollama's names.
_CHAT_NAMES = (
    ("max_tokens", "options.num_predict"),
    ("response_format", "format"),
    *((chat, f"options.{option}") for option, chat in _SAMPLING_OPTIONS.items()),
)


@dataclass
class OllamaRequest:
    """A parsed ``/api/chat`` or ``/api/generate`` request: the pool's job, and what the
    answer and the model checks need."""

    job: Job
    kind: Literal["chat", "generate"]
    model: str
    # False: no messages (an empty prompt), a request to load or unload the model.
    runs: bool = True
    # options.num_ctx, checked against the loaded model's context.
    num_ctx: int | None = None
    ignored: list[str] = field(default_factory=list)


def parse_chat_body(body: Mapping[str, Any]) -> OllamaRequest:
    """``POST /api/chat`` (see the module docstring)."""
    _check_fields(body, CHAT_FIELDS)
    model = _model(body)
    messages = body.get("messages")
    if messages is None or messages == []:
        return _load_only("chat", model, body)
    if not isinstance(messages, list):
        raise invalid("messages must be a list of messages", "messages")
    chat_messages = _chat_messages(messages)
    chat: dict[str, Any] = {"messages": chat_messages, "stream": _stream(body)}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools must be a list of function tools", "tools")
        if tools:
            chat["tools"] = tools
    num_ctx, repeat_penalty, ignored = _options(body.get("options"), chat)
    _format(body.get("format"), chat)
    sources = [f"messages[{index}]" for index in range(len(chat_messages))]
    try:
        job = parse_chat(chat)
    except ApiError as exc:
        raise renamed(exc, sources, list(range(len(tools or []))), _CHAT_NAMES) from None
    apply_controls(job.params, ollama_controls, body.get("think"))
    return _request(job, "chat", model, body, num_ctx, repeat_penalty, ignored)


def parse_generate_body(body: Mapping[str, Any]) -> OllamaRequest:
    """``POST /api/generate`` (see the module docstring)."""
    _check_fields(body, GENERATE_FIELDS)
    model = _model(body)
    images = _images(body.get("images"), "images")
    suffix = body.get("suffix")
    if suffix not in (None, ""):
        raise invalid(
            f"suffix: {model!r} does not support insert: no model served here fills in the "
            "middle (send the text before it as the prompt)",
            "suffix",
            "unsupported_value",
        )
    if body.get("template") not in (None, ""):
        raise invalid(
            "template: the model's own chat template is used; send raw: true with a prompt "
            "templated already instead",
            "template",
            "unsupported_value",
        )
    prompt = body.get("prompt")
    if (prompt is None or prompt == "") and images:
        raise invalid("images: a prompt is needed with the images", "prompt")
    if prompt is None or prompt == "":
        return _load_only("generate", model, body)
    if not isinstance(prompt, str):
        raise invalid("prompt must be a string", "prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise invalid("system must be a string", "system")
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise invalid("raw must be true or false", "raw")
    if raw and body.get("think") not in (None, False):
        raise invalid(
            "think: with raw: true the prompt is no chat, so nothing thinks apart from the "
            "answer; leave think out or send the prompt without raw",
            "think",
            "unsupported_value",
        )
    context = body.get("context")
    if context is not None and not (
        isinstance(context, list) and all(is_int(item, minimum=0) for item in context)
    ):
        raise invalid("context must be a list of token ids", "context")
    completion: dict[str, Any] = {"stream": _stream(body)}
    if raw:
        if images:
            raise invalid(
                "images: with raw: true no template is applied, so the images have no place; "
                "send raw: false",
                "images",
                "unsupported_value",
            )
        if system:
            raise invalid(
                "system: with raw: true no template is applied, so a system message has no "
                "place; put it in the prompt",
                "system",
                "unsupported_value",
            )
        completion["prompt"] = prompt
        sources = ["prompt"]
    else:
        content = [*images, {"type": "text", "text": prompt}] if images else prompt
        messages = [{"role": "user", "content": content}]
        sources = ["prompt"]
        if system:
            messages.insert(0, {"role": "system", "content": system})
            sources.insert(0, "system")
        completion["messages"] = messages
    num_ctx, repeat_penalty, ignored = _options(body.get("options"), completion)
    _format(body.get("format"), completion)
    try:
        job = parse_completion(completion) if raw else parse_chat(completion)
    except ApiError as exc:
        raise renamed(exc, sources, [], _CHAT_NAMES) from None
    if not raw:
        apply_controls(job.params, ollama_controls, body.get("think"))
    return _request(job, "generate", model, body, num_ctx, repeat_penalty, ignored)


def _request(
    job: Job,
    kind: Literal["chat", "generate"],
    model: str,
    body: Mapping[str, Any],
    num_ctx: int | None,
    repeat_penalty: float | None,
    ignored: list[str],
) -> OllamaRequest:
    if repeat_penalty is not None:
        job.params["repetition_penalty"] = repeat_penalty
    ignored = [name for name in _IGNORED_FIELDS if body.get(name) is not None] + ignored
    if ignored:
        logger.info("POST /api/%s: accepted and ignored: %s", kind, ", ".join(ignored))
    return OllamaRequest(job, kind, model, num_ctx=num_ctx, ignored=ignored)


def _load_only(
    kind: Literal["chat", "generate"], model: str, body: Mapping[str, Any]
) -> OllamaRequest:
    _stream(body)
    return OllamaRequest(Job([], {}), kind, model, runs=False)


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name not in allowed and value is not None:
            raise invalid(f"unsupported field {name!r}", param=name, code="unsupported_field")
    for name in ("truncate", "shift"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(f"{name} must be true or false", name)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required", "model", "missing_field")
    return model


def _stream(body: Mapping[str, Any]) -> bool:
    """Ollama streams unless the body says ``stream: false``."""
    stream = body.get("stream")
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise invalid("stream must be true or false", "stream")
    return stream


def _images(images: object, where: str) -> list[dict[str, Any]]:
    """Ollama's ``images``: base64 image files (no data: URL), as the pool's parts."""
    if images is None:
        return []
    if not isinstance(images, list):
        raise invalid(f"{where} must be a list of base64 images", where)
    return [
        image_from_base64(image, None, f"{where}[{number}]") for number, image in enumerate(images)
    ]


def _chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as chat's: an assistant's ``tool_calls`` (arguments an object,
    no id) given ids, and each ``tool`` result the id of the call it answers (by its
    ``tool_name``, else the next unanswered call)."""
    converted: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", where)
        for key, value in message.items():
            if key not in _MESSAGE_KEYS and value is not None:
                raise invalid(
                    f"{where}.{key} is not supported", f"{where}.{key}", "unsupported_field"
                )
        images = _images(message.get("images"), f"{where}.images")
        role = message.get("role")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"{where}.content must be a string", f"{where}.content")
        if images and role != "user":
            raise invalid(f"{where}.images: images are read in user messages", f"{where}.images")
        # The images before the text, as Ollama's own templates place them.
        parts = [*images, {"type": "text", "text": content}]
        chat: dict[str, Any] = {"role": role, "content": parts if images else content}
        calls = message.get("tool_calls")
        if calls and role == "assistant":
            if not isinstance(calls, list):
                raise invalid(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            chat["tool_calls"] = [_call(call, index, number) for number, call in enumerate(calls)]
            pending = [(c["id"], c["function"]["name"]) for c in chat["tool_calls"]]
        elif role == "tool":
            chat["tool_call_id"] = _answered_call(message, pending, where)
            if isinstance(message.get("tool_name"), str):
                chat["name"] = message["tool_name"]
        converted.append(chat)
    return converted


def _call(call: object, index: int, number: int) -> dict[str, Any]:
    where = f"messages[{index}].tool_calls[{number}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise invalid(f"{where}.function must be an object", f"{where}.function")
    call_id = call.get("id") if isinstance(call, dict) else None
    return {
        "id": call_id if isinstance(call_id, str) and call_id else f"call_{index}_{number}",
        "type": "function",
        "function": {"name": function.get("name"), "arguments": function.get("arguments", {})},
    }


def _answered_call(message: Mapping[str, Any], pending: list[tuple[str, str]], where: str) -> str:
    given = message.get("tool_call_id")
    if isinstance(given, str) and given:
        return given
    name = message.get("tool_name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{where}.tool_name must be a string", f"{where}.tool_name")
    for position, (call_id, call_name) in enumerate(pending):
        if name is None or call_name == name:
            del pending[position]
            return call_id
    return ""


def _options(options: object, chat: dict[str, Any]) -> tuple[int | None, float | None, list[str]]:
    """``options`` into ``chat``'s sampling fields; ``num_ctx``, ``repeat_penalty`` and
    the options accepted without effect are returned."""
    if options is None:
        return None, None, []
    if not isinstance(options, dict):
        raise invalid("options must be an object", "options")
    num_ctx: int | None = None
    repeat_penalty: float | None = None
    ignored: list[str] = []
    for name, value in options.items():
        where = f"options.{name}"
        if value is None:
            continue
        if name in _SAMPLING_OPTIONS:
            chat[_SAMPLING_OPTIONS[name]] = value
        elif name == "num_predict":
            if not is_int(value, minimum=-2) or value == 0:
                raise invalid(
                    f"{where} must be -1 (no limit but the model's), -2 or a number >= 1, "
                    f"got {value!r}",
                    where,
                )
            if value > 0:
                chat["max_tokens"] = value
        elif name == "num_ctx":
            if not is_int(value, minimum=1):
                raise invalid(f"{where} must be an integer >= 1, got {value!r}", where)
            num_ctx = value
        elif name == "repeat_penalty":
            if not is_number(value) or value <= 0:
                raise invalid(f"{where} must be a number > 0, got {value!r}", where)
            repeat_penalty = float(value) if value != 1 else None
        elif name in _RUNTIME_OPTIONS:
            ignored.append(where)
        elif name in _OFF_VALUES:
            if value != _OFF_VALUES[name]:
                raise invalid(
                    f"{where} is not supported here (only {_OFF_VALUES[name]:g}, which turns "
                    "it off); use temperature, top_p and top_k",
                    where,
                    "unsupported_value",
                )
        elif name in _MIROSTAT_OPTIONS:
            ignored.append(where)
        else:
            raise invalid(f"{where} is not an option", where, "unsupported_field")
    return num_ctx, repeat_penalty, ignored


def _format(value: object, chat: dict[str, Any]) -> None:
    """``format``: ``"json"`` (any JSON object) or a JSON schema, as ``response_format``."""
    if value is None or value == "":
        return
    if value == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(value, dict):
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": value},
        }
    else:
        raise invalid('format must be "json" or a JSON schema', "format")
