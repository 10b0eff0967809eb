"""A reasoning model's thinking apart from its answer, for every API family.

A worker returns a reasoning model's text in the canonical form
``<think>THINKING</think>ANSWER`` (``shared.reasoning``). The generation walk splits it
once, here, for whatever family answers: a whole :class:`Result` gets the answer as its
``text`` and the thinking as its ``reasoning`` (:func:`split_result`); a stream's chunks
are split as they come (``streaming``, by a ``ReturnedTextParser``), so no family ever sends
thinking as content. A pool whose ``reasoning_parser`` is "none" is not split.

The marker of a forced close (the worker closed thinking at a bound) is the result's
``thinking_closed``; :data:`CLOSED_HEADER` carries it on a whole answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from modelpool.server.http import invalid
from modelpool.shared.reasoning.controls import DEADLINE_PARAM, ControlError
from modelpool.shared.reasoning.parsers import split_reasoning

if TYPE_CHECKING:
    from modelpool.supervisor.results import Result

CLOSED_HEADER = "x-modelpool-thinking-closed"
"""Response header: why the worker closed a choice's thinking ("budget", "reserve",
"loop", "deadline"), comma-separated for several choices; absent when none was."""
_BUILTIN_BACKENDS = frozenset({"auto", "hf", "llama_cpp", "testing"})


def splits(parser: str) -> bool:
    """Whether a pool with this ``reasoning_parser`` has its answers split."""
    return parser != "none"


def split_result(result: Result) -> Result:
    """``result`` with its thinking taken out of ``text`` into ``reasoning``."""
    reasoning, answer = split_reasoning(result.text)
    if reasoning is None:
        return result
    return dataclasses.replace(result, text=answer, reasoning=reasoning)


def closed_header(results: Mapping[int, Result]) -> dict[str, str]:
    """The forced-close header of a whole answer, when a choice's thinking was closed."""
    reasons = [r.thinking_closed for _, r in sorted(results.items()) if r.thinking_closed]
    return {CLOSED_HEADER: ",".join(reasons)} if reasons else {}


def with_deadline(params: dict[str, Any], backend: str, deadline_at: float) -> None:
    """Give a request on a built-in backend its deadline (``time.time()``), which the
    worker closes thinking by; a custom backend is sent no name it may not know."""
    if backend in _BUILTIN_BACKENDS:
        params.setdefault(DEADLINE_PARAM, deadline_at)


def reasoning_delta(reasoning: str) -> dict[str, str]:
    """Chat's thinking, under both names clients read (vLLM's ``reasoning_content`` and
    the newer ``reasoning``)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def chat_reasoning(message: dict[str, Any], choice: dict[str, Any], result: Result) -> None:
    """A whole chat answer's thinking on its ``message``, and the forced-close marker on
    its ``choice``."""
    if result.reasoning is not None:
        message.update(reasoning_delta(result.reasoning))
    if result.thinking_closed is not None:
        choice["thinking_closed"] = result.thinking_closed


def apply_controls(
    params: dict[str, Any], read: Callable[[object], dict[str, Any]], value: object
) -> None:
    """Add the thinking controls ``read`` finds in a request's ``value`` to its pool
    ``params``; a bad one is a 400 naming its field."""
    try:
        params.update(read(value))
    except ControlError as exc:
        raise invalid(str(exc), param=exc.param) from None
