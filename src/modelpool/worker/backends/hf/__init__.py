"""The transformers backend: :func:`load` is its factory, the ``"hf"`` backend name's
target.

- ``handler``: :func:`load` (load options, the model) and the handler;
- ``pooling``: embedding models and cross-encoders (a sentence-transformers directory);
- ``generation``: the one-call form, through transformers' ``generate()``;
- ``runner``: the batched form's decoding loop;
- ``packed``: each running row on a KV cache of its own, a decoding step (and a prefill
  slice riding on it) one packed forward pass;
- ``padded``: the running rows on one left-padded KV cache, for models ``packed`` does
  not fit;
- ``grammars``: llguidance masks as torch bitmasks;
- ``prefix_cache``: the KV of recent prompts and answers, per worker.

Importing it costs nothing heavy: torch and transformers are imported by :func:`load`.
"""

# validate: the pool checks a request's parameters with it before dispatch
# (supervisor.intake.backend_validator reads it from the module the backend name resolves to).
from modelpool.worker.backends.hf.handler import load, load_generation, validate

__all__ = ["load", "load_generation", "validate"]
