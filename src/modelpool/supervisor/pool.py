"""The public face: :class:`ModelPool` (its streams are in ``streams.py``).

    with ModelPool(PoolConfig(model="./chat-model", workers=2)) as pool:
        result = pool.generate([{"role": "user", "content": "Hello"}], max_new_tokens=16)

A chat model wants chat messages, as here; a string is raw text with no chat template.

Every method here runs on the caller's thread (or asyncio task) and only hands work
to the dispatcher thread (``supervisor.EventLoop.post``); the supervisor's docstring
follows one request from :meth:`ModelPool.submit` to its resolved future.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import itertools
import logging
import math
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from modelpool.scheduling import admission
from modelpool.scheduling.ordering import promotion_at
from modelpool.scheduling.queueing import arrival
from modelpool.scheduling.sizes import RunSize
from modelpool.shared.config import PoolConfig
from modelpool.shared.embeddings import (
    EmbeddingResult,
    ScoreResult,
    embed_request,
    embedding_result,
    score_request,
    score_result,
)
from modelpool.shared.errors import InvalidRequest, PoolClosed, PoolError, PoolOverloaded, QueueFull
from modelpool.shared.images import SUBMIT_OFF_LOOP_BYTES, image_bytes
from modelpool.shared.pooling_answers import check_task
from modelpool.shared.protocol import (
    DetokenizeRequest,
    PoolingRequest,
    Prompt,
    Task,
    TokenIds,
    TokenizeRequest,
    encode_request,
)
from modelpool.shared.validation import (
    PROMOTED_AT_PARAM,
    check_prompt,
    pooling_queue_params,
)
from modelpool.supervisor import gpu
from modelpool.supervisor.backend_choice import (
    AUTO,
    prepared_model,
    with_backend_chosen,
    with_pooling_batches,
)
from modelpool.supervisor.dispatcher import Dispatcher
from modelpool.supervisor.intake import backend_validator, check_request
from modelpool.supervisor.loop import EventLoop
from modelpool.supervisor.observe import Observers, RequestRecord, WorkerEvent
from modelpool.supervisor.prefix_tiers import remove_host_tier, with_host_tier
from modelpool.supervisor.preflight import check_devices, check_model_source
from modelpool.supervisor.records import NoIO, Request
from modelpool.supervisor.results import PoolFuture, Result, cancel_submitted
from modelpool.supervisor.stats import PoolHealth, PoolStats
from modelpool.supervisor.streams import END, AsyncPoolStream, PoolStream, StreamBuffer

__all__ = ["AsyncPoolStream", "ModelPool", "PoolFuture", "PoolStream", "Result"]

logger = logging.getLogger(__name__)

_live_pools: weakref.WeakSet[ModelPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close(drain=False, timeout=5.0)


class ModelPool:
    """A supervised pool of pre-warmed worker processes serving one model.

        hello = [{"role": "user", "content": "Hello"}]  # a chat model wants messages
        with ModelPool(PoolConfig(model="embedded:smollm2-135m-instruct")) as pool:
            result = pool.generate(hello, max_new_tokens=16)
            future = pool.submit(hello)            # concurrent.futures.Future
            for chunk in pool.stream(hello):       # text as it is generated
                print(chunk, end="")
            pool.generate("The capital of France is")  # a string: raw text, no chat template

    ``examples/`` in the repository has these, runnable (and run by the tests).

    ``start()`` returns once every worker has loaded the model and said ready.
    Every call resolves within its deadline with a :class:`Result` or a
    :class:`~modelpool.shared.errors.PoolError`.
    """

    def __init__(
        self,
        config: PoolConfig | None = None,
        /,
        *,
        gpu_probe: gpu.GpuProbe | None = None,
        **overrides: Any,
    ) -> None:
        """``overrides`` are PoolConfig fields; ``gpu_probe`` replaces the NVML probe (tests)."""
        if config is None:
            config = PoolConfig(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        # "auto" is hf or llama_cpp, whose request rules are the same (hf.validate).
        self._backend_validate = backend_validator(
            "hf" if config.backend == AUTO else config.backend
        )
        # Why the pool serves on its backend; set by start() (see backend_choice).
        self._backend_reason: str | None = None
        self._futures: weakref.WeakValueDictionary[str, PoolFuture] = weakref.WeakValueDictionary()
        # Only start() takes a lock. Everything a caller, a signal handler or a finalizer
        # can reach while another call is half done on the same thread (submit, stats,
        # cancel, close, a stream's __del__) is lock-free: a plain lock taken there would
        # deadlock on re-entry and then block every thread's calls behind it.
        self._start_lock = threading.RLock()
        # One token per request the dispatcher has not yet dequeued: deque append and
        # pop are atomic, so max_queue holds without a lock.
        self._queue_tokens: collections.deque[None] = collections.deque()
        self._closed = False
        # A forked child inherits this object but not the dispatcher thread.
        self._owner_pid = os.getpid()
        self._loop: EventLoop | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._last_snapshot: PoolStats | None = None
        self._gpu_probe = gpu_probe
        # Ids unique across pools and restarts without a uuid (a system call) per request.
        self._id_prefix = f"{secrets.token_hex(5)}-"
        self._request_numbers = itertools.count(1)
        # Observers of finished requests and worker events (add_observer), kept here so
        # that they can be added before start().
        self._observers = Observers()
        self._host_tier: str | None = None  # a host tier directory this pool made

    # ---- life cycle ------------------------------------------------------------------------

    def start(self) -> ModelPool:
        """Start every worker and wait until all are ready; raise ``ModelLoadFailed`` if not.

        Before any worker starts, the devices and the model are checked once (see
        :mod:`modelpool.supervisor.preflight`): ``DeviceError`` (a ``ValueError``) or
        ``ModelSourceError`` (a ``ModelLoadFailed``) in well under a second."""
        self._check_owner()
        if self._closed:
            raise PoolClosed("the pool is closed")
        if self._loop is None:
            # Slow work (preparing an embedded model, probing NVML, fetching a hub model)
            # outside the lock, so that a close() from another thread is not stuck
            # behind it. The preflight fails here, in one line, what every worker would
            # otherwise fail at, in turn, after loading torch.
            config = self.config
            probe = self._gpu_probe or gpu.GpuProbe()
            devices = check_devices(config, probe)
            config, reason = with_backend_chosen(config, devices)
            if config.backend != self.config.backend:
                devices = check_devices(config, probe)  # with the chosen backend's checks
            model = prepared_model(config.model, config.backend)
            if model != config.model:
                config = config.replace(model=model)
            config = with_pooling_batches(config)
            worker_environ = check_model_source(
                config.model, config.backend, config.backend_options
            )
            if self.config.backend == AUTO:
                # After the preflight: a start it refuses stays one line of error.
                logger.info(
                    "serving %s on the %s backend (%s)", self.config.model, config.backend, reason
                )
            with self._start_lock:
                if self._closed:
                    raise PoolClosed("the pool is closed")
                if self._loop is None:
                    config, self._host_tier = with_host_tier(config)
                    self.config = config
                    self._backend_reason = reason
                    self._backend_validate = backend_validator(config.backend)
                    self._loop = EventLoop(
                        config,
                        devices,
                        probe,
                        worker_environ=worker_environ,
                        on_started=self._on_started,
                        on_dequeued=self._on_dequeued,
                        observers=self._observers,
                    )
                    _live_pools.add(self)
                    self._loop.start()
            if self._closed:
                # close() ran on another thread before the loop existed and found nothing
                # to stop: stop it here.
                self.close(drain=False, timeout=5.0)
                raise PoolClosed("the pool was closed while starting")
        try:
            self._started.wait()
        except BaseException:
            self.close(drain=False, timeout=5.0)  # Ctrl-C while the model loads
            raise
        if self._start_error is not None:
            error = self._start_error
            self.close(drain=False, timeout=5.0)
            raise error
        return self

    def _on_started(self, error: BaseException | None) -> None:
        self._start_error = error
        self._started.set()

    def add_observer(
        self,
        *,
        on_request: Callable[[RequestRecord], None] | None = None,
        on_worker: Callable[[WorkerEvent], None] | None = None,
    ) -> None:
        """Call ``on_request`` with each resolved request's record and ``on_worker`` with
        each worker event (kill, exit, release check, retry); see
        :mod:`modelpool.supervisor.observe`.
        They run on the dispatcher thread and must be quick."""
        observers = self._observers
        # Copied, not appended to: the dispatcher thread may be iterating the old list.
        if on_request is not None:
            observers.on_request = [*observers.on_request, on_request]
        if on_worker is not None:
            observers.on_worker = [*observers.on_worker, on_worker]

    def predicted_ttft(
        self, priority: int = 0, *, also_waiting: int = 0, size: RunSize | None = None
    ) -> float | None:
        """Seconds a new request of ``priority`` (and ``size``) would wait for its first
        token (``scheduling.admission.predicted_ttft``): the work queued ahead of it, plus
        ``also_waiting`` runs held elsewhere (the daemon's fair share). None before enough
        runs were measured, or before start()."""
        loop = self._loop
        if loop is None:
            return None
        return admission.predicted_ttft(
            loop.dispatcher,
            capacity=self._capacity,
            priority=priority,
            also_waiting=also_waiting,
            size=size,
        )

    def tokens_within(self, seconds: float) -> int | None:
        """The tokens a run can decode and still answer within ``seconds`` at the rates
        this pool measured (``WaitPredictor.tokens_within``); None before enough runs were
        measured, or before start()."""
        loop = self._loop
        return None if loop is None else loop.dispatcher.predictor.tokens_within(seconds)

    def check_admission(
        self,
        priority: int,
        max_queue_time_s: float | None,
        deadline_s: float,
        *,
        also_waiting: int = 0,
        size: RunSize | None = None,
    ) -> float | None:
        """Raise ``QueueFull`` if a new request's predicted time to first token passes
        ``max_queue_time_s`` (None: the pool's setting) or ``deadline_s``
        (``scheduling.admission.judge``); returns its ``due_in_s`` for
        :meth:`promotion_at`, None when nothing was judged."""
        loop = self._loop
        if loop is None:
            return None
        limit = self.config.max_queue_time_s if max_queue_time_s is None else max_queue_time_s
        try:
            return admission.judge(
                loop.dispatcher,
                capacity=self._capacity,
                priority=priority,
                limit_s=limit,
                deadline_s=deadline_s,
                also_waiting=also_waiting,
                size=size,
            )
        except QueueFull:
            loop.post(loop.dispatcher.count_overloaded, True)
            raise

    def promotion_at(self, now: float, due_in_s: float | None) -> float:
        """When a request admitted at ``now`` with ``due_in_s`` (:meth:`check_admission`)
        is promoted ahead of every younger request (``scheduling.admission.promotion_at``)."""
        loop = self._loop
        if loop is None:
            return math.inf
        return admission.promotion_at(loop.dispatcher.predictor, now, due_in_s)

    @property
    def _capacity(self) -> int:
        return self.config.workers * self.config.max_batch_size

    def close(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting requests, finish (``drain``) or fail in-flight ones, stop every worker.

        Idempotent. Returns when every worker process is gone and reaped. In a forked
        child it does nothing: the workers belong to the parent's pool.
        """
        self._closed = True
        loop = self._loop
        if loop is None or os.getpid() != self._owner_pid:
            return
        loop.post(loop.dispatcher.begin_close, drain, time.monotonic() + timeout)
        if threading.current_thread() is loop.thread:
            return  # Called from a callback: the dispatcher finishes the close after it.
        if loop.thread.is_alive():
            bound = (
                timeout
                + self.config.cancel_grace_s
                + 2 * self.config.term_grace_s
                + self.config.gpu_release_timeout_s
                + 10.0
            )
            loop.thread.join(bound)
            if loop.thread.is_alive():
                logger.error("the dispatcher did not stop within %.0fs; killing workers", bound)
                loop.kill_all_workers()
        self._last_snapshot = loop.dispatcher.snapshot() if not loop.thread.is_alive() else None
        if not loop.thread.is_alive():
            remove_host_tier(self._host_tier)
        _live_pools.discard(self)

    def __enter__(self) -> ModelPool:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        *,
        deadline_s: float | None = None,
        on_chunk: Callable[[str], None] | None = None,
        **gen_kwargs: Any,
    ) -> PoolFuture:
        """Queue a request; returns a future with ``request_id``. Validation errors raise here.

        ``prompt``: chat messages (``[{"role": "user", "content": "Hello"}]``) for a chat
        model, which renders them with its template; a string is raw text, continued as
        it is (see :data:`modelpool.shared.protocol.Prompt`).

        ``on_chunk(text)`` is called with each chunk as the worker streams it, on the
        dispatcher thread (keep it short; an exception in it is logged and ignored), for
        a caller that wants the future and the chunks both. Such a request is a stream:
        once a chunk was delivered it is not retried after a crash or timeout.

        ``response_format`` constrains the output (``{"type": "json_object"}``, OpenAI's
        ``{"type": "json_schema", "json_schema": {...}}``, a bare JSON schema or a pydantic
        model class; see :mod:`modelpool.shared.structured`), as ``grammar`` does with llguidance
        grammar text. A schema the grammar engine cannot honour raises ``GrammarError``
        here, naming the keyword and its path.
        """
        return self._submit(prompt, deadline_s, gen_kwargs, on_chunk)

    def generate(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> Result:
        """Run one request and wait for it. Raises a ``PoolError`` subclass on failure."""
        loop = self._loop
        if loop is not None and threading.current_thread() is loop.thread:
            # Future callbacks run on the dispatcher thread; waiting there would stop it.
            raise PoolError("generate() called from a future callback; use submit() there")
        future = self._submit(prompt, deadline_s, gen_kwargs, None)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its future resolves with ``finish_reason="cancelled"`` and the text
        so far. False if the request is unknown or already finished."""
        self._check_owner()
        loop = self._loop
        future = self._futures.get(request_id)
        if loop is None or future is None or future.done():
            return False
        loop.post(loop.dispatcher.cancel, request_id, False)
        return True

    def stream(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> PoolStream:
        """Text chunks as the worker produces them; leaving the loop early cancels.

        stream = pool.stream("Hello", max_new_tokens=32)
        for chunk in stream:
            print(chunk, end="")
        stream.result.finish_reason, stream.request_id
        """
        chunks: queue.SimpleQueue[object] = queue.SimpleQueue()
        future = self._submit(prompt, deadline_s, gen_kwargs, chunks.put)
        future.add_done_callback(lambda _: chunks.put(END))
        return PoolStream(future, chunks.get)

    async def agenerate(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> Result:
        """asyncio version of :meth:`generate`; cancelling the task stops the worker."""
        if image_bytes(prompt) < SUBMIT_OFF_LOOP_BYTES:
            future = self._submit(prompt, deadline_s, gen_kwargs, None)
        else:
            # Pickling megabytes of images holds the GIL: not on the caller's event loop.
            submitting = asyncio.get_running_loop().run_in_executor(
                None, self._submit, prompt, deadline_s, gen_kwargs, None
            )
            try:
                future = await asyncio.shield(submitting)
            except asyncio.CancelledError:
                submitting.add_done_callback(cancel_submitted)
                raise
        return await asyncio.wrap_future(future)

    def astream(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> AsyncPoolStream:
        """asyncio version of :meth:`stream`: ``async for chunk in pool.astream(...)``.

        No thread per stream: chunks reach the event loop through a
        :class:`StreamBuffer`, which wakes the loop once per batch of chunks rather than
        once per chunk. Cancelling the consuming task cancels the request.
        """
        chunks = StreamBuffer(asyncio.get_running_loop())
        future = self._submit(prompt, deadline_s, gen_kwargs, chunks.put_threadsafe, counted=True)
        future.add_done_callback(lambda _: chunks.put_threadsafe(END))
        return AsyncPoolStream(future, chunks)

    def tokenize(
        self, prompt: Prompt, *, add_generation_prompt: bool = True, deadline_s: float | None = None
    ) -> list[int]:
        """The token ids a worker feeds the model for ``prompt``: its own tokenizer and chat
        template, as a generation's prompt is read (and counted against the context)::

            pool.tokenize([{"role": "user", "content": "Hello"}])   # [1, 9690, 198, ...]

        It is a pool request (queued, placed, answered by a worker between two decoding
        steps), so it waits its turn behind a one-call worker's running generation.
        ``add_generation_prompt=False`` renders chat messages without the assistant's
        opening."""
        future = self._tokenizer_request(
            TokenizeRequest(check_prompt(prompt), bool(add_generation_prompt)), deadline_s
        )
        return list(future.result().token_ids or [])

    def detokenize(self, token_ids: list[int], *, deadline_s: float | None = None) -> str:
        """The text of ``token_ids`` in the model's tokenizer (a worker's)."""
        request = DetokenizeRequest(_checked_ids(token_ids))
        return self._tokenizer_request(request, deadline_s).result().text

    async def atokenize(
        self, prompt: Prompt, *, add_generation_prompt: bool = True, deadline_s: float | None = None
    ) -> list[int]:
        """asyncio version of :meth:`tokenize`."""
        request = TokenizeRequest(check_prompt(prompt), bool(add_generation_prompt))
        result = await asyncio.wrap_future(self._tokenizer_request(request, deadline_s))
        return list(result.token_ids or [])

    async def adetokenize(self, token_ids: list[int], *, deadline_s: float | None = None) -> str:
        """asyncio version of :meth:`detokenize`."""
        request = DetokenizeRequest(_checked_ids(token_ids))
        return (await asyncio.wrap_future(self._tokenizer_request(request, deadline_s))).text

    def _tokenizer_request(
        self, request: TokenizeRequest | DetokenizeRequest, deadline_s: float | None
    ) -> PoolFuture:
        return self._submit(request, deadline_s, {}, None)

    # ---- embeddings and scores (modelpool.shared.embeddings) -------------------------------

    @property
    def task(self) -> Task:
        """What the pool's model does, as its workers said when ready (so: once started):
        "generate", "embed" (a sentence-transformers bi-encoder: embed, and score by cosine)
        or "score" (a cross-encoder: score only)."""
        loop = self._loop
        return "generate" if loop is None else loop.dispatcher.worker_manager.task

    def embed(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        truncate: bool = False,
        deadline_s: float | None = None,
        priority: int = 0,
        **queue: Any,
    ) -> EmbeddingResult:
        """One vector per input, from an embedding model's worker::

            pool.embed(["first text", "second"]).vectors      # two vectors, unit length
            pool.embed([101, 7592, 102])                       # one input as token ids
            pool.embed("text", dimensions=64)                  # cut to 64 and renormalised

        An input longer than the model's context raises ``ContextLengthExceeded`` unless
        ``truncate``; an empty input raises ``InvalidRequest`` naming ``input``; a
        generation model raises ``WrongTask``. A request like any other: deadline,
        cancel, retried elsewhere if its worker dies, queueing keywords as generate's."""
        request = embed_request(inputs, dimensions, truncate)
        future = self._submit(request, deadline_s, pooling_queue_params(priority, queue), None)
        return embedding_result(_waited(future))

    async def aembed(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        truncate: bool = False,
        deadline_s: float | None = None,
        priority: int = 0,
        **queue: Any,
    ) -> EmbeddingResult:
        """asyncio version of :meth:`embed`; cancelling the task stops the worker."""
        request = embed_request(inputs, dimensions, truncate)
        future = self._submit(request, deadline_s, pooling_queue_params(priority, queue), None)
        result: Result = await asyncio.wrap_future(future)
        return embedding_result(result)

    def score(
        self,
        query: str,
        documents: Sequence[str],
        *,
        raw_scores: bool = False,
        truncate: bool = False,
        deadline_s: float | None = None,
        priority: int = 0,
        **queue: Any,
    ) -> ScoreResult:
        """One relevance score of ``query`` per document: a cross-encoder's (the sigmoid of
        its logit; the logit with ``raw_scores``), or an embedding model's cosine::

            result = pool.score("capital of France", ["Paris is...", "Bananas are..."])
            best = max(range(len(result.scores)), key=result.scores.__getitem__)"""
        request = score_request(query, documents, raw_scores, truncate)
        future = self._submit(request, deadline_s, pooling_queue_params(priority, queue), None)
        return score_result(_waited(future))

    async def ascore(
        self,
        query: str,
        documents: Sequence[str],
        *,
        raw_scores: bool = False,
        truncate: bool = False,
        deadline_s: float | None = None,
        priority: int = 0,
        **queue: Any,
    ) -> ScoreResult:
        """asyncio version of :meth:`score`."""
        request = score_request(query, documents, raw_scores, truncate)
        future = self._submit(request, deadline_s, pooling_queue_params(priority, queue), None)
        result: Result = await asyncio.wrap_future(future)
        return score_result(result)

    def health(self) -> PoolHealth:
        """Is the pool alive? Cheap and never waits on the dispatcher thread, so that a
        liveness probe answers even when that thread is wedged::

            health = pool.health()
            health.alive, health.reason, health.heartbeat_age_s

        Not alive: not started, closed, failed (workers could not start, or the
        dispatcher crashed), or the dispatcher's heartbeat is older than
        ``heartbeat_timeout_s`` (a callback or a bug blocks its thread).
        """
        loop = self._loop
        if loop is None:
            state = "closed" if self._closed else "starting"
            return PoolHealth(False, state, None, f"the pool is {state} (start() not called)")
        dispatcher = loop.dispatcher
        age = round(max(0.0, time.monotonic() - loop.heartbeat), 3)
        state = dispatcher.state
        if state == "failed" or dispatcher.crashed:
            cause = dispatcher.last_load_error or "its dispatcher crashed; see the log"
            return PoolHealth(False, "failed", age, f"the pool failed: {cause}")
        if self._closed or state == "closed" or not loop.thread.is_alive():
            return PoolHealth(False, state, age, "the pool is closed")
        bound = self.config.heartbeat_timeout_s
        if age > bound:
            return PoolHealth(
                False,
                state,
                age,
                f"the dispatcher thread has not gone round its loop for {age:.1f} s "
                f"(heartbeat_timeout_s = {bound:g}): it is wedged",
            )
        return PoolHealth(True, state, age)

    def _with_heartbeat(self, snapshot: PoolStats) -> PoolStats:
        """The snapshot with what the pool, not its dispatcher, knows: the heartbeat's age
        and why it serves on its backend."""
        snapshot = dataclasses.replace(snapshot, backend_reason=self._backend_reason)
        loop = self._loop
        if loop is None or not loop.thread.is_alive():
            return snapshot
        age = round(max(0.0, time.monotonic() - loop.heartbeat), 3)
        return dataclasses.replace(snapshot, heartbeat_age_s=age)

    async def astats(self) -> PoolStats:
        """:meth:`stats` for asyncio code: awaits the dispatcher's snapshot without a thread."""
        self._check_owner()
        return self._with_heartbeat(await self._astats())

    async def _astats(self) -> PoolStats:
        loop = self._loop
        if loop is None or not loop.thread.is_alive():
            return self._stats()
        running = asyncio.get_running_loop()
        snapshot: asyncio.Future[PoolStats] = running.create_future()

        def build() -> None:
            stats = loop.dispatcher.snapshot()
            try:
                running.call_soon_threadsafe(_set_if_pending, snapshot, stats)
            except RuntimeError:
                pass  # The caller's event loop is gone.

        if not loop.post(build):
            return self._stats()
        try:
            return await asyncio.wait_for(asyncio.shield(snapshot), 5.0)
        except TimeoutError:
            return self._last_snapshot or loop.dispatcher.snapshot()

    def stats(self) -> PoolStats:
        """A consistent snapshot, built by the dispatcher thread; never waits on a worker.

        ``heartbeat_age_s`` is measured when the snapshot returns: a wedged dispatcher
        shows here (after up to 5 s, with its last snapshot) as a growing age.
        """
        self._check_owner()
        return self._with_heartbeat(self._stats())

    def _stats(self) -> PoolStats:
        loop = self._loop
        if loop is None:
            return Dispatcher(self.config, NoIO(), devices=[]).snapshot()
        if not loop.thread.is_alive() or threading.current_thread() is loop.thread:
            return self._last_snapshot or loop.dispatcher.snapshot()
        holder: list[PoolStats] = []
        ready = threading.Event()

        def build() -> None:
            holder.append(loop.dispatcher.snapshot())
            ready.set()

        if loop.post(build) and ready.wait(5.0):
            return holder[0]
        return self._last_snapshot or loop.dispatcher.snapshot()

    # ---- internals -----------------------------------------------------------------------------

    def _submit(
        self,
        prompt: Prompt | TokenizeRequest | DetokenizeRequest | PoolingRequest,
        deadline_s: float | None,
        gen_kwargs: dict[str, Any],
        on_chunk: Callable[..., None] | None,
        *,
        counted: bool = False,
    ) -> PoolFuture:
        """``counted``: ``on_chunk(text, counts)`` gets each chunk's ``TokenCounts`` too."""
        checked = check_request(prompt, deadline_s, gen_kwargs, self.config, self._backend_validate)
        prompt, deadline_s, gen_kwargs = checked.prompt, checked.deadline_s, checked.gen_kwargs
        priority, max_queue_time_s, traceparent, admitted = checked.queue
        loop = self._loop
        self._check_owner()
        if self._closed:
            raise PoolClosed("the pool is closed")
        if loop is None:
            raise PoolError("the pool is not started: call start() or use `with ModelPool(...)`")
        check_task(loop.dispatcher.worker_manager.task, prompt, checked.generation)
        failure = loop.dispatcher.load_failure()
        if failure is not None:
            raise failure
        if loop.dispatcher.crashed:
            raise PoolError("the pool's dispatcher failed; see the log")
        tokens = self._queue_tokens
        tokens.append(None)
        if len(tokens) > self.config.max_queue:
            self._on_dequeued()
            loop.post(loop.dispatcher.count_overloaded)
            raise PoolOverloaded(f"the queue is full ({self.config.max_queue} waiting)")
        if admitted:
            # Judged and accepted by the caller (the daemon): not judged again, and
            # promoted before its deadline as a request admitted here would be.
            due_in_s: float | None = deadline_s
        else:
            try:
                due_in_s = self.check_admission(
                    priority, max_queue_time_s, deadline_s, size=checked.size
                )
            except QueueFull:
                self._on_dequeued()
                raise
        now = time.monotonic()
        arrived, due_at = arrival(now), self.promotion_at(now, due_in_s)
        if self.config.max_batch_size > 1:  # a batch orders by the pool's rule too
            gen_kwargs[PROMOTED_AT_PARAM] = promotion_at(
                waiting_since=arrived, due_at=due_at, aging_s=self.config.priority_aging_s
            )
        try:
            # The caller's own params only: the worker adds the defaults it was given once.
            payload = encode_request(prompt, gen_kwargs)
        except Exception as exc:
            self._on_dequeued()
            raise InvalidRequest(f"the request cannot be sent to a worker: {exc!r}") from exc
        request_id = f"req-{self._id_prefix}{next(self._request_numbers):x}"
        future = PoolFuture(request_id, self._cancel_from_future)
        request = Request(
            request_id=request_id,
            payload=payload,
            future=future,
            submitted_at=now,
            arrived_at=arrived,
            deadline=now + deadline_s,
            on_chunk=on_chunk,
            counted_chunks=counted,
            prefix_fingerprints=checked.fingerprints,
            priority=priority,
            due_at=due_at,
            max_new_tokens=checked.size.max_new_tokens,
            size=checked.size,
            traceparent=traceparent,
            reproducible=checked.reproducible,
        )
        self._futures[request_id] = future
        if not loop.post(loop.dispatcher.submit, request):
            self._on_dequeued()
            raise PoolClosed("the pool has stopped")
        return future

    def _on_dequeued(self) -> None:
        try:
            self._queue_tokens.pop()
        except IndexError:
            pass  # Every token is accounted for; nothing to give back.

    def _check_owner(self) -> None:
        if os.getpid() != self._owner_pid:
            raise PoolClosed(
                f"this pool belongs to process {self._owner_pid}, which forked this one; "
                "a child process must create its own ModelPool"
            )

    def _cancel_from_future(self, request_id: str) -> None:
        loop = self._loop
        if loop is not None and os.getpid() == self._owner_pid:
            loop.post(loop.dispatcher.cancel, request_id, True)


def _waited(future: PoolFuture) -> Result:
    """The future's result; a caller interrupted while waiting cancels the request."""
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def _checked_ids(token_ids: object) -> tuple[int, ...]:
    prompt = check_prompt(list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids)
    if not isinstance(prompt, TokenIds):
        raise InvalidRequest("token_ids must be a non-empty list of token ids")
    return prompt.ids


def _set_if_pending(future: asyncio.Future[PoolStats], stats: PoolStats) -> None:
    if not future.done():
        future.set_result(stats)
