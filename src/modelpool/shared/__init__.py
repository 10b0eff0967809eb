"""What both sides of a pool speak: imported by the worker and by the supervisor, importing
neither.

- the wire between them (:mod:`.protocol`), the typed errors (:mod:`.errors`) and the pool's
  configuration (:mod:`.config`, with :mod:`.toml_text`);
- the checks a request passes on both sides (:mod:`.validation`, :mod:`.context`,
  :mod:`.prefixes`), the grammars of structured outputs and tools (:mod:`.grammar`,
  :mod:`.structured`, :mod:`.tools`);
- the shapes of answers (:mod:`.embeddings`, :mod:`.pooling_answers`,
  :mod:`.logprob_columns`), process trees (:mod:`.processes`) and the embedded model
  (:mod:`.embedded`).

``tests/unit/test_layers.py`` holds it to that: nothing here imports
:mod:`modelpool.supervisor`, :mod:`modelpool.worker`, :mod:`modelpool.scheduling` or
:mod:`modelpool.server`.
"""
