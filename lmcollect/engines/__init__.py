"""Inference engines behind one interface (:class:`EngineProtocol`): submit, pause, resume, load weights."""
from lmcollect.engines.protocol import EngineClosedError, EngineProtocol, EngineRequest, EngineResult
from lmcollect.engines.transformers_engine import TransformersEngine

__all__ = ["EngineClosedError", "EngineProtocol", "EngineRequest", "EngineResult", "TransformersEngine"]
