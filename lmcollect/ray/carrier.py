"""The one way weights travel through Ray: one object-store object, whose buffers a reader maps without a copy."""

from __future__ import annotations

from typing import Any

import ray

from lmcollect.weights.buckets import WeightBuckets, view_buckets
from lmcollect.weights.delta import WeightDelta
from lmcollect.weights.lora import is_lora_source, lora_adapter
from lmcollect.weights.tensors import to_weight_dict


def ray_payload(source: Any) -> Any:
    """What a push puts into the object store for ``source``: its bytes as numpy buffers (a
    reader maps them zero-copy; torch tensors would be copied out on every read).

    - a LoRA source: the adapter itself, on the CPU (its tensors only);
    - :class:`~lmcollect.weights.delta.WeightDelta`: the delta with its arrays as numpy buffers;
    - :class:`~lmcollect.weights.buckets.WeightBuckets` (packed already): its buffers as they are;
    - anything else with named tensors (a module, a TensorDict, a dict):
      views of its tensors' bytes, not packed (the one copy is ``ray.put``'s).
    """
    if is_lora_source(source):
        return lora_adapter(source).to("cpu")
    if isinstance(source, WeightDelta):
        return WeightDelta(source.base_version, source.entries, source.arrays.to_numpy())
    if isinstance(source, WeightBuckets):
        return source.to_numpy()
    return view_buckets(to_weight_dict(source)).to_numpy()


def put_weights(source: Any) -> ray.ObjectRef:
    """``ray.put`` of :func:`ray_payload`: one object, shared by every reader."""
    return ray.put(ray_payload(source))
