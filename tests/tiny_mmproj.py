"""A tiny LLaVA-style multimodal projector GGUF (a CLIP vision tower and the "mlp"
projector, random weights) for the embedded SmolLM2 GGUF, written with the ``gguf``
package: what llama.cpp's clip loader (tools/mtmd/clip.cpp) reads for
``projector_type = mlp``, small enough to encode an image in milliseconds
(tests/integration/test_llama_cpp_vision.py)."""

from __future__ import annotations

from pathlib import Path

IMAGE_SIZE = 32
PATCH_SIZE = 8
WIDTH = 64
HEADS = 4
BLOCKS = 2
FFN = 128
PROJECTOR_HIDDEN = 128


def make_mmproj(path: Path, *, text_width: int = 576, seed: int = 0) -> Path:
    """Write the projector at ``path`` (once) and return it; ``text_width`` is the text
    model's embedding size, which the projector's output must match."""
    import gguf
    import numpy as np

    if path.exists():
        return path
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        scale = 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", FFN)
    writer.add_uint32("clip.vision.projection_dim", text_width)
    writer.add_uint32("clip.vision.block_count", BLOCKS)
    writer.add_uint32("clip.vision.attention.head_count", HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    tensors: dict[str, np.ndarray] = {
        "v.patch_embd.weight": weight(WIDTH, 3, PATCH_SIZE, PATCH_SIZE),
        "v.class_embd": weight(WIDTH),
        "v.position_embd.weight": weight(n_patches + 1, WIDTH),
        "v.pre_ln.weight": ones(WIDTH),
        "v.pre_ln.bias": zeros(WIDTH),
        "mm.0.weight": weight(PROJECTOR_HIDDEN, WIDTH),
        "mm.0.bias": zeros(PROJECTOR_HIDDEN),
        "mm.2.weight": weight(text_width, PROJECTOR_HIDDEN),
        "mm.2.bias": zeros(text_width),
    }
    for block in range(BLOCKS):
        prefix = f"v.blk.{block}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"{prefix}.{name}.weight"] = weight(WIDTH, WIDTH)
            tensors[f"{prefix}.{name}.bias"] = zeros(WIDTH)
        for name in ("ln1", "ln2"):
            tensors[f"{prefix}.{name}.weight"] = ones(WIDTH)
            tensors[f"{prefix}.{name}.bias"] = zeros(WIDTH)
        tensors[f"{prefix}.ffn_up.weight"] = weight(FFN, WIDTH)
        tensors[f"{prefix}.ffn_up.bias"] = zeros(FFN)
        tensors[f"{prefix}.ffn_down.weight"] = weight(WIDTH, FFN)
        tensors[f"{prefix}.ffn_down.bias"] = zeros(WIDTH)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
