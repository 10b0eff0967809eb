"""The worker side: what runs inside a worker process, and nothing else.

:mod:`.process` is the process (its start, its lifeline, the backend's load, the one-call
loop); :mod:`.batch_loop` the stepping loop of a batched backend; :mod:`.calls` what both
loops do with an attempt (the call a backend receives, its answer, its failure reported
typed) over :mod:`.channel`, the socket to the supervisor; :mod:`.backends` holds the
model engines it runs (``hf``, ``llama_cpp``, the fault-injection ``testing`` backend) and
what they share (:mod:`.backends.common`, the in-batch scheduler included);
:mod:`.cuda_faults` reads a CUDA failure. A worker imports nothing of
:mod:`modelpool.supervisor` or :mod:`modelpool.server` (``tests/unit/test_layers.py``).
"""
