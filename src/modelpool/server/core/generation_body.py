"""The daemon's generation request: a completions or chat body in OpenAI's field names,
parsed and checked into a :class:`~modelpool.server.core.job.Job`.

OpenAI's chat body is the form every generating family reads its own into: the OpenAI
routes parse theirs here directly, and the Responses, Anthropic and Ollama families
translate theirs into a chat (or completion) body and parse it here, so that every
family gets the same checks, templates, tools and structured outputs::

    body = parse_json_object(raw)
    job = parse_chat(body)  # or parse_completion(body)

Bodies are checked field by field rather than by pydantic models: every rejection
names the OpenAI field (the pool's own messages name its kwargs, e.g.
``max_new_tokens``), and a field we cannot honour (``suffix``, ``audio``...) is a 400,
never ignored. ``COMPLETION_FIELDS`` and ``CHAT_FIELDS`` name the fields each
route acts on (a few more, such as ``user``, are accepted and ignored: ``fields``).
The field primitives are ``fields``', the deadline ``deadline``'s, the cost ``cost``'s;
each family writes its own answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelpool.server.core.fields import (
    check_fields,
    opt_bool,
    opt_int,
    opt_number,
    parse_priority,
    unsupported_unless,
)
from modelpool.server.core.job import MAX_CHOICES, Job
from modelpool.server.http import ApiError, invalid
from modelpool.shared.errors import GrammarError, ImageRefused, SchemaTooComplex
from modelpool.shared.image_input import image_from_url
from modelpool.shared.protocol import MAX_TOP_LOGPROBS, Prompt, TokenIds
from modelpool.shared.reasoning.controls import ControlError, chat_controls
from modelpool.shared.structured import GUIDED_FIELDS, grammar_for_body
from modelpool.shared.tools import (
    ToolPlan,
    ToolRequestError,
    chat_message,
    fill_result_names,
    parse_tool_request,
)
from modelpool.shared.validation import (
    FIT_PARAM,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    is_int,
    is_number,
)

# OpenAI's bound on the legacy completions ``logprobs`` (chat's top_logprobs allows 20).
MAX_LEGACY_LOGPROBS = 5
MAX_CACHE_SALT = 256
_COMMON_FIELDS = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "timeout",
        # Queueing (vLLM's priority: lower runs first; modelpool's bound on the wait).
        "priority",
        "max_queue_time_s",
        # Structured outputs (modelpool.shared.structured): OpenAI's, and vLLM's extensions.
        "response_format",
        "structured_outputs",
        *GUIDED_FIELDS,
        "ignore_eos",
        # vLLM's (PR #17045): the prefix-cache partition within the tenant's own.
        "cache_salt",
    }
)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    # Reasoning models (modelpool.shared.reasoning.controls): vLLM's.
    "thinking_token_budget",
    "chat_template_kwargs",
}
# Chat roles; "developer" is OpenAI's newer name for "system" and is passed on as such;
# "tool" (and the legacy "function") carry a tool's result (see modelpool.shared.tools).
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# The message keys each role may carry beside role and content.
_MESSAGE_KEYS: dict[str, frozenset[str]] = {
    "assistant": frozenset({"name", "tool_calls", "function_call", "refusal"}),
    "tool": frozenset({"tool_call_id", "name"}),
    "function": frozenset({"name"}),
}


# --------------------------------------------------------------------------------------------
# Request parsing


def _common_params(body: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {**_penalty_params(body), **structured_params(body)}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    else:
        # No maximum: what the context leaves after the prompt (a model's configured
        # generation_defaults.max_new_tokens still caps it), as OpenAI's and vLLM's
        # servers answer; the request's deadline bounds it.
        params[FIT_PARAM] = True
    # vLLM's extension, which load generators use to fix the output length: end-of-sequence
    # is not chosen before this many tokens (a stop string still ends the text).
    min_tokens = opt_int(body, "min_tokens", 0)
    if min_tokens:
        if max_tokens is not None and min_tokens > max_tokens:
            raise invalid(
                f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})", "min_tokens"
            )
        params["min_new_tokens"] = min_tokens
    # vLLM's too (guidellm and genai-perf send it): generate past end-of-sequence up to
    # max_tokens, so that every answer has the length the benchmark asked for.
    if opt_bool(body, "ignore_eos"):
        params["ignore_eos"] = True
    temperature = opt_number(body, "temperature")
    if temperature is not None:
        if temperature < 0:
            raise invalid(f"temperature must be >= 0, got {temperature!r}", param="temperature")
        params["temperature"] = temperature
    top_p = opt_number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
        params["top_p"] = top_p
    # vLLM's extension; -1 is its older spelling of 0, off (every token is a candidate).
    top_k = opt_int(body, "top_k", -1)
    if top_k is not None:
        params["top_k"] = max(top_k, 0)
    seed = opt_int(body, "seed", 0)
    if seed is not None:
        params["seed"] = seed
    priority = parse_priority(body)
    if priority is not None:
        params["priority"] = priority
    max_queue_time_s = opt_number(body, "max_queue_time_s")
    if max_queue_time_s is not None:
        if max_queue_time_s <= 0:
            raise invalid(
                f"max_queue_time_s must be a number > 0, got {max_queue_time_s!r}",
                param="max_queue_time_s",
            )
        params["max_queue_time_s"] = max_queue_time_s
    stop = body.get("stop")
    if isinstance(stop, str):
        if not stop:
            raise invalid("stop must not be an empty string", param="stop")
        params["stop"] = [stop]
    elif isinstance(stop, list):
        for index, item in enumerate(stop):
            if not isinstance(item, str) or not item:
                raise invalid(f"stop[{index}] must be a non-empty string", param="stop")
        if stop:
            params["stop"] = list(stop)
    elif stop is not None:
        raise invalid("stop must be a string or a list of strings", param="stop")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT:
            raise invalid(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters",
                param="cache_salt",
            )
        # The client's part only: the daemon puts it in the tenant's partition (app.py).
        params["cache_salt"] = salt
    return params


def _penalty_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """``presence_penalty``, ``frequency_penalty`` (numbers in [-2, 2]) and ``logit_bias``
    (token id strings -> biases in [-100, 100]) as the pool's kwargs; zeros are left out."""
    params: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = opt_number(body, name)
        if value is not None and abs(value) > MAX_PENALTY:
            raise invalid(
                f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}", name
            )
        if value:
            params[name] = value
    bias = body.get("logit_bias")
    if bias is None:
        return params
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid(
            f"logit_bias must be an object of at most {MAX_LOGIT_BIAS_TOKENS} token ids",
            "logit_bias",
        )
    by_token: dict[int, float] = {}
    for token, value in bias.items():
        if not token.isdecimal() or not is_int(int(token), minimum=0):
            raise invalid(
                f"logit_bias keys must be token ids (decimal integers >= 0), got {token!r}",
                "logit_bias",
            )
        if not is_number(value) or abs(value) > MAX_LOGIT_BIAS:
            raise invalid(
                f"logit_bias[{token!r}] must be a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}",
                "logit_bias",
            )
        by_token[int(token)] = float(value)
    if by_token:
        params["logit_bias"] = by_token
    return params


def structured_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """``{"grammar": ...}`` for a body that asks for structured output, else ``{}``; a
    constraint the grammar engine cannot honour is a 400 whose ``param`` points at it."""
    try:
        grammar = grammar_for_body(body)
    except SchemaTooComplex as exc:
        raise too_complex(exc) from exc
    except GrammarError as exc:
        raise invalid(exc.message, param=exc.param, code="unsupported_value") from exc
    return {} if grammar is None else {"grammar": grammar}


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = bool(opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid(
                "stream_options is only allowed with stream: true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", param="stream_options")
        for key, value in options.items():
            # continuous_usage_stats (vLLM's): usage on every chunk, as benchmarks read it.
            unsupported_unless(
                key in ("include_usage", "continuous_usage_stats") and isinstance(value, bool),
                f"stream_options.{key}",
                "not supported when streaming",
            )
    return stream


def _include_usage(body: Mapping[str, Any], key: str = "include_usage") -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get(key) is True


def _choice_count(body: Mapping[str, Any], prompts: int) -> tuple[int, int]:
    """``n`` and ``best_of`` (1 when absent), checked against the number of prompts."""
    n = opt_int(body, "n", 1) or 1
    best_of = opt_int(body, "best_of", 1) or n
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if prompts * best_of > MAX_CHOICES:
        name = "best_of" if best_of > n else "n"
        raise invalid(
            f"{name}: at most {MAX_CHOICES} generations per request "
            f"({prompts} prompt(s) x {best_of})",
            param=name,
        )
    return n, best_of


def token_prompt(value: list[Any], where: str) -> TokenIds:
    if not value:
        raise invalid(f"{where} must not be an empty list of token ids", param="prompt")
    for index, token_id in enumerate(value):
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise invalid(
                f"{where}[{index}] must be a token id (an integer >= 0), got {token_id!r}",
                param="prompt",
            )
    return TokenIds(tuple(value))


def _completion_prompts(value: object) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, list) for item in value):
            return [token_prompt(item, f"prompt[{index}]") for index, item in enumerate(value)]
        if not any(isinstance(item, (str, list)) for item in value):
            return [token_prompt(value, "prompt")]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
        param="prompt",
    )


def parse_completion(body: Mapping[str, Any]) -> Job:
    check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise invalid("missing field 'prompt'", param="prompt", code="missing_field")
    prompts = _completion_prompts(body["prompt"])
    suffix = body.get("suffix")
    unsupported_unless(suffix in (None, ""), "suffix", "insertion is not supported")
    echo = bool(opt_bool(body, "echo"))
    logprobs = opt_int(body, "logprobs", 0)
    if logprobs is not None and logprobs > MAX_LEGACY_LOGPROBS:
        raise invalid(
            f"logprobs must be <= {MAX_LEGACY_LOGPROBS}, got {logprobs}", param="logprobs"
        )
    max_tokens = opt_int(body, "max_tokens", 0)
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens 0 only makes sense with echo (scoring the prompt)", "max_tokens")
    params = _common_params(body, max_tokens)
    if logprobs is not None:
        params["logprobs"] = logprobs
        if echo:
            params["prompt_logprobs"] = logprobs
    if max_tokens == 0:
        params.setdefault("prompt_logprobs", 0)
    stream = _stream_flag(body)
    n, best_of = _choice_count(body, len(prompts))
    if stream and best_of > n:
        raise invalid("best_of > n cannot be streamed", param="best_of")
    if stream and echo and any(isinstance(prompt, TokenIds) for prompt in prompts):
        raise invalid(
            "echo with a token-id prompt cannot be streamed (the text of the tokens is known "
            "only at the end); send stream: false",
            param="echo",
            code="unsupported_value",
        )
    return Job(
        prompts,
        params,
        n=n,
        best_of=best_of,
        stream=stream,
        include_usage=_include_usage(body),
        continuous_usage=_include_usage(body, "continuous_usage_stats"),
        logprobs=logprobs,
        echo=echo,
    )


def message_content(content: object, index: int) -> str | list[dict[str, Any]]:
    """A message's content: its text, or, when it carries images, its text and image
    parts in order (``shared.images``; ``image_url`` parts as data URLs, or http(s) URLs
    left pending for the daemon's host rule, ``server.images``)."""
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(content):
            part_where = f"{where}[{part_index}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"{part_where} must be an object with a 'type'", param=part_where)
            if part["type"] == "image_url":
                parts.append(_image_url_part(part, part_where))
            elif part["type"] == "image" and ("data" in part or "url" in part):
                parts.append(part)  # another family's image, in the pool's form already
            elif part["type"] != "text":
                raise invalid(
                    f"{part_where}: content of type {part['type']!r} is not supported "
                    "(text and image_url are)",
                    param=part_where,
                    code="unsupported_value",
                )
            elif not isinstance(part.get("text"), str):
                raise invalid(f"{part_where}.text must be a string", param=part_where)
            else:
                parts.append({"type": "text", "text": part["text"]})
        if any(part["type"] == "image" for part in parts):
            return parts
        return "\n".join(part["text"] for part in parts)
    raise invalid(f"{where} must be a string or a list of text and image parts", param=where)


def _image_url_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """OpenAI's ``{"type": "image_url", "image_url": {"url", "detail"}}`` (the URL alone
    as a string is taken too); ``detail`` is accepted and left to the model's processor."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if isinstance(image_url, dict):
        detail = image_url.get("detail")
        if detail not in (None, "auto", "low", "high"):
            raise invalid(
                f"{where}.image_url.detail must be 'auto', 'low' or 'high', got {detail!r}",
                param=f"{where}.image_url.detail",
            )
    if url is None:
        raise ImageRefused(
            f"{where}: missing image_url.url", part=where, reason="invalid_image_url"
        )
    return image_from_url(url, where)


def parse_chat(body: Mapping[str, Any]) -> Job:
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if "messages" not in body:
        raise invalid("missing field 'messages'", param="messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    prompt: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role must be a string", param=f"{where}.role")
        if role not in _CHAT_ROLES:
            raise invalid(
                f"{where}.role {role!r} is not supported "
                f"(supported: {', '.join(sorted(_CHAT_ROLES))})",
                param=f"{where}.role",
                code="unsupported_value",
            )
        for key in message:
            if key not in ("role", "content", "name") and key not in _MESSAGE_KEYS.get(role, ()):
                raise invalid(
                    f"{where}.{key} is not supported",
                    param=f"{where}.{key}",
                    code="unsupported_field",
                )
        prompt.append(_chat_message(message, role, index))
    fill_result_names(prompt)
    plan = _tool_plan(body)
    modalities = body.get("modalities")
    unsupported_unless(
        modalities is None or modalities == ["text"], "modalities", "only text output is supported"
    )
    for name in ("audio", "prediction", "web_search_options"):
        unsupported_unless(body.get(name) is None, name, "not supported by this server")
    wants_logprobs = bool(opt_bool(body, "logprobs"))
    top_logprobs = opt_int(body, "top_logprobs", 0)
    if top_logprobs is not None:
        if not wants_logprobs:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs must be <= {MAX_TOP_LOGPROBS}, got {top_logprobs}",
                param="top_logprobs",
            )
    logprobs = (top_logprobs or 0) if wants_logprobs else None

    max_tokens = opt_int(body, "max_tokens", 1)
    max_completion = opt_int(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise invalid(
            "max_tokens and max_completion_tokens disagree", param="max_completion_tokens"
        )
    params = _common_params(body, max_completion if max_tokens is None else max_tokens)
    if logprobs is not None:
        params["logprobs"] = logprobs
    try:
        params.update(chat_controls(body))
    except ControlError as exc:
        raise invalid(str(exc), param=exc.param) from None
    if plan is not None and plan.choice != "none":
        if "grammar" in params:
            raise invalid(
                "response_format (or a guided field) and tool calling cannot both constrain "
                "one answer: send tool_choice 'none' or no response_format",
                param="response_format",
                code="unsupported_value",
            )
        params.update(plan.pool_params())
    n, _ = _choice_count({"n": body.get("n")}, 1)
    return Job(
        [prompt],
        params,
        n=n,
        stream=_stream_flag(body),
        include_usage=_include_usage(body),
        continuous_usage=_include_usage(body, "continuous_usage_stats"),
        logprobs=logprobs,
        chat=True,
        tools=plan,
    )


def _chat_message(message: Mapping[str, Any], role: str, index: int) -> dict[str, Any]:
    """One message in the pool's form; tool calls and results through ``modelpool.shared.tools``."""
    content = message.get("content")
    where = f"messages[{index}]"
    calls = "tool_calls" in message or "function_call" in message
    if content is None and role == "assistant" and calls:
        content = ""  # OpenAI's null content beside the calls
    text = message_content(content, index)
    if isinstance(text, list) and role not in ("user", "tool"):
        raise invalid(
            f"{where}.content: images are read in user messages and tool results only",
            param=f"{where}.content",
            code="unsupported_value",
        )
    try:
        converted = chat_message(message, where, text)
    except ToolRequestError as exc:
        raise invalid(str(exc), param=exc.param) from None
    if converted is not None:
        return converted
    return {"role": "system" if role == "developer" else role, "content": text}


def _tool_plan(body: Mapping[str, Any]) -> ToolPlan | None:
    """``tools``/``tool_choice``/``parallel_tool_calls`` (or ``functions``/``function_call``)."""
    try:
        return parse_tool_request(body)
    except ToolRequestError as exc:
        raise invalid(str(exc), param=exc.param) from None
    except SchemaTooComplex as exc:
        raise too_complex(exc) from exc


def too_complex(error: SchemaTooComplex) -> ApiError:
    """400 ``schema_too_complex``, naming the bound passed (``bound``)."""
    return ApiError(
        400,
        error.message,
        code="schema_too_complex",
        param=error.param,
        extra={"bound": error.bound},
    )
