"""A fake world that drives the dispatcher step by step, with no processes: its clock,
the dispatcher's I/O (``records.DispatcherIO``), workers made ready, requests made and
submitted, deaths. Each test file gives it the fake worker process that records what it
needs of what the dispatcher sends (``test_batch_dispatch``, ``test_prefetch``)::

    class World(FakeWorld[Proc]):
        def __init__(self, workers: int) -> None:
            config = PoolConfig(model="m", backend="testing", workers=workers)
            super().__init__(config, Proc, slots=1)

    world = World(workers=2)
    request = world.new_request("echo:hi", priority=0, deadline_s=60.0)
    world.submit_request(request)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from modelpool.shared.config import PoolConfig
from modelpool.shared.protocol import PROTOCOL_VERSION, WorkerSpec, encode_request
from modelpool.supervisor.dispatcher import Dispatcher
from modelpool.supervisor.records import Request, Worker
from modelpool.supervisor.results import PoolFuture

P = TypeVar("P")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeWorld(Generic[P]):
    """A started dispatcher over ``config`` whose workers are ``proc`` (called with each
    worker's pid) and say ready at once with ``slots`` slots."""

    def __init__(self, config: PoolConfig, proc: Callable[[int], P], *, slots: int) -> None:
        self.clock = Clock()
        self.procs: dict[int, P] = {}
        self.config = config
        self._proc = proc
        self._slots = slots
        self.d = Dispatcher(self.config, self, devices=["cpu"], clock=self.clock)
        self.d.start()
        for worker in list(self.d.workers.values()):
            self.ready(worker)
        self.d.after_event()
        self.numbers = 0

    # DispatcherIO
    def spawn(self, worker: Worker, spec: WorkerSpec) -> P:
        proc = self._proc(1000 + worker.id)
        self.procs[worker.id] = proc
        return proc

    def check_release(self, worker: Worker) -> None:
        self.d.worker_manager.on_release_checked(worker.id, True, 0.0, "psutil", None, None)

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        return None

    def gpu_workers_changed(self, workers: list[tuple[int, int, str, int | None]]) -> None:
        return None

    # driving
    def ready(self, worker: Worker) -> None:
        message = ("ready", PROTOCOL_VERSION, 1000 + worker.id, 0, None, self._slots)
        self.d.on_message(worker, message)

    def new_request(self, prompt: str, *, priority: int, deadline_s: float) -> Request:
        """A request for ``prompt`` (r1, r2, ... in order), not submitted yet."""
        self.numbers += 1
        request_id = f"r{self.numbers}"
        return Request(
            request_id=request_id,
            payload=encode_request(prompt, {}),
            future=PoolFuture(request_id, lambda _: None),
            submitted_at=self.clock.now,
            deadline=self.clock.now + deadline_s,
            priority=priority,
        )

    def submit_request(self, request: Request, *, pump: bool = True) -> Request:
        """``request`` submitted, and dispatched unless ``pump`` is false."""
        self.d.submit(request)
        if pump:
            self.d.after_event()
        return request

    def die(self, worker: Worker, code: int = -11) -> None:
        """The worker exits with ``code``; its replacements say ready at once."""
        self.d.on_exit(worker, code)
        for fresh in list(self.d.workers.values()):
            if fresh.state == "starting":
                self.ready(fresh)
        self.d.after_event()
