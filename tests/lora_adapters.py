"""Tiny LoRA adapters made with PEFT on the tiny random model, and PEFT's own answers with
them: the reference the pool's adapters are compared with (tests/integration/test_lora.py,
tests/e2e/test_lora_api.py, benchmarks/lora.py)."""

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
