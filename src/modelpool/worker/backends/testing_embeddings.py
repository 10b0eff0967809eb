"""The testing backend's embeddings and scores (``backend="testing"`` with the load option
``task = "embed"`` or ``"score"``): vectors without a model, and the faults of a real one.

An input's text says what to do (anything else is embedded)::

    pool.embed(["hello", "embed_sleep:0.5"])   # the second takes 0.5 s, checking cancel
    pool.embed(["embed_hang"])                  # never returns, ignores SIGTERM

==========================  ====================================================
``embed_sleep:SECONDS``     takes SECONDS, reading the cancel flag every 10 ms
                            (an honest slow model: a deadline needs no kill)
``embed_wait:PATH``         waits until PATH exists, reading the cancel flag every
                            10 ms (a test holds a batch open with it)
``embed_hang``              never returns, never reads the flag, ignores SIGTERM
``embed_segfault``          dereferences NULL
``embed_crash_once:PATH``   exits if PATH does not exist (creating it), else embeds
``embed_hang_once:PATH``    hangs if PATH does not exist (creating it), else embeds
==========================  ====================================================

The load options ``pooling_token_s`` and ``pooling_batch_tokens`` make its work take time
as a real model's does (``Passes``): each request's tokens in forward passes of at most
``pooling_batch_tokens`` (16,384, hf's default before issue 58), each pass sleeping
``pooling_token_s`` per token without reading the cancel flag, which is read between two
passes only: what a deadline meets in a real model's micro-batch.

With ``max_batch_size`` above 1 the requests batch (``PooledBatch``): the worker admits
every embed or score request that has arrived, and one step answers them all, one after
the other, so a fault in one is a fault of the step (``embed_segfault`` and
``embed_crash_once`` take the worker and its whole batch down, ``embed_hang`` freezes
it); a request refused (its context, its dimensions) fails alone. The load option
``batch_log = PATH`` appends each step's number of requests to PATH, one a line, so that
a test sees how its requests were batched.

A vector has ``DIMENSIONS`` values made from a hash of the input (equal inputs, equal
vectors), unit length. An input counts one token per whitespace-separated word (token
ids: one each); with ``max_model_len`` a longer one is refused (``ContextLengthExceeded``)
unless truncated. An embedding model scores by cosine; a cross-encoder (``task =
"score"``) gives the logit ``shared words - 0.5`` between query and document, through a
sigmoid unless raw scores are asked for.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from modelpool.shared.embeddings import check_dimensions, cosine, cut_and_normalise
from modelpool.shared.errors import ContextLengthExceeded
from modelpool.shared.protocol import (
    BatchCall,
    Call,
    EmbedRequest,
    Finished,
    Generation,
    PooledAnswer,
    PoolingRequest,
    ScoreRequest,
)

DIMENSIONS = 8
_SLEEP_STEP_S = 0.01


@dataclass(frozen=True)
class Passes:
    """A real model's forward passes, simulated (the load options ``pooling_token_s`` and
    ``pooling_batch_tokens``): rows packed in order into passes of at most
    ``batch_tokens`` tokens (a longer row alone), each taking ``token_s`` a token."""

    token_s: float = 0.0
    batch_tokens: int = 16384

    def run(self, rows: Sequence[int], call: Call) -> bool:
        """Every pass over ``rows`` (their token counts); False, at the first pass
        boundary after it, once the call was cancelled."""
        if self.token_s <= 0:
            return True
        packed = 0
        for tokens in rows:
            if packed and packed + tokens > self.batch_tokens:
                if call.cancelled():
                    return False
                time.sleep(packed * self.token_s)
                packed = 0
            packed += tokens
        if call.cancelled():
            return False
        time.sleep(packed * self.token_s)
        return not call.cancelled()


# Passes that take no time: the default, a backend whose work is the hash alone.
INSTANT = Passes()


def embed(
    request: EmbedRequest, call: Call, max_model_len: int | None, passes: Passes = INSTANT
) -> Generation:
    size = check_dimensions(request.dimensions, DIMENSIONS)
    tokens = [_fit(_tokens(item), max_model_len, request.truncate, index)
              for index, item in enumerate(request.inputs)]  # fmt: skip
    if not passes.run(tokens, call):
        return Generation("", "cancelled", sum(tokens), 0)
    vectors = []
    for item, count in zip(request.inputs, tokens, strict=True):
        if isinstance(item, str) and not _act(item, call):
            return Generation("", "cancelled", sum(tokens), 0)
        vectors.append(cut_and_normalise(vector(item, count), size))
    return Generation("", "stop", sum(tokens), 0, pooled=PooledAnswer(vectors=vectors))


def score(
    request: ScoreRequest,
    call: Call,
    max_model_len: int | None,
    cross_encoder: bool,
    passes: Passes = INSTANT,
) -> Generation:
    query_tokens = _fit(_tokens(request.query), max_model_len, request.truncate, 0)
    lengths = [_fit(_tokens(document), max_model_len, request.truncate, index)
               for index, document in enumerate(request.documents)]  # fmt: skip
    # A cross-encoder reads each pair; an embedding model the query once and each document.
    rows = [query_tokens, *lengths]
    if cross_encoder:
        rows = [query_tokens + tokens for tokens in lengths]
    if not passes.run(rows, call):
        return Generation("", "cancelled", 0, 0)
    prompt_tokens = 0
    scores = []
    for document, tokens in zip(request.documents, lengths, strict=True):
        if not _act(document, call):
            return Generation("", "cancelled", prompt_tokens, 0)
        prompt_tokens += query_tokens + tokens
        if cross_encoder:
            shared = len(set(request.query.split()) & set(document.split()))
            logit = shared - 0.5
            scores.append(logit if request.raw_scores else 1 / (1 + math.exp(-logit)))
        else:
            query = vector(request.query, query_tokens)
            scores.append(cosine(query, vector(document, tokens)))
    method = "cross-encoder" if cross_encoder else "cosine"
    return Generation(
        "", "stop", prompt_tokens, 0, pooled=PooledAnswer(scores=scores, method=method)
    )


class PooledBatch:
    """The admitted embed and score requests of a batched worker, answered together."""

    def __init__(
        self,
        max_model_len: int | None,
        cross_encoder: bool,
        log: str | None,
        passes: Passes = INSTANT,
    ) -> None:
        self.max_model_len = max_model_len
        self.cross_encoder = cross_encoder
        self.log = log
        self.passes = passes
        self.calls: list[tuple[BatchCall, PoolingRequest]] = []

    def admit(self, call: BatchCall) -> bool:
        """Take ``call`` if it carries a pooling request (the worker's ``PoolingCall``)."""
        request = getattr(call, "request", None)
        if not isinstance(request, (EmbedRequest, ScoreRequest)):
            return False
        self.calls.append((call, request))
        return True

    def step(self) -> list[Finished]:
        """Every admitted request's answer (or its own refusal)."""
        calls, self.calls = self.calls, []
        if not calls:
            return []
        if self.log is not None:
            with open(self.log, "a") as log:
                log.write(f"{len(calls)}\n")
        finished: list[Finished] = []
        for call, request in calls:
            try:
                if isinstance(request, EmbedRequest):
                    answer = embed(request, call, self.max_model_len, self.passes)
                else:
                    answer = score(
                        request, call, self.max_model_len, self.cross_encoder, self.passes
                    )
            except Exception as exc:
                finished.append((call, exc))
                continue
            finished.append((call, answer))
        return finished

    def retire(self, call: BatchCall) -> bool:
        kept = [entry for entry in self.calls if entry[0] is not call]
        retired = len(kept) < len(self.calls)
        self.calls = kept
        return retired


def _tokens(item: str | tuple[int, ...]) -> int:
    return len(item) if isinstance(item, tuple) else max(1, len(item.split()))


def _fit(tokens: int, max_model_len: int | None, truncate: bool, index: int) -> int:
    if max_model_len is None or tokens <= max_model_len:
        return tokens
    if truncate:
        return max_model_len
    raise ContextLengthExceeded(
        f"input[{index}] is {tokens} tokens; this model's maximum context length is "
        f"{max_model_len} tokens (truncate=True cuts it to fit)",
        prompt_tokens=tokens,
        max_new_tokens=None,
        max_model_len=max_model_len,
    )


def vector(item: str | tuple[int, ...], tokens: int | None = None) -> list[float]:
    """The unit vector this backend gives ``item`` (its first ``tokens`` words)."""
    tokens = _tokens(item) if tokens is None else tokens
    text = item if isinstance(item, str) else " ".join(map(str, item))
    words = text.split()[:tokens] if isinstance(item, str) else text.split()
    digest = hashlib.sha256(" ".join(words).encode()).digest()
    return cut_and_normalise([byte / 127.5 - 1.0 for byte in digest[:DIMENSIONS]], DIMENSIONS)


def _act(text: str, call: Call) -> bool:
    """Do what ``text`` asks (see the table); False once the call was cancelled."""
    command, _, argument = text.partition(":")
    if command == "embed_sleep":
        until = time.monotonic() + float(argument)
        while time.monotonic() < until:
            if call.cancelled():
                return False
            time.sleep(_SLEEP_STEP_S)
    elif command == "embed_wait":
        while not os.path.exists(argument):
            if call.cancelled():
                return False
            time.sleep(_SLEEP_STEP_S)
    elif command == "embed_segfault":
        ctypes.string_at(0)
    elif command == "embed_hang" or (
        command in ("embed_hang_once", "embed_crash_once") and _first_time(argument)
    ):
        if command == "embed_crash_once":
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Event().wait()
    return not call.cancelled()


def _first_time(marker: str) -> bool:
    try:
        with open(marker, "x"):
            return True
    except FileExistsError:
        return False
