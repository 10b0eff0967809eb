"""modelpool: serve a local Hugging Face model from a supervised pool of pre-warmed workers.

    from modelpool import ModelPool, PoolConfig

    with ModelPool(PoolConfig(model="./my-model", workers=2, deadline_s=30)) as pool:
        print(pool.generate("Name the capital of France.").text)

Names are loaded on first use so that a worker process, which imports
``modelpool.worker``, never pays for (or imports) the supervisor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelPool": "modelpool.pool",
    "PoolFuture": "modelpool.pool",
    "PoolStream": "modelpool.streams",
    "AsyncPoolStream": "modelpool.streams",
    "Result": "modelpool.pool",
    "PoolConfig": "modelpool.config",
    "RetryPolicy": "modelpool.config",
    "ServerConfig": "modelpool.config",
    "Generation": "modelpool.protocol",
    "TokenIds": "modelpool.protocol",
    "TokenLogprob": "modelpool.protocol",
    "TokenLogprobs": "modelpool.logprob_columns",
    "PoolHealth": "modelpool.stats",
    "PoolStats": "modelpool.stats",
    "Attempt": "modelpool.errors",
    "PoolError": "modelpool.errors",
    "DeadlineExceeded": "modelpool.errors",
    "WorkerCrashed": "modelpool.errors",
    "PoisonRequest": "modelpool.errors",
    "BackendError": "modelpool.errors",
    "OutOfMemory": "modelpool.errors",
    "CudaError": "modelpool.errors",
    "PoolOverloaded": "modelpool.errors",
    "QueueFull": "modelpool.errors",
    "PoolClosed": "modelpool.errors",
    "ModelLoadFailed": "modelpool.errors",
    "PreflightError": "modelpool.errors",
    "ModelSourceError": "modelpool.errors",
    "DeviceError": "modelpool.errors",
    "InvalidRequest": "modelpool.errors",
    "ContextLengthExceeded": "modelpool.errors",
    "WrongTask": "modelpool.errors",
    "EmbeddingResult": "modelpool.embeddings",
    "ScoreResult": "modelpool.embeddings",
    "GrammarError": "modelpool.errors",
    "GrammarCompileTimeout": "modelpool.errors",
    "GrammarEngineMissing": "modelpool.errors",
    "SchemaTooComplex": "modelpool.errors",
}

__all__ = [
    "AsyncPoolStream",
    "Attempt",
    "BackendError",
    "ContextLengthExceeded",
    "CudaError",
    "DeadlineExceeded",
    "DeviceError",
    "EmbeddingResult",
    "Generation",
    "GrammarCompileTimeout",
    "GrammarEngineMissing",
    "GrammarError",
    "InvalidRequest",
    "ModelLoadFailed",
    "ModelPool",
    "ModelSourceError",
    "OutOfMemory",
    "PoisonRequest",
    "PoolClosed",
    "PoolConfig",
    "PoolError",
    "PoolFuture",
    "PoolHealth",
    "PoolOverloaded",
    "PoolStats",
    "PoolStream",
    "PreflightError",
    "QueueFull",
    "Result",
    "RetryPolicy",
    "SchemaTooComplex",
    "ScoreResult",
    "ServerConfig",
    "TokenIds",
    "TokenLogprob",
    "TokenLogprobs",
    "WorkerCrashed",
    "WrongTask",
    "__version__",
]

if TYPE_CHECKING:
    from modelpool.config import PoolConfig, RetryPolicy, ServerConfig
    from modelpool.embeddings import EmbeddingResult, ScoreResult
    from modelpool.errors import (
        Attempt,
        BackendError,
        ContextLengthExceeded,
        CudaError,
        DeadlineExceeded,
        DeviceError,
        GrammarCompileTimeout,
        GrammarEngineMissing,
        GrammarError,
        InvalidRequest,
        ModelLoadFailed,
        ModelSourceError,
        OutOfMemory,
        PoisonRequest,
        PoolClosed,
        PoolError,
        PoolOverloaded,
        PreflightError,
        QueueFull,
        SchemaTooComplex,
        WorkerCrashed,
        WrongTask,
    )
    from modelpool.logprob_columns import TokenLogprobs
    from modelpool.pool import ModelPool, PoolFuture, Result
    from modelpool.protocol import Generation, TokenIds, TokenLogprob
    from modelpool.stats import PoolHealth, PoolStats
    from modelpool.streams import AsyncPoolStream, PoolStream


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'modelpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
