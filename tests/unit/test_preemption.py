"""Which running attempts a more urgent request preempts, and how a rerun continues its
caller's stream (``preemption.py``), over plain records and in the dispatcher's fake
world of ``test_batch_dispatch`` (no processes)."""

from __future__ import annotations

from typing import cast

from test_batch_dispatch import World

from modelpool.scheduling.preemption import choose_victims, worth_looking
from modelpool.shared.errors import BackendError
from modelpool.shared.protocol import Generation
from modelpool.supervisor.records import Request, Run, Worker
from modelpool.supervisor.results import PoolFuture


def _request(name: str, priority: int, *, at: float = 0.0, **fields: object) -> Request:
    request = Request(name, b"", PoolFuture(name, lambda rid: None), at, at + 60.0)
    request.priority = priority
    for key, value in fields.items():
        setattr(request, key, value)
    return request


def _worker(identity: int, *requests: Request, started: float = 1.0) -> Worker:
    worker = Worker(id=identity, slot=identity, device="cpu", started_at=0.0)
    worker.state, worker.role = "busy", "serving"
    worker.slots = max(1, len(requests))
    for n, request in enumerate(requests):
        run = Run(n + 10 * identity, request, request, worker, n, started + n, 100.0)
        request.run = run
        worker.runs[run.attempt_id] = run
    return worker


def _victims(waiting: list[Request], *workers: Worker, left_s: float = 0.0) -> list[str]:
    pairs = choose_victims(waiting, workers, now=5.0, aging_s=10.0, min_time_left_s=left_s)
    chosen_for = [waiting.index(request) for _, request in pairs]
    assert chosen_for == sorted(set(chosen_for)), "one each, the most urgent first"
    return [cast(Request, run.request).request_id for run, _ in pairs]


def test_the_least_urgent_and_latest_started_run_is_preempted_first() -> None:
    a, b, c = _request("a", 5), _request("b", 9), _request("c", 9)
    worker = _worker(1, a, b, c)
    assert worth_looking({0: 2}, [worker])
    assert _victims([_request("u1", 0), _request("u2", 0)], worker) == ["c", "b"]
    assert _victims([_request("u", 9)], worker) == [], "same priority: no preemption"
    assert not worth_looking({9: 1}, [worker])


def test_a_slot_on_its_way_is_used_before_another_preemption() -> None:
    a, b = _request("a", 5), _request("b", 5)
    worker = _worker(1, a, b)
    next(iter(worker.runs.values())).preempted = True  # a's slot frees at its next step
    next(iter(worker.runs.values())).cancel_sent = True
    assert _victims([_request("u1", 0)], worker) == []
    assert _victims([_request("u1", 0), _request("u2", 0)], worker) == ["b"]


def test_promoted_and_sampled_streamed_runs_are_not_preempted() -> None:
    old = _request("old", 5, at=-20.0)  # waited past priority_aging_s
    sampled = _request("sampled", 5, reproducible=False, streamed=True)
    quiet = _request("quiet", 5, reproducible=False)  # streamed nothing yet
    worker = _worker(1, old, sampled, quiet)
    assert _victims([_request(f"u{i}", 0) for i in range(3)], worker) == ["quiet"]


def test_a_rerun_sends_only_what_its_caller_has_not_seen() -> None:
    run = Run(1, None, cast(Request, None), cast(Worker, None), 0, 0.0, 1.0, skip="t0 t1 ")
    assert run.continue_stream("t0 ") == ("send", "")
    assert run.continue_stream("t1 t2 ") == ("send", "t2 ")
    assert run.skip == "", "caught up: the rest goes straight through"
    assert run.continue_stream("t3 ") == ("send", "t3 ")


def test_a_rerun_with_other_text_is_reported_diverged() -> None:
    run = Run(1, None, cast(Request, None), cast(Worker, None), 0, 0.0, 1.0, skip="t0 t1 ")
    assert run.continue_stream("t0 ") == ("send", "")
    assert run.continue_stream("x1 ") == ("diverged", "")


def test_a_run_near_its_deadline_is_spared_and_one_preempted_before_goes_last() -> None:
    near = _request("near", 5, deadline=19.0)  # 14 s left at 5.0
    again = _request("again", 5, preemptions=1)
    fresh = _request("fresh", 5)
    worker = _worker(1, near, again, fresh)
    waiting = [_request(f"u{i}", 0) for i in range(3)]
    assert _victims(waiting, worker, left_s=20.0) == ["fresh", "again"], "near would time out"


def _chunk(world: World, request: Request, text: str) -> None:
    run = request.run
    assert run is not None
    world.d.on_message(run.worker, ("chunk", run.attempt_id, text))


def _let_go(world: World, run: Run, text: str) -> None:
    """The worker answers for a preempted run: it stopped (cancelled)."""
    world.procs[run.worker.id].runs.pop(run.attempt_id, None)
    world.d.on_message(run.worker, ("done", run.attempt_id, Generation(text, "cancelled"), 0))
    world.d.after_event()


def test_a_full_batch_hands_a_slot_over_and_the_victim_reruns_as_one_stream() -> None:
    world = World(workers=1, batch=2)
    seen: list[str] = []
    first, second = world.submit("long0", priority=5), world.submit("long1", priority=5)
    second.on_chunk = seen.append
    _chunk(world, second, "t0 ")
    _chunk(world, second, "t1 ")
    victim = second.run
    assert victim is not None
    world.clock.now += 1.0
    urgent = world.submit("urgent", priority=0)
    # The one started last is cancelled and queued again, first of its priority; the
    # urgent request is sent to its worker with the cancel, in a cancel word of its own,
    # so that the worker starts it where it lets the victim go.
    proc = world.procs[victim.worker.id]
    assert proc.cancels == [(victim.slot, victim.attempt_id)]
    assert second.state == "queued" and [a.outcome for a in second.attempts] == ["preempted"]
    assert urgent.state == "running" and first.state == "running"
    assert urgent.run is not None and urgent.run.worker is victim.worker
    assert urgent.run.slot not in (victim.slot, cast(Run, first.run).slot)
    assert world.d.counters["preemptions"] == 1
    other = first.run
    urgent2 = world.submit("urgent2", priority=0)
    assert world.d.counters["preemptions"] == 2, "another urgent one: the other low run"
    assert other is not None and first.state == "queued" and urgent2.state == "running"
    slots = [run.slot for run in victim.worker.runs.values()]
    assert len(slots) == len(set(slots)) == 4, "two winding down, two handed their slots"
    late = world.submit("late", priority=0)
    assert late.state == "queued" and world.d.counters["preemptions"] == 2, "nothing left"
    _let_go(world, victim, "t0 t1 ")
    _let_go(world, other, "")
    assert late.state == "queued", "the two slots are the urgent ones'"
    world.finish(urgent)
    world.finish(urgent2)
    world.finish(late)
    assert first.state == second.state == "running", "the low ones run again"
    _chunk(world, second, "t0 ")  # the rerun repeats what the caller saw: not sent
    _chunk(world, second, "t1 t2 ")
    world.finish(second, "t0 t1 t2 t3 ")
    assert seen == ["t0 ", "t1 ", "t2 ", "t3 "], "one answer: none twice, none lost"
    assert second.future.result().text == "t0 t1 t2 t3 "
    assert world.d.counters["retries"] == 0, "a preemption is not a retry"


def test_a_rerun_that_streams_other_text_fails_rather_than_contradict_the_stream() -> None:
    world = World(workers=1, batch=1)
    seen: list[str] = []
    low = world.submit("long", priority=5)
    low.on_chunk = seen.append
    _chunk(world, low, "t0 ")
    victim = low.run
    assert victim is not None
    world.clock.now += 1.0
    urgent = world.submit("urgent", priority=0)
    _let_go(world, victim, "t0 ")
    world.finish(urgent)
    _chunk(world, low, "x0 ")
    assert low.state == "done" and seen == ["t0 "]
    error = low.future.exception()
    assert isinstance(error, BackendError) and "preempted" in str(error)
