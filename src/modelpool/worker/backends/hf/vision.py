"""Vision models on the hf backend: a directory whose config is an image-text-to-text model.

A model whose ``config.json`` ``model_type`` is one of transformers'
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` (LLaVA, Idefics3/SmolVLM, Qwen2-VL,
Gemma 3, Mistral 3, ...) is loaded with ``AutoModelForImageTextToText`` and its
``AutoProcessor``. A request's image parts (:mod:`modelpool.shared.images`) are decoded in
the worker within the pool's limits (:mod:`modelpool.worker.images`) and handed to the
processor's own chat template as ``{"type": "image", "image": <PIL image>}`` parts, so the
template places them where the model was trained to see them; the processor expands each
into its image tokens, which count in ``prompt_tokens`` (and so in ``usage`` and in the
context check).

It runs one request at a time (one-call, ``generate()``), never in the batched loop: that
loop's rows are token ids prefilled through the language model alone, in chunks, over a
shared KV cache, while a vision model's prefill must run its vision tower and splice the
features in at the image tokens, per model family. For the same reason it keeps no prefix
cache: a cache keyed by token ids would give one image's KV to another image behind the
same image tokens. Streaming, stop strings, cancellation (between decoder layers of the
prefill, and every step) are the one-call text form's (:mod:`.generation`).

Tools and grammars are the text model's too, so that an agent's session (Claude Code
always sends tools) can use a vision model: the tools are rendered by the processor's
template when it renders them, else offered in the system message as text
(:data:`~modelpool.shared.tools.GENERIC_PREAMBLE`, the system turn's other parts kept);
the request's grammar (a tool call's syntax, a ``response_format``) masks each step's
logits through a logits processor given to the model's ``generate()``, and the supervisor
reads the calls out of the text as for any model. Log probabilities, penalties and
adapters are refused on such a model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from modelpool.shared.context import check_max_model_len, context_length
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.grammar import COMPILE_TIMEOUT_PARAM, GRAMMAR_PARAM
from modelpool.shared.prefixes import CACHE_SALT_PARAM
from modelpool.shared.protocol import Call, Generation, Prompt, TokenIds, note_prompt
from modelpool.shared.reasoning.controls import THINKING_PARAMS, template_params
from modelpool.shared.tools import generic_preamble, template_features, template_messages
from modelpool.shared.validation import FIT_PARAM, PRIORITY_PARAM, PROMOTED_AT_PARAM
from modelpool.worker import images
from modelpool.worker.backends.common.params import (
    check_load_options,
    check_vocabulary,
    fit_new_tokens,
)
from modelpool.worker.backends.common.params import validate as validate_params
from modelpool.worker.backends.common.text import TextProgress, stop_strings
from modelpool.worker.backends.hf.generation import (
    PrefillCancelled,
    _generation_kwargs,
    _grammar_processor,
    _hooks,
    cancellable,
    finish_reason_of,
)
from modelpool.worker.backends.hf.grammars import LLGuidanceGrammars
from modelpool.worker.backends.hf.options import (
    LOAD_OPTIONS,
    thread_count,
    torch_device,
    torch_dtype,
    trust_remote_code,
    use_torch_threads,
)

logger = logging.getLogger(__name__)

# What the one-call text form honours that a vision model's generate() does too.
VISION_PARAMS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "repetition_penalty",
        PRIORITY_PARAM,
        PROMOTED_AT_PARAM,
        FIT_PARAM,
        "tools",
        GRAMMAR_PARAM,
        COMPILE_TIMEOUT_PARAM,
        # A prefix cache's partition (the Anthropic API sets it): no prefix cache here.
        CACHE_SALT_PARAM,
        *THINKING_PARAMS,
    }
)
# Load options that shape the batched loop, its prefix cache or adapters: none applies.
_BATCH_ONLY_OPTIONS = ("kv_cache_tokens", "prefill_chunk_tokens", "prefix_cache_bytes", "max_loras")


def load_vision(model: str, device: str = "cpu", **options: Any) -> VisionHandler:
    """Load a vision model and its processor (the hf backend's options, those of the
    batched loop ignored: see the module docstring)."""
    check_load_options(options, LOAD_OPTIONS, "hf")
    if options.get("gguf_file") is not None:
        raise ValueError("gguf_file: a vision model is served from its transformers directory")
    ignored = [name for name in _BATCH_ONLY_OPTIONS if name in options]
    if ignored:
        logger.info("a vision model runs one request at a time: %s not used", ", ".join(ignored))
    started = time.monotonic()
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    use_torch_threads(thread_count(options.get("torch_threads")))
    trusted = trust_remote_code(options)
    model_kwargs: dict[str, Any] = {"trust_remote_code": trusted}
    dtype = options.get("dtype")
    if dtype is not None:
        model_kwargs["dtype"] = torch_dtype(str(dtype))
    if options.get("device_map") is not None:
        model_kwargs["device_map"] = options["device_map"]
    processor: Any = AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
        model, trust_remote_code=trusted
    )
    if options.get("chat_template") is not None:
        processor.chat_template = str(options["chat_template"])
    vision_model: Any = AutoModelForImageTextToText.from_pretrained(model, **model_kwargs)
    if "device_map" not in model_kwargs:
        vision_model.to(torch_device(device))
    vision_model.eval()
    handler = VisionHandler(
        vision_model, processor, check_max_model_len(options.get("max_model_len"))
    )
    logger.info(
        "loaded vision model %s on %s (%s, %d torch threads, context %s tokens) in %.2f s",
        model,
        vision_model.device,
        vision_model.dtype,
        torch.get_num_threads(),
        handler.max_model_len,
        time.monotonic() - started,
    )
    return handler


class VisionHandler:
    """A loaded vision model and its processor; one request at a time (``generate``)."""

    def __init__(self, model: Any, processor: Any, max_model_len: int | None = None) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer: Any = processor.tokenizer
        self.max_model_len = context_length(model.config, max_model_len)
        if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else list(eos or ())) | frozenset(
            [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        )
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.grammars = LLGuidanceGrammars(self.tokenizer, self.vocab_size, self.eos_ids)

    def validate(self, params: Mapping[str, Any]) -> None:
        validate_params(params, "hf")
        refused = sorted(set(params) - VISION_PARAMS)
        if refused:
            raise InvalidRequest(f"{refused[0]!r} is not supported for a vision model")

    def encode(
        self,
        prompt: Prompt,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Any:
        """The processor's inputs for ``prompt`` with ``tools`` offered (input ids,
        attention mask, and the images' pixel values and whatever else the family needs),
        on the model's device."""
        if isinstance(prompt, TokenIds):
            raise InvalidRequest("a vision model takes a string or chat messages, not token ids")
        if isinstance(prompt, str):
            return self.tokenizer(prompt, return_tensors="pt").to(self.model.device)
        decoded = iter(images.decode_prompt_images(prompt))
        # Tool calls and results the template cannot render go in as text, a result's
        # images kept as parts in its turn (the order they were decoded in is kept).
        features = template_features(self.processor)
        rendered = template_messages(prompt, features)
        messages = [
            {**message, "content": _parts(message["content"], decoded)} for message in rendered
        ]
        kwargs = dict(template_kwargs or {})
        if tools and features.tools:
            kwargs["tools"] = tools
        elif tools:
            _offer_in_system(messages, generic_preamble(tools))
        inputs = self.processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            **kwargs,
        )
        return inputs.to(self.model.device, dtype=self.model.dtype)

    def generate(self, call: Call) -> Generation:
        """One request through ``generate()``, streamed and cancellable."""
        import torch

        self.validate(call.params)
        params = dict(call.params)
        stops = stop_strings(params.pop("stop", ()))
        seed = params.pop("seed", None)
        ignore_eos = params.pop("ignore_eos", False)
        tools = params.pop("tools", None)
        grammar_text = params.pop(GRAMMAR_PARAM, None)
        for name in (PRIORITY_PARAM, PROMOTED_AT_PARAM, COMPILE_TIMEOUT_PARAM, CACHE_SALT_PARAM):
            params.pop(name, None)
        template_kwargs = template_params(params)
        for name in THINKING_PARAMS:
            params.pop(name, None)
        if ignore_eos:
            params["eos_token_id"] = None
        inputs = self.encode(call.prompt, template_kwargs, tools)
        prompt_tokens = int(inputs["input_ids"].shape[1])
        params["max_new_tokens"] = fit_new_tokens(call, params, prompt_tokens, self.max_model_len)
        params.pop(FIT_PARAM, None)
        if params["max_new_tokens"] == 0:
            return Generation("", "length", prompt_tokens, 0)
        processors: list[Any] = []
        if grammar_text is not None:
            # Compiled on a thread of its own within its bound, the cancel flag read meanwhile.
            compiled = self.grammars.start(call.params).wait(call.cancelled)
            if compiled is None:
                return Generation("", "cancelled", prompt_tokens, 0)
            processors.append(_grammar_processor(self.grammars, self.grammars.row(compiled)))
        progress = TextProgress(self.tokenizer, call, prompt_tokens, stops)
        note_prompt(call, prompt_tokens, 0)
        if seed is not None:
            torch.manual_seed(seed)
        try:
            with torch.inference_mode(), cancellable(self.model, call.cancelled):
                sequences = self.model.generate(
                    **inputs, **_generation_kwargs(params), **_hooks(progress, processors)
                )
        except PrefillCancelled:
            return Generation(progress.text, "cancelled", prompt_tokens, len(progress.token_ids))
        progress.flush()
        if progress.error is not None:
            raise progress.error
        finish_reason = finish_reason_of(progress, int(sequences[0, -1]), self.eos_ids, ignore_eos)
        return Generation(
            progress.text,
            finish_reason,
            prompt_tokens,
            len(progress.token_ids),
            stop_sequence=progress.stop_sequence if finish_reason == "stop" else None,
        )

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """The token ids a generation of ``prompt`` feeds the model, image tokens included."""
        ids: list[int] = self.encode(prompt)["input_ids"][0].tolist()
        return ids

    def detokenize(self, token_ids: list[int]) -> str:
        check_vocabulary(token_ids, self.vocab_size)
        text: str = self.tokenizer.decode(token_ids, clean_up_tokenization_spaces=False)
        return text


def _offer_in_system(messages: list[dict[str, Any]], preamble: str) -> None:
    """Put ``preamble`` at the end of the system turn's parts (one made first if there is
    none), for a template that does not render tools."""
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": []})
    system = messages[0]["content"]
    separator = "\n\n" if system else ""
    system.append({"type": "text", "text": f"{separator}{preamble}"})


def _parts(content: object, decoded: Any) -> list[dict[str, Any]]:
    """A message's content as the processor's parts: text as it is, each image part as
    the next decoded image (the order :func:`images.decode_prompt_images` read them in)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else ():
        if part.get("type") == "image":
            parts.append({"type": "image", "image": next(decoded).image})
        elif part.get("type") == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
    return parts
