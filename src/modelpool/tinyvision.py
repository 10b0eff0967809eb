"""A tiny random vision-language model (LLaVA's architecture), built locally in seconds.

The vision tests cannot download a model: this builds one from transformers configs, as
:mod:`modelpool.tinymodel` builds its text model (whose byte-level tokenizer it reuses,
with an ``<image>`` token added): a CLIP vision tower of 2 layers over 32x32 pixels in
8x8 patches, a projector, and the tiny llama. Its processor is a real one (LLaVA's: a
CLIP image processor that resizes and normalises any image to 32x32, and a chat template
that writes one ``<image>`` per image part, which the processor expands to the
:data:`IMAGE_TOKENS` positions the tower's features fill)::

    from modelpool.tinyvision import build_tiny_vision_model

    path = build_tiny_vision_model("/tmp/tiny-llava")    # instant the second time
    # a directory AutoProcessor and AutoModelForImageTextToText load

Its answers are deterministic gibberish that depends on the image's pixels.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from modelpool.tinymodel import _build_tokenizer

IMAGE_TOKEN: Final = "<image>"
IMAGE_SIZE: Final = 32
PATCH_SIZE: Final = 8
IMAGE_TOKENS: Final = (IMAGE_SIZE // PATCH_SIZE) ** 2
"""Prompt tokens one image takes: one per patch (the CLS feature is dropped)."""


@dataclass(frozen=True)
class VisionShape:
    """The sizes of a built vision model (its weights are random whatever the size)."""

    image_size: int
    patch_size: int
    vision_width: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    text_width: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int

    @property
    def image_tokens(self) -> int:
        """Prompt tokens one image takes: one per patch (the CLS feature is dropped)."""
        return (self.image_size // self.patch_size) ** 2


TINY: Final = VisionShape(IMAGE_SIZE, PATCH_SIZE, 32, 64, 2, 4, 64, 128, 2, 4, 2)
"""The tests' model: built in seconds, a forward pass in milliseconds."""
REALISTIC: Final = VisionShape(224, 16, 768, 3072, 12, 12, 576, 1536, 30, 9, 3)
"""A CLIP ViT-B/16 tower (224 px, 196 image tokens, ~86M parameters) before a language
model of SmolLM2-135M's shape (its vocabulary the tiny tokenizer's): what a small real
vision model costs per request, for benchmarks (``benchmarks.images_ttft --size
realistic``)."""

# The parts of a message in order: text as it is, each image as the token the processor
# expands. A string content is written whole, as text-only templates do.
VISION_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_vision_model(
    path: str | Path,
    *,
    seed: int = 0,
    context_length: int = 1024,
    shape: VisionShape | None = None,
) -> Path:
    """Build (once) the tiny vision model and its processor in ``path`` and return it;
    ``seed`` fixes the weights, ``context_length`` is the language model's, ``shape`` its
    sizes (:data:`TINY`, the default, or :data:`REALISTIC`). If ``path`` already holds a
    built model it is returned untouched."""
    target = Path(path)
    if (target / "config.json").is_file() and (target / "processor_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model, processor = _build(seed, context_length, shape or TINY)
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            # A concurrent build is in the way; a finished one is as good as ours.
            if not (target / "config.json").is_file():
                shutil.copytree(staging, target, dirs_exist_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(seed: int, context_length: int, shape: VisionShape) -> tuple[Any, Any]:
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _build_tokenizer(512, VISION_CHAT_TEMPLATE, (IMAGE_TOKEN,))
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert isinstance(image_token, int)
    vision = CLIPVisionConfig(
        hidden_size=shape.vision_width,
        intermediate_size=shape.vision_intermediate,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.image_size,
        patch_size=shape.patch_size,
        projection_dim=shape.vision_width,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.text_width,
        intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers,
        num_attention_heads=shape.text_heads,
        num_key_value_heads=shape.text_kv_heads,
        max_position_embeddings=context_length,
        tie_word_embeddings=False,
        **ids,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=shape.image_tokens,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model: Any = LlavaForConditionalGeneration(config)
    model.generation_config.update(**ids)
    model.eval()
    processor = LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=_image_processor(shape.image_size),
        tokenizer=tokenizer,
        chat_template=VISION_CHAT_TEMPLATE,
        patch_size=shape.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return model, processor


def _image_processor(image_size: int) -> Any:
    """CLIP's image processor: its Pillow form where transformers has one (the default
    form wants torchvision, which the hf backend does not need)."""
    import transformers

    kind = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return kind(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
