"""The transformers backend: one causal language model per worker, streamed and stoppable.

The pool runs it as ``backend="hf"``; it can also be used directly::

    from modelpool.worker.backends.hf import load

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

``grammar`` (llguidance grammar text, see :mod:`modelpool.shared.grammar`) constrains the
output: compiled within ``grammar_compile_timeout_s`` on a thread of its own, then
applied as a logits processor before generate()'s sampling warpers.

Every step, and every decoder layer of the prefill, checks ``call.cancelled()`` and
ends generation cleanly when it turns true (``generation``); text is handed to
``call.emit`` as soon as it is stable (never half a character, never the start of a
stop string), and the chunks joined are exactly the returned text.

With ``max_batch_size`` above 1 the pool drives the batched form instead
(``admit``/``step``/``retire``/``abort``, see ``hf.runner``): many requests
decode together over one KV cache, each with its own sampling parameters.

Importing this module costs nothing heavy: the supervisor imports it for
:func:`validate`, and torch and transformers are imported by :func:`load`.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelpool.shared.context import check_max_model_len, context_length
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.images import vision_model_type
from modelpool.shared.lora import DEFAULT_MAX_LORAS, lora_ref
from modelpool.shared.prefix_tier import BLOCK_TOKENS as TIER_BLOCK_TOKENS
from modelpool.shared.prefix_tier import TierSpec
from modelpool.shared.prefixes import answered_fingerprints
from modelpool.shared.protocol import (
    Call,
    Generation,
    PrefixCacheReport,
    Prompt,
    TokenIds,
    TokenLogprob,
)
from modelpool.shared.reasoning.controls import PARSER_PARAM
from modelpool.shared.tools import render_chat
from modelpool.worker.backends.common.chat_text import (
    NO_SPECIALS,
    EscapedChat,
    Specials,
    splices_exactly,
)
from modelpool.worker.backends.common.params import (
    chat_template_option,
    check_load_options,
    check_vocabulary,
    fit_new_tokens,
    positive_int,
)
from modelpool.worker.backends.common.params import validate as validate_params
from modelpool.worker.backends.common.scheduler import (
    PrefillChunk,
    ScheduledHandler,
    Scheduler,
    WarmUpCall,
    run_alone,
)
from modelpool.worker.backends.common.thinking import ThinkingModels, is_chat
from modelpool.worker.backends.hf.generation import generate
from modelpool.worker.backends.hf.generation_config import unbatchable_generation_config
from modelpool.worker.backends.hf.grammars import LLGuidanceGrammars
from modelpool.worker.backends.hf.lora import Loras
from modelpool.worker.backends.hf.options import (
    LOAD_OPTIONS,
    byte_size,
    looks_like_a_path,
    max_memory,
    thread_count,
    torch_device,
    torch_dtype,
    trust_remote_code,
    use_torch_threads,
)
from modelpool.worker.backends.hf.pooling import PoolingHandler, load_pooling, pooling_task
from modelpool.worker.backends.hf.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from modelpool.worker.backends.hf.prefix_tier import HFPrefixTiers
from modelpool.worker.backends.hf.runner import DEFAULT_KV_CACHE_TOKENS, HFRow, HFRunner
from modelpool.worker.backends.hf.vision import VisionHandler, load_vision
from modelpool.worker.images import refuse_images

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def validate(params: Mapping[str, Any]) -> None:
    """Reject generation parameters this backend does not take, or takes with other types
    (every backend's rules, ``common.params``). Cheap and import-free, so the supervisor
    calls it before dispatch::

        validate({"max_new_tokens": 32, "stop": ["\\n\\n"]})   # fine
        validate({"max_tokens": 32})                           # InvalidRequest naming max_tokens
    """
    validate_params(params, "hf")


def load(
    model: str, device: str = "cpu", **options: Any
) -> HFHandler | PoolingHandler | VisionHandler:
    """The backend's factory: a local directory of a sentence-transformers embedding model or
    of a cross-encoder is a pooling model, loaded by
    :func:`modelpool.worker.backends.hf.pooling.load_pooling` (its own options; its worker embeds
    and scores instead of generating); an image-text-to-text model's a vision model
    (:func:`modelpool.worker.backends.hf.vision.load_vision`); anything else a generation
    model (:func:`load_generation`)."""
    if vision_model_type(model) is not None:
        return load_vision(model, device, **options)
    task = pooling_task(model)
    if task is not None:
        return load_pooling(model, device, task, **options)
    return load_generation(model, device, **options)


def load_generation(model: str, device: str = "cpu", **options: Any) -> HFHandler:
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
    ``kv_cache_tokens`` (the batched form's KV-cache bound in tokens, every running
    row's prompt and generation; see ``hf.runner``), ``prefill_chunk_tokens`` (the batched
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
    check_load_options(options, LOAD_OPTIONS, "hf")
    dtype = options.get("dtype")
    device_map = options.get("device_map")
    gguf_file = options.get("gguf_file")
    chat_template = chat_template_option(options)
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string such as 'bfloat16', got {dtype!r}")
    if device_map is not None and not isinstance(device_map, (str, dict)):
        raise ValueError(f"device_map must be a string or a mapping, got {device_map!r}")
    memory_map = max_memory(options.get("max_memory"))
    if device_map is None and (memory_map is not None or "," in device):
        device_map = "auto"
    if gguf_file is not None and not isinstance(gguf_file, str):
        raise ValueError(f"gguf_file must be a file name, got {gguf_file!r}")
    trusted = trust_remote_code(options)
    threads = thread_count(options.get("torch_threads"))
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
    prefix_cache_bytes = byte_size(
        "prefix_cache_bytes", options.get("prefix_cache_bytes", DEFAULT_PREFIX_CACHE_BYTES)
    )
    max_loras = positive_int("max_loras", options.get("max_loras", DEFAULT_MAX_LORAS))
    if looks_like_a_path(model) and not os.path.exists(os.path.expanduser(model)):
        # Said before importing torch (seconds) and in words, rather than as the hub
        # client's "Repo id must be in the form ..." for a path that is simply missing.
        raise FileNotFoundError(f"model directory {model!r} does not exist")

    started = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    library_logs_through_root()
    use_torch_threads(threads)

    shared: dict[str, Any] = {"trust_remote_code": trusted}
    if gguf_file is not None:
        shared["gguf_file"] = gguf_file
    model_kwargs = dict(shared)
    if dtype is not None:
        model_kwargs["dtype"] = torch_dtype(dtype)
    if device_map is not None:
        model_kwargs["device_map"] = device_map
    if memory_map is not None:
        model_kwargs["max_memory"] = memory_map
    tokenizer = AutoTokenizer.from_pretrained(model, **shared)
    language_model: Any = AutoModelForCausalLM.from_pretrained(model, **model_kwargs)
    if device_map is None:
        language_model.to(torch_device(device))
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
        max_loras=max_loras,
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


class HFHandler(ScheduledHandler):
    """A loaded model and tokenizer; made by :func:`load`.

    Both backend forms: ``generate(call)`` answers one request through
    transformers' ``generate()``; ``admit``/``step``/``retire``/``abort`` run
    many at once through the shared :class:`~modelpool.worker.backends.common.scheduler.Scheduler`
    over an :class:`~modelpool.worker.backends.hf.runner.HFRunner`.

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
        max_loras: int = DEFAULT_MAX_LORAS,
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
        self.token_texts: dict[int, str] = {}
        # What a chat's content may not write as special tokens (common.chat_text).
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.specials = Specials.of(
            {token.content: int(id_) for id_, token in added.items() if token.special}
        )
        self.chat_as_text = tokenizer.chat_template is None or splices_exactly(
            lambda messages: str(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ),
            lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
            self._text_ids,
            self.specials,
        )
        if not self.chat_as_text:
            logger.warning(
                "this tokenizer reads text otherwise in pieces than whole: special tokens in "
                "chat content are read as special tokens "
                "(see modelpool.worker.backends.common.chat_text)"
            )
        # llguidance is imported (and the tokenizer's view made) on the first grammar.
        self.grammars = LLGuidanceGrammars(tokenizer, self.vocab_size, self.eos_ids)
        self.runner = HFRunner(self)
        self.loras = Loras(model, max_loras, self._adapters_in_use)
        self.scheduler: Scheduler[HFRow] = Scheduler(
            self.runner, kv_cache_tokens, prefill_chunk_tokens
        )
        self.thinking = self.scheduler.thinking_models = ThinkingModels(
            tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
            tokenizer.get_vocab(),
            lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        )
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
        self.prefix_tiers: HFPrefixTiers | None = None  # attach_prefix_tiers
        # transformers 5.24 renamed generate()'s past_key_values to cache, as the forward's.
        forward = inspect.signature(model.forward).parameters
        self.cache_keyword = "cache" if "cache" in forward else "past_key_values"

    def attach_prefix_tiers(
        self, specs: Sequence[TierSpec], model: str, options: Mapping[str, Any]
    ) -> None:
        """Write the prefix cache's entries to the tiers of ``specs`` and restore from them
        on a miss (``hf.prefix_tier``); nothing while the prefix cache is off. A tier that
        cannot be opened is logged and left off: it only saves work."""
        if self.prefix_cache is None or not specs:
            return
        try:
            self.prefix_tiers = HFPrefixTiers.open(specs, model, dict(options), self.model)
        except OSError:
            logger.warning("the prefix cache tiers could not be opened", exc_info=True)

    def prefix_lookup(self, ids: list[int], partition: int) -> tuple[Any, int] | None:
        """A request cache holding the longest prefix of ``ids`` cached in ``partition``
        and its length: from the worker's prefix cache, or restored from a tier that holds
        at least a block more (then kept in the worker's cache too)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        found = cache.lookup(ids, partition)
        held = 0 if found is None else found[1]
        tiers = self.prefix_tiers
        if tiers is None or held + TIER_BLOCK_TOKENS > len(ids) - 1:
            return found
        restored = tiers.restore(ids, partition, held)
        if restored is None:
            return found
        hit, layers = restored
        prefix = list(hit.ids[: hit.length])
        return cache.adopt(prefix, layers, hit.fingerprints, partition), hit.length

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
        partition: int = 0,
    ) -> None:
        """Keep the KV of a finished request's prompt and answer (``token_ids``, as many as
        ``layers`` hold) in the prefix cache's ``partition``, with the fingerprints the
        pool places by."""
        if self.prefix_cache is None:
            return
        try:
            fingerprints = answered_fingerprints(prompt, answer_text, answer_ids, partition)
            kept = self.prefix_cache.insert(token_ids, layers, fingerprints, partition)
            if kept is not None and self.prefix_tiers is not None:
                self.prefix_tiers.write(token_ids, kept, fingerprints, partition)
        except Exception:
            # The cache only saves work: failing to fill it must not fail the request.
            logger.warning("could not keep a finished request's KV", exc_info=True)

    def _adapters_in_use(self) -> set[int]:
        return {row.state.lora for row in (*self.scheduler.prefilling, *self.scheduler.rows)}

    def validate(self, params: Mapping[str, Any]) -> None:
        """The module's :func:`validate`, for callers that hold only the handler."""
        validate(params)

    def warm_up(self) -> None:
        """Generate one token so that the first real request does not pay for lazy set-up."""
        self.generate(WarmUpCall())

    def generate(self, call: Call) -> Generation:
        """Answer one request alone (``generation``; the module docstring says what the
        parameters mean). A reasoning model's runs through the scheduler, whose bound on
        thinking generate() does not have (``common.thinking``)."""
        parser = call.params.get(PARSER_PARAM, "auto")
        if self.batched and is_chat(call.prompt) and self.thinking.get(parser):
            return run_alone(self.scheduler, call)
        with self.loras.solo(lora_ref(call.params)):
            return generate(self, call)

    def token_logprobs(self, logits: torch.Tensor, ids: list[int], top: int) -> list[TokenLogprob]:
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
                    (other, self.token_text(other), other_value)
                    for other, other_value in zip(
                        alternative_ids[index], alternatives[index], strict=True
                    )
                )
            entries.append(TokenLogprob(token_id, self.token_text(token_id), value, best))
        return entries

    def token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            self.token_texts[token_id] = text
        return text

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int:
        """This request's ``max_new_tokens``, fitted to the context; raises if it cannot fit."""
        return fit_new_tokens(call, params, prompt_tokens, self.max_model_len)

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """The token ids a generation of ``prompt`` feeds the model (``/tokenize``)."""
        input_ids = self.encode(prompt, add_generation_prompt=add_generation_prompt)
        ids: list[int] = input_ids[0].tolist()
        return ids

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (``/detokenize``)."""
        check_vocabulary(token_ids, self.vocab_size)
        text: str = self.tokenizer.decode(token_ids, clean_up_tokenization_spaces=False)
        return text

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """The prompt's token ids; a chat prompt offers ``tools`` (OpenAI's shape) to the
        model (see ``modelpool.shared.tools.render_chat``)."""
        import torch

        tokenizer = self.tokenizer
        input_ids: torch.Tensor
        if isinstance(prompt, TokenIds):
            check_vocabulary(prompt.ids, self.vocab_size)
            input_ids = torch.tensor([prompt.ids])
        elif isinstance(prompt, str):
            input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        else:
            refuse_images(prompt, "a text-only hf model")
            if tokenizer.chat_template is None:
                raise InvalidRequest(
                    "this model's tokenizer has no chat template: send a string prompt, "
                    "or give the hf backend a chat_template option"
                )
            # The content's special tokens are text; the template writes its own (BOS
            # included), the only ones read as such.
            specials = self.specials if self.chat_as_text else NO_SPECIALS
            chat = EscapedChat.of(prompt, tools, specials)
            if tools or any(len(message) > 2 for message in prompt):
                text = render_chat(
                    tokenizer, chat.messages, chat.tools, add_generation_prompt, template_kwargs
                )
            else:
                text = tokenizer.apply_chat_template(
                    chat.messages,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **(template_kwargs or {}),
                )
            if self.chat_as_text:
                ids = chat.token_ids(text, self._text_ids)
            else:
                ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            input_ids = torch.tensor([ids], dtype=torch.long)
        if input_ids.shape[1] == 0:
            if tokenizer.bos_token_id is None:
                raise InvalidRequest("the prompt is empty and the tokenizer has no BOS token")
            input_ids = torch.tensor([[tokenizer.bos_token_id]])
        return input_ids.to(self.model.device)

    def _text_ids(self, text: str) -> list[int]:
        """``text``'s ids with no special token read (a chat's content, between the
        template's markers)."""
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        ids: list[int] = encoded["input_ids"]
        return ids


def _cache_has_layers() -> bool:
    """Does this transformers' DynamicCache keep per-layer tensors in ``layers`` (the batched
    loop edits them)? Older releases kept ``key_cache``/``value_cache`` lists instead."""
    from transformers import DynamicCache

    return hasattr(DynamicCache(), "layers")


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
