"""Images in a chat message: the one form every API's parser produces, and their limits.

A chat message's ``content`` is either a string or a list of parts, each a plain dict::

    {"type": "text", "text": "What is in this picture?"}
    {"type": "image", "data": b"\\x89PNG...", "media_type": "image/png"}

``data`` is the image file as its client sent it (base64 already decoded), never a
decoded bitmap: decoding untrusted bytes happens in the worker, after the limits below,
never on the daemon's event loop or the supervisor's thread. The API parsers (chat
``image_url`` data URLs, Anthropic ``image`` blocks, Responses ``input_image``, Ollama
``images``) each turn their own shape into this one.

The limits are checked in two places: what needs no decoding (encoded bytes, images per
request) when the request is taken, and what the file declares (pixels, frames) in the
worker, from the header, before a single pixel is decoded.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

ImageMediaType = Literal["image/png", "image/jpeg", "image/webp", "image/gif"]
IMAGE_MEDIA_TYPES: Final[tuple[ImageMediaType, ...]] = (
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
)


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be; ``PoolConfig`` carries one for every model.

    Defaults sit near the peers' (vLLM, Ollama): a phone photo or a 4K screenshot passes,
    a decompression bomb (a small file declaring a huge canvas) does not.
    """

    max_bytes: int = 20 * 1024 * 1024
    """Encoded bytes of one image, as sent (after base64)."""
    max_pixels: int = 40_000_000
    """Width times height that one image's header declares."""
    max_frames: int = 1
    """Frames of an animated image (GIF, WebP, APNG) that are read; more is refused."""
    max_images: int = 16
    """Images in one request, over all of its messages."""


def image_parts(content: object) -> list[Mapping[str, Any]]:
    """The image parts of one message's content, in order (none for a string)."""
    if not isinstance(content, Sequence) or isinstance(content, (str, bytes)):
        return []
    return [part for part in content if isinstance(part, Mapping) and part.get("type") == "image"]


def count_images(messages: object) -> int:
    """How many image parts a prompt carries (0 for a string or token ids)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return 0
    return sum(
        len(image_parts(message.get("content")))
        for message in messages
        if isinstance(message, Mapping)
    )


def image_bytes(messages: object) -> int:
    """The encoded bytes of a prompt's images (0 for a string or token ids)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return 0
    return sum(
        len(part.get("data") or b"")
        for message in messages
        if isinstance(message, Mapping)
        for part in image_parts(message.get("content"))
    )


SUBMIT_OFF_LOOP_BYTES: Final = 1 << 20
"""A prompt with more image bytes than this is pickled for its worker off the caller's
event loop (``ModelPool.agenerate``): one copy of 15 MB held the loop ~35 ms on a loaded
machine."""


IMAGE_TOKEN_ESTIMATE: Final = 1024
"""What one image is counted as, in tokens, wherever the pool sizes a prompt before a
worker has read it (the daemon's ``max_request_tokens`` budget, admission's predicted
prefill): about what the common vision towers make of a photo (LLaVA 576, Gemma 3 256,
Qwen2-VL ~1,000 at 1 MP). The worker counts the real tokens in ``usage``."""


def model_reads_images(backend: str, model: str, backend_options: Mapping[str, Any]) -> bool:
    """Whether a pool of this backend and model reads images: the testing backend when
    ``backend_options["vision"]`` is true, llama_cpp with an ``mmproj`` file, hf when the
    directory's ``config.json`` names an image-text-to-text model (transformers'
    ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``). ``auto`` is either of the last two,
    whichever the model turns out to be; a custom backend is taken to read none."""
    if backend == "testing":
        return bool(backend_options.get("vision"))
    if backend in ("llama_cpp", "auto") and backend_options.get("mmproj"):
        return True
    if backend in ("hf", "auto"):
        return vision_model_type(model) is not None
    return False


@functools.lru_cache(maxsize=64)
def vision_model_type(model: str) -> str | None:
    """The ``model_type`` of a local directory's ``config.json`` when it is an
    image-text-to-text model's (transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``),
    else None (a hub id, a text model, no config). The one rule the daemon, the supervisor
    and the hf worker share, so that all three agree on what a directory is."""
    config_path = Path(os.path.expanduser(model)) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return None
    return model_type if model_type in _image_text_to_text_types() else None


@functools.lru_cache(maxsize=1)
def _image_text_to_text_types() -> frozenset[str]:
    """transformers' image-text-to-text model types. Read from its module's source where
    transformers is not imported yet: importing that module imports torch (~250 MB and five
    seconds here), and the daemon and the supervisor otherwise never load either; the
    table is a literal, so its source says exactly what the import would."""
    if "transformers" not in sys.modules:
        from_source = _types_from_source()
        if from_source:
            return from_source
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return frozenset(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _types_from_source() -> frozenset[str] | None:
    """The table's keys from ``transformers/models/auto/modeling_auto.py``'s text (found
    without importing the package), or None where it is not the literal expected."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(target, ast.Name)
                and target.id == "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
                for target in node.targets
            )
            and isinstance(node.value, ast.Call)
            and node.value.args
        ):
            try:
                pairs = ast.literal_eval(node.value.args[0])
            except ValueError:
                return None
            return frozenset(name for name, _ in pairs)
    return None
