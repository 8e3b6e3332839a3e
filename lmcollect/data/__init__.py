"""Data types shared by every layer: chat histories and the keys of a collected turn."""
from lmcollect.data import keys
from lmcollect.data.history import History, Message

__all__ = ["History", "Message", "keys"]
