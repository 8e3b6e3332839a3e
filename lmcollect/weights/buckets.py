"""Weights as a few byte buffers plus a layout (the metadata, sent first): packing and views.

A :class:`WeightBuckets` is what every transport moves: a :class:`BucketLayout` (name, dtype,
shape and byte offset of every tensor) and the byte buffers it points into. Two ways to build one:

* :func:`pack_buckets` copies the tensors into one flat buffer per dtype (split at
  ``bucket_size_bytes``). Transports that move raw buffers (a process-group broadcast, a shared
  buffer) use it: a handful of large messages instead of one per tensor.
* :func:`view_buckets` copies nothing: each distinct tensor is its own buffer. Ray's object store
  writes all of them back to back into one shared-memory object with a single copy, so packing
  first would only add a copy.

Receivers get zero-copy views with :meth:`WeightBuckets.tensors` and validate
:meth:`BucketLayout.metadata` against their model before loading anything; a layout that comes
from another process is checked with :func:`layout_problems` and :func:`max_layout_nbytes`
before any buffer is allocated for it.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN_BYTES = 64  # every tensor starts on a 64-byte boundary, so any dtype view is aligned

_packs_made = 0
_packs_lock = threading.Lock()


def packs_made() -> int:
    """How many times :func:`pack_buckets` has copied weights into buffers in this process: a push
    packs once, where its sender makes it; receivers pass the buckets on as they are (tests read it)."""
    return _packs_made


def _count_pack() -> None:
    global _packs_made
    with _packs_lock:
        _packs_made += 1


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives: a byte range of one buffer."""

    name: str
    """State-dict name of the tensor."""
    dtype: torch.dtype
    """Its dtype."""
    shape: tuple[int, ...]
    """Its shape."""
    buffer_index: int
    """Index of the buffer that holds it."""
    offset_bytes: int
    """Byte offset of its first element in that buffer (a multiple of ``ALIGN_BYTES``)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BucketLayout:
    """The metadata of one push: every tensor's slot, and the size of every buffer."""

    slots: tuple[TensorSlot, ...]
    """One slot per name; tied names may share a byte range."""
    buffer_nbytes: tuple[int, ...]
    """Size in bytes of each buffer."""

    def metadata(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """name -> (dtype, shape), the form receivers check against their model."""
        return {s.name: (s.dtype, torch.Size(s.shape)) for s in self.slots}

    @property
    def total_nbytes(self) -> int:
        return sum(self.buffer_nbytes)


@dataclass
class WeightBuckets:
    """A layout and the byte buffers it points into (1-D uint8 torch tensors or numpy arrays)."""

    layout: BucketLayout
    """Where each tensor is."""
    buffers: list[Any]
    """The bytes; numpy arrays when the buckets travel through Ray's object store."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> a view of its bytes with the right dtype and shape (no copy)."""
        flat = [_as_byte_tensor(b) for b in self.buffers]
        return {s.name: _slot_view(flat[s.buffer_index], s) for s in self.layout.slots}

    def to_numpy(self) -> WeightBuckets:
        """The same buckets with numpy buffers (zero-copy; a GPU buffer is copied to the CPU), which
        Ray stores without pickling bytes."""
        return WeightBuckets(
            self.layout, [b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else b for b in self.buffers]
        )

    @property
    def nbytes(self) -> int:
        return self.layout.total_nbytes


def _as_byte_tensor(buffer: Any) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer
    with warnings.catch_warnings():
        # Object-store arrays are read-only; we only read them (copy_ into the model).
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(buffer))


def _slot_view(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    end = slot.offset_bytes + slot.nbytes
    if end > flat.numel():
        raise ValueError(
            f"weight buckets are corrupt: {slot.name!r} needs bytes [{slot.offset_bytes}, {end}) "
            f"of buffer {slot.buffer_index}, which has {flat.numel()} bytes."
        )
    if slot.nbytes == 0:  # empty byte views may have stride 0, which view(dtype) refuses
        return torch.empty(slot.shape, dtype=slot.dtype, device=flat.device)
    return flat[slot.offset_bytes : end].view(slot.dtype).view(slot.shape)


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def tie_key(tensor: torch.Tensor) -> tuple:
    """Tensors with equal keys are the same memory (tied weights): sent once."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


def plan_layout(
    weights: Mapping[str, torch.Tensor],
    *,
    bucket_size_bytes: int | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    own_buffer_min_bytes: int | None = None,
) -> BucketLayout:
    """One buffer per dtype (in order of first appearance), split when a buffer would pass
    ``bucket_size_bytes`` (a tensor larger than that gets a buffer of its own). ``dtypes``
    (name -> dtype) stores those tensors in another dtype (see :func:`pack_buckets`).
    ``own_buffer_min_bytes``: tensors of at least this size get a buffer of their own (which a
    sender can put on the wire as it is, see ``pack_buckets(direct=True)``)."""
    if bucket_size_bytes is not None and bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be positive or None, got {bucket_size_bytes}.")
    open_buffer: dict[torch.dtype, int] = {}  # dtype -> index of the buffer being filled
    sizes: list[int] = []
    seen: dict[tuple, tuple[int, int]] = {}
    slots = []
    for name, tensor in weights.items():
        key = tie_key(tensor)
        dtype = tensor.dtype if dtypes is None else dtypes.get(name, tensor.dtype)
        if key not in seen:
            nbytes = tensor.numel() * dtype.itemsize
            if own_buffer_min_bytes is not None and nbytes >= own_buffer_min_bytes:
                seen[key] = (len(sizes), 0)
                sizes.append(nbytes)
            else:
                seen[key] = _place(nbytes, dtype, open_buffer, sizes, bucket_size_bytes)
        index, offset = seen[key]
        slots.append(TensorSlot(name, dtype, tuple(tensor.shape), index, offset))
    return BucketLayout(tuple(slots), tuple(sizes))


def _place(nbytes: int, dtype: torch.dtype, open_buffer: dict, sizes: list[int], cap: int | None) -> tuple[int, int]:
    index = open_buffer.get(dtype)
    if index is None or (cap is not None and sizes[index] > 0 and _align(sizes[index]) + nbytes > cap):
        index = len(sizes)
        sizes.append(0)
        open_buffer[dtype] = index
    offset = _align(sizes[index])
    sizes[index] = offset + nbytes
    return index, offset


def pack_buckets(
    weights: Mapping[str, torch.Tensor],
    *,
    bucket_size_bytes: int | None = None,
    out: list[torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    layout: BucketLayout | None = None,
    on_buffer_packed: Callable[[int, torch.Tensor], None] | None = None,
    direct: bool = False,
) -> WeightBuckets:
    """Copy ``weights`` into flat per-dtype buffers (reusing ``out`` when its sizes match).

    ``dtypes`` (name -> dtype) casts those tensors while they are copied into their buffer: a
    cast copy of the whole model is never made (e.g. an fp32 trainer sending to a bf16 engine).
    ``on_buffer_packed(index, buffer)`` is called for every buffer, in index order, as soon as it
    and every buffer before it are full: a sender can put buffer ``i`` on the wire while later
    buffers are still being packed. ``layout``: the :func:`plan_layout` of these arguments, if the
    caller already made it. ``direct=True``: a buffer holding exactly one tensor that already has
    its bytes in order (contiguous, on ``device``, in the buffer's dtype) is that tensor's bytes,
    not a copy (``out`` is then ignored: never write into such buffers).
    """
    layout = layout if layout is not None else plan_layout(weights, bucket_size_bytes=bucket_size_bytes, dtypes=dtypes)
    device = torch.device(device) if device is not None else _common_device(weights)
    _count_pack()
    views = _direct_views(layout, weights, device) if direct else {}
    if (
        not direct
        and out is not None
        and [(b.numel(), b.device) for b in out] == [(n, device) for n in layout.buffer_nbytes]
    ):
        buffers = out
    else:
        buffers = [
            views[i] if i in views else torch.empty(n, dtype=torch.uint8, device=device)
            for i, n in enumerate(layout.buffer_nbytes)
        ]
    last_slot = {slot.buffer_index: position for position, slot in enumerate(layout.slots)}
    full, announced = [False] * len(buffers), 0
    copied: set[tuple] = set()
    with torch.no_grad():
        for position, (slot, tensor) in enumerate(zip(layout.slots, weights.values(), strict=True)):
            key = tie_key(tensor)
            if key not in copied and slot.buffer_index not in views:  # else a tied alias, or sent as it is
                copied.add(key)
                _slot_view(buffers[slot.buffer_index], slot).copy_(tensor)
            if on_buffer_packed is not None and last_slot[slot.buffer_index] == position:
                full[slot.buffer_index] = True
                while announced < len(buffers) and full[announced]:
                    on_buffer_packed(announced, buffers[announced])
                    announced += 1
    return WeightBuckets(layout, buffers)


class PackTarget:
    """A layout's slot views into buffers kept from push to push, made once (an engine's pack set).

    Packing into it is one ``torch._foreach_copy_`` for every tensor and one NaN/Inf check per
    buffer, instead of a few torch calls per tensor. Each of those calls gives up the GIL and must
    take it back: beside a busy collector (dialog tasks, a decoding thread) a thread waits up to the
    interpreter's switch interval each time, so the per-tensor loop of :func:`pack_buckets` took
    seconds where its copy takes tens of milliseconds. The buffers' padding must hold zeros (new
    buffers: :meth:`allocate`; shared-memory files start zeroed), so a whole buffer can be checked.
    """

    def __init__(self, layout: BucketLayout, buffers: list[torch.Tensor]) -> None:
        self.layout, self.buffers = layout, buffers
        self._views = [_slot_view(buffers[slot.buffer_index], slot) for slot in layout.slots]
        first: dict[tuple[int, int], int] = {}  # a tied alias shares its slot's bytes: copied once
        for i, slot in enumerate(layout.slots):
            first.setdefault((slot.buffer_index, slot.offset_bytes), i)
        self._copied = sorted(first.values())
        dtypes = {slot.buffer_index: slot.dtype for slot in layout.slots}  # a buffer holds one dtype
        self._typed = [buffer.view(dtypes.get(i, torch.uint8)) for i, buffer in enumerate(buffers)]

    @classmethod
    def allocate(cls, layout: BucketLayout, device: torch.device | str = "cpu") -> PackTarget:
        """New zeroed buffers for ``layout``."""
        return cls(layout, [torch.zeros(n, dtype=torch.uint8, device=device) for n in layout.buffer_nbytes])

    def pack(self, weights: Mapping[str, torch.Tensor], *, check_finite: bool = False) -> WeightBuckets:
        """Copy ``weights`` (the names and order :attr:`layout` was planned from) into the buffers; with
        ``check_finite``, a ``ValueError`` naming every tensor holding NaN or Inf (nothing is loaded from them)."""
        _count_pack()
        tensors = list(weights.values())
        if len(tensors) != len(self._views):
            raise ValueError(
                f"{len(tensors)} tensors for a layout of {len(self._views)}; plan the layout from these weights."
            )
        with torch.no_grad():  # no torch call per tensor: each would wait for the GIL (see the class)
            torch._foreach_copy_([self._views[i] for i in self._copied], [tensors[i] for i in self._copied])
        if check_finite and any(holds_non_finite(typed) for typed in self._typed):
            names = [
                slot.name for slot, view in zip(self.layout.slots, self._views, strict=True) if holds_non_finite(view)
            ]
            raise ValueError(
                f"weight push rejected, no weight was changed: {names[:20]} hold NaN or infinite values "
                "(allow_non_finite=True pushes them anyway)."
            )
        return WeightBuckets(self.layout, self.buffers)


def holds_non_finite(tensor: torch.Tensor, *, as_dtype: torch.dtype | None = None) -> bool:
    """Whether a floating tensor holds a NaN or an infinity (once cast to ``as_dtype``, when given):
    one min/max pass (NaN propagates through both, so min and max are finite exactly when every
    element is; cheaper than ``isfinite(t).all()``; a cast is monotonic, so the extremes overflow first)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    low, high = torch.aminmax(tensor.detach())
    if as_dtype is not None and as_dtype != tensor.dtype and as_dtype.is_floating_point:
        low, high = low.to(as_dtype), high.to(as_dtype)
    return not bool(torch.isfinite(low) & torch.isfinite(high))


def _direct_views(
    layout: BucketLayout, weights: Mapping[str, torch.Tensor], device: torch.device
) -> dict[int, torch.Tensor]:
    """Buffer index -> the bytes of the one tensor it holds, where they can be sent as they are."""
    counts: dict[int, int] = {}
    for slot in layout.slots:
        counts[slot.buffer_index] = counts.get(slot.buffer_index, 0) + 1
    views: dict[int, torch.Tensor] = {}
    for slot, tensor in zip(layout.slots, weights.values(), strict=True):
        usable = (
            tensor.dtype == slot.dtype and tensor.device == device and tensor.is_contiguous() and tensor.numel() > 0
        )
        # tied aliases name the same tensor; any other second slot means a shared buffer
        if (
            usable
            and slot.buffer_index not in views
            and (counts[slot.buffer_index] == 1 or _all_tied(layout, slot.buffer_index))
        ):
            views[slot.buffer_index] = tensor.detach().reshape(-1).view(torch.uint8)
    return views


def _all_tied(layout: BucketLayout, index: int) -> bool:
    """Whether every slot of buffer ``index`` starts at offset 0 (tied aliases of one tensor)."""
    return all(s.offset_bytes == 0 for s in layout.slots if s.buffer_index == index)


def view_buckets(weights: Mapping[str, torch.Tensor]) -> WeightBuckets:
    """One buffer per distinct CPU tensor, viewing its bytes (a copy only if not contiguous or on GPU)."""
    buffers: list[torch.Tensor] = []
    seen: dict[tuple, int] = {}
    slots = []
    for name, tensor in weights.items():
        key = tie_key(tensor)
        if key not in seen:
            seen[key] = len(buffers)
            buffers.append(_bytes_of(tensor))
        slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), seen[key], 0))
    return WeightBuckets(BucketLayout(tuple(slots), tuple(b.numel() for b in buffers)), buffers)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _common_device(weights: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in weights.values()}
    if len(devices) > 1:
        raise ValueError(f"weights are spread over devices {sorted(map(str, devices))}; pass device=... to pack them.")
    return devices.pop() if devices else torch.device("cpu")


def layout_problems(layout: BucketLayout) -> list[str]:
    """Every way ``layout`` (e.g. parsed from an untrusted header) is not a layout :func:`plan_layout`
    or :func:`view_buckets` could have made: sizes that are not non-negative integers, slots outside
    their buffer or off the ``ALIGN_BYTES`` grid, repeated names, buffers no slot uses. Empty: sound."""
    sizes = layout.buffer_nbytes
    problems = [
        f"buffer {i} has size {n!r}, not a non-negative integer" for i, n in enumerate(sizes) if not _is_count(n)
    ]
    if problems:
        return problems
    names: set[str] = set()
    used: set[int] = set()
    for slot in layout.slots:
        problems += _slot_problems(slot, sizes, names)
        names.add(slot.name)
        used.add(slot.buffer_index)
    problems += [f"buffer {i} holds no tensor" for i in range(len(sizes)) if i not in used]
    return problems


def _slot_problems(slot: TensorSlot, sizes: tuple[int, ...], names: set[str]) -> list[str]:
    if slot.name in names:
        return [f"{slot.name!r} appears twice"]
    if (
        not all(_is_count(d) for d in slot.shape)
        or not _is_count(slot.offset_bytes)
        or not _is_count(slot.buffer_index)
    ):
        return [f"{slot.name!r} has a shape, offset or buffer index that is not a non-negative integer"]
    if slot.buffer_index >= len(sizes):
        return [f"{slot.name!r} is in buffer {slot.buffer_index}, of {len(sizes)} buffers"]
    if slot.offset_bytes % ALIGN_BYTES:
        return [f"{slot.name!r} starts at byte {slot.offset_bytes}, not a multiple of {ALIGN_BYTES}"]
    if slot.offset_bytes + slot.nbytes > sizes[slot.buffer_index]:
        return [f"{slot.name!r} ends past its buffer of {sizes[slot.buffer_index]} bytes"]
    return []


def bucket_problems(buckets: WeightBuckets) -> list[str]:
    """:func:`layout_problems` of ``buckets.layout``, and every buffer that is missing or smaller
    than its layout says: what a receiver checks before it hands the buckets on (no byte is read)."""
    problems = layout_problems(buckets.layout)
    sizes = buckets.layout.buffer_nbytes
    if len(buckets.buffers) != len(sizes):
        return [*problems, f"the layout has {len(sizes)} buffers, the buckets {len(buckets.buffers)}"]
    for i, (buffer, size) in enumerate(zip(buckets.buffers, sizes, strict=True)):
        found = _as_byte_tensor(buffer)
        if found.dtype != torch.uint8 or found.dim() != 1 or not found.is_contiguous() or found.numel() < size:
            problems.append(f"buffer {i} is not {size} bytes (a 1-D uint8 buffer of {found.numel()} elements)")
    return problems


def byte_views(buckets: WeightBuckets) -> list[memoryview]:
    """Each buffer's bytes as a memoryview of the same memory (no copy; a buffer on a GPU is copied
    to the CPU): what an in-process vLLM worker's ``load_packed_weights`` takes."""
    views = []
    for buffer in buckets.buffers:
        array = buffer.detach().cpu().numpy() if isinstance(buffer, torch.Tensor) else np.asarray(buffer)
        views.append(array.data)
    return views


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def max_layout_nbytes(metadata: Mapping[str, tuple[torch.dtype, torch.Size]], aliases: Mapping[str, str]) -> int:
    """The most bytes a sound full push of a model with this metadata (and tied ``aliases``) can
    take: every name, aliases too (a trainer may not tie what the model ties), in its own range,
    plus the alignment padding before it."""
    targets = [*metadata, *(name for name in aliases.values() if name in metadata)]
    return sum(math.prod(metadata[name][1]) * metadata[name][0].itemsize + ALIGN_BYTES for name in targets)


def layout_to_json(layout: BucketLayout) -> str:
    """The layout as JSON (what travels ahead of the buffers; no pickle on the wire)."""
    slots = [
        [s.name, str(s.dtype).removeprefix("torch."), list(s.shape), s.buffer_index, s.offset_bytes]
        for s in layout.slots
    ]
    return json.dumps({"slots": slots, "buffer_nbytes": list(layout.buffer_nbytes)})


def layout_from_json(text: str | bytes) -> BucketLayout:
    data = json.loads(text)
    slots = tuple(
        TensorSlot(name, dtype_from_name(dtype), tuple(shape), index, offset)
        for name, dtype, shape, index, offset in data["slots"]
    )
    return BucketLayout(slots, tuple(data["buffer_nbytes"]))


def metadata_to_json(metadata: Mapping[str, tuple[torch.dtype, torch.Size]], aliases: Mapping[str, str]) -> str:
    """A model's metadata (name -> (dtype, shape)) and tied aliases as JSON."""
    meta = {name: [str(dtype).removeprefix("torch."), list(shape)] for name, (dtype, shape) in metadata.items()}
    return json.dumps({"metadata": meta, "aliases": dict(aliases)})


def metadata_from_json(text: str | bytes) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
    data = json.loads(text)
    meta = {name: (dtype_from_name(dtype), torch.Size(shape)) for name, (dtype, shape) in data["metadata"].items()}
    return meta, dict(data["aliases"])


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32`` (only real torch dtypes are accepted)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in weight metadata.")
    return dtype


LOAD_PACKED_WEIGHTS = "load_packed_weights"
"""The vLLM worker extension's method that checks and reloads :func:`packed_weights`."""


def packed_weights(weights: Mapping[str, torch.Tensor]) -> tuple[str, list[np.ndarray]]:
    """``weights`` as a bucket layout (JSON) and its byte buffers (numpy, in this process's memory):
    what a vLLM worker's ``load_packed_weights`` takes, in the call itself (no process group)."""
    buckets = pack_buckets(weights, device="cpu")
    return layout_to_json(buckets.layout), [buffer.numpy() for buffer in buckets.buffers]
