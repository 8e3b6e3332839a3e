"""Weight transports (the "schemes" collectors register): one module per mechanism, each a ``<Mechanism>Sender`` and ``<Mechanism>Receiver``."""

from lmcollect.transports.base import WeightReceiver, WeightSender

__all__ = ["WeightReceiver", "WeightSender"]
