"""The llama_cpp backend's decoding loop: every running request in one ``llama_decode`` a step.

:class:`LlamaEngine` serves both forms of the backend. The batched form
(``max_batch_size`` above 1) is driven by the worker loop through
``admit``/``step``/``retire``/``abort``; the one-call form, ``generate``, is the
same loop with one request in it, so both forms choose the same tokens.

A request moves through these lists: ``compiling`` (a constrained request while
its grammar compiles off the loop, see ``modelpool.grammar``), ``waiting``
(admitted, waiting for KV room or a free sequence id), ``prefilling`` (its prompt
being read) and ``rows`` (decoding). Each request is its own llama.cpp sequence (``seq_id``) in one
unified KV cache of ``kv_cells`` cells; its cells are removed
(``llama_memory_seq_rm``) the moment it ends, is retired or lost. Each
``step()``:

1. starts waiting requests whose prompt plus ``max_new_tokens`` fit beside the
   started ones (a request alone is always started: the context length bounds it);
2. builds one llama.cpp batch: the latest token of every decoding row (its own
   sequence id and position), then the next prompt slices of the prefilling
   requests, at most ``prefill_chunk_tokens`` prompt tokens in all (chunked
   prefill: a long prompt is read over several steps, so cancels, deadlines and
   the decoding rows' inter-token latency are kept);
3. runs one ``llama_decode`` over it, and gives each decoding row, and each
   request whose prompt is now read, its next token.

Faults stay in their row where they can be attributed: a failure choosing or
emitting one row's token is that request's. A ``llama_decode`` that fails over
several rows cannot be blamed on one: they leave together as
``protocol.RowsLost`` while waiting requests stay.

With a prefix cache (``prefix_cache_tokens`` above 0, see ``llama_cpp_prefix``), a
request that ends normally leaves its sequence to the cache instead of removing it, and
a request starting its prefill takes the longest cached prefix of its prompt into its
own sequence (``llama_memory_seq_cp``) and reads only the rest. Cached cells count
against ``kv_cells`` beside the started requests' reservations, and entries are evicted
the moment a request needs their cells or sequence id.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from modelpool.backends.hf_text import TextProgress, stop_strings
from modelpool.backends.llama_cpp_prefix import SequencePrefixCache
from modelpool.backends.llama_cpp_sampling import Sampling, choose_token, token_logprob
from modelpool.grammar import (
    GRAMMAR_PARAM,
    PendingGrammar,
    RowGrammar,
    settle_compiled,
    wait_for_any,
)
from modelpool.prefixes import answered_fingerprints
from modelpool.protocol import (
    BatchCall,
    Call,
    Finished,
    FinishReason,
    Generation,
    PrefixCacheReport,
    Prompt,
    RowsLost,
    TokenLogprob,
    note_prompt,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK_TOKENS = 512
_COMPILE_WAIT_S = 0.05  # with only grammars compiling, a step waits this long for one


class Runtime(Protocol):
    """What the engine needs of a loaded llama.cpp model and context (``llama_cpp.Runtime``)."""

    end_ids: npt.NDArray[np.int64]
    end_id_set: frozenset[int]
    n_vocab: int

    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[int], outputs: list[bool]
    ) -> int: ...

    def logits(self, index: int) -> npt.NDArray[np.float32]: ...

    def remove_sequence(self, seq_id: int) -> None: ...

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give sequence ``target`` the cells of ``source``'s positions [0, length)."""
        ...

    def trim_sequence(self, seq_id: int, length: int) -> None:
        """Remove sequence ``seq_id``'s cells from position ``length`` on."""
        ...

    def clear(self) -> None: ...

    def token_text(self, token_id: int) -> str: ...

    def decoder(self) -> Any: ...


class Grammars(Protocol):
    """What the engine needs of the grammar engine (``llama_cpp.LlamaGrammars``)."""

    def start(self, params: dict[str, Any]) -> PendingGrammar[Any]: ...

    def row(self, compiled: Any) -> RowGrammar: ...

    def allowed(self, grammar: RowGrammar) -> npt.NDArray[np.bool_]: ...


class Encoder(Protocol):
    """What the engine needs of the handler: prompts as token ids, the context fit."""

    def encode(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int: ...

    def grammars(self) -> Grammars: ...


class DecodeFailed(RuntimeError):
    """``llama_decode`` returned an error code."""


@dataclass(eq=False)
class _Row:
    call: BatchCall
    prompt_ids: list[int]
    progress: TextProgress
    sampling: Sampling
    max_new_tokens: int
    rng: np.random.Generator | None
    top_logprobs: int | None
    prompt_top_logprobs: int | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    seq_id: int = -1
    prefilled: int = 0
    pending: int = -1  # the latest token, decoded at the next step
    finish_reason: FinishReason | None = None
    seen: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose cells came from the prefix cache
    pending_grammar: PendingGrammar[Any] | None = None  # its grammar, while it compiles
    grammar: RowGrammar | None = None  # its grammar state, once compiled

    @property
    def generated(self) -> int:
        return len(self.progress.token_ids)

    @property
    def reserved(self) -> int:
        """KV cells this request may come to hold."""
        return len(self.prompt_ids) + self.max_new_tokens

    def result(self, finish_reason: FinishReason) -> Generation:
        return Generation(
            self.progress.text,
            finish_reason,
            len(self.prompt_ids),
            self.generated,
            self.logprobs,
            self.prompt_logprobs,
            cached_tokens=self.cached_tokens,
        )

    def held_ids(self) -> list[int]:
        """The token ids whose cells the row's sequence holds: its prompt and its answer
        but the last token, which was chosen and never decoded."""
        answer = self.progress.token_ids
        return self.prompt_ids + answer[: max(0, len(answer) - 1)]


class LlamaEngine:
    """One worker's requests in flight; every method runs on the worker loop's thread."""

    def __init__(
        self,
        runtime: Runtime,
        encoder: Encoder,
        *,
        kv_cells: int,
        max_sequences: int,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        prefix_cache_tokens: int = 0,
        cell_bytes: int = 0,
    ) -> None:
        self.runtime = runtime
        self.encoder = encoder
        self.kv_cells = kv_cells
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.compiling: list[_Row] = []  # their grammar compiles (off this thread)
        self.waiting: list[_Row] = []
        self.prefilling: list[_Row] = []
        self.rows: list[_Row] = []
        self._free_seq_ids = list(range(max_sequences - 1, -1, -1))
        self.prefix_cache = (
            SequencePrefixCache(prefix_cache_tokens, cell_bytes, self._free_sequence)
            if prefix_cache_tokens > 0
            else None
        )

    # ---- the BatchedHandler surface ------------------------------------------------------

    def admit(self, call: BatchCall) -> None:
        row = self._row(call)
        if call.params.get(GRAMMAR_PARAM) is None:
            self.waiting.append(row)
            return
        # Compiled on a thread of its own: the running rows go on decoding meanwhile.
        row.pending_grammar = self.encoder.grammars().start(call.params)
        self.compiling.append(row)

    def retire(self, call: BatchCall) -> Generation:
        for queue in (self.compiling, self.waiting, self.prefilling, self.rows):
            for row in queue:
                if row.call is call:
                    queue.remove(row)
                    self._release(row)
                    return row.result("cancelled")
        return Generation("", "cancelled", None, 0)

    def abort(self) -> None:
        for row in self.prefilling + self.rows:
            self._release(row)
        self.compiling.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self.rows.clear()
        self.runtime.clear()
        if self.prefix_cache is not None:
            self._free_seq_ids.extend(self.prefix_cache.drop_all())

    def room(self) -> tuple[int, list[BatchCall]]:
        """Free KV cells beside the started requests, and the requests waiting for room.
        Cached cells count as free: a starting request evicts them at once."""
        used = sum(row.reserved for row in self.prefilling + self.rows)
        return max(0, self.kv_cells - used), [row.call for row in self.waiting]

    def prefix_cache_report(self) -> PrefixCacheReport | None:
        return None if self.prefix_cache is None else self.prefix_cache.report()

    def step(self) -> list[Finished]:
        finished: list[Finished] = []
        if self.compiling:
            self._settle_grammars(finished)
        self._start_prefills()
        decoding = list(self.rows)
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        outputs: list[bool] = []
        for row in decoding:
            tokens.append(row.pending)
            positions.append(len(row.prompt_ids) + row.generated - 1)
            seq_ids.append(row.seq_id)
            outputs.append(True)
        slices: list[tuple[_Row, int, int, int]] = []  # row, start, end, its first batch index
        budget = self.prefill_chunk_tokens
        for row in self.prefilling:
            if budget <= 0:
                break
            start = row.prefilled
            end = min(len(row.prompt_ids), start + budget)
            budget -= end - start
            slices.append((row, start, end, len(tokens)))
            last = len(row.prompt_ids) - 1
            every = row.prompt_top_logprobs is not None
            for position in range(start, end):
                tokens.append(row.prompt_ids[position])
                positions.append(position)
                seq_ids.append(row.seq_id)
                outputs.append(every or (position == last and row.max_new_tokens > 0))
        if not tokens:
            if self.compiling and not finished:
                # Only compilations to wait for: wait on them (briefly, so that cancels
                # are still read) rather than spin.
                pending = [row.pending_grammar for row in self.compiling if row.pending_grammar]
                wait_for_any(pending, _COMPILE_WAIT_S)
            return finished
        code = self.runtime.decode(tokens, positions, seq_ids, outputs)
        if code != 0:
            self._lose([*decoding, *(row for row, *_ in slices)], code, finished)
            return finished
        for index, row in enumerate(decoding):
            self._guarded(row, finished, functools.partial(self._next, row, index))
        for row, start, end, first in slices:
            self._guarded(row, finished, functools.partial(self._read, row, start, end, first))
        return finished

    # ---- admission -------------------------------------------------------------------------

    def _row(self, call: BatchCall) -> _Row:
        import numpy as np

        params = call.params
        prompt_ids = self.encoder.encode(call.prompt, params.get("tools"))
        stops = stop_strings(params["stop"]) if "stop" in params else ()
        sampling = Sampling.from_params(params, self.runtime.n_vocab)
        rng = None
        if sampling.do_sample:
            rng = np.random.default_rng(params.get("seed"))
        top_logprobs: int | None = params.get("logprobs")
        return _Row(
            call=call,
            prompt_ids=prompt_ids,
            progress=TextProgress(self.runtime.decoder(), call, len(prompt_ids), stops),
            sampling=sampling,
            # Raises ContextLengthExceeded (that request's answer alone) when it cannot fit.
            max_new_tokens=self.encoder.fit_new_tokens(call, dict(params), len(prompt_ids)),
            rng=rng,
            top_logprobs=top_logprobs,
            prompt_top_logprobs=params.get("prompt_logprobs"),
            logprobs=None if top_logprobs is None else [],
            seen=list(prompt_ids),
        )

    def _settle_grammars(self, finished: list[Finished]) -> None:
        """Rows whose grammar compiled wait for KV room; those whose compilation failed or
        outlasted its bound end with that error (theirs alone)."""
        ready, failed = settle_compiled(self.compiling, self.encoder.grammars().row)
        self.waiting.extend(ready)
        finished.extend((row.call, error) for row, error in failed)

    def _start_prefills(self) -> None:
        started = sum(row.reserved for row in self.prefilling + self.rows)
        cache = self.prefix_cache
        for row in list(self.waiting):
            alone = not self.prefilling and not self.rows
            if not alone and started + row.reserved > self.kv_cells:
                break
            if cache is not None:
                # Cached cells give way to the request: they never hold its room.
                while started + row.reserved + cache.cells > self.kv_cells and cache.evict():
                    pass
                if not self._free_seq_ids and not len(cache):
                    break
            elif not self._free_seq_ids:
                break
            self.waiting.remove(row)
            self.prefilling.append(row)
            started += row.reserved
            self._take_sequence(row)

    def _take_sequence(self, row: _Row) -> None:
        """Give ``row`` a sequence id, starting it with the cells of the longest cached
        prefix of its prompt when there is one (not for prompt logprobs: every prompt
        position's logits are read)."""
        cache = self.prefix_cache
        found = None
        if cache is not None and row.prompt_top_logprobs is None:
            found = cache.lookup(row.prompt_ids)
        if cache is not None and found is not None:
            entry, length = found
            if self._free_seq_ids:
                row.seq_id = self._free_seq_ids.pop()
                self.runtime.copy_prefix(entry.seq_id, row.seq_id, length)
            else:
                # No sequence id to copy into: the request takes the entry's own.
                row.seq_id = cache.take(entry)
                self.runtime.trim_sequence(row.seq_id, length)
            row.prefilled = row.cached_tokens = length
        else:
            if not self._free_seq_ids and cache is not None:
                cache.evict()
            row.seq_id = self._free_seq_ids.pop()
        note_prompt(row.call, len(row.prompt_ids), row.cached_tokens)

    # ---- after the decode ------------------------------------------------------------------

    def _guarded(self, row: _Row, finished: list[Finished], work: Callable[[], bool]) -> None:
        """Run ``work`` for ``row``; it ends the row (its result, or its own exception)."""
        try:
            ended = work()
        except Exception as exc:
            self._end(row)
            finished.append((row.call, exc))
            return
        if ended:
            self._end(row, keep=True)
            finished.append((row.call, row.result(row.finish_reason or "stop")))

    def _next(self, row: _Row, index: int) -> bool:
        return self._take(row, self.runtime.logits(index))

    def _read(self, row: _Row, start: int, end: int, first: int) -> bool:
        """A prompt slice was read: its prompt logprobs; once the prompt is whole, the
        request's first token (it then decodes with the rows)."""
        row.prefilled = end
        row.call.prefilled(end - start)
        if row.prompt_top_logprobs is not None:
            self._score_prompt(row, start, end, first)
        if end < len(row.prompt_ids):
            return False
        self.prefilling.remove(row)
        self.rows.append(row)
        if row.max_new_tokens == 0:
            row.finish_reason = "length"
            return True
        return self._take(row, self.runtime.logits(first + end - 1 - start))

    def _score_prompt(self, row: _Row, start: int, end: int, first: int) -> None:
        top = row.prompt_top_logprobs or 0
        text_of = self.runtime.token_text
        if row.prompt_logprobs is None:
            first_id = row.prompt_ids[0]
            row.prompt_logprobs = [TokenLogprob(first_id, text_of(first_id), None)]
        # The output at prompt position p predicts the token at p + 1.
        for position in range(start, min(end, len(row.prompt_ids) - 1)):
            logits = self.runtime.logits(first + position - start)
            following = row.prompt_ids[position + 1]
            row.prompt_logprobs.append(token_logprob(logits, following, top, text_of))

    def _take(self, row: _Row, logits: npt.NDArray[np.float32]) -> bool:
        """Choose ``row``'s token from ``logits`` and hand it on; True when the row ended."""
        runtime = self.runtime
        allowed = None
        if row.grammar is not None:
            allowed = self.encoder.grammars().allowed(row.grammar)
        token_id = choose_token(
            logits, row.sampling, row.seen, row.generated, runtime.end_ids, row.rng, allowed
        )
        if row.top_logprobs is not None and row.logprobs is not None:
            row.logprobs.append(
                token_logprob(logits, token_id, row.top_logprobs, runtime.token_text)
            )
        row.seen.append(token_id)
        progress = row.progress
        progress.take([token_id])
        row.call.delivered()
        progress.on_token()
        if progress.error is not None:
            raise progress.error
        grammar_complete = row.grammar is not None and row.grammar.take(token_id)
        ended = token_id in runtime.end_id_set and not row.sampling.ignore_eos
        if progress.stopped or ended or grammar_complete:
            row.finish_reason = "stop"
        elif row.generated >= row.max_new_tokens:
            row.finish_reason = "length"
        else:
            row.pending = token_id
            return False
        progress.flush()
        if progress.error is not None:
            raise progress.error
        return True

    def _end(self, row: _Row, *, keep: bool = False) -> None:
        """Take ``row`` out of the loop; ``keep``: it ended normally, and its cells may
        stay in the prefix cache."""
        for queue in (self.prefilling, self.rows):
            if row in queue:
                queue.remove(row)
        if keep and self.prefix_cache is not None and row.seq_id >= 0:
            try:
                answer = row.progress.token_ids
                fingerprints = answered_fingerprints(row.call.prompt, row.progress.text, answer)
                if self.prefix_cache.insert(row.seq_id, row.held_ids(), fingerprints):
                    row.seq_id = -1
            except Exception:
                # The cache only saves work: failing to fill it must not fail the request.
                logger.warning("could not keep a finished request's KV", exc_info=True)
        self._release(row)

    def _release(self, row: _Row) -> None:
        """Free the row's KV cells and its sequence id."""
        if row.seq_id < 0:
            return
        seq_id, row.seq_id = row.seq_id, -1
        self._free_sequence(seq_id)

    def _free_sequence(self, seq_id: int) -> None:
        self.runtime.remove_sequence(seq_id)
        self._free_seq_ids.append(seq_id)

    def _lose(self, rows: list[_Row], code: int, finished: list[Finished]) -> None:
        for row in rows:
            self._end(row)
        cause = DecodeFailed(
            f"llama_decode returned {code} for a batch of {len(rows)} request(s)"
            + (" (no KV cache room)" if code == 1 else "")
        )
        if len(rows) == 1:
            # One request in the pass: the failure is its own.
            finished.append((rows[0].call, cause))
            return
        raise RowsLost([row.call for row in rows], cause, finished)


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


def run_alone(engine: LlamaEngine, call: Call) -> Generation:
    """The one-call form: ``call`` through ``engine`` with nothing else in it, stopped at
    the first step after its cancel flag is set."""
    solo = SoloCall(call)
    engine.admit(solo)
    try:
        while True:
            for _, outcome in engine.step():
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome
            if call.cancelled():
                return engine.retire(solo)
    except BaseException:
        engine.abort()
        raise
