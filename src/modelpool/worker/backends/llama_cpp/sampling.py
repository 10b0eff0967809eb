"""Per-request token choice for the llama_cpp backend, on one row's logits, in numpy.

The settings are every backend's (:class:`~modelpool.worker.backends.common.sampling.Sampling`,
the same parameters with the same meaning as on hf), applied here in numpy. Each
request samples from its own generator, seeded by its ``seed``, so a row's tokens never
depend on the other rows of a batch.

Choosing here rather than through llama.cpp's sampler chain keeps every parameter per
request without a sampler object per row, and keeps logprobs exactly the model's
(a log-softmax of the raw logits, before any setting).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from modelpool.shared.protocol import TokenLogprob
from modelpool.worker.backends.common.sampling import Sampling, banned_ngram_tokens

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Logits = npt.NDArray[np.float32]


def choose_token(
    logits: Logits,
    sampling: Sampling,
    seen: list[int],
    generated: int,
    end_ids: npt.NDArray[np.int64],
    rng: np.random.Generator | None,
    allowed: npt.NDArray[np.bool_] | None = None,
) -> int:
    """The next token for one row. ``logits`` may be llama.cpp's own buffer: it is not
    written to. ``seen``: prompt and generated tokens; ``end_ids``: the end-of-generation
    tokens that ``min_new_tokens`` holds back; ``allowed``: the tokens a grammar allows
    (None: every token)."""
    import numpy as np

    if allowed is None and sampling.is_plain_greedy(generated):
        return int(logits.argmax())
    scores = np.array(logits, dtype=np.float32, copy=True)
    if allowed is not None:
        scores[~allowed] = -math.inf
    if sampling.repetition_penalty != 1.0:
        ids = np.fromiter(set(seen), dtype=np.int64)
        picked = scores[ids]
        penalty = sampling.repetition_penalty
        scores[ids] = np.where(picked < 0, picked * penalty, picked / penalty)
    if sampling.no_repeat_ngram_size:
        banned = banned_ngram_tokens(seen, sampling.no_repeat_ngram_size)
        if banned:
            scores[list(banned)] = -math.inf
    if generated < sampling.min_new_tokens and end_ids.size:
        scores[end_ids] = -math.inf
    if sampling.penalties.active:
        # OpenAI's penalties count the generated tokens only: the tail of ``seen``.
        sampling.penalties.apply_numpy(scores, seen[len(seen) - generated :] if generated else [])
    if allowed is not None and not np.isfinite(scores).any():
        # The penalties forbade every token the grammar allows: the grammar wins (a
        # promised JSON must still close), as on the hf backend.
        scores = np.where(allowed, logits, -math.inf).astype(np.float32)
    if not sampling.do_sample:
        return int(scores.argmax())
    assert rng is not None, "a sampling row has its generator"
    return _sample(scores, sampling, rng)


def _sample(scores: Logits, sampling: Sampling, rng: np.random.Generator) -> int:
    import numpy as np

    scores = scores / max(sampling.temperature, 1e-5)
    candidates = np.arange(scores.shape[0])
    if 0 < sampling.top_k < scores.shape[0]:
        # Only the k best can survive: the rest of the work is on k entries, not the vocabulary.
        candidates = np.argpartition(scores, -sampling.top_k)[-sampling.top_k :]
        scores = scores[candidates]
    if sampling.top_p < 1.0:
        order = np.argsort(scores)
        probabilities = _softmax(scores[order])
        remove = np.cumsum(probabilities) <= (1 - sampling.top_p)
        remove[-1] = False
        scores = scores.copy()
        scores[order[remove]] = -math.inf
    probabilities = _softmax(scores)
    cumulative = np.cumsum(probabilities)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(candidates[min(index, candidates.shape[0] - 1)])


def _softmax(scores: Logits) -> Logits:
    import numpy as np

    shifted = np.exp(scores - scores.max())
    result: Logits = shifted / shifted.sum()
    return result


def log_softmax(logits: Logits) -> Logits:
    import numpy as np

    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max()
    result: Logits = (shifted - math.log(float(np.exp(shifted).sum()))).astype(np.float32)
    return result


def token_logprob(logits: Logits, token_id: int, top: int, text_of: Any) -> TokenLogprob:
    """``token_id``'s log probability under ``logits`` and the ``top`` likeliest
    alternatives, most likely first. ``text_of(token_id)`` gives a token's text."""
    import numpy as np

    logprobs = log_softmax(logits)
    best: tuple[tuple[int, str, float], ...] = ()
    if top:
        ids = np.argpartition(logprobs, -top)[-top:]
        ids = ids[np.argsort(-logprobs[ids], kind="stable")]
        best = tuple((int(other), text_of(int(other)), float(logprobs[other])) for other in ids)
    return TokenLogprob(token_id, text_of(token_id), float(logprobs[token_id]), best)
