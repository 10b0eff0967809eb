"""The supervisor: one thread that runs the dispatcher and does all of its I/O.

Data flow::

    caller threads / asyncio tasks (pool.ModelPool)
      |  submit(): validate, count against max_queue, make a PoolFuture
      v
    command deque + wake-up pipe ----------------------------+
      |                                                      |
      v                                                      |
    dispatcher thread (EventLoop.run + dispatcher.Dispatcher) |  monitor threads
      one selector over: the wake-up pipe, every worker's    |  (monitors.py: release
      socket, every worker's pidfd (exit sentinel)           |   checks, GPU sampling)
      one timer heap: attempt deadlines, kill-ladder steps,  |   post their results
      start-up timeouts, stall checks, respawn backoff       |   back as commands
      |                                                   <--+
      |  ("run", attempt_id, slot, payload) over the worker's socket (queued; each
      |   worker's outbox is written once per turn, before the select)
      v
    worker processes (spawn.py: a new interpreter running modelpool.worker.process, own group)
      |  ("chunk" ...)*, then ("done" ...) or ("error" ...)
      v
    Dispatcher: the attempt id must match the worker's current attempt, else the
    message is stale and dropped; the request's PoolFuture is resolved once.

Follow one request (each name is a function; the file is in brackets)::

    ModelPool.submit -> ModelPool._submit             [pool.py]  validate, encode, max_queue
      (response_format -> grammar text               [structured.py]; tools: [tools.py])
      -> EventLoop.post                               [here]     command deque + wake-up byte
      -> EventLoop.run -> _run_commands               [here]
      -> Dispatcher.submit                            [dispatcher.py]  queue, deadline timer
      -> Dispatcher.after_event -> _pump              [dispatcher.py]
      -> placement.open_workers, assign               [placement.py]  which worker takes it
         (KV room, running rows, the longest cached prefix: [prefixes.py])
      -> Dispatcher._dispatch                         [dispatcher.py]  ("run", ...) to a worker
      -> ProcessWorkerIO.send                         [spawn.py]
      -> serve -> _run_attempt                        [worker/process.py]  the backend generates
         (batched: BatchLoop.serve -> _step [worker/batch_loop.py] -> HFHandler.step
          -> Scheduler.step [backends/common/scheduler.py]: admission, prefill slices, grammars ->
          HFRunner.run [backends/hf/runner.py]: prefix cache [backends/hf/prefix_cache.py],
          each row on its own KV cache, one packed pass a step with a prefill slice
          riding on it [backends/hf/packed.py] (else one padded cache [hf/padded.py]),
          each row's grammar mask [backends/hf/grammars.py];
          on llama.cpp: LlamaCppHandler.step -> Scheduler.step -> LlamaRunner.run
          [backends/llama_cpp/runner.py])
      -> EventLoop._read                              [here]     frames from the socket
      -> Dispatcher.on_message -> _on_chunk / _on_done [dispatcher.py]
      -> _run_ended -> _succeed -> _finish            [dispatcher.py]
      -> set_future                                   [results.py]  the caller's future

The deadline path (the ladder)::

    EventLoop.run -> Dispatcher.run_due_timers -> TimerHeap.run_due   [records.py]
      (or StallWatch._check                 [stalls.py] no progress for stall_timeout_s)
      -> Dispatcher._attempt_timed_out      the request is detached from the attempt
      -> _soft_cancel                       cancel flag in the ControlBlock (next token)
      -> Retries.attempt_failed -> requeue  [retries.py] retried elsewhere (a spare at once)
      -> _on_cancel_grace_over              [dispatcher.py]
      -> WorkerManager.send_signal          [worker_manager.py] SIGTERM to the process group
      -> send_signal (after term_grace_s)   [worker_manager.py] SIGKILL
      -> EventLoop._reap                    pidfd readable: wait, close the channel
      -> Dispatcher.on_exit -> WorkerManager.record_exit  [worker_manager.py] kill or crash
      -> Dispatcher.on_exit                 its runs settled (retried or failed)
      -> WorkerManager.after_exit           [worker_manager.py] release check asked
      -> Monitors.check_release             [monitors.py] process group gone, NVML memory
      -> WorkerManager.on_release_checked   [worker_manager.py] the release is recorded
      -> fill_slots -> spawn                [worker_manager.py] the slot is refilled

A worker that dies is a normal, named event (``Dispatcher.on_exit``), never an
exception: its attempt is recorded as a crash (or a kill, if the pool had signalled
it), its memory release is checked, its slot is refilled, and its request is retried
elsewhere or failed with a typed error.

Future callbacks (``add_done_callback``, ``on_chunk``) run on the dispatcher thread, as
in ``concurrent.futures``: they must be quick and must not wait on the pool
(``generate()`` refuses to run there).

The worker's own side (the lifeline pipe, the cancel flag, the backend protocol) is in
``worker/process.py`` and ``protocol.py``; ``docs/architecture.md`` ties them together.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import selectors
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.scheduling import preemption
from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import PoolClosed
from modelpool.shared.protocol import WorkerSpec
from modelpool.supervisor import gpu
from modelpool.supervisor.devices import group_devices, nvml_index_for, worker_env_for
from modelpool.supervisor.dispatcher import Dispatcher
from modelpool.supervisor.monitors import Monitors
from modelpool.supervisor.observe import Observers
from modelpool.supervisor.records import GpuWorker, Worker, WorkerIO
from modelpool.supervisor.results import set_future
from modelpool.supervisor.spawn import ProcessWorkerIO, build_env, start_worker_process, usable_cpus

logger = logging.getLogger(__name__)

# The event loop wakes at least this often (or a quarter of heartbeat_timeout_s, if less)
# and stamps its heartbeat, so that an idle pool stays fresh and only a wedged loop ages.
_HEARTBEAT_WAIT_S = 1.0


class EventLoop:
    """Runs the Dispatcher on its own thread and does its I/O: the pool's arbiter.

    ``run()`` is the map, first: commands from other threads, due timers, the dispatcher's
    bookkeeping, then one ``select`` over the wake-up pipe, every worker's socket and
    every worker's pidfd. ``__init__`` follows it (the state ``run`` owns), then the verbs
    it calls, in that order.
    """

    def run(self) -> None:
        dispatcher = self.dispatcher
        try:
            dispatcher.start()
            while True:
                self.heartbeat = time.monotonic()
                self._run_commands()
                dispatcher.run_due_timers()
                dispatcher.after_event()
                if dispatcher.finished:
                    break
                next_at = dispatcher.next_timer_at()
                timeout = self._longest_wait_s
                if next_at is not None:
                    timeout = min(max(0.0, next_at - time.monotonic()), timeout)
                if self._eof_without_exit:
                    timeout = min(timeout, 0.005)
                self._write_outboxes()
                for key, mask in self.selector.select(timeout):
                    kind, worker = key.data
                    if kind == "wake":
                        self._drain_wake()
                    elif worker.state == "dead":
                        # Reaped earlier in this same batch: its socket and pidfd are closed
                        # (the socket may still be readable through a child that kept it).
                        continue
                    elif kind == "sock":
                        if mask & selectors.EVENT_WRITE:
                            self._flush(worker)
                        if mask & selectors.EVENT_READ:
                            self._read(worker)
                    else:
                        self._reap(worker)
                self._poll_eof_workers()
        except BaseException as exc:
            logger.critical("the modelpool dispatcher failed; failing every request", exc_info=True)
            dispatcher.crash(exc)
        finally:
            self._stop_accepting()
            self.monitors.stop()
            self._teardown()

    def __init__(
        self,
        config: PoolConfig,
        devices: list[str],
        probe: gpu.GpuProbe,
        *,
        worker_environ: Mapping[str, str] | None = None,
        on_started: Callable[[BaseException | None], None],
        on_dequeued: Callable[[], None],
        observers: Observers | None = None,
    ) -> None:
        self.config = config
        self.probe = probe
        self.selector = selectors.DefaultSelector()
        self.commands: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self.stopped = False
        # post() runs on any thread, in signal handlers and finalizers too, and takes no
        # lock; so the wake-up pipe is closed only once nothing can post any more: when
        # this object is collected, not at teardown. Nor at interpreter exit: weakref's
        # own exit hook, registered after the pool's (so called before it), would close
        # the pipe under the close() that the pool's hook is about to post.
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w).atexit = False
        self.selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._lifeline_r, self._lifeline_w = os.pipe()
        _lifeline_writers.add(self._lifeline_w)
        self._eof_without_exit: list[Worker] = []
        # Workers with frames queued this turn (ProcessWorkerIO.send), written before the
        # loop waits: one write per worker per turn.
        self._outboxes: list[ProcessWorkerIO] = []
        # Devices are mapped once, here: an application that changes CUDA_VISIBLE_DEVICES
        # after start() (to hide the GPU from itself, say) must not remap its workers.
        self.environ = dict(os.environ)
        # Added to every worker's environment: what the preflight found they need
        # (HF_HUB_OFFLINE=1 once it has put a hub model in the cache).
        self.worker_environ = dict(worker_environ or {})
        self.dispatcher = Dispatcher(
            config,
            self,
            devices=devices,
            on_started=on_started,
            on_dequeued=on_dequeued,
            gpu_available=probe.available,
            gpu_reason=probe.reason,
            observers=observers,
        )
        self.monitors = Monitors(
            config,
            probe,
            self.post,
            on_release_checked=self.dispatcher.worker_manager.on_release_checked,
            on_device_free=self.dispatcher.on_device_free,
            on_gpu_sample=self.dispatcher.on_gpu_sample,
            on_prefix_tiers=self.dispatcher.prefix_tiers.update,
            environ=self.environ,
        )
        self.thread = threading.Thread(target=self.run, name="modelpool-dispatcher", daemon=True)
        self._threads_per_worker = max(1, usable_cpus() // config.workers)
        # time.monotonic() at the top of the loop's latest round; read by other threads.
        self.heartbeat = time.monotonic()
        self._longest_wait_s = min(_HEARTBEAT_WAIT_S, config.heartbeat_timeout_s / 4)

    def _run_commands(self) -> None:
        self._wake_pending = False
        commands = self.commands
        while commands:
            action, args = commands.popleft()
            action(*args)

    def _write_outboxes(self) -> None:
        for io in self._outboxes:
            if not io.closed:
                io.flush()
        self._outboxes.clear()  # the same list: every worker's io appends to it

    def _drain_wake(self) -> None:
        # One read suffices: a writer only writes while no wake-up is pending.
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _flush(self, worker: Worker) -> None:
        io = worker.io
        if not isinstance(io, ProcessWorkerIO):
            return
        io.flush()
        if not io.outbox:
            try:
                self.selector.modify(io.sock, selectors.EVENT_READ, ("sock", worker))
            except (KeyError, ValueError):
                pass

    def _read(self, worker: Worker, *, until_eof: bool = False) -> None:
        io = worker.io
        if not isinstance(io, ProcessWorkerIO) or io.eof or io.closed:
            return
        while True:
            try:
                data = io.sock.recv(1 << 18)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._stop_reading(worker, io)
                self.dispatcher.channel_closed(worker)
                return
            try:
                for message in io.decoder.feed(data):
                    self.dispatcher.on_message(worker, message)
            except Exception:
                # One broken worker (or a backend that sent what the pool cannot read)
                # must not take the dispatcher, and with it every other request, down.
                logger.exception(
                    "worker %d (pid %s) sent a message the pool cannot use; killing it",
                    worker.id,
                    worker.pid,
                )
                self._stop_reading(worker, io)
                self.dispatcher.protocol_error(worker)
                return
            if len(data) < (1 << 18) and not until_eof:
                return

    def _stop_reading(self, worker: Worker, io: ProcessWorkerIO) -> None:
        io.eof = True
        self._unregister(io.sock)
        if io.pidfd is None:
            self._eof_without_exit.append(worker)

    def _poll_eof_workers(self) -> None:
        for worker in list(self._eof_without_exit):
            io = worker.io
            if isinstance(io, ProcessWorkerIO) and io.popen.poll() is not None:
                self._eof_without_exit.remove(worker)
                self._reap(worker)

    def _reap(self, worker: Worker) -> None:
        io = worker.io
        if not isinstance(io, ProcessWorkerIO) or worker.state == "dead":
            return
        # A last result or traceback may be waiting behind the exit.
        self._read(worker, until_eof=True)
        # Whatever the worker started dies with it. Sent before the leader is reaped: its
        # zombie keeps the group id from being reused by a new process group meanwhile.
        io.signal_group(signal.SIGKILL)
        returncode = io.popen.wait()
        io.eof = True
        self._unregister(io.sock)
        if io.pidfd is not None:
            self._unregister(io.pidfd)
        io.close()
        self.dispatcher.on_exit(worker, returncode)

    def _unregister(self, fileobj: socket.socket | int) -> None:
        try:
            self.selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass  # Already forgotten (end of file came first), or already closed.

    def _stop_accepting(self) -> None:
        """No command is taken after this; submissions already queued fail instead of hanging.

        ``stopped`` is set before the deque is drained, and ``post`` checks it again after
        appending, so every command is either drained here or taken back by its poster.
        """
        self.stopped = True
        while True:
            try:
                action, args = self.commands.popleft()
            except IndexError:
                break
            if action == self.dispatcher.submit:
                set_future(args[0].future, PoolClosed("the pool stopped before the request ran"))

    def _teardown(self) -> None:
        for worker in list(self.dispatcher.workers.values()):
            io = worker.io
            if isinstance(io, ProcessWorkerIO) and not io.closed:
                try:
                    io.signal_group(signal.SIGKILL)
                    io.popen.wait()
                finally:
                    io.close()
                    worker.state = "dead"
        self.selector.close()
        _lifeline_writers.discard(self._lifeline_w)
        _close_fds(self._lifeline_r, self._lifeline_w)

    # ---- from other threads ------------------------------------------------------------

    def post(self, action: Callable[..., None], *args: Any) -> bool:
        """Queue work for the dispatcher thread; False once the loop has stopped.

        Lock-free, so that it is safe from a signal handler or a finalizer that runs on a
        thread which is itself in the middle of a post: deque appends are atomic, and
        the wake-up byte is written at most once per batch of commands.
        """
        if self.stopped:
            return False
        command = (action, args)
        self.commands.append(command)
        if self.stopped:
            try:
                self.commands.remove(command)
            except ValueError:
                return True  # _stop_accepting drained it, and resolved it if it was a submit
            return False
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # The pipe is full of wake-ups already.
        return True

    def start(self) -> None:
        self.thread.start()
        self.monitors.start()

    def kill_all_workers(self) -> None:
        """Last resort when the dispatcher is wedged: take every worker down without it."""
        for worker in list(self.dispatcher.workers.values()):
            io = worker.io
            if isinstance(io, ProcessWorkerIO) and not io.closed:
                io.signal_group(signal.SIGKILL)

    # ---- DispatcherIO ----------------------------------------------------------------------

    def spawn(self, worker: Worker, spec: WorkerSpec) -> WorkerIO:
        device_env, worker_device = worker_env_for(worker.device, self.probe, self.environ)
        for device in group_devices(worker.device):
            index = nvml_index_for(device, self.probe, self.environ)
            if index is not None:
                worker.gpu_baselines[device] = self.probe.used_bytes(index)
        io = start_worker_process(
            build_env({**self.worker_environ, **device_env}, self._threads_per_worker),
            self._lifeline_r,
            lambda io: self._want_write(worker, io),
            # One cancel word per run it may hold: a one-call worker's prefetched runs
            # (modelpool.scheduling.prefetch), a batched worker's preempted rows winding down beside
            # the requests handed their slots (modelpool.scheduling.preemption).
            preemption.cancel_words(spec.max_batch_size),
            self._outboxes.append,
        )
        try:
            self.selector.register(io.sock, selectors.EVENT_READ, ("sock", worker))
            if io.pidfd is not None:
                self.selector.register(io.pidfd, selectors.EVENT_READ, ("exit", worker))
            io.send(("init", dataclasses.replace(spec, device=worker_device)))
        except BaseException:
            io.signal_group(signal.SIGKILL)
            io.popen.wait()
            for fd in (io.sock, io.pidfd):
                if fd is not None:
                    try:
                        self.selector.unregister(fd)
                    except (KeyError, ValueError):
                        pass
            io.close()
            raise
        return io

    def check_release(self, worker: Worker) -> None:
        self.monitors.check_release(worker)

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        self.monitors.watch_device_free(device, needed_bytes)

    def gpu_workers_changed(self, workers: list[GpuWorker]) -> None:
        self.monitors.gpu_workers_changed(workers)

    def _want_write(self, worker: Worker, io: ProcessWorkerIO) -> None:
        """The worker's socket buffer is full: finish sending when it can take more."""
        try:
            self.selector.modify(
                io.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, ("sock", worker)
            )
        except (KeyError, ValueError):
            pass


# The write ends of every live pool's lifeline. A child forked without exec (the
# multiprocessing "fork" context, say) would otherwise hold them open and keep the
# workers alive after the supervisor died, for as long as that child lives.
_lifeline_writers: set[int] = set()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _close_lifelines_in_child() -> None:
    for fd in _lifeline_writers:
        try:
            os.close(fd)
        except OSError:
            pass
    _lifeline_writers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_lifelines_in_child)
