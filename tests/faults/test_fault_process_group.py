"""Process-group (gloo) weight sync losing a member: no receiver keeps half-loaded weights.

A receiver loads a push only once every buffer of it has arrived, so whoever dies, each
surviving receiver holds either the old weights with the old version or the new weights with
the new version, never a mix.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from lmcollect import LLMCollector
from lmcollect.ray.collector import RayLLMCollector
from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender
from tests.factories import SmallModelPolicy, SmallNet, make_arithmetic_env
from tests.faults.fault_factories import DyingSender

pytestmark = pytest.mark.integration

TIMEOUT_S = 6.0
BUCKET_SIZE_BYTES = 512  # SmallNet's tensors go in several buffers: a sender can die between two


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.fault_timeout(60)
def test_sender_dying_mid_broadcast_leaves_the_receiver_on_its_old_weights(ray_cluster, fault_table) -> None:
    sender = ray.remote(num_cpus=0.1)(DyingSender).remote(1, timeout_s=TIMEOUT_S, bucket_size_bytes=BUCKET_SIZE_BYTES)
    collector = LLMCollector(make_arithmetic_env(), policy=SmallModelPolicy(), dialog_turns_per_batch=4, track_policy_version=True)
    receiver = ProcessGroupReceiver()
    collector.register_scheme_receiver({"policy": receiver}, synchronize_weights=False)
    receiver.set_connection_info(ray.get(sender.connection_info.remote()), worker_idx=0)
    joined = sender.connect.remote()
    receiver.connect()
    ray.get(joined)
    old, new = SmallNet(), SmallNet()
    try:
        sent = sender.send.remote(old.state_dict())
        collector.receive_weights()
        num_buffers = ray.get(sent)
        assert num_buffers >= 2 and collector.policy_version == 1 and same_weights(collector.get_policy_model(), old)

        dying = sender.send_and_die.remote(new.state_dict(), 1)
        started = time.monotonic()
        with pytest.raises(Exception) as failure:  # gloo's error for a peer that closed the connection
            collector.receive_weights()
        time_to_error = time.monotonic() - started
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dying, timeout=TIMEOUT_S)
        assert time_to_error < TIMEOUT_S + 5
        assert same_weights(collector.get_policy_model(), old), "the receiver kept part of the broken push"
        assert collector.policy_version == 1
    finally:
        receiver.close()
        collector.shutdown()
        ray.kill(sender)
    fault_table.add(
        "sender dies mid-broadcast (gloo)",
        f"the sender's process SIGKILLs itself after 1 of {num_buffers} buffers of a push",
        f"receive_weights() raises {type(failure.value).__name__}; the receiver keeps the old weights and version 1",
        time_to_error,
        None,
    )


@pytest.mark.fault_timeout(90)
def test_receiver_dying_between_init_and_first_push_leaves_the_others_consistent(ray_cluster, fault_table) -> None:
    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=2, timeout_s=TIMEOUT_S, bucket_size_bytes=BUCKET_SIZE_BYTES))
    collectors = [
        RayLLMCollector(make_arithmetic_env, policy_factory=SmallModelPolicy, dialog_turns_per_batch=4,
                        track_policy_version=True, num_cpus=0.25)
        for _ in range(2)
    ]
    new = SmallNet()
    try:
        old = collectors[0].get_policy_model()
        joined = []
        for worker_idx, collector in enumerate(collectors):
            collector.register_scheme_receiver({"policy": ProcessGroupReceiver(timeout_s=TIMEOUT_S)}, synchronize_weights=False)
            collector.cascade_execute("_receiver_schemes['policy'].set_connection_info", sender.connection_info(), worker_idx=worker_idx)
            joined.append(collector.actor.cascade_execute.remote("_receiver_schemes['policy'].connect"))
        sender.connect()
        ray.get(joined)
        os.kill(collectors[1].process_info()["pid"], signal.SIGKILL)  # after init, before the first push

        pulled = collectors[0].actor.receive_weights.remote()
        started = time.monotonic()
        try:
            sender.send(new)
            send_error = None
        except Exception as exc:  # gloo names the peer that is gone
            send_error = exc
        send_s = time.monotonic() - started
        try:
            ray.get(pulled, timeout=TIMEOUT_S + 10)
            receive_error = None
        except ray.exceptions.RayTaskError as exc:
            receive_error = exc
        time_to_error = time.monotonic() - started
        survivor_version = collectors[0].policy_version
        survivor = collectors[0].get_policy_model()
    finally:
        sender.close()
        for collector in collectors:
            collector.shutdown(timeout=5)
    assert send_error is not None or receive_error is not None, "a push to a dead receiver went through unnoticed"
    assert time_to_error < TIMEOUT_S + 10
    if survivor_version == 1:  # it got every buffer before the sender failed: the whole push
        assert same_weights(survivor, new)
    else:
        assert survivor_version == 0 and same_weights(survivor, old), "the survivor kept part of the broken push"
    outcome = "the whole push (version 1)" if survivor_version == 1 else "its old weights (version 0)"
    fault_table.add(
        "receiver dies between init and the first push (gloo, 2 receivers)",
        "SIGKILL of receiver 2's actor after the group formed, then a push",
        f"the sender's send raises {type(send_error).__name__ if send_error else 'nothing'} after {send_s:.1f} s; "
        f"receiver 1's receive ends after {time_to_error:.1f} s (its timeout_s={TIMEOUT_S:.0f}) holding {outcome}",
        send_s,
        None,
    )
