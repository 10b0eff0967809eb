"""The worker side: what runs inside a worker process, and nothing else.

:mod:`.process` is the process (its channel to the supervisor, its one-call and batch loops,
its failure reports); :mod:`.backends` holds the model engines it runs (``hf``,
``llama_cpp``, the fault-injection ``testing`` backend) and what they share
(:mod:`.backends.common`, the in-batch scheduler included); :mod:`.cuda_faults` reads a CUDA
failure. A worker imports nothing of :mod:`modelpool.supervisor` or :mod:`modelpool.server`
(``tests/unit/test_layers.py``).
"""
