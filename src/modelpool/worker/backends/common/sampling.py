"""One request's token-choice settings, read once from its parameters, and the helpers
every runner's token choice shares.

The parameters mean the same on every backend: greedy unless the request samples
(``do_sample``, or a ``temperature`` above 0), then temperature, top-k, top-p in that
order; ``repetition_penalty`` (CTRL's, as transformers applies it),
``no_repeat_ngram_size``, ``min_new_tokens`` (end-of-generation tokens masked until
then), OpenAI's penalties (:mod:`~modelpool.worker.backends.common.penalties`) and
``ignore_eos``. Each runner applies them in its own array library (torch, numpy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpool.worker.backends.common.penalties import Penalties

SAMPLING_DEFAULTS: Mapping[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
"""What transformers' generate() uses when neither the request nor a generation_config
says, so that a sampled request means the same on every backend."""


@dataclass(frozen=True)
class Sampling:
    """One request's token-choice settings."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    penalties: Penalties = field(default_factory=Penalties)
    ignore_eos: bool = False  # vLLM's: an end-of-generation token does not end the request

    @classmethod
    def from_params(
        cls,
        params: Mapping[str, Any],
        vocab_size: int,
        defaults: Mapping[str, Any] | None = None,
        *,
        prompt_tokens: int = 0,
        min_length: int = 0,
    ) -> Sampling:
        """Read from a request's validated params. ``defaults``: what the model supplies
        where the request does not say (the hf backend's generation_config: the sampling
        ones, ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``);
        ``min_length`` counts prompt and completion together, as generate() does. A
        ``logit_bias`` id outside the vocabulary raises
        :class:`~modelpool.shared.errors.InvalidRequest`."""
        given = {**SAMPLING_DEFAULTS, **(defaults or {}), **params}
        return cls(
            do_sample=bool(params.get("do_sample", params.get("temperature", 0) > 0)),
            temperature=float(given["temperature"]),
            top_k=int(given["top_k"] or 0),
            top_p=float(given["top_p"]),
            repetition_penalty=float(given.get("repetition_penalty", 1.0)),
            no_repeat_ngram_size=int(given.get("no_repeat_ngram_size", 0)),
            min_new_tokens=max(int(given.get("min_new_tokens", 0)), min_length - prompt_tokens),
            penalties=Penalties.from_params(params, vocab_size),
            ignore_eos=params.get("ignore_eos") is True,
        )

    def is_plain_greedy(self, generated: int) -> bool:
        """True when the choice is the argmax of the raw logits (no copy, no masks)."""
        return (
            not self.do_sample
            and self.repetition_penalty == 1.0
            and self.no_repeat_ngram_size == 0
            and not self.penalties.active
            and generated >= self.min_new_tokens
        )


def banned_ngram_tokens(seen: list[int], size: int) -> set[int]:
    """Tokens that would repeat an n-gram of ``size`` already in ``seen``."""
    if len(seen) < size:
        return set()
    prefix = tuple(seen[len(seen) - size + 1 :])
    return {
        seen[start + size - 1]
        for start in range(len(seen) - size + 1)
        if tuple(seen[start : start + size - 1]) == prefix
    }
