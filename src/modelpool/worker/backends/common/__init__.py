"""What every backend shares: the in-worker scheduler and what a backend's model runner
plugs into it (``scheduler``), the generation parameters and their validation
(``params``), streamed text (``text``), token-choice settings and helpers
(``sampling``, ``penalties``) and the prefix cache's LRU skeleton (``prefix_cache``).

A backend package (``backends.hf``, ``backends.llama_cpp``) imports from here and never
from another backend.
"""
