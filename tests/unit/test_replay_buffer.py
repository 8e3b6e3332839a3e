"""ReplayBuffer: ring storage, sampling, versions, state and thread safety."""
from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lmcollect.buffers import ReplayBuffer
from lmcollect.data import keys


def turn(i: int, version: int = 0) -> TensorDict:
    return TensorDict({"i": torch.tensor(i), keys.POLICY_VERSION: torch.tensor(version), "tokens": torch.arange(i % 5 + 1)}, batch_size=[])


def test_ring_overwrites_oldest() -> None:
    buffer = ReplayBuffer(capacity=3)
    buffer.extend(lazy_stack([turn(i) for i in range(5)]))
    assert len(buffer) == 3 and buffer.write_count == 5
    assert sorted(buffer.sample(3, replace=False)["i"].tolist()) == [2, 3, 4]


def test_extend_accepts_2d_batches_and_add() -> None:
    buffer = ReplayBuffer(capacity=10)
    batch = lazy_stack([lazy_stack([turn(2 * r + c) for c in range(2)]) for r in range(2)])
    assert buffer.extend(batch) == 4
    buffer.add(turn(9))
    assert sorted(buffer.sample(5, replace=False)["i"].tolist()) == [0, 1, 2, 3, 9]
    with pytest.raises(ValueError, match="extend"):
        buffer.add(batch)


def test_sample_without_replacement_too_many() -> None:
    buffer = ReplayBuffer(capacity=4)
    buffer.extend(lazy_stack([turn(i) for i in range(2)]))
    with pytest.raises(ValueError, match="replace=True"):
        buffer.sample(3, replace=False)


def test_sample_is_seeded_and_uniform() -> None:
    a, b = ReplayBuffer(capacity=100, seed=1), ReplayBuffer(capacity=100, seed=1)
    for buffer in (a, b):
        buffer.extend(lazy_stack([turn(i) for i in range(100)]))
    assert torch.equal(a.sample(50)["i"], b.sample(50)["i"])
    counts = torch.bincount(a.sample(20_000)["i"], minlength=100).float()
    assert counts.min() > 120 and counts.max() < 290  # ~200 each


def test_min_policy_version_bounds_staleness() -> None:
    buffer = ReplayBuffer(capacity=10)
    buffer.extend(lazy_stack([turn(i, version=i // 3) for i in range(9)]))  # versions 0,0,0,1,1,1,2,2,2
    sample = buffer.sample(20, min_policy_version=2)
    assert set(sample[keys.POLICY_VERSION].tolist()) == {2}
    with pytest.raises(RuntimeError, match="policy_version >= 3"):
        buffer.sample(1, min_policy_version=3)


def test_empty_and_state_dict() -> None:
    buffer = ReplayBuffer(capacity=5, seed=0)
    buffer.extend(lazy_stack([turn(i) for i in range(7)]))
    state = buffer.state_dict()
    restored = ReplayBuffer(capacity=5)
    restored.load_state_dict(state)
    assert len(restored) == 5 and restored.write_count == 7
    assert torch.equal(restored.sample(4)["i"], buffer.sample(4)["i"])
    buffer.empty()
    assert len(buffer) == 0 and buffer.write_count == 0
    with pytest.raises(RuntimeError, match="empty"):
        buffer.sample(1)
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=6).load_state_dict(state)


def test_bad_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=0)


def test_concurrent_extend_and_sample() -> None:
    buffer = ReplayBuffer(capacity=1000)
    buffer.add(turn(0))
    errors: list[BaseException] = []

    def writer() -> None:
        for i in range(300):
            buffer.extend(lazy_stack([turn(i), turn(i + 1)]))

    def reader() -> None:
        try:
            for _ in range(300):
                assert buffer.sample(4).batch_size == torch.Size([4])
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and buffer.write_count == 601
