"""Replay buffers that collectors fill and trainers sample from (the Ray actor: ``lmcollect.ray.RayReplayBuffer``)."""

from lmcollect.buffers.replay_buffer import ReplayBuffer

__all__ = ["ReplayBuffer"]
