"""The transformers backend: one causal language model per worker, streamed and stoppable.

The pool runs it as ``backend="hf"``; it can also be used directly::

    from modelpool.backends.hf import load

    handler = load("path/to/model", device="cpu", dtype="bfloat16", torch_threads=2)
    generation = handler.generate(call)   # call.prompt, call.params, call.cancelled(), call.emit()
    generation.text, generation.finish_reason

Decoding is greedy unless the request samples (``do_sample=True`` or a
``temperature`` above 0). A request whose prompt tokens plus ``max_new_tokens``
exceed the model's context (``handler.max_model_len``: the model config's, or
the ``max_model_len`` option) is refused with ``ContextLengthExceeded`` before
the prefill; without a ``max_new_tokens`` of the caller's, the default is cut
down to what the context leaves. ``logprobs=N`` returns each generated token's
log probability and its N likeliest alternatives (``Generation.logprobs``);
``prompt_logprobs=N`` scores the prompt's tokens too, with one forward pass
(``max_new_tokens=0`` then scores the prompt alone). Neither costs anything
when not asked for: only then does generate() keep each step's logits.
``ignore_eos=True`` (vLLM's, which load generators send to fix output lengths)
generates past the end-of-sequence token up to ``max_new_tokens``.

``grammar`` (llguidance grammar text, see :mod:`modelpool.grammar`) constrains the
output: compiled within ``grammar_compile_timeout_s`` on a thread of its own, then
applied as a logits processor before generate()'s sampling warpers.

Every step checks ``call.cancelled()`` and ends generation cleanly when it
turns true; text is handed to ``call.emit`` as soon as it is stable (never
half a character, never the start of a stop string), and the chunks joined
are exactly the returned text.

With ``max_batch_size`` above 1 the pool drives the batched form instead
(``admit``/``step``/``retire``/``abort``, see ``hf_batch``): many requests
decode together over one KV cache, each with its own sampling parameters.

Importing this module costs nothing heavy: the supervisor imports it for
:func:`validate`, and torch and transformers are imported by :func:`load`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelpool.backends.hf_batch import (
    DEFAULT_KV_CACHE_TOKENS,
    BatchEngine,
    PrefillChunk,
    unbatchable_generation_config,
)
from modelpool.backends.hf_penalties import PENALTY_PARAMS, Penalties, logits_processor
from modelpool.backends.hf_text import TextProgress, stop_strings
from modelpool.backends.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from modelpool.context import check_max_model_len, context_length, fit_to_context
from modelpool.errors import InvalidRequest
from modelpool.grammar import (
    COMPILE_TIMEOUT_PARAM,
    GRAMMAR_PARAM,
    LLGuidanceGrammars,
    RowGrammar,
    check_grammar_params,
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
    TokenIds,
    TokenLogprob,
    note_prompt,
)
from modelpool.tools import check_template_tools, render_chat
from modelpool.validation import MAX_INT, check_generation_params, is_int, is_number

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

THREADS_ENV = "MODELPOOL_TORCH_THREADS"
"""Torch intra-op threads for a worker when the ``torch_threads`` option is not given."""

DEFAULT_MAX_NEW_TOKENS = 128

GENERATION_PARAMS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "do_sample",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "stop",
        "seed",
        "logprobs",
        "prompt_logprobs",
        *PENALTY_PARAMS,
        "tools",
        GRAMMAR_PARAM,
        COMPILE_TIMEOUT_PARAM,
        "ignore_eos",
    }
)
LOAD_OPTIONS = frozenset(
    {
        "dtype",
        "device_map",
        "max_memory",
        "gguf_file",
        "trust_remote_code",
        "torch_threads",
        "chat_template",
        "kv_cache_tokens",
        "prefill_chunk_tokens",
        "max_model_len",
        "prefix_cache_bytes",
    }
)
_MEMORY_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)

# Set in greedy mode they change nothing but make transformers warn on every request.
_SAMPLING_ONLY = ("temperature", "top_p", "top_k")


def validate(params: Mapping[str, Any]) -> None:
    """Reject generation parameters this backend does not take, or takes with other types.

    Cheap and import-free, so the supervisor calls it before dispatch::

        validate({"max_new_tokens": 32, "stop": ["\\n\\n"]})   # fine
        validate({"max_tokens": 32})                           # InvalidRequest naming max_tokens
    """
    unknown = sorted(set(params) - GENERATION_PARAMS)
    if unknown:
        raise InvalidRequest(
            f"unknown generation parameter(s) for the hf backend: {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(GENERATION_PARAMS))}"
        )
    check_generation_params(params)
    for key in ("min_new_tokens", "top_k", "no_repeat_ngram_size"):
        if key in params:
            _check_int(key, params[key], minimum=0)
    if "seed" in params:
        _check_int("seed", params["seed"], minimum=0)
    if "do_sample" in params and not isinstance(params["do_sample"], bool):
        raise InvalidRequest(f"do_sample must be true or false, got {params['do_sample']!r}")
    if "repetition_penalty" in params:
        value = params["repetition_penalty"]
        if not is_number(value) or value <= 0:
            raise InvalidRequest(f"repetition_penalty must be a number > 0, got {value!r}")
    if params.get("min_new_tokens", 0) > params.get("max_new_tokens", math.inf):
        raise InvalidRequest("min_new_tokens must not exceed max_new_tokens")
    if params.get("do_sample") is True and params.get("temperature") == 0:
        raise InvalidRequest("do_sample=true needs a temperature > 0 (temperature 0 means greedy)")
    if "stop" in params:
        stop_strings(params["stop"])
    check_grammar_params(params)
    if params.get("tools") is not None:
        check_template_tools(params["tools"])


def load(model: str, device: str = "cpu", **options: Any) -> HFHandler:
    """Load ``model`` (a hub id or a local directory) once per worker and return its handler.

    Options (the pool's ``backend_options``): ``dtype`` ("auto", "float32",
    "bfloat16", ...; default: the checkpoint's), ``device_map`` (accelerate
    placement; then ``device`` is not applied), ``max_memory`` (per device,
    e.g. ``{"0": "38GiB", "1": "38GiB", "cpu": "64GiB"}``: GPUs in the worker's
    own numbering, sizes as bytes or strings; implies ``device_map="auto"``
    unless one is given), ``gguf_file`` (a file inside ``model``),
    ``trust_remote_code`` (default False), ``torch_threads`` (default:
    ``$MODELPOOL_TORCH_THREADS``, else torch's own choice), ``chat_template``
    (a Jinja template replacing the tokenizer's), ``max_model_len`` (the
    context length in tokens, prompt and completion together; default: the
    model config's ``max_position_embeddings`` or the like) and
    ``kv_cache_tokens`` (the batched form's KV-cache bound, rows x columns of
    the padded cache; see ``hf_batch``), ``prefill_chunk_tokens`` (the batched
    form's prompt tokens prefilled per step, or "auto", the default) and
    ``prefix_cache_bytes`` (the bound of the worker's prefix cache, bytes or a size such
    as "512MiB"; 0 turns it off; default ``DEFAULT_PREFIX_CACHE_BYTES``, see
    ``prefix_cache``)::

        handler = load("/models/smollm2", device="cuda:0", dtype="bfloat16")
        handler = load("/models/smollm2", max_model_len=2048)   # bound memory per request

    A worker that owns several GPUs gets ``device="cuda:0,cuda:1"``: the model is
    spread across them with ``device_map="auto"`` (accelerate) unless ``device_map``
    says otherwise ("balanced", "sequential" or an explicit map).
    """
    unknown = sorted(set(options) - LOAD_OPTIONS)
    if unknown:
        raise ValueError(
            f"unknown option(s) for the hf backend: {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(LOAD_OPTIONS))}"
        )
    dtype = options.get("dtype")
    device_map = options.get("device_map")
    gguf_file = options.get("gguf_file")
    trust_remote_code = options.get("trust_remote_code", False)
    chat_template = options.get("chat_template")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string such as 'bfloat16', got {dtype!r}")
    if device_map is not None and not isinstance(device_map, (str, dict)):
        raise ValueError(f"device_map must be a string or a mapping, got {device_map!r}")
    max_memory = _max_memory(options.get("max_memory"))
    if device_map is None and (max_memory is not None or "," in device):
        device_map = "auto"
    if gguf_file is not None and not isinstance(gguf_file, str):
        raise ValueError(f"gguf_file must be a file name, got {gguf_file!r}")
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be true or false, got {trust_remote_code!r}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a Jinja template string")
    threads = _thread_count(options.get("torch_threads"))
    kv_cache_tokens = options.get("kv_cache_tokens", DEFAULT_KV_CACHE_TOKENS)
    if (
        not isinstance(kv_cache_tokens, int)
        or isinstance(kv_cache_tokens, bool)
        or (kv_cache_tokens < 1)
    ):
        raise ValueError(f"kv_cache_tokens must be a positive integer, got {kv_cache_tokens!r}")
    prefill_chunk_tokens = options.get("prefill_chunk_tokens", "auto")
    if prefill_chunk_tokens != "auto" and (
        not isinstance(prefill_chunk_tokens, int)
        or isinstance(prefill_chunk_tokens, bool)
        or prefill_chunk_tokens < 1
    ):
        raise ValueError(
            f'prefill_chunk_tokens must be a positive integer or "auto", '
            f"got {prefill_chunk_tokens!r}"
        )
    max_model_len = check_max_model_len(options.get("max_model_len"))
    prefix_cache_bytes = _byte_size(
        "prefix_cache_bytes", options.get("prefix_cache_bytes", DEFAULT_PREFIX_CACHE_BYTES)
    )
    if _looks_like_a_path(model) and not os.path.exists(os.path.expanduser(model)):
        # Said before importing torch (seconds) and in words, rather than as the hub
        # client's "Repo id must be in the form ..." for a path that is simply missing.
        raise FileNotFoundError(f"model directory {model!r} does not exist")

    started = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    library_logs_through_root()
    if threads is not None:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            # Only settable before the first inter-op parallel work in the process.
            logger.debug("torch inter-op threads already fixed; leaving them")

    shared: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        shared["gguf_file"] = gguf_file
    model_kwargs = dict(shared)
    if dtype is not None:
        model_kwargs["dtype"] = _torch_dtype(dtype)
    if device_map is not None:
        model_kwargs["device_map"] = device_map
    if max_memory is not None:
        model_kwargs["max_memory"] = max_memory
    tokenizer = AutoTokenizer.from_pretrained(model, **shared)
    language_model: Any = AutoModelForCausalLM.from_pretrained(model, **model_kwargs)
    if device_map is None:
        language_model.to(_torch_device(device))
    language_model.eval()
    if chat_template is not None:
        tokenizer.chat_template = chat_template

    handler = HFHandler(
        language_model,
        tokenizer,
        max_model_len=max_model_len,
        kv_cache_tokens=kv_cache_tokens,
        prefill_chunk_tokens=prefill_chunk_tokens,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    handler.warm_up()
    logger.info(
        "loaded %s on %s (%s, %d torch threads, context %s tokens) in %.2f s",
        model,
        language_model.device,
        language_model.dtype,
        torch.get_num_threads(),
        handler.max_model_len,
        time.monotonic() - started,
    )
    return handler


class HFHandler:
    """A loaded model and tokenizer; made by :func:`load`.

    Both backend forms: ``generate(call)`` answers one request through
    transformers' ``generate()``; ``admit``/``step``/``retire``/``abort`` run
    many at once through :class:`~modelpool.backends.hf_batch.BatchEngine`.

    ``max_model_len`` overrides the context length read from the model's config.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_model_len: int | None = None,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        prefill_chunk_tokens: PrefillChunk = "auto",
        prefix_cache_bytes: int = 0,
    ) -> None:
        # Held as Any: transformers' annotations are partial (untyped methods,
        # decorated ones mypy cannot bind), and every use here is plain.
        self.model: Any = model
        self.tokenizer: Any = tokenizer
        self.max_model_len = context_length(model.config, max_model_len)
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        self.eos_ids = _token_ids(model.generation_config.eos_token_id) | _token_ids(
            tokenizer.eos_token_id
        )
        embeddings: Any = self.model.get_input_embeddings()
        self.vocab_size = int(embeddings.num_embeddings)
        self._token_texts: dict[int, str] = {}
        # llguidance is imported (and the tokenizer's view made) on the first grammar.
        self.grammars = LLGuidanceGrammars(tokenizer, self.vocab_size, self.eos_ids)
        self._batch = BatchEngine(self, kv_cache_tokens, prefill_chunk_tokens)
        # The batched loop keeps one full-length cache per layer: a model with sliding-window
        # layers would need their masks and crops, so it runs one request at a time.
        config = model.config
        layer_types = getattr(config, "layer_types", None) or ()
        sliding = getattr(config, "sliding_window", None) is not None and getattr(
            config, "use_sliding_window", True
        )
        # A generation_config processor the loop does not apply would make batched output
        # differ from generate()'s: such a model runs one request at a time.
        unbatchable = unbatchable_generation_config(model.generation_config)
        if unbatchable:
            logger.warning(
                "the model's generation_config sets %s, which the batched loop does not "
                "apply: requests run one at a time",
                ", ".join(unbatchable),
            )
        full_attention = (
            not sliding
            and not any("sliding" in str(kind) for kind in layer_types)
            and _cache_has_layers()
        )
        self.batched = full_attention and not unbatchable
        # KV keyed by token ids alone fits only a model whose KV depends on nothing else:
        # no adapters (PEFT), full-attention layers whose caches are never cropped.
        adapters = bool(getattr(model, "peft_config", None))
        self.prefix_cache = (
            PrefixCache(prefix_cache_bytes)
            if prefix_cache_bytes > 0 and full_attention and not adapters
            else None
        )
        # transformers 5.24 renamed generate()'s past_key_values to cache, as the forward's.
        forward = inspect.signature(model.forward).parameters
        self._cache_keyword = "cache" if "cache" in forward else "past_key_values"

    def admit(self, call: BatchCall) -> None:
        """Batched form: queue ``call``; it is prefilled at the next :meth:`step`."""
        self._batch.admit(call)

    def step(self) -> list[Finished]:
        """Batched form: prefill what was admitted, one decoding step for every request."""
        return self._batch.step()

    def retire(self, call: BatchCall) -> Generation:
        """Batched form: drop ``call`` now; returns its text so far."""
        return self._batch.retire(call)

    def abort(self) -> None:
        """Batched form: forget every request."""
        self._batch.abort()

    def room(self) -> tuple[int, list[BatchCall]]:
        """Batched form: free KV room in tokens, and the requests waiting for it."""
        return self._batch.room()

    def prefix_cache_report(self) -> PrefixCacheReport | None:
        """The prefix cache's size, counters and fingerprints (None: it is off)."""
        return None if self.prefix_cache is None else self.prefix_cache.report()

    def remember(
        self,
        prompt: Prompt,
        token_ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        answer_text: str,
        answer_ids: list[int],
    ) -> None:
        """Keep the KV of a finished request's prompt and answer (``token_ids``, as many as
        ``layers`` hold) in the prefix cache, with the fingerprints the pool places by."""
        if self.prefix_cache is None:
            return
        try:
            fingerprints = answered_fingerprints(prompt, answer_text, answer_ids)
            self.prefix_cache.insert(token_ids, layers, fingerprints)
        except Exception:
            # The cache only saves work: failing to fill it must not fail the request.
            logger.warning("could not keep a finished request's KV", exc_info=True)

    def validate(self, params: Mapping[str, Any]) -> None:
        """The module's :func:`validate`, for callers that hold only the handler."""
        validate(params)

    def warm_up(self) -> None:
        """Generate one token so that the first real request does not pay for lazy set-up."""
        self.generate(_WarmUpCall())

    def generate(self, call: Call) -> Generation:
        """Answer one request; see the module docstring for what the parameters mean."""
        import torch

        validate(call.params)
        params = dict(call.params)
        stops = stop_strings(params.pop("stop", ()))
        seed = params.pop("seed", None)
        top_logprobs: int | None = params.pop("logprobs", None)
        prompt_top_logprobs: int | None = params.pop("prompt_logprobs", None)
        penalties = Penalties.from_params(params, self.vocab_size)
        for name in PENALTY_PARAMS:
            params.pop(name, None)
        grammar_text = params.pop(GRAMMAR_PARAM, None)
        params.pop(COMPILE_TIMEOUT_PARAM, None)
        ignore_eos = params.pop("ignore_eos", False)
        if ignore_eos:
            # No end-of-sequence id: generate() stops at max_new_tokens or a stop string.
            params["eos_token_id"] = None
        input_ids = self.encode(call.prompt, params.pop("tools", None))
        prompt_tokens = int(input_ids.shape[1])
        params["max_new_tokens"] = self.fit_new_tokens(call, params, prompt_tokens)
        # Penalties first: the grammar's mask comes last, so no bias reopens a token it shut.
        processors: list[Any] = []
        if penalties.active:
            processors.append(logits_processor(penalties, prompt_tokens))
        if grammar_text is not None:
            # Compiled on a thread of its own within its bound; the cancel flag is read
            # meanwhile.
            compiled = self.grammars.start(call.params).wait(call.cancelled)
            if compiled is None:
                return Generation("", "cancelled", prompt_tokens, 0)
            processors.append(_grammar_processor(self.grammars, self.grammars.row(compiled)))
        prompt_logprobs = None
        if prompt_top_logprobs is not None:
            prompt_logprobs, prompt_cache = self._prompt_logprobs(input_ids, prompt_top_logprobs)
            if prompt_cache is not None:
                # generate() then computes only the last prompt token: no second prefill.
                params.update(prompt_cache)
        if params.get("max_new_tokens") == 0:
            no_tokens: list[TokenLogprob] | None = None if top_logprobs is None else []
            return Generation("", "length", prompt_tokens, 0, no_tokens, prompt_logprobs)
        if top_logprobs is not None:
            # Only now: keeping every step's logits is what logprobs cost.
            params.update(output_logits=True, return_dict_in_generate=True)
        # No cancelled() check before the prefill: the worker has just read the flag
        # before calling us, and every cancelled() call counts as progress, which would
        # start the stall clock before the one step that cannot be interrupted. A cancel
        # that lands during the prefill stops generation at the first decoding step.

        progress = TextProgress(self.tokenizer, call, prompt_tokens, stops)
        prompt_ids: list[int] = input_ids[0].tolist()
        kv, cached_tokens = self._prefix_kv(prompt_ids, params, prompt_top_logprobs is None)
        note_prompt(call, prompt_tokens, cached_tokens)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **_generation_kwargs(params),
                **_hooks(progress, processors),
            )
        # Idempotent after the streamer's end(); keeps the returned text whole
        # should a generation path ever skip end().
        progress.flush()
        if progress.error is not None:
            raise progress.error
        if kv is not None:
            held = [(layer.keys, layer.values) for layer in kv.layers]
            all_ids = prompt_ids + progress.token_ids
            self.remember(
                call.prompt,
                all_ids[: kv.get_seq_length()],
                held,
                progress.text,
                progress.token_ids,
            )
        logprobs = None
        if top_logprobs is not None:
            sequences = output.sequences
            # Every generated token, the end-of-sequence one included (its text is the
            # special token's): one entry per completion token, as clients that read
            # the logprob of the k-th token after the prompt (lm-eval) expect.
            kept = progress.token_ids
            steps = output.logits[: len(kept)]
            logprobs = self._token_logprobs(torch.cat(steps), kept, top_logprobs) if kept else []
        else:
            sequences = output

        finish_reason: FinishReason
        if progress.cancelled:
            finish_reason = "cancelled"
        elif progress.stopped or (not ignore_eos and int(sequences[0, -1]) in self.eos_ids):
            finish_reason = "stop"
        else:
            finish_reason = "length"
        return Generation(
            progress.text,
            finish_reason,
            prompt_tokens,
            len(progress.token_ids),
            logprobs,
            prompt_logprobs,
            cached_tokens,
        )

    def _prefix_kv(
        self, prompt_ids: list[int], params: dict[str, Any], usable: bool
    ) -> tuple[Any, int]:
        """The cache generate() starts from (the longest cached prefix of the prompt, or an
        empty one to keep after) in ``params``, and the prompt tokens it already holds."""
        from transformers import DynamicCache

        if self.prefix_cache is None or not usable:
            return None, 0
        found = self.prefix_cache.lookup(prompt_ids)
        kv, cached_tokens = found if found is not None else (DynamicCache(), 0)
        params[self._cache_keyword] = kv
        return kv, cached_tokens

    def _prompt_logprobs(
        self, input_ids: torch.Tensor, top: int
    ) -> tuple[list[TokenLogprob], dict[str, Any] | None]:
        """Each prompt token's logprob given the tokens before it, and the KV cache of all
        but the last prompt token as a generate() keyword (None for a one-token prompt).

        One forward pass over ``prompt[:-1]``: its outputs predict ``prompt[1:]``, and its
        cache lets generate() start at the last prompt token instead of a second prefill.
        """
        import torch

        ids = input_ids[0].tolist()
        first = TokenLogprob(ids[0], self._token_text(ids[0]), None)
        if len(ids) == 1:
            return [first], None
        with torch.inference_mode():
            output = self.model(input_ids=input_ids[:, :-1], use_cache=True)
        # transformers 5 names the cache "cache" (output field and generate() keyword),
        # earlier versions "past_key_values".
        fields = getattr(output, "__dataclass_fields__", {})
        name = "cache" if "cache" in fields else "past_key_values"
        cache = {name: getattr(output, name)}
        return [first, *self._token_logprobs(output.logits[0], ids[1:], top)], cache

    def _token_logprobs(self, logits: torch.Tensor, ids: list[int], top: int) -> list[TokenLogprob]:
        """``logits[i]`` is the model's output that predicted ``ids[i]``."""
        import torch

        with torch.inference_mode():
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            chosen = logprobs.gather(1, torch.tensor(ids, device=logprobs.device)[:, None])
            chosen_values: list[float] = chosen[:, 0].tolist()
            if top:
                top_values, top_ids = logprobs.topk(top, dim=-1)
                alternatives: list[list[float]] = top_values.tolist()
                alternative_ids: list[list[int]] = top_ids.tolist()
        entries = []
        for index, (token_id, value) in enumerate(zip(ids, chosen_values, strict=True)):
            best: tuple[tuple[int, str, float], ...] = ()
            if top:
                best = tuple(
                    (other, self._token_text(other), other_value)
                    for other, other_value in zip(
                        alternative_ids[index], alternatives[index], strict=True
                    )
                )
            entries.append(TokenLogprob(token_id, self._token_text(token_id), value, best))
        return entries

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            self._token_texts[token_id] = text
        return text

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int:
        """This request's ``max_new_tokens``, fitted to the context; raises if it cannot fit."""
        asked = params.get("max_new_tokens")
        default = DEFAULT_MAX_NEW_TOKENS
        if asked is not None and "max_new_tokens" in getattr(call, "defaulted", ()):
            default, asked = asked, None
        new_tokens = fit_to_context(prompt_tokens, asked, self.max_model_len, default=default)
        if params.get("min_new_tokens", 0) > new_tokens:
            # The caller insists on more than the capped default: refused if that cannot fit.
            fit_to_context(prompt_tokens, params["min_new_tokens"], self.max_model_len, default=0)
        return new_tokens

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """The token ids a generation of ``prompt`` feeds the model (``/tokenize``)."""
        input_ids = self.encode(prompt, add_generation_prompt=add_generation_prompt)
        ids: list[int] = input_ids[0].tolist()
        return ids

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (``/detokenize``)."""
        self._check_vocabulary(token_ids)
        text: str = self.tokenizer.decode(token_ids, clean_up_tokenization_spaces=False)
        return text

    def _check_vocabulary(self, token_ids: Sequence[int]) -> None:
        too_large = [token_id for token_id in token_ids if token_id >= self.vocab_size]
        if too_large:
            raise InvalidRequest(
                f"token id {too_large[0]} is outside this model's vocabulary "
                f"(ids 0 to {self.vocab_size - 1})"
            )

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> torch.Tensor:
        """The prompt's token ids; a chat prompt offers ``tools`` (OpenAI's shape) to the
        model (see ``modelpool.tools.render_chat``)."""
        import torch

        tokenizer = self.tokenizer
        input_ids: torch.Tensor
        if isinstance(prompt, TokenIds):
            self._check_vocabulary(prompt.ids)
            input_ids = torch.tensor([prompt.ids])
        elif isinstance(prompt, str):
            input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        else:
            if tokenizer.chat_template is None:
                raise InvalidRequest(
                    "this model's tokenizer has no chat template: send a string prompt, "
                    "or give the hf backend a chat_template option"
                )
            if tools or any(len(message) > 2 for message in prompt):
                text = render_chat(tokenizer, prompt, tools, add_generation_prompt)
            else:
                text = tokenizer.apply_chat_template(
                    [dict(message) for message in prompt],
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                )
            # The template writes its own special tokens (BOS included).
            input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if input_ids.shape[1] == 0:
            if tokenizer.bos_token_id is None:
                raise InvalidRequest("the prompt is empty and the tokenizer has no BOS token")
            input_ids = torch.tensor([[tokenizer.bos_token_id]])
        return input_ids.to(self.model.device)


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


def _cache_has_layers() -> bool:
    """Does this transformers' DynamicCache keep per-layer tensors in ``layers`` (the batched
    loop edits them)? Older releases kept ``key_cache``/``value_cache`` lists instead."""
    from transformers import DynamicCache

    return hasattr(DynamicCache(), "layers")


def _generation_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **params}
    if "do_sample" not in kwargs:
        kwargs["do_sample"] = kwargs.get("temperature", 0) > 0
    if not kwargs["do_sample"]:
        for key in _SAMPLING_ONLY:
            kwargs.pop(key, None)
    return kwargs


class _WarmUpCall:
    prompt: Prompt = "Hello"
    params: dict[str, Any] = {"max_new_tokens": 1}

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        pass


def _check_int(key: str, value: object, *, minimum: int, maximum: int = MAX_INT) -> None:
    if not is_int(value, minimum=minimum, maximum=maximum):
        raise InvalidRequest(f"{key} must be an integer in [{minimum}, {maximum}], got {value!r}")


def _token_ids(value: int | list[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


# Libraries that print to stderr through a handler of their own.
_LIBRARY_LOGGERS = ("huggingface_hub", "transformers")


def library_logs_through_root() -> None:
    """When the root logger has a handler (a worker's forwards each record to the
    supervisor), send transformers' and huggingface_hub's records through it alone.

    Each library adds its own stderr handler; huggingface_hub also propagates to the root,
    so in a worker each of its warnings came out twice, and transformers' came out bare,
    without the worker's name. Called once they are imported (they configure their
    loggers then)."""
    if not logging.getLogger().handlers:
        return  # no root handler: the libraries' own are the only ones that print
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        for handler in list(library.handlers):
            if type(handler) is logging.StreamHandler:
                library.removeHandler(handler)
        library.propagate = True


def _looks_like_a_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def _thread_count(option: object) -> int | None:
    if option is not None:
        if not isinstance(option, int) or isinstance(option, bool) or option < 1:
            raise ValueError(f"torch_threads must be a positive integer, got {option!r}")
        return option
    from_env = os.environ.get(THREADS_ENV, "").strip()
    if not from_env:
        return None
    if not from_env.isdigit() or int(from_env) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {from_env!r}")
    return int(from_env)


_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _byte_size(name: str, option: object) -> int:
    """Bytes, from an int or a size such as "512MiB"."""
    if isinstance(option, int) and not isinstance(option, bool) and option >= 0:
        return option
    text = option.strip() if isinstance(option, str) else ""
    match = _MEMORY_SIZE.match(text)
    if match is None:
        raise ValueError(f"{name} must be bytes or a size like '512MiB', got {option!r}")
    return int(float(text[: match.start(2)]) * _SIZE_UNITS[match.group(2).lower()])


def _max_memory(option: object) -> dict[int | str, int | str] | None:
    """``max_memory`` as accelerate takes it: GPU keys as ints ("0", "cuda:0" -> 0), "cpu",
    "disk"; sizes as bytes or strings such as "20GiB"."""
    if option is None:
        return None
    if not isinstance(option, Mapping) or not option:
        raise ValueError(
            f"max_memory must be a table of device -> size, e.g. {{'0': '20GiB'}}, got {option!r}"
        )
    result: dict[int | str, int | str] = {}
    for key, size in option.items():
        name = str(key).strip().lower()
        if name.startswith("cuda:"):
            name = name[len("cuda:") :]
        if name.isdigit():
            device: int | str = int(name)
        elif name in ("cpu", "disk", "mps"):
            device = name
        else:
            raise ValueError(f"max_memory: {key!r} is not a GPU number, 'cuda:N', 'cpu' or 'disk'")
        if is_int(size, minimum=1):
            result[device] = int(size)
        elif isinstance(size, str) and _MEMORY_SIZE.match(size.strip()):
            result[device] = size.strip()
        else:
            raise ValueError(
                f"max_memory[{key!r}] must be bytes or a size like '20GiB', got {size!r}"
            )
    return result


def _torch_dtype(name: str) -> Any:
    if name == "auto":
        return name
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"dtype must be 'auto' or a torch dtype name (bfloat16, ...), not {name!r}"
        )
    return dtype


def _torch_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from exc
