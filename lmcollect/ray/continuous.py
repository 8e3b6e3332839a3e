"""RayContinuousLLMCollector: the continuous collector in a Ray actor, with RayLLMCollector's API."""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from tensordict import TensorDictBase

from lmcollect.ray.collector import RayLLMCollector, RayContinuousWorker
from lmcollect.collectors.versioning import PolicyVersion
from lmcollect.engines.protocol import EngineProtocol
from lmcollect.engines.sampling import SamplingConfig


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

    def __init__(
        self,
        env: Any,
        *,
        engine_factory: Callable[[], EngineProtocol],
        tokenizer: Any,
        sampling: SamplingConfig | None = None,
        stop_token_ids: Collection[int] | None = None,
        dialog_turns_per_batch: int,
        total_dialog_turns: int = -1,
        yield_only_last_steps: bool | None = None,
        yield_completed_trajectories: bool | None = None,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        replay_buffer: Any | None = None,
        flatten_data: bool | None = None,
        weight_updater: Any | None = None,
        track_policy_version: bool | PolicyVersion = False,
        max_policy_lag: int | None = None,
        max_dialogs_in_flight: int | None = None,
        max_buffered_turns: int | None = None,
        verbose: bool = False,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        sync_iter: bool = True,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        call_timeout_s: float | None = 120.0,
        collect_timeout_s: float | None = 1800.0,
    ) -> None:
        if not callable(engine_factory):
            raise TypeError(
                f"engine_factory must be a callable building the engine inside the actor, got {type(engine_factory).__name__}."
            )
        self._policy_arg = None
        arguments = locals()
        arguments["engine"] = arguments.pop("engine_factory")  # the collector's engine argument, built in the actor
        self._launch(env, arguments, weight_updater=weight_updater)

    @classmethod
    def _actor_body(cls) -> type:
        return RayContinuousWorker
