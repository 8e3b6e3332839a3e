"""vLLM engine replicas as Ray actors, behind the same ``BatchEngineProtocol`` as an in-process engine."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from lmcollect.ray.bounded import get_within
from lmcollect.ray.cluster import actor_options
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.vllm_common import Completion
from lmcollect.policies.vllm_policy import VLLMEngine

logger = logging.getLogger(__name__)

# The actor is already the engine's own process: running vLLM in it starts much faster than
# spawning an engine-core process. Callers can override any of these.
DEFAULT_ENV_VARS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Any max_concurrency works: each VLLMEngine runs its calls on its own engine thread, one at a time.
_ACTOR_DEFAULTS: dict[str, Any] = {"num_cpus": 1}


def split_evenly(num_items: int, num_parts: int) -> list[range]:
    """Contiguous index ranges of ``num_items`` over ``num_parts`` (sizes differ by at most one)."""
    base, extra = divmod(num_items, num_parts)
    bounds, start = [], 0
    for part in range(num_parts):
        stop = start + base + (1 if part < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def _with_env_vars(options: dict[str, Any], env_vars: dict[str, str] | None) -> dict[str, Any]:
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**DEFAULT_ENV_VARS, **runtime_env.get("env_vars", {}), **(env_vars or {})}
    return {**options, "runtime_env": runtime_env}


class VLLMReplicas:
    """``num_replicas`` :class:`VLLMEngine` actors; each batch is split evenly over them.

    Pass it as ``VLLMPolicy(model_path, engine=VLLMReplicas(model_path, num_replicas=2, ...))``.
    Ray must be running (see ``lmcollect.ray.cluster.init_ray``).

    Args:
        model_path: a model folder every actor can read.
        num_replicas: number of engine actors.
        engine_kwargs: ``vllm.LLM`` arguments of every replica (see :class:`VLLMEngine`).
        remote_config: actor options (``num_cpus``, ``num_gpus``, ``runtime_env``,
            ``max_concurrency``...); default ``num_cpus=1``.
        env_vars: environment of the actors, over :data:`DEFAULT_ENV_VARS` and ``runtime_env``'s
            (vLLM reads its settings there, e.g. ``VLLM_CPU_KVCACHE_SPACE``).
        start_timeout_s: longest the replicas may take to start.
        call_timeout_s: longest one call into the replicas (a batch's generation, a worker RPC)
            waits; a hung actor raises :class:`~lmcollect.ray.bounded.CallTimeoutError`.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        num_replicas: int = 1,
        engine_kwargs: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        start_timeout_s: float = 900.0,
        call_timeout_s: float = 600.0,
    ) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}.")
        options = _with_env_vars(actor_options(remote_config, defaults=_ACTOR_DEFAULTS), env_vars)
        actor_cls = ray.remote(**options)(VLLMEngine)
        self.actors = [actor_cls.remote(model_path, engine_kwargs=engine_kwargs) for _ in range(num_replicas)]
        self.call_timeout_s = call_timeout_s
        get_within(  # surface start-up errors here
            [actor.ready.remote() for actor in self.actors],
            timeout_s=start_timeout_s, call="VLLMReplicas start-up", knob="start_timeout_s",
        )
        logger.info("started %d vLLM replica(s) of %s", num_replicas, model_path)

    @property
    def num_replicas(self) -> int:
        return len(self.actors)

    def generate_tokens(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
    ) -> list[Completion]:
        """Completions in prompt order; replica ``i`` answers the ``i``-th contiguous slice."""
        futures = []
        for actor, part in zip(self.actors, split_evenly(len(prompts), self.num_replicas)):
            if part:
                part_seeds = None if seeds is None else seeds[part.start : part.stop]
                futures.append(actor.generate_tokens.remote(
                    prompts[part.start : part.stop], sampling, part_seeds, stop_token_ids=list(stop_token_ids)
                ))
        return [completion for chunk in self._get(futures, "generate_tokens") for completion in chunk]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` on every worker of every replica, all at once; results replica by replica."""
        results = self._get([actor.collective_rpc.remote(method, args, kwargs) for actor in self.actors], f"collective_rpc({method!r})")
        return [result for replica in results for result in replica]

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every worker, replica ``i`` with ``args_per_replica[i]`` (e.g. its ranks)."""
        if len(args_per_replica) != self.num_replicas:
            raise ValueError(f"got arguments for {len(args_per_replica)} replicas; there are {self.num_replicas}.")
        refs = [actor.collective_rpc.remote(method, args, kwargs) for actor, args in zip(self.actors, args_per_replica)]
        results = []
        for index, ref in enumerate(refs):
            try:
                results += self._get(ref, f"collective_rpc({method!r}) on replica {index}")
            except RayActorError as exc:  # name the replica: the caller reports which engine died
                raise RuntimeError(f"vLLM replica {index} died during {method}: {exc}") from exc
        return results

    def reset_prefix_cache(self) -> None:
        self._get([actor.reset_prefix_cache.remote() for actor in self.actors], "reset_prefix_cache")

    def _get(self, refs: Any, call: str) -> Any:
        return get_within(refs, timeout_s=self.call_timeout_s, call=f"VLLMReplicas.{call}", knob="call_timeout_s")

    def shutdown(self) -> None:
        """Kill the actors (their engines go with them)."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
