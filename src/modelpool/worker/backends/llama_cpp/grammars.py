"""Structured outputs on llama.cpp: llguidance over the GGUF's own vocabulary, the masks
applied in numpy to each constrained row's logits.

Compilation, caching and the per-row matcher are every backend's
(:class:`modelpool.shared.grammar.GuidanceGrammars`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from modelpool.shared.errors import GrammarError
from modelpool.shared.grammar import GuidanceGrammars, RowGrammar, import_llguidance

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from modelpool.worker.backends.llama_cpp.runtime import Runtime


class LlamaGrammars(GuidanceGrammars):
    """llguidance's tokenizer made from the GGUF's own vocabulary (``llguidance.llamacpp``,
    about a second, on the first compilation); the masks applied in numpy."""

    def __init__(self, runtime: Runtime) -> None:
        def make_tokenizer() -> Any:
            import_llguidance()
            llamacpp = importlib.import_module("llguidance.llamacpp")
            with warnings.catch_warnings():
                # It reads each token's attributes through a binding that llama-cpp-python
                # marks deprecated: one warning per token otherwise.
                warnings.simplefilter("ignore", DeprecationWarning)
                return llamacpp.lltokenizer_from_vocab(
                    runtime.vocab, n_vocab=runtime.n_vocab, eos_token=sorted(runtime.end_id_set)
                )

        super().__init__(make_tokenizer, runtime.end_id_set)
        self._runtime = runtime
        self._words = (runtime.n_vocab + 31) // 32

    def allowed(self, grammar: RowGrammar) -> npt.NDArray[np.bool_]:
        """The tokens ``grammar`` allows next, one bool per vocabulary entry."""
        import numpy as np

        bits = np.full(self._words, -1, dtype=np.int32)
        grammar.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if grammar.matcher.is_error():
            raise GrammarError(f"grammar: {grammar.matcher.get_error()}")
        unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")
        allowed: npt.NDArray[np.bool_] = unpacked[: self._runtime.n_vocab].astype(bool)
        return allowed
