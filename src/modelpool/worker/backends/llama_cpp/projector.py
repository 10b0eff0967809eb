"""A GGUF's multimodal projector (``backend_options.mmproj``) through llama.cpp's mtmd
library: the image encoder that turns a bitmap into embeddings the text model reads at
the image's place in the prompt.

:class:`Projector` holds the mtmd context made from the projector file and the text
model; :meth:`Projector.prefill` tokenizes a rendered prompt whose images are written as
this projector's media marker, encodes each image, and evaluates text and image chunks
into one llama.cpp sequence (``mtmd_helper_eval_chunks``), leaving the last position's
logits for the first sampled token.
"""

from __future__ import annotations

import ctypes
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelpool.shared.errors import InvalidRequest
from modelpool.worker.backends.llama_cpp.options import BackendUnavailable

if TYPE_CHECKING:
    from modelpool.worker.backends.llama_cpp.runtime import Runtime
    from modelpool.worker.images import DecodedImage

logger = logging.getLogger(__name__)

_GGML_WARN_AND_ERROR = (3, 4)  # ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_LOG_CALLBACK: Any = None  # kept alive: llama.cpp holds the pointer


@dataclass(frozen=True)
class Prefilled:
    """A prompt evaluated into a sequence: the next free position, and its size in
    positions (text tokens and image embeddings together: ``prompt_tokens``)."""

    next_position: int
    prompt_tokens: int


class Projector:
    """An mtmd context: the projector file read onto the runtime's text model."""

    def __init__(self, mtmd: Any, context: Any, marker: str, path: Path) -> None:
        self._mtmd = mtmd
        self._context = context
        self.marker = marker
        self.path = path

    @classmethod
    def open(cls, runtime: Runtime, path: Path, *, threads: int, use_gpu: bool) -> Projector:
        """Read ``path``; a missing file or one mtmd cannot load is a
        :class:`BackendUnavailable` naming it (the pool's ``ModelLoadFailed``)."""
        if not path.is_file():
            raise BackendUnavailable(f"mmproj {str(path)!r}: no such file")
        try:
            from llama_cpp import mtmd_cpp
        except ImportError as exc:
            raise BackendUnavailable(
                f"this llama-cpp-python has no multimodal library (mtmd): {exc}"
            ) from None
        _quiet_mtmd_logs(mtmd_cpp)
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = threads
        params.print_timings = False
        # A marker no client can guess: a prompt's own text never becomes an image slot.
        marker = f"<__modelpool_image_{secrets.token_hex(8)}__>"
        # mtmd copies the marker at init; marker_bytes outlives the call.
        marker_bytes = marker.encode()
        params.media_marker = marker_bytes
        context = mtmd_cpp.mtmd_init_from_file(str(path).encode(), runtime.model, params)
        if not context:
            raise BackendUnavailable(
                f"llama.cpp could not load the mmproj {str(path)!r} (not a multimodal "
                "projector GGUF, a damaged file, or a projector for a text model of another "
                "embedding size; its log says more)"
            )
        if not mtmd_cpp.mtmd_support_vision(context):
            mtmd_cpp.mtmd_free(context)
            raise BackendUnavailable(f"the mmproj {str(path)!r} has no vision encoder")
        return cls(mtmd_cpp, context, marker, path)

    def prefill(
        self, runtime: Runtime, text: str, images: list[DecodedImage], seq_id: int
    ) -> Prefilled:
        """Evaluate ``text`` (its images written as :attr:`marker`, in order) into
        ``seq_id`` from position 0; the last position's logits are left for sampling."""
        mtmd = self._mtmd
        bitmaps = [_bitmap(mtmd, image) for image in images]
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            encoded = text.encode("utf-8")
            prompt = mtmd.mtmd_input_text()
            prompt.text = encoded
            prompt.text_len = len(encoded)
            # The template writes the model's special tokens (and its BOS) as text.
            prompt.add_special = False
            prompt.parse_special = True
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            code = int(
                mtmd.mtmd_tokenize(self._context, chunks, ctypes.byref(prompt), array, len(bitmaps))
            )
            if code != 0:
                raise InvalidRequest(
                    f"llama.cpp's multimodal tokenizer refused the prompt (code {code}: "
                    "1 is images and their places not matching, 2 an image it cannot "
                    "preprocess)"
                )
            prompt_tokens = int(mtmd.mtmd_helper_get_n_pos(chunks))
            next_position = llama_pos(runtime)
            code = int(
                mtmd.mtmd_helper_eval_chunks(
                    self._context,
                    runtime.context,
                    chunks,
                    0,
                    seq_id,
                    runtime.batch_capacity,
                    True,
                    ctypes.byref(next_position),
                )
            )
            if code != 0:
                raise RuntimeError(f"mtmd_helper_eval_chunks returned {code}")
            return Prefilled(int(next_position.value), prompt_tokens)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)


def llama_pos(runtime: Runtime) -> Any:
    """A ``llama_pos`` out-parameter."""
    holder: Any = runtime.llama.llama_pos(0)
    return holder


def _bitmap(mtmd: Any, image: DecodedImage) -> Any:
    """The decoded image as an mtmd bitmap (RGB, 3 bytes a pixel, row after row)."""
    width, height = image.image.size
    pixels = image.image.tobytes()
    buffer = (ctypes.c_uint8 * len(pixels)).from_buffer_copy(pixels)
    bitmap = mtmd.mtmd_bitmap_init(width, height, buffer)
    if not bitmap:
        raise RuntimeError(f"mtmd_bitmap_init failed for a {width}x{height} image")
    return bitmap


def _quiet_mtmd_logs(mtmd: Any) -> None:
    """mtmd logs every chunk it reads at INFO on stderr; keep its warnings and errors,
    through this module's logger."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return
    import llama_cpp

    def forward(level: int, text: bytes, _: Any) -> None:
        if level in _GGML_WARN_AND_ERROR and text:
            logger.warning("mtmd: %s", text.decode("utf-8", errors="replace").rstrip())

    _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
    mtmd.mtmd_log_set(_LOG_CALLBACK, None)
    mtmd.mtmd_helper_log_set(_LOG_CALLBACK, None)
