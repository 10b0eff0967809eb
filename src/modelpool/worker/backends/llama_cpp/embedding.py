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

With ``max_batch_size`` above 1 the handler is batched (``protocol.BatchedHandler``,
``batches_pooling``), as the hf backend's pooling handler is: the worker admits every
embed or score request that has arrived (each checked then, so that a bad one fails
alone) and one ``step()`` packs all their inputs into the same micro-batches; a
cancelled request's inputs leave the micro-batches after its flag is read.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool.shared.embeddings import check_dimensions, cosine, cut_and_normalise
from modelpool.shared.errors import ContextLengthExceeded, InvalidRequest
from modelpool.shared.pooling_answers import PooledBatching
from modelpool.shared.protocol import (
    BatchCall,
    Call,
    EmbedRequest,
    Generation,
    PooledAnswer,
    ScoreRequest,
)

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


@dataclass(frozen=True)
class _Pending:
    """An embed or score request, its inputs read into token rows, waiting for a step."""

    call: Call
    request: EmbedRequest | ScoreRequest
    rows: list[list[int]]
    dimensions: int  # an embedding's, after the cut


class LlamaEmbeddingHandler(PooledBatching):
    """A GGUF embedding model: ``embed`` and ``score`` (``modelpool.shared.pooling_answers``), in
    the batched form too (``batches_pooling``: the requests a worker holds embedded
    together), ``tokenize``, ``detokenize``; no generation."""

    task = "embed"

    def __init__(self, model: Any, max_model_len: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.size = int(model.n_embd())
        self.vocab_size = int(model.n_vocab())
        self._pending: list[tuple[BatchCall, _Pending]] = []

    # ---- the two requests, alone (the one-call loop) -----------------------------------

    def embed(self, request: EmbedRequest, call: Call) -> Generation:
        return self._answers([self._prepare(request, call)])[0]

    def score(self, request: ScoreRequest, call: Call) -> Generation:
        return self._answers([self._prepare(request, call)])[0]

    # ---- batched form: the requests of concurrent clients in shared decodes ------------

    def _prepare(self, request: EmbedRequest | ScoreRequest, call: Call) -> _Pending:
        """``request``'s rows, checked (dimensions, context, vocabulary) before any decode."""
        if isinstance(request, EmbedRequest):
            dimensions = check_dimensions(request.dimensions, self.size)
            return _Pending(call, request, self._rows(request.inputs, request.truncate), dimensions)
        rows = self._rows((request.query, *request.documents), request.truncate)
        return _Pending(call, request, rows, self.size)

    def _answers(self, pending: list[_Pending]) -> list[Generation]:
        """Each pending request's answer, in order (``Generation("", "cancelled")`` for one
        whose call was cancelled)."""
        owners = [owner for owner, entry in enumerate(pending) for _ in entry.rows]
        rows = [row for entry in pending for row in entry.rows]
        vectors, cancelled = self._vectors(rows, owners, [entry.call for entry in pending])
        answers = []
        first = 0
        for owner, entry in enumerate(pending):
            own = vectors[first : first + len(entry.rows)]
            first += len(entry.rows)
            if owner in cancelled:
                answers.append(Generation("", "cancelled", 0, 0))
                continue
            tokens = sum(len(row) for row in entry.rows)
            if isinstance(entry.request, EmbedRequest):
                cut = [cut_and_normalise(vector, entry.dimensions) for vector in own]
                answer = PooledAnswer(vectors=cut)
            else:
                answer = PooledAnswer(
                    scores=[cosine(own[0], vector) for vector in own[1:]], method="cosine"
                )
            answers.append(Generation("", "stop", tokens, 0, pooled=answer))
        return answers

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

    def _vectors(
        self, rows: list[list[int]], owners: list[int], calls: list[Call]
    ) -> tuple[list[list[float]], set[int]]:
        """Each row's pooled vector, in order (empty for a row of a cancelled request), and
        the requests found cancelled (``owners[i]``: the index in ``calls`` of row ``i``'s
        request). One ``llama_decode`` per micro-batch: rows packed, in order, until the
        next would pass the context; the flags are read before each."""
        import llama_cpp

        model = self.model
        sequences = int(model.context_params.n_seq_max)
        vectors: list[list[float]] = [[] for _ in rows]
        cancelled: set[int] = set()
        for batch in self._micro_batches(rows, sequences):
            cancelled |= {
                owner for owner, call in enumerate(calls)
                if owner not in cancelled and call.cancelled()
            }  # fmt: skip
            if len(cancelled) == len(calls):
                break
            batch = [index for index in batch if owners[index] not in cancelled]
            if not batch:
                continue
            model._batch.reset()
            for sequence, index in enumerate(batch):
                model._batch.add_sequence(rows[index], sequence, True)
            model._ctx.kv_cache_clear()
            model._ctx.decode(model._batch)
            for sequence, index in enumerate(batch):
                pointer = llama_cpp.llama_get_embeddings_seq(model._ctx.ctx, sequence)
                vectors[index] = _unit([float(value) for value in pointer[: self.size]])
        model._batch.reset()
        model._ctx.kv_cache_clear()
        return vectors, cancelled

    def _micro_batches(self, rows: list[list[int]], sequences: int) -> list[list[int]]:
        """The rows' indices in micro-batches of at most the context's tokens and
        ``sequences`` rows, in order."""
        batches: list[list[int]] = []
        batch: list[int] = []
        used = 0
        for index, row in enumerate(rows):
            if batch and (used + len(row) > self.max_model_len or len(batch) >= sequences):
                batches.append(batch)
                batch, used = [], 0
            batch.append(index)
            used += len(row)
        if batch:
            batches.append(batch)
        return batches


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return vector if norm == 0.0 else [value / norm for value in vector]
