"""Inference engines behind one interface (:class:`EngineProtocol`): submit, pause, resume, load weights."""
from __future__ import annotations

from importlib import import_module
from typing import Any

from lmcollect.engines.protocol import (
    EngineClosedError,
    EngineProtocol,
    EngineRequest,
    EngineResult,
    WorkerRpcEngine,
    engine_of,
    worker_rpc_engine_of,
)
from lmcollect.engines.router import EngineRouter

# vLLM is an optional extra and slow to import, Ray and transformers too: their modules are imported
# when first used
_LAZY = {
    "TransformersEngine": "lmcollect.engines.transformers_engine",
    "VLLMAsyncEngine": "lmcollect.engines.vllm_async",
    "RayEngine": "lmcollect.engines.ray_engine",
    "ray_engine_replicas": "lmcollect.engines.ray_engine",
}

__all__ = [
    "EngineClosedError",
    "EngineProtocol",
    "EngineRequest",
    "EngineResult",
    "EngineRouter",
    "WorkerRpcEngine",
    "engine_of",
    "worker_rpc_engine_of",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmcollect.engines' has no attribute {name!r}")
