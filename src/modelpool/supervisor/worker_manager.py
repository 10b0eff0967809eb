"""The worker side of the dispatcher: slots, start-up, recycling, roles and signals.

``WorkerManager`` is owned by ``dispatcher.Dispatcher`` and runs only on the dispatcher
thread, as the Dispatcher does; it holds the worker records (``Dispatcher.workers`` is
the same dict) and everything that decides about workers as processes, and nothing
about requests. The split follows pebble's pool, which keeps a task manager and a
worker manager: the Dispatcher places requests, settles attempts, retries and resolves;
this object keeps the slots filled and the workers in line.

What it decides, grouped as below:

- slots and start-up: ``start``/``spawn`` a worker per slot, ``fill_slots`` after a death
  (not while its GPU memory is unverified or blocked, not before a start-up backoff),
  start-up timeouts, ``startup_failed`` (backoff, an abandoned slot, or the pool's
  ``ModelLoadFailed``, which it hands to its owner), ``on_ready``, early deaths
  (``record_exit``, ``EARLY_DEATH_S``);
- recycling and roles: ``retire_reason``, ``maybe_retire`` (with spares, only once an
  idle spare takes its place), ``stop_worker``, ``rebalance`` (spares into gaps);
- signals, the process end of the kill ladder: ``send_signal`` (SIGTERM re-arms to
  SIGKILL after ``term_grace_s``), ``rearm_ladder``, ``kill_if_alive``,
  ``channel_closed``, ``kill_all``, ``after_backend_error`` (a sticky CUDA error
  replaces the worker, an out-of-memory that left memory allocated recycles it);
- memory: release checks after an exit (``after_exit``, ``on_release_checked``), GPUs
  blocked until their memory is free (``on_device_free``), NVML samples
  (``on_gpu_sample``), ``pool_device`` (a worker's GPU in the pool's numbering) and the
  worker and GPU parts of ``Dispatcher.snapshot``.

It asks one thing of its owner (``PoolSide``): to fail the pool when workers cannot
start, since that settles requests. The run-level side of the ladder (a run's cancel
flag and its grace) stays with the Dispatcher, which owns the runs.
"""

from __future__ import annotations

import collections
import itertools
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import ModelLoadFailed
from modelpool.shared.protocol import PROTOCOL_VERSION, TASKS, PrefixCacheReport, Task, WorkerSpec
from modelpool.shared.reasoning.controls import pool_params
from modelpool.supervisor.devices import group_devices
from modelpool.supervisor.observe import Observers, WorkerEvent
from modelpool.supervisor.prefix_tiers import tier_specs
from modelpool.supervisor.records import DispatcherIO, TimerHeap, Worker, describe_exit
from modelpool.supervisor.stats import (
    DeviceStats,
    GpuStats,
    PrefixCacheStats,
    ReleaseStats,
    WorkerStats,
)

# The records keep the dispatcher's logger: this is its worker side, and logging set up
# for "modelpool.supervisor.dispatcher" must still see them.
logger = logging.getLogger("modelpool.dispatcher")

# A worker that dies on its own this soon after saying ready counts as a failed start
# (backoff, then ModelLoadFailed or an abandoned slot), like one that never got ready.
EARLY_DEATH_S = 5.0


class PoolSide(Protocol):
    """What the worker side reads of its owner, and the one thing it asks of it."""

    @property
    def closing(self) -> bool: ...

    @property
    def failure(self) -> ModelLoadFailed | None: ...

    @property
    def observers(self) -> Observers: ...

    def give_up_loading(self, failure: ModelLoadFailed) -> None:
        """Workers failed to start too often and none serves: the pool has failed."""
        ...


class WorkerManager:
    """Owns the worker records and every decision about worker processes; see the
    module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        io: DispatcherIO,
        owner: PoolSide,
        *,
        devices: list[str],
        clock: Callable[[], float],
        timers: TimerHeap,
        counters: dict[str, int],
        gpu_available: bool,
        gpu_reason: str | None,
    ) -> None:
        self.config = config
        self.io = io
        self.owner = owner
        self.devices = devices
        self.clock = clock
        self.timers = timers
        self.counters = counters
        self.gpu_available = gpu_available
        self.gpu_reason = gpu_reason
        self.gpu_devices: list[DeviceStats] = []

        self.workers: dict[int, Worker] = {}
        self.kill_reasons: collections.Counter[str] = collections.Counter()
        self.releases = ReleaseStats()
        self.blocked_devices: dict[str, int] = {}  # GPU -> bytes it must have free again
        self.blocked_held: dict[str, int | None] = {}  # GPU -> bytes a dead worker still held
        self.blocked_holders: dict[str, list[str]] = {}  # GPU -> who holds them, as found
        self.abandoned_slots: set[int] = set()
        self.slot_not_before: dict[int, float] = {}
        self.slots_awaiting_release: set[int] = set()
        self.retire_waiting: set[int] = set()
        self.last_load_error: str | None = None
        # The model's context length as the workers report it (the smallest, should they
        # ever differ); kept when they leave, so stats still show it between respawns.
        self.max_model_len: int | None = None
        # What the model does, from the workers' "ready" (protocol.Task).
        self.task: Task = "generate"
        self.consecutive_startup_failures = 0
        self.pending_release_checks = 0
        self._worker_ids = itertools.count()

    def start(self) -> None:
        for slot in range(self.slot_count):
            self.spawn(slot, replacement=False)

    # ---- slots and start-up --------------------------------------------------------------

    @property
    def slot_count(self) -> int:
        return self.config.workers + self.config.spares

    def spawn(self, slot: int, *, replacement: bool) -> None:
        device = self.devices[slot % len(self.devices)]
        now = self.clock()
        worker = Worker(id=next(self._worker_ids), slot=slot, device=device, started_at=now)
        self.workers[worker.id] = worker
        spec = WorkerSpec(
            model=self.config.model,
            backend=self.config.backend,
            backend_options=self.config.backend_options,
            device=device,
            sys_path=list(sys.path),
            log_level=logging.getLogger("modelpool").getEffectiveLevel(),
            generation_defaults={**pool_params(self.config), **self.config.generation_defaults},
            max_batch_size=self.config.max_batch_size,
            poll_s=self.config.worker_poll_s,
            image_limits=self.config.image_limits,
            prefix_tiers=tier_specs(self.config),
        )
        if replacement:
            self.counters["respawns"] += 1
        try:
            worker.io = self.io.spawn(worker, spec)
        except Exception as exc:
            # Whatever the cause (no memory for a process, a device that cannot be mapped),
            # it is this worker's failed start, never the dispatcher's death.
            logger.error("worker %d: could not start a process: %s", worker.id, exc)
            worker.load_error = f"could not start a worker process: {exc}"
            del self.workers[worker.id]
            self.startup_failed(worker)
            return
        worker.pid = worker.io.pid
        worker.startup_timer = self.timers.call_at(
            now + self.config.startup_timeout_s, self._on_startup_timeout, worker
        )
        logger.debug("worker %d (pid %s) starting on %s", worker.id, worker.pid, device)

    def group_blocked(self, label: str) -> bool:
        """A GPU that still holds a dead worker's memory blocks every group it belongs to."""
        return any(device in self.blocked_devices for device in group_devices(label))

    def _slot_filled(self, slot: int) -> bool:
        return any(w.slot == slot and w.state != "dead" for w in self.workers.values())

    def another_worker_exists(self, failed: Worker) -> bool:
        """Can some worker other than ``failed`` ever take a retry?

        A retry never goes back to the worker that just failed it. Other live workers
        can take it; so can a replacement, in any slot that may still be filled, and
        in the failed worker's own slot if that worker is on its way out.
        """
        if any(w is not failed and w.state != "dead" for w in self.workers.values()):
            return True
        leaving = failed.state in ("cancelling", "killing", "dead")
        for slot in range(self.slot_count):
            if slot in self.abandoned_slots:
                continue
            if self.group_blocked(self.devices[slot % len(self.devices)]):
                continue
            if slot != failed.slot or leaving:
                return True
        return False

    def fill_slots(self) -> None:
        if self.owner.closing or self.owner.failure is not None:
            return
        now = self.clock()
        for slot in range(self.slot_count):
            if (
                slot in self.abandoned_slots
                or slot in self.slots_awaiting_release
                or self._slot_filled(slot)
            ):
                continue
            if self.group_blocked(self.devices[slot % len(self.devices)]):
                continue
            not_before = self.slot_not_before.get(slot, 0.0)
            if not_before > now:
                continue
            self.slot_not_before.pop(slot, None)
            self.spawn(slot, replacement=True)

    def _on_startup_timeout(self, worker: Worker) -> None:
        if worker.state != "starting":
            return
        worker.load_error = (
            f"worker {worker.id} was not ready within startup_timeout_s="
            f"{self.config.startup_timeout_s}"
        )
        self.send_signal(worker, signal.SIGKILL, "startup_timeout")

    def startup_failed(self, worker: Worker) -> None:
        self.counters["startup_failures"] += 1
        self.consecutive_startup_failures += 1
        error_text = worker.load_error or (
            f"worker {worker.id} {describe_exit(worker.exit_code)} before it was ready"
        )
        self.last_load_error = error_text
        logger.error(
            "worker %d failed to start: %s", worker.id, error_text.strip().splitlines()[-1]
        )
        limit = self.config.startup_failures_before_giving_up
        if self.consecutive_startup_failures < limit:
            backoff = min(30.0, 0.25 * 2 ** (self.consecutive_startup_failures - 1))
            when = self.clock() + backoff
            self.slot_not_before[worker.slot] = when
            self.timers.call_at(when, self.fill_slots)
            return
        if any(w.state not in ("starting", "dead") for w in self.workers.values()):
            # Others serve: keep them, give up on this slot, and say so in the state.
            self.abandoned_slots.add(worker.slot)
            logger.error(
                "giving up on worker slot %d after %d start-up failures in a row",
                worker.slot,
                self.consecutive_startup_failures,
            )
            return
        self.owner.give_up_loading(
            ModelLoadFailed(
                f"workers failed to start {self.consecutive_startup_failures} times in a row; "
                f"last error: {error_text.strip().splitlines()[-1] if error_text.strip() else '?'}",
                worker_traceback=error_text,
            )
        )

    def on_ready(
        self,
        worker: Worker,
        version: int,
        pid: int,
        rss_bytes: int,
        max_model_len: int | None = None,  # absent from an older worker, refused just below
        slots: int = 1,
        task: str = "generate",
    ) -> None:
        if worker.state != "starting" or worker.signalled:
            return  # A "ready" that crossed the start-up timeout's SIGKILL: it is dying.
        self.timers.cancel(worker.startup_timer)
        if version != PROTOCOL_VERSION:
            worker.load_error = (
                f"worker speaks protocol {version}, supervisor {PROTOCOL_VERSION}: "
                "mixed modelpool installations"
            )
            self.send_signal(worker, signal.SIGKILL, "protocol")
            return
        worker.state = "idle"
        worker.slots = max(1, min(int(slots), self.config.max_batch_size))
        # Without spares every worker serves; with them, _rebalance decides.
        worker.role = "spare" if self.config.spares else "serving"
        worker.pid = pid
        worker.ready_at = self.clock()
        worker.rss_bytes = rss_bytes
        worker.max_model_len = max_model_len
        if task in TASKS:
            self.task = task
        if max_model_len is not None and (
            self.max_model_len is None or max_model_len < self.max_model_len
        ):
            self.max_model_len = max_model_len
        # The crash-loop count is cleared once this worker has outlived EARLY_DEATH_S, not
        # at "ready": a worker that says ready and dies at once must still count.
        worker.startup_timer = self.timers.call_at(
            worker.ready_at + EARLY_DEATH_S, self._settled, worker
        )
        logger.info(
            "worker %d (pid %d) ready on %s in %.2fs",
            worker.id,
            pid,
            worker.device,
            worker.ready_at - worker.started_at,
        )
        self.publish_gpu_workers()

    def _settled(self, worker: Worker) -> None:
        if worker.state != "dead":
            self.consecutive_startup_failures = 0

    def ready_count(self) -> int:
        return sum(w.state in ("idle", "busy") for w in self.workers.values())

    def record_exit(self, worker: Worker, previous_state: str) -> str:
        """Log and count how ``worker`` (just marked dead) ended; a worker that never got
        ready, or died at once after it did, is a failed start. Returns the exit, in words."""
        returncode = worker.exit_code
        reason = describe_exit(returncode, signalled_by_pool=worker.signalled)
        if previous_state == "starting":
            if not self.owner.closing:
                self.startup_failed(worker)
        elif worker.signalled:
            logger.info(
                "worker %d (pid %s) stopped (%s, %s)",
                worker.id,
                worker.pid,
                worker.kill_reason,
                reason,
            )
        elif worker.stopping and returncode == 0:
            logger.debug("worker %d (pid %s) exited cleanly", worker.id, worker.pid)
        else:
            self.counters["crashes"] += 1
            logger.warning("worker %d (pid %s) died: %s", worker.id, worker.pid, reason)
            alive_for = self.clock() - (worker.ready_at or worker.started_at)
            killed_from_outside = returncode == -signal.SIGKILL
            if (
                not worker.runs
                and worker.requests == 0
                and alive_for < EARLY_DEATH_S
                and not killed_from_outside
            ):
                # Ready, then dead at once by its own doing, without a request to blame (a
                # backend that exits or aborts after loading): refilling the slot at once
                # would reload the model in a tight loop. A request that kills workers is
                # the retry policy's business; a SIGKILL the pool did not send (an operator,
                # the OOM killer) is not the backend's, and is refilled as any crash.
                worker.load_error = (
                    f"worker {worker.id} {reason} {alive_for:.2f}s after it was ready"
                )
                if not self.owner.closing:
                    self.startup_failed(worker)
        return reason

    # ---- recycling and roles -------------------------------------------------------------

    def retry_retirements(self) -> None:
        """Workers waiting for a spare to take their place: retire those that now can."""
        for worker_id in list(self.retire_waiting):
            waiting = self.workers.get(worker_id)
            if waiting is None or waiting.state == "dead":
                self.retire_waiting.discard(worker_id)
            else:
                self.maybe_retire(waiting)

    def retire_reason(self, worker: Worker) -> str | None:
        if worker.retire_reason is not None:
            return worker.retire_reason
        config = self.config
        if (
            config.max_requests_per_worker is not None
            and worker.requests >= config.max_requests_per_worker
        ):
            return f"served {worker.requests} requests"
        if (
            config.max_worker_rss_mb is not None
            and worker.rss_bytes is not None
            and worker.rss_bytes > config.max_worker_rss_mb * 2**20
        ):
            return f"RSS {worker.rss_bytes / 2**20:.0f} MB > {config.max_worker_rss_mb} MB"
        if (
            config.max_worker_gpu_mb is not None
            and worker.gpu_bytes is not None
            and worker.gpu_bytes > config.max_worker_gpu_mb * 2**20
        ):
            return f"GPU memory {worker.gpu_bytes / 2**20:.0f} MB > {config.max_worker_gpu_mb} MB"
        return None

    def maybe_retire(self, worker: Worker) -> None:
        """Retire an idle worker that crossed a recycling limit.

        With spares configured, a serving worker is retired only once an idle spare
        can take its place, so serving capacity never dips; until then it keeps serving.
        """
        if worker.state != "idle" or self.owner.closing:
            return
        reason = self.retire_reason(worker)
        if reason is None:
            return
        if self.config.spares and worker.role == "serving":
            successor = next(
                (w for w in self.workers.values() if w.state == "idle" and w.role == "spare"),
                None,
            )
            if successor is None:
                self.retire_waiting.add(worker.id)
                return
            # Claimed now: a second worker waiting to retire must not count the same spare.
            successor.role = "serving"
        self.retire_waiting.discard(worker.id)
        logger.info("recycling worker %d (pid %s): %s", worker.id, worker.pid, reason)
        self.counters["recycled"] += 1
        self.stop_worker(worker)

    def stop_worker(self, worker: Worker) -> None:
        assert worker.io is not None
        worker.stopping = True
        worker.state = "stopping"
        worker.io.send(("stop",))
        self.rearm_ladder(
            worker,
            max(self.config.term_grace_s, 1.0),
            self.send_signal,
            signal.SIGTERM,
            "stop_timeout",
        )

    def rebalance(self) -> None:
        """Keep ``workers`` serving: promote idle spares into gaps, demote extras back."""
        if not self.config.spares:
            return
        alive = [w for w in self.workers.values() if w.state in ("idle", "busy")]
        serving = [w for w in alive if w.role == "serving"]
        spares = [w for w in alive if w.role == "spare" and w.state == "idle"]
        while len(serving) < self.config.workers and spares:
            promoted = spares.pop(0)
            promoted.role = "serving"
            serving.append(promoted)
        surplus = len(serving) - self.config.workers
        for worker in serving:
            if surplus <= 0:
                break
            if worker.state == "idle":
                worker.role = "spare"
                surplus -= 1

    # ---- signals: the process end of the kill ladder -------------------------------------

    def send_signal(self, worker: Worker, signum: int, reason: str) -> None:
        if worker.state == "dead" or worker.io is None:
            return
        if not worker.signalled:
            worker.signalled = True
            worker.kill_reason = reason
            self.counters["kills"] += 1
            self.kill_reasons[reason] += 1
            self.owner.observers.worker_event(
                WorkerEvent(
                    "kill",
                    self.clock(),
                    worker.id,
                    worker.pid,
                    reason,
                    attempt_ids=tuple(worker.runs),
                    detail=signal.Signals(signum).name,
                    pool_slot=worker.slot,
                )
            )
        if worker.state != "starting":
            worker.state = "killing"
        worker.io.signal_group(signum)
        if signum == signal.SIGTERM:
            self.rearm_ladder(
                worker, self.config.term_grace_s, self.send_signal, signal.SIGKILL, reason
            )
        else:
            self.timers.cancel(worker.ladder_timer)
            worker.ladder_timer = None

    def rearm_ladder(
        self, worker: Worker, delay: float, step: Callable[..., None], *args: Any
    ) -> None:
        """The worker's next ladder step, in ``delay`` seconds, replaces the one pending."""
        self.timers.cancel(worker.ladder_timer)
        worker.ladder_timer = self.timers.call_at(self.clock() + delay, step, worker, *args)

    def kill_if_alive(self, worker: Worker, reason: str) -> None:
        if worker.state != "dead":
            self.send_signal(worker, signal.SIGKILL, reason)

    def channel_closed(self, worker: Worker) -> None:
        """Its socket reached end of file: nothing more is sent to it, and it is killed
        if it has not exited a second from now."""
        if worker.state == "dead":
            return
        if worker.state == "idle":
            worker.state = "killing"  # nothing more is sent to it
        self.timers.call_at(self.clock() + 1.0, self.kill_if_alive, worker, "channel_closed")

    def kill_all(self) -> None:
        """The dispatcher failed: every worker's process group gets SIGKILL, nothing more."""
        for worker in self.workers.values():
            if worker.io is not None and worker.state != "dead":
                worker.io.signal_group(signal.SIGKILL)

    def after_backend_error(
        self, worker: Worker, kind: str, text: str, details: Mapping[str, Any]
    ) -> None:
        """What a backend's error says about the worker: a sticky CUDA error replaces it
        now; an out-of-memory that left memory allocated retires it once idle."""
        if kind == "cuda_error":
            self.retire_after_cuda_error(worker, text)
        elif kind == "oom":
            self.counters["cuda_oom"] += 1
            if details.get("recycle"):
                worker.retire_reason = (
                    f"{details.get('allocated_bytes')} bytes still allocated after a CUDA "
                    f"out-of-memory (post-load baseline {details.get('baseline_bytes')})"
                )

    def retire_after_cuda_error(self, worker: Worker, text: str) -> None:
        """Its CUDA context is unusable: kill it now, before it could be handed anything
        else; its memory release is checked, and its slot refilled, as after any kill."""
        self.counters["cuda_errors"] += 1
        logger.error(
            "worker %d (pid %s) on %s hit a sticky CUDA error; replacing it: %s",
            worker.id,
            worker.pid,
            worker.device,
            text.strip().splitlines()[0] if text.strip() else "?",
        )
        self.send_signal(worker, signal.SIGKILL, "cuda_error")

    # ---- memory: release checks, blocked GPUs, samples -----------------------------------

    def after_exit(self, worker: Worker, previous_state: str) -> None:
        """A worker's exit is settled: ask for its memory release check, refill slots."""
        if previous_state != "starting" or worker.pid is not None:
            self.pending_release_checks += 1
            if self.gpu_available and worker.device.startswith("cuda"):
                # A GPU slot is refilled only once the old worker's memory is known to be back:
                # a replacement loading beside memory that is still held can run out of it.
                self.slots_awaiting_release.add(worker.slot)
            self.io.check_release(worker)
        self.publish_gpu_workers()
        self.fill_slots()

    def on_release_checked(
        self,
        worker_id: int,
        ok: bool,
        seconds: float,
        method: str,
        freed_bytes: int | None,
        held_bytes: int | None,
        held_by_device: Mapping[str, int | None] | None = None,
        holders: Mapping[str, list[str]] | None = None,
    ) -> None:
        """A dead worker's release is known. ``held_by_device``: the GPUs of its group that
        still hold memory (GPU -> bytes); without it a failure blocks every GPU of the group.
        ``holders``: GPU -> the processes found holding it, for stats."""
        self.pending_release_checks -= 1
        releases = self.releases
        self.releases = ReleaseStats(
            checked=releases.checked + 1,
            ok=releases.ok + int(ok),
            failed=releases.failed + int(not ok),
            last_ms=seconds * 1000.0,
            last_method=method,
            last_freed_mb=None if freed_bytes is None else freed_bytes / 2**20,
        )
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        self.owner.observers.worker_event(
            WorkerEvent(
                "release",
                self.clock(),
                worker.id,
                worker.pid,
                worker.kill_reason or "",
                ok=ok,
                seconds=seconds,
                detail=method,
                pool_slot=worker.slot,
            )
        )
        if not self.owner.closing:
            # Keep the dead worker's record only until its release is known.
            del self.workers[worker_id]
        self.slots_awaiting_release.discard(worker.slot)
        if ok or not worker.device.startswith("cuda"):
            self.fill_slots()
            return
        if not held_by_device:
            held_by_device = dict.fromkeys(group_devices(worker.device), held_bytes)
        for device, held in held_by_device.items():
            # Room for what the worker had on this GPU (or, unknown, what is still held there).
            needed = worker.gpu_bytes_by_device.get(device) or held or 0
            logger.error(
                "GPU memory of worker %d (pid %s) on %s not released: %s bytes still held; "
                "no worker of the group %s starts until it is free",
                worker.id,
                worker.pid,
                device,
                held,
                worker.device,
            )
            self.blocked_devices[device] = needed
            self.blocked_held[device] = held
            self.blocked_holders[device] = list((holders or {}).get(device, []))
            self.io.watch_device_free(device, needed)

    def on_device_free(self, device: str) -> None:
        self.blocked_held.pop(device, None)
        self.blocked_holders.pop(device, None)
        if self.blocked_devices.pop(device, None) is not None:
            logger.info("%s has room for a worker again", device)
        self.fill_slots()

    def on_gpu_sample(
        self,
        per_worker: Mapping[int, tuple[int | None, str, Mapping[str, int | None]]],
        devices: list[DeviceStats],
    ) -> None:
        """NVML's readings: per worker (the sum over its GPUs, the method, each GPU's figure)."""
        self.gpu_devices = devices
        for worker_id, (used, method, by_device) in per_worker.items():
            worker = self.workers.get(worker_id)
            if worker is None or worker.state == "dead":
                continue
            worker.gpu_bytes = used
            worker.gpu_method = method
            worker.gpu_bytes_by_device = dict(by_device)
            limit = self.config.max_worker_gpu_mb
            if limit is not None and used is not None and used > limit * 2**20:
                self.maybe_retire(worker)

    def publish_gpu_workers(self) -> None:
        if not self.gpu_available:
            return
        self.io.gpu_workers_changed(
            [
                (w.id, w.pid, w.device)
                for w in self.workers.values()
                if w.pid is not None and w.state != "dead" and w.device.startswith("cuda")
            ]
        )

    # ---- stats ---------------------------------------------------------------------------

    def worker_stats(self, now: float) -> list[WorkerStats]:
        """The live workers, as ``stats()`` shows them."""
        workers = []
        # Copies first: ModelPool.stats() builds a snapshot off the dispatcher thread when
        # that thread does not answer, and a dict must not change size under iteration.
        for worker in list(self.workers.values()):
            if worker.state == "dead":
                continue
            shown: str = worker.state
            runs = list(worker.runs.values())
            waiting = worker.waiting_attempts
            if worker.state == "idle" and worker.role == "spare":
                shown = "spare"
            workers.append(
                WorkerStats(
                    id=worker.id,
                    pool_slot=worker.slot,
                    pid=worker.pid,
                    state=shown,
                    role=worker.role,
                    device=worker.device,
                    requests=worker.requests,
                    uptime_s=round(now - worker.started_at, 3),
                    rss_mb=None if worker.rss_bytes is None else round(worker.rss_bytes / 2**20, 1),
                    gpu_mb=None if worker.gpu_bytes is None else round(worker.gpu_bytes / 2**20, 1),
                    gpu_mb_method=worker.gpu_method,
                    max_model_len=worker.max_model_len,
                    slots=worker.slots,
                    running=[
                        run.request.request_id
                        for run in runs
                        if run.request is not None
                        and run.attempt_id not in waiting
                        and not run.prefetched
                    ],
                    waiting_for_room=[
                        run.request.request_id
                        for run in runs
                        if run.request is not None and run.attempt_id in waiting
                    ],
                    kv_free_tokens=worker.kv_free_tokens,
                    prefix_cache=_prefix_cache_stats(worker.prefix_cache),
                    gpu_mb_by_device={
                        device: None if used is None else round(used / 2**20, 1)
                        for device, used in worker.gpu_bytes_by_device.items()
                    },
                )
            )
        return workers

    def gpu_stats(self) -> GpuStats:
        return GpuStats(
            available=self.gpu_available,
            reason=self.gpu_reason,
            devices=list(self.gpu_devices),
            releases=self.releases,
            blocked_devices=sorted(self.blocked_devices),
            blocked_held_mb={
                device: None if held is None else round(held / 2**20, 1)
                for device, held in sorted(self.blocked_held.items())
            },
            blocked_holders={
                device: list(lines) for device, lines in sorted(self.blocked_holders.items())
            },
        )


def _prefix_cache_stats(report: PrefixCacheReport | None) -> PrefixCacheStats | None:
    if report is None:
        return None
    return PrefixCacheStats(
        bytes=report.bytes,
        limit_bytes=report.limit_bytes,
        entries=report.entries,
        hits=report.hits,
        lookups=report.lookups,
        evictions=report.evictions,
        cached_tokens=report.cached_tokens,
    )


def pool_device(worker: Worker, local: object) -> str | None:
    """The pool's name for a GPU the worker named in its own numbering ("cuda:1" of a
    group "cuda:2,cuda:3" is "cuda:3"); without one, the worker's GPU if it has one."""
    members = group_devices(worker.device)
    if not isinstance(local, str) or not local.startswith("cuda"):
        return worker.device if len(members) == 1 and worker.device != "cpu" else None
    if worker.device == "cpu":
        return local  # a rehearsal (the testing backend) on a CPU worker
    ordinal = int(local.partition(":")[2] or 0)
    return members[ordinal] if ordinal < len(members) else local
