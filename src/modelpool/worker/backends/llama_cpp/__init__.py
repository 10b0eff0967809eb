"""The llama_cpp backend (GGUF models on llama.cpp): :func:`load` is its factory, the
``"llama_cpp"`` backend name's target.

- ``handler``: :func:`load` and the handler (prompts, chat templates, both forms);
- ``options``: load options, GPU placement, the GGUF file, the bindings' import;
- ``runtime``: the llama.cpp model and context behind a few ctypes calls;
- ``runner``: the decoding loop over one ``llama_decode`` a step;
- ``sampling``: token choice in numpy; ``grammars``: llguidance masks in numpy;
- ``prefix_cache``: finished requests' KV cells kept as llama.cpp sequences;
- ``probe``: the first-decode probe in a child process.

Importing it costs nothing heavy: llama-cpp-python and numpy are imported by :func:`load`.
"""

# validate: the pool checks a request's parameters with it before dispatch
# (supervisor.intake.backend_validator reads it from the module the backend name resolves to).
from modelpool.worker.backends.llama_cpp.handler import load, load_generation, validate

__all__ = ["load", "load_generation", "validate"]
