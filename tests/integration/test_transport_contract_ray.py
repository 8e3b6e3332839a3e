"""The transport contract (tests/transport_contract.py) for the Ray object store pair:
``RayObjectStoreSender`` (its mailbox actor) -> ``RayObjectStoreReceiver`` registered with a
collector over the tiny transformers model. The receiver and its collector run in this process (the
bytes still go through the object store and the mailbox actor); the checks share one sender, so the
module starts two mailbox actors in all (the dead-peer check kills its own)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from lmcollect.ray.object_store import RayObjectStoreSender
from tests.transport_contract import CHECKS, SchemePullPair, tiny_collector

pytestmark = pytest.mark.integration

CALL_TIMEOUT_S = 10.0  # the receiver's bound on each call into Ray


class RayObjectStorePair(SchemePullPair):
    """A ``RayObjectStoreSender`` and one receiver of it, registered with a fresh collector (the
    sender's mailbox actor is the peer that can die)."""

    supports = frozenset({"dead_peer"})  # no delta, adapter or version: the sender publishes full snapshots
    bound_s = CALL_TIMEOUT_S + 5.0

    def __init__(self, model_path: Path, sender: RayObjectStoreSender) -> None:
        super().__init__(tiny_collector(model_path), sender, sender.make_receiver(call_timeout_s=CALL_TIMEOUT_S))

    def kill_peer(self) -> None:
        mailbox = self.sender._mailbox
        self.sender.close()  # kills the mailbox actor; ray.kill returns before the actor is gone
        deadline = time.monotonic() + 30.0
        while True:  # a call that still reaches the mailbox would not be a call after the peer died
            try:
                ray.get(mailbox.ready.remote(), timeout=5.0)
            except (RayActorError, GetTimeoutError):
                return
            assert time.monotonic() < deadline, "the mailbox actor still answers 30 s after ray.kill"
            time.sleep(0.1)

    def call_after_peer_died(self) -> None:
        self.collector.receive_weights()

    def close(self) -> None:
        self.collector.shutdown()
        self.collector.policy.close()


@pytest.fixture(scope="module")
def shared_sender(ray_cluster) -> Iterator[RayObjectStoreSender]:
    sender = RayObjectStoreSender(call_timeout_s=CALL_TIMEOUT_S)
    yield sender
    sender.close()


@pytest.mark.parametrize("check", list(CHECKS))
def test_transport_contract(check: str, tiny_model_path: Path, shared_sender: RayObjectStoreSender) -> None:
    own = check == "dead_peer"  # it kills the sender's mailbox
    sender = RayObjectStoreSender(call_timeout_s=CALL_TIMEOUT_S) if own else shared_sender
    pair = RayObjectStorePair(tiny_model_path, sender)
    try:
        CHECKS[check](pair)
    finally:
        pair.close()
        if own:
            sender.close()
