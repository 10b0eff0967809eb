"""The hf backend's one-call form: one request through transformers' ``generate()``,
streamed through :class:`~modelpool.worker.backends.common.text.TextProgress` and stoppable.

``generate()`` is given hooks: a stopping criterion and a streamer that drive the text
(a stop string ends generation on the step that completes it), logits processors for
OpenAI's penalties and a grammar, and a check of the cancel flag before every decoder
layer (:func:`cancellable`), so that a cancel or a deadline during a long prompt's
prefill (one forward pass, seconds on a CPU) ends the request within a layer's time
instead of after the whole pass, past the pool's ``cancel_grace_s`` (which kills the
worker).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Container, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from modelpool.shared.grammar import COMPILE_TIMEOUT_PARAM, GRAMMAR_PARAM, RowGrammar
from modelpool.shared.lora import LORA_PARAM
from modelpool.shared.prefixes import CACHE_SALT_PARAM, partition_of
from modelpool.shared.protocol import Call, FinishReason, Generation, TokenLogprob, note_prompt
from modelpool.shared.reasoning.controls import THINKING_PARAMS, template_params
from modelpool.shared.validation import FIT_PARAM, PRIORITY_PARAM, PROMOTED_AT_PARAM
from modelpool.worker.backends.common.params import DEFAULT_MAX_NEW_TOKENS
from modelpool.worker.backends.common.penalties import PENALTY_PARAMS, Penalties
from modelpool.worker.backends.common.text import TextProgress, stop_strings
from modelpool.worker.backends.common.thinking import (
    ThinkingModels,
    is_chat,
    keep_family_tokens,
)
from modelpool.worker.backends.hf.layer_checks import transformer_layers
from modelpool.worker.backends.hf.runner import LoadedModel

if TYPE_CHECKING:
    import torch

    from modelpool.worker.backends.hf.grammars import LLGuidanceGrammars

# Set in greedy mode they change nothing but make transformers warn on every request.
_SAMPLING_ONLY = ("temperature", "top_p", "top_k")


class GeneratingModel(LoadedModel, Protocol):
    """What the one-call form needs of the hf handler (``hf.handler.HFHandler``, which
    imports this module), beyond what the batched runner needs."""

    cache_keyword: str
    thinking: ThinkingModels

    def validate(self, params: Mapping[str, Any]) -> None: ...

    def token_logprobs(
        self, logits: torch.Tensor, ids: list[int], top: int
    ) -> list[TokenLogprob]: ...

    def token_text(self, token_id: int) -> str: ...


class PrefillCancelled(Exception):
    """The cancel flag was read set before a decoder layer of a prefill."""


@contextlib.contextmanager
def cancellable(model: Any, cancelled: Callable[[], bool]) -> Iterator[None]:
    """Within the block, each decoder layer of ``model`` first reads ``cancelled`` when it
    runs over more than one position (a prefill) and raises :class:`PrefillCancelled` if it
    is set. At the first pass over one position (decoding) the checks are removed: the
    stopping criterion reads the flag once a step already, and a module with hooks takes
    torch's slower call path.

    Each read counts as progress for the pool's stall clock, which is what a prefill is
    making; a model whose decoder layers cannot be found is run without the checks."""
    import torch

    handles: list[Any] = []

    def check(module: Any, args: tuple[Any, ...]) -> None:
        hidden = args[0] if args else None
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return
        if hidden.shape[-2] == 1:
            for handle in handles:
                handle.remove()
        elif cancelled():
            raise PrefillCancelled

    handles.extend(layer.register_forward_pre_hook(check) for layer in transformer_layers(model))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def generate(handler: GeneratingModel, call: Call) -> Generation:
    """Answer one request; see the module docstring for what the parameters mean."""
    import torch

    handler.validate(call.params)
    params = dict(call.params)
    stops = stop_strings(params.pop("stop", ()))
    seed = params.pop("seed", None)
    top_logprobs: int | None = params.pop("logprobs", None)
    prompt_top_logprobs: int | None = params.pop("prompt_logprobs", None)
    penalties = Penalties.from_params(params, handler.vocab_size)
    for name in PENALTY_PARAMS:
        params.pop(name, None)
    grammar_text = params.pop(GRAMMAR_PARAM, None)
    params.pop(COMPILE_TIMEOUT_PARAM, None)
    params.pop(PRIORITY_PARAM, None)  # the one-call form runs alone: nothing to order
    params.pop(PROMOTED_AT_PARAM, None)
    partition = partition_of(params)
    params.pop(CACHE_SALT_PARAM, None)
    params.pop(LORA_PARAM, None)  # applied by the handler around this call (hf.lora)
    ignore_eos = params.pop("ignore_eos", False)
    # Thinking is bounded on the scheduler's path (handler.generate sends a reasoning
    # model's requests there): here, only the template reads enable_thinking.
    template_kwargs = template_params(params)
    for name in THINKING_PARAMS:
        params.pop(name, None)
    if ignore_eos:
        # No end-of-sequence id: generate() stops at max_new_tokens or a stop string.
        params["eos_token_id"] = None
    input_ids = handler.encode(
        call.prompt, params.pop("tools", None), template_kwargs=template_kwargs
    )
    prompt_tokens = int(input_ids.shape[1])
    params["max_new_tokens"] = handler.fit_new_tokens(call, params, prompt_tokens)
    params.pop(FIT_PARAM, None)  # read by the fit above; generate() takes no such kwarg
    # Penalties first: the grammar's mask comes last, so no bias reopens a token it shut.
    processors: list[Any] = []
    if penalties.active:
        processors.append(penalties_processor(penalties, prompt_tokens))
    if grammar_text is not None:
        # Compiled on a thread of its own within its bound; the cancel flag is read
        # meanwhile.
        compiled = handler.grammars.start(call.params).wait(call.cancelled)
        if compiled is None:
            return Generation("", "cancelled", prompt_tokens, 0)
        processors.append(_grammar_processor(handler.grammars, handler.grammars.row(compiled)))
    prompt_logprobs = None
    if prompt_top_logprobs is not None:
        try:
            with cancellable(handler.model, call.cancelled):
                prompt_logprobs, prompt_cache = _prompt_logprobs(
                    handler, input_ids, prompt_top_logprobs
                )
        except PrefillCancelled:
            return Generation("", "cancelled", prompt_tokens, 0)
        if prompt_cache is not None:
            # generate() then computes only the last prompt token: no second prefill.
            params.update(prompt_cache)
    if params.get("max_new_tokens") == 0:
        no_tokens: list[TokenLogprob] | None = None if top_logprobs is None else []
        return Generation("", "length", prompt_tokens, 0, no_tokens, prompt_logprobs)
    if top_logprobs is not None:
        # Only now: keeping every step's logits is what logprobs cost.
        params.update(output_logits=True, return_dict_in_generate=True)
    progress = TextProgress(handler.tokenizer, call, prompt_tokens, stops)
    if is_chat(call.prompt):
        # Unbounded here (one request at a time), but a gpt-oss answer is still split.
        keep_family_tokens(handler.thinking, call.params, progress)
    prompt_ids: list[int] = input_ids[0].tolist()
    kv, cached_tokens = _prefix_kv(
        handler, prompt_ids, params, prompt_top_logprobs is None, partition
    )
    note_prompt(call, prompt_tokens, cached_tokens)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.inference_mode(), cancellable(handler.model, call.cancelled):
            output = handler.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **_generation_kwargs(params),
                **_hooks(progress, processors),
            )
    except PrefillCancelled:
        # Nothing was emitted after the flag was read; the partial KV is not kept.
        return Generation(
            progress.text,
            "cancelled",
            prompt_tokens,
            len(progress.token_ids),
            cached_tokens=cached_tokens,
        )
    # Idempotent after the streamer's end(); keeps the returned text whole
    # should a generation path ever skip end().
    progress.flush()
    if progress.error is not None:
        raise progress.error
    if kv is not None:
        held = [(layer.keys, layer.values) for layer in kv.layers]
        all_ids = prompt_ids + progress.token_ids
        handler.remember(
            call.prompt,
            all_ids[: kv.get_seq_length()],
            held,
            progress.text,
            progress.token_ids,
            partition,
        )
    logprobs = None
    if top_logprobs is not None:
        sequences = output.sequences
        # Every generated token, the end-of-sequence one included (its text is the
        # special token's): one entry per completion token, as clients that read
        # the logprob of the k-th token after the prompt (lm-eval) expect.
        kept = progress.token_ids
        steps = output.logits[: len(kept)]
        logprobs = handler.token_logprobs(torch.cat(steps), kept, top_logprobs) if kept else []
    else:
        sequences = output

    finish_reason = finish_reason_of(progress, int(sequences[0, -1]), handler.eos_ids, ignore_eos)
    return Generation(
        progress.text,
        finish_reason,
        prompt_tokens,
        len(progress.token_ids),
        logprobs,
        prompt_logprobs,
        cached_tokens,
        stop_sequence=progress.stop_sequence if finish_reason == "stop" else None,
    )


def finish_reason_of(
    progress: TextProgress, last_token: int, eos_ids: Container[int], ignore_eos: bool
) -> FinishReason:
    """Why a ``generate()`` call ended: cancelled, a stop (a stop string, or the model's end
    of sequence unless ignored) or its token limit."""
    if progress.cancelled:
        return "cancelled"
    if progress.stopped or (not ignore_eos and last_token in eos_ids):
        return "stop"
    return "length"


def _prefix_kv(
    handler: GeneratingModel,
    prompt_ids: list[int],
    params: dict[str, Any],
    usable: bool,
    partition: int,
) -> tuple[Any, int]:
    """The cache generate() starts from (the longest prefix of the prompt cached in
    ``partition``, or an empty one to keep after) in ``params``, and the prompt tokens it
    already holds."""
    from transformers import DynamicCache

    if handler.prefix_cache is None or not usable:
        return None, 0
    found = handler.prefix_lookup(prompt_ids, partition)
    kv, cached_tokens = found if found is not None else (DynamicCache(), 0)
    params[handler.cache_keyword] = kv
    return kv, cached_tokens


def _prompt_logprobs(
    handler: GeneratingModel, input_ids: torch.Tensor, top: int
) -> tuple[list[TokenLogprob], dict[str, Any] | None]:
    """Each prompt token's logprob given the tokens before it, and the KV cache of all
    but the last prompt token as a generate() keyword (None for a one-token prompt).

    One forward pass over ``prompt[:-1]``: its outputs predict ``prompt[1:]``, and its
    cache lets generate() start at the last prompt token instead of a second prefill.
    """
    import torch

    ids = input_ids[0].tolist()
    first = TokenLogprob(ids[0], handler.token_text(ids[0]), None)
    if len(ids) == 1:
        return [first], None
    with torch.inference_mode():
        output = handler.model(input_ids=input_ids[:, :-1], use_cache=True)
    # transformers 5 names the cache "cache" (output field and generate() keyword),
    # earlier versions "past_key_values".
    fields = getattr(output, "__dataclass_fields__", {})
    name = "cache" if "cache" in fields else "past_key_values"
    cache = {name: getattr(output, name)}
    return [first, *handler.token_logprobs(output.logits[0], ids[1:], top)], cache


def _hooks(progress: TextProgress, processors: list[Any]) -> dict[str, Any]:
    """generate() keyword arguments that connect it to ``progress`` (and to a grammar's
    logits processor: generate() runs such processors before its sampling warpers)."""
    from transformers import LogitsProcessorList

    criteria_type, streamer_type, criteria_list_type = _hook_types()
    hooks = {
        "stopping_criteria": criteria_list_type([criteria_type(progress)]),
        "streamer": streamer_type(progress),
    }
    if processors:
        hooks["logits_processor"] = LogitsProcessorList(processors)
    return hooks


def _grammar_processor(grammars: LLGuidanceGrammars, grammar: RowGrammar) -> Any:
    """A generate() logits processor that allows only the tokens ``grammar`` allows: it
    advances the grammar by each token generate() chose, then masks the next step's."""

    class GrammarProcessor:
        def __init__(self) -> None:
            self.prompt_tokens: int | None = None
            self.bitmask = grammars.new_bitmask(1)

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.prompt_tokens is None:
                self.prompt_tokens = int(input_ids.shape[1])
            else:
                grammar.take(int(input_ids[0, -1]))
            failures = grammars.fill_masks([(0, grammar)], self.bitmask)
            if failures:
                raise failures[0]
            grammars.apply(scores, self.bitmask, [0])
            return scores

    return GrammarProcessor()


@functools.cache
def _hook_types() -> tuple[type[Any], type[Any], type[Any]]:
    """The transformers subclasses, defined on first use to keep importing this module light."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class ProgressCriteria(StoppingCriteria):
        def __init__(self, progress: TextProgress) -> None:
            self.progress = progress

        def __call__(
            self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any
        ) -> torch.Tensor:
            done = self.progress.on_step(input_ids)
            batch = input_ids.shape[0]
            return torch.full((batch,), done, dtype=torch.bool, device=input_ids.device)

    class ProgressStreamer(BaseStreamer):
        def __init__(self, progress: TextProgress) -> None:
            self.progress = progress
            self.prompt_skipped = False

        def put(self, value: torch.Tensor) -> None:
            # generate() hands over the prompt first; the token itself is read
            # by the criterion, which sees it earlier in the same step.
            if self.prompt_skipped:
                self.progress.deliver()
                self.progress.on_token()
            self.prompt_skipped = True

        def end(self) -> None:
            self.progress.flush()

    return ProgressCriteria, ProgressStreamer, StoppingCriteriaList


def _generation_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **params}
    if "do_sample" not in kwargs:
        kwargs["do_sample"] = kwargs.get("temperature", 0) > 0
    if not kwargs["do_sample"]:
        for key in _SAMPLING_ONLY:
            kwargs.pop(key, None)
    return kwargs


def penalties_processor(penalties: Penalties, prompt_tokens: int) -> Any:
    """OpenAI's penalties as a transformers ``LogitsProcessor`` for ``generate()`` (one row)."""
    from transformers import LogitsProcessor

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            scores = scores.clone()
            for row in range(scores.shape[0]):
                generated = input_ids[row, prompt_tokens:].tolist()
                penalties.apply(scores[row], generated)
            return scores

    return OpenAIPenalties()
