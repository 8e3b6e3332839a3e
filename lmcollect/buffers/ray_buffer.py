"""RayReplayBuffer: one ReplayBuffer in a Ray actor, written by many collectors, sampled by the trainer."""
from __future__ import annotations

from typing import Any

import ray
from tensordict import TensorDictBase

from lmcollect.buffers.replay_buffer import ReplayBuffer
from lmcollect.distributed.ray_cluster import actor_options, init_ray


class RayReplayBuffer:
    """The :class:`ReplayBuffer` API, backed by an actor.

    Collectors in other actors call :meth:`extend` on their pickled copy, which talks to the
    same actor, so data goes from collector to buffer without passing through the driver.
    Data in the buffer outlives any collector.

    Args:
        capacity: turns kept.
        seed: seed of the sampling generator.
        remote_config: actor options (default: a tenth of a CPU).
        ray_init_config: ``ray.init`` arguments if Ray is not running yet.
    """

    def __init__(
        self,
        *,
        capacity: int,
        seed: int | None = None,
        remote_config: dict[str, Any] | None = None,
        ray_init_config: dict[str, Any] | None = None,
    ) -> None:
        init_ray(ray_init_config)
        options = actor_options(remote_config, defaults={"num_cpus": 0.1, "max_concurrency": 8})
        self._actor = ray.remote(**options)(ReplayBuffer).remote(capacity=capacity, seed=seed)
        self.capacity = capacity
        ray.get(self._actor.__len__.remote())

    @classmethod
    def _from_actor(cls, actor: Any, capacity: int) -> RayReplayBuffer:
        buffer = cls.__new__(cls)
        buffer._actor, buffer.capacity = actor, capacity
        return buffer

    def __reduce__(self) -> tuple:
        # Pickles as the actor handle: every copy (in any collector actor) writes to the same buffer.
        return (RayReplayBuffer._from_actor, (self._actor, self.capacity))

    @property
    def actor(self) -> Any:
        return self._actor

    def extend(self, data: TensorDictBase) -> int:
        return ray.get(self._actor.extend.remote(data))

    def add(self, turn: TensorDictBase) -> int:
        return ray.get(self._actor.add.remote(turn))

    def sample(self, batch_size: int, *, replace: bool = True, min_policy_version: int | None = None) -> TensorDictBase:
        return ray.get(self._actor.sample.remote(batch_size, replace=replace, min_policy_version=min_policy_version))

    def __len__(self) -> int:
        return ray.get(self._actor.__len__.remote())

    @property
    def write_count(self) -> int:
        return ray.get(self._actor.get_write_count.remote())

    def empty(self) -> None:
        ray.get(self._actor.empty.remote())

    def state_dict(self) -> dict:
        return ray.get(self._actor.state_dict.remote())

    def load_state_dict(self, state: dict) -> None:
        ray.get(self._actor.load_state_dict.remote(state))

    def shutdown(self) -> None:
        """Release the actor (the data goes with it)."""
        ray.kill(self._actor, no_restart=True)
