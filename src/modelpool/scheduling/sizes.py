"""How big a request is before it runs, and the queued work summed by priority.

The pool knows a request's prompt before any worker reads it: its token count when it is
token ids, else its characters (turned into tokens at the measured tokens per character,
``prediction.WaitPredictor``); and its maximum of new tokens when it has one. Admission
(``admission.py``) predicts a queued run's seconds from these, not from the pool's mean
run::

    size = size_of("Tell me about the sea", max_new_tokens=60)   # RunSize(0, 21, 60)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelpool.shared.images import IMAGE_TOKEN_ESTIMATE
from modelpool.shared.protocol import Prompt, TokenIds

# An image part, in the characters a prompt is sized in: its estimated tokens at about
# four characters a token.
IMAGE_CHARS = 4 * IMAGE_TOKEN_ESTIMATE


@dataclass(frozen=True, slots=True)
class RunSize:
    """One request's size as the pool knows it: prompt tokens when given as ids, else
    prompt characters; and its ``max_new_tokens`` (None: it said none)."""

    prompt_tokens: int = 0
    prompt_chars: int = 0
    max_new_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Work:
    """Queued runs, summed: those ``sized`` (their expected output is known), with their
    prompt tokens, prompt characters and expected output tokens; and those ``unsized``
    (no maximum, and no measured cap yet), which count at the pool's mean run."""

    sized: int = 0
    prompt_tokens: int = 0
    prompt_chars: int = 0
    output_tokens: int = 0
    unsized: int = 0

    @property
    def runs(self) -> int:
        return self.sized + self.unsized

    def __add__(self, other: Work) -> Work:
        return Work(
            self.sized + other.sized,
            self.prompt_tokens + other.prompt_tokens,
            self.prompt_chars + other.prompt_chars,
            self.output_tokens + other.output_tokens,
            self.unsized + other.unsized,
        )

    def __sub__(self, other: Work) -> Work:
        return Work(
            self.sized - other.sized,
            self.prompt_tokens - other.prompt_tokens,
            self.prompt_chars - other.prompt_chars,
            self.output_tokens - other.output_tokens,
            self.unsized - other.unsized,
        )


NO_WORK = Work()


@dataclass(frozen=True, slots=True)
class InFlight:
    """The runs on workers, summed: their ``work`` (as it was queued), and of those
    started (not prefetched), how many and the sum of their start times, which say how
    much of that work is done by now."""

    work: Work = Work()
    started: int = 0
    started_at_sum: float = 0.0

    def sent(self, work: Work, *, started_at: float | None) -> InFlight:
        """A run of ``work`` went to a worker, started then (None: prefetched)."""
        if started_at is None:
            return InFlight(self.work + work, self.started, self.started_at_sum)
        return InFlight(self.work + work, self.started + 1, self.started_at_sum + started_at)

    def started_one(self, started_at: float) -> InFlight:
        """A prefetched run started."""
        return InFlight(self.work, self.started + 1, self.started_at_sum + started_at)

    def ended(self, work: Work, *, started_at: float | None) -> InFlight:
        """A run left its worker (``started_at``: when it started; None: never did)."""
        if started_at is None:
            return InFlight(self.work - work, self.started, self.started_at_sum)
        return InFlight(self.work - work, self.started - 1, self.started_at_sum - started_at)

    def elapsed_s(self, now: float) -> float:
        """The run-seconds the started runs have had by ``now``."""
        return max(0.0, self.started * now - self.started_at_sum)


NOTHING_IN_FLIGHT = InFlight()
UNKNOWN_SIZE = RunSize()


def size_of(prompt: Prompt | object, max_new_tokens: int | None) -> RunSize:
    """The size of a request for ``prompt`` (anything but a generation's prompt, as a
    tokenize or embed request, is sized by its maximum alone)."""
    if isinstance(prompt, TokenIds):
        return RunSize(prompt_tokens=len(prompt.ids), max_new_tokens=max_new_tokens)
    if isinstance(prompt, str):
        return RunSize(prompt_chars=len(prompt), max_new_tokens=max_new_tokens)
    if isinstance(prompt, Sequence):
        return RunSize(prompt_chars=_message_chars(prompt), max_new_tokens=max_new_tokens)
    return RunSize(max_new_tokens=max_new_tokens)


def _message_chars(messages: Sequence[object]) -> int:
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping):
                    continue
                text = part.get("text")
                # An image, in characters of text: its estimated tokens at ~4 a token.
                is_image = part.get("type") == "image"
                total += IMAGE_CHARS if is_image else len(text) if isinstance(text, str) else 0
    return total
