"""Checks the pool applies to every request before anything is dispatched."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from modelpool.shared.errors import ImageRefused, InvalidRequest
from modelpool.shared.images import IMAGE_MEDIA_TYPES
from modelpool.shared.prefixes import CACHE_SALT_PARAM, MAX_CACHE_SALT_CHARS
from modelpool.shared.protocol import MAX_TOP_LOGPROBS, Prompt, TokenIds
from modelpool.shared.reasoning.controls import check_thinking_params

# The widest integer any backend is asked to take (a C int64: torch, numpy, CUDA); a
# larger one would fail inside a worker, or with OverflowError, instead of here.
MAX_INT = 2**63 - 1
# OpenAI's ranges for its penalties and its bound on logit_bias's entries.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300


def is_number(value: object) -> bool:
    """A finite int or float, not a bool: what every numeric field accepts.

    An int too large for a float (``10**400``, valid JSON) is not a number here, where
    ``math.isfinite`` would raise ``OverflowError`` instead of answering.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value: object, *, minimum: int, maximum: int = MAX_INT) -> bool:
    """An int (not a bool) in ``[minimum, maximum]``."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def check_generation_params(params: Mapping[str, Any], *, where: str = "") -> None:
    """The backend-independent checks; raises :class:`InvalidRequest`."""
    prefix = f"{where}." if where else ""
    for key in ("logprobs", "prompt_logprobs"):
        if params.get(key) is not None:
            value = params[key]
            if not is_int(value, minimum=0, maximum=MAX_TOP_LOGPROBS):
                raise InvalidRequest(
                    f"{prefix}{key} must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                    f"(alternatives per token), got {value!r}"
                )
    if "max_new_tokens" in params:
        value = params["max_new_tokens"]
        # 0 scores the prompt without generating: only with prompt_logprobs.
        smallest = 0 if params.get("prompt_logprobs") is not None else 1
        if not is_int(value, minimum=smallest):
            raise InvalidRequest(
                f"{prefix}max_new_tokens must be an integer in [{smallest}, {MAX_INT}], "
                f"got {value!r}" + ("" if smallest == 0 else " (0 only with prompt_logprobs)")
            )
    if "seed" in params:
        value = params["seed"]
        if value is not None and not is_int(value, minimum=-MAX_INT - 1):
            raise InvalidRequest(f"{prefix}seed must be a 64-bit integer, got {value!r}")
    if "temperature" in params:
        value = params["temperature"]
        if not is_number(value) or value < 0:
            raise InvalidRequest(f"{prefix}temperature must be a number >= 0, got {value!r}")
    if "top_p" in params:
        value = params["top_p"]
        if not is_number(value) or not 0 < value <= 1:
            raise InvalidRequest(f"{prefix}top_p must be in (0, 1], got {value!r}")
    if FIT_PARAM in params and not isinstance(params[FIT_PARAM], bool):
        raise InvalidRequest(
            f"{prefix}{FIT_PARAM} must be true or false, got {params[FIT_PARAM]!r}"
        )
    check_thinking_params(params, prefix)
    salt = params.get(CACHE_SALT_PARAM)
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS):
        raise InvalidRequest(
            f"{prefix}{CACHE_SALT_PARAM} must be a string of at most {MAX_CACHE_SALT_CHARS} "
            "characters (the prefix cache's partition)"
        )
    if "ignore_eos" in params and not isinstance(params["ignore_eos"], bool):
        raise InvalidRequest(
            f"{prefix}ignore_eos must be true or false, got {params['ignore_eos']!r}"
        )
    _check_penalties(params, prefix)


def _check_penalties(params: Mapping[str, Any], prefix: str) -> None:
    """OpenAI's ranges: penalties in [-2, 2], ``logit_bias`` token id -> bias in [-100, 100]
    (ids as ints or as decimal strings, OpenAI's JSON form)."""
    for key in ("presence_penalty", "frequency_penalty"):
        value = params.get(key)
        if value is not None and (not is_number(value) or abs(value) > MAX_PENALTY):
            raise InvalidRequest(
                f"{prefix}{key} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                f"got {value!r}"
            )
    bias = params.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(
            f"{prefix}logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to biases"
        )
    for token, value in bias.items():
        token_ok = is_int(token, minimum=0) or (
            isinstance(token, str) and token.isdecimal() and is_int(int(token), minimum=0)
        )
        if not token_ok:
            raise InvalidRequest(
                f"{prefix}logit_bias keys must be token ids (integers >= 0), got {token!r}"
            )
        if not is_number(value) or abs(value) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"{prefix}logit_bias[{token!r}] must be a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}"
            )


def check_prompt(prompt: object) -> Prompt:
    """A prompt is a string, a non-empty list of ``{"role", "content"}`` messages (content
    a string or a list of text and image parts, ``shared.images``), or token ids
    (:class:`TokenIds`, or a non-empty list of ints).

    Returns what is sent: the string, a copy of the messages as plain dicts, or the ids as
    a ``TokenIds`` of plain ints, so that a caller's later change to its list, or a type
    only its own process can rebuild, cannot reach a worker.
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, TokenIds):
        return _token_ids(prompt.ids)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise InvalidRequest(
            "prompt must be a string, a non-empty list of chat messages or of token ids, "
            f"got {type(prompt).__name__}"
        )
    if all(isinstance(item, int) for item in prompt):
        return _token_ids(prompt)
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"prompt[{index}] must be a mapping with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"prompt[{index}].role must be a non-empty string")
        copy: dict[str, Any] = {"role": str(role), "content": _content(content, index)}
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                copy[key] = str(message[key])
        if message.get("tool_calls") is not None:
            copy["tool_calls"] = _tool_calls(message["tool_calls"], index)
        messages.append(copy)
    return messages


def _content(content: object, index: int) -> str | list[dict[str, Any]]:
    """A message's content: a string, or a list of text and image parts (``shared.images``)
    copied as plain dicts, the image's bytes as ``bytes`` (immutable: never copied)."""
    if isinstance(content, str):
        return str(content)
    if not isinstance(content, (list, tuple)):
        raise InvalidRequest(
            f"prompt[{index}].content must be a string or a list of text and image parts"
        )
    parts: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        where = f"prompt[{index}].content[{number}]"
        if not isinstance(part, Mapping) or part.get("type") not in ("text", "image"):
            raise InvalidRequest(f"{where} must be a text part or an image part")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.text must be a string")
            parts.append({"type": "text", "text": str(part["text"])})
            continue
        data, media_type = part.get("data"), part.get("media_type")
        if not isinstance(data, (bytes, bytearray, memoryview)) or not data:
            raise ImageRefused(
                f"{where}: an image part's data must be the image file's bytes (a URL is "
                "fetched, or refused, by the daemon before a request reaches the pool)",
                part=where,
                reason="invalid_image",
            )
        if media_type not in IMAGE_MEDIA_TYPES:
            raise ImageRefused(
                f"{where}: media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}, "
                f"got {media_type!r}",
                part=where,
                reason="unsupported_media_type",
            )
        parts.append({"type": "image", "data": bytes(data), "media_type": str(media_type)})
    return parts


def _tool_calls(calls: object, index: int) -> list[dict[str, Any]]:
    """An assistant message's calls: ``[{"id", "type", "function": {"name", "arguments"}}]``
    with the arguments as a JSON object (what chat templates print), copied as JSON."""
    where = f"prompt[{index}].tool_calls"
    try:
        copied = json.loads(json.dumps(calls))
    except (TypeError, ValueError):
        raise InvalidRequest(f"{where} must be JSON data") from None
    if not isinstance(copied, list):
        raise InvalidRequest(f"{where} must be a list")
    for call in copied:
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), dict)
        ):
            raise InvalidRequest(
                f"{where}: each call must be {{'function': {{'name': str, 'arguments': dict}}}}"
            )
    return copied


def _token_ids(ids: object) -> TokenIds:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidRequest("a token-id prompt must hold at least one id")
    for index, token_id in enumerate(ids):
        if not is_int(token_id, minimum=0):
            raise InvalidRequest(
                f"prompt[{index}] must be a token id (an integer >= 0), got {token_id!r}"
            )
    return TokenIds(tuple(int(token_id) for token_id in ids))


def check_deadline(deadline_s: object) -> None:
    if not is_number(deadline_s) or deadline_s <= 0:  # type: ignore[operator]
        raise InvalidRequest(f"deadline_s must be a number > 0, got {deadline_s!r}")


# A W3C trace context (https://www.w3.org/TR/trace-context/): version-traceid-spanid-flags.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
# Priorities as vLLM takes them: any integer; bounded so that no sort key overflows a C long.
MAX_PRIORITY = 2**31 - 1
FIT_PARAM = "fit_to_context"
"""A request parameter: true cuts ``max_new_tokens`` to what the context leaves after the
prompt (finish_reason "length" there) instead of refusing it, and a request that asks
for no maximum gets all of that room instead of the worker's own default. The daemon
sets it for every request that sets no maximum, and on ``/v1/messages`` unless the
model's ``generation_defaults`` choose otherwise (see ``server.anthropic.api``)."""

PRIORITY_PARAM = "priority"
"""The request parameter a worker's scheduler reads a request's priority from (the pool
sets it when it is not 0): lower takes the next free row and the prefill budget first."""

PROMOTED_AT_PARAM = "promoted_at"
"""The request parameter a batched worker's scheduler reads when a request is promoted
ahead of every other from (``time.monotonic()``, the machine's clock, the same in every
process): the pool of a batched worker (``max_batch_size`` above 1) sets it on every
request, and a caller's own value is dropped."""


def valid_traceparent(value: object) -> bool:
    """A W3C ``traceparent`` this pool can continue (version ff, all-zero ids: not)."""
    if not isinstance(value, str):
        return False
    match = _TRACEPARENT.match(value)
    return (
        match is not None
        and match.group(1) != "ff"
        and set(match.group(2)) != {"0"}
        and set(match.group(3)) != {"0"}
    )


class QueueParams(NamedTuple):
    """A request's queueing keywords, checked (:func:`check_queue_params`)."""

    priority: int
    max_queue_time_s: float | None
    traceparent: str | None
    admitted: bool


def check_queue_params(params: dict[str, Any]) -> QueueParams:
    """Pop and check the queueing keywords of a request: ``priority`` (an int, lower runs
    first, default 0), ``max_queue_time_s`` (a number > 0, or ``math.inf`` for no bound;
    None: the pool's), ``traceparent`` (a W3C trace context string) and ``admitted``
    (a bool: its caller judged its predicted wait already and accepted it)."""
    priority = params.pop("priority", 0)
    if priority is None:
        priority = 0
    if not is_int(priority, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY):
        raise InvalidRequest(
            f"priority must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}] (lower runs "
            f"first), got {priority!r}"
        )
    max_queue_time_s = params.pop("max_queue_time_s", None)
    if max_queue_time_s is not None and not (
        max_queue_time_s == math.inf or (is_number(max_queue_time_s) and max_queue_time_s > 0)
    ):
        raise InvalidRequest(f"max_queue_time_s must be a number > 0, got {max_queue_time_s!r}")
    traceparent = params.pop("traceparent", None)
    if traceparent is not None and not valid_traceparent(traceparent):
        raise InvalidRequest(f"traceparent must be a W3C trace context, got {traceparent!r}")
    admitted = params.pop("admitted", False)
    if not isinstance(admitted, bool):
        raise InvalidRequest(f"admitted must be true or false, got {admitted!r}")
    return QueueParams(
        priority,
        None if max_queue_time_s is None else float(max_queue_time_s),
        traceparent,
        admitted,
    )


# The keywords of a request that say how it queues, not what it computes.
QUEUE_KEYWORDS = frozenset({"priority", "max_queue_time_s", "traceparent", "admitted"})


def pooling_queue_params(priority: int, keywords: Mapping[str, Any]) -> dict[str, Any]:
    """An embedding's or a score's queueing keywords (``check_queue_params`` checks their
    values) with its ``priority``; a ``TypeError`` for any other keyword, as an unknown
    keyword argument would be: such a request has no generation parameters to take."""
    unknown = sorted(set(keywords) - QUEUE_KEYWORDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    return {**keywords, "priority": priority}
