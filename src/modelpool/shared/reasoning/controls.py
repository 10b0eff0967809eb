"""The request fields that control thinking, read into the worker params every backend
understands, and the per-model effort budgets.

Worker params (set by the server from each API's fields, or by a ``pool.generate`` caller):

- ``reasoning_effort``: "none", "minimal", "low", "medium" or "high": the model's budget
  for that effort (``reasoning_budgets``; "none" and "minimal" do not think);
- ``thinking_token_budget``: the thinking tokens allowed (vLLM's field; wins over effort);
- ``enable_thinking``: False renders the template without thinking (Qwen3's
  ``chat_template_kwargs``) and closes any thinking the model still opens at once;
- ``thinking_deadline``: a ``time.time()`` by which the answer must be done: thinking
  is closed when the measured decode rate leaves only the answer's reserve.

The pool's own (``PoolConfig``, sent under ``generation_defaults``): ``reasoning_parser``,
``reasoning_budgets``, ``reasoning_answer_reserve``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.reasoning.parsers import PARSER_NAMES

EFFORTS = ("none", "minimal", "low", "medium", "high")
DEFAULT_BUDGETS: Mapping[str, int] = {"low": 1024, "medium": 2048, "high": 8192}
"""vLLM's defaults for low/medium/high effort, in thinking tokens."""
DEFAULT_ANSWER_RESERVE = 256
"""Tokens of ``max_tokens`` kept for the answer (at most a quarter of it): thinking is
closed before it would spend them."""

EFFORT_PARAM = "reasoning_effort"
BUDGET_PARAM = "thinking_token_budget"
ENABLE_PARAM = "enable_thinking"
DEADLINE_PARAM = "thinking_deadline"
PARSER_PARAM = "reasoning_parser"
BUDGETS_PARAM = "reasoning_budgets"
RESERVE_PARAM = "reasoning_answer_reserve"
MAX_BUDGET = 1 << 24


class ControlError(InvalidRequest):
    """A thinking control with a bad value; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ThinkingBound:
    """One request's bound on thinking, as the worker reads it from its params."""

    budget: int | None  # thinking tokens allowed; None: only the reserve bounds it
    enabled: bool
    reserve: int
    deadline: float | None

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> ThinkingBound:
        enabled = params.get(ENABLE_PARAM) is not False
        budget: int | None = params.get(BUDGET_PARAM)
        effort = params.get(EFFORT_PARAM)
        if budget is None and effort is not None:
            budgets = {**DEFAULT_BUDGETS, **(params.get(BUDGETS_PARAM) or {})}
            budget = budgets.get(effort, 0)
        if not enabled:
            budget = 0
        reserve = params.get(RESERVE_PARAM, DEFAULT_ANSWER_RESERVE)
        return cls(budget, enabled, int(reserve), params.get(DEADLINE_PARAM))


class PoolSettings(Protocol):
    @property
    def reasoning_parser(self) -> str: ...

    @property
    def reasoning_budgets(self) -> dict[str, int]: ...

    @property
    def reasoning_answer_reserve(self) -> int: ...


def template_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """What a request's params pass to its chat template: ``enable_thinking`` when it
    said (Qwen3's and similar templates read it; others ignore it)."""
    enable = params.get(ENABLE_PARAM)
    return {} if enable is None else {ENABLE_PARAM: enable}


def check_pool_settings(config: PoolSettings) -> None:
    """The pool's reasoning settings; raises ValueError naming the bad one."""
    check_settings(
        config.reasoning_parser, config.reasoning_budgets, config.reasoning_answer_reserve
    )


def check_settings(parser: object, budgets: object, reserve: object) -> None:
    """``reasoning_parser``, ``reasoning_budgets``, ``reasoning_answer_reserve``."""
    if parser not in PARSER_NAMES:
        raise ValueError(f"reasoning_parser must be one of {PARSER_NAMES}, got {parser!r}")
    if not isinstance(budgets, Mapping) or not all(
        key in DEFAULT_BUDGETS and _is_budget(value) for key, value in budgets.items()
    ):
        raise ValueError(
            "reasoning_budgets must map low, medium and high to thinking tokens "
            f"(integers >= 0), got {budgets!r}"
        )
    if not _is_budget(reserve):
        raise ValueError(f"reasoning_answer_reserve must be an integer >= 0, got {reserve!r}")


def pool_params(config: PoolSettings) -> dict[str, Any]:
    """The pool's settings that differ from the defaults, as the params every worker
    request carries (none when all are the defaults: a custom backend sees no new name)."""
    params: dict[str, Any] = {}
    if config.reasoning_parser != "auto":
        params[PARSER_PARAM] = config.reasoning_parser
    if config.reasoning_budgets:
        params[BUDGETS_PARAM] = dict(config.reasoning_budgets)
    if config.reasoning_answer_reserve != DEFAULT_ANSWER_RESERVE:
        params[RESERVE_PARAM] = config.reasoning_answer_reserve
    return params


def _is_budget(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BUDGET


def effort(value: object, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if value not in EFFORTS:
        raise ControlError(f"{param} must be one of {', '.join(EFFORTS)}, got {value!r}", param)
    return {EFFORT_PARAM: value}


def budget(value: object, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not _is_budget(value):
        raise ControlError(
            f"{param} must be an integer in [0, {MAX_BUDGET}] (thinking tokens), got {value!r}",
            param,
        )
    return {BUDGET_PARAM: value}


def template_kwargs(value: object) -> dict[str, Any]:
    """``chat_template_kwargs``: ``enable_thinking`` (and ``thinking``, its other name
    in some templates) is what changes the rendered prompt here."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ControlError("chat_template_kwargs must be an object", "chat_template_kwargs")
    params: dict[str, Any] = {}
    for key, flag in value.items():
        where = f"chat_template_kwargs.{key}"
        if key not in (ENABLE_PARAM, "thinking"):
            raise ControlError(
                f"{where} is not supported (supported: {ENABLE_PARAM}, thinking)", where
            )
        if not isinstance(flag, bool):
            raise ControlError(f"{where} must be true or false", where)
        params[ENABLE_PARAM] = flag
    return params


def chat_controls(body: Mapping[str, Any]) -> dict[str, Any]:
    """Chat Completions' (and vLLM's) fields: ``reasoning_effort``,
    ``thinking_token_budget``, ``chat_template_kwargs``."""
    return {
        **effort(body.get("reasoning_effort"), "reasoning_effort"),
        **budget(body.get(BUDGET_PARAM), BUDGET_PARAM),
        **template_kwargs(body.get("chat_template_kwargs")),
    }


def responses_controls(reasoning: object) -> dict[str, Any]:
    """Responses' ``reasoning: {effort, summary}`` (summary: every summary is the thinking
    itself here)."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, Mapping):
        raise ControlError("reasoning must be an object", "reasoning")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            raise ControlError(f"reasoning.{key} is not supported", f"reasoning.{key}")
    return effort(reasoning.get("effort"), "reasoning.effort")


def messages_controls(thinking: object) -> dict[str, Any]:
    """Anthropic's ``thinking: {type: enabled, budget_tokens}`` or ``{type: disabled}``."""
    if thinking is None:
        return {}
    if not isinstance(thinking, Mapping) or thinking.get("type") not in (
        "enabled",
        "disabled",
        "adaptive",
    ):
        raise ControlError(
            "thinking must be {type: enabled, budget_tokens} or {type: disabled}", "thinking"
        )
    if thinking["type"] == "disabled":
        return {ENABLE_PARAM: False}
    return budget(thinking.get("budget_tokens"), "thinking.budget_tokens")


def ollama_controls(think: object) -> dict[str, Any]:
    """Ollama's ``think``: true, false, or an effort."""
    if think is None or think is True:
        return {}
    if think is False:
        return {ENABLE_PARAM: False}
    if think in ("low", "medium", "high"):
        return {EFFORT_PARAM: think}
    raise ControlError("think must be true, false, 'low', 'medium' or 'high'", "think")


THINKING_PARAMS = frozenset(
    {
        EFFORT_PARAM,
        BUDGET_PARAM,
        ENABLE_PARAM,
        DEADLINE_PARAM,
        PARSER_PARAM,
        BUDGETS_PARAM,
        RESERVE_PARAM,
    }
)
"""The worker params of thinking, which every backend takes."""


def check_thinking_params(params: Mapping[str, Any], prefix: str = "") -> None:
    """The thinking params' values; raises :class:`InvalidRequest` naming the bad one."""
    effort(params.get(EFFORT_PARAM), prefix + EFFORT_PARAM)
    budget(params.get(BUDGET_PARAM), prefix + BUDGET_PARAM)
    enable = params.get(ENABLE_PARAM)
    if enable is not None and not isinstance(enable, bool):
        raise ControlError(f"{prefix}{ENABLE_PARAM} must be true or false", ENABLE_PARAM)
    deadline = params.get(DEADLINE_PARAM)
    if deadline is not None and (
        not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or deadline != deadline
    ):
        raise ControlError(f"{prefix}{DEADLINE_PARAM} must be a time.time() number", DEADLINE_PARAM)
    if PARSER_PARAM in params or BUDGETS_PARAM in params or RESERVE_PARAM in params:
        try:
            check_settings(
                params.get(PARSER_PARAM, "auto"),
                params.get(BUDGETS_PARAM, {}),
                params.get(RESERVE_PARAM, DEFAULT_ANSWER_RESERVE),
            )
        except ValueError as exc:
            raise InvalidRequest(f"{prefix}{exc}") from None
