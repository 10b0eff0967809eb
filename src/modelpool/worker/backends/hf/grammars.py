"""Structured outputs on the hf backend: llguidance over the model's transformers tokenizer
(``llguidance.hf``), the masks as torch bitmasks applied to each constrained row's logits.

Compilation, caching and the per-row matcher are every backend's
(:class:`modelpool.shared.grammar.GuidanceGrammars`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modelpool.shared.grammar import GuidanceGrammars, RowGrammar

if TYPE_CHECKING:
    import torch


class LLGuidanceGrammars(GuidanceGrammars):
    """The hf backend's grammar engine: llguidance over the model's tokenizer."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        def make_tokenizer() -> Any:
            import llguidance.hf

            return llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids)
            )

        super().__init__(make_tokenizer, eos_ids)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._shifts: torch.Tensor | None = None

    def new_bitmask(self, rows: int) -> torch.Tensor:
        import torch

        return torch.full((rows, self._words), -1, dtype=torch.int32)

    def fill_masks(
        self, grammars: list[tuple[int, RowGrammar]], bitmask: torch.Tensor
    ) -> dict[int, Exception]:
        """Each row's mask into ``bitmask[index]``; the rows whose grammar failed, by index
        (llguidance drops the GIL while it computes, so this runs beside a forward pass)."""
        failures: dict[int, Exception] = {}
        for index, grammar in grammars:
            try:
                grammar.fill_mask(bitmask, index)
            except Exception as exc:
                failures[index] = exc
        return failures

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Set the logits of the tokens ``bitmask`` forbids to -inf, for rows ``indices``."""
        import torch

        if self._shifts is None:
            self._shifts = torch.arange(32, dtype=torch.int32)
        picked = bitmask[indices]
        bits = ((picked.unsqueeze(-1) >> self._shifts) & 1).reshape(len(indices), -1)
        allowed = bits[:, : logits.shape[-1]].bool().to(logits.device)
        if allowed.shape[-1] < logits.shape[-1]:
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - allowed.shape[-1]))
        rows = torch.tensor(indices, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
