"""GGUF embedding models on llama.cpp: llama-cpp-python's ``Llama(embedding=True)``.

A GGUF is an embedding model when its architecture is an encoder llama.cpp pools
(``bert``, ``nomic-bert``, ``jina-bert-v2``, ...) or its metadata names a pooling type;
the load option ``embedding`` (true or false) overrides the guess. Its worker embeds
(vectors normalised to unit length, as sentence-transformers' ``Normalize`` leaves them)
and scores by cosine; it does not generate.

Inputs (texts tokenized by the GGUF's own tokenizer, special tokens added; token ids fed
as they are) are packed into micro-batches of at most the context's tokens, each one
``llama_decode`` with a sequence per input, the cancel flag read between them. An input
longer than the context is refused unless truncated. This is how
``Llama.embed`` itself packs, with token ids and the cancel check added.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from modelpool.embeddings import check_dimensions, cosine, cut_and_normalise
from modelpool.errors import ContextLengthExceeded, InvalidRequest
from modelpool.protocol import Call, EmbedRequest, Generation, PooledAnswer, ScoreRequest

logger = logging.getLogger(__name__)

ENCODER_ARCHITECTURES = frozenset(
    {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert",
     "neo-bert", "eurobert", "t5encoder"}
)  # fmt: skip


def is_embedding_model(metadata: dict[str, str]) -> bool:
    """Does a GGUF with this metadata embed (an encoder, or a pooling type set)?"""
    architecture = metadata.get("general.architecture", "")
    return architecture in ENCODER_ARCHITECTURES or f"{architecture}.pooling_type" in metadata


def read_metadata(path: Path) -> dict[str, str]:
    """The GGUF's metadata, read with its vocabulary only (no weights)."""
    from llama_cpp import Llama

    vocabulary = Llama(str(path), vocab_only=True, verbose=False)
    metadata = dict(vocabulary.metadata)
    vocabulary.close()
    return metadata


def load_embedding(
    path: Path, threads: int, max_model_len: int | None, n_gpu_layers: int, use_mmap: bool
) -> LlamaEmbeddingHandler:
    from llama_cpp import Llama

    started = time.monotonic()
    probe = Llama(str(path), vocab_only=True, verbose=False)
    trained = int(
        probe.metadata.get(f"{probe.metadata.get('general.architecture')}.context_length", 512)
    )
    probe.close()
    context = min(trained, max_model_len) if max_model_len else trained
    model = Llama(
        str(path),
        embedding=True,
        n_ctx=context,
        n_batch=context,
        n_ubatch=context,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=n_gpu_layers,
        use_mmap=use_mmap,
        verbose=False,
    )
    handler = LlamaEmbeddingHandler(model, context)
    logger.info(
        "loaded %s with llama.cpp as an embedding model (%d dimensions, %d threads, context "
        "%d tokens) in %.2f s",
        path.name,
        handler.size,
        threads,
        context,
        time.monotonic() - started,
    )
    return handler


class LlamaEmbeddingHandler:
    """A GGUF embedding model: ``embed`` and ``score`` (``modelpool.pooling_answers``),
    ``tokenize``, ``detokenize``; no generation."""

    task = "embed"

    def __init__(self, model: Any, max_model_len: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.size = int(model.n_embd())
        self.vocab_size = int(model.n_vocab())

    def embed(self, request: EmbedRequest, call: Call) -> Generation:
        dimensions = check_dimensions(request.dimensions, self.size)
        rows = self._rows(request.inputs, request.truncate)
        vectors = self._vectors(rows, call)
        if vectors is None:
            return Generation("", "cancelled", 0, 0)
        cut = [cut_and_normalise(vector, dimensions) for vector in vectors]
        tokens = sum(len(row) for row in rows)
        return Generation("", "stop", tokens, 0, pooled=PooledAnswer(vectors=cut))

    def score(self, request: ScoreRequest, call: Call) -> Generation:
        rows = self._rows((request.query, *request.documents), request.truncate)
        vectors = self._vectors(rows, call)
        if vectors is None:
            return Generation("", "cancelled", 0, 0)
        scores = [cosine(vectors[0], vector) for vector in vectors[1:]]
        tokens = sum(len(row) for row in rows)
        return Generation(
            "", "stop", tokens, 0, pooled=PooledAnswer(scores=scores, method="cosine")
        )

    def tokenize(self, prompt: object, add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise InvalidRequest("an embedding model tokenizes text, not chat messages")
        return [int(token) for token in self.model.tokenize(prompt.encode("utf-8"))]

    def detokenize(self, token_ids: list[int]) -> str:
        return bytes(self.model.detokenize(token_ids)).decode("utf-8", errors="replace")

    def _rows(self, inputs: tuple[str | tuple[int, ...], ...], truncate: bool) -> list[list[int]]:
        rows = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                ids = self.tokenize(item)
            else:
                ids = list(item)
                if max(ids) >= self.vocab_size:
                    raise InvalidRequest(
                        f"input[{index}] has token id {max(ids)}, past this model's vocabulary "
                        f"({self.vocab_size} tokens)"
                    )
            if len(ids) > self.max_model_len:
                if not truncate:
                    raise ContextLengthExceeded(
                        f"input[{index}] is {len(ids)} tokens; this model's maximum context "
                        f"length is {self.max_model_len} tokens (truncate=True cuts it to fit)",
                        prompt_tokens=len(ids),
                        max_new_tokens=None,
                        max_model_len=self.max_model_len,
                    )
                ids = ids[: self.max_model_len]
            rows.append(ids)
        return rows

    def _vectors(self, rows: list[list[int]], call: Call) -> list[list[float]] | None:
        """Each row's pooled vector, in order; None once cancelled. One ``llama_decode`` per
        micro-batch: rows packed, in order, until the next would pass the context."""
        import llama_cpp

        model = self.model
        sequences = int(model.context_params.n_seq_max)
        vectors: list[list[float]] = []
        batch: list[int] = []
        used = 0
        model._batch.reset()
        for position in [*range(len(rows)), None]:
            row = rows[position] if position is not None else None
            full = row is None or used + len(row) > self.max_model_len or len(batch) >= sequences
            if batch and full:
                if call.cancelled():
                    return None
                model._ctx.kv_cache_clear()
                model._ctx.decode(model._batch)
                for sequence in range(len(batch)):
                    pointer = llama_cpp.llama_get_embeddings_seq(model._ctx.ctx, sequence)
                    vectors.append(_unit([float(value) for value in pointer[: self.size]]))
                model._batch.reset()
                batch, used = [], 0
            if row is not None:
                model._batch.add_sequence(row, len(batch), True)
                batch.append(position)
                used += len(row)
        model._ctx.kv_cache_clear()
        return vectors


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return vector if norm == 0.0 else [value / norm for value in vector]
