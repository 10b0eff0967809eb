"""The worker's bound on thinking: it counts a request's thinking tokens and, at a bound,
makes the model's own end of thinking the next tokens, so that the answer follows.

A row of a reasoning model gets a :class:`ThinkingTracker` (``Scheduler.admit``). For
each token taken it knows whether the model is thinking (thinking the template opened in
the prompt counts as started); it closes thinking by queueing the end sequence (the
tokens of ``</think>``, or of Harmony's switch to the final channel), which the runner
takes as the next tokens in place of its own choice (:meth:`ThinkingTracker.forced`), when:

- ``budget``: the thinking tokens reached the request's budget (its effort's, its
  ``thinking_token_budget``, or 0 with thinking disabled);
- ``reserve``: thinking would leave fewer than the answer's reserve of ``max_tokens``
  (never "length" with an empty answer because of thinking alone);
- ``loop``: the thinking repeats itself (``shared.reasoning.loops``);
- ``deadline``: at the measured decode rate, the time left only fits the reserve.

Thinking tokens are never more than the budget: the end sequence is forced on the token
that would have been the first past it. While thinking, the row's grammar (structured
output, tool calls) is held aside: it constrains the answer, from the end of thinking on.

Harmony (gpt-oss) ends thinking by ending the analysis message and starting the next
(``<|end|><|start|>assistant``), whose channel says what follows: ``final`` (the answer)
or ``commentary to=functions.NAME`` (a call). A forced close of a request that offers
tools stops there, so that the model may still call; one that offers none goes on into
the final channel. A Harmony tool grammar covers the whole output (analysis, then the
answer or a call, :mod:`modelpool.shared.tool_formats.gpt_oss`): held aside, it first
reads an empty analysis message when it starts, so that it stands where the model does,
past the analysis (it allows one), and offers the answer or the call, never analysis.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from modelpool.shared.protocol import TokenIds
from modelpool.shared.reasoning.controls import PARSER_PARAM, ThinkingBound
from modelpool.shared.reasoning.detect import ReasoningFamily, detect_family
from modelpool.shared.reasoning.loops import LoopDetector
from modelpool.shared.reasoning.parsers import HARMONY_TOKENS, THINK_END, THINK_START, ParserName
from modelpool.worker.backends.common.text import TextProgress

T = TypeVar("T", bound=Hashable)
CloseReason = Literal["budget", "reserve", "loop", "deadline"]
CLOSE_REASONS: tuple[CloseReason, ...] = ("budget", "reserve", "loop", "deadline")
MARKERS = (THINK_START, THINK_END, "<|channel|>", "<|message|>")
"""The tokens a vocabulary is searched for (``shared.reasoning.detect``)."""
_RATE_EVERY = 8  # tokens between decode-rate readings for the deadline check
_OPENING_WINDOW = 64  # a prompt's last tokens, where a template opens thinking


@dataclass(frozen=True)
class ThinkingModel(Generic[T]):
    """A loaded reasoning model's thinking, in its own tokens: the family, the start and
    end sequences."""

    family: ReasoningFamily
    start: tuple[T, ...]
    end: tuple[T, ...]
    answer: tuple[T, ...] = ()  # what a forced close adds when no call may follow

    def tracker(
        self, prompt: Sequence[T], params: dict[str, Any], max_new_tokens: int
    ) -> ThinkingTracker[T]:
        return ThinkingTracker(
            self, _open_in_prompt(prompt, self.start, self.end), params, max_new_tokens
        )


class ThinkingModels:
    """A loaded model's thinking for each ``reasoning_parser`` a request may carry (the
    pool's, "auto" by default): detected once from its chat template and the marker
    tokens its vocabulary holds, the markers' ids from ``encode``."""

    def __init__(
        self,
        chat_template: str | None,
        vocabulary: Collection[str],
        encode: Callable[[str], list[int]],
    ) -> None:
        self._template = chat_template
        self._present = frozenset(marker for marker in MARKERS if marker in vocabulary)
        self._encode = encode
        self._models: dict[str, ThinkingModel[int] | None] = {}

    def get(self, parser: ParserName) -> ThinkingModel[int] | None:
        if parser not in self._models:
            family = detect_family(parser, self._template, self._present)
            self._models[parser] = None if family is None else self._model(family)
        return self._models[parser]

    def _model(self, family: ReasoningFamily) -> ThinkingModel[int] | None:
        start, end = self._encode(family.start_text), self._encode(family.end_text)
        answer = self._encode(family.answer_text) if family.answer_text else []
        if not (start and end):
            return None
        return ThinkingModel(family, tuple(start), tuple(end), tuple(answer))


def is_chat(prompt: object) -> bool:
    """A list of chat messages (not a raw string, not token ids): what may think."""
    return not isinstance(prompt, (str, TokenIds))


def thinking_for(
    models: ThinkingModels | None,
    prompt: Sequence[int],
    params: dict[str, Any],
    max_new_tokens: int,
    progress: TextProgress,
) -> ThinkingTracker[int] | None:
    """A request's tracker, when its model thinks (for the request's parser); thinking
    the template opened gets its opening written back at the head of the text (the
    canonical form the server splits)."""
    model = keep_family_tokens(models, params, progress)
    if model is None:
        return None
    tracker = model.tracker(prompt, params, max_new_tokens)
    if tracker.started_in_prompt:
        progress.lead = model.family.start_text
    return tracker


def keep_family_tokens(
    models: ThinkingModels | None, params: dict[str, Any], progress: TextProgress
) -> ThinkingModel[int] | None:
    """A chat request's thinking model (for its parser), if its model thinks; a gpt-oss
    model's text keeps Harmony's special tokens, which the server splits its channels by
    (the backends otherwise drop special tokens when decoding)."""
    model = None if models is None else models.get(params.get(PARSER_PARAM, "auto"))
    if model is not None and model.family.family == "gpt_oss":
        progress.keep_special(HARMONY_TOKENS)
    return model


def _open_in_prompt(prompt: Sequence[T], start: tuple[T, ...], end: tuple[T, ...]) -> bool:
    """Does ``prompt`` end inside thinking (its last start sequence not closed)? A
    template opens it in the last few tokens it writes: only those are read, whatever the
    prompt's length."""
    tail = prompt[-_OPENING_WINDOW:]
    last_start = _rfind(tail, start)
    return last_start >= 0 and _rfind(tail, end) < last_start


def _rfind(items: Sequence[T], part: tuple[T, ...]) -> int:
    size = len(part)
    for index in range(len(items) - size, -1, -1):
        if tuple(items[index : index + size]) == part:
            return index
    return -1


class ThinkingTracker(Generic[T]):
    """One request's thinking: started, counted, closed."""

    def __init__(
        self, model: ThinkingModel[T], started: bool, params: dict[str, Any], max_new_tokens: int
    ) -> None:
        self.model = model
        self.started_in_prompt = started
        self.thinking = started
        self.bound = ThinkingBound.of(params)
        self.max_new_tokens = max_new_tokens
        # The answer's reserve: at most a quarter of max_new_tokens, so that a small one
        # still leaves thinking room.
        self.reserve = min(self.bound.reserve, max_new_tokens // 4)
        self.tokens = 0  # thinking tokens taken (the end sequence not counted)
        self.closed_by: CloseReason | None = None
        self.ended = False  # thinking ended (by the model or forced)
        self._generated = 0
        # A request with tools may call one after thinking: the close stops at the end of
        # thinking, where the model names its next channel (Harmony) itself.
        calls = bool(params.get("tools"))
        self._close = model.end if calls else model.end + model.answer
        harmony = model.family.family == "gpt_oss"
        # Harmony may open its analysis channel again after a message (the server reads
        # every analysis message as reasoning): it counts against the same budget.
        self._reopens = harmony
        # What a held Harmony tool grammar reads before the answer (see the module's doc).
        self.grammar_lead: tuple[T, ...] = model.start + model.end if calls and harmony else ()
        self._forced: deque[T] = deque()
        self._matched = 0  # how much of the end sequence the latest tokens are
        self._start_matched = 0
        self._loops = LoopDetector()
        self._started_at = time.monotonic()
        self.held_grammar: Any = None  # the row's grammar, held aside while thinking
        if started:
            self._opened()

    def _opened(self) -> None:
        """Thinking began: with its budget spent (0: thinking disabled) it is closed at
        once."""
        self.thinking, self.ended = True, False
        self._start_matched = self._matched = 0
        budget = self.bound.budget
        if budget is not None and self.tokens >= budget:
            self.closed_by = "budget"
            self._forced.extend(self._close)

    def forced(self) -> T | None:
        """The token the model must take next (the end of thinking being forced)."""
        return self._forced[0] if self._forced else None

    def take(self, token: T) -> bool:
        """Count ``token``; True when it ended thinking (the grammar may start)."""
        self._generated += 1
        if self._forced and token == self._forced[0]:
            self._forced.popleft()
            if not self._forced:
                return self._end()
            return False
        if not self.thinking:
            if self.ended and not self._reopens:
                return False
            start = self.model.start
            matched = self._start_matched
            self._start_matched = (
                matched + 1 if token == start[matched] else (1 if token == start[0] else 0)
            )
            if self._start_matched == len(start):
                self._opened()
            elif self._generated > len(start) * 2 and self._start_matched == 0 and not self.ended:
                self.ended = True  # the answer began without thinking
            return False
        end = self.model.end
        self._matched = (
            self._matched + 1 if token == end[self._matched] else (1 if token == end[0] else 0)
        )
        if self._matched == len(end):
            return self._end()
        if self._matched:
            return False
        self.tokens += 1
        reason = self._bounded(token)
        if reason is not None:
            self.closed_by = reason
            self._forced.extend(self._close)
        return False

    def _end(self) -> bool:
        self.thinking = False
        self.ended = True
        self._forced.clear()
        return True

    def _bounded(self, token: T) -> CloseReason | None:
        """Why thinking must close before the next token, if it must."""
        looping = self._loops.take(token)
        end = len(self._close)
        budget = self.bound.budget
        if budget is not None and self.tokens >= budget:
            return "budget"
        if self._generated + end + self.reserve >= self.max_new_tokens:
            return "reserve"
        if looping:
            return "loop"
        deadline = self.bound.deadline
        if deadline is not None and self._generated % _RATE_EVERY == 0:
            step_s = (time.monotonic() - self._started_at) / self._generated
            left = deadline - time.time()
            if left <= step_s * (end + max(self.reserve, 1)):
                return "deadline"
        return None
