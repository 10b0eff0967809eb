"""What finished runs measured, and the wait they predict for a new request.

``WaitPredictor`` keeps moving averages of finished runs (time from dispatch to the first
token, time from dispatch to the end and its spread, prefill and decode tokens per second,
prompt tokens per character) and a quantile of the model's answer lengths. From them:

- a queued run's seconds from its own size (``sizes.Work``): its prompt tokens at the
  measured prefill rate, and its expected output at the measured decode rate. Its
  expected output is its ``max_new_tokens``, capped by what the model's answers measured:
  ``ANSWER_QUANTILE`` of the answer lengths of the last ``ANSWER_WINDOW`` runs, where an
  answer cut at its maximum (finish_reason "length") counts as longer than any (it would
  have gone on), so the cap is known only while most answers end on their own. A run
  with no maximum and no cap yet, or any run while no decode rate is measured, counts at
  the mean run plus its spread (what the pool measured, whatever the sizes); where the
  backend reports no prompt tokens, a prefill counts at the mean time to a first token;
- a new request's predicted time to first token given the work queued ahead of it and
  the share of the slots that more urgent requests took of the last dispatches (they
  will pass it too), and of the slot time lost to runs they preempted, plus the mean
  deviation of the waits it predicted before (``observe_wait``): under overload the
  admitted requests sit just under their bound, and a prediction right on average would
  see half of them pass it (:meth:`WaitPredictor.predict_ttft`)::

    predictor.observe(run_s=0.8, ttft_s=0.1, prompt_tokens=40, completion_tokens=32,
                      prompt_chars=160, cut=False)
    predictor.predict_ttft(ahead=work, free=0, capacity=4, urgent_share=0.2)

The dispatcher thread writes it, callers' threads read it: every field is one float,
replaced whole, so a reader sees each one either old or new, never torn.
"""

from __future__ import annotations

import math
from collections import deque

from modelpool.scheduling.sizes import InFlight, RunSize, Work

# Weight of the newest run in the moving averages: about the last 20 runs count.
EWMA_WEIGHT = 0.1
# Runs measured before a prediction is trusted (a first run pays warm-up costs).
MIN_SAMPLES = 3
# The share of the measured decode rate a request without a maximum leaves unspent when
# its deadline bounds its length (WaitPredictor.tokens_within).
DECODE_MARGIN = 0.2
# The least share of the slots a priority is predicted to get, however busy the more
# urgent ones keep them (aging promotes it after priority_aging_s anyway).
MIN_SHARE = 0.05
# Weight of the newest dispatch or preemption in the share of runs preempted.
PREEMPTED_WEIGHT = 1 / 256
# A request admitted by its predicted wait is promoted this many runs (mean plus spread)
# before its deadline: one for a slot to free, the others for promoted requests ahead.
DUE_RUNS = 3
# The expected output of a queued run is capped at this quantile of the answer lengths
# of the last ANSWER_WINDOW runs: long enough to cover most answers (the prediction errs
# long), short of the few longest.
ANSWER_QUANTILE = 0.9
ANSWER_WINDOW = 256


class WaitPredictor:
    """Moving averages of finished runs, and the time to first token they predict."""

    def __init__(self) -> None:
        self.samples = 0
        self.run_s = 0.0
        self.run_spread_s = 0.0  # the moving mean of |run - its moving average|
        # Of the recent dispatches and preemptions, the share that were preemptions: the
        # slot time lost to runs that will run again (preempt_for_priority).
        self.preempted_share = 0.0
        self.ttft_s = 0.0
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        self.tokens_per_char = 0.0
        # ANSWER_QUANTILE of the recent answers' lengths (math.inf: unknown, or too many
        # answers were cut at their maximum to tell).
        self.answer_cap = math.inf
        self._answers: deque[float] = deque(maxlen=ANSWER_WINDOW)
        # The moving mean of |first token's wait - its prediction| of the requests judged
        # by their predicted wait: added to each prediction, so that it errs long by what
        # the model's approximations missed (how runs fall to workers, prefetching).
        self.wait_spread_s = 0.0
        self._waits = 0
        # Totals over every answered run (the status page's tokens per second).
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def observe(
        self,
        *,
        run_s: float,
        ttft_s: float | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        prompt_chars: int = 0,
        cut: bool = False,
    ) -> None:
        """A run that ended with an answer: dispatch to end ``run_s``, dispatch to first
        token ``ttft_s`` (None: it streamed nothing before its answer); ``prompt_chars``
        its prompt's characters (0: given as token ids); ``cut``: it stopped at its
        maximum of new tokens, not on its own."""
        first = ttft_s if ttft_s is not None else run_s
        self.prompt_tokens += prompt_tokens or 0
        self.completion_tokens += completion_tokens or 0
        if self.samples:
            self.run_spread_s = self._mix(self.run_spread_s, abs(run_s - self.run_s))
        self.run_s = self._mix(self.run_s, run_s)
        self.ttft_s = self._mix(self.ttft_s, first)
        if prompt_tokens and first > 0:
            self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s, prompt_tokens / first)
        if prompt_tokens and prompt_chars:
            ratio = prompt_tokens / prompt_chars
            self.tokens_per_char = (
                ratio if not self.tokens_per_char else self._mix(self.tokens_per_char, ratio)
            )
        decode_s = run_s - first
        if completion_tokens and completion_tokens > 1 and decode_s > 0:
            self.decode_tokens_per_s = self._mix(
                self.decode_tokens_per_s, (completion_tokens - 1) / decode_s
            )
        if completion_tokens is not None:
            self._answers.append(math.inf if cut else float(completion_tokens))
            self.answer_cap = _quantile(self._answers, ANSWER_QUANTILE)
        self.samples += 1

    def observe_wait(self, *, predicted_s: float, waited_s: float) -> None:
        """A request judged by its predicted wait (``predicted_s``, without the spread)
        had its first token after ``waited_s``."""
        miss = abs(waited_s - predicted_s)
        self._waits += 1
        first = self._waits == 1
        self.wait_spread_s = (
            miss if first else self.wait_spread_s + EWMA_WEIGHT * (miss - self.wait_spread_s)
        )

    def dispatched(self, *, preempted: bool) -> None:
        """A run was dispatched (False) or preempted (True)."""
        self.preempted_share += PREEMPTED_WEIGHT * (float(preempted) - self.preempted_share)

    def _mix(self, old: float, new: float) -> float:
        return new if self.samples == 0 else old + EWMA_WEIGHT * (new - old)

    def work_of(self, size: RunSize) -> Work:
        """One queued run of ``size``, with its expected output as known now (see the
        module docstring): the dispatcher adds it to the queued work, and takes away the
        same when the run leaves the queue."""
        expected = min(
            math.inf if size.max_new_tokens is None else size.max_new_tokens, self.answer_cap
        )
        if expected == math.inf:
            return Work(unsized=1)
        return Work(1, size.prompt_tokens, size.prompt_chars, int(expected))

    def mean_run_s(self) -> float:
        """A run of unknown size: the mean plus the spread (erring long)."""
        return self.run_s + self.run_spread_s

    def seconds_of(self, work: Work) -> float:
        """The runs of ``work`` end to end, one after another: the sized ones from their
        tokens at the measured rates, the others (and all, while no decode rate is
        measured) at the mean run."""
        prefill, decode = self.prefill_tokens_per_s, self.decode_tokens_per_s
        if decode <= 0:
            return work.runs * self.mean_run_s()
        prompt = work.prompt_tokens + work.prompt_chars * self.tokens_per_char
        # Where the backend reports no prompt tokens, a prefill takes the mean time to a
        # first token.
        prefill_s = prompt / prefill if prefill > 0 else work.sized * self.ttft_s
        decoding = max(0, work.output_tokens - work.sized)  # the first comes with the prefill
        return prefill_s + decoding / decode + work.unsized * self.mean_run_s()

    def first_token_s(self, size: RunSize | None) -> float:
        """A run's own time to its first token: its prompt at the prefill rate when it is
        known, else the mean measured."""
        if size is None or self.prefill_tokens_per_s <= 0:
            return self.ttft_s
        prompt = size.prompt_tokens + size.prompt_chars * self.tokens_per_char
        return prompt / self.prefill_tokens_per_s if prompt else self.ttft_s

    def predict_ttft(
        self,
        *,
        ahead: Work,
        free: int,
        capacity: int,
        urgent_share: float = 0.0,
        size: RunSize | None = None,
        in_flight: InFlight | None = None,
        now: float = 0.0,
        spread: bool = True,
    ) -> float | None:
        """Seconds until a new request's first token (of ``size``; None: unknown). With
        fewer runs ahead of it than ``free`` slots, its own time to first token. Else it
        starts once the work ``ahead`` of it (each run's own seconds, ``seconds_of``) and
        what is left at ``now`` of the runs ``in_flight`` on workers (None: unknown, one
        mean run) are done, ``capacity`` slots working at once, of which
        ``urgent_share`` go to more urgent requests that arrive meanwhile and pass it
        and, when there are such, ``preempted_share`` are lost to runs they preempt
        (those run again, first). With ``spread``, plus the mean deviation of the waits
        it predicted (``observe_wait``). None until measured."""
        if self.samples < MIN_SAMPLES or capacity <= 0:
            return None
        own = self.first_token_s(size)
        margin = self.wait_spread_s if spread else 0.0
        if ahead.runs < free:
            return own + margin
        if in_flight is None:
            left_in_flight = self.mean_run_s()
        else:
            done_s = in_flight.elapsed_s(now)
            left_in_flight = max(0.0, self.seconds_of(in_flight.work) - done_s)
        ending_s = self.seconds_of(ahead) + left_in_flight
        lost = self.preempted_share if urgent_share > 0 else 0.0
        left_for_it = max(1.0 - urgent_share - lost, MIN_SHARE)
        return ending_s / (capacity * left_for_it) + own + margin

    def tokens_within(self, seconds: float) -> int | None:
        """How many tokens a run may decode and still answer within ``seconds``: the
        measured decode rate over what is left after a time to first token, less
        ``DECODE_MARGIN`` (a run decodes slower than the moving mean about half the time).
        At least one; None until measured."""
        if self.samples < MIN_SAMPLES or self.decode_tokens_per_s <= 0:
            return None
        decoding_s = max(0.0, seconds - self.ttft_s)
        return max(1, int(decoding_s * self.decode_tokens_per_s * (1 - DECODE_MARGIN)))

    def promotion_lead_s(self) -> float:
        """How long before its bound a request admitted by its predicted wait is promoted
        (``Request.due_at``): DUE_RUNS runs of mean plus spread, and a time to first token."""
        return DUE_RUNS * self.mean_run_s() + self.ttft_s

    def to_dict(self) -> dict[str, float | int]:
        """What stats show under ``throughput`` (``answer_cap_tokens`` once known)."""
        shown: dict[str, float | int] = {
            "samples": self.samples,
            "run_s": round(self.run_s, 4),
            "run_spread_s": round(self.run_spread_s, 4),
            "preempted_share": round(self.preempted_share, 4),
            "ttft_s": round(self.ttft_s, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 1),
            "wait_spread_s": round(self.wait_spread_s, 4),
            "tokens_per_char": round(self.tokens_per_char, 4),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.answer_cap != math.inf:
            shown["answer_cap_tokens"] = int(self.answer_cap)
        return shown


def _quantile(values: deque[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank, so an infinite value stays one)."""
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, math.ceil(q * len(ranked)) - 1)]
