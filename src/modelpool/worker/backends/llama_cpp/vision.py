"""A GGUF served with its multimodal projector (``backend_options.mmproj``): images read
through llama.cpp's mtmd library (:mod:`.projector`).

Such a model's handler runs one request at a time (``batched = False``): text requests
through the shared scheduler alone (as ``generate`` always does), a request with images
through :meth:`ImageGeneration.generate`. The scheduler cannot carry an image:
its rows are token ids, prefilled in slices beside other rows' steps, while an image is
a run of embeddings that the projector encodes and writes into the sequence in one
piece (``mtmd_helper_eval_chunks``). The prefix cache is off on such a model: it is keyed
by token ids, which do not tell one image from another, and the image path uses the
sequence the scheduler left free.

An image request decodes each image in the worker within the pool's limits
(:mod:`modelpool.worker.images`), renders the chat with the model's template with the
projector's marker at each image's place, and counts the image's positions in
``prompt_tokens``. It samples as the text path does (``llama_cpp.sampling``); the
cancel flag is read before every token. Log probabilities, grammars, penalties, tools
and LoRA adapters are refused on an image request (a text request still has them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.protocol import Call, FinishReason, Generation, Prompt, note_prompt
from modelpool.shared.reasoning.controls import THINKING_PARAMS, template_params
from modelpool.shared.tools import template_features, template_messages
from modelpool.shared.validation import FIT_PARAM, PRIORITY_PARAM, PROMOTED_AT_PARAM
from modelpool.worker import images
from modelpool.worker.backends.common.params import fit_new_tokens
from modelpool.worker.backends.common.params import validate as validate_params
from modelpool.worker.backends.common.sampling import Sampling
from modelpool.worker.backends.common.text import TextProgress, stop_strings
from modelpool.worker.backends.llama_cpp.projector import Projector
from modelpool.worker.backends.llama_cpp.runtime import Runtime
from modelpool.worker.backends.llama_cpp.sampling import choose_token

IMAGE_PARAMS = frozenset(
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
        "no_repeat_ngram_size",
        PRIORITY_PARAM,
        PROMOTED_AT_PARAM,
        FIT_PARAM,
        *THINKING_PARAMS,
    }
)
_SEQUENCE = 0  # the image path's sequence: the scheduler holds none between requests


class ChatModel(Protocol):
    """What the image path asks of the llama_cpp handler: its template and context."""

    chat_template: str | None
    max_model_len: int

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tokenize: bool,
        **template_variables: Any,
    ) -> str: ...


class ImageGeneration:
    """The image path of a GGUF served with its projector (see the module docstring)."""

    def __init__(self, runtime: Runtime, projector: Projector) -> None:
        self.runtime = runtime
        self.projector = projector

    def generate(self, model: ChatModel, call: Call) -> Generation:
        """One chat request with image parts, prefilled through the projector."""
        validate_params(call.params, "llama_cpp")
        refused = sorted(set(call.params) - IMAGE_PARAMS)
        if refused:
            raise InvalidRequest(f"{refused[0]!r} is not supported with images on llama_cpp")
        params = dict(call.params)
        stops = stop_strings(params.pop("stop", ()))
        seed = params.pop("seed", None)
        text, decoded = self._chat_text(model, call.prompt, template_params(params))
        runtime = self.runtime
        # Text requests may have left an adapter applied to the context.
        runtime.use_adapter(None)
        try:
            prefilled = self.projector.prefill(runtime, text, decoded, _SEQUENCE)
            return self._sample(
                model, call, params, prefilled.prompt_tokens, prefilled.next_position, stops, seed
            )
        finally:
            runtime.remove_sequence(_SEQUENCE)

    def _chat_text(
        self, model: ChatModel, prompt: Prompt, template_kwargs: Mapping[str, Any]
    ) -> tuple[str, list[images.DecodedImage]]:
        """The chat rendered by the model's template, each image written as the
        projector's marker, and the images decoded in the same order."""
        assert isinstance(prompt, list)  # image_locations found image parts in a chat
        if model.chat_template is None:
            raise InvalidRequest(
                "this GGUF has no chat template: give the llama_cpp backend a chat_template "
                "option to send images"
            )
        decoded = images.decode_prompt_images(prompt)
        marker = self.projector.marker
        messages: list[dict[str, Any]] = []
        # As on hf: what the template cannot render of tool calling goes in as text, a
        # tool result's images kept in its turn.
        for message in template_messages(prompt, template_features(model)):
            content = message.get("content")
            if isinstance(content, list):
                pieces = []
                for part in content:
                    if part.get("type") == "image":
                        pieces.append(marker)
                    elif part.get("type") == "text":
                        pieces.append(str(part.get("text", "")).replace(marker, ""))
                content = "".join(pieces)
            messages.append({**message, "content": content})
        text = model.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        return text, decoded

    def _sample(
        self,
        model: ChatModel,
        call: Call,
        params: dict[str, Any],
        prompt_tokens: int,
        position: int,
        stops: tuple[str, ...],
        seed: object,
    ) -> Generation:
        import numpy as np

        runtime = self.runtime
        max_new_tokens = fit_new_tokens(call, params, prompt_tokens, model.max_model_len)
        sampling = Sampling.from_params(params, runtime.n_vocab, prompt_tokens=prompt_tokens)
        rng = np.random.default_rng(seed if isinstance(seed, int) else None)
        decoder: Any = runtime.decoder()  # the tokenizer face TextProgress decodes with
        progress = TextProgress(decoder, call, prompt_tokens, stops)
        note_prompt(call, prompt_tokens, 0)
        logits = runtime.logits(-1)
        generated: list[int] = []
        finish: FinishReason = "length"
        while len(generated) < max_new_tokens:
            if call.cancelled():
                progress.cancelled = True
                finish = "cancelled"
                break
            # Penalties see the answer's tokens only: an image's positions have no ids.
            token = choose_token(logits, sampling, generated, len(generated), runtime.end_ids, rng)
            if token in runtime.end_id_set and not sampling.ignore_eos:
                finish = "stop"
                break
            generated.append(token)
            stopped = progress.take([token])
            progress.deliver()
            progress.on_token()
            if progress.error is not None:
                raise progress.error
            if stopped:
                finish = "stop"
                break
            if len(generated) == max_new_tokens:
                break
            code = runtime.decode([token], [position], [_SEQUENCE], [True])
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code}")
            position += 1
            logits = runtime.logits(0)
        progress.flush()
        return Generation(
            progress.text,
            finish,
            prompt_tokens,
            len(generated),
            stop_sequence=progress.stop_sequence if progress.stopped else None,
        )
