"""The in-worker scheduler every backend shares, and the model runner a backend plugs in.

The split is vLLM's (``v1/core/sched`` beside the model runner): :class:`Scheduler`
decides, a backend's :class:`ModelRunner` computes. The scheduler owns a worker's
requests from ``admit`` to their answer, through four lists:

- ``compiling``: a constrained request while its grammar compiles on a thread of its own
  (``modelpool.shared.grammar``); the others go on decoding, and one whose compilation fails or
  outlasts its bound ends alone;
- ``waiting``: admitted, waiting for KV room (``kv_tokens``, in the runner's own measure:
  :meth:`ModelRunner.kv_need`); a request alone is always started, whatever its size;
- ``prefilling``: its prompt being read, slice by slice (chunked prefill): at most the
  step's :class:`PrefillBudget` of prompt tokens in all, so a long prompt is read over
  several steps, the decoding rows keep their inter-token latency, and cancels,
  deadlines and disconnects are honoured between slices;
- ``rows``: decoding, one token a step.

Priority (the request's ``priority`` parameter, lower first, 0 when absent), in the pool's
order (``scheduling.ordering``: promoted first, from the instant the pool sends as
``promoted_at``, then by priority, then by arrival): the waiting requests start in that
order, so a more urgent one takes the next free room, and each step's prefill budget goes
to the prefilling requests in that order, so a long low-priority prompt read in slices
yields its slice to a more urgent one, and a promoted one (aged, or due) to nobody. Rows
already decoding are never preempted.

Each :meth:`Scheduler.step` settles finished compilations, starts the waiting requests
that fit, plans the step (:class:`StepPlan`: the decoding rows, the prompts read whole,
the slices) and hands the plan to the runner, which runs the forward passes, chooses each
row's token and reports back through the scheduler's step calls: :meth:`Scheduler.take`
(a row's token: streamed text, stop strings, ``max_new_tokens``, end of generation,
grammar completion), :meth:`Scheduler.prefilled`, :meth:`Scheduler.fail` (a fault that
is one row's) and :meth:`Scheduler.lost` (a pass over several rows failed: they leave
together as ``protocol.RowsLost``, waiting and prefilling requests stay).

A runner holds the model and the KV memory: it loads, builds a request's row
(:meth:`ModelRunner.row`), reserves and frees its KV (:meth:`ModelRunner.start`,
:meth:`ModelRunner.release`, :meth:`ModelRunner.reset`), runs a plan and samples. It gets
batching, chunked prefill, grammars, stop strings, penalties' bookkeeping and the room
report without writing them again; the prefix cache's skeleton is ``prefix_cache``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, NoReturn, Protocol, TypeVar

from modelpool.scheduling.ordering import Urgency, urgency
from modelpool.shared.grammar import (
    GRAMMAR_PARAM,
    PendingGrammar,
    RowGrammar,
    settle_compiled,
    wait_for_any,
)
from modelpool.shared.protocol import (
    BatchCall,
    Call,
    Finished,
    FinishReason,
    Generation,
    Prompt,
    RowsLost,
    TokenLogprob,
    note_prompt,
)
from modelpool.shared.validation import PRIORITY_PARAM, PROMOTED_AT_PARAM
from modelpool.worker.backends.common.sampling import Sampling
from modelpool.worker.backends.common.text import TextProgress
from modelpool.worker.backends.common.thinking import (
    ThinkingModels,
    ThinkingTracker,
    is_chat,
    thinking_for,
)

State = TypeVar("State")

PrefillChunk = int | Literal["auto"]
_AUTO_MIN_SLICE = 16
_AUTO_MAX_SLICE = 4096
_AUTO_SLICE_OVER_STEP = 1.3  # what a slice adds to a step beside rows, in decoding steps
_AUTO_SOLO_SLICE_S = 1.0  # a slice's target time when no row is decoding
_AUTO_FIRST_SOLO_SLICE = 128  # tokens, before a slice alone is timed
AUTO_WHOLE_PROMPT = 128
"""In "auto" mode, a prompt (or a rest of one) this short is read in one pass."""
_STEPS_TIMED = 16  # plain decoding steps whose median sets the slice's target beside rows
_AUTO_SLICE_GROWTH = 1.25  # beside rows, a slice grows at most this much a step (rows pay)
_COMPILE_WAIT_S = 0.05  # with only grammars compiling, a step waits this long for one


@dataclass(eq=False)
class Row(Generic[State]):
    """One request in the scheduler; ``state`` is the runner's own (its KV, its RNG)."""

    call: BatchCall
    prompt_ids: list[int]
    progress: TextProgress
    sampling: Sampling
    max_new_tokens: int
    state: State
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    prefilled: int = 0  # prompt tokens read (or taken from the prefix cache)
    cached_tokens: int = 0  # of those, taken from the prefix cache
    pending_grammar: PendingGrammar[Any] | None = None  # its grammar, while it compiles
    grammar: RowGrammar | None = None  # its grammar state, once compiled
    thinking: ThinkingTracker[int] | None = None  # a reasoning model's thinking, bounded

    @property
    def generated(self) -> int:
        return len(self.progress.token_ids)

    @property
    def remaining(self) -> int:
        return max(0, self.max_new_tokens - self.generated)

    def result(self, finish_reason: FinishReason) -> Generation:
        thinking = self.thinking
        return Generation(
            self.progress.lead + self.progress.text,
            finish_reason,
            len(self.prompt_ids),
            self.generated,
            self.logprobs,
            self.prompt_logprobs,
            cached_tokens=self.cached_tokens,
            stop_sequence=self.progress.stop_sequence if finish_reason == "stop" else None,
            reasoning_tokens=None if thinking is None else thinking.tokens,
            thinking_closed=None if thinking is None else thinking.closed_by,
        )


class Grammars(Protocol):
    """What the scheduler needs of a backend's grammar engine."""

    def start(self, params: Mapping[str, Any]) -> PendingGrammar[Any]: ...

    def row(self, compiled: Any) -> RowGrammar: ...


@dataclass
class StepPlan(Generic[State]):
    """What one step computes, in this order of preference."""

    decoding: list[Row[State]]  # the rows decoding when the step began, one token each
    whole: list[Row[State]]  # fresh short prompts read whole (a runner may read them together)
    slices: list[tuple[Row[State], int]]  # the next slice (tokens) of other prefilling prompts
    fused: bool  # the first slice may ride on the decoding rows' pass


class ModelRunner(Protocol[State]):
    """What a backend implements: a model, its KV memory, a forward pass and sampling.

    ``end_ids``: the end-of-generation tokens; ``slices_ride_on_decode``: whether a prompt
    slice can share the decoding rows' forward pass (then the first slice does)."""

    @property
    def end_ids(self) -> frozenset[int]: ...

    @property
    def slices_ride_on_decode(self) -> bool: ...

    def row(self, call: BatchCall) -> Row[State]:
        """``call`` as a row: its prompt ids, sampling, ``max_new_tokens`` fitted to the
        context; raises what refuses the request (that request's answer alone)."""
        ...

    def grammars(self) -> Grammars: ...

    def kv_need(self, rows: Sequence[Row[State]]) -> int:
        """KV room, in ``Scheduler.kv_tokens``' measure, ``rows`` may come to take."""
        ...

    def join_cells(self, rows: Sequence[Row[State]], joining: Row[State]) -> int:
        """Cache positions written when ``joining``, its prompt read, joins ``rows``
        (what a join's measured time per position is scaled by)."""
        ...

    def start(self, row: Row[State], need: int) -> bool:
        """Reserve ``row``'s KV as its prefill starts (``need``: every started row's with
        it), from the longest cached prefix of its prompt when there is one (setting
        ``prefilled`` and ``cached_tokens``); False when it cannot start yet."""
        ...

    def run(self, plan: StepPlan[State], step: Scheduler[State]) -> None:
        """Run the plan's forward passes and report each row's progress to ``step``."""
        ...

    def release(self, row: Row[State]) -> None:
        """Free whatever KV ``row`` holds (it was retired); nothing if it holds none."""
        ...

    def reset(self, started: list[Row[State]]) -> None:
        """Forget every request (``started``: those holding KV) and their KV."""
        ...


class PrefillBudget:
    """Prompt tokens one step may prefill: ``prefill_chunk_tokens``, or "auto", which
    sizes each step's slices by timing them (the runner reports the times).

    "auto": what a slice adds to a step is about 1.3 decoding steps (the median of the
    recent ones) while rows are decoding, so a step lasts about 2.3 normal ones while a
    long prompt is read (under 3, the bound kept); about a second when none is (cancels
    are still read every second). Beside rows the slice starts small, so the first one
    costs the running rows little. The median, not an average: a few slow first steps
    raised an average, and the slices grew where they should have shrunk.

    The step that reads a prompt's last slice also takes its first token and joins the
    row to the batch (the hf runner copies its cache into the batch's): that join's
    measured time is taken out of the last slice's share (``last_slice``), so that the
    step that ends a prompt is no longer than the ones before it."""

    def __init__(self, prefill_chunk_tokens: PrefillChunk) -> None:
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.auto = prefill_chunk_tokens == "auto"
        self._auto_slice = {True: _AUTO_MIN_SLICE, False: _AUTO_FIRST_SOLO_SLICE}
        self._decode_steps_s: deque[float] = deque(maxlen=_STEPS_TIMED)
        # Seconds per prompt token of a slice ridden beside rows, and of a join per cache
        # cell it writes (rows after it times their width): the latest measured.
        self._slice_token_s: float | None = None
        self._join_cell_s: float | None = None

    def size(self, beside_rows: bool) -> int:
        if self.prefill_chunk_tokens != "auto":
            return self.prefill_chunk_tokens
        return self._auto_slice[beside_rows]

    @property
    def decode_step_s(self) -> float | None:
        """The median of the recent plain decoding steps' times (None before the first)."""
        return statistics.median(self._decode_steps_s) if self._decode_steps_s else None

    def timed_decode(self, seconds: float) -> None:
        self._decode_steps_s.append(seconds)

    def steer(self, tokens: int, seconds: float, beside_rows: bool) -> None:
        """Resize the "auto" slice from a full slice's time (what it added to the step,
        when it rode on one) against its target: 1.3 decoding steps while rows decode
        (a step then lasts about 2.3 normal ones: more came within noise of the 3 the
        running rows' inter-token latency is held under, less lengthens the long
        prompt's hold on its slot), a second when none does.
        Steered by time, not by a per-token cost: a pass has a fixed cost (reading the
        weights) that small slices would overweight, shrinking the slice further and
        further."""
        if beside_rows and tokens > 0:
            self._slice_token_s = seconds / tokens
        if self.prefill_chunk_tokens != "auto" or tokens < self._auto_slice[beside_rows]:
            return
        step_s = self.decode_step_s
        target_s = _AUTO_SLICE_OVER_STEP * step_s if beside_rows and step_s else _AUTO_SOLO_SLICE_S
        growth = _AUTO_SLICE_GROWTH if beside_rows else 2.0
        scale = min(growth, max(0.5, target_s / max(seconds, 1e-6)))
        resized = int(min(_AUTO_MAX_SLICE, max(_AUTO_MIN_SLICE, tokens * scale)))
        self._auto_slice[beside_rows] = resized

    def joined(self, cells: int, seconds: float) -> None:
        """A row took its first token and joined the running rows in ``seconds``; the
        batch's cache has ``cells`` positions after it (rows times width: the merge
        writes them all)."""
        self._join_cell_s = seconds / max(1, cells)

    def last_slice(self, count: int, rest: int, cells: int) -> int:
        """Of a prompt's ``rest``, how much to read beside rows in a step whose budget is
        ``count`` tokens: all of it when it fits with the join (``cells``: the batch's
        cache positions after it; before a join is measured, a join is counted as one
        decoding step), else at most what leaves a last slice that does, and at least a
        minimum slice, so that the prompt ends."""
        if not self.auto or rest > count or self._slice_token_s is None:
            return min(count, rest)
        if self._join_cell_s is not None:
            join_s = self._join_cell_s * cells
        else:
            join_s = self.decode_step_s or 0.0
        room = count - int(join_s / max(self._slice_token_s, 1e-9))
        last = max(_AUTO_MIN_SLICE, room)
        if rest <= last:
            return rest
        return max(_AUTO_MIN_SLICE, rest - last)


class Scheduler(Generic[State]):
    """One worker's requests in flight over ``runner``; every method runs on the worker
    loop's thread. ``kv_tokens``: the KV budget started requests share."""

    def __init__(
        self, runner: ModelRunner[State], kv_tokens: int, prefill_chunk_tokens: PrefillChunk
    ) -> None:
        self.runner = runner
        self.kv_tokens = kv_tokens
        self.budget = PrefillBudget(prefill_chunk_tokens)
        self.compiling: list[Row[State]] = []
        self.waiting: list[Row[State]] = []
        self.prefilling: list[Row[State]] = []
        self.rows: list[Row[State]] = []
        self._finished: list[Finished] = []
        # A reasoning model's thinking, per parser (set by a handler that reads it).
        self.thinking_models: ThinkingModels | None = None

    # ---- the BatchedHandler surface ------------------------------------------------------

    def admit(self, call: BatchCall) -> None:
        row = self.runner.row(call)
        if is_chat(call.prompt):
            # A chat's answer may think; a raw prompt's continuation is the caller's text.
            row.thinking = thinking_for(
                self.thinking_models, row.prompt_ids, call.params, row.max_new_tokens, row.progress
            )
        if call.params.get(GRAMMAR_PARAM) is None:
            self._wait(row)
            return
        # Compiled on a thread of its own: the running rows go on decoding meanwhile.
        row.pending_grammar = self.runner.grammars().start(call.params)
        self.compiling.append(row)

    def step(self) -> list[Finished]:
        finished = self._finished = []
        if self.compiling:
            ready, failed = settle_compiled(self.compiling, self.runner.grammars().row)
            for row in ready:
                if row.thinking is not None and row.thinking.thinking:
                    # The grammar constrains the answer: it starts after the thinking.
                    row.thinking.held_grammar, row.grammar = row.grammar, None
                self._wait(row)
            finished.extend((row.call, error) for row, error in failed)
        self._start_prefills()
        plan = self._plan()
        if plan.decoding or plan.whole or plan.slices:
            self.runner.run(plan, self)
        if self.compiling and not finished and not (self.waiting or self.prefilling or self.rows):
            # Only compilations to wait for: wait on them (briefly, so that cancels are
            # still read) rather than spin.
            pending = [row.pending_grammar for row in self.compiling if row.pending_grammar]
            wait_for_any(pending, _COMPILE_WAIT_S)
        return finished

    def retire(self, call: BatchCall) -> Generation:
        for queue in (self.compiling, self.waiting, self.prefilling, self.rows):
            for row in queue:
                if row.call is call:
                    queue.remove(row)
                    self.runner.release(row)
                    return row.result("cancelled")
        return Generation("", "cancelled", None, 0)

    def abort(self) -> None:
        started = self.prefilling + self.rows
        self.compiling.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self.rows.clear()
        self.runner.reset(started)

    def room(self) -> tuple[int, list[BatchCall]]:
        """Free KV room beside the requests already started, and the requests waiting
        for room."""
        started = self.rows + self.prefilling
        used = self.runner.kv_need(started) if started else 0
        return max(0, self.kv_tokens - used), [row.call for row in self.waiting]

    # ---- what the runner reports during a step -----------------------------------------------

    def prefilled(self, row: Row[State], tokens: int) -> None:
        """``tokens`` more of ``row``'s prompt were read (progress for the stall clock)."""
        row.prefilled += tokens
        row.call.prefilled(tokens)

    def take(self, row: Row[State], token_id: int) -> bool:
        """Give ``row`` its next token; True when the request has ended (its answer is
        recorded). A row whose prompt was just read joins the decoding rows. Raises what
        ended the request in error (its stream, its stop strings, its grammar): that
        row's fault alone, for the runner to report through :meth:`fail`."""
        progress = row.progress
        progress.take([token_id])
        row.call.delivered()
        progress.on_token()
        if progress.error is not None:
            raise progress.error
        grammar = row.grammar
        thinking = row.thinking
        if thinking is not None and thinking.take(token_id) and thinking.held_grammar is not None:
            # Thinking ended with this token: the grammar reads the answer from the next.
            held, thinking.held_grammar = thinking.held_grammar, None
            for lead in thinking.grammar_lead:
                held.take(lead)
            row.grammar = held
        grammar_complete = grammar is not None and grammar.take(token_id)
        ended = not row.sampling.ignore_eos and token_id in self.runner.end_ids
        if progress.stopped or ended or grammar_complete:
            reason: FinishReason = "stop"
        elif row.generated >= row.max_new_tokens:
            reason = "length"
        else:
            if row in self.prefilling:
                self.prefilling.remove(row)
                self.rows.append(row)
            return False
        progress.flush()
        if progress.error is not None:
            raise progress.error
        self.finish(row, reason)
        return True

    def finish(self, row: Row[State], reason: FinishReason) -> None:
        """``row`` ended normally with ``reason``: its answer is recorded."""
        row.finish_reason = reason
        self._leave(row)
        self._finished.append((row.call, row.result(reason)))

    def fail(self, row: Row[State], error: Exception) -> None:
        """``row`` ended with ``error``, its fault alone."""
        self._leave(row)
        self._finished.append((row.call, error))

    def lost(self, rows: list[Row[State]], error: Exception) -> NoReturn:
        """A pass over ``rows`` failed and cannot be blamed on one of them: they leave
        together (the runner has freed their KV); the others stay."""
        for row in rows:
            self._leave(row)
        raise RowsLost([row.call for row in rows], error, self._finished) from error

    # ---- admission and planning ------------------------------------------------------------

    def _wait(self, row: Row[State]) -> None:
        """Queue ``row`` for KV room, in arrival order (``_start_prefills`` takes them
        most urgent first)."""
        self.waiting.append(row)

    def _start_prefills(self) -> None:
        """Waiting requests that fit the KV budget beside the started ones, in order."""
        started = self.rows + self.prefilling
        now = time.monotonic()
        for row in sorted(self.waiting, key=lambda row: _urgency(row, now)):
            need = self.runner.kv_need([*started, row])
            if started and need > self.kv_tokens:
                break
            if not self.runner.start(row, need):
                break
            self.waiting.remove(row)
            self.prefilling.append(row)
            started.append(row)
            note_prompt(row.call, len(row.prompt_ids), row.cached_tokens)

    def _plan(self) -> StepPlan[State]:
        """The next slice of each prefilling request, in order, within this step's budget.
        In "auto" mode fresh short prompts are read whole (a pass has a fixed cost, reading
        the weights, that slicing them would multiply) and may share one pass; longer ones
        are sliced, the first riding on the decoding rows' pass when the runner allows."""
        budget = self.budget.size(bool(self.rows))
        # Fresh short prompts share one pass up to this many tokens; with no row decoding
        # there is no one's latency to protect, and all of them do.
        group_budget = max(budget, AUTO_WHOLE_PROMPT) if self.rows else None
        # The short rest of a long prompt is read whole too (one pass's fixed cost saved),
        # unless it rides on the decoding step's pass: there it costs only its tokens, and
        # the budget keeps the step short (read whole, the last 115 tokens of a
        # 1,000-token prompt made a step 8 times a normal one).
        fused = bool(self.rows) and self.runner.slices_ride_on_decode
        whole: list[Row[State]] = []
        slices: list[tuple[Row[State], int]] = []
        # The most urgent first: a long low-priority prompt yields its slice.
        now = time.monotonic()
        for row in sorted(self.prefilling, key=lambda row: _urgency(row, now)):
            rest = len(row.prompt_ids) - row.prefilled
            read_whole = (
                self.budget.auto and rest <= AUTO_WHOLE_PROMPT and (row.prefilled == 0 or not fused)
            )
            if read_whole and row.prefilled == 0 and (group_budget is None or group_budget > 0):
                whole.append(row)
                budget -= rest
                if group_budget is not None:
                    group_budget -= rest
                continue
            if budget <= 0:
                break
            if read_whole:
                count = rest
            elif self.rows:
                cells = self.runner.join_cells(self.rows, row)
                count = self.budget.last_slice(budget, rest, cells)
            else:
                count = min(budget, rest)
            budget -= count
            slices.append((row, count))
        return StepPlan(list(self.rows), whole, slices, fused)

    def _leave(self, row: Row[State]) -> None:
        for queue in (self.prefilling, self.rows):
            if row in queue:
                queue.remove(row)


def _urgency(row: Row[Any], now: float) -> Urgency:
    """The pool's order (``scheduling.ordering``): promoted first, then by priority; the
    sorts are stable, so arrival order within one urgency."""
    params = row.call.params
    promoted_at: float = params.get(PROMOTED_AT_PARAM, math.inf)
    return urgency(params.get(PRIORITY_PARAM, 0), promoted_at=promoted_at, now=now)


class ScheduledHandler:
    """The batched handler surface (``protocol.BatchedHandler``) of a backend whose
    requests run through a :class:`Scheduler`."""

    scheduler: Scheduler[Any]

    def admit(self, call: BatchCall) -> None:
        """Queue ``call``; its prefill starts at a :meth:`step` when it fits."""
        self.scheduler.admit(call)

    def step(self) -> list[Finished]:
        """Prefill what fits, one decoding step for every running request."""
        return self.scheduler.step()

    def retire(self, call: BatchCall) -> Generation:
        """Drop ``call`` now; returns its text so far."""
        return self.scheduler.retire(call)

    def abort(self) -> None:
        """Forget every request."""
        self.scheduler.abort()

    def room(self) -> tuple[int, list[BatchCall]]:
        """Free KV room, and the requests waiting for it."""
        return self.scheduler.room()


class SoloCall:
    """A one-call ``Call`` seen as a ``BatchCall``: the one-call worker counts its
    ``cancelled()`` checks as progress, so token and prefill counts are not needed."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.prompt = call.prompt
        self.params = call.params
        self.defaulted = getattr(call, "defaulted", ())

    def cancelled(self) -> bool:
        return self.call.cancelled()

    def emit(self, text: str) -> None:
        self.call.emit(text)

    def delivered(self, tokens: int = 1) -> None:
        pass

    def prefilled(self, tokens: int) -> None:
        pass


class WarmUpCall:
    """The one-token request a backend answers at load, so that the first real request
    does not pay for lazy set-up."""

    prompt: Prompt = "Hello"
    params: dict[str, Any] = {"max_new_tokens": 1}

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        pass


def run_alone(scheduler: Scheduler[Any], call: Call) -> Generation:
    """The one-call form over a scheduler: ``call`` with nothing else in it, stopped at
    the first step after its cancel flag is set (between prefill slices too)."""
    solo = SoloCall(call)
    scheduler.admit(solo)
    try:
        while True:
            for _, outcome in scheduler.step():
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome
            if call.cancelled():
                return scheduler.retire(solo)
    except BaseException:
        scheduler.abort()
        raise
