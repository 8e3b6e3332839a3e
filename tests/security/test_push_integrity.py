"""Process-group pushes: NaN/Inf refused before sending, and bytes changed on the way refused before loading.

Part of the security suite (issue 42, items 4 and 5). Gloo on CPU, sender and receiver in one
process (the receiver in a thread), every wait bounded. The tamperers play a host on the network
path between trainer and engine: they change the bytes after the sender made its digest or
checksums, as such a host (or one that rewrote the unsigned gloo rendezvous keys) would.
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmcollect.collectors import LLMCollector
from lmcollect.transports.process_group import (
    PreparedPush,
    ProcessGroupConfig,
    ProcessGroupReceiver,
    ProcessGroupSender,
)
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import DeltaConfig, WeightDelta
from tests.factories import SmallModelPolicy, make_arithmetic_env
from tests.security.process_groups import TIMEOUT_S, engine_weights, make_group, same, weights  # noqa: F401 - make_group: a fixture


def as_held(pushed: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``pushed`` as a receiver holding its floats in ``dtype`` gets it."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in pushed.items()}


# ---------------------------------------------------------------------- item 4: NaN/Inf before sending
def test_a_push_finite_in_fp32_but_infinite_in_the_receivers_fp16_is_refused_before_anything_is_sent(make_group) -> None:
    group = make_group(convert_dtype=True, context=engine_weights(torch.float16))
    assert same(group.push(weights(1)), as_held(weights(1), torch.float16))
    before = (group.receiver.last_checksums(), dict(group.receiver.last_receive_info))
    overflowing = weights(2)
    overflowing["norm.weight"][0] = 1e5  # fp16 holds at most 65504: the cast would make it inf
    with pytest.raises(ValueError, match=r"'norm.weight' holds NaN or infinite values once cast to torch.float16 \(allow_non_finite=True"):
        group.sender.send(overflowing)
    assert group.receiver.receive(timeout_s=0.5) is None  # nothing was announced, nothing was sent
    assert (group.receiver.last_checksums(), group.receiver.last_receive_info) == before
    assert same(group.push(weights(2)), as_held(weights(2), torch.float16))  # the group is still in step


def test_a_delta_push_bringing_a_nan_is_refused_before_anything_is_sent_and_the_base_is_kept(make_group) -> None:
    group = make_group(delta=DeltaConfig())
    group.push(weights(1))
    broken = weights(2)
    broken["norm.weight"][1] = float("nan")
    with pytest.raises(ValueError, match=r"'norm.weight' holds NaN or infinite values \(allow_non_finite=True"):
        group.sender.send(broken)
    assert group.receiver.receive(timeout_s=0.5) is None
    assert same(group.push(weights(2)), as_held(weights(2), torch.float32))
    assert group.sender.last_push_stats.kind == "delta"  # the sender's base did not move


def test_allow_non_finite_sends_what_the_receiver_will_hold_as_inf(make_group) -> None:
    group = make_group(convert_dtype=True, allow_non_finite=True, context=engine_weights(torch.float16))
    overflowing = weights(1)
    overflowing["norm.weight"][0] = 1e5
    assert torch.isposinf(group.push(overflowing)["norm.weight"][0])


# ---------------------------------------------------------------------- item 5: a full push's digest
class TamperingGroup:
    """The test's tamperer: a host on the path that relays every broadcast with one byte flipped
    (the sender digests the bytes it meant to send; the receiver gets these)."""

    def __init__(self, group) -> None:
        self.group = group
        self.relayed: list[torch.Tensor] = []  # alive until the broadcasts complete

    def broadcast(self, buffer: torch.Tensor, root: int):
        changed = buffer.clone()
        changed[changed.numel() // 2] ^= 0x10
        self.relayed.append(changed)
        return self.group.broadcast(changed, root)


def _full_of(collector: LLMCollector, value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, value) for name, t in collector.get_policy_model().state_dict().items()}


def test_a_full_push_whose_bytes_change_on_the_way_is_refused_and_the_collector_loads_nothing() -> None:
    collector = LLMCollector(make_arithmetic_env(), policy=SmallModelPolicy(), dialog_turns_per_batch=1, track_policy_version=True)
    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=TIMEOUT_S))
    receiver = ProcessGroupReceiver(timeout_s=TIMEOUT_S)
    collector.register_scheme_receiver({"policy": receiver}, synchronize_weights=False)
    receiver.set_connection_info(sender.connection_info(), worker_idx=0)
    pool = ThreadPoolExecutor(1)
    real_group = None
    try:
        joined = pool.submit(receiver.connect)
        sender.connect()
        joined.result(timeout=TIMEOUT_S)
        held = {k: v.clone() for k, v in collector.get_policy_model().state_dict().items()}
        real_group, sender._group = sender._group, TamperingGroup(sender._group)
        received = pool.submit(collector.receive_weights)
        sender.send(_full_of(collector, 2.0))
        with pytest.raises(ValueError, match="do not match the digest the sender signed.*nothing was loaded"):
            received.result(timeout=TIMEOUT_S)
        assert all(torch.equal(held[k], v) for k, v in collector.get_policy_model().state_dict().items())
        assert collector.policy_version == 0

        sender._group = real_group  # the path is clean again: the next push loads
        received = pool.submit(collector.receive_weights)
        sender.send(_full_of(collector, 3.0))
        received.result(timeout=TIMEOUT_S)
        assert all(torch.all(v == 3.0) for v in collector.get_policy_model().state_dict().values())
        assert collector.policy_version == 2  # the version the sender gave this push (its first went nowhere)
    finally:
        if real_group is not None:
            sender._group = real_group
        sender.close()
        receiver.close()
        collector.shutdown()
        pool.shutdown(wait=False)


# ---------------------------------------------------------------------- item 5: keyed delta checksums
def crc_keeping_change(data: bytes, at: int) -> bytes:
    """``data`` with byte ``at`` changed and its last 4 bytes set so that its CRC32 stays the same,
    as anyone can do to an unkeyed CRC (it is affine in the bits: solve for 32 of them)."""
    changed = bytearray(data)
    changed[at] ^= 0x40

    def crc_flipping(bits: int) -> int:
        trial = bytearray(changed)
        for b in range(32):
            if bits >> b & 1:
                trial[len(trial) - 4 + b // 8] ^= 1 << (b % 8)
        return zlib.crc32(bytes(trial))

    base = crc_flipping(0)
    basis: list[tuple[int, int, int]] = []  # (pivot bit, effect on the CRC, which bits make it)
    for b in range(32):
        effect, bits = crc_flipping(1 << b) ^ base, 1 << b
        for pivot, vector, made_of in basis:
            if effect >> pivot & 1:
                effect, bits = effect ^ vector, bits ^ made_of
        if effect:
            basis.append((effect.bit_length() - 1, effect, bits))
    want, bits = base ^ zlib.crc32(data), 0
    for pivot, vector, made_of in basis:
        if want >> pivot & 1:
            want, bits = want ^ vector, bits ^ made_of
    assert want == 0, "the last 4 bytes of a CRC32 input can always restore it"
    assert crc_flipping(bits) == zlib.crc32(data)
    for b in range(32):
        if bits >> b & 1:
            changed[len(changed) - 4 + b // 8] ^= 1 << (b % 8)
    return bytes(changed)


class CrcKeepingTamperer(ProcessGroupSender):
    """The test's tamperer: changes a delta's new values on the way and keeps their CRC32, so an
    unkeyed checksum would still match (the signed header's checksums are left as they are)."""

    def prepare(self, weights: object) -> PreparedPush:
        prepared = super().prepare(weights)
        if prepared.encoded is not None:
            delta = prepared.encoded.delta
            buffers = [b.clone() for b in delta.arrays.buffers]
            values = WeightBuckets(delta.arrays.layout, buffers).tensors()["0.values"]
            raw = values.reshape(-1).view(torch.uint8)
            raw.copy_(torch.frombuffer(bytearray(crc_keeping_change(raw.numpy().tobytes(), 0)), dtype=torch.uint8))
            prepared.encoded.delta = WeightDelta(delta.base_version, delta.entries, WeightBuckets(delta.arrays.layout, buffers))
        return prepared


def test_a_delta_changed_on_the_way_with_its_crc_kept_is_refused_and_a_full_push_repairs_it(make_group) -> None:
    group = make_group(CrcKeepingTamperer, delta=DeltaConfig())
    group.push(weights(1))
    received = group.push(weights(2))  # a delta: its norm.weight values changed on the way, their CRC32 kept
    assert "checksum" in group.receiver.last_receive_info["after_refused_delta"]["refused"]
    stats = group.sender.last_push_stats
    assert (stats.kind, stats.num_repaired) == ("full", 1)
    assert same(received, as_held(weights(2), torch.float32))


def test_digest_false_posts_no_digest_and_the_receiver_waits_for_none(make_group) -> None:
    group = make_group(digest=False)  # a group on a network nothing untrusted reaches
    assert same(group.push(weights(1)), weights(1))
    assert not any("/digest/" in key for key in group.client().list_keys())
    signed = make_group()
    signed.push(weights(1))
    assert any(key.endswith("/digest/0") for key in signed.client().list_keys())
