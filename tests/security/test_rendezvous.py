"""The process-group push's rendezvous store is closed by default: what a forger writes is never read, or refused.

Part of the security suite (issue "Closed by default"). The sender's TCPStore listens on all
interfaces, so each test plays a host that reaches it: it writes what a forger would (a plain
``TCPStore`` client, or a holder of the secret for a compromised header), then asserts the
refusal, or that nobody read it, and that the receiver's weights did not change. Gloo on CPU,
sender and receiver in one process (the receiver in a thread), every wait bounded.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch.distributed as dist

from lmcollect.weights.buckets import BucketLayout, WeightBuckets, layout_to_json
from lmcollect.weights.delta import DeltaConfig, WeightDelta
from lmcollect.transports.process_group import (
    PreparedPush,
    ProcessGroupConfig,
    ProcessGroupReceiver,
    ProcessGroupSender,
)
from lmcollect.transports.rendezvous import GroupStore
from tests.security.process_groups import TIMEOUT_S, make_group, same, weights  # noqa: F401 - make_group: a fixture

HUGE = 1 << 40  # bytes: a receiver that allocated this would die (or raise something else than ValueError)


def header(kind: str, layout: BucketLayout, **extra) -> str:
    return json.dumps({"kind": kind, "version": [7, "forged"], "layout": layout_to_json(layout), **extra})


def prefix_of(forger: dist.TCPStore) -> str:
    """The group's key prefix, as any client learns it: by listing the store's keys."""
    return next(key for key in forger.list_keys() if key.endswith("/meta/1")).removesuffix("meta/1")


# ---------------------------------------------------------------------- (a) forgers without the secret
def test_a_header_forged_at_the_well_known_key_is_never_read(make_group) -> None:
    group = make_group()
    layout = group.sender.layout_for(weights())
    group.client().set("push/0", header("full", replace(layout, buffer_nbytes=(HUGE,) * len(layout.buffer_nbytes))))
    assert group.receiver.receive(timeout_s=0.5) is None  # it waits on its group's own key only
    assert group.receiver.last_checksums() == []  # nothing was allocated
    assert same(group.push(weights(1)), weights(1))  # the real push goes through


def test_a_forger_who_lists_the_keys_learns_the_prefix_but_not_the_secret(make_group) -> None:
    group = make_group()
    group.push(weights(1))
    before = (group.receiver.last_checksums(), dict(group.receiver.last_receive_info))
    forger = group.client()
    secret = group.sender.connection_info()["secret"]
    assert not any(secret in key for key in forger.list_keys())  # any client may list them
    prefix = prefix_of(forger)
    layout = group.sender.layout_for(weights())
    forger.set(prefix + "push/1", header("full", replace(layout, buffer_nbytes=(HUGE,) * len(layout.buffer_nbytes))))
    with pytest.raises(ValueError, match="not signed with this group's secret"):
        group.receiver.receive(timeout_s=5)
    assert (group.receiver.last_checksums(), group.receiver.last_receive_info) == before


# ---------------------------------------------------------------------- (b) compromised headers
def wrong_shape(layout: BucketLayout) -> BucketLayout:
    slots = tuple(replace(s, shape=(2, 2)) if s.name == "norm.weight" else s for s in layout.slots)  # same bytes
    return replace(layout, slots=slots)


def unknown_name(layout: BucketLayout) -> BucketLayout:
    return replace(layout, slots=tuple(replace(s, name="evil.weight") if s.name == "norm.weight" else s for s in layout.slots))


def absurd_buffer(layout: BucketLayout) -> BucketLayout:
    return replace(layout, buffer_nbytes=(HUGE, *layout.buffer_nbytes[1:]))


def outside_its_buffer(layout: BucketLayout) -> BucketLayout:
    return replace(layout, slots=tuple(replace(s, offset_bytes=1 << 20) if s.name == "norm.weight" else s for s in layout.slots))


@pytest.mark.parametrize(
    ("spoil", "kind", "reason"),
    [
        (wrong_shape, "full", r"'norm.weight' has shape \(2, 2\), the model expects \(4,\)"),
        (unknown_name, "full", r"missing 'norm.weight'.*unexpected 'evil.weight'"),
        (absurd_buffer, "full", "more than this model's tensors need"),
        (outside_its_buffer, "full", "'norm.weight' ends past its buffer"),
        (absurd_buffer, "delta", "more than the full push it patches"),
        (lambda layout: layout, "evil", "neither 'full' nor 'delta'"),
    ],
    ids=["wrong_shape", "unknown_name", "absurd_buffer", "outside_its_buffer", "absurd_delta", "unknown_kind"],
)
def test_a_signed_header_that_does_not_fit_the_model_is_refused_before_allocation(make_group, spoil, kind, reason) -> None:
    group = make_group(delta=DeltaConfig())
    group.push(weights(1))
    before = (group.receiver.last_checksums(), dict(group.receiver.last_receive_info))
    delta_fields = {"base": [1, "x"], "entries": []} if kind == "delta" else {}
    compromised = GroupStore(group.client(), group.sender.connection_info()["secret"])  # a holder of the secret
    compromised.set("push/1", header(kind, spoil(group.sender.layout_for(weights())), **delta_fields))
    with pytest.raises(ValueError, match=reason):
        group.receiver.receive(timeout_s=5)
    assert (group.receiver.last_checksums(), group.receiver.last_receive_info) == before


# ---------------------------------------------------------------------- (c) forged acknowledgements
class CorruptingSender(ProcessGroupSender):
    """Flips one bit of every delta on its way out: the receiver's checksum refuses it."""

    def prepare(self, weights: object) -> PreparedPush:
        prepared = super().prepare(weights)
        if prepared.encoded is not None:
            delta = prepared.encoded.delta
            buffers = [b.clone() for b in delta.arrays.buffers]
            buffers[-1][0] ^= 1
            prepared.encoded.delta = WeightDelta(delta.base_version, delta.entries, WeightBuckets(delta.arrays.layout, buffers))
        return prepared


@pytest.mark.parametrize("where", ["unprefixed", "prefixed_unsigned"])
def test_a_forged_ack_does_not_make_the_sender_accept_a_refused_delta(make_group, where) -> None:
    group = make_group(CorruptingSender, delta=DeltaConfig())
    group.push(weights(1))
    forger = group.client()
    forger.set(("" if where == "unprefixed" else prefix_of(forger)) + "ack/1/1", "ok")
    received = group.push(weights(2))  # a delta, which the real receiver refuses (checksum)
    stats = group.sender.last_push_stats
    assert (stats.kind, stats.num_repaired) == ("full", 1)  # the forged "ok" was ignored or refused
    assert "checksum" in group.receiver.last_receive_info["after_refused_delta"]["refused"]
    assert same(received, weights(2))


# ---------------------------------------------------------------------- (d) forged verdicts
class ForgedVerdictSender(ProcessGroupSender):
    """Posts a verdict that is neither "ok" nor "full" for its first delta (as a compromised store would)."""

    forged = False

    def _post_verdict(self, n: int, verdict: str) -> None:
        super()._post_verdict(n, verdict if self.forged else "accepted")
        self.forged = True


def test_a_verdict_other_than_ok_or_full_is_refused_and_the_patched_copy_is_not_trusted(make_group) -> None:
    group = make_group(ForgedVerdictSender, delta=DeltaConfig())
    group.push(weights(1))
    before = dict(group.receiver.last_receive_info)
    received = group.pool.submit(group.receiver.receive)
    group.sender.send(weights(2))
    with pytest.raises(ValueError, match="neither 'ok' nor 'full'"):
        received.result(timeout=TIMEOUT_S)  # receive raised: its caller loads nothing
    assert group.receiver.last_receive_info == before
    # the receiver no longer holds a base: the next delta is refused and a full push repairs it
    assert same(group.push(weights(3)), weights(3))
    assert (group.sender.last_push_stats.kind, group.sender.last_push_stats.num_repaired) == ("full", 1)


# ---------------------------------------------------------------------- (e) connection info
@pytest.mark.parametrize("secret", [None, "", "0" * 31, "Z" * 32, 12345], ids=["missing", "empty", "short", "not_hex", "not_str"])
def test_connection_info_without_a_valid_secret_is_refused(secret) -> None:
    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=TIMEOUT_S))
    info = sender.connection_info()
    sender.close()
    assert json.loads(json.dumps(info)) == info  # plain data
    forged = {k: v for k, v in info.items() if k != "secret"} | ({} if secret is None else {"secret": secret})
    receiver = ProcessGroupReceiver()
    with pytest.raises(ValueError, match="older lmcollect sender or was forged"):
        receiver.set_connection_info(forged, worker_idx=0)
    assert receiver.rank == -1
    with pytest.raises(RuntimeError, match="set_connection_info"):
        receiver.connect()  # nothing was kept


def test_every_group_has_its_own_secret_and_no_log_shows_it(make_group, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    group = make_group(delta=DeltaConfig())
    other = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo"))
    assert group.sender.connection_info()["secret"] != other.connection_info()["secret"]
    other.close()
    for step in range(1, 3):
        assert same(group.push(weights(step)), weights(step))
    assert group.sender.connection_info()["secret"] not in caplog.text
