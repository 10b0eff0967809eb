"""Tiny random pooling models for the tests, built locally from configs in about a second:
a sentence-transformers embedding model (a BERT, ``modules.json``, ``1_Pooling``,
``Normalize``) in any pooling mode, and a cross-encoder (a BERT sequence classifier
with one label). Their numbers mean nothing; they are deterministic (seeded), and the
directories are what sentence-transformers itself writes and reads::

    path = build_embedding_model(tmp / "st-mean")               # mean pooling, normalised
    path = build_embedding_model(tmp / "st-cls", mode="cls", normalize=False)
    path = build_cross_encoder(tmp / "ce")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

PoolingFlag = Literal["mean", "cls", "max", "lasttoken", "mean_sqrt_len"]

HIDDEN_SIZE = 32
MAX_SEQ_LENGTH = 48

_WORDS = tuple(
    [
        "the",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "it",
        "that",
        "for",
        "on",
        "with",
        "as",
        "was",
        "at",
        "by",
        "be",
        "this",
        "are",
        "from",
        "or",
        "an",
        "which",
        "capital",
        "france",
        "paris",
        "city",
        "germany",
        "berlin",
        "banana",
        "fruit",
        "yellow",
        "apple",
        "red",
        "green",
        "cat",
        "dog",
        "animal",
        "runs",
        "fast",
        "slow",
        "water",
        "river",
        "sea",
        "mountain",
        "high",
        "low",
        "music",
        "song",
        "sings",
        "book",
        "reads",
        "query",
        "document",
        "relevant",
        "search",
        "engine",
        "model",
        "vector",
        "embedding",
        "text",
        "sentence",
        "hello",
        "world",
    ]
)
_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?;:'\"-()"


def _write_tokenizer(path: Path) -> int:
    """A BERT WordPiece tokenizer whose vocabulary covers any ASCII text (whole words, then
    single characters and their ``##`` continuations); returns its size."""
    from transformers import BertTokenizerFast

    vocab = [*_SPECIAL, *_WORDS, *_CHARACTERS, *(f"##{char}" for char in _CHARACTERS)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True)
    tokenizer.model_max_length = MAX_SEQ_LENGTH
    tokenizer.save_pretrained(str(path))
    return len(vocab)


def _config(vocab_size: int, layers: int = 2, **extra: object) -> object:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        **extra,
    )


def build_embedding_model(
    path: Path,
    *,
    mode: PoolingFlag = "mean",
    normalize: bool = True,
    seed: int = 0,
    layers: int = 2,
) -> Path:
    """A sentence-transformers directory: a random BERT of ``layers`` layers, ``mode``
    pooling, ``Normalize``."""
    import torch
    from transformers import BertModel

    if (path / "modules.json").is_file():
        return path
    torch.manual_seed(seed)
    vocab_size = _write_tokenizer(path)
    BertModel(_config(vocab_size, layers)).save_pretrained(str(path))  # type: ignore[arg-type]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {
        "word_embedding_dimension": HIDDEN_SIZE,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": mode == "mean_sqrt_len",
        "pooling_mode_lasttoken": mode == "lasttoken",
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    settings = {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False}
    (path / "sentence_bert_config.json").write_text(json.dumps(settings))
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def build_cross_encoder(path: Path, *, seed: int = 0) -> Path:
    """A cross-encoder: a random BERT sequence classifier with one label."""
    import torch
    from transformers import BertForSequenceClassification

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    vocab_size = _write_tokenizer(path)
    model = BertForSequenceClassification(_config(vocab_size, num_labels=1))  # type: ignore[arg-type]
    model.config.architectures = ["BertForSequenceClassification"]
    model.save_pretrained(str(path))
    return path
