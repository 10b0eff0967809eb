"""The dispatcher's batching rules, driven step by step with a fake world (no processes).

Slots and placement, the collateral and poison rules of ``Retries.batch_lost``, and
the two regressions the chaos harness found: an isolated request shared its worker with
requests placed in the same dispatch round, and a worker killed for an ignored cancel
charged its batch twice (once at the cancel, once at its exit).
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from fake_world import FakeWorld
from modelpool.shared.config import PoolConfig, RetryPolicy
from modelpool.shared.errors import BackendError, PoisonRequest, WorkerCrashed
from modelpool.shared.protocol import Generation
from modelpool.supervisor.records import FailedBatch, Request, Worker


class Proc:
    """One fake worker process: what the dispatcher sent and flagged."""

    def __init__(self, pid: int) -> None:
        self.pid: int | None = pid
        self.runs: dict[int, tuple[int, str]] = {}  # attempt id -> (slot, prompt)
        self.cancels: list[tuple[int, int]] = []
        self.signals: list[int] = []
        self.progress_count = 0
        self.withdrawals: list[int] = []

    def send(self, message: tuple[Any, ...]) -> None:
        if message[0] == "withdraw":
            self.withdrawals.append(message[1])
        if message[0] == "run":
            import pickle

            _, attempt_id, slot, payload = message
            prompt, _ = pickle.loads(payload)
            assert slot not in {s for s, _ in self.runs.values()}, "slot used twice"
            self.runs[attempt_id] = (slot, prompt)

    def request_cancel(self, slot: int, attempt_id: int) -> None:
        self.cancels.append((slot, attempt_id))

    def progress(self) -> int:
        return self.progress_count

    def signal_group(self, signum: int) -> None:
        self.signals.append(signum)


class World(FakeWorld[Proc]):
    def __init__(self, workers: int, spares: int = 0, batch: int = 4, **overrides: Any) -> None:
        config = PoolConfig(
            model="m",
            backend="testing",
            workers=workers,
            spares=spares,
            max_batch_size=batch,
            devices=("cpu",),
            deadline_s=60.0,
            cancel_grace_s=0.5,
            term_grace_s=0.5,
            retry=RetryPolicy(max_retries=2),
            # A one-call world (batch=1) answers only the runs a test finishes: the run a
            # one-call worker holds prefetched behind its current one is test_prefetch's.
            **{"prefetch": False, **overrides},
        )
        super().__init__(config, Proc, slots=8)

    def submit(
        self, prompt: str, *, pump: bool = True, batch_failures: int = 0, priority: int = 0
    ) -> Request:
        request = self.new_request(prompt, priority=priority, deadline_s=self.config.deadline_s)
        request.batch_failures = batch_failures
        request.suspected_in = [FailedBatch([request]) for _ in range(batch_failures)]
        return self.submit_request(request, pump=pump)

    def worker_of(self, request: Request) -> Worker:
        assert request.run is not None, request.state
        return request.run.worker

    def finish(self, request: Request, text: str = "ok") -> None:
        run = request.run
        assert run is not None
        self.procs[run.worker.id].runs.pop(run.attempt_id, None)
        self.d.on_message(run.worker, ("done", run.attempt_id, Generation(text), 0))
        self.d.after_event()


def test_capacity_is_slots_and_the_least_loaded_worker_goes_first() -> None:
    world = World(workers=2, batch=3)
    requests = [world.submit(f"p{index}") for index in range(7)]
    loads = sorted(len(w.runs) for w in world.d.workers.values())
    assert loads == [3, 3], "two workers of three slots each"
    assert sum(r.state == "queued" for r in requests) == 1
    assert world.d.snapshot().capacity == 6
    first, second = world.worker_of(requests[0]), world.worker_of(requests[1])
    assert first is not second, "the second request went to the emptier worker"


def test_cancel_flags_only_its_own_slot_and_the_worker_stays_busy() -> None:
    world = World(workers=1, batch=4)
    requests = [world.submit(f"p{index}") for index in range(3)]
    worker = world.worker_of(requests[1])
    run = requests[1].run
    assert run is not None
    world.d.cancel(requests[1].request_id, False)
    proc = world.procs[worker.id]
    assert proc.cancels == [(run.slot, run.attempt_id)]
    assert worker.state == "busy", "the others keep the worker busy"
    extra = world.submit("p3")
    assert extra.state == "running", "a cancelled run does not close the worker to others"


def test_a_crash_in_a_batch_retries_the_others_as_collateral_uncharged() -> None:
    world = World(workers=1, spares=1, batch=4)
    requests = [world.submit(f"p{index}") for index in range(3)]
    world.die(world.worker_of(requests[0]))
    for request in requests:
        assert request.state in ("running", "queued")
        assert [a.outcome for a in request.attempts] == ["collateral"]
        assert request.batch_failures == 1 and not request.isolated
    assert world.d.counters["collateral_retries"] == 3
    assert world.d.counters["retries"] == 0, "collateral retries are not charged"
    # Suspects are spread, one per worker: one runs on the promoted spare at once, the
    # others wait for another worker rather than share a batch with it.
    assert sum(r.state == "running" for r in requests) == 1
    fresh = world.submit("fresh")
    assert fresh.state == "running", "a request that is no suspect joins the batch"


def test_the_culprit_failing_alone_clears_its_batch_and_the_others_run_together() -> None:
    world = World(workers=1, spares=1, batch=4)
    innocents = [world.submit(f"innocent{index}") for index in range(3)]
    culprit = world.submit("culprit")
    world.die(world.worker_of(culprit))
    # The newest of the batch is first in the queue: it runs on the promoted spare, the
    # other suspects wait rather than share its batch.
    assert culprit.state == "running" and all(r.state == "queued" for r in innocents)
    world.die(world.worker_of(culprit))  # it fails alone: the batch's failure is explained
    assert culprit.isolated and not any(r.suspect for r in innocents)
    # The innocents now share the next worker, each re-run once; the culprit waits behind
    # them for an empty worker.
    worker = world.worker_of(innocents[0])
    assert all(world.worker_of(r) is worker for r in innocents)
    assert culprit.state == "queued"
    for request in innocents:
        assert [a.outcome for a in request.attempts] == ["collateral"]
        world.finish(request)
    assert world.worker_of(culprit) is worker and next(iter(worker.runs.values())).alone
    world.die(worker)
    with pytest.raises(PoisonRequest, match="suspect"):
        culprit.future.result(timeout=0)


def test_a_poison_request_fails_as_the_suspect_within_three_attempts() -> None:
    world = World(workers=2, spares=1, batch=4, max_queue=100)
    poison = world.submit("poison")
    for index in range(5):
        world.submit(f"filler{index}")
    deaths = 0
    while poison.state != "done":
        if poison.state == "queued":
            # Suspects wait for a worker with no other suspect: let the others finish.
            for request in list(world.d.live.values()):
                if request is not poison and request.state == "running":
                    world.finish(request)
        worker = world.worker_of(poison)
        if poison.isolated:
            # Alone on its worker, and nothing placed beside it in the same round.
            assert [run.owner for run in worker.runs.values()] == [poison]
            assert (
                world.submit("late").run is None
                or world.worker_of(world.d.live[f"r{world.numbers}"]) is not worker
            )
        else:
            world.submit("beside")
        world.die(worker)
        deaths += 1
        assert deaths <= 3, poison.attempts
    with pytest.raises(PoisonRequest, match="suspect"):
        poison.future.result(timeout=0)
    assert world.d.counters["poison_requests"] == 1
    assert all(a.outcome in ("collateral", "crash") for a in poison.attempts)
    assert sum(a.outcome == "crash" for a in poison.attempts) <= 2


def test_an_isolated_request_gets_an_empty_worker_to_itself_in_one_round() -> None:
    world = World(workers=2, batch=4)
    busy = world.submit("busy")
    isolated = world.submit("isolated", pump=False, batch_failures=2)
    others = [world.submit(f"o{index}", pump=False) for index in range(4)]
    world.d.after_event()
    worker = world.worker_of(isolated)
    assert worker is not world.worker_of(busy), "it needs an empty worker"
    assert next(iter(worker.runs.values())).alone and len(worker.runs) == 1
    assert all(world.worker_of(o) is world.worker_of(busy) for o in others[:3])
    assert others[3].state == "queued"


def test_a_stream_that_showed_text_fails_typed_with_its_batch() -> None:
    world = World(workers=1, spares=1, batch=4)
    streamed = world.submit("s")
    quiet = world.submit("q")
    run = streamed.run
    assert run is not None
    streamed.on_chunk = lambda text: None
    world.d.on_message(run.worker, ("chunk", run.attempt_id, "hello"))
    world.die(run.worker)
    with pytest.raises(WorkerCrashed) as caught:
        streamed.future.result(timeout=0)
    assert not isinstance(caught.value, PoisonRequest)
    assert quiet.state == "running" and quiet.attempts[0].outcome == "collateral"


def test_a_worker_killed_for_an_ignored_cancel_counts_its_batch_once() -> None:
    world = World(workers=1, spares=1, batch=4)
    stuck = world.submit("stuck")
    other = world.submit("other")
    worker = world.worker_of(stuck)
    world.d.cancel(stuck.request_id, False)
    world.clock.now += 1.0  # past cancel_grace_s: the cancel was ignored
    world.d.run_due_timers()
    world.d.after_event()
    assert signal.SIGTERM in world.procs[worker.id].signals
    assert other.batch_failures == 1 and other.attempts[0].outcome == "collateral"
    world.die(worker, -15)
    assert other.batch_failures == 1, "the exit charged the same batch again"


def test_max_batch_size_one_keeps_the_unbatched_rules() -> None:
    world = World(workers=1, spares=1, batch=1)
    request = world.submit("p")
    world.die(world.worker_of(request))
    assert [a.outcome for a in request.attempts] == ["crash"]
    assert world.d.counters["retries"] == 1 and world.d.counters["collateral_retries"] == 0
    assert request.batch_failures == 0 and request.alone_failures == 0


# ---- issue 26: placement that sees the cache, a lost step, one worker without a spare ------


def test_requests_placed_together_spread_over_idle_workers() -> None:
    world = World(workers=2, batch=4)
    requests = [world.submit(f"p{index}", pump=False) for index in range(4)]
    world.d.after_event()
    loads = sorted(len(w.runs) for w in world.d.workers.values())
    assert loads == [2, 2], "least loaded first, counting this round's placements"
    assert all(r.state == "running" for r in requests)


def test_a_worker_with_requests_waiting_for_kv_room_gets_no_more_while_another_has_room() -> None:
    world = World(workers=2, batch=4)
    long = world.submit("long")
    crowded = world.worker_of(long)
    other = next(w for w in world.d.workers.values() if w is not crowded)
    behind = world.submit("behind")
    assert world.worker_of(behind) is other
    third = world.submit("third")
    assert world.worker_of(third) is crowded, "the premise: it is the least loaded"
    third_run = third.run
    assert third_run is not None
    # The crowded worker says that "third" waits there for KV room.
    world.d.on_message(crowded, ("room", 10, [third_run.attempt_id]))
    shown = {w.id: w for w in world.d.snapshot().workers}[crowded.id]
    assert shown.waiting_for_room == [third.request_id]
    assert third.request_id not in shown.running and shown.kv_free_tokens == 10
    fourth = world.submit("fourth")
    assert world.worker_of(fourth) is other, "not queued behind a request waiting for room"
    world.d.on_message(
        other, ("room", 0, [world.procs[other.id].runs and max(world.procs[other.id].runs)])
    )
    fifth = world.submit("fifth")
    assert fifth.state == "queued", "every worker is full: it waits in the pool"
    world.d.on_message(crowded, ("room", 500, []))
    world.d.after_event()
    assert world.worker_of(fifth) is crowded


def test_equal_loads_go_to_the_worker_with_more_kv_room() -> None:
    world = World(workers=2, batch=4)
    first, second = world.submit("a"), world.submit("b")
    small, large = world.worker_of(first), world.worker_of(second)
    world.d.on_message(small, ("room", 40, []))
    world.d.on_message(large, ("room", 4000, []))
    assert world.worker_of(world.submit("c")) is large


def test_a_failed_step_is_a_lost_batch_on_a_worker_that_stays() -> None:
    world = World(workers=1, batch=4)
    requests = [world.submit(f"p{index}") for index in range(3)]
    worker = world.worker_of(requests[0])
    lost = [r.run.attempt_id for r in requests[:2] if r.run is not None]
    for attempt_id in lost:  # the worker dropped them from its batch
        world.procs[worker.id].runs.pop(attempt_id)
    world.d.on_message(worker, ("batch_error", lost, "backend", "RuntimeError: boom", "tb", 0, {}))
    world.d.after_event()
    assert worker.state in ("idle", "busy") and not world.procs[worker.id].signals
    for request in requests[:2]:
        assert [a.outcome for a in request.attempts] == ["collateral"], "never charged"
        assert request.suspect
    assert world.d.counters["collateral_retries"] == 2 and world.d.counters["failed"] == 0
    # One suspect at a time on the only worker, back on the same worker: it stays warm.
    assert sum(r.state == "running" for r in requests[:2]) == 1
    assert requests[2].state == "running" and requests[2].attempts == []


def test_a_failed_step_of_one_row_is_that_requests_error() -> None:
    world = World(workers=1, batch=4)
    alone = world.submit("alone")
    run = alone.run
    assert run is not None
    world.d.on_message(
        run.worker, ("batch_error", [run.attempt_id], "backend", "RuntimeError: boom", "", 0, {})
    )
    with pytest.raises(BackendError, match="boom"):
        alone.future.result(timeout=0)


@pytest.mark.parametrize("fault", ["stall", "ignored_cancel"])
def test_one_worker_without_a_spare_retries_the_innocents_of_a_killed_batch(fault: str) -> None:
    world = World(workers=1, batch=4, stall_timeout_s=1.0)
    innocents = [world.submit(f"innocent{index}") for index in range(3)]
    culprit = world.submit("culprit")
    worker = world.worker_of(culprit)
    if fault == "stall":
        world.clock.now += 0.3
        world.d.run_due_timers()
        world.clock.now += 2.0
        world.d.run_due_timers()
    else:
        world.d.cancel(culprit.request_id, False)
        world.clock.now += 1.0
        world.d.run_due_timers()
    world.d.after_event()
    assert signal.SIGTERM in world.procs[worker.id].signals
    for request in innocents:
        assert not request.future.done(), request.future
        assert [a.outcome for a in request.attempts] == ["collateral"]
    assert world.d.counters["collateral_retries"] >= 3
    world.die(worker, -15)
    # The replacement takes them, one suspect at a time (the newest of the batch first).
    replacement = next(w for w in world.d.workers.values() if w.state != "dead")
    assert replacement is not worker and len(replacement.runs) == 1


def test_a_request_waiting_for_room_is_withdrawn_to_a_worker_with_room() -> None:
    world = World(workers=2, batch=4)
    long = world.submit("long")
    crowded = world.worker_of(long)
    other = next(w for w in world.d.workers.values() if w is not crowded)
    busy = [world.submit("busy0")]
    short = world.submit("short")
    assert world.worker_of(short) is crowded, "the premise: it was placed beside long"
    busy.append(world.submit("busy1"))
    run = short.run
    assert run is not None
    world.d.on_message(crowded, ("room", 5, [run.attempt_id]))
    assert world.procs[crowded.id].withdrawals == [run.attempt_id]
    world.d.on_message(crowded, ("room", 5, [run.attempt_id]))
    assert world.procs[crowded.id].withdrawals == [run.attempt_id], "asked once"
    world.procs[crowded.id].runs.pop(run.attempt_id)
    world.d.on_message(crowded, ("withdrawn", run.attempt_id))
    world.d.after_event()
    assert world.worker_of(short) is other
    assert short.attempts == [], "a withdrawal is no attempt"
    assert world.d.counters["withdrawn"] == 1
    assert all(r.state == "running" for r in busy)
