"""RayContinuousLLMCollector: the continuous collector in a Ray actor, with RayLLMCollector's API."""

from __future__ import annotations

from typing import Any, ClassVar

from lmcollect.collectors.continuous.collector import ContinuousLLMCollector
from lmcollect.ray.collector import RayContinuousWorker, RayLLMCollector


class RayContinuousLLMCollector(RayLLMCollector):
    """A :class:`~lmcollect.collectors.ContinuousLLMCollector` in a Ray actor.

    Arguments are those of ``ContinuousLLMCollector``, with the engine given as ``engine_factory``
    (called inside the actor, so no model travels through the driver; the env list or env
    factory and the tokenizer are pickled into it), plus the Ray arguments of every Ray collector
    (``ray_init_config``, ``remote_config``, ``num_cpus`` / ``num_gpus``, ``sync_iter``,
    ``call_timeout_s``, ``collect_timeout_s``; see :class:`~lmcollect.ray.collector.RayActorConfig`).
    Every method works as on ``RayLLMCollector``: iteration, ``start()`` into a
    :class:`~lmcollect.buffers.RayReplayBuffer`, ``pause()``, weight pushes (they land between two
    decoding steps of the actor's engine), restarts.

    Example::

        buffer = RayReplayBuffer(capacity=100_000)
        collector = RayContinuousLLMCollector(make_env, engine_factory=make_engine, tokenizer=tokenizer,
                                              dialog_turns_per_batch=64, max_dialogs_in_flight=32,
                                              replay_buffer=buffer, track_policy_version=True)
        collector.start()
        ...  # sample from buffer, train, collector.update_policy_weights_(model)
    """

    local_collector = ContinuousLLMCollector
    _renamed: ClassVar[dict[str, str]] = {"engine_factory": "engine"}  # built inside the actor: only a factory travels

    def _collector_arguments(self, env: Any, arguments: dict[str, Any]) -> dict[str, Any]:
        engine_factory = arguments.get("engine_factory")
        if engine_factory is not None and not callable(engine_factory):
            raise TypeError(
                f"engine_factory must be a callable building the engine inside the actor, got {type(engine_factory).__name__}."
            )
        return super()._collector_arguments(env, arguments)

    @classmethod
    def _actor_body(cls) -> type:
        return RayContinuousWorker
