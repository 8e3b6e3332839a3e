"""A push is packed once, by its sender: the receiving collector hands the sender's buckets to the
engine as they are (checked first, read through views), and the engine copies from those bytes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.engines import TransformersEngine
from lmcollect.envs import ChatEnv, SingleTurnTask, arithmetic_dataset
from lmcollect.models import load_model_and_tokenizer
from lmcollect.weights.buckets import BucketLayout, WeightBuckets, pack_buckets, packs_made, view_buckets
from tests.factories import perturbed_model


class SeenLoads:
    """Records the source of every ``load_weights`` call of one engine, then runs the real load."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.sources: list[object] = []
        real = engine.load_weights

        def load_weights(source, **kwargs):
            self.sources.append(source)
            return real(source, **kwargs)

        engine.load_weights = load_weights  # type: ignore[method-assign]


@pytest.fixture
def parts(tiny_model_path):
    tokenizer = load_model_and_tokenizer(tiny_model_path)[1]
    engine = TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer)
    env = ChatEnv(arithmetic_dataset(4, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=tokenizer, dialog_turns_per_batch=1, track_policy_version=True
    )
    yield engine, collector, SeenLoads(engine)
    collector.shutdown()
    engine.close()


def buffer_addresses(buckets: WeightBuckets) -> list[int]:
    return [torch.as_tensor(buffer).data_ptr() for buffer in buckets.buffers]


def params_of(engine: TransformersEngine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.model.state_dict().items()}


@pytest.mark.parametrize("form", ["packed", "views", "numpy"])
def test_the_engine_receives_the_senders_buffers_and_nothing_is_packed_again(tiny_model_path, parts, form) -> None:
    engine, collector, seen = parts
    new = perturbed_model(tiny_model_path, seed=2).state_dict()
    buckets = {"packed": lambda: pack_buckets(new), "views": lambda: view_buckets(new)}.get(
        form, lambda: pack_buckets(new).to_numpy()
    )()
    packs = packs_made()
    collector.receive_weights(buckets, convert_dtype=True)  # the dtypes already match: nothing to cast
    assert packs_made() == packs, "the receiving side packed the push again"
    assert len(seen.sources) == 1 and seen.sources[0] is buckets
    assert buffer_addresses(seen.sources[0]) == buffer_addresses(buckets)
    for name, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(tensor, new[name], rtol=0, atol=0, msg=name)
    assert engine.version == collector.version_index() == 1


def test_buckets_that_do_not_fit_or_hold_nan_are_refused_before_anything_changes(tiny_model_path, parts) -> None:
    engine, collector, _ = parts
    held = params_of(engine)
    new = perturbed_model(tiny_model_path, seed=2).state_dict()
    buckets = pack_buckets(new)
    first = buckets.layout.slots[0]
    misshapen = dataclasses.replace(first, shape=(first.shape[0] + 1, *first.shape[1:]))
    wrong = WeightBuckets(BucketLayout((misshapen, *buckets.layout.slots[1:]), buckets.layout.buffer_nbytes), buckets.buffers)
    with pytest.raises(ValueError, match=r"has shape \(|corrupt"):
        collector.receive_weights(wrong)
    nan = {name: t.clone() for name, t in new.items()}
    next(t for t in nan.values() if t.is_floating_point())[0].fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        collector.receive_weights(pack_buckets(nan))
    assert engine.version == collector.version_index() == 0  # one counter: the collector's starting 0
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, held[name]), name


def test_a_cast_push_is_packed_by_no_one_but_loads_the_cast_values(tiny_model_path, parts) -> None:
    """``convert_dtype`` that must cast makes new tensors (the cast itself): they go to the engine
    as named tensors, not packed again."""
    engine, collector, seen = parts
    new = {name: t.double() for name, t in perturbed_model(tiny_model_path, seed=3).state_dict().items()}
    buckets = pack_buckets(new)
    packs = packs_made()
    collector.receive_weights(buckets, convert_dtype=True)
    assert packs_made() == packs and not isinstance(seen.sources[0], WeightBuckets)
    for name, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(tensor, new[name].to(tensor.dtype), rtol=0, atol=0, msg=name)
