"""The hf backend's batched form: its own decoding loop over one shared KV cache.

:class:`BatchEngine` is what ``HFHandler.admit/step/retire/abort`` drive when
the pool runs the hf backend with ``max_batch_size`` above 1 (see
``protocol.BatchedHandler``). Each ``step()``:

1. prefills the requests admitted since the last step, left-padded to one
   length, in one forward pass, which gives each its first token;
2. merges them into the running batch: the narrower of the two caches is
   left-padded with masked columns, rows are concatenated;
3. runs one decoding step for every running request (one forward pass);
4. retires every request that ended (EOS, stop string, ``max_new_tokens``),
   dropping its cache rows and any leading columns that are now padding in
   every row.

Why our own loop rather than transformers' ``ContinuousBatchingManager``
(``generate_batch``): on CPU its paged path measured 33 tok/s against 94 tok/s
for a left-padded batch through ``generate()`` (SmolLM2-135M, 8 x 32 tokens,
2 cores; issue 12), it sizes its cache from free memory unless told
otherwise, it applies ``do_sample`` and the seed to the whole batch, and one
failing request ends its whole thread. Here every sampling parameter is per
request (``seed``, ``temperature``, ``top_p``, ``top_k``, ``do_sample``,
``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``,
``stop``, ``max_new_tokens``), each request samples from its own
``torch.Generator``, and the cache is bounded by ``kv_cache_tokens``.
The GPU comparison with the manager is still to be measured.

The rule held to: greedy decoding of a prompt in a batch gives the same tokens
as the same prompt alone through ``HFHandler.generate`` in float32, on the
models tested (tests/integration/test_hf_batching.py); padding columns are
masked out of attention, so only floating-point summation order differs. In
bfloat16 or float16 that order can flip a near tie, as in any batched server.

KV-cache memory: ``kv_cache_tokens`` bounds rows x columns of the padded cache
(prompt plus every token the running requests may still generate); a request
that would push the batch past it waits in the worker until rows leave. A
request alone is always admitted, whatever its size: the bound limits
batching, never what one request may ask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpool.errors import InvalidRequest
from modelpool.protocol import BatchCall, Finished, FinishReason, Generation

if TYPE_CHECKING:
    import torch

    from modelpool.backends.hf import HFHandler, _Progress

DEFAULT_KV_CACHE_TOKENS = 16384
"""Rows x columns of one worker's padded KV cache when ``kv_cache_tokens`` is not given:
about 750 MB for SmolLM2-135M in float32 (30 layers x 2 x 3 heads x 64 x 4 bytes a token)."""

_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
UNBATCHED_PARAMS = ("logprobs", "prompt_logprobs")
"""Parameters the batched loop does not compute; a request with them is refused."""


@dataclass(eq=False)
class _Row:
    """One request in the batch."""

    call: BatchCall
    prompt_ids: list[int]
    progress: _Progress
    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    no_repeat_ngram_size: int
    generator: torch.Generator | None
    finish_reason: FinishReason | None = None

    @property
    def generated(self) -> int:
        return len(self.progress.token_ids)

    @property
    def remaining(self) -> int:
        return max(0, self.max_new_tokens - self.generated)

    def result(self, finish_reason: FinishReason) -> Generation:
        return Generation(self.progress.text, finish_reason, len(self.prompt_ids), self.generated)


class BatchEngine:
    """One worker's running batch; every method runs on the worker loop's thread."""

    def __init__(self, handler: HFHandler, kv_cache_tokens: int) -> None:
        import inspect

        self.handler = handler
        self.kv_cache_tokens = kv_cache_tokens
        # transformers 5.24 renamed the forward's past_key_values to cache.
        parameters = inspect.signature(handler.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        # Only the last position's logits are read: skip the vocabulary projection of every
        # other prompt token (generate() does the same).
        self._last_logits: dict[str, int] = (
            {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        )
        self.waiting: list[_Row] = []
        self.rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [rows, columns], 1 where a real token is
        self._last: torch.Tensor | None = None  # [rows], each row's latest token

    # ---- the BatchedHandler surface ------------------------------------------------------

    def admit(self, call: BatchCall) -> None:
        self.waiting.append(self._row(call))

    def retire(self, call: BatchCall) -> Generation:
        for row in self.waiting:
            if row.call is call:
                self.waiting.remove(row)
                return row.result("cancelled")
        for index, row in enumerate(self.rows):
            if row.call is call:
                self._drop([index])
                return row.result("cancelled")
        return Generation("", "cancelled", None, 0)

    def abort(self) -> None:
        self.waiting.clear()
        self.rows.clear()
        self._cache = self._mask = self._last = None

    def step(self) -> list[Finished]:
        import torch

        finished: list[Finished] = []
        with torch.inference_mode():
            admitted = self._admissions()
            if admitted:
                self._prefill(admitted, finished)
            if self.rows:
                self._decode(finished)
        return finished

    @property
    def cache_tokens(self) -> int:
        """Rows x columns of the padded cache now."""
        return 0 if self._mask is None else int(self._mask.numel())

    # ---- admission -------------------------------------------------------------------------

    def _row(self, call: BatchCall) -> _Row:
        import torch

        from modelpool.backends.hf import _Progress, _stop_strings

        handler = self.handler
        params = call.params
        for name in UNBATCHED_PARAMS:
            if params.get(name) is not None:
                # Never dropped, never applied to the batch: refused, naming the field.
                raise InvalidRequest(
                    f"{name} is not supported by the batched hf backend "
                    "(max_batch_size > 1); send it to a pool with max_batch_size = 1"
                )
        input_ids = handler._encode(call.prompt)
        prompt_ids = [int(token) for token in input_ids[0].tolist()]
        stops = _stop_strings(params["stop"]) if "stop" in params else ()
        config = handler.model.generation_config
        do_sample = params.get("do_sample", params.get("temperature", 0) > 0)

        def sampling(key: str) -> Any:
            if key in params:
                return params[key]
            value = getattr(config, key, None)
            return _SAMPLING_DEFAULTS[key] if value is None else value

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
            progress=_Progress(handler.tokenizer, call, len(prompt_ids), stops),
            # Fitted to the context as the one-call path does; raises ContextLengthExceeded
            # (the worker answers that request alone) when the prompt cannot fit.
            max_new_tokens=handler._new_tokens(call, dict(params), len(prompt_ids)),
            min_new_tokens=params.get("min_new_tokens", 0),
            do_sample=do_sample,
            temperature=float(sampling("temperature")),
            top_k=int(sampling("top_k") or 0),
            top_p=float(sampling("top_p")),
            repetition_penalty=float(params.get("repetition_penalty", 1.0)),
            no_repeat_ngram_size=int(params.get("no_repeat_ngram_size", 0)),
            generator=generator,
        )

    def _admissions(self) -> list[_Row]:
        """Waiting requests that fit the KV budget beside the running ones, in order."""
        admitted: list[_Row] = []
        width = 0 if self._mask is None else int(self._mask.shape[1])
        longest_rest = max((row.remaining for row in self.rows), default=0)
        for row in list(self.waiting):
            count = len(self.rows) + len(admitted) + 1
            width = max(width, len(row.prompt_ids))
            longest_rest = max(longest_rest, row.remaining)
            projected = count * (width + longest_rest)
            if count > 1 and projected > self.kv_cache_tokens:
                break
            self.waiting.remove(row)
            admitted.append(row)
        return admitted

    # ---- the forward passes ----------------------------------------------------------------

    def _prefill(self, admitted: list[_Row], finished: list[Finished]) -> None:
        import torch
        from transformers import DynamicCache

        model = self.handler.model
        device = model.device
        width = max(len(row.prompt_ids) for row in admitted)
        pad = int(self.handler.tokenizer.pad_token_id or 0)
        input_ids = torch.full((len(admitted), width), pad, dtype=torch.long)
        mask = torch.zeros((len(admitted), width), dtype=torch.long)
        for index, row in enumerate(admitted):
            length = len(row.prompt_ids)
            input_ids[index, width - length :] = torch.tensor(row.prompt_ids)
            mask[index, width - length :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        cache = DynamicCache()
        output = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **{self._cache_keyword: cache},
            **self._last_logits,
        )
        tokens = self._choose(admitted, output.logits[:, -1, :])
        keep = [index for index, row in enumerate(admitted) if not self._take(row, tokens[index])]
        for index, row in enumerate(admitted):
            if index not in keep:
                finished.append((row.call, row.result(row.finish_reason or "stop")))
        if not keep:
            return
        kept = torch.tensor(keep, device=device)
        cache.batch_select_indices(kept)
        self._merge([admitted[index] for index in keep], cache, mask[kept], tokens[kept])

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor, last: torch.Tensor) -> None:
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
        self.rows = self.rows + rows

    def _decode(self, finished: list[Finished]) -> None:
        import torch

        assert self._mask is not None and self._last is not None
        mask = torch.nn.functional.pad(self._mask, (0, 1), value=1)
        output = self.handler.model(
            input_ids=self._last[:, None],
            attention_mask=mask,
            position_ids=mask.sum(-1, keepdim=True) - 1,
            use_cache=True,
            **{self._cache_keyword: self._cache},
            **self._last_logits,
        )
        self._mask = mask
        tokens = self._choose(self.rows, output.logits[:, -1, :])
        self._last = tokens
        ended = []
        for index, row in enumerate(self.rows):
            if self._take(row, tokens[index]):
                ended.append(index)
                finished.append((row.call, row.result(row.finish_reason or "stop")))
        if ended:
            self._drop(ended)

    def _drop(self, indices: list[int]) -> None:
        import torch

        keep = [index for index in range(len(self.rows)) if index not in indices]
        if not keep:
            self.rows = []
            self._cache = self._mask = self._last = None
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

    def _choose(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token, by that row's own parameters."""
        import torch

        tokens = logits.argmax(dim=-1)
        eos_ids = self.handler._eos_ids
        for index, row in enumerate(rows):
            plain = (
                not row.do_sample
                and row.repetition_penalty == 1.0
                and row.no_repeat_ngram_size == 0
                and row.generated >= row.min_new_tokens
            )
            if plain:
                continue
            scores = logits[index].float().clone()
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
            if row.generated < row.min_new_tokens and eos_ids:
                scores[list(eos_ids)] = -math.inf
            if not row.do_sample:
                tokens[index] = scores.argmax()
                continue
            tokens[index] = _sample(scores, row)
        return tokens

    def _take(self, row: _Row, token: torch.Tensor) -> bool:
        """Give ``row`` its token; True when the request has ended."""
        token_id = int(token)
        progress = row.progress
        progress.take([token_id])
        row.call.delivered()
        progress.on_token()
        if progress.error is not None:
            raise progress.error
        if progress.stopped or token_id in self.handler._eos_ids:
            row.finish_reason = "stop"
        elif row.generated >= row.max_new_tokens:
            row.finish_reason = "length"
        else:
            return False
        progress.flush()
        if progress.error is not None:
            raise progress.error
        return True


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
