"""Tiny random reasoning models, built in the tests (as ``modelpool.tinymodel`` builds its
model): the tiny llama with ``<think>`` and ``</think>`` added to its vocabulary (as
Qwen3's and DeepSeek-R1's tokenizers have them: added, not special, so they stay in the
decoded text) and a chat template of each family. Random weights never close their own
thinking: whatever ends it is the worker's bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from modelpool.tinymodel import build_tiny_model

Family = Literal["qwen3", "deepseek_r1"]

# Qwen3's thinking variant (2507): the template opens thinking unless enable_thinking is
# false, when it writes an empty one, closed.
QWEN3_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# DeepSeek-R1's distills: the template always opens thinking.
DEEPSEEK_R1_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|User|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|Assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)
TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "deepseek_r1": DEEPSEEK_R1_TEMPLATE}


def build_thinking_model(path: Path, family: Family) -> Path:
    """Build (once) the tiny reasoning model of ``family`` in ``path``."""
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(path.parent / f"{path.name}-base")
    tokenizer: Any = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATES[family]
    model: Any = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
