"""RayReplayBuffer: one ReplayBuffer in a Ray actor, written by many collectors, sampled by the trainer."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError
from tensordict import TensorDictBase

from lmcollect.buffers.replay_buffer import ReplayBuffer
from lmcollect.ray.bounded import DEFAULT_CALL_TIMEOUT_S, get_within
from lmcollect.ray.cluster import actor_options, init_ray


class BufferActorError(RuntimeError):
    """The buffer's actor died (SIGKILL, OOM, its node lost): its contents went with it."""


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
        call_timeout_s: longest any call into the actor waits for its answer (a hung actor
            raises :class:`~lmcollect.ray.bounded.CallTimeoutError` naming this knob).
    """

    def __init__(
        self,
        *,
        capacity: int,
        seed: int | None = None,
        remote_config: dict[str, Any] | None = None,
        ray_init_config: dict[str, Any] | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be positive, got {call_timeout_s!r}.")
        init_ray(ray_init_config)
        options = actor_options(remote_config, defaults={"num_cpus": 0.1, "max_concurrency": 8})
        self._actor = ray.remote(**options)(ReplayBuffer).remote(capacity=capacity, seed=seed)
        self.capacity = capacity
        self.call_timeout_s = call_timeout_s
        self._call("__len__")  # surfaces start-up errors here

    @classmethod
    def _from_actor(cls, actor: Any, capacity: int, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> RayReplayBuffer:
        buffer = cls.__new__(cls)
        buffer._actor, buffer.capacity, buffer.call_timeout_s = actor, capacity, call_timeout_s
        return buffer

    def __reduce__(self) -> tuple:
        # Pickles as the actor handle: every copy (in any collector actor) writes to the same buffer.
        return (RayReplayBuffer._from_actor, (self._actor, self.capacity, self.call_timeout_s))

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ref = getattr(self._actor, method).remote(*args, **kwargs)
        try:
            return get_within(
                ref, timeout_s=self.call_timeout_s, call=f"RayReplayBuffer.{method}", knob="call_timeout_s"
            )
        except RayActorError as exc:  # designed for: a dead actor is a fault the caller must act on
            raise BufferActorError(
                f"RayReplayBuffer.{method}(): the buffer's actor died ({type(exc).__name__}), and its contents with "
                "it. Build a new RayReplayBuffer and restore the last checkpoint into it "
                "(load_checkpoint(folder, collectors, replay_buffer=new_buffer))."
            ) from exc

    @property
    def actor(self) -> Any:
        return self._actor

    def extend(self, data: TensorDictBase) -> int:
        return self._call("extend", data)

    def add(self, turn: TensorDictBase) -> int:
        return self._call("add", turn)

    def sample(self, batch_size: int, *, replace: bool = True, min_policy_version: int | None = None) -> TensorDictBase:
        return self._call("sample", batch_size, replace=replace, min_policy_version=min_policy_version)

    def __len__(self) -> int:
        return self._call("__len__")

    @property
    def write_count(self) -> int:
        return self._call("get_write_count")

    def empty(self) -> None:
        self._call("empty")

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def state_since(self, token: dict | None) -> dict:
        """:meth:`ReplayBuffer.state_since`: the turns written since ``token`` (incremental checkpoints)."""
        return self._call("state_since", token)

    def check_state_dict(self, state: dict) -> None:
        """Raise ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._call("check_state_dict", state)

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def shutdown(self) -> None:
        """Release the actor (the data goes with it)."""
        ray.kill(self._actor, no_restart=True)
