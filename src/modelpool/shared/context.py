"""The model's context length: where a worker learns it, and the per-request check.

A request fits when its prompt tokens plus the new tokens it may generate are
at most ``max_model_len``. The check needs the prompt's token count, so it
runs in the worker, after the backend has tokenised (chat messages after their
template), and costs two comparisons there; the pool never tokenises::

    max_model_len = context_length(model.config, override=options.get("max_model_len"))
    new_tokens = fit_to_context(len(input_ids), requested, max_model_len, default=128)

A batched backend calls :func:`fit_to_context` once per row. Import-free, so
that any backend (and the supervisor) can use it without pulling in torch.
"""

from __future__ import annotations

import logging
from typing import Any

from modelpool.shared.errors import ContextLengthExceeded

logger = logging.getLogger(__name__)

# Where model configs keep their context length, in the order vLLM reads them; the
# smallest present wins (a config may carry both a position table and a shorter limit).
CONFIG_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def fit_to_context(
    prompt_tokens: int, max_new_tokens: int | None, max_model_len: int | None, *, default: int
) -> int:
    """How many new tokens one request may generate; raises if not even what it asked fits.

    ``max_new_tokens`` is what the caller asked for, or None when it asked for
    nothing: then ``default`` applies, cut down to what the context leaves (the
    result then ends with finish_reason "length", as OpenAI's does)::

        fit_to_context(100, 20, 128, default=64)     # 20
        fit_to_context(100, None, 128, default=64)   # 28: the default, capped
        fit_to_context(100, 40, 128, default=64)     # ContextLengthExceeded: 140 > 128
        fit_to_context(128, None, 128, default=64)   # ContextLengthExceeded: no room at all

    ``max_model_len`` None means the limit is unknown, and nothing is checked.
    """
    if max_model_len is None:
        return default if max_new_tokens is None else max_new_tokens
    if max_new_tokens is None:
        room = max_model_len - prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                prompt_tokens=prompt_tokens, max_new_tokens=None, max_model_len=max_model_len
            )
        return min(default, room)
    if prompt_tokens + max_new_tokens > max_model_len:
        raise ContextLengthExceeded(
            prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, max_model_len=max_model_len
        )
    return max_new_tokens


def check_max_model_len(value: object, where: str = "max_model_len") -> int | None:
    """A context length is a positive integer, or None for "unknown"."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    return value


def context_length(config: Any, override: object = None) -> int | None:
    """The context length of a model from its (transformers) ``config``, or ``override``.

    The override is for a config that is wrong, or to bound the memory a long
    request may take; one above what the config says is allowed (a model whose
    config understates it) but logged, since positions past the model's table
    give garbage or an index error.
    """
    limit = check_max_model_len(override)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [
        value
        for key in CONFIG_KEYS
        if isinstance(value := getattr(text_config, key, None), int)
        and not isinstance(value, bool)
        and value > 0
    ]
    from_config = min(found) if found else None
    if limit is None:
        return from_config
    if from_config is not None and limit > from_config:
        logger.warning(
            "max_model_len=%d is above the model config's %d: requests past %d tokens may "
            "give garbage",
            limit,
            from_config,
            from_config,
        )
    return limit
