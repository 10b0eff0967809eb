"""The llama.cpp backend: a GGUF model per worker, run by llama.cpp through llama-cpp-python.

The pool runs it as ``backend="llama_cpp"`` (install ``modelpool[llama]``; see docs/backends.md,
"The llama_cpp backend", for the build flags)::

    from modelpool.worker.backends.llama_cpp import load

    handler = load("/models/SmolLM2-135M-Instruct.Q4_1.gguf", threads=2)
    handler.generate(call)        # call.prompt, call.params, call.cancelled(), call.emit()

``model`` is a ``.gguf`` file, or a directory holding one (``gguf_file`` names
it when there are several). The request parameters and their meaning are the
every backend's (``common.params.GENERATION_PARAMS``): greedy unless the request samples,
``temperature``/``top_p``/``top_k``/``seed``, ``repetition_penalty``,
``no_repeat_ngram_size``, ``min_new_tokens``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``ignore_eos``, ``stop``, grammars, ``logprobs`` and
``prompt_logprobs`` (both forms), token-id prompts, ``tools`` (offered through
``modelpool.shared.tools.render_chat`` as on hf, each call constrained by its grammar).
Chat messages are rendered with the GGUF's own chat template
(``tokenizer.chat_template``) unless the ``chat_template`` option gives one. A
request that does not fit the context (``max_model_len``, default the model's
training context) is refused with
``ContextLengthExceeded`` before its prefill, as on hf.

Both backend forms run the same loop, the shared scheduler (``common.scheduler``) over
``llama_cpp.runner``: ``generate`` is one request alone, ``admit``/``step``/``retire``/
``abort`` many at once, each its own llama.cpp sequence, one ``llama_decode`` per step
over all of them.

A backend that cannot run says so at load, in the one line the pool's
``ModelLoadFailed`` quotes: llama-cpp-python not installed, a file that is not a
GGUF llama.cpp can read, GPU layers asked of a CPU-only build, or a build that
uses CPU instructions this machine does not run. That last one would kill the
worker on its first decode (SIGILL, or SIGSEGV under some sandboxes) and the
pool would see crashes, not a reason, so the first load of a model with a given
build on a given CPU first decodes one token in a child process (a second or two,
once: the outcome is remembered under ``$MODELPOOL_HOME/llama_cpp``).

Importing this module costs nothing heavy: the supervisor imports it for
:func:`validate`; llama-cpp-python and numpy are imported by :func:`load`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.prefix_tier import TierSpec
from modelpool.shared.protocol import (
    Call,
    Generation,
    PrefixCacheReport,
    Prompt,
    TokenIds,
)
from modelpool.shared.tools import render_chat
from modelpool.worker.backends.common.chat_text import EscapedChat, Specials, splices_exactly
from modelpool.worker.backends.common.params import check_vocabulary, fit_new_tokens
from modelpool.worker.backends.common.params import validate as validate_params
from modelpool.worker.backends.common.scheduler import (
    ScheduledHandler,
    Scheduler,
    WarmUpCall,
    run_alone,
)
from modelpool.worker.backends.common.thinking import MARKERS, ThinkingModels
from modelpool.worker.backends.llama_cpp.embedding import (
    LlamaEmbeddingHandler,
    is_embedding_model,
    load_embedding,
    read_metadata,
)
from modelpool.worker.backends.llama_cpp.grammars import LlamaGrammars
from modelpool.worker.backends.llama_cpp.lora import GgufLoras
from modelpool.worker.backends.llama_cpp.options import (
    ALL_LAYERS,
    Options,
    gguf_path,
    import_llama_cpp,
    parse_options,
    placement,
)
from modelpool.worker.backends.llama_cpp.prefix_tier import LlamaPrefixTiers
from modelpool.worker.backends.llama_cpp.probe import probe_once
from modelpool.worker.backends.llama_cpp.projector import Projector
from modelpool.worker.backends.llama_cpp.runner import LlamaRow, LlamaRunner
from modelpool.worker.backends.llama_cpp.runtime import Runtime
from modelpool.worker.backends.llama_cpp.vision import ImageGeneration
from modelpool.worker.images import image_locations, refuse_images

logger = logging.getLogger(__name__)


def validate(params: Mapping[str, Any]) -> None:
    """Reject generation parameters this backend does not take (every backend's rules,
    ``common.params``)."""
    validate_params(params, "llama_cpp")


def load(
    model: str, device: str = "cpu", **options: Any
) -> LlamaCppHandler | LlamaEmbeddingHandler:
    """Load the GGUF ``model`` once per worker and return its handler.

    Options (the pool's ``backend_options``): ``gguf_file`` (the file in a directory
    ``model``), ``threads`` (CPU threads; default ``$MODELPOOL_TORCH_THREADS``, which the
    pool sets per worker, else every CPU this process may use), ``chat_template`` (a
    Jinja template replacing the GGUF's), ``max_model_len`` (the context length in
    tokens, prompt and completion together; default the model's training context),
    ``kv_cache_tokens`` (KV cells of the worker, all its requests together; default
    and minimum ``max_model_len``), ``prefill_chunk_tokens`` (prompt tokens read per
    step, default 512), ``max_sequences`` (requests one worker may hold at once,
    default 64), ``prefix_cache_tokens`` (KV cells the prefix cache may keep of
    finished requests, default half of the KV cells, 0 turns it off; see
    ``llama_cpp.prefix_cache``), ``max_loras`` (LoRA GGUF adapters held, default 8;
    ``llama_cpp.lora``), ``mmproj`` (a multimodal projector GGUF: the model reads
    images, ``llama_cpp.vision``), ``use_mmap`` (default true), and the placement ones
    (:func:`placement`): ``n_gpu_layers``, ``main_gpu``, ``split_mode``,
    ``tensor_split``, and ``embedding`` (true: an embedding model, see
    ``llama_cpp.embedding``; default: what the GGUF's architecture says)::

        handler = load("/models/qwen2.5-0.5b-instruct-q4_k_m.gguf", threads=4)
        handler = load("/models/llama", device="cuda:0", n_gpu_layers=-1)
    """
    settings = parse_options(options)
    path = gguf_path(model, options.get("gguf_file"))
    llama = import_llama_cpp()
    layout = placement(device, options, gpu_offload=bool(llama.llama_supports_gpu_offload()))
    embedding = options.get("embedding")
    if embedding is not None and not isinstance(embedding, bool):
        raise ValueError(f"embedding must be true or false, got {embedding!r}")
    if embedding or (embedding is None and is_embedding_model(read_metadata(path))):
        if settings.mmproj is not None:
            raise ValueError("mmproj: an embedding model reads no images")
        return load_embedding(
            path, settings.threads, settings.max_model_len, layout.n_gpu_layers, settings.use_mmap
        )
    probe_once(path, layout)
    started = time.monotonic()
    if settings.mmproj is not None:
        # The image path uses the sequence a finished request leaves free (llama_cpp.vision).
        if settings.prefix_cache_tokens:
            logger.info("a model with an mmproj keeps no prefix cache: prefix_cache_tokens unused")
        settings = replace(settings, prefix_cache_tokens=0)
    runtime = Runtime.open(llama, path, layout, settings)
    handler = _handler(runtime, settings, gpu=layout.n_gpu_layers != 0)
    handler.warm_up()
    logger.info(
        "loaded %s with llama.cpp (%d threads, %s GPU layers, context %d tokens, %d KV cells) "
        "in %.2f s",
        path.name,
        settings.threads,
        "all" if layout.n_gpu_layers == ALL_LAYERS else layout.n_gpu_layers,
        handler.max_model_len,
        runtime.kv_cells,
        time.monotonic() - started,
    )
    return handler


def _handler(runtime: Runtime, settings: Options, *, gpu: bool) -> LlamaCppHandler:
    """The text handler, or with ``mmproj`` the one that also reads images."""
    if settings.mmproj is None:
        return LlamaCppHandler(runtime, settings)
    mmproj = Path(settings.mmproj).expanduser()
    projector = Projector.open(runtime, mmproj, threads=settings.threads, use_gpu=gpu)
    return LlamaCppHandler(runtime, settings, projector)


def load_generation(model: str, device: str = "cpu", **options: Any) -> LlamaCppHandler:
    """:func:`load` for a generation model (``embedding`` false, whatever the GGUF says)."""
    handler = load(model, device, **{**options, "embedding": False})
    assert isinstance(handler, LlamaCppHandler)
    return handler


def _prefix_cache_tokens(runtime: Runtime, settings: Options) -> int:
    """The prefix cache's bound in cells: the option, else half of the KV cells; 0 (off)
    for models whose prefix cells do not hold their prefix's whole state."""
    if not runtime.prefix_cacheable():
        return 0
    if settings.prefix_cache_tokens is None:
        return runtime.kv_cells // 2
    return min(settings.prefix_cache_tokens, runtime.kv_cells)


class LlamaCppHandler(ScheduledHandler):
    """A loaded GGUF model; made by :func:`load`. Both backend forms, one scheduler."""

    def __init__(
        self, runtime: Runtime, settings: Options, projector: Projector | None = None
    ) -> None:
        self.runtime = runtime
        # With a projector, images too (llama_cpp.vision), one request at a time.
        self.images = None if projector is None else ImageGeneration(runtime, projector)
        self.batched = projector is None
        self.max_model_len: int = runtime.max_model_len
        self.chat_template = settings.chat_template or runtime.metadata("tokenizer.chat_template")
        self.runner = LlamaRunner(
            runtime,
            self,
            kv_cells=runtime.kv_cells,
            max_sequences=runtime.max_sequences,
            prefix_cache_tokens=_prefix_cache_tokens(runtime, settings),
            cell_bytes=runtime.cell_bytes(),
            loras=GgufLoras(runtime, settings.max_loras),
        )
        self.scheduler: Scheduler[LlamaRow] = Scheduler(
            self.runner, runtime.kv_cells, settings.prefill_chunk_tokens
        )
        self.scheduler.thinking_models = ThinkingModels(
            self.chat_template,
            [marker for marker in MARKERS if len(runtime.tokenize(marker, add_special=False)) == 1],
            lambda text: runtime.tokenize(text, add_special=False),
        )
        llama = runtime.llama
        self._bos = int(llama.llama_vocab_bos(runtime.vocab))
        self._eos = int(llama.llama_vocab_eos(runtime.vocab))
        self._render: Any = None
        self._grammars: LlamaGrammars | None = None
        # What a chat's content may not write as special tokens (common.chat_text).
        self.specials = Specials.of(runtime.control_tokens())
        self.chat_as_text = self.chat_template is None or splices_exactly(
            lambda messages: self.render_chat(messages),
            lambda text: runtime.tokenize(text, add_special=False),
            self._text_ids,
            self.specials,
        )
        if not self.chat_as_text:
            logger.warning(
                "this vocabulary reads text otherwise in pieces than whole: special tokens in "
                "chat content are read as special tokens "
                "(see modelpool.worker.backends.common.chat_text)"
            )

    def grammars(self) -> LlamaGrammars:
        """The grammar engine, made on the first constrained request."""
        if self._grammars is None:
            self._grammars = LlamaGrammars(self.runtime)
        return self._grammars

    # ---- one-call form -----------------------------------------------------------------------

    def generate(self, call: Call) -> Generation:
        if self.images is not None and image_locations(call.prompt):
            return self.images.generate(self, call)
        validate(call.params)
        return run_alone(self.scheduler, call)

    def validate(self, params: Mapping[str, Any]) -> None:
        validate(params)

    def warm_up(self) -> None:
        """One token, so that the first request does not pay llama.cpp's first graph."""
        self.generate(WarmUpCall())

    # ---- batched form (admit, step, retire, abort, room: ScheduledHandler) ------------------

    def prefix_cache_report(self) -> PrefixCacheReport | None:
        """The prefix cache's size, counters and fingerprints (None: it is off)."""
        return self.runner.prefix_cache_report()

    def attach_prefix_tiers(
        self, specs: Sequence[TierSpec], model: str, options: Mapping[str, Any]
    ) -> None:
        """Write the prefix cache's sequences to the tiers of ``specs`` and restore from
        them on a miss (``llama_cpp.prefix_tier``); nothing while the prefix cache is off.
        A tier that cannot be opened is logged and left off: it only saves work."""
        if self.runner.prefix_cache is None or not specs:
            return
        layout = f"unified-f16:{self.runtime.cell_bytes()}"
        try:
            self.runner.tiers = LlamaPrefixTiers.open(specs, model, dict(options), layout)
        except OSError:
            logger.warning("the prefix cache tiers could not be opened", exc_info=True)

    # ---- what the runner asks --------------------------------------------------------------

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int:
        """This request's ``max_new_tokens``, fitted to the context as on hf."""
        return fit_new_tokens(call, params, prompt_tokens, self.max_model_len)

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """The token ids a generation of ``prompt`` feeds the model (``/tokenize``)."""
        return self.encode(prompt, add_generation_prompt=add_generation_prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (``/detokenize``)."""
        check_vocabulary(token_ids, self.runtime.n_vocab)
        runtime = self.runtime
        text = b"".join(runtime.piece(token_id) for token_id in token_ids)
        return text.decode("utf-8", errors="replace")

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids; a chat prompt offers ``tools`` (OpenAI's shape) to the
        model as the hf backend does (``modelpool.shared.tools.render_chat``);
        ``template_kwargs``: the request's template variables (``enable_thinking``)."""
        runtime = self.runtime
        if self.images is None:
            refuse_images(prompt, "a llama_cpp model without an mmproj")
        elif image_locations(prompt):
            # generate() sends these to the image path; /tokenize has no ids for an image.
            raise InvalidRequest("a prompt with images has no token ids: its images are embeddings")
        if isinstance(prompt, TokenIds):
            check_vocabulary(prompt.ids, self.runtime.n_vocab)
            ids = list(prompt.ids)
        elif isinstance(prompt, str):
            ids = runtime.tokenize(prompt, add_special=True)
        elif self.chat_as_text:
            # The content's special tokens are text; the template writes its own (BOS
            # included), the only ones read as such.
            chat = EscapedChat.of(prompt, tools, self.specials)
            text = self.render_chat(
                chat.messages, chat.tools, add_generation_prompt, template_kwargs
            )
            ids = chat.token_ids(text, self._text_ids)
        else:
            text = self.render_chat(prompt, tools, add_generation_prompt, template_kwargs)
            ids = runtime.tokenize(text, add_special=False)
        if not ids:
            if self._bos < 0:
                raise InvalidRequest("the prompt is empty and the model has no BOS token")
            ids = [self._bos]
        return ids

    def _text_ids(self, text: str) -> list[int]:
        """``text``'s ids with no special token read (a chat's content, between the
        template's markers)."""
        return self.runtime.tokenize(text, add_special=False, parse_special=False)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise InvalidRequest(
                "this GGUF has no chat template: send a string prompt, or give the "
                "llama_cpp backend a chat_template option"
            )
        if tools or any(len(message) > 2 for message in messages):
            # Tool definitions, calls and results: the one renderer both backends share.
            return render_chat(self, messages, tools, add_generation_prompt, template_kwargs)
        return self.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tokenize: bool,
        **template_variables: Any,
    ) -> str:
        """The GGUF's chat template rendered as a transformers tokenizer's
        ``apply_chat_template(..., tokenize=False)`` renders it (what
        ``modelpool.shared.tools.render_chat`` calls, ``tools=`` included)."""
        if tokenize or self.chat_template is None:
            raise ValueError("apply_chat_template here renders text from the chat template")
        if self._render is None:
            self._render = _compile_template(self.chat_template)
        text: str = self._render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.runtime.special_text(self._bos),
            eos_token=self.runtime.special_text(self._eos),
            **template_variables,
        )
        return text


def _compile_template(template: str) -> Any:
    """A chat template rendered as transformers renders one (a sandboxed Jinja
    environment with the same whitespace rules and helpers)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return environment.from_string(template).render
