"""OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, applied to a
row's next-token scores on torch (:meth:`Penalties.apply`, the hf backend) and numpy
(:meth:`Penalties.apply_numpy`, the llama_cpp backend): one definition, one validation,
for every backend.

OpenAI's definitions, over the tokens generated so far (the prompt does not count)::

    score[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)
    score[t] += logit_bias[t]

On the hf backend ``generate()`` takes them as a logits processor
(``hf.generation.penalties_processor``: it runs after transformers' own processors,
repetition penalty and ``min_new_tokens`` included, and before the sampling warpers);
the runners apply them at the same point of their own token choice, so that a row
decodes alike alone and in a batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpool.shared.errors import InvalidRequest

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

PENALTY_PARAMS = ("presence_penalty", "frequency_penalty", "logit_bias")


@dataclass(frozen=True)
class Penalties:
    """One request's penalties; :meth:`active` is False when they change nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_params(cls, params: Mapping[str, Any], vocab_size: int) -> Penalties:
        """Read from a request's (already validated) params; a biased token id outside the
        model's vocabulary is refused here, where the vocabulary is known."""
        given = params.get("logit_bias") or {}
        bias = tuple(sorted((int(key), float(value)) for key, value in given.items()))
        outside = [token_id for token_id, _ in bias if token_id >= vocab_size]
        if outside:
            raise InvalidRequest(
                f"logit_bias: token id {outside[0]} is outside this model's vocabulary "
                f"(ids 0 to {vocab_size - 1})"
            )
        return cls(
            float(params.get("presence_penalty") or 0.0),
            float(params.get("frequency_penalty") or 0.0),
            bias,
        )

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.bias)

    def apply(self, scores: torch.Tensor, generated: list[int]) -> torch.Tensor:
        """``scores`` ([vocabulary], float) with the penalties applied, in place."""
        import torch

        if generated and (self.presence or self.frequency):
            counts = torch.bincount(
                torch.tensor(generated, device=scores.device), minlength=scores.shape[-1]
            ).to(scores.dtype)
            scores -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        if self.bias:
            ids = torch.tensor([token_id for token_id, _ in self.bias], device=scores.device)
            values = torch.tensor([value for _, value in self.bias], device=scores.device)
            scores[ids] += values.to(scores.dtype)
        return scores

    def apply_numpy(
        self, scores: npt.NDArray[np.float32], generated: list[int]
    ) -> npt.NDArray[np.float32]:
        """:meth:`apply` on a numpy row (the llama_cpp backend's logits), in place."""
        import numpy as np

        if generated and (self.presence or self.frequency):
            ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            scores[ids] -= (self.frequency * counts + self.presence).astype(scores.dtype)
        if self.bias:
            ids = np.fromiter((token_id for token_id, _ in self.bias), dtype=np.int64)
            scores[ids] += np.fromiter((value for _, value in self.bias), dtype=scores.dtype)
        return scores
