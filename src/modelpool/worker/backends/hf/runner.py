"""The hf backend's model runner for the batched form: forward passes over the running
rows' KV caches, and each row's token choice in torch.

The shared scheduler (``common.scheduler``) decides what each step computes: which
waiting requests start (the KV budget here is ``kv_cache_tokens``: every running row's
prompt and every token it may still generate, :meth:`HFRunner.kv_need`), which prompts
are read whole and which slices are read (chunked prefill, with "auto" slices steered by
the times reported here). :class:`HFRunner` runs the plan:

1. fresh short prompts are read together in one left-padded pass (if that pass fails,
   each again alone, so a fault is still one request's); other slices each in a pass
   of their own, into the request's own buffers (``hf.packed.RowKV``, made for its
   whole prompt at its first slice: a slice writes its columns in place);
2. a request whose prompt is read gets its first token and joins the running batch
   (``hf.packed.RowCache``): a prompt read in slices joins with the buffers it was read
   into, nothing copied; the prompts read together are copied out of their shared pass;
3. one decoding step for every running request: one packed forward pass, each row's
   last token at its own position, attention split per row (``hf.packed``), so a short
   row never pays for a long one; the first long prompt's slice rides on that same
   pass, so a slice costs its tokens, not a pass's fixed cost;
4. every request that ended (EOS, stop string, ``max_new_tokens``, its grammar
   complete) leaves, and its buffers with it.

A model the packed pass does not fit (attention not dispatched through transformers'
interface, a sliding window, soft capping) keeps its rows on one left-padded cache
instead (``hf.padded``: every row pays for the longest, a join rewrites the cache) and
reads each slice in a pass of its own, which on a CPU costs about one more decoding step
per slice; a model found out only at its first packed pass has its rows moved there.

A constrained row's mask is computed on a helper thread while the forward pass runs and
applied to its logits before its own penalties and sampling.

Faults stay in their row where they can be attributed: a prefill runs one
request at a time, so its failure (an out-of-memory on a long prompt, say) is
that request's (a failed packed pass is undone, and its slice and the decoding
step run apart, so this holds there too); so is a failure choosing or emitting
one row's token. A failure of the shared decoding pass cannot be blamed on one
row: those rows leave the batch together as ``protocol.RowsLost`` (the pool retries
them and tracks suspects) while waiting and prefilling requests stay.

``prefill_chunk_tokens`` (a load option): a number of prompt tokens per step, or
"auto" (the default, see ``common.scheduler.PrefillBudget``). A long prompt's time to
first token grows while it shares the worker with decoding rows: that is the price of
their inter-token latency.

Why our own loop rather than transformers' ``ContinuousBatchingManager``
(``generate_batch``): on CPU its paged path measured 33 tok/s against 94 tok/s
for a left-padded batch through ``generate()`` (SmolLM2-135M, 8 x 32 tokens,
2 cores; issue 12), it sizes its cache from free memory unless told
otherwise, it applies ``do_sample`` and the seed to the whole batch, and one
failing request ends its whole thread. Here every sampling parameter is per
request (``common.sampling``), each request samples from its own
``torch.Generator``, and the cache is bounded by ``kv_cache_tokens``.
The model's ``generation_config`` supplies the defaults ``generate()`` would
take from it (``repetition_penalty``, ``no_repeat_ngram_size``,
``min_new_tokens``/``min_length``, the sampling ones); a model whose
generation_config asks for a processor this loop does not implement
(``generation_config.unbatchable_generation_config``) runs one request at a time instead.
The GPU comparison with the manager is still to be measured.

The rule held to: greedy decoding of a prompt in a batch gives the same tokens
as the same prompt alone through ``HFHandler.generate`` in float32, on the
models tested (tests/integration/test_hf_batching.py); padding columns are
masked out of attention, so only floating-point summation order differs (a
sliced prefill too). In bfloat16 or float16 that order can flip a near tie, as
in any batched server.

The prefix cache (``hf.prefix_cache``, the handler's) touches the loop at two points:
when a request's prefill starts, the longest cached prefix of its prompt becomes the
start of its prefill cache (it prefills only the rest; those columns are copied into
its buffers at its first packed slice); when a row finishes, its
columns (prompt and answer) are copied out of its cache into the prefix cache.

KV-cache memory: ``kv_cache_tokens`` bounds the tokens the running rows may come to
hold (each one's prompt plus every token it may still generate, prefilling ones
included; on the padded cache, rows x the widest such row). A row's buffers grow by
half when full, never past what it may hold. A request that would push the batch past
the bound waits in the worker until rows leave, and ``room()`` tells the pool, which
places new requests elsewhere meanwhile. A request alone is always admitted, whatever its
size: the bound limits batching, never what one request may ask.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.grammar import RowGrammar
from modelpool.shared.lora import lora_ref
from modelpool.shared.prefixes import partition_of
from modelpool.shared.protocol import BatchCall, Call, Prompt
from modelpool.shared.reasoning.controls import template_params
from modelpool.worker.backends.common.sampling import Sampling, banned_ngram_tokens
from modelpool.worker.backends.common.scheduler import Row, Scheduler, StepPlan
from modelpool.worker.backends.common.text import TextProgress, stop_strings
from modelpool.worker.backends.hf.generation_config import CONFIG_DEFAULTS
from modelpool.worker.backends.hf.lora import NO_ADAPTER, Loras, LoraWeights, tokens_use
from modelpool.worker.backends.hf.packed import (
    FusionUnsupported,
    RowCache,
    RowKV,
    fusable,
    packed_forward,
)
from modelpool.worker.backends.hf.padded import PaddedRows

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from modelpool.worker.backends.hf.grammars import LLGuidanceGrammars
    from modelpool.worker.backends.hf.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_TOKENS = 16384
"""The KV tokens one worker's running rows may hold when ``kv_cache_tokens`` is not given:
about 750 MB for SmolLM2-135M in float32 (30 layers x 2 x 3 heads x 64 x 4 bytes a token)."""

UNBATCHED_PARAMS = ("logprobs", "prompt_logprobs")
"""Parameters the batched loop does not compute; a request with them is refused."""


class LoadedModel(Protocol):
    """What the runner needs of the hf handler (``hf.handler.HFHandler``)."""

    model: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    vocab_size: int
    grammars: LLGuidanceGrammars

    prefix_cache: PrefixCache | None
    loras: Loras

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> torch.Tensor: ...

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int: ...

    def prefix_lookup(self, ids: list[int], partition: int) -> tuple[Any, int] | None: ...

    def remember(
        self,
        prompt: Prompt,
        token_ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        answer_text: str,
        answer_ids: list[int],
        partition: int = 0,
    ) -> None: ...


@dataclass(eq=False)
class HFRow:
    """The runner's part of a row: its sampling generator, its own cache while prefilling."""

    generator: torch.Generator | None
    # While prefilling: a DynamicCache (from the prefix cache, or slices read on the
    # padded form), or the RowKV a packed pass reads its prompt into.
    cache: Any = None
    # Its LoRA adapter: read and checked at admission (``staged``), placed when it starts.
    staged: LoraWeights | None = None
    lora: int = NO_ADAPTER


HFRequest = Row[HFRow]


class HFRunner:
    """The batched form's forward passes and token choice for one loaded hf model; every
    method runs on the worker loop's thread, driven by a :class:`Scheduler`."""

    def __init__(self, handler: LoadedModel) -> None:
        import inspect

        self.handler = handler
        # transformers 5.24 renamed the forward's past_key_values to cache.
        parameters = inspect.signature(handler.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        # Only the last position's logits are read: skip the vocabulary projection of every
        # other prompt token (generate() does the same).
        self._last_logits: dict[str, int] = (
            {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        )
        self._mask_thread: ThreadPoolExecutor | None = None
        # Each running row on a cache of its own, stepped in packed passes a slice beside
        # decoding rows rides on (hf.packed), when the model allows it; else one padded
        # cache (hf.padded), and a slice gets a pass of its own.
        self._packed = fusable(handler.model)
        self.batch: list[HFRequest] = []  # the decoding rows, in the caches' row order
        self._rows: RowCache | PaddedRows = RowCache() if self._packed else PaddedRows()
        self._last: torch.Tensor | None = None  # [rows], each row's latest token

    # ---- the ModelRunner surface ---------------------------------------------------------

    @property
    def end_ids(self) -> frozenset[int]:
        return self.handler.eos_ids

    @property
    def slices_ride_on_decode(self) -> bool:
        return self._packed

    def grammars(self) -> LLGuidanceGrammars:
        return self.handler.grammars

    def row(self, call: BatchCall) -> HFRequest:
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
        ref = lora_ref(params)
        staged = None if ref is None else handler.loras.stage(ref)
        input_ids = handler.encode(
            call.prompt, params.get("tools"), template_kwargs=template_params(params)
        )
        prompt_ids = [int(token) for token in input_ids[0].tolist()]
        stops = stop_strings(params["stop"]) if "stop" in params else ()
        config = handler.model.generation_config
        # What generate() takes from the model's generation_config when the request does
        # not say; it counts min_length over prompt and completion together.
        defaults = {
            key: value
            for key in CONFIG_DEFAULTS
            if (value := getattr(config, key, None)) is not None
        }
        sampling = Sampling.from_params(
            params,
            handler.vocab_size,
            defaults,
            prompt_tokens=len(prompt_ids),
            min_length=int(getattr(config, "min_length", 0) or 0),
        )
        generator = None
        if sampling.do_sample:
            generator = torch.Generator(device=handler.model.device)
            if "seed" in params:
                generator.manual_seed(params["seed"])
            else:
                generator.seed()
        return Row(
            call=call,
            prompt_ids=prompt_ids,
            progress=TextProgress(handler.tokenizer, call, len(prompt_ids), stops),
            sampling=sampling,
            # Fitted to the context as the one-call path does; raises ContextLengthExceeded
            # (the worker answers that request alone) when the prompt cannot fit.
            max_new_tokens=handler.fit_new_tokens(call, dict(params), len(prompt_ids)),
            state=HFRow(generator, staged=staged),
        )

    def kv_need(self, rows: Sequence[HFRequest]) -> int:
        """The KV tokens ``rows`` may come to hold: each row's prompt and every token it
        may generate (on one padded cache: rows x the widest such row)."""
        if self._packed:
            return sum(len(row.prompt_ids) + row.generated + row.remaining for row in rows)
        width = max(len(row.prompt_ids) + row.generated for row in rows)
        longest_rest = max(row.remaining for row in rows)
        return len(rows) * (width + longest_rest)

    def join_cells(self, rows: Sequence[HFRequest], joining: HFRequest) -> int:
        """Cache positions written when ``joining`` joins ``rows``: its own on a cache of
        its own, the whole padded cache's on one padded cache."""
        if self._packed:
            return len(joining.prompt_ids)
        width = max(len(joining.prompt_ids), *(len(row.prompt_ids) for row in rows))
        return (len(rows) + 1) * width

    def start(self, row: HFRequest, need: int) -> bool:
        """Place the row's adapter (False: every place is taken by adapters in use; it
        waits) and start its prefill cache from the longest cached prefix of its prompt."""
        import torch

        if row.state.staged is not None:
            slot = self.handler.loras.acquire(row.state.staged)
            if slot is None:
                return False
            row.state.lora, row.state.staged = slot, None
        with torch.inference_mode():
            found = self.handler.prefix_lookup(row.prompt_ids, partition_of(row.call.params))
        if found is not None:
            row.state.cache, row.prefilled = found
            row.cached_tokens = row.prefilled
        return True

    def run(self, plan: StepPlan[HFRow], step: Scheduler[HFRow]) -> None:
        import torch

        with torch.inference_mode():
            whole = plan.whole
            if len(whole) > 1 and self._prefill_together(whole, step):
                whole = []
            slices = list(plan.slices)
            beside = slices.pop(0) if slices and plan.fused else None
            for row, count in [(row, len(row.prompt_ids)) for row in whole] + slices:
                self._prefill_alone(row, count, step)
            if self.batch:
                self._decode(step, beside)
            elif beside is not None:
                self._prefill_alone(*beside, step)

    def release(self, row: HFRequest) -> None:
        row.state.cache = None
        if row in self.batch:
            self._drop([self.batch.index(row)])

    def reset(self, started: list[HFRequest]) -> None:
        self._reset_batch()

    @property
    def cache_tokens(self) -> int:
        """KV tokens the running rows hold now (on one padded cache: rows x columns;
        prefilling caches not included)."""
        return self._rows.tokens

    # ---- the prefix cache ------------------------------------------------------------------

    def _remember(self, index: int, row: HFRequest) -> None:
        """Keep a finished row's KV (its prompt and answer) in the prefix cache."""
        if self.handler.prefix_cache is None:
            return
        try:
            layers = self._rows.row_layers(index)
            held = int(layers[0][0].shape[-2])
            answer = row.progress.token_ids
            ids = (row.prompt_ids + answer)[:held]
            self.handler.remember(
                row.call.prompt,
                ids,
                layers,
                row.progress.text,
                answer,
                partition_of(row.call.params),
            )
        except Exception:
            # The cache only saves work: failing to fill it must not fail the batch.
            logger.warning("could not keep a finished request's KV", exc_info=True)

    # ---- the forward passes ----------------------------------------------------------------

    def _prefill_together(self, rows: list[HFRequest], step: Scheduler[HFRow]) -> bool:
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
            with self._adapters(rows, [width] * len(rows)):
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
            step.prefilled(row, len(row.prompt_ids) - row.prefilled)
        tokens, failures = self._choose(rows, output.logits[:, -1, :])
        keep = []
        for index, row in enumerate(rows):
            try:
                if index in failures:
                    raise failures[index]
                if step.take(row, int(tokens[index])):
                    continue
            except Exception as exc:
                step.fail(row, exc)
                continue
            keep.append(index)
        if keep:
            kept = torch.tensor(keep, device=device)
            cache.batch_select_indices(kept)
            columns = [(width - len(rows[index].prompt_ids), width) for index in keep]
            self._join([rows[index] for index in keep], cache, columns, tokens[kept])
        return True

    def _prefill_alone(self, row: HFRequest, count: int, step: Scheduler[HFRow]) -> None:
        """The next ``count`` prompt tokens of ``row`` in a pass of its own; once its prompt
        is read, its first token, and it joins the batch."""
        try:
            logits = self._prefill_slice(row, count, step)
        except Exception as exc:
            step.fail(row, exc)
            return
        if logits is not None:
            self._prefilled(row, logits, step)

    def _prefilled(self, row: HFRequest, logits: torch.Tensor, step: Scheduler[HFRow]) -> None:
        """``row``'s prompt is read (``logits``: its last position's): its first token, and
        it joins the batch."""
        started = time.perf_counter()
        try:
            tokens, failures = self._choose([row], logits)
            if failures:
                raise failures[0]
            if step.take(row, int(tokens[0])):
                return
        except Exception as exc:
            step.fail(row, exc)
            return
        cache, row.state.cache = row.state.cache, None
        beside = list(self.batch)
        self._join([row], cache, [(0, len(row.prompt_ids))], tokens[:1])
        if beside:
            step.budget.joined(self.join_cells(beside, row), time.perf_counter() - started)

    def _prefill_slice(
        self, row: HFRequest, count: int, step: Scheduler[HFRow]
    ) -> torch.Tensor | None:
        """Read ``count`` more prompt tokens into the row's cache; the logits of its last
        position once the whole prompt is read, else None."""
        start, end = row.prefilled, row.prefilled + count
        started = time.perf_counter()
        logits = None
        with self._adapters([row], [count]):
            if self._packed:
                # The packed pass with no decoding rows: the slice goes into the buffers the
                # row will join with.
                try:
                    logits = self._packed_slice(row, start, end)
                except FusionUnsupported as exc:
                    self._unpack(exc)
            if not self._packed:
                logits = self._padded_slice(row, start, end)
        step.budget.steer(count, time.perf_counter() - started, bool(self.batch))
        step.prefilled(row, count)
        if end < len(row.prompt_ids):
            return None
        assert logits is not None
        return logits

    def _packed_slice(self, row: HFRequest, start: int, end: int) -> torch.Tensor:
        import torch

        device = self.handler.model.device
        return packed_forward(
            self.handler.model,
            RowCache(),
            torch.empty(0, dtype=torch.long, device=device),
            slice_row=self._prompt_buffers(row),
            slice_ids=row.prompt_ids[start:end],
            slice_logits=end == len(row.prompt_ids),
        )

    def _padded_slice(self, row: HFRequest, start: int, end: int) -> torch.Tensor:
        import torch
        from transformers import DynamicCache

        device = self.handler.model.device
        if row.state.cache is None:
            row.state.cache = DynamicCache()
        elif isinstance(row.state.cache, RowKV):
            # Read in packed passes until the model turned out not to take them.
            row.state.cache = row.state.cache.as_dynamic()
        output = self.handler.model(
            input_ids=torch.tensor([row.prompt_ids[start:end]], device=device),
            attention_mask=torch.ones((1, end), dtype=torch.long, device=device),
            position_ids=torch.arange(start, end, device=device)[None, :],
            use_cache=True,
            **{self._cache_keyword: row.state.cache},
            **self._last_logits,
        )
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits

    def _prompt_buffers(self, row: HFRequest) -> RowKV:
        """The buffers a packed pass reads ``row``'s prompt into: made for the whole prompt
        at its first slice, from the prefix cache's columns when it started from some."""
        if not isinstance(row.state.cache, RowKV):
            limit = len(row.prompt_ids) + row.generated + row.remaining
            row.state.cache = RowKV.for_prompt(
                len(row.prompt_ids), limit, row.state.cache, row.prefilled
            )
        buffers: RowKV = row.state.cache
        # The slice's positions come from the buffers, its token ids from ``prefilled``.
        assert buffers.length == row.prefilled, (buffers.length, row.prefilled)
        return buffers

    def _join(
        self,
        rows: list[HFRequest],
        cache: Any,
        columns: list[tuple[int, int]],
        last: torch.Tensor,
    ) -> None:
        """Requests whose prompts are read join the running batch: row ``i`` of their
        prefill ``cache`` holds its KV in columns ``columns[i]``; ``last``: their first
        tokens."""
        import torch

        if isinstance(cache, RowKV):
            assert isinstance(self._rows, RowCache)
            self._rows.adopt(cache)
        else:
            limits = [len(row.prompt_ids) + row.generated + row.remaining for row in rows]
            self._rows.add(cache, columns, limits)
        self._last = last if self._last is None else torch.cat([self._last, last])
        self.batch = [*self.batch, *rows]

    def _decode(self, step: Scheduler[HFRow], beside: tuple[HFRequest, int] | None) -> None:
        """One decoding step for every running row, with the slice ``beside`` in the same
        pass when one is given. If that packed pass fails, the slice is read in a pass of
        its own and the step runs alone, so that a fault is still one request's or the
        batch's."""
        if beside is not None:
            if self._packed and self._decode_with_slice(*beside, step):
                return
            self._prefill_alone(*beside, step)
        if self.batch:
            self._decode_step(step)

    def _decode_with_slice(self, row: HFRequest, count: int, step: Scheduler[HFRow]) -> bool:
        """The packed pass with a slice (hf.packed): False, with nothing changed, when it
        failed."""
        assert isinstance(self._rows, RowCache) and self._last is not None
        start, end = row.prefilled, row.prefilled + count
        masks = self._masks_beside_forward()
        started = time.perf_counter()
        try:
            # Inside the try: making the buffers (a prefix cache hit copies its columns in)
            # may run out of memory, which must fail this request alone, read apart.
            slice_row = self._prompt_buffers(row)
            with self._adapters([*self.batch, row], [1] * len(self.batch) + [count]):
                logits = packed_forward(
                    self.handler.model,
                    self._rows,
                    self._last,
                    slice_row=slice_row,
                    slice_ids=row.prompt_ids[start:end],
                    slice_logits=end == len(row.prompt_ids),
                )
        except FusionUnsupported as exc:
            self._unpack(exc)
            return False
        except Exception:
            # The step runs again apart, with masks of its own (these are discarded).
            return False
        step_s = step.budget.decode_step_s
        if step_s is not None:
            # What the slice added to the step is what its size is steered by.
            step.budget.steer(count, time.perf_counter() - started - step_s, bool(self.batch))
        step.prefilled(row, count)
        rows = len(self.batch)
        self._decoded(logits[:rows], step, masks)
        if end == len(row.prompt_ids):
            self._prefilled(row, logits[rows:], step)
        return True

    def _decode_step(self, step: Scheduler[HFRow]) -> None:
        assert self._last is not None
        # The grammar masks are computed while the forward pass runs (llguidance releases
        # the GIL): they depend only on the tokens already taken.
        masks = self._masks_beside_forward()
        started = time.perf_counter()
        try:
            with self._adapters(self.batch, [1] * len(self.batch)):
                logits = self._decode_rows()
        except Exception as exc:
            # One pass over every running row: no one of them can be blamed. They leave
            # together; waiting and prefilling requests stay.
            lost = self.batch
            self._reset_batch()
            step.lost(lost, exc)
        step.budget.timed_decode(time.perf_counter() - started)
        self._decoded(logits, step, masks)

    def _adapters(self, rows: Sequence[HFRequest], counts: list[int]) -> Any:
        """The pass's adapters: row ``i``'s for its ``counts[i]`` tokens (``hf.lora``)."""
        return tokens_use([row.state.lora for row in rows], counts, self.handler.model.device)

    def _decode_rows(self) -> torch.Tensor:
        assert self._last is not None
        try:
            return self._rows.decode(
                self.handler.model, self._last, self._cache_keyword, self._last_logits
            )
        except FusionUnsupported as exc:
            self._unpack(exc)
            return self._rows.decode(
                self.handler.model, self._last, self._cache_keyword, self._last_logits
            )

    def _unpack(self, reason: FusionUnsupported) -> None:
        """The model turned out not to run packed passes: its rows move to one padded
        cache, and from now on slices get passes of their own."""
        logger.info("this model's rows share one padded cache: %s", reason)
        self._packed = False
        if isinstance(self._rows, RowCache):
            self._rows = PaddedRows.of(self._rows)

    def _decoded(
        self, logits: torch.Tensor, step: Scheduler[HFRow], masks: Future[GrammarMasks] | None
    ) -> None:
        """Every running row's next token from its ``logits``; rows that ended leave."""
        tokens, failures = self._choose(
            self.batch, logits, None if masks is None else masks.result()
        )
        self._last = tokens
        ended = []
        for index, row in enumerate(self.batch):
            try:
                if index in failures:
                    raise failures[index]
                done = step.take(row, int(tokens[index]))
            except Exception as exc:
                ended.append(index)
                step.fail(row, exc)
                continue
            if done:
                ended.append(index)
                self._remember(index, row)
        if ended:
            self._drop(ended)

    def _reset_batch(self) -> None:
        self.batch = []
        self._rows = RowCache() if self._packed else PaddedRows()
        self._last = None

    def _drop(self, indices: list[int]) -> None:
        import torch

        keep = [index for index in range(len(self.batch)) if index not in indices]
        if not keep:
            self._reset_batch()
            return
        assert self._last is not None
        self._rows.select(keep)
        self._last = self._last[torch.tensor(keep, device=self._last.device)]
        self.batch = [self.batch[index] for index in keep]

    # ---- per-request token choice and bookkeeping ------------------------------------------

    def _masks_beside_forward(self) -> Future[GrammarMasks] | None:
        """The running rows' grammar masks, computed on a thread of their own."""
        from concurrent.futures import ThreadPoolExecutor

        constrained = _constrained(self.batch)
        if not constrained:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="modelpool-masks")
        grammars = self.handler.grammars
        bitmask = grammars.new_bitmask(len(self.batch))

        def fill() -> GrammarMasks:
            return bitmask, grammars.fill_masks(constrained, bitmask)

        return self._mask_thread.submit(fill)

    def _choose(
        self, rows: list[HFRequest], logits: torch.Tensor, masks: GrammarMasks | None = None
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
            forced = None if row.thinking is None else row.thinking.forced()
            if forced is not None:
                tokens[index] = forced  # the end of thinking, forced (common.thinking)
                continue
            if row.sampling.is_plain_greedy(row.generated):
                continue
            try:
                tokens[index] = self._choose_one(row, logits[index])
            except Exception as exc:
                failures[index] = exc
        return tokens, failures

    def _choose_one(self, row: HFRequest, logits: torch.Tensor) -> torch.Tensor:
        import torch

        sampling = row.sampling
        scores = logits.float().clone()
        seen = row.prompt_ids + row.progress.token_ids
        penalty = sampling.repetition_penalty
        if penalty != 1.0:
            ids = torch.tensor(sorted(set(seen)), device=scores.device)
            picked = scores[ids]
            scores[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
        if sampling.no_repeat_ngram_size:
            banned = banned_ngram_tokens(seen, sampling.no_repeat_ngram_size)
            if banned:
                scores[list(banned)] = -math.inf
        eos_ids = self.handler.eos_ids
        if row.generated < sampling.min_new_tokens and eos_ids:
            scores[list(eos_ids)] = -math.inf
        if sampling.penalties.active:
            sampling.penalties.apply(scores, row.progress.token_ids)
        if row.grammar is not None and not bool(torch.isfinite(scores).any()):
            # The penalties forbade every token the grammar allows: the grammar wins (a
            # promised JSON must still close).
            scores = logits.float().clone()
        if not sampling.do_sample:
            return scores.argmax()
        return _sample(scores, sampling, row.state.generator)


GrammarMasks = tuple["torch.Tensor", dict[int, Exception]]
"""A step's grammar masks (one row of bits per batch row) and the rows whose mask failed."""


def _constrained(rows: list[HFRequest]) -> list[tuple[int, RowGrammar]]:
    return [(index, row.grammar) for index, row in enumerate(rows) if row.grammar is not None]


def _sample(
    scores: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    import torch

    scores = scores / max(sampling.temperature, 1e-5)
    if 0 < sampling.top_k < scores.shape[-1]:
        threshold = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, -math.inf)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - sampling.top_p)
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), -math.inf)
    probabilities = scores.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator)[0]
