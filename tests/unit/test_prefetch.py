"""The dispatcher's prefetch rules (``modelpool.scheduling.prefetch``) for one-call workers, driven
step by step with a fake world (no processes): what is sent ahead, when it starts, and
what takes it back (an idle worker, a more urgent request, a cancel, a deadline, a death)."""

from __future__ import annotations

import pickle
import signal
from typing import Any

import pytest

from fake_world import FakeWorld
from modelpool.shared.config import PoolConfig, RetryPolicy
from modelpool.shared.errors import DeadlineExceeded
from modelpool.shared.protocol import Generation
from modelpool.supervisor.records import Request, Worker


class Proc:
    """One fake one-call worker process: the runs in its socket, in order, and its flags."""

    def __init__(self, pid: int) -> None:
        self.pid: int | None = pid
        self.inbox: list[tuple[int, int, str]] = []  # (attempt id, slot, prompt)
        self.cancel_words: dict[int, int] = {}
        self.signals: list[int] = []

    def send(self, message: tuple[Any, ...]) -> None:
        if message[0] == "run":
            _, attempt_id, slot, payload = message
            prompt, _ = pickle.loads(payload)
            assert slot not in {s for _, s, _ in self.inbox}, "cancel word used twice"
            self.inbox.append((attempt_id, slot, prompt))

    def request_cancel(self, slot: int, attempt_id: int) -> None:
        self.cancel_words[slot] = attempt_id

    def progress(self) -> int:
        return 0

    def signal_group(self, signum: int) -> None:
        self.signals.append(signum)


class World(FakeWorld[Proc]):
    def __init__(self, workers: int, **overrides: Any) -> None:
        values: dict[str, Any] = {
            "model": "m",
            "backend": "testing",
            "workers": workers,
            "devices": ("cpu",),
            "deadline_s": 60.0,
            "cancel_grace_s": 0.5,
            "term_grace_s": 0.5,
            "retry": RetryPolicy(max_retries=2),
        }
        super().__init__(PoolConfig(**{**values, **overrides}), Proc, slots=1)

    def submit(self, prompt: str, *, priority: int = 0, deadline_s: float = 60.0) -> Request:
        request = self.new_request(prompt, priority=priority, deadline_s=deadline_s)
        return self.submit_request(request)

    def answer_next(self, worker: Worker, text: str = "ok") -> None:
        """The worker answers the first run in its socket, as a one-call worker does:
        "cancelled" without running it if its cancel word names it."""
        proc = self.procs[worker.id]
        attempt_id, slot, _ = proc.inbox.pop(0)
        if proc.cancel_words.get(slot) == attempt_id:
            generation = Generation("", "cancelled", None, 0)
        else:
            generation = Generation(text)
        self.d.on_message(worker, ("done", attempt_id, generation, 0))
        self.d.after_event()

    def die(self, worker: Worker, code: int = -9) -> None:
        self.procs[worker.id].inbox.clear()
        super().die(worker, code)

    def serving(self) -> list[Worker]:
        return [w for w in self.d.workers.values() if w.state != "dead"]


def test_a_busy_one_call_worker_holds_its_next_request_which_starts_at_its_answer() -> None:
    world = World(workers=2, attempt_timeout_s=5.0)
    requests = [world.submit(f"echo:{n}") for n in range(5)]
    first, second = world.serving()
    # Two each (one running, one behind it, in cancel words 0 and 1), one left queued.
    assert [len(w.runs) for w in (first, second)] == [2, 2]
    assert [slot for _, slot, _ in world.procs[first.id].inbox] == [0, 1]
    assert list(world.d.queue) == [requests[4].request_id]
    waiting = [run for run in first.runs.values() if run.prefetched]
    assert len(waiting) == 1 and waiting[0].deadline_timer is None  # not started: no deadline
    stats = world.d.snapshot()
    assert stats.running == 2, "a prefetched request is not running"

    world.clock.now += 3.0
    world.answer_next(first)
    assert requests[0].future.result().text == "ok"
    promoted = waiting[0]
    assert not promoted.prefetched and promoted.started_at == world.clock.now
    assert promoted.deadline == world.clock.now + 5.0, "its attempt timeout starts now"
    # And the queued one went behind it, at once.
    assert not world.d.queue and len(first.runs) == 2


def test_an_idle_worker_takes_back_a_request_waiting_behind_another() -> None:
    world = World(workers=2)
    long_one, quick, behind = (world.submit(p) for p in ("echo:long", "echo:quick", "echo:b"))
    first, second = world.serving()
    assert behind.run is not None and behind.run.prefetched and behind.run.worker is first
    world.answer_next(second)  # the quick one ends; the long one goes on
    assert quick.future.done()
    # Taken back through its cancel word (the worker answers it unrun), started on the other.
    assert world.procs[first.id].cancel_words == {1: 3}  # attempt 3, in word 1
    assert behind.run is not None and behind.run.worker is second
    assert not behind.run.prefetched and behind.attempts == []
    world.answer_next(second, "b")
    assert behind.future.result().text == "b"
    world.answer_next(first, "long")
    world.answer_next(first)  # its answer to the taken-back run, which nobody waits for
    assert long_one.future.result().text == "long"
    assert not first.runs and first.state == "idle" and world.procs[first.id].signals == []


def test_a_worker_idle_for_a_moment_under_a_full_queue_takes_from_the_queue() -> None:
    world = World(workers=2)
    for n in range(7):
        world.submit(f"echo:{n}")
    first, second = world.serving()
    # It answered both of its runs before the pool read either: idle, three queued.
    proc = world.procs[first.id]
    for _ in range(2):
        attempt_id, _, _ = proc.inbox.pop(0)
        world.d.on_message(first, ("done", attempt_id, Generation("ok"), 0))
    world.d.after_event()
    assert world.procs[second.id].cancel_words == {}, "took work back from a busy worker"
    assert len(first.runs) == 2 and len(world.d.queue) == 1


def test_a_more_urgent_request_takes_the_place_of_a_prefetched_one() -> None:
    world = World(workers=1, preempt_for_priority=False)
    world.submit("echo:running", priority=5)
    low = world.submit("echo:low", priority=5)
    assert low.run is not None and low.run.prefetched
    urgent = world.submit("echo:urgent", priority=0)
    assert low.state == "queued" and low.attempts == []
    (worker,) = world.serving()
    world.answer_next(worker, "running")
    world.answer_next(worker)  # the taken-back low one, unrun
    assert urgent.run is not None and not urgent.run.prefetched, "urgent goes first"
    assert low.run is not None and low.run.prefetched
    world.answer_next(worker, "urgent")
    world.answer_next(worker, "low")
    assert (urgent.future.result().text, low.future.result().text) == ("urgent", "low")


def test_with_preemption_an_urgent_request_takes_the_running_slot_not_the_prefetch() -> None:
    world = World(workers=1)
    running = world.submit("echo:running", priority=5)
    low = world.submit("echo:low", priority=5)
    urgent = world.submit("echo:urgent", priority=0)
    assert running.preemptions == 1 and low.run is None
    assert world.d.counters["preemptions"] == 1
    # Handed the preempted run's slot: it waits in the worker's socket behind the victim
    # (which stops at its next token) and the taken-back low one (answered unrun).
    (worker,) = world.serving()
    assert urgent.run is not None and urgent.run.prefetched and urgent.run.worker is worker
    assert [slot for _, slot, _ in world.procs[worker.id].inbox] == [0, 1, 2]
    world.answer_next(worker, "running")
    world.answer_next(worker)
    assert not urgent.run.prefetched, "it runs where the victim stopped"
    world.answer_next(worker, "urgent")
    assert urgent.future.result().text == "urgent"
    assert running.state == "running" and low.state == "running", "the low ones after it"


def test_a_cancel_of_a_prefetched_request_acts_at_once_without_a_signal() -> None:
    world = World(workers=1)
    running = world.submit("echo:running")
    cancelled = world.submit("echo:cancelled")
    world.d.cancel(cancelled.request_id, caller_gone=False)
    assert cancelled.future.result().finish_reason == "cancelled"
    (worker,) = world.serving()
    assert world.procs[worker.id].cancel_words == {1: 2}
    world.clock.now += 10.0  # far past cancel_grace_s
    world.d.run_due_timers()
    world.d.after_event()
    assert world.procs[worker.id].signals == [] and not running.future.done()
    world.answer_next(worker, "done")
    world.answer_next(worker)  # the cancelled one, answered unrun
    assert running.future.result().text == "done"
    assert world.d.counters["cancelled"] == 1 and world.d.counters["cancel_escalations"] == 0
    assert not worker.runs and worker.state == "idle"
    assert worker.requests == 1, "the one answered unrun is not a request it served"


def test_the_deadline_of_a_prefetched_request_acts_at_once_without_a_signal() -> None:
    world = World(workers=1)
    running = world.submit("echo:running")
    late = world.submit("echo:late", deadline_s=1.0)
    assert late.run is not None and late.run.prefetched
    world.clock.now += 1.0
    world.d.run_due_timers()
    world.d.after_event()
    with pytest.raises(DeadlineExceeded, match="before a worker could finish"):
        late.future.result()
    world.clock.now += 10.0  # far past cancel_grace_s
    world.d.run_due_timers()
    world.d.after_event()
    (worker,) = world.serving()
    assert world.procs[worker.id].signals == []
    world.answer_next(worker, "done")
    assert running.future.result().text == "done"
    assert world.d.counters["timeouts"] == 1 and late.attempts == []


def test_a_prefetched_request_on_a_worker_that_dies_goes_back_uncharged() -> None:
    world = World(workers=1)
    running = world.submit("echo:running")
    waiting = world.submit("echo:waiting")
    (worker,) = world.serving()
    world.die(worker)
    assert waiting.attempts == [], "charged for a death it did not run in"
    assert [a.outcome for a in running.attempts] == ["crash"]
    (fresh,) = world.serving()
    # The retry first (it was running), then the one that waited behind it.
    assert [prompt for _, _, prompt in world.procs[fresh.id].inbox] == [
        "echo:running",
        "echo:waiting",
    ]
    world.answer_next(fresh, "r")
    world.answer_next(fresh, "w")
    assert waiting.future.result().attempts == 1
    assert running.future.result().attempts == 2


@pytest.mark.parametrize(
    "overrides", [{"prefetch": False}, {"max_requests_per_worker": 1}], ids=["off", "last"]
)
def test_no_prefetch_when_off_or_when_the_current_request_is_the_workers_last(
    overrides: dict[str, Any],
) -> None:
    world = World(workers=1, **overrides)
    world.submit("echo:running")
    waiting = world.submit("echo:waiting")
    assert waiting.state == "queued"
    (worker,) = world.serving()
    assert len(worker.runs) == 1


def test_prefetch_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="prefetch must be true or false"):
        PoolConfig(model="m", prefetch=1)  # type: ignore[arg-type]


def test_a_recalled_worker_signal_is_never_sent_for_a_prefetched_run_at_close() -> None:
    world = World(workers=1)
    world.submit("echo:running")
    world.submit("echo:waiting")
    world.d.begin_close(drain=False, deadline=world.clock.now)
    world.d.after_event()
    (worker,) = world.serving()
    world.answer_next(worker)
    world.answer_next(worker)
    world.d.after_event()
    assert signal.SIGTERM not in world.procs[worker.id].signals
    assert not worker.runs and not world.d.prefetched


def _measure_runs(world: World, worker: Worker, run_s: float, count: int) -> None:
    """``count`` requests, each answered ``run_s`` after it went out, one at a time."""
    for n in range(count):
        world.submit(f"echo:{n}")
        world.clock.now += run_s
        world.answer_next(worker)


def test_runs_far_shorter_than_a_wake_up_are_prefetched_several_deep() -> None:
    world = World(workers=1)
    (worker,) = world.serving()
    _measure_runs(world, worker, 0.0001, 20)  # an echo's run: 0.1 ms
    requests = [world.submit(f"echo:next {n}") for n in range(8)]
    # One running and prefetch.MAX_PREFETCHED behind it, each in its own cancel word.
    assert [slot for _, slot, _ in world.procs[worker.id].inbox] == [0, 1, 2, 3, 4]
    assert sum(run.prefetched for run in worker.runs.values()) == 4
    assert len(world.d.queue) == 3
    # The runs behind start one by one, in order, each as the one before it is answered.
    world.clock.now += 0.0001
    world.answer_next(worker)
    started, behind = requests[1].run, requests[2].run
    assert started is not None and not started.prefetched
    assert behind is not None and behind.prefetched
    assert len(worker.runs) == 5, "the queue's next one went behind them at once"


def test_runs_as_long_as_a_wake_up_or_longer_are_prefetched_one_deep() -> None:
    world = World(workers=1)
    (worker,) = world.serving()
    _measure_runs(world, worker, 0.002, 5)
    for n in range(4):
        world.submit(f"echo:next {n}")
    assert len(worker.runs) == 2 and len(world.d.queue) == 2


def test_a_worker_never_holds_more_runs_than_it_may_still_serve() -> None:
    world = World(workers=1, max_requests_per_worker=30)
    (worker,) = world.serving()
    _measure_runs(world, worker, 0.0001, 27)
    for n in range(8):
        world.submit(f"echo:next {n}")
    assert worker.requests == 27 and len(worker.runs) == 3, "it retires after its 30th"


def test_runs_taken_back_together_keep_their_order_in_the_queue() -> None:
    world = World(workers=1, preempt_for_priority=False)
    (worker,) = world.serving()
    _measure_runs(world, worker, 0.0001, 20)
    low = [world.submit(f"echo:low {n}", priority=5) for n in range(5)]
    assert sum(run.prefetched for run in worker.runs.values()) == 4
    urgent = world.submit("echo:urgent", priority=0)  # the four behind come back
    waiting = [request_id for request_id in world.d.queue if request_id != urgent.request_id]
    assert waiting == [request.request_id for request in low[1:]]


def test_a_run_taken_back_after_it_started_counts_as_served() -> None:
    world = World(workers=2)
    world.submit("echo:long")
    world.submit("echo:quick")
    behind = world.submit("echo:behind")
    first, second = world.serving()
    taken_back = behind.run
    assert taken_back is not None and taken_back.worker is first
    world.answer_next(second)  # idle: the one behind the long run is taken back
    assert taken_back.recalled
    world.answer_next(first, "long")
    served = first.requests
    # Its cancel word came after the worker had started it: answered with text.
    world.procs[first.id].inbox.pop(0)
    world.d.on_message(first, ("done", taken_back.attempt_id, Generation("behind"), 0))
    assert first.requests == served + 1


def test_a_run_started_from_behind_another_is_watched_for_stalls() -> None:
    world = World(workers=1, stall_timeout_s=1.0)
    running = world.submit("echo:running")
    behind = world.submit("echo:behind")
    (worker,) = world.serving()
    world.d.cancel(running.request_id, caller_gone=False)
    world.clock.now += 0.3  # a stall check finds no attached run started: it stops
    world.d.run_due_timers()
    world.answer_next(worker)  # the cancelled one ends; the one behind it starts
    assert behind.run is not None and not behind.run.prefetched
    world.procs[worker.id].progress = lambda: 1  # type: ignore[method-assign]
    for _ in range(8):  # one token, then nothing for 2 s
        world.clock.now += 0.25
        world.d.run_due_timers()
        world.d.after_event()
    assert world.d.counters["stalls"] == 1


@pytest.mark.parametrize(
    "overrides",
    [{"max_requests_per_worker": 1}, {"prefetch": False}],
    ids=["victim-is-its-last", "prefetch-off"],
)
def test_no_request_is_handed_a_slot_where_it_could_not_be_prefetched(
    overrides: dict[str, Any],
) -> None:
    world = World(workers=1, **overrides)
    low = world.submit("echo:low", priority=5)
    urgent = world.submit("echo:urgent", priority=0)
    assert low.preemptions == 1, "preempted all the same"
    assert urgent.state == "queued", "it waits in the pool for the slot, as before"
    served: dict[int, int] = {}
    for _ in range(10):  # the victim lets go; the worker retires where it must
        for each in list(world.d.workers.values()):
            served[each.id] = each.requests
            if each.state == "stopping" and not each.runs:
                world.die(each, 0)
        holding = [w for w in world.serving() if world.procs[w.id].inbox]
        if not holding:
            break
        world.answer_next(holding[0])
    assert urgent.future.result().text == "ok" and low.future.done()
    limit = overrides.get("max_requests_per_worker")
    assert limit is None or max(served.values()) <= limit, served
