"""Replay buffers that collectors fill and trainers sample from."""
from lmcollect.buffers.replay_buffer import ReplayBuffer

__all__ = ["ReplayBuffer"]
