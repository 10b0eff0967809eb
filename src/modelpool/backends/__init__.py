"""Built-in backends: ``"hf"`` is :func:`modelpool.backends.hf.load`."""
