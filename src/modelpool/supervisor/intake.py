"""A request's checks on the caller's thread, before the pool queues it.

Everything a caller gets wrong is refused here, as a typed ``InvalidRequest`` (or
``DeadlineExceeded`` for a deadline past), before the dispatcher sees the request: its
prompt, deadline, queueing keywords (``priority``, ``max_queue_time_s``, ``traceparent``,
``admitted``), its grammar (compiled bounded, ``shared.structured``), its generation
parameters against the pool's rules and its backend's light ``validate``. What the pool
needs of it follows from the checked parameters: its prefix fingerprints (placement),
its size (admission, ``scheduling.sizes``) and whether a rerun gives the same text
(preemption)::

    checked = check_request(prompt, deadline_s, kwargs, config, backend_validator("hf"))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from modelpool.scheduling.sizes import RunSize, size_of
from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import ImageRefused, InvalidRequest
from modelpool.shared.image_input import check_image_limits
from modelpool.shared.images import model_reads_images
from modelpool.shared.lora import with_request_lora
from modelpool.shared.prefixes import partition_of, prompt_fingerprints
from modelpool.shared.protocol import (
    DetokenizeRequest,
    EmbedRequest,
    PoolingRequest,
    Prompt,
    ScoreRequest,
    TokenizeRequest,
)
from modelpool.shared.structured import constrain
from modelpool.shared.validation import (
    PRIORITY_PARAM,
    PROMOTED_AT_PARAM,
    QueueParams,
    check_deadline,
    check_generation_params,
    check_prompt,
    check_queue_params,
)
from modelpool.worker.backends import resolve_backend

NOT_GENERATIONS = (TokenizeRequest, DetokenizeRequest, EmbedRequest, ScoreRequest)

Validator = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Checked:
    """A request that passed its checks: what the pool queues and sends of it."""

    prompt: Prompt | TokenizeRequest | DetokenizeRequest | PoolingRequest
    generation: bool
    deadline_s: float
    gen_kwargs: dict[str, Any]  # the caller's own params, as the worker gets them
    queue: QueueParams
    fingerprints: tuple[int, ...]
    size: RunSize
    reproducible: bool


def check_request(
    prompt: Prompt | TokenizeRequest | DetokenizeRequest | PoolingRequest,
    deadline_s: float | None,
    gen_kwargs: Mapping[str, Any],
    config: PoolConfig,
    backend_validate: Validator | None,
) -> Checked:
    """Check a request (see the module docstring); ``deadline_s`` None: the pool's."""
    generation = not isinstance(prompt, NOT_GENERATIONS)
    if generation:
        prompt = check_prompt(prompt)
        _check_images(prompt, config)
    if deadline_s is None:
        deadline_s = config.deadline_s
    else:
        check_deadline(deadline_s)
    kwargs = with_request_lora(gen_kwargs)  # the daemon's adapter for it (shared.lora)
    queue = check_queue_params(kwargs)
    kwargs.pop(PROMOTED_AT_PARAM, None)  # the pool's to set, not a caller's
    if queue.priority:
        kwargs[PRIORITY_PARAM] = queue.priority  # for the worker's scheduler too
    kwargs = constrain(kwargs, config.grammar_compile_timeout_s)
    params = {**config.generation_defaults, **kwargs}
    check_generation_params(params)
    if backend_validate is not None:
        try:
            backend_validate(params)
        except InvalidRequest:
            raise
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(str(exc)) from exc
    fingerprints: tuple[int, ...] = ()
    if not isinstance(prompt, NOT_GENERATIONS):
        # In the request's partition of the workers' prefix caches (cache_salt, adapter).
        fingerprints = prompt_fingerprints(prompt, partition_of(params))
    # A generation's only: an embedding's params are the pool's defaults, unused.
    max_new_tokens = params.get("max_new_tokens") if generation else None
    return Checked(
        prompt=prompt,
        generation=generation,
        deadline_s=deadline_s,
        gen_kwargs=kwargs,
        queue=queue,
        fingerprints=fingerprints,
        size=size_of(prompt, max_new_tokens),
        reproducible=_reproducible(params),
    )


def _check_images(prompt: Prompt, config: PoolConfig) -> None:
    """The image checks that need no decoding (count, encoded bytes: ``image_limits``),
    and a model that reads none refuses them: the daemon replaces them with a note first
    when its ``unsupported_images`` says so (``server.images``)."""
    if check_image_limits(prompt, config.image_limits, "prompt") and not model_reads_images(
        config.backend, config.model, config.backend_options
    ):
        raise ImageRefused(
            f"{config.model!r} reads no images (a text-only model); send text only",
            part="prompt",
            reason="model_not_multimodal",
        )


def backend_validator(backend: str) -> Validator | None:
    """The backend module's light ``validate(params)``, if it has one (see the README: Backends)."""
    module_name = resolve_backend(backend).partition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if backend in ("hf", "llama_cpp", "testing"):
            raise
        return None  # A custom backend may only be importable inside a worker.
    validate: Validator | None = getattr(module, "validate", None)
    return validate


def _reproducible(params: Mapping[str, Any]) -> bool:
    """Would running the request again give the same text: greedy decoding (the backends'
    rule: sampling with ``do_sample``, else with a temperature above 0), or a seed."""
    sampled = params.get("do_sample", (params.get("temperature") or 0) > 0)
    return not sampled or params.get("seed") is not None
