"""Weight transports (the "schemes" collectors register): one module per mechanism, each a ``<Mechanism>Sender`` and ``<Mechanism>Receiver``."""

from lmcollect.lazy import lazy_attributes
from lmcollect.transports.base import WeightReceiver, WeightSender

# torch.distributed (the process group) is imported only by a process that pushes that way
_LAZY = {
    "SharedMemorySender": "lmcollect.transports.shared_memory",
    "SharedMemoryReceiver": "lmcollect.transports.shared_memory",
    "ProcessGroupConfig": "lmcollect.transports.process_group",
    "ProcessGroupSender": "lmcollect.transports.process_group",
    "ProcessGroupReceiver": "lmcollect.transports.process_group",
}

__all__ = ["WeightReceiver", "WeightSender", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)
