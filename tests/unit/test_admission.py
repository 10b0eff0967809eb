"""Admission from sizes (``scheduling.admission``, ``prediction``, ``sizes``): each queued
run predicted from its own prompt and expected output at the measured rates, not at the
pool's mean run; pure functions, no processes."""

from __future__ import annotations

import math

import pytest

from modelpool import QueueFull
from modelpool.scheduling import admission
from modelpool.scheduling.prediction import ANSWER_WINDOW, WaitPredictor
from modelpool.scheduling.queueing import PriorityCounts
from modelpool.scheduling.sizes import NOTHING_IN_FLIGHT, RunSize, Work, size_of
from modelpool.shared.protocol import TokenIds


class _State:
    """A dispatcher's published state, as admission reads it."""

    def __init__(self, predictor: WaitPredictor, free_slots: int = 0) -> None:
        self.predictor = predictor
        self.priorities = PriorityCounts()
        self.free_slots = free_slots
        self.in_flight = NOTHING_IN_FLIGHT
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def queue(self, size: RunSize, priority: int = 0) -> None:
        self.priorities.queued(priority, 1, self.predictor.work_of(size))


def _short_history() -> WaitPredictor:
    """Runs of two tokens, 50 ms apart, cut at their maximum of two (``cut``)."""
    predictor = WaitPredictor()
    for _ in range(4):
        predictor.observe(run_s=0.1, ttft_s=0.05, prompt_tokens=None, completion_tokens=2, cut=True)
    return predictor


def test_long_runs_queued_behind_short_history_are_predicted_long() -> None:
    """The issue's case: one slot, three runs of 60 tokens at 50 ms queued after a few
    short runs, behind one such run 1 s in. At the mean run they are 0.1 s each (admitted
    under a 2 s bound); from their sizes 3 s each, and 2 s left of the running one."""
    predictor = _short_history()
    assert predictor.decode_tokens_per_s == pytest.approx(20.0)
    state = _State(predictor)
    long_run = RunSize(prompt_chars=14, max_new_tokens=60)
    state.in_flight = state.in_flight.sent(predictor.work_of(long_run), started_at=0.0)
    state.now = 1.0
    for _ in range(3):
        state.queue(long_run)
    mean_rule = predictor.predict_ttft(ahead=Work(unsized=3), free=0, capacity=1)
    assert mean_rule is not None and mean_rule < 2.0
    predicted = admission.predicted_ttft(state, capacity=1, priority=0)
    assert predicted is not None
    assert predicted == pytest.approx(3 * (0.05 + 59 / 20) + 2.0 + 0.05)
    with pytest.raises(QueueFull) as refused:
        admission.judge(state, capacity=1, priority=0, limit_s=2.0, deadline_s=30.0)
    assert refused.value.retry_after_s == pytest.approx(predicted - 2.0)


def test_the_expected_output_is_capped_by_the_answers_measured() -> None:
    """Answers that end on their own around 10 tokens cap a maximum of 500; answers cut at
    their maximum say only that they would have gone on, so too many of them leave the
    cap unknown (and a run without a maximum then counts at the mean run)."""
    predictor = WaitPredictor()
    for n in range(20):
        predictor.observe(run_s=0.5, ttft_s=0.05, prompt_tokens=8, completion_tokens=8 + n % 3)
    assert predictor.answer_cap == 10
    assert predictor.work_of(RunSize(prompt_tokens=8, max_new_tokens=500)).output_tokens == 10
    assert predictor.work_of(RunSize(prompt_tokens=8, max_new_tokens=4)).output_tokens == 4
    assert predictor.work_of(RunSize(prompt_tokens=8)).output_tokens == 10
    for _ in range(ANSWER_WINDOW):
        predictor.observe(run_s=0.5, ttft_s=0.05, prompt_tokens=8, completion_tokens=16, cut=True)
    assert predictor.answer_cap == math.inf
    assert predictor.work_of(RunSize(prompt_tokens=8)) == Work(unsized=1)
    assert predictor.work_of(RunSize(max_new_tokens=500)).output_tokens == 500


def test_prompts_count_at_the_measured_prefill_rate_and_tokens_per_character() -> None:
    predictor = WaitPredictor()
    for _ in range(5):  # 100 tokens read in 0.25 s; 400 characters
        predictor.observe(
            run_s=1.0, ttft_s=0.25, prompt_tokens=100, completion_tokens=31, prompt_chars=400
        )
    assert predictor.tokens_per_char == pytest.approx(0.25)
    long_prompt = Work(sized=1, prompt_chars=4000, output_tokens=1)
    ids = Work(sized=1, prompt_tokens=1000, output_tokens=1)
    assert predictor.seconds_of(long_prompt) == pytest.approx(2.5)
    assert predictor.seconds_of(ids) == pytest.approx(2.5)
    assert predictor.first_token_s(RunSize(prompt_tokens=200)) == pytest.approx(0.5)


def test_sizes_come_from_the_prompt_the_pool_holds() -> None:
    assert size_of("four", 9) == RunSize(prompt_chars=4, max_new_tokens=9)
    assert size_of(TokenIds((1, 2, 3)), None) == RunSize(prompt_tokens=3)
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]
    assert size_of(messages, 5) == RunSize(prompt_chars=5, max_new_tokens=5)


def test_the_queued_work_leaves_as_it_came() -> None:
    counts = PriorityCounts()
    big, small = Work(1, 0, 40, 60), Work(1, 0, 4, 2)
    counts.queued(0, 1, big)
    counts.queued(0, 1, small)
    counts.queued(5, 1, small)
    counts.queued(0, -1, big)
    assert counts.work == {0: small, 5: small}
    assert counts.waiting == {0: 1, 5: 1}
    counts.queued(0, -1, small)
    assert counts.work == {5: small}


def test_a_request_admitted_is_due_a_few_runs_before_its_deadline() -> None:
    predictor = _short_history()
    assert admission.promotion_at(predictor, 100.0, None) == math.inf
    due = admission.promotion_at(predictor, 100.0, 10.0)
    assert due == pytest.approx(110.0 - predictor.promotion_lead_s())


def test_a_prediction_errs_long_by_how_far_the_waits_it_predicted_missed() -> None:
    """Admitted requests sit just under the bound when the pool is overloaded: a
    prediction right on average would see half of them pass it. So each prediction adds
    the mean deviation of the first-token waits it predicted before."""
    predictor = _short_history()
    ahead = Work(unsized=3)
    plain = predictor.predict_ttft(ahead=ahead, free=0, capacity=1)
    assert plain == predictor.predict_ttft(ahead=ahead, free=0, capacity=1, spread=False)
    for n in range(40):
        predictor.observe_wait(predicted_s=1.0, waited_s=1.5 if n % 2 else 0.5)
    assert predictor.wait_spread_s == pytest.approx(0.5)
    assert plain is not None
    assert predictor.predict_ttft(ahead=ahead, free=0, capacity=1) == pytest.approx(plain + 0.5)
    assert predictor.to_dict()["wait_spread_s"] == pytest.approx(0.5)
