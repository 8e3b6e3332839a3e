"""Delta weight pushes: only the elements that changed since the last push travel, with checksums.

The sender keeps the last pushed weights (:class:`DeltaBase`, in the receivers' dtypes) and the
version they were pushed as. The next push compares the new weights with them bit for bit and
sends, per changed tensor, the changed positions and their new values (a :class:`WeightDelta`),
marked with the version it applies to. A receiver applies a delta only onto that version: it
checks the delta (:func:`prepare_delta`), writes it, and verifies a per-tensor CRC32 over the
changed positions, the values they held before and the values they hold after; on any mismatch
it restores the old values and raises :class:`DeltaRejectedError` (weights and version
unchanged), and the sender answers with a full push. Where the delta crosses a network (a process
group), the checksum is keyed instead (``checksum_key``: a 64-bit HMAC-SHA256 keyed with the group's
secret), so bytes changed on the way cannot be given a matching checksum.

Encodings of the changed positions, per tensor (``DeltaConfig.encoding``):

* ``"indices"`` (the default): uint16 offsets inside blocks of 65536 elements plus one int32
  count per block, 2 bytes per change instead of 4 for int32 positions; the receiver's work
  grows with the changes only;
* ``"bitmask"``: one bit per element; fewer bytes once more than 1 element in 16 changed, but
  the receiver unpacks it (a pass over every element), slower at equal changes (see the
  delta-encodings rows of docs/benchmarks.md, ``benchmarks/weight_sync.py --rows delta-encodings``);
* ``"dense"``: the whole tensor, whenever that is smaller (e.g. a bias every element of which moved).

Pure torch and numpy: no Ray, no torch.distributed.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from lmcollect.weights.buckets import WeightBuckets, tie_key, view_buckets
from lmcollect.weights.digest import keyed_checksum
from lmcollect.weights.tensors import WeightDict
from lmcollect.weights.version import PushVersion

Encoding = Literal["indices", "bitmask", "dense"]
BLOCK_BITS = 16  # "indices" positions: uint16 offsets inside blocks of 2**16 elements
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaRejectedError(RuntimeError):
    """A receiver refused a delta push: it holds another version than the delta's base, the delta
    is malformed, or a checksum failed after applying. Its weights and version are unchanged; the
    sender answers with a full push."""


@dataclass(frozen=True, kw_only=True)
class DeltaConfig:
    """How delta pushes are encoded (``PushConfig(delta=...)``, for every updater)."""

    encoding: Literal["auto", "indices", "bitmask"] = "indices"
    """Positions of the changed elements: "indices" (fastest to apply) or "bitmask" per tensor,
    either replaced by "dense" when that is smaller; "auto": the smallest of the three (fewest
    bytes, for slow links)."""
    max_fraction: float = 0.5
    """A delta larger than this fraction of a full push's bytes is sent as a full push instead."""

    def __post_init__(self) -> None:
        if self.encoding not in ("auto", "indices", "bitmask"):
            raise ValueError(f"encoding must be 'auto', 'indices' or 'bitmask', got {self.encoding!r}.")
        if not 0.0 < self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in (0, 1], got {self.max_fraction}; e.g. 0.5.")


def resolve_delta(delta: bool | DeltaConfig) -> DeltaConfig | None:
    """``delta=`` as updaters take it (False, True or a DeltaConfig) -> the config, or None for off."""
    if isinstance(delta, DeltaConfig):
        return delta
    if not isinstance(delta, bool):
        raise TypeError(f"delta must be a bool or a DeltaConfig, got {type(delta).__name__}.")
    return DeltaConfig() if delta else None


@dataclass(frozen=True)
class TensorDelta:
    """The change of one tensor; its arrays are ``"{i}.positions"``, ``"{i}.blocks"`` (indices
    only) and ``"{i}.values"`` in the delta's buckets, ``i`` its index among the entries."""

    name: str
    encoding: Encoding
    numel: int
    num_changed: int
    checksum: int
    """CRC32 of the position arrays, the old values, then the new values (as raw bytes); with a
    ``checksum_key``, their keyed digest (HMAC-SHA256, 64 bits) instead."""


@dataclass
class WeightDelta:
    """What a delta push carries: the base version it applies to, one entry per changed tensor,
    and the entries' arrays (byte buffers and their layout, like a full push)."""

    base_version: PushVersion
    entries: tuple[TensorDelta, ...]
    arrays: WeightBuckets

    @property
    def nbytes(self) -> int:
        return self.arrays.nbytes

    def header(self) -> dict:
        """Everything but the buffers, as JSON-able data (the process group sends it through its store)."""
        return {
            "base": [self.base_version.index, self.base_version.uuid],
            "entries": [[e.name, e.encoding, e.numel, e.num_changed, e.checksum] for e in self.entries],
        }

    @classmethod
    def from_header(cls, header: dict, arrays: WeightBuckets) -> WeightDelta:
        index, uid = header["base"]
        entries = tuple(
            TensorDelta(n, enc, int(numel), int(k), int(crc)) for n, enc, numel, k, crc in header["entries"]
        )
        return cls(PushVersion(int(index), str(uid)), entries, arrays)


@dataclass(frozen=True)
class PushStats:
    """What one push moved (``updater.last_push_stats``)."""

    kind: Literal["full", "delta", "lora"]
    nbytes: int
    """Bytes of weights (or of the delta's arrays) sent once to all receivers."""
    full_nbytes: int
    """Bytes a full push of the same weights moves."""
    num_changed: int = 0
    """Elements that changed since the last push (delta pushes)."""
    numel: int = 0
    """Elements in all tensors (delta pushes)."""
    num_full: int = 0
    """Receivers sent the full weights: all of them for a full push; with a delta, those that did
    not hold its base (they skipped a push, restarted) or refused it."""
    num_repaired: int = 0
    """Receivers that refused the delta and got a full push (counted in ``num_full`` too)."""
    call_s: float | None = None
    """Seconds of the push call as the trainer waited for it (checks, send, every engine's pause,
    load and resume); None for a push not waited for. What the push costs the engines afterwards
    (keys/values computed again) comes later: ``collector.push_costs()``."""

    @classmethod
    def full(cls, nbytes: int, *, num_full: int, num_repaired: int = 0) -> PushStats:
        """A full push of ``nbytes`` to ``num_full`` receivers (``num_repaired`` of them had refused a delta)."""
        return cls("full", nbytes, nbytes, num_full=num_full, num_repaired=num_repaired)

    @classmethod
    def lora(cls, nbytes: int, *, num_receivers: int) -> PushStats:
        """A LoRA push of an adapter of ``nbytes`` to ``num_receivers`` (``full_nbytes``: the same,
        the merged model is never sent)."""
        return cls("lora", nbytes, nbytes, num_full=num_receivers)


@dataclass
class EncodedDelta:
    """A delta ready to send, with what the sender needs to commit it into its base."""

    delta: WeightDelta
    positions: dict[str, torch.Tensor | None] = field(default_factory=dict)
    """name -> int64 positions of its changed elements (None: all of them, a dense entry)."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> the new values at those positions, in the receivers' dtype."""
    numel: int = 0
    full_nbytes: int = 0

    def stats(self, num_full: int = 0) -> PushStats:
        num_changed = sum(e.num_changed for e in self.delta.entries)
        return PushStats("delta", self.delta.nbytes, self.full_nbytes, num_changed, self.numel, num_full)


# ---------------------------------------------------------------------- sender
@dataclass
class PreparedPush:
    """A push checked before anything is sent: the weights, the receivers' dtypes where they differ
    (``convert_dtype``; None: the weights' own), and the encoded delta (None: a full push).
    ``ProcessGroupSender.prepare`` makes one; the Ray updater's delta plan adds its targets."""

    weights: WeightDict
    dtypes: dict[str, torch.dtype] | None
    encoded: EncodedDelta | None

    def sent_values(self) -> WeightDict:
        """What travels, for a NaN/Inf check: the delta's changed values, or the whole weights."""
        return self.encoded.values if self.encoded is not None else self.weights


class DeltaBase:
    """The sender's copy of the last pushed weights (receivers' dtypes) and the version pushed.

    :meth:`snapshot` (after a full push: a copy) or :meth:`adopt` (tensors the sender keeps
    anyway, e.g. its packed buffers) sets it; :meth:`encode` compares new weights with it without
    changing it; :meth:`commit` writes an encoded delta into it once the push goes out.
    ``checksum_key``: the entries' checksums are keyed with it (receivers verify with the same
    key); None: CRC32.
    """

    def __init__(self, config: DeltaConfig, *, checksum_key: bytes | None = None) -> None:
        self.config = config
        self.checksum_key = checksum_key
        self.version: PushVersion | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()
        self._pool: ThreadPoolExecutor | None = None
        self._scratch = threading.local()  # one comparison mask per encoding thread, reused

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_pool=None, _scratch=None)  # threads and scratch memory never travel
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._scratch = threading.local()

    def reset(self) -> None:
        """Forget the base: the next push is a full push."""
        self.version, self.tensors, self._names = None, {}, ()

    def snapshot(
        self, weights: Mapping[str, torch.Tensor], version: PushVersion, dtypes: Mapping[str, torch.dtype] | None = None
    ) -> dict[str, torch.Tensor]:
        """Copy ``weights`` (each distinct tensor once, cast to ``dtypes[name]``) as the base of ``version``."""
        reuse = self.tensors
        copies: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in distinct_tensors(weights).items():
                dtype = _dtype_for(name, tensor, dtypes)
                old = reuse.get(name)
                if old is None or old.dtype != dtype or old.shape != tensor.shape or old.device != tensor.device:
                    old = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
                copies[name] = old.copy_(tensor)
        self.adopt(copies, weights, version, dtypes)
        return copies

    def adopt(
        self,
        tensors: dict[str, torch.Tensor],
        weights: Mapping[str, torch.Tensor],
        version: PushVersion,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """Take ``tensors`` (name -> the pushed values, contiguous) as the base of ``version``;
        ``weights`` (what was pushed, before any cast) fixes which later pushes fit it."""
        self.tensors, self.version = tensors, version
        self._names = _signature(weights, dtypes)

    def fits(self, weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None = None) -> bool:
        """True when ``weights`` have the names, shapes and dtypes of the base's push."""
        return self.version is not None and _signature(weights, dtypes) == self._names

    def encode(
        self, weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None = None
    ) -> EncodedDelta | None:
        """The delta from the base to ``weights``, or None when a full push is due (no base, other
        names/shapes/dtypes, or a delta above ``max_fraction`` of a full push). Changes nothing.

        CPU tensors are compared on ``torch.get_num_threads()`` threads, a tensor at a time each."""
        base_version = self.version
        if base_version is None or not self.fits(weights, dtypes):
            return None
        full_nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        budget = self.config.max_fraction * full_nbytes
        entries: list[TensorDelta] = []
        arrays: dict[str, torch.Tensor] = {}
        positions_of: dict[str, torch.Tensor | None] = {}
        values_of: dict[str, torch.Tensor] = {}
        nbytes = 0
        names = list(self.tensors)
        for name, found in zip(names, self._map(functools.partial(self._encode_one, weights), names), strict=True):
            if found is None:
                continue  # unchanged
            entry, tensor_arrays, positions = found
            nbytes += sum(a.numel() * a.element_size() for a in tensor_arrays.values())
            if nbytes > budget:
                return None
            arrays.update({f"{len(entries)}.{key}": array for key, array in tensor_arrays.items()})
            entries.append(entry)
            positions_of[name] = positions
            values_of[name] = tensor_arrays["values"].view(self.tensors[name].dtype)
        delta = WeightDelta(base_version, tuple(entries), view_buckets(arrays))
        numel = sum(t.numel() for t in self.tensors.values())
        return EncodedDelta(delta, positions_of, values_of, numel=numel, full_nbytes=full_nbytes)

    def commit(self, encoded: EncodedDelta, version: PushVersion) -> None:
        """Write ``encoded`` into the base, which becomes ``version``."""
        with torch.no_grad():
            for name, positions in encoded.positions.items():
                target, values = _bits(self.tensors[name]), _bits(encoded.values[name])
                if positions is None:
                    target.copy_(values)
                else:
                    target.index_copy_(0, positions.to(target.device), values)
        self.version = version

    def _encode_one(
        self, weights: Mapping[str, torch.Tensor], name: str
    ) -> tuple[TensorDelta, dict[str, torch.Tensor], torch.Tensor | None] | None:
        base = self.tensors[name]
        with torch.no_grad():
            new = _bits(weights[name].detach().to(base.dtype))
        return _encode_tensor(
            name, new, _bits(base), self.config.encoding, self._mask_for(base), checksum_key=self.checksum_key
        )

    def _map(self, fn: Callable[[str], Any], names: list[str]) -> Iterator[Any]:
        num_threads = torch.get_num_threads()
        if num_threads <= 1 or any(t.device.type != "cpu" for t in self.tensors.values()):
            return map(fn, names)
        if self._pool is None or self._pool._max_workers != num_threads:
            self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="delta-encode")
        return self._pool.map(fn, names)

    def _mask_for(self, tensor: torch.Tensor) -> np.ndarray | None:
        """This thread's boolean scratch of ``tensor.numel()`` (None off the CPU)."""
        if tensor.device.type != "cpu":
            return None
        mask = getattr(self._scratch, "mask", None)
        if mask is None or mask.size < tensor.numel():
            mask = self._scratch.mask = np.empty(max(t.numel() for t in self.tensors.values()), dtype=bool)
        return mask[: tensor.numel()]


def distinct_tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without tied aliases (the first name of each storage)."""
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        key = tie_key(tensor)
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def distinct_nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of ``weights`` with each tied tensor counted once (what a full push moves)."""
    return sum(t.numel() * t.element_size() for t in distinct_tensors(weights).values())


def changed_positions(new_bits: torch.Tensor, base_bits: torch.Tensor, mask: np.ndarray | None = None) -> torch.Tensor:
    """int64 positions where two flat integer tensors differ. On the CPU (``mask``: a boolean
    scratch of their size) numpy's nonzero does it, several times faster than torch's."""
    if mask is None:
        return torch.ne(new_bits, base_bits).nonzero().squeeze(1)
    np.not_equal(new_bits.numpy(), base_bits.numpy(), out=mask)
    return torch.from_numpy(np.flatnonzero(mask))


def _encode_tensor(
    name: str,
    new: torch.Tensor,
    base: torch.Tensor,
    wanted: Literal["auto", "indices", "bitmask"],
    mask: np.ndarray | None,
    *,
    checksum_key: bytes | None = None,
) -> tuple[TensorDelta, dict[str, torch.Tensor], torch.Tensor | None] | None:
    """One tensor's entry, its arrays ("positions", "blocks", "values") and the positions to commit
    (None: all of them, "dense"); None when nothing changed. ``new``, ``base``: flat integer views."""
    positions = changed_positions(new, base, mask)
    numel, k, itemsize = new.numel(), positions.numel(), new.element_size()
    if k == 0:
        return None
    sizes: dict[Encoding, int] = {
        "indices": 2 * k + 4 * _num_blocks(numel) + k * itemsize,
        "bitmask": -(-numel // 8) + k * itemsize,
        "dense": numel * itemsize,
    }
    encoding: Encoding = min(sizes if wanted == "auto" else (wanted, "dense"), key=sizes.__getitem__)
    if encoding == "dense":
        arrays, old = {"values": new}, base
    else:
        arrays = {**_encode_positions(encoding, positions.cpu().numpy(), numel), "values": _take(new, positions)}
        old = _take(base, positions)
    position_arrays = [arrays[key] for key in ("blocks", "positions") if key in arrays]
    checksum = _checksum(position_arrays, old, arrays["values"], checksum_key)
    return TensorDelta(name, encoding, numel, k, checksum), arrays, None if encoding == "dense" else positions


def _take(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if flat.device.type == "cpu":  # numpy: no torch intra-op threads inside the encoding threads
        return torch.from_numpy(np.take(flat.numpy(), positions.numpy()))
    return flat.index_select(0, positions)


def _encode_positions(encoding: str, positions: np.ndarray, numel: int) -> dict[str, torch.Tensor]:
    if encoding == "bitmask":
        mask = np.zeros(numel, dtype=bool)
        mask[positions] = True
        return {"positions": torch.from_numpy(np.packbits(mask))}
    counts = np.bincount(positions >> BLOCK_BITS, minlength=_num_blocks(numel)).astype(np.int32)
    return {"positions": torch.from_numpy(positions.astype(np.uint16)), "blocks": torch.from_numpy(counts)}


# ---------------------------------------------------------------------- receiver
@dataclass
class _Change:
    target: torch.Tensor  # flat integer view of the receiving tensor
    entry: TensorDelta
    positions: torch.Tensor | None  # None: dense
    position_arrays: list[torch.Tensor]
    values: torch.Tensor
    old: torch.Tensor | None = None


class PreparedDelta:
    """A checked delta, ready to write (:func:`prepare_delta` builds it; :meth:`apply_` writes)."""

    def __init__(self, changes: list[_Change], checksum_key: bytes | None = None) -> None:
        self._changes = changes
        self._checksum_key = checksum_key

    @torch.no_grad()
    def apply_(self) -> None:
        """Write every change, then verify each tensor's checksum; on a mismatch restore the old
        values and raise :class:`DeltaRejectedError` (nothing stays changed)."""
        bad = []
        for change in self._changes:
            if change.positions is None:
                change.old = change.target.clone()
                change.target.copy_(change.values)
                after = change.target
            else:
                change.old = change.target.index_select(0, change.positions)
                change.target.index_copy_(0, change.positions, change.values)
                after = change.target.index_select(0, change.positions)
            if _checksum(change.position_arrays, change.old, after, self._checksum_key) != change.entry.checksum:
                bad.append(change.entry.name)
        if bad:
            self._undo()
            raise DeltaRejectedError(
                f"delta checksum mismatch after applying {bad[:5]} ({len(bad)} tensor(s)); old weights kept."
            )

    def _undo(self) -> None:
        for change in self._changes:
            if change.positions is None:
                change.target.copy_(change.old)
            else:
                change.target.index_copy_(0, change.positions, change.old)


def prepare_delta(
    delta: WeightDelta,
    targets: Mapping[str, torch.Tensor],
    *,
    held_version: PushVersion | None,
    aliases: Mapping[str, str] | None = None,
    checksum_key: bytes | None = None,
) -> PreparedDelta:
    """Check ``delta`` against the receiver before anything changes: it must apply to the version
    held (``held_version``), name known tensors of the same dtype and size, and hold consistent
    positions. Raises :class:`DeltaRejectedError` otherwise. ``checksum_key``: the key the sender's
    checksums were made with (None: CRC32)."""
    check_delta_base(delta, held_version)
    aliases = aliases or {}
    arrays = delta.arrays.tensors()
    changes = []
    for i, entry in enumerate(delta.entries):
        target = targets.get(aliases.get(entry.name, entry.name))
        values = arrays.get(f"{i}.values")
        if target is None or values is None or not target.is_contiguous() or target.numel() != entry.numel:
            raise DeltaRejectedError(f"delta entry {entry.name!r} does not fit this receiver's tensor.")
        bits = _bits(target)
        if values.dtype != bits.dtype:
            raise DeltaRejectedError(
                f"delta entry {entry.name!r} has {values.dtype} values for a {target.dtype} tensor."
            )
        positions = _decode_positions(entry, arrays, i, values.numel())
        positions = None if positions is None else positions.to(target.device)
        changes.append(
            _Change(bits, entry, positions, _position_arrays(arrays, i), values.reshape(-1).to(target.device))
        )
    return PreparedDelta(changes, checksum_key)


def check_delta_base(delta: WeightDelta, held_version: PushVersion | None) -> None:
    """Raise :class:`DeltaRejectedError` unless the receiver holds the delta's base version."""
    if held_version != delta.base_version:
        held = "no pushed version" if held_version is None else f"{held_version.index} ({held_version.uuid[:8]})"
        raise DeltaRejectedError(
            f"the delta applies to version {delta.base_version.index} ({delta.base_version.uuid[:8]}); "
            f"this receiver holds {held}."
        )


def _decode_positions(
    entry: TensorDelta, arrays: dict[str, torch.Tensor], i: int, num_values: int
) -> torch.Tensor | None:
    numel, k = entry.numel, entry.num_changed
    if entry.encoding == "dense":
        if num_values != numel:
            raise DeltaRejectedError(f"dense delta entry {entry.name!r} has {num_values} values for {numel} elements.")
        return None
    raw = arrays.get(f"{i}.positions")
    if raw is None or num_values != k:
        raise DeltaRejectedError(
            f"delta entry {entry.name!r} has {num_values} values for {k} changes, or no positions."
        )
    raw = raw.reshape(-1).cpu().numpy()
    if entry.encoding == "bitmask":
        if raw.size != -(-numel // 8):
            raise DeltaRejectedError(f"delta entry {entry.name!r}: bitmask of {raw.size} bytes for {numel} elements.")
        positions = np.flatnonzero(np.unpackbits(raw.view(np.uint8), count=numel))
    elif entry.encoding == "indices":
        counts = arrays.get(f"{i}.blocks")
        if counts is None or counts.numel() != _num_blocks(numel):
            raise DeltaRejectedError(f"delta entry {entry.name!r} has no block counts, or the wrong number.")
        counts = counts.reshape(-1).cpu().numpy().view(np.int32)
        if counts.min(initial=0) < 0 or int(counts.sum()) != raw.size:
            raise DeltaRejectedError(f"delta entry {entry.name!r}: block counts do not add up to its positions.")
        starts = np.arange(counts.size, dtype=np.int64) << BLOCK_BITS
        positions = np.repeat(starts, counts) + raw.view(np.uint16)
    else:
        raise DeltaRejectedError(f"delta entry {entry.name!r} has an unknown encoding {entry.encoding!r}.")
    if positions.size != k or (k and (positions[-1] >= numel or not np.all(positions[1:] > positions[:-1]))):
        raise DeltaRejectedError(f"delta entry {entry.name!r}: positions out of range, repeated or out of order.")
    return torch.from_numpy(positions)


# ---------------------------------------------------------------------- helpers
def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of the same bytes (compare and copy bit patterns, NaNs included)."""
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
    return flat if flat.dtype == _BITS_DTYPES[flat.element_size()] else flat.view(_BITS_DTYPES[flat.element_size()])


def _position_arrays(arrays: Mapping[str, torch.Tensor], i: int) -> list[torch.Tensor]:
    """Entry ``i``'s position arrays in the order its checksum covers them."""
    return [arrays[key] for key in (f"{i}.blocks", f"{i}.positions") if key in arrays]


def _checksum(
    position_arrays: list[torch.Tensor], old: torch.Tensor, new: torch.Tensor, key: bytes | None = None
) -> int:
    if key is not None:
        return keyed_checksum([*position_arrays, old, new], key)
    crc = 0
    for array in (*position_arrays, old, new):
        crc = zlib.crc32(array.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def _num_blocks(numel: int) -> int:
    return max(1, -(-numel // (1 << BLOCK_BITS)))


def _dtype_for(name: str, tensor: torch.Tensor, dtypes: Mapping[str, torch.dtype] | None) -> torch.dtype:
    return tensor.dtype if dtypes is None else dtypes.get(name, tensor.dtype)


def _signature(weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None) -> tuple:
    return tuple((name, _dtype_for(name, t, dtypes), tuple(t.shape)) for name, t in distinct_tensors(weights).items())
