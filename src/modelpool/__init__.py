"""modelpool: serve a local Hugging Face model from a supervised pool of pre-warmed workers.

    from modelpool import ModelPool, PoolConfig

    with ModelPool(PoolConfig(model="./my-model", workers=2, deadline_s=30)) as pool:
        print(pool.generate("Name the capital of France.").text)

Names are loaded on first use so that a worker process, which imports
``modelpool.worker.process``, never pays for (or imports) the supervisor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelPool": "modelpool.supervisor.pool",
    "PoolFuture": "modelpool.supervisor.pool",
    "PoolStream": "modelpool.supervisor.streams",
    "AsyncPoolStream": "modelpool.supervisor.streams",
    "Result": "modelpool.supervisor.pool",
    "PoolConfig": "modelpool.shared.config",
    "RetryPolicy": "modelpool.shared.config",
    "ServerConfig": "modelpool.shared.config",
    "Generation": "modelpool.shared.protocol",
    "TokenIds": "modelpool.shared.protocol",
    "TokenLogprob": "modelpool.shared.protocol",
    "TokenLogprobs": "modelpool.shared.logprob_columns",
    "PoolHealth": "modelpool.supervisor.stats",
    "PoolStats": "modelpool.supervisor.stats",
    "Attempt": "modelpool.shared.errors",
    "PoolError": "modelpool.shared.errors",
    "DeadlineExceeded": "modelpool.shared.errors",
    "WorkerCrashed": "modelpool.shared.errors",
    "PoisonRequest": "modelpool.shared.errors",
    "BackendError": "modelpool.shared.errors",
    "OutOfMemory": "modelpool.shared.errors",
    "CudaError": "modelpool.shared.errors",
    "PoolOverloaded": "modelpool.shared.errors",
    "QueueFull": "modelpool.shared.errors",
    "PoolClosed": "modelpool.shared.errors",
    "ModelLoadFailed": "modelpool.shared.errors",
    "PreflightError": "modelpool.shared.errors",
    "ModelSourceError": "modelpool.shared.errors",
    "DeviceError": "modelpool.shared.errors",
    "InvalidRequest": "modelpool.shared.errors",
    "ContextLengthExceeded": "modelpool.shared.errors",
    "WrongTask": "modelpool.shared.errors",
    "ImageRefused": "modelpool.shared.errors",
    "ImageLimits": "modelpool.shared.images",
    "MalformedToolCall": "modelpool.shared.errors",
    "EmbeddingResult": "modelpool.shared.embeddings",
    "ScoreResult": "modelpool.shared.embeddings",
    "GrammarError": "modelpool.shared.errors",
    "GrammarCompileTimeout": "modelpool.shared.errors",
    "GrammarEngineMissing": "modelpool.shared.errors",
    "SchemaTooComplex": "modelpool.shared.errors",
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
    "ImageLimits",
    "ImageRefused",
    "InvalidRequest",
    "MalformedToolCall",
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
    from modelpool.shared.config import PoolConfig, RetryPolicy, ServerConfig
    from modelpool.shared.embeddings import EmbeddingResult, ScoreResult
    from modelpool.shared.errors import (
        Attempt,
        BackendError,
        ContextLengthExceeded,
        CudaError,
        DeadlineExceeded,
        DeviceError,
        GrammarCompileTimeout,
        GrammarEngineMissing,
        GrammarError,
        ImageRefused,
        InvalidRequest,
        MalformedToolCall,
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
    from modelpool.shared.images import ImageLimits
    from modelpool.shared.logprob_columns import TokenLogprobs
    from modelpool.shared.protocol import Generation, TokenIds, TokenLogprob
    from modelpool.supervisor.pool import ModelPool, PoolFuture, Result
    from modelpool.supervisor.stats import PoolHealth, PoolStats
    from modelpool.supervisor.streams import AsyncPoolStream, PoolStream


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'modelpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
