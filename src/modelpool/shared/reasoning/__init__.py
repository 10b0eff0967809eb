"""Reasoning ("thinking") models: their thinking told apart from their answer, and bounded.

- :mod:`.parsers`: streaming parsers, fed text pieces, that yield the reasoning and the
  answer separately, one per family (``deepseek_r1``, ``qwen3``: ``<think>...</think>``;
  ``gpt_oss``: Harmony's channels), and :func:`.parsers.split_reasoning` for the canonical
  text a worker returns;
- :mod:`.detect`: which family a model is, from its chat template and vocabulary
  (``reasoning_parser = "auto"``);
- :mod:`.controls`: the request fields that control thinking (effort, budgets,
  ``enable_thinking``) read into worker params, and the per-model budgets;
- :mod:`.loops`: the n-gram loop detector the worker closes looping thinking with.

The worker bounds thinking (``modelpool.worker.backends.common.thinking``); the server
only splits and formats (docs/reasoning.md).
"""
