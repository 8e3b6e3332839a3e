"""Weight-sync schemes: one module per mechanism, each a ``<Mechanism>Sender`` and ``<Mechanism>Receiver``."""
from lmcollect.weight_sync.schemes.base import WeightReceiver, WeightSender

__all__ = ["WeightReceiver", "WeightSender"]
