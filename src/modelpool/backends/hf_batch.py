"""The hf backend's batched form: its own decoding loop over one shared KV cache.

:class:`BatchEngine` is what ``HFHandler.admit/step/retire/abort`` drive when
the pool runs the hf backend with ``max_batch_size`` above 1 (see
``protocol.BatchedHandler``). A request moves through three lists:
``waiting`` (admitted by the worker, waiting for KV room), ``prefilling`` (its
prompt being read, slice by slice, into a cache of its own) and ``rows`` (the
running batch, one shared left-padded cache). Each ``step()``:

1. starts the prefill of waiting requests that fit the KV budget, in order;
2. prefills the next slice of each prefilling request, at most
   ``prefill_chunk_tokens`` prompt tokens in all (chunked prefill, as vLLM and
   SGLang do): a long prompt is read over several steps, so the running rows
   keep their inter-token latency, and cancels, deadlines and disconnects are
   honoured between slices. Each slice counts as progress for the pool's stall
   clock. A request whose prompt is read gets its first token and is merged
   into the running batch: the narrower of the two caches is left-padded with
   masked columns, rows are concatenated;
3. runs one decoding step for every running request (one forward pass); the
   first long prompt's slice rides on that same pass (``hf_fused``: the rows'
   tokens and the slice's go through the weights together as one packed
   sequence, attention is split), so a slice costs its tokens, not a pass's
   fixed cost;
4. retires every request that ended (EOS, stop string, ``max_new_tokens``),
   dropping its cache rows and any leading columns that are now padding in
   every row.

A request with a grammar (structured outputs, :mod:`modelpool.grammar`) first waits in
``compiling`` while its grammar compiles on a thread of its own; the batch goes on
decoding meanwhile, and one whose compilation fails or outlasts its bound ends alone.
Once running, its row's mask is computed on a helper thread while the forward pass runs
and applied to its logits before its own penalties and sampling; it ends as soon as its
grammar is complete.

Faults stay in their row where they can be attributed: a prefill runs one
request at a time, so its failure (an out-of-memory on a long prompt, say) is
that request's (a failed fused pass is undone, and its slice and the decoding
step run apart, so this holds there too); so is a failure choosing or emitting
one row's token. A
failure of the shared decoding pass cannot be blamed on one row: those rows
leave the batch together as ``protocol.RowsLost`` (the pool retries them and
tracks suspects) while waiting and prefilling requests stay.

``prefill_chunk_tokens`` (a load option): a number of prompt tokens per step,
or "auto" (the default), which sizes each step's slices by timing them: what a
slice adds to a step is about 1.3 decoding steps (the median of the recent ones)
while rows are decoding, so a step lasts about 2.3 normal ones while a long prompt
is read (under 3, the bound kept); about a second when none is (cancels are still read every
second). A long prompt's time to first token grows while it shares the worker
with decoding rows: that is the price of their inter-token latency. A model the
fused pass does not fit (attention not dispatched through transformers'
interface, a sliding window) reads each slice in a pass of its own, which on a
CPU costs about one more decoding step per slice.

Why our own loop rather than transformers' ``ContinuousBatchingManager``
(``generate_batch``): on CPU its paged path measured 33 tok/s against 94 tok/s
for a left-padded batch through ``generate()`` (SmolLM2-135M, 8 x 32 tokens,
2 cores; issue 12), it sizes its cache from free memory unless told
otherwise, it applies ``do_sample`` and the seed to the whole batch, and one
failing request ends its whole thread. Here every sampling parameter is per
request (``seed``, ``temperature``, ``top_p``, ``top_k``, ``do_sample``,
``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``,
``stop``, ``max_new_tokens``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``ignore_eos``), each request samples from its own
``torch.Generator``, and the cache is bounded by ``kv_cache_tokens``.
The model's ``generation_config`` supplies the defaults ``generate()`` would
take from it (``repetition_penalty``, ``no_repeat_ngram_size``,
``min_new_tokens``/``min_length``, the sampling ones); a model whose
generation_config asks for a processor this loop does not implement
(:func:`unbatchable_generation_config`) runs one request at a time instead.
The GPU comparison with the manager is still to be measured.

The rule held to: greedy decoding of a prompt in a batch gives the same tokens
as the same prompt alone through ``HFHandler.generate`` in float32, on the
models tested (tests/integration/test_hf_batching.py); padding columns are
masked out of attention, so only floating-point summation order differs (a
sliced prefill too). In bfloat16 or float16 that order can flip a near tie, as
in any batched server.

The prefix cache (``prefix_cache``, the handler's) touches the loop at two points:
when a request's prefill starts, the longest cached prefix of its prompt becomes the
start of its prefill cache (it prefills only the rest); when a row finishes, its
columns (prompt and answer) are copied out of the batch's cache into the prefix cache.

KV-cache memory: ``kv_cache_tokens`` bounds rows x columns of the padded cache
(prompt plus every token the running requests may still generate, prefilling
ones included); a request that would push the batch past it waits in the
worker until rows leave, and ``room()`` tells the pool, which places new
requests elsewhere meanwhile. A request alone is always admitted, whatever its
size: the bound limits batching, never what one request may ask.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from modelpool.backends.hf_fused import FusionUnsupported, fusable, fused_forward
from modelpool.backends.hf_penalties import Penalties
from modelpool.backends.hf_text import TextProgress, stop_strings
from modelpool.errors import InvalidRequest
from modelpool.grammar import (
    GRAMMAR_PARAM,
    LLGuidanceGrammars,
    PendingGrammar,
    RowGrammar,
    settle_compiled,
    wait_for_any,
)
from modelpool.protocol import (
    BatchCall,
    Call,
    Finished,
    FinishReason,
    Generation,
    Prompt,
    RowsLost,
    note_prompt,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from modelpool.backends.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_TOKENS = 16384
"""Rows x columns of one worker's padded KV cache when ``kv_cache_tokens`` is not given:
about 750 MB for SmolLM2-135M in float32 (30 layers x 2 x 3 heads x 64 x 4 bytes a token)."""

PrefillChunk = int | Literal["auto"]
_AUTO_MIN_SLICE = 16
_AUTO_MAX_SLICE = 4096
_AUTO_SLICE_OVER_STEP = 1.3  # what a slice adds to a step beside rows, in decoding steps
_AUTO_SOLO_SLICE_S = 1.0  # a slice's target time when no row is decoding
_AUTO_FIRST_SOLO_SLICE = 128  # tokens, before a slice alone is timed
_AUTO_WHOLE_PROMPT = 128  # a prompt (or a rest of one) this short is read in one pass
_STEPS_TIMED = 16  # plain decoding steps whose median sets the slice's target beside rows
_AUTO_SLICE_GROWTH = 1.25  # beside rows, a slice grows at most this much a step (rows pay)

_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
UNBATCHED_PARAMS = ("logprobs", "prompt_logprobs")
"""Parameters the batched loop does not compute; a request with them is refused."""

# generation_config fields that make generate() add a processor or a search this loop does
# not implement, with the value that means "off".
_UNBATCHABLE_GENERATION_CONFIG: dict[str, Any] = {
    "num_beams": 1,
    "penalty_alpha": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "encoder_repetition_penalty": 1.0,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "renormalize_logits": False,
    "watermarking_config": None,
}


def unbatchable_generation_config(config: Any) -> list[str]:
    """The fields of a model's generation_config that the batched loop cannot apply as
    ``generate()`` would (the model then runs one request at a time)."""
    return [
        name
        for name, off in _UNBATCHABLE_GENERATION_CONFIG.items()
        if getattr(config, name, off) not in (off, None)
    ]


class LoadedModel(Protocol):
    """What the engine needs of the hf handler (``hf.HFHandler``)."""

    model: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    vocab_size: int
    grammars: LLGuidanceGrammars

    prefix_cache: PrefixCache | None

    def encode(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> torch.Tensor: ...

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int: ...

    def remember(
        self,
        prompt: Prompt,
        token_ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        answer_text: str,
        answer_ids: list[int],
    ) -> None: ...


@dataclass(eq=False)
class _Row:
    """One request in the engine."""

    call: BatchCall
    prompt_ids: list[int]
    progress: TextProgress
    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    no_repeat_ngram_size: int
    penalties: Penalties
    generator: torch.Generator | None
    ignore_eos: bool = False
    finish_reason: FinishReason | None = None
    cache: Any = None  # its own cache while prefilling
    prefilled: int = 0  # prompt tokens read into ``cache``
    pending_grammar: PendingGrammar[Any] | None = None  # its grammar, while it compiles
    grammar: RowGrammar | None = None  # its grammar state, once compiled
    cached_tokens: int = 0  # of those, taken from the prefix cache

    @property
    def generated(self) -> int:
        return len(self.progress.token_ids)

    @property
    def remaining(self) -> int:
        return max(0, self.max_new_tokens - self.generated)

    def result(self, finish_reason: FinishReason) -> Generation:
        return Generation(
            self.progress.text,
            finish_reason,
            len(self.prompt_ids),
            self.generated,
            cached_tokens=self.cached_tokens,
        )


class BatchEngine:
    """One worker's running batch; every method runs on the worker loop's thread."""

    def __init__(
        self,
        handler: LoadedModel,
        kv_cache_tokens: int,
        prefill_chunk_tokens: PrefillChunk = "auto",
    ) -> None:
        import inspect

        self.handler = handler
        self.kv_cache_tokens = kv_cache_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # transformers 5.24 renamed the forward's past_key_values to cache.
        parameters = inspect.signature(handler.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        # Only the last position's logits are read: skip the vocabulary projection of every
        # other prompt token (generate() does the same).
        self._last_logits: dict[str, int] = (
            {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        )
        self.compiling: list[_Row] = []  # their grammar compiles (off this thread)
        self.waiting: list[_Row] = []
        self.prefilling: list[_Row] = []
        self._mask_thread: ThreadPoolExecutor | None = None
        self.rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [rows, columns], 1 where a real token is
        self._last: torch.Tensor | None = None  # [rows], each row's latest token
        # The "auto" slice sizes beside decoding rows and alone, each steered by timing its
        # full slices against its target; beside rows it starts small, so the first slice
        # costs the running rows little. The decoding step's time (the median of the last
        # plain steps: an average was raised by a few slow first steps, and the slices
        # grew where they should have shrunk) sets the target beside rows.
        self._auto_slice = {True: _AUTO_MIN_SLICE, False: _AUTO_FIRST_SOLO_SLICE}
        self._decode_steps_s: deque[float] = deque(maxlen=_STEPS_TIMED)
        # A slice beside decoding rows rides on their step's forward pass (hf_fused) when
        # the model allows it; else it is a pass of its own.
        self._fuse = fusable(handler.model)

    # ---- the BatchedHandler surface ------------------------------------------------------

    def admit(self, call: BatchCall) -> None:
        row = self._row(call)
        if call.params.get(GRAMMAR_PARAM) is None:
            self.waiting.append(row)
            return
        # Compiled on a thread of its own: the running rows go on decoding meanwhile.
        row.pending_grammar = self.handler.grammars.start(call.params)
        self.compiling.append(row)

    def retire(self, call: BatchCall) -> Generation:
        for queue in (self.compiling, self.waiting, self.prefilling):
            for row in queue:
                if row.call is call:
                    queue.remove(row)
                    return row.result("cancelled")
        for index, row in enumerate(self.rows):
            if row.call is call:
                self._drop([index])
                return row.result("cancelled")
        return Generation("", "cancelled", None, 0)

    def abort(self) -> None:
        self.compiling.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self._reset_batch()

    def step(self) -> list[Finished]:
        import torch

        finished: list[Finished] = []
        with torch.inference_mode():
            if self.compiling:
                self._settle_grammars(finished)
            self._start_prefills()
            beside = self._prefill_slices(finished) if self.prefilling else None
            if self.rows:
                self._decode(finished, beside)
            elif beside is not None:
                self._prefill_alone(*beside, finished)
        if self.compiling and not finished and not (self.waiting or self.prefilling or self.rows):
            # Only compilations to wait for: wait on them (briefly, so that cancels are
            # still read) rather than spin.
            wait_for_any(
                [row.pending_grammar for row in self.compiling if row.pending_grammar],
                _COMPILE_WAIT_S,
            )
        return finished

    def room(self) -> tuple[int, list[BatchCall]]:
        """Free KV room in tokens beside the requests already started, and the requests
        waiting for room."""
        started = self.rows + self.prefilling
        used = self._projected(started) if started else 0
        return max(0, self.kv_cache_tokens - used), [row.call for row in self.waiting]

    @property
    def cache_tokens(self) -> int:
        """Rows x columns of the padded cache now (prefilling caches not included)."""
        return 0 if self._mask is None else int(self._mask.numel())

    # ---- admission -------------------------------------------------------------------------

    def _row(self, call: BatchCall) -> _Row:
        import torch

        handler = self.handler
        params = call.params
        for name in UNBATCHED_PARAMS:
            if params.get(name) is not None:
                # Never dropped, never applied to the batch: refused, naming the field.
                raise InvalidRequest(
                    f"{name} is not supported by the batched hf backend "
                    "(max_batch_size > 1); send it to a pool with max_batch_size = 1"
                )
        input_ids = handler.encode(call.prompt, params.get("tools"))
        prompt_ids = [int(token) for token in input_ids[0].tolist()]
        stops = stop_strings(params["stop"]) if "stop" in params else ()
        config = handler.model.generation_config
        do_sample = params.get("do_sample", params.get("temperature", 0) > 0)

        def sampling(key: str) -> Any:
            if key in params:
                return params[key]
            value = getattr(config, key, None)
            return _SAMPLING_DEFAULTS[key] if value is None else value

        def from_config(key: str, off: Any) -> Any:
            # What generate() takes from the model's generation_config when the request
            # does not say.
            if key in params:
                return params[key]
            value = getattr(config, key, None)
            return off if value is None else value

        # generate() counts min_length over prompt and completion together.
        min_new_tokens = max(
            int(from_config("min_new_tokens", 0)),
            int(getattr(config, "min_length", 0) or 0) - len(prompt_ids),
        )
        generator = None
        if do_sample:
            generator = torch.Generator(device=handler.model.device)
            if "seed" in params:
                generator.manual_seed(params["seed"])
            else:
                generator.seed()
        return _Row(
            call=call,
            prompt_ids=prompt_ids,
            progress=TextProgress(handler.tokenizer, call, len(prompt_ids), stops),
            # Fitted to the context as the one-call path does; raises ContextLengthExceeded
            # (the worker answers that request alone) when the prompt cannot fit.
            max_new_tokens=handler.fit_new_tokens(call, dict(params), len(prompt_ids)),
            min_new_tokens=min_new_tokens,
            do_sample=do_sample,
            temperature=float(sampling("temperature")),
            top_k=int(sampling("top_k") or 0),
            top_p=float(sampling("top_p")),
            repetition_penalty=float(from_config("repetition_penalty", 1.0)),
            no_repeat_ngram_size=int(from_config("no_repeat_ngram_size", 0)),
            penalties=Penalties.from_params(params, handler.vocab_size),
            generator=generator,
            ignore_eos=params.get("ignore_eos") is True,
        )

    @staticmethod
    def _projected(rows: list[_Row]) -> int:
        """Rows x columns the padded cache may reach with ``rows`` in it."""
        width = max(len(row.prompt_ids) + row.generated for row in rows)
        longest_rest = max(row.remaining for row in rows)
        return len(rows) * (width + longest_rest)

    def _settle_grammars(self, finished: list[Finished]) -> None:
        """Rows whose grammar compiled wait for KV room; those whose compilation failed or
        outlasted its bound end with that error (theirs alone)."""
        ready, failed = settle_compiled(self.compiling, self.handler.grammars.row)
        self.waiting.extend(ready)
        finished.extend((row.call, error) for row, error in failed)

    def _start_prefills(self) -> None:
        """Waiting requests that fit the KV budget beside the started ones, in order."""
        started = self.rows + self.prefilling
        for row in list(self.waiting):
            if started and self._projected([*started, row]) > self.kv_cache_tokens:
                break
            self.waiting.remove(row)
            self.prefilling.append(row)
            started.append(row)
            self._reuse_prefix(row)

    def _reuse_prefix(self, row: _Row) -> None:
        """Start the row's prefill cache from the longest cached prefix of its prompt."""
        cache = self.handler.prefix_cache
        found = None if cache is None else cache.lookup(row.prompt_ids)
        if found is not None:
            row.cache, row.prefilled = found
            row.cached_tokens = row.prefilled
        note_prompt(row.call, len(row.prompt_ids), row.cached_tokens)

    def _remember(self, index: int, row: _Row) -> None:
        """Keep a finished row's KV (its prompt and answer) in the prefix cache."""
        assert self._mask is not None
        if self.handler.prefix_cache is None:
            return
        try:
            held = int(self._mask[index].sum())
            start = int(self._mask.shape[1]) - held  # left-padded: its columns are the last
            row_columns = (slice(index, index + 1), slice(None), slice(start, None))
            layers = [
                (layer.keys[row_columns], layer.values[row_columns])
                for layer in self._cache.layers
            ]
            answer = row.progress.token_ids
            ids = (row.prompt_ids + answer)[:held]
            self.handler.remember(row.call.prompt, ids, layers, row.progress.text, answer)
        except Exception:
            # The cache only saves work: failing to fill it must not fail the batch.
            logger.warning("could not keep a finished request's KV", exc_info=True)

    # ---- the forward passes ----------------------------------------------------------------

    def _slice_budget(self) -> int:
        if self.prefill_chunk_tokens != "auto":
            return self.prefill_chunk_tokens
        return self._auto_slice[bool(self.rows)]

    @property
    def _decode_step_s(self) -> float | None:
        return statistics.median(self._decode_steps_s) if self._decode_steps_s else None

    def _steer_slice(self, tokens: int, seconds: float) -> None:
        """Resize the "auto" slice from a full slice's time (what it added to the step,
        when it rode on one) against its target: 1.3 decoding steps while rows decode
        (a step then lasts about 2.3 normal ones: more came within noise of the 3 the
        running rows' inter-token latency is held under, less lengthens the long
        prompt's hold on its slot), a second when none does.
        Steered by time, not by a per-token cost: a pass has a fixed cost (reading the
        weights) that small slices would overweight, shrinking the slice further and
        further."""
        beside_rows = bool(self.rows)
        if self.prefill_chunk_tokens != "auto" or tokens < self._auto_slice[beside_rows]:
            return
        step_s = self._decode_step_s
        target_s = _AUTO_SLICE_OVER_STEP * step_s if beside_rows and step_s else _AUTO_SOLO_SLICE_S
        growth = _AUTO_SLICE_GROWTH if beside_rows else 2.0
        scale = min(growth, max(0.5, target_s / max(seconds, 1e-6)))
        resized = int(min(_AUTO_MAX_SLICE, max(_AUTO_MIN_SLICE, tokens * scale)))
        self._auto_slice[beside_rows] = resized

    def _prefill_slices(self, finished: list[Finished]) -> tuple[_Row, int] | None:
        """The next slice of each prefilling request, in order, within this step's budget.
        Fresh short prompts (read whole in "auto" mode: a pass has a fixed cost, reading
        the weights, that slicing them would multiply) are read together in one
        left-padded pass; if that pass fails, each is read again alone, so that a fault
        is still one request's. Longer prompts are read one per pass, except the first,
        which is returned (row, tokens) to ride on the decoding step's pass when rows
        decode and the model allows it."""
        budget = self._slice_budget()
        # Fresh short prompts share one pass up to this many tokens; with no row decoding
        # there is no one's latency to protect, and all of them do.
        group_budget = max(budget, _AUTO_WHOLE_PROMPT) if self.rows else None
        # The short rest of a long prompt is read whole too (one pass's fixed cost saved),
        # unless it rides on the decoding step's pass: there it costs only its tokens, and
        # the budget keeps the step short (read whole, the last 115 tokens of a
        # 1,000-token prompt made a step 8 times a normal one).
        fused = bool(self.rows) and self._fuse
        together: list[_Row] = []
        alone: list[tuple[_Row, int]] = []
        for row in self.prefilling:
            rest = len(row.prompt_ids) - row.prefilled
            whole = (
                self.prefill_chunk_tokens == "auto"
                and rest <= _AUTO_WHOLE_PROMPT
                and (row.prefilled == 0 or not fused)
            )
            if whole and row.prefilled == 0 and (group_budget is None or group_budget > 0):
                together.append(row)
                budget -= rest
                if group_budget is not None:
                    group_budget -= rest
                continue
            if budget <= 0:
                break
            count = rest if whole else min(budget, rest)
            budget -= count
            alone.append((row, count))
        if len(together) > 1 and self._prefill_together(together, finished):
            together = []
        beside = alone.pop(0) if alone and fused else None
        for row, count in [(row, len(row.prompt_ids)) for row in together] + alone:
            self._prefill_alone(row, count, finished)
        return beside

    def _prefill_together(self, rows: list[_Row], finished: list[Finished]) -> bool:
        """Read the whole prompts of ``rows`` in one left-padded pass and give each its first
        token; False, with nothing changed, when the pass itself failed."""
        import torch
        from transformers import DynamicCache

        device = self.handler.model.device
        width = max(len(row.prompt_ids) for row in rows)
        pad = int(self.handler.tokenizer.pad_token_id or 0)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            length = len(row.prompt_ids)
            input_ids[index, width - length :] = torch.tensor(row.prompt_ids)
            mask[index, width - length :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        cache = DynamicCache()
        try:
            output = self.handler.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                **{self._cache_keyword: cache},
                **self._last_logits,
            )
        except Exception:
            return False
        for row in rows:
            self.prefilling.remove(row)
            row.call.prefilled(len(row.prompt_ids))
        tokens, failures = self._choose(rows, output.logits[:, -1, :])
        keep = []
        for index, row in enumerate(rows):
            try:
                if index in failures:
                    raise failures[index]
                if self._take(row, tokens[index]):
                    finished.append((row.call, row.result(row.finish_reason or "stop")))
                    continue
            except Exception as exc:
                finished.append((row.call, exc))
                continue
            keep.append(index)
        if keep:
            kept = torch.tensor(keep, device=device)
            cache.batch_select_indices(kept)
            self._merge([rows[index] for index in keep], cache, mask[kept], tokens[kept])
        return True

    def _prefill_alone(self, row: _Row, count: int, finished: list[Finished]) -> None:
        """The next ``count`` prompt tokens of ``row`` in a pass of its own; once its prompt
        is read, its first token, and it joins the batch."""
        try:
            logits = self._prefill_slice(row, count)
        except Exception as exc:
            self.prefilling.remove(row)
            finished.append((row.call, exc))
            return
        if logits is not None:
            self._prefilled(row, logits, finished)

    def _prefilled(self, row: _Row, logits: torch.Tensor, finished: list[Finished]) -> None:
        """``row``'s prompt is read (``logits``: its last position's): its first token, and
        it joins the batch."""
        import torch

        self.prefilling.remove(row)
        try:
            tokens, failures = self._choose([row], logits)
            if failures:
                raise failures[0]
            if self._take(row, tokens[0]):
                finished.append((row.call, row.result(row.finish_reason or "stop")))
                return
        except Exception as exc:
            finished.append((row.call, exc))
            return
        cache, row.cache = row.cache, None
        mask = torch.ones((1, len(row.prompt_ids)), dtype=torch.long, device=tokens.device)
        self._merge([row], cache, mask, tokens[:1])

    def _prefill_slice(self, row: _Row, count: int) -> torch.Tensor | None:
        """Read ``count`` more prompt tokens into the row's cache; the logits of its last
        position once the whole prompt is read, else None."""
        import torch
        from transformers import DynamicCache

        device = self.handler.model.device
        if row.cache is None:
            row.cache = DynamicCache()
        start, end = row.prefilled, row.prefilled + count
        started = time.perf_counter()
        output = self.handler.model(
            input_ids=torch.tensor([row.prompt_ids[start:end]], device=device),
            attention_mask=torch.ones((1, end), dtype=torch.long, device=device),
            position_ids=torch.arange(start, end, device=device)[None, :],
            use_cache=True,
            **{self._cache_keyword: row.cache},
            **self._last_logits,
        )
        self._steer_slice(count, time.perf_counter() - started)
        row.prefilled = end
        row.call.prefilled(count)
        if end < len(row.prompt_ids):
            return None
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor, last: torch.Tensor) -> None:
        """Requests whose prompts are read join the running batch with their cache rows."""
        import torch

        if self._cache is None or self._mask is None or self._last is None:
            self.rows, self._cache, self._mask, self._last = rows, cache, mask, last
            self._trim()
            return
        old_width, new_width = int(self._mask.shape[1]), int(mask.shape[1])
        width = max(old_width, new_width)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
            old_keys = _pad_left(old_layer.keys, width - old_width)
            old_values = _pad_left(old_layer.values, width - old_width)
            old_layer.keys = torch.cat([old_keys, _pad_left(new_layer.keys, width - new_width)])
            old_layer.values = torch.cat(
                [old_values, _pad_left(new_layer.values, width - new_width)]
            )
        self._mask = torch.cat(
            [
                torch.nn.functional.pad(self._mask, (width - old_width, 0)),
                torch.nn.functional.pad(mask, (width - new_width, 0)),
            ]
        )
        self._last = torch.cat([self._last, last])
        self.rows = [*self.rows, *rows]

    def _decode(self, finished: list[Finished], beside: tuple[_Row, int] | None) -> None:
        """One decoding step for every running row, with the slice ``beside`` in the same
        pass when one is given. If that fused pass fails, the slice is read in a pass of
        its own and the step runs alone, so that a fault is still one request's or the
        batch's."""
        if beside is not None:
            if self._fuse and self._decode_with_slice(*beside, finished):
                return
            self._prefill_alone(*beside, finished)
        if self.rows:
            self._decode_step(finished)

    def _decode_with_slice(self, row: _Row, count: int, finished: list[Finished]) -> bool:
        """The fused pass (hf_fused): False, with nothing changed, when it failed."""
        import torch
        from transformers import DynamicCache

        assert self._mask is not None and self._last is not None
        mask = torch.nn.functional.pad(self._mask, (0, 1), value=1)
        if row.cache is None:
            row.cache = DynamicCache()
        start, end = row.prefilled, row.prefilled + count
        masks = self._masks_beside_forward()
        started = time.perf_counter()
        try:
            logits = fused_forward(
                self.handler.model,
                batch_cache=self._cache,
                batch_mask=mask,
                last_tokens=self._last,
                slice_cache=row.cache,
                read=start,
                slice_ids=row.prompt_ids[start:end],
                slice_logits=end == len(row.prompt_ids),
            )
        except FusionUnsupported as exc:
            logger.info("prefill slices get passes of their own with this model: %s", exc)
            self._fuse = False
            return False
        except Exception:
            # The step runs again apart, with masks of its own (these are discarded).
            return False
        step_s = self._decode_step_s
        if step_s is not None:
            # What the slice added to the step is what its size is steered by.
            self._steer_slice(count, time.perf_counter() - started - step_s)
        row.prefilled = end
        row.call.prefilled(count)
        rows = len(self.rows)
        self._mask = mask
        self._decoded(logits[:rows], finished, masks)
        if end == len(row.prompt_ids):
            self._prefilled(row, logits[rows:], finished)
        return True

    def _decode_step(self, finished: list[Finished]) -> None:
        import torch

        assert self._mask is not None and self._last is not None
        mask = torch.nn.functional.pad(self._mask, (0, 1), value=1)
        # The grammar masks are computed while the forward pass runs (llguidance releases
        # the GIL): they depend only on the tokens already taken.
        masks = self._masks_beside_forward()
        started = time.perf_counter()
        try:
            output = self.handler.model(
                input_ids=self._last[:, None],
                attention_mask=mask,
                position_ids=mask.sum(-1, keepdim=True) - 1,
                use_cache=True,
                **{self._cache_keyword: self._cache},
                **self._last_logits,
            )
        except Exception as exc:
            # One pass over every running row: no one of them can be blamed. They leave
            # together; waiting and prefilling requests stay.
            lost = [row.call for row in self.rows]
            self._reset_batch()
            raise RowsLost(lost, exc, finished) from exc
        self._decode_steps_s.append(time.perf_counter() - started)
        self._mask = mask
        self._decoded(output.logits[:, -1, :], finished, masks)

    def _decoded(
        self, logits: torch.Tensor, finished: list[Finished], masks: Future[GrammarMasks] | None
    ) -> None:
        """Every running row's next token from its ``logits``; rows that ended leave."""
        tokens, failures = self._choose(
            self.rows, logits, None if masks is None else masks.result()
        )
        self._last = tokens
        ended = []
        for index, row in enumerate(self.rows):
            try:
                if index in failures:
                    raise failures[index]
                done = self._take(row, tokens[index])
            except Exception as exc:
                ended.append(index)
                finished.append((row.call, exc))
                continue
            if done:
                ended.append(index)
                finished.append((row.call, row.result(row.finish_reason or "stop")))
                self._remember(index, row)
        if ended:
            self._drop(ended)

    def _reset_batch(self) -> None:
        self.rows = []
        self._cache = self._mask = self._last = None

    def _drop(self, indices: list[int]) -> None:
        import torch

        keep = [index for index in range(len(self.rows)) if index not in indices]
        if not keep:
            self._reset_batch()
            return
        assert self._mask is not None and self._last is not None
        kept = torch.tensor(keep, device=self._mask.device)
        self._cache.batch_select_indices(kept)
        self._mask = self._mask[kept]
        self._last = self._last[kept]
        self.rows = [self.rows[index] for index in keep]
        self._trim()

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row (the longest request left)."""
        assert self._mask is not None
        real = self._mask.any(dim=0).nonzero()
        start = int(real[0]) if real.numel() else 0
        if start == 0:
            return
        for layer in self._cache.layers:
            layer.keys = layer.keys[:, :, start:, :]
            layer.values = layer.values[:, :, start:, :]
        self._mask = self._mask[:, start:]

    # ---- per-request token choice and bookkeeping ------------------------------------------

    def _masks_beside_forward(self) -> Future[GrammarMasks] | None:
        """The running rows' grammar masks, computed on a thread of their own."""
        from concurrent.futures import ThreadPoolExecutor

        constrained = _constrained(self.rows)
        if not constrained:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="modelpool-masks")
        grammars = self.handler.grammars
        bitmask = grammars.new_bitmask(len(self.rows))

        def fill() -> GrammarMasks:
            return bitmask, grammars.fill_masks(constrained, bitmask)

        return self._mask_thread.submit(fill)

    def _choose(
        self, rows: list[_Row], logits: torch.Tensor, masks: GrammarMasks | None = None
    ) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Each row's next token, by that row's own parameters, and the rows whose choice
        failed (by index), each with its exception: that row's fault alone. A row with a
        grammar chooses among the tokens its grammar allows (``masks``: computed already,
        else here)."""
        failures: dict[int, Exception] = {}
        constrained = _constrained(rows)
        if constrained:
            grammars = self.handler.grammars
            if masks is None:
                bitmask = grammars.new_bitmask(len(rows))
                masks = bitmask, grammars.fill_masks(constrained, bitmask)
            bitmask, failures = masks
            failures = dict(failures)
            allowed = [index for index, _ in constrained if index not in failures]
            if allowed:
                grammars.apply(logits, bitmask, allowed)
        tokens = logits.argmax(dim=-1)
        for index, row in enumerate(rows):
            if index in failures:
                continue
            plain = (
                not row.do_sample
                and row.repetition_penalty == 1.0
                and row.no_repeat_ngram_size == 0
                and not row.penalties.active
                and row.generated >= row.min_new_tokens
            )
            if plain:
                continue
            try:
                tokens[index] = self._choose_one(row, logits[index])
            except Exception as exc:
                failures[index] = exc
        return tokens, failures

    def _choose_one(self, row: _Row, logits: torch.Tensor) -> torch.Tensor:
        import torch

        scores = logits.float().clone()
        seen = row.prompt_ids + row.progress.token_ids
        if row.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seen)), device=scores.device)
            picked = scores[ids]
            scores[ids] = torch.where(
                picked < 0, picked * row.repetition_penalty, picked / row.repetition_penalty
            )
        if row.no_repeat_ngram_size:
            banned = _banned_ngram_tokens(seen, row.no_repeat_ngram_size)
            if banned:
                scores[list(banned)] = -math.inf
        eos_ids = self.handler.eos_ids
        if row.generated < row.min_new_tokens and eos_ids:
            scores[list(eos_ids)] = -math.inf
        if row.penalties.active:
            row.penalties.apply(scores, row.progress.token_ids)
        if row.grammar is not None and not bool(torch.isfinite(scores).any()):
            # The penalties forbade every token the grammar allows: the grammar wins (a
            # promised JSON must still close).
            scores = logits.float().clone()
        if not row.do_sample:
            return scores.argmax()
        return _sample(scores, row)

    def _take(self, row: _Row, token: torch.Tensor) -> bool:
        """Give ``row`` its token; True when the request has ended. Raises what ended the
        request in error (its stream, its stop strings): that row's fault alone."""
        token_id = int(token)
        progress = row.progress
        progress.take([token_id])
        row.call.delivered()
        progress.on_token()
        if progress.error is not None:
            raise progress.error
        grammar_complete = row.grammar is not None and row.grammar.take(token_id)
        ended = not row.ignore_eos and token_id in self.handler.eos_ids
        if progress.stopped or ended or grammar_complete:
            row.finish_reason = "stop"
        elif row.generated >= row.max_new_tokens:
            row.finish_reason = "length"
        else:
            return False
        progress.flush()
        if progress.error is not None:
            raise progress.error
        return True


GrammarMasks = tuple["torch.Tensor", dict[int, Exception]]
"""A step's grammar masks (one row of bits per batch row) and the rows whose mask failed."""
_COMPILE_WAIT_S = 0.05


def _constrained(rows: list[_Row]) -> list[tuple[int, RowGrammar]]:
    return [(index, row.grammar) for index, row in enumerate(rows) if row.grammar is not None]


def _pad_left(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Left-pad a [rows, heads, columns, dim] cache tensor along its columns."""
    import torch

    if columns == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, columns, 0))


def _banned_ngram_tokens(seen: list[int], size: int) -> set[int]:
    """Tokens that would repeat an n-gram of ``size`` already in ``seen``."""
    if len(seen) < size:
        return set()
    prefix = tuple(seen[len(seen) - size + 1 :])
    return {
        seen[start + size - 1]
        for start in range(len(seen) - size + 1)
        if tuple(seen[start : start + size - 1]) == prefix
    }


def _sample(scores: torch.Tensor, row: _Row) -> torch.Tensor:
    import torch

    scores = scores / max(row.temperature, 1e-5)
    if 0 < row.top_k < scores.shape[-1]:
        threshold = torch.topk(scores, row.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, -math.inf)
    if row.top_p < 1.0:
        ordered, order = torch.sort(scores)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - row.top_p)
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), -math.inf)
    probabilities = scores.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=row.generator)[0]
