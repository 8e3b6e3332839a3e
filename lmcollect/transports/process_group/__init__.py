"""Weight sync over a torch.distributed process group: metadata through the store, buffers by broadcast.

One module per role: :mod:`.config` (where and how the two sides meet), :mod:`.sender` (rank 0),
:mod:`.receiver` (ranks 1..n), :mod:`.group` (what both sides use to form and run the group).
"""

from lmcollect.transports.process_group.config import ProcessGroupConfig
from lmcollect.transports.process_group.group import (
    buffer_checksums,
    digest_context,
    gloo_device,
    local_address_toward,
)
from lmcollect.transports.process_group.receiver import ProcessGroupReceiver
from lmcollect.transports.process_group.sender import DIRECT_SEND_MIN_BYTES, ProcessGroupSender
from lmcollect.weights.delta import PreparedPush

__all__ = [
    "DIRECT_SEND_MIN_BYTES",
    "PreparedPush",
    "ProcessGroupConfig",
    "ProcessGroupReceiver",
    "ProcessGroupSender",
    "buffer_checksums",
    "digest_context",
    "gloo_device",
    "local_address_toward",
]
