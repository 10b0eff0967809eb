"""The generation parameters every backend takes, their validation, and what a request's
``max_new_tokens`` becomes once fitted to the context.

Cheap and import-free: the supervisor validates a request's parameters (through a
backend's ``validate``) before dispatch, so nothing here imports torch or numpy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from modelpool.shared.context import fit_to_context
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.grammar import COMPILE_TIMEOUT_PARAM, GRAMMAR_PARAM, check_grammar_params
from modelpool.shared.lora import LORA_PARAM, lora_ref
from modelpool.shared.prefixes import CACHE_SALT_PARAM
from modelpool.shared.protocol import Call
from modelpool.shared.reasoning.controls import THINKING_PARAMS
from modelpool.shared.tools import check_template_tools
from modelpool.shared.validation import (
    FIT_PARAM,
    MAX_INT,
    PRIORITY_PARAM,
    PROMOTED_AT_PARAM,
    check_generation_params,
    is_int,
    is_number,
)
from modelpool.worker.backends.common.penalties import PENALTY_PARAMS
from modelpool.worker.backends.common.text import stop_strings

THREADS_ENV = "MODELPOOL_TORCH_THREADS"
"""CPU threads for a worker when the backend's own threads option is not given (the pool
sets it per worker)."""

# New tokens for a request that asks for no maximum and does not ask to fit the context
# (FIT_PARAM): a library call's default, as transformers' and vLLM's own generate() cap
# theirs; the daemon's requests fit the context instead, as OpenAI's servers answer.
DEFAULT_MAX_NEW_TOKENS = 128

GENERATION_PARAMS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "do_sample",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "stop",
        "seed",
        "logprobs",
        "prompt_logprobs",
        *PENALTY_PARAMS,
        "tools",
        GRAMMAR_PARAM,
        COMPILE_TIMEOUT_PARAM,
        "ignore_eos",
        PRIORITY_PARAM,
        LORA_PARAM,
        PROMOTED_AT_PARAM,
        CACHE_SALT_PARAM,
        FIT_PARAM,
        *THINKING_PARAMS,
    }
)


def validate(params: Mapping[str, Any], backend: str) -> None:
    """Reject generation parameters the backends do not take, or take with other types;
    ``backend`` names the backend in the message::

        validate({"max_new_tokens": 32, "stop": ["\\n\\n"]}, "hf")   # fine
        validate({"max_tokens": 32}, "hf")                           # InvalidRequest
    """
    unknown = sorted(set(params) - GENERATION_PARAMS)
    if unknown:
        raise InvalidRequest(
            f"unknown generation parameter(s) for the {backend} backend: {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(GENERATION_PARAMS))}"
        )
    check_generation_params(params)
    for key in ("min_new_tokens", "top_k", "no_repeat_ngram_size"):
        if key in params:
            _check_int(key, params[key], minimum=0)
    if "seed" in params:
        _check_int("seed", params["seed"], minimum=0)
    if "do_sample" in params and not isinstance(params["do_sample"], bool):
        raise InvalidRequest(f"do_sample must be true or false, got {params['do_sample']!r}")
    if "repetition_penalty" in params:
        value = params["repetition_penalty"]
        if not is_number(value) or value <= 0:
            raise InvalidRequest(f"repetition_penalty must be a number > 0, got {value!r}")
    if params.get("min_new_tokens", 0) > params.get("max_new_tokens", math.inf):
        raise InvalidRequest("min_new_tokens must not exceed max_new_tokens")
    if params.get("do_sample") is True and params.get("temperature") == 0:
        raise InvalidRequest("do_sample=true needs a temperature > 0 (temperature 0 means greedy)")
    if "stop" in params:
        stop_strings(params["stop"])
    check_grammar_params(params)
    lora_ref(params)
    if params.get("tools") is not None:
        check_template_tools(params["tools"])


def fit_new_tokens(
    call: Call, params: Mapping[str, Any], prompt_tokens: int, max_model_len: int | None
) -> int:
    """This request's ``max_new_tokens``, fitted to the context; raises
    ``ContextLengthExceeded`` if it cannot fit (see :func:`requested_new_tokens`)."""
    asked, default = requested_new_tokens(call, params, max_model_len)
    new_tokens = fit_to_context(prompt_tokens, asked, max_model_len, default=default)
    if params.get("min_new_tokens", 0) > new_tokens:
        # The caller insists on more than the capped default: refused if that cannot fit.
        fit_to_context(prompt_tokens, params["min_new_tokens"], max_model_len, default=0)
    return new_tokens


def requested_new_tokens(
    call: Call, params: Mapping[str, Any], max_model_len: int | None
) -> tuple[int | None, int]:
    """(what the request demands, the ceiling otherwise) for ``fit_to_context``: a
    ``max_new_tokens`` the pool filled in (``call.defaulted``), or any with ``FIT_PARAM``,
    is a ceiling cut down to what the context leaves; none at all is
    ``DEFAULT_MAX_NEW_TOKENS``, or with ``FIT_PARAM`` the whole room the context leaves."""
    asked = params.get("max_new_tokens")
    fit = params.get(FIT_PARAM) is True
    if asked is not None and (fit or "max_new_tokens" in getattr(call, "defaulted", ())):
        return None, asked
    if asked is None and fit and max_model_len is not None:
        return None, max_model_len
    return asked, DEFAULT_MAX_NEW_TOKENS


def check_vocabulary(token_ids: Sequence[int], vocab_size: int) -> None:
    """InvalidRequest naming the first of ``token_ids`` outside ids 0 to vocab_size - 1."""
    outside = [token for token in token_ids if not 0 <= token < vocab_size]
    if outside:
        raise InvalidRequest(
            f"token id {outside[0]} is outside this model's vocabulary (ids 0 to {vocab_size - 1})"
        )


def check_load_options(options: Mapping[str, Any], allowed: frozenset[str], backend: str) -> None:
    """ValueError naming the load options ``backend`` does not take, and those it does."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"unknown option(s) for the {backend} backend: {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )


def chat_template_option(options: Mapping[str, Any]) -> str | None:
    """The ``chat_template`` load option (a Jinja template replacing the model's), checked."""
    chat_template = options.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a Jinja template string")
    return chat_template


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1 (a load option), else ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def threads_from_env() -> int | None:
    """``$MODELPOOL_TORCH_THREADS`` as a thread count, None when it is unset or empty."""
    from_env = os.environ.get(THREADS_ENV, "").strip()
    if not from_env:
        return None
    if not from_env.isdigit() or int(from_env) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {from_env!r}")
    return int(from_env)


def _check_int(key: str, value: object, *, minimum: int, maximum: int = MAX_INT) -> None:
    if not is_int(value, minimum=minimum, maximum=maximum):
        raise InvalidRequest(f"{key} must be an integer in [{minimum}, {maximum}], got {value!r}")
