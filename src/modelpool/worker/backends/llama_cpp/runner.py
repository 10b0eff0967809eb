"""The llama_cpp backend's model runner: every running request in one ``llama_decode`` a step.

Both forms of the backend run through the shared scheduler (``common.scheduler``): the
batched form (``max_batch_size`` above 1) is driven by the worker loop through
``admit``/``step``/``retire``/``abort``; the one-call form, ``generate``, is the same
loop with one request in it (``common.scheduler.run_alone``), so both forms choose the
same tokens.

Each request is its own llama.cpp sequence (``seq_id``) in one unified KV cache of
``kv_cells`` cells (the scheduler's KV budget: a request reserves its prompt plus its
``max_new_tokens``, :meth:`LlamaRunner.kv_need`); its cells are removed
(``llama_memory_seq_rm``) the moment it ends, is retired or lost. :meth:`LlamaRunner.run`
builds one llama.cpp batch per step: the latest token of every decoding row (its own
sequence id and position), then the prompt slices the scheduler chose; runs one
``llama_decode`` over it, and gives each decoding row, and each request whose prompt is
now read, its next token (``sampling``, in numpy).

Faults stay in their row where they can be attributed: a failure choosing or
emitting one row's token is that request's. A ``llama_decode`` that fails over
several rows cannot be blamed on one: they leave together as
``protocol.RowsLost`` while waiting requests stay.

With a prefix cache (``prefix_cache_tokens`` above 0, see ``llama_cpp.prefix_cache``), a
request that ends normally leaves its sequence to the cache instead of removing it, and
a request starting its prefill takes the longest cached prefix of its prompt into its
own sequence (``llama_memory_seq_cp``) and reads only the rest. Cached cells count
against ``kv_cells`` beside the started requests' reservations, and entries are evicted
the moment a request needs their cells or sequence id. With prefix cache tiers
(``llama_cpp.prefix_tier``), each new entry's state is also written out of the worker,
and a request the worker's cache misses by a block or more starts its sequence from
the longest prefix a tier holds (``sequence_state.load_state``) before its prefill.

LoRA adapters (``llama_cpp.lora``): llama.cpp applies an adapter to the whole context, so a
step decodes the rows of one adapter (or of none), the groups taken in turn step by
step so that no group's rows stall; a request's adapter is read as it is admitted (a
file llama.cpp refuses is its 400) and held while it runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.grammar import RowGrammar
from modelpool.shared.lora import LoraRef, lora_ref
from modelpool.shared.prefix_tier import BLOCK_TOKENS as TIER_BLOCK_TOKENS
from modelpool.shared.prefixes import answered_fingerprints, partition_of
from modelpool.shared.protocol import BatchCall, Call, PrefixCacheReport, Prompt, TokenLogprob
from modelpool.shared.reasoning.controls import template_params
from modelpool.worker.backends.common.sampling import Sampling
from modelpool.worker.backends.common.scheduler import Grammars, Row, Scheduler, StepPlan
from modelpool.worker.backends.common.text import TextProgress, stop_strings
from modelpool.worker.backends.llama_cpp.lora import GgufLoras
from modelpool.worker.backends.llama_cpp.prefix_cache import SequencePrefixCache
from modelpool.worker.backends.llama_cpp.prefix_tier import LlamaPrefixTiers
from modelpool.worker.backends.llama_cpp.sampling import choose_token, token_logprob
from modelpool.worker.backends.llama_cpp.sequence_state import (
    StateRefused,
    load_state,
    state_bytes,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

logger = logging.getLogger(__name__)


class Runtime(Protocol):
    """What the runner needs of a loaded llama.cpp model and context (``runtime.Runtime``)."""

    end_ids: npt.NDArray[np.int64]
    end_id_set: frozenset[int]
    n_vocab: int

    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[int], outputs: list[bool]
    ) -> int: ...

    def logits(self, index: int) -> npt.NDArray[np.float32]: ...

    llama: Any
    context: Any
    memory: Any

    def remove_sequence(self, seq_id: int) -> None: ...

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give sequence ``target`` the cells of ``source``'s positions [0, length)."""
        ...

    def trim_sequence(self, seq_id: int, length: int) -> None:
        """Remove sequence ``seq_id``'s cells from position ``length`` on."""
        ...

    def clear(self) -> None: ...

    def use_adapter(self, handle: Any) -> None: ...

    def token_text(self, token_id: int) -> str: ...

    def decoder(self) -> Any: ...


class LlamaGrammarEngine(Grammars, Protocol):
    """What the runner needs of the grammar engine (``grammars.LlamaGrammars``)."""

    def allowed(self, grammar: RowGrammar) -> npt.NDArray[np.bool_]: ...


class Encoder(Protocol):
    """What the runner needs of the handler: prompts as token ids, the context fit."""

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int: ...

    def grammars(self) -> LlamaGrammarEngine: ...


class DecodeFailed(RuntimeError):
    """``llama_decode`` returned an error code."""


@dataclass(eq=False)
class LlamaRow:
    """The runner's part of a row: its sequence, RNG, logprob asks, tokens seen."""

    rng: np.random.Generator | None
    top_logprobs: int | None
    prompt_top_logprobs: int | None
    seq_id: int = -1
    pending: int = -1  # the latest token, decoded at the next step
    seen: list[int] = field(default_factory=list)
    lora: LoraRef | None = None  # the request's adapter
    adapter: str | None = None  # its key in the held adapters, while the row holds it
    adapter_error: InvalidRequest | None = None  # its adapter could not be read as it started


LlamaRequest = Row[LlamaRow]


def reserved(row: LlamaRequest) -> int:
    """KV cells a request may come to hold."""
    return len(row.prompt_ids) + row.max_new_tokens


def held_ids(row: LlamaRequest) -> list[int]:
    """The token ids whose cells the row's sequence holds: its prompt and its answer but
    the last token, which was chosen and never decoded."""
    answer = row.progress.token_ids
    return row.prompt_ids + answer[: max(0, len(answer) - 1)]


class LlamaRunner:
    """One worker's llama.cpp sequences and decodes; every method runs on the worker
    loop's thread, driven by a :class:`Scheduler` whose KV budget is ``kv_cells``."""

    def __init__(
        self,
        runtime: Runtime,
        encoder: Encoder,
        *,
        kv_cells: int,
        max_sequences: int,
        prefix_cache_tokens: int = 0,
        cell_bytes: int = 0,
        loras: GgufLoras | None = None,
    ) -> None:
        self.runtime = runtime
        self.encoder = encoder
        self.kv_cells = kv_cells
        self._free_seq_ids = list(range(max_sequences - 1, -1, -1))
        self.loras = loras
        self._turn = ""  # the adapter group the latest step decoded ("": the base)
        self.prefix_cache = (
            SequencePrefixCache(prefix_cache_tokens, cell_bytes, self._free_sequence)
            if prefix_cache_tokens > 0
            else None
        )
        self.tiers: LlamaPrefixTiers | None = None  # the handler's attach_prefix_tiers

    # ---- the ModelRunner surface ---------------------------------------------------------

    @property
    def end_ids(self) -> frozenset[int]:
        return self.runtime.end_id_set

    @property
    def slices_ride_on_decode(self) -> bool:
        # Every slice goes into the step's one llama_decode with the decoding rows.
        return True

    def grammars(self) -> LlamaGrammarEngine:
        return self.encoder.grammars()

    def row(self, call: BatchCall) -> LlamaRequest:
        import numpy as np

        params = call.params
        prompt_ids = self.encoder.encode(
            call.prompt, params.get("tools"), template_kwargs=template_params(params)
        )
        stops = stop_strings(params["stop"]) if "stop" in params else ()
        sampling = Sampling.from_params(params, self.runtime.n_vocab)
        rng = np.random.default_rng(params.get("seed")) if sampling.do_sample else None
        top_logprobs: int | None = params.get("logprobs")
        lora = lora_ref(params)
        if lora is not None:
            if self.loras is None:
                raise InvalidRequest("this model serves no LoRA adapters")
            self.loras.check(lora)  # its 400, before any batch
        return Row(
            call=call,
            prompt_ids=prompt_ids,
            progress=TextProgress(self.runtime.decoder(), call, len(prompt_ids), stops),
            sampling=sampling,
            # Raises ContextLengthExceeded (that request's answer alone) when it cannot fit.
            max_new_tokens=self.encoder.fit_new_tokens(call, dict(params), len(prompt_ids)),
            state=LlamaRow(
                rng,
                top_logprobs,
                params.get("prompt_logprobs"),
                seen=list(prompt_ids),
                lora=lora,
            ),
            logprobs=None if top_logprobs is None else [],
        )

    def kv_need(self, rows: Sequence[LlamaRequest]) -> int:
        """Cells the rows reserve. Cached cells count as free: a starting request evicts
        them at once."""
        return sum(reserved(row) for row in rows)

    def join_cells(self, rows: Sequence[LlamaRequest], joining: LlamaRequest) -> int:
        # A row joins by decoding beside the others in its sequence's cells: nothing is copied.
        return 0

    def start(self, row: LlamaRequest, need: int) -> bool:
        cache = self.prefix_cache
        if cache is not None:
            # Cached cells give way to the request: they never hold its room.
            while need + cache.cells > self.kv_cells and cache.evict():
                pass
            if not self._free_seq_ids and not len(cache):
                return False
        elif not self._free_seq_ids:
            return False
        if not self._take_adapter(row):
            return False
        self._take_sequence(row)
        return True

    def _take_adapter(self, row: LlamaRequest) -> bool:
        """Hold the row's adapter; False when every place is in use (it waits)."""
        state = row.state
        if state.lora is None or self.loras is None:
            return True
        try:
            state.adapter = self.loras.acquire(state.lora)
        except InvalidRequest as exc:
            state.adapter_error = exc  # its file changed since admission: failed in run
            return True
        return state.adapter is not None

    def run(self, plan: StepPlan[LlamaRow], step: Scheduler[LlamaRow]) -> None:
        plan = self._one_adapter(plan, step)
        decoding = plan.decoding
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        outputs: list[bool] = []
        for row in decoding:
            tokens.append(row.state.pending)
            positions.append(len(row.prompt_ids) + row.generated - 1)
            seq_ids.append(row.state.seq_id)
            outputs.append(True)
        slices: list[tuple[LlamaRequest, int, int, int]] = []  # row, start, end, first index
        reads = [(row, len(row.prompt_ids) - row.prefilled) for row in plan.whole]
        for row, count in reads + plan.slices:
            start, end = row.prefilled, row.prefilled + count
            slices.append((row, start, end, len(tokens)))
            last = len(row.prompt_ids) - 1
            every = row.state.prompt_top_logprobs is not None
            for position in range(start, end):
                tokens.append(row.prompt_ids[position])
                positions.append(position)
                seq_ids.append(row.state.seq_id)
                outputs.append(every or (position == last and row.max_new_tokens > 0))
        code = self.runtime.decode(tokens, positions, seq_ids, outputs)
        if code != 0:
            self._lose([*decoding, *(row for row, *_ in slices)], code, step)
            return
        for index, row in enumerate(decoding):
            self._guarded(row, step, functools.partial(self._next, row, index, step))
        for row, start, end, first in slices:
            work = functools.partial(self._read, row, start, end, first, step)
            self._guarded(row, step, work)

    def _one_adapter(
        self, plan: StepPlan[LlamaRow], step: Scheduler[LlamaRow]
    ) -> StepPlan[LlamaRow]:
        """The part of ``plan`` this step decodes: the rows of one adapter group, the
        group after the latest one decoded (llama.cpp applies adapters per context); the
        adapter set on the context. Rows whose adapter failed to load leave first."""
        rows = [*plan.decoding, *plan.whole, *(row for row, _ in plan.slices)]
        for row in rows:
            if row.state.adapter_error is not None:
                self._end(row)
                step.fail(row, row.state.adapter_error)
        groups = sorted(
            {row.state.adapter or "" for row in rows if row.state.adapter_error is None}
        )
        if not groups:
            return StepPlan([], [], [], plan.fused)
        chosen = next((key for key in groups if key > self._turn), groups[0])
        self._turn = chosen

        def mine(row: LlamaRequest) -> bool:
            return row.state.adapter_error is None and (row.state.adapter or "") == chosen

        if self.loras is not None:
            self.runtime.use_adapter(self.loras.handle(chosen) if chosen else None)
        return StepPlan(
            [row for row in plan.decoding if mine(row)],
            [row for row in plan.whole if mine(row)],
            [(row, count) for row, count in plan.slices if mine(row)],
            plan.fused,
        )

    def release(self, row: LlamaRequest) -> None:
        """Free the row's KV cells, its sequence id and its hold on its adapter."""
        if row.state.adapter is not None and self.loras is not None:
            self.loras.release(row.state.adapter)
            row.state.adapter = None
        if row.state.seq_id < 0:
            return
        seq_id, row.state.seq_id = row.state.seq_id, -1
        self._free_sequence(seq_id)

    def reset(self, started: list[LlamaRequest]) -> None:
        for row in started:
            self.release(row)
        self.runtime.clear()
        if self.prefix_cache is not None:
            self._free_seq_ids.extend(self.prefix_cache.clear())

    def prefix_cache_report(self) -> PrefixCacheReport | None:
        return None if self.prefix_cache is None else self.prefix_cache.report()

    # ---- sequences -------------------------------------------------------------------------

    def _take_sequence(self, row: LlamaRequest) -> None:
        """Give ``row`` a sequence id, starting it with the cells of the longest cached
        prefix of its prompt when there is one (not for prompt logprobs: every prompt
        position's logits are read)."""
        cache = self.prefix_cache
        found = None
        partition = partition_of(row.call.params)
        if cache is not None and row.state.prompt_top_logprobs is None:
            found = cache.lookup(row.prompt_ids, partition)
        if self._restore_from_tier(row, partition, 0 if found is None else found[1]):
            return
        if cache is not None and found is not None:
            entry, length = found
            if self._free_seq_ids:
                row.state.seq_id = self._free_seq_ids.pop()
                self.runtime.copy_prefix(entry.seq_id, row.state.seq_id, length)
            else:
                # No sequence id to copy into: the request takes the entry's own.
                row.state.seq_id = cache.take(entry)
                self.runtime.trim_sequence(row.state.seq_id, length)
            row.prefilled = row.cached_tokens = length
        else:
            if not self._free_seq_ids and cache is not None:
                cache.evict()
            row.state.seq_id = self._free_seq_ids.pop()

    def _restore_from_tier(self, row: LlamaRequest, partition: int, held: int) -> bool:
        """Start ``row``'s sequence with the state of the longest prefix of its prompt a
        tier holds, when that is at least a block more than the worker's cache holds
        (``held``); False when it starts otherwise (no tier hit, or llama.cpp refused the
        state: the prompt is then prefilled)."""
        tiers, cache, prompt = self.tiers, self.prefix_cache, row.prompt_ids
        if tiers is None or cache is None or row.state.prompt_top_logprobs is not None:
            return False
        if held + TIER_BLOCK_TOKENS > len(prompt) - 1:
            return False
        hit = tiers.lookup(prompt, partition, held)
        if hit is None:
            return False
        if not self._free_seq_ids:
            cache.evict()
        if not self._free_seq_ids:
            return False
        seq_id = self._free_seq_ids.pop()
        try:
            load_state(self.runtime, hit.payload, seq_id, len(hit.ids), hit.length)
        except StateRefused:
            logger.warning("llama.cpp refused a prefix tier's state; prefilling", exc_info=True)
            self._free_seq_ids.append(seq_id)
            return False
        row.state.seq_id = seq_id
        row.prefilled = row.cached_tokens = hit.length
        return True

    def _write_to_tiers(
        self, seq_id: int, ids: list[int], fingerprints: tuple[int, ...], partition: int
    ) -> None:
        """Hand a new cache entry's state to the tiers (copied out here; written on their
        writer thread)."""
        tiers = self.tiers
        if tiers is not None and tiers.wants(ids, partition):
            tiers.write(ids, state_bytes(self.runtime, seq_id, len(ids)), fingerprints, partition)

    def _free_sequence(self, seq_id: int) -> None:
        self.runtime.remove_sequence(seq_id)
        self._free_seq_ids.append(seq_id)

    def _end(self, row: LlamaRequest, *, keep: bool = False) -> None:
        """Free ``row``'s sequence; ``keep``: it ended normally, and its cells may stay in
        the prefix cache."""
        if keep and self.prefix_cache is not None and row.state.seq_id >= 0:
            try:
                answer = row.progress.token_ids
                partition = partition_of(row.call.params)
                fingerprints = answered_fingerprints(
                    row.call.prompt, row.progress.text, answer, partition
                )
                held = held_ids(row)
                if self.prefix_cache.insert(row.state.seq_id, held, fingerprints, partition):
                    seq_id, row.state.seq_id = row.state.seq_id, -1
                    self._write_to_tiers(seq_id, held, fingerprints, partition)
            except Exception:
                # The cache only saves work: failing to fill it must not fail the request.
                logger.warning("could not keep a finished request's KV", exc_info=True)
        self.release(row)

    def _lose(self, rows: list[LlamaRequest], code: int, step: Scheduler[LlamaRow]) -> None:
        for row in rows:
            self._end(row)
        cause = DecodeFailed(
            f"llama_decode returned {code} for a batch of {len(rows)} request(s)"
            + (" (no KV cache room)" if code == 1 else "")
        )
        if len(rows) == 1:
            # One request in the pass: the failure is its own.
            step.fail(rows[0], cause)
            return
        step.lost(rows, cause)

    # ---- after the decode ------------------------------------------------------------------

    def _guarded(
        self, row: LlamaRequest, step: Scheduler[LlamaRow], work: Callable[[], bool]
    ) -> None:
        """Run ``work`` for ``row``; when it ends the row (its result, or its own
        exception), the row's sequence is freed or kept in the prefix cache."""
        try:
            ended = work()
        except Exception as exc:
            self._end(row)
            step.fail(row, exc)
            return
        if ended:
            self._end(row, keep=True)

    def _next(self, row: LlamaRequest, index: int, step: Scheduler[LlamaRow]) -> bool:
        return self._take(row, self.runtime.logits(index), step)

    def _read(
        self, row: LlamaRequest, start: int, end: int, first: int, step: Scheduler[LlamaRow]
    ) -> bool:
        """A prompt slice was read: its prompt logprobs; once the prompt is whole, the
        request's first token (it then decodes with the rows)."""
        step.prefilled(row, end - start)
        if row.state.prompt_top_logprobs is not None:
            self._score_prompt(row, start, end, first)
        if end < len(row.prompt_ids):
            return False
        if row.max_new_tokens == 0:
            step.finish(row, "length")
            return True
        return self._take(row, self.runtime.logits(first + end - 1 - start), step)

    def _score_prompt(self, row: LlamaRequest, start: int, end: int, first: int) -> None:
        top = row.state.prompt_top_logprobs or 0
        text_of = self.runtime.token_text
        if row.prompt_logprobs is None:
            first_id = row.prompt_ids[0]
            row.prompt_logprobs = [TokenLogprob(first_id, text_of(first_id), None)]
        # The output at prompt position p predicts the token at p + 1.
        for position in range(start, min(end, len(row.prompt_ids) - 1)):
            logits = self.runtime.logits(first + position - start)
            following = row.prompt_ids[position + 1]
            row.prompt_logprobs.append(token_logprob(logits, following, top, text_of))

    def _take(
        self, row: LlamaRequest, logits: npt.NDArray[np.float32], step: Scheduler[LlamaRow]
    ) -> bool:
        """Choose ``row``'s token from ``logits`` and hand it on; True when the row ended."""
        runtime = self.runtime
        state = row.state
        allowed = None
        if row.grammar is not None:
            allowed = self.encoder.grammars().allowed(row.grammar)
        forced = None if row.thinking is None else row.thinking.forced()
        if forced is not None:
            token_id = forced  # the end of thinking, forced (common.thinking)
        else:
            token_id = choose_token(
                logits, row.sampling, state.seen, row.generated, runtime.end_ids, state.rng, allowed
            )
        if state.top_logprobs is not None and row.logprobs is not None:
            row.logprobs.append(
                token_logprob(logits, token_id, state.top_logprobs, runtime.token_text)
            )
        state.seen.append(token_id)
        if step.take(row, token_id):
            return True
        state.pending = token_id
        return False
