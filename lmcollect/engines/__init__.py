"""Inference engines behind one interface (:class:`EngineProtocol`): submit, pause, resume, load weights."""

from __future__ import annotations

from lmcollect.engines.protocol import (
    BatchGenerating,
    EngineCapabilities,
    EngineClosedError,
    EngineDiedError,
    EngineProtocol,
    EngineRequest,
    EngineResult,
    PromptTooLongError,
    StalePushError,
    WorkerRpcEngine,
    capabilities_of,
    engine_of,
    worker_rpc_engine_of,
)
from lmcollect.engines.router import EngineRouter
from lmcollect.lazy import lazy_attributes

# vLLM and transformers are slow to import: their modules are imported when first used (an engine in
# a Ray actor: lmcollect.ray.RayEngine)
_LAZY = {
    "TransformersEngine": "lmcollect.engines.hf.engine",
    "VLLMEngine": "lmcollect.engines.vllm.engine",
}

__all__ = [
    "BatchGenerating",
    "EngineCapabilities",
    "EngineClosedError",
    "EngineDiedError",
    "EngineProtocol",
    "EngineRequest",
    "EngineResult",
    "EngineRouter",
    "PromptTooLongError",
    "StalePushError",
    "WorkerRpcEngine",
    "capabilities_of",
    "engine_of",
    "worker_rpc_engine_of",
    *_LAZY,
]


__getattr__ = lazy_attributes(__name__, _LAZY)
