"""Inference engines behind one interface (:class:`EngineProtocol`): submit, pause, resume, load weights."""
from lmcollect.engines.protocol import EngineProtocol, EngineRequest, EngineResult

__all__ = ["EngineProtocol", "EngineRequest", "EngineResult"]
