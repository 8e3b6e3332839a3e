"""vLLM engine replicas as Ray actors: :class:`~lmcollect.engines.vllm.engine.VLLMEngine` in each, one router in front."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcollect.engines.router import EngineRouter
from lmcollect.engines.vllm.engine import VLLMEngine
from lmcollect.ray.bounded import DEFAULT_CALL_TIMEOUT_S
from lmcollect.ray.engine import RayEngine, start_ray_engines

logger = logging.getLogger(__name__)


def _with_env_vars(options: dict[str, Any], env_vars: dict[str, str] | None) -> dict[str, Any]:
    """``options`` with ``env_vars`` over its ``runtime_env``'s (the actor's defaults are ``start_ray_engines``')."""
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **(env_vars or {})}
    return {**options, "runtime_env": runtime_env}


class VLLMReplicas(EngineRouter):
    """``num_replicas`` :class:`VLLMEngine` actors behind one :class:`EngineRouter` (itself an engine).

    Pass it as ``VLLMPolicy(model_path, engine=VLLMReplicas(model_path, num_replicas=2, ...))`` or as
    a continuous collector's engine. Requests go to the least-loaded replica (one dialog's turns to
    one replica); weight loads, pauses and worker RPCs reach every replica. Ray must be running
    (see ``lmcollect.ray.cluster.init_ray``).

    Args:
        model_path: a model folder every actor can read.
        num_replicas: number of engine actors.
        engine_kwargs: ``vllm.EngineArgs`` of every replica (see :class:`VLLMEngine`).
        remote_config: actor options (``num_cpus``, ``num_gpus``, ``runtime_env``...); default ``num_cpus=1``.
        env_vars: environment of the actors, over ``runtime_env``'s (vLLM reads its settings
            there, e.g. ``VLLM_CPU_KVCACHE_SPACE``).
        start_timeout_s: longest the replicas may take to start.
        call_timeout_s: longest one control call into a replica (a pause, a weight load, a worker
            RPC) waits; a hung actor raises :class:`~lmcollect.ray.bounded.CallTimeoutError`.
            Generation requests are futures: their callers bound them.
    """

    engines: Sequence[RayEngine]  # every replica is the proxy of an engine actor

    def __init__(
        self,
        model_path: str | Path,
        *,
        num_replicas: int = 1,
        engine_kwargs: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        start_timeout_s: float = 900.0,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        options = _with_env_vars(remote_config or {}, env_vars)
        factory = functools.partial(VLLMEngine, str(model_path), engine_kwargs=engine_kwargs)
        super().__init__(start_ray_engines(
            factory, num_replicas=num_replicas, remote_config=options,
            start_timeout_s=start_timeout_s, call_timeout_s=call_timeout_s,
        ))  # fmt: skip
        self.model_path = str(model_path)
        logger.info("started %d vLLM replica(s) of %s", num_replicas, model_path)

    @property
    def actors(self) -> list[Any]:
        """The replicas' Ray actor handles, in replica order."""
        return [engine.actor for engine in self.engines]

    def shutdown(self) -> None:
        """Close every replica and end its actor (same as :meth:`close`)."""
        self.close()
