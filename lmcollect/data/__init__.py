"""Data types shared by every layer: chat histories, the keys of a collected turn, batch helpers."""

from lmcollect.data import keys
from lmcollect.data.history import History, Message
from lmcollect.data.turns import flatten_turns, non_tensor_values, stack_turns

__all__ = ["History", "Message", "flatten_turns", "keys", "non_tensor_values", "stack_turns"]
