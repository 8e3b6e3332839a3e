"""Replay buffers that collectors fill and trainers sample from."""
from lmcollect.buffers.replay_buffer import ReplayBuffer

__all__ = ["RayReplayBuffer", "ReplayBuffer"]


def __getattr__(name: str):
    if name == "RayReplayBuffer":  # imports ray only when asked for
        from lmcollect.buffers.ray_buffer import RayReplayBuffer

        return RayReplayBuffer
    raise AttributeError(name)
