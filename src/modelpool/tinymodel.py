"""A tiny random causal language model, built locally in about a second.

No machine that runs the tests can reach a model hub, so the tests (and
anyone trying the pool without downloading anything) use a model built here
from a config, with random weights and a byte-level BPE tokenizer trained in
process. It produces gibberish, but deterministic gibberish: with greedy
decoding the same prompt always gives the same text, and because the
tokenizer works on bytes the model readily emits multi-byte characters (and
bytes that only become a character together with the next token), which is
what streaming has to get right::

    from modelpool.tinymodel import build_tiny_model
    from modelpool.worker.backends.hf import load

    path = build_tiny_model("/tmp/tiny-llama")         # instant the second time
    handler = load(str(path))

Nothing heavy is imported until :func:`build_tiny_model` runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

Arch = Literal["llama", "gpt2"]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer. The non-ASCII lines matter: merges inside
# multi-byte characters give tokens that hold a whole character, half of one,
# or a character plus its neighbour, so generated text splits them every way.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "Le café est très chaud; où est la crème brûlée? Ça va, garçon.",
    "Über die Brücke gehen Mädchen und Jungen schön schnell.",
    "¿Dónde está la estación? Mañana, señor.",
    "東京は日本の首都です。こんにちは、世界。",
    "北京是中国的首都。你好，世界。",  # noqa: RUF001 - the full-width comma is the point
    "서울은 한국의 수도입니다.",
    "Москва — столица России. Привет, мир.",
    "Emoji: 😀 🎉 🚀 ❤️ 👍 🐍 ✨",
    "def generate(prompt):\n    return model(prompt)\n",
)

_CONFIG_FILE = "config.json"
_TOKENIZER_FILE = "tokenizer.json"


def build_tiny_model(
    path: str | Path,
    *,
    arch: Arch = "llama",
    vocab_size: int = 512,
    seed: int = 0,
    context_length: int = 1024,
    chat_template: str = CHAT_TEMPLATE,
    special_tokens: tuple[str, ...] = (),
) -> Path:
    """Build (once) a tiny random model and its tokenizer in ``path`` and return it.

    ``arch`` is ``"llama"`` (a rotary, grouped-query decoder like most current
    models) or ``"gpt2"`` (learned positions, a different tokenizer setup in
    transformers). ``vocab_size`` is the tokenizer's target size and the
    model's embedding size; ``seed`` fixes the weights; ``context_length`` is
    the config's ``max_position_embeddings`` (``n_positions`` for gpt2), which
    the pool reads as the model's context length; ``chat_template`` and
    ``special_tokens`` (added to the vocabulary) give it a model family's chat format
    (its tool-call markers, say). If ``path`` already
    holds a built model it is returned untouched, whatever the arguments.
    """
    target = Path(path)
    if (target / _CONFIG_FILE).is_file() and (target / _TOKENIZER_FILE).is_file():
        return target
    if arch not in ("llama", "gpt2"):
        raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")
    if vocab_size < 300:
        # The byte alphabet (256) and the special tokens must fit with room for merges.
        raise ValueError(f"vocab_size must be at least 300, got {vocab_size}")

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = _build_tokenizer(vocab_size, chat_template, special_tokens)
        _build_model(arch, tokenizer, seed, context_length).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # A concurrent build (or an empty directory the caller made) is in
            # the way; a finished build there is as good as ours.
            if not (target / _CONFIG_FILE).is_file():
                shutil.copytree(staging, target, dirs_exist_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built tiny %s model in %s", arch, target)
    return target


def _build_tokenizer(
    vocab_size: int, chat_template: str, special_tokens: tuple[str, ...]
) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.chat_template = chat_template
    return tokenizer


def _build_model(
    arch: Arch, tokenizer: PreTrainedTokenizerFast, seed: int, context_length: int
) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vocab_size = len(tokenizer)
    torch.manual_seed(seed)
    model: Any  # several of transformers' model methods (update, eval) are unannotated
    if arch == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=context_length,
                tie_word_embeddings=False,
                **ids,
            )
        )
    else:
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=vocab_size,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=context_length,
                tie_word_embeddings=False,
                **ids,
            )
        )
    model.generation_config.update(**ids)
    model.eval()
    return model


ThinkingFamily = Literal["qwen3", "deepseek_r1", "gpt_oss"]

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
# gpt-oss's Harmony, cut down: tools in the developer message, calls on the commentary
# channel. gpt-oss itself opens its analysis channel; random weights never would, so this
# template opens it in the prompt (thinking the template opens counts as started).
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: medium<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{% for tool in tools %}type {{ tool.function.name }} = "
    "(_: {{ tool.function.parameters | tojson }}) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ call.function.name }} <|constrain|>json<|message|>"
    "{{ call.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif message.role == 'tool' %}<|start|>functions.{{ message.name }} to=assistant"
    "<|channel|>commentary<|message|>{{ message.content }}<|end|>"
    "{% elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ message.content }}<|end|>"
    "{% else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif %}"
)
HARMONY_SPECIAL_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
)
THINKING_TEMPLATES = {
    "qwen3": QWEN3_TEMPLATE,
    "deepseek_r1": DEEPSEEK_R1_TEMPLATE,
    "gpt_oss": HARMONY_TEMPLATE,
}


def build_thinking_model(
    path: str | Path, family: ThinkingFamily, *, context_length: int = 1024
) -> Path:
    """Build (once) a tiny reasoning model of ``family`` in ``path``: the tiny llama with
    ``<think>`` and ``</think>`` added to its vocabulary (added, not special, as Qwen3's
    and DeepSeek-R1's tokenizers have them, so they stay in the decoded text) and that
    family's chat template; for ``gpt_oss``, Harmony's tokens added as special tokens (as
    gpt-oss has them: decoding drops them unless the worker keeps them). Random weights
    never close their own thinking: whatever ends it is the worker's bound
    (docs/reasoning.md). ``context_length`` as :func:`build_tiny_model`'s."""
    target = Path(path)
    if family == "gpt_oss":
        return build_tiny_model(
            target,
            context_length=context_length,
            chat_template=HARMONY_TEMPLATE,
            special_tokens=HARMONY_SPECIAL_TOKENS,
        )
    if (target / _CONFIG_FILE).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(target.parent / f"{target.name}-base", context_length=context_length)
    tokenizer: Any = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATES[family]
    model: Any = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
