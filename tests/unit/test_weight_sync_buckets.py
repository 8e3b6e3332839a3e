"""Flat weight buckets, metadata checks and in-place loading: pure torch, no collector."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lmcollect.weights.buckets import (
    PackTarget,
    holds_non_finite,
    ALIGN_BYTES,
    layout_from_json,
    layout_to_json,
    metadata_from_json,
    metadata_to_json,
    pack_buckets,
    plan_layout,
    view_buckets,
)
from lmcollect.weights.tensors import expected_metadata, load_weights_, to_weight_dict, weight_problems


class TiedNet(nn.Module):
    """Tied weights, a persistent and a non-persistent buffer, and a bf16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.low = nn.Parameter(torch.randn(2, 3).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor(3))
        self.register_buffer("scratch", torch.ones(3), persistent=False)


def mixed_weights() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.tensor(5, dtype=torch.int64),  # 0-dim
        "d": torch.tensor([True, False, True]),
        "e": torch.empty(0, 4),
        "f": base.t(),  # not contiguous
        "g": torch.randn(2, 2).to(torch.float16),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("build", [pack_buckets, view_buckets])
def test_round_trip_every_dtype_and_shape(build) -> None:
    weights = mixed_weights()
    buckets = build(weights)
    assert_same(buckets.tensors(), weights)
    assert_same(buckets.to_numpy().tensors(), weights)  # the form the object store carries
    assert buckets.layout.metadata() == {k: (v.dtype, v.shape) for k, v in weights.items()}


def test_pack_makes_one_aligned_buffer_per_dtype() -> None:
    buckets = pack_buckets(mixed_weights())
    dtypes = {s.dtype for s in buckets.layout.slots}
    assert len(buckets.buffers) == len(dtypes) == 5
    assert all(s.offset_bytes % ALIGN_BYTES == 0 for s in buckets.layout.slots)
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in buckets.buffers)


def test_bucket_size_splits_buffers_and_keeps_big_tensors_whole() -> None:
    weights = {f"w{i}": torch.randn(64) for i in range(6)}  # 256 bytes each
    layout = plan_layout(weights, bucket_size_bytes=600)
    assert layout.buffer_nbytes == (512, 512, 512)
    assert plan_layout({"big": torch.randn(1000)}, bucket_size_bytes=600).buffer_nbytes == (4000,)
    assert_same(pack_buckets(weights, bucket_size_bytes=600).tensors(), weights)
    with pytest.raises(ValueError, match="bucket_size_bytes"):
        plan_layout(weights, bucket_size_bytes=0)


def test_pack_reuses_its_buffers_when_the_layout_is_unchanged() -> None:
    weights = mixed_weights()
    first = pack_buckets(weights)
    weights["a"] += 1
    second = pack_buckets(weights, out=first.buffers)
    assert all(x is y for x, y in zip(first.buffers, second.buffers))
    assert torch.equal(second.tensors()["a"], weights["a"])


@pytest.mark.parametrize("build", [pack_buckets, view_buckets])
def test_tied_tensors_travel_once(build) -> None:
    net = TiedNet()
    weights = to_weight_dict(net)
    buckets = build(weights)
    slots = {s.name: s for s in buckets.layout.slots}
    tied = slots["embed.weight"], slots["head.weight"]
    assert (tied[0].buffer_index, tied[0].offset_bytes) == (tied[1].buffer_index, tied[1].offset_bytes)
    assert_same(buckets.tensors(), weights)


def test_view_buckets_copies_nothing_for_contiguous_cpu_tensors() -> None:
    weights = {"a": torch.randn(4, 4), "b": torch.randn(3)}
    buckets = view_buckets(weights)
    assert [b.data_ptr() for b in buckets.buffers] == [weights["a"].data_ptr(), weights["b"].data_ptr()]


def test_layout_and_metadata_travel_as_json() -> None:
    layout = pack_buckets(mixed_weights()).layout
    assert layout_from_json(layout_to_json(layout)) == layout
    meta, aliases = expected_metadata(TiedNet())
    assert metadata_from_json(metadata_to_json(meta, aliases)) == (meta, aliases)
    with pytest.raises(ValueError, match="unknown dtype"):
        layout_from_json(layout_to_json(layout).replace('"float32"', '"Tensor"'))


def test_weight_problems_lists_every_mismatch() -> None:
    expected, aliases = expected_metadata(TiedNet())
    sent = {k: (v.dtype, v.shape) for k, v in to_weight_dict(TiedNet()).items()}
    assert weight_problems(sent, expected, aliases=aliases) == []
    del sent["norm.bias"]
    sent["extra"] = (torch.float32, torch.Size([1]))
    sent["norm.weight"] = (torch.float32, torch.Size([5]))
    sent["low"] = (torch.float32, torch.Size([2, 3]))
    problems = weight_problems(sent, expected, aliases=aliases)
    assert len(problems) == 4
    assert any("missing 'norm.bias'" in p for p in problems)
    assert any("unexpected 'extra'" in p for p in problems)
    assert any("'norm.weight' has shape (5,)" in p for p in problems)
    assert any("'low' has dtype torch.float32" in p and "convert_dtype=True" in p for p in problems)
    sent["norm.weight"] = (torch.float32, torch.Size([4]))
    sent["norm.bias"] = (torch.float32, torch.Size([4]))
    del sent["extra"]
    assert weight_problems(sent, expected, aliases=aliases, convert_dtype=True) == []


def test_tied_alias_may_be_sent_alone() -> None:
    expected, aliases = expected_metadata(TiedNet())
    sent = {k: (v.dtype, v.shape) for k, v in to_weight_dict(TiedNet()).items() if k != "embed.weight"}
    assert weight_problems(sent, expected, aliases=aliases) == []


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()} | {"scratch": net.scratch.clone()}


@pytest.mark.parametrize(
    "spoil",
    [
        lambda w: w.pop("norm.bias"),
        lambda w: w.update(extra=torch.zeros(1)),
        lambda w: w.update({"norm.weight": torch.zeros(5)}),
        lambda w: w.update(low=torch.zeros(2, 3)),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_bad_load_changes_nothing(spoil) -> None:
    net = TiedNet()
    before = snapshot(net)
    weights = {k: torch.full_like(v, 7) for k, v in to_weight_dict(TiedNet()).items()}
    spoil(weights)
    with pytest.raises(ValueError, match="no weight was changed"):
        load_weights_(net, weights)
    assert_same(snapshot(net), before)


def test_repeated_identical_loads_keep_all_state() -> None:
    source, net = TiedNet(), TiedNet()
    with torch.no_grad():
        source.steps.fill_(11)
    for _ in range(2):
        load_weights_(net, pack_buckets(to_weight_dict(source)).tensors())
        assert_same(net.state_dict(), source.state_dict())
        assert net.head.weight is net.embed.weight  # still tied
        assert torch.equal(net.scratch, torch.ones(3))  # non-persistent buffer untouched
        assert int(net.steps) == 11


def test_convert_dtype_only_when_asked() -> None:
    net = TiedNet()
    weights = {k: v.double() if v.is_floating_point() else v for k, v in to_weight_dict(TiedNet()).items()}
    with pytest.raises(ValueError, match="dtype torch.float64"):
        load_weights_(net, weights)
    load_weights_(net, weights, convert_dtype=True)
    assert net.low.dtype == torch.bfloat16
    assert torch.equal(net.norm.weight, weights["norm.weight"].float())


def test_direct_packing_sends_big_tensors_as_they_are_and_announces_buffers_in_order() -> None:
    weights = {
        "small.a": torch.arange(4, dtype=torch.float32),
        "big": torch.randn(64, 64),
        "small.b": torch.arange(3, dtype=torch.int64),
        "big16": torch.randn(32, 64).to(torch.bfloat16),
    }
    layout = plan_layout(weights, own_buffer_min_bytes=4096)
    announced: list[int] = []
    buckets = pack_buckets(weights, layout=layout, direct=True, on_buffer_packed=lambda i, _: announced.append(i))
    assert announced == list(range(len(layout.buffer_nbytes)))
    by_name = {slot.name: slot for slot in layout.slots}
    for name in ("big", "big16"):  # a buffer of its own, viewing the trainer's memory: no copy
        buffer = buckets.buffers[by_name[name].buffer_index]
        assert buffer.data_ptr() == weights[name].data_ptr() and buffer.numel() == weights[name].nbytes
    assert by_name["small.a"].buffer_index != by_name["big"].buffer_index
    got = buckets.tensors()
    assert all(torch.equal(got[k], v) for k, v in weights.items())
    copied = pack_buckets(weights, layout=layout)  # not direct: every buffer is a copy
    assert all(b.data_ptr() != weights["big"].data_ptr() for b in copied.buffers)


def test_the_finite_check_names_every_spoiled_tensor() -> None:
    weights = {"a": torch.ones(4, 3), "b": torch.arange(6), "c": torch.zeros(5), "d": torch.ones(2)}
    weights["a"][1, 2], weights["c"][0] = float("nan"), float("-inf")
    with pytest.raises(ValueError, match=r"\['a', 'c'\] hold NaN or infinite values.*allow_non_finite=True"):
        PackTarget.allocate(plan_layout(weights)).pack(weights, check_finite=True)
    assert not holds_non_finite(torch.arange(3)) and holds_non_finite(torch.tensor([float("inf")]))


def test_a_pack_target_packs_every_push_into_the_same_buffers_and_refuses_non_finite_tensors_by_name() -> None:
    weights = {"a": torch.ones(4, 3), "b": torch.arange(6.0), "c": torch.zeros(5)}
    weights["tied"] = weights["a"]  # a tied alias: one slot's bytes
    target = PackTarget.allocate(plan_layout(weights))
    first = target.pack(weights)
    moved = {name: tensor + 1 for name, tensor in weights.items()}
    second = target.pack(moved, check_finite=True)
    assert [b.data_ptr() for b in second.buffers] == [b.data_ptr() for b in first.buffers]
    assert all(torch.equal(second.tensors()[name], moved[name]) for name in ("a", "b", "c"))
    moved["c"][2] = float("inf")
    with pytest.raises(ValueError, match=r"\['c'\] hold NaN or infinite values"):
        target.pack(moved, check_finite=True)
    with pytest.raises(ValueError, match="3 tensors for a layout of 4"):
        target.pack({"a": weights["a"], "b": weights["b"], "c": weights["c"]})
