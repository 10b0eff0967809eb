"""Tiny LoRA adapters made with PEFT on the tiny random model, and PEFT's own answers with
them: the reference the pool's adapters are compared with (tests/integration/test_lora.py,
tests/e2e/test_lora_api.py, benchmarks/lora.py); and LoRA GGUFs for the llama_cpp backend
(tests/integration/test_llama_cpp_lora.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def make_adapter(
    base: Path,
    folder: Path,
    *,
    seed: int,
    rank: int = 4,
    alpha: int = 16,
    targets: Sequence[str] = TARGETS,
) -> Path:
    """A PEFT LoRA adapter of ``base`` in ``folder`` with random, non-zero A and B (PEFT
    starts B at zero, which would leave the model's output as it is)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (folder / "adapter_model.safetensors").exists():
        return folder
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False
    )
    peft_model: Any = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.5)
    peft_model.save_pretrained(str(folder))
    return folder


def peft_answers(
    base: Path, adapter: Path | None, prompts: Sequence[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy continuation (token ids, up to an end token) by PEFT's
    ``generate`` with ``adapter`` active (None: the base alone), one prompt at a time."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    answers = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            answers.append([int(token) for token in output[0, len(ids) :]])
    return answers


def broken_adapter(good: Path, folder: Path, fault: str) -> Path:
    """A copy of the adapter ``good`` with ``fault``: "truncated" (its weights cut in
    half), "corrupt" (a header that is not JSON), "shape" (a lora_A of another base's
    width), "target" (a module the base lacks), "rank" (a config rank other than its
    matrices'), "hang" (its weights a FIFO nobody writes: reading it blocks)."""
    import json
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(good, folder)
    weights = folder / "adapter_model.safetensors"
    if fault == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif fault == "corrupt":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\0" * 64)
    elif fault in ("shape", "target"):
        tensors = load_file(str(weights))
        key = next(key for key in sorted(tensors) if key.endswith("q_proj.lora_A.weight"))
        if fault == "shape":
            rank, width = tensors[key].shape
            tensors[key] = torch.randn(rank, width + 3)
        else:
            b_key = key.replace("lora_A", "lora_B")
            for old in (key, b_key):
                tensors[old.replace("q_proj", "qq_proj")] = tensors.pop(old)
        save_file(tensors, str(weights))
    elif fault == "rank":
        config_file = folder / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["r"] = int(config["r"]) * 2
        config_file.write_text(json.dumps(config))
    elif fault == "hang":
        weights.unlink()
        os.mkfifo(weights)
    else:
        raise ValueError(fault)
    return folder


def make_gguf_adapter(
    base_gguf: Path,
    file: Path,
    *,
    seed: int,
    rank: int = 8,
    targets: Sequence[str] = ("attn_q",),
    wrong_width: bool = False,
) -> Path:
    """A LoRA GGUF of ``base_gguf`` (as llama.cpp's convert_lora_to_gguf.py writes one:
    ``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and
    ``blk.N.T.weight.lora_a`` [rank x in] / ``.lora_b`` [out x rank] in numpy's order)
    with random, non-zero A and B on every layer's ``targets``; ``wrong_width``: A one
    column wider than the base's input (an adapter of another base)."""
    import gguf
    import numpy as np

    from modelpool.shared.lora_gguf import read_gguf_header

    metadata, tensors, _ = read_gguf_header(base_gguf)  # gguf.GGUFReader takes seconds
    arch = str(metadata["general.architecture"])
    shapes = {name: dims for name, (dims, _, _) in tensors.items()}
    rng = np.random.default_rng(seed)
    file.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(file), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for name, shape in sorted(shapes.items()):
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if not name.startswith("blk.") or module not in targets or len(shape) != 2:
            continue
        n_in, n_out = shape  # ggml's order: the input width first
        a = rng.normal(0.0, 0.2, (rank, n_in + wrong_width)).astype(np.float32)
        b = rng.normal(0.0, 0.2, (n_out, rank)).astype(np.float32)
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file
