"""A push's receiving end without a collector: a WeightLoader over an engine loads, versions and
refuses exactly as a collector's receive_weights does (the collector only forwards to it)."""

from __future__ import annotations

import pytest
import torch

from lmcollect.engines import TransformersEngine
from lmcollect.models import load_model_and_tokenizer
from lmcollect.weight_sync.loader import LoadOptions, WeightLoader
from lmcollect.weights.buckets import pack_buckets
from lmcollect.weights.version import PolicyVersion, PushVersion
from tests.factories import perturbed_model


@pytest.fixture
def engine(tiny_model_path):
    tokenizer = load_model_and_tokenizer(tiny_model_path)[1]
    return TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer)


def test_a_loader_puts_a_senders_buckets_into_its_engine_and_the_version_is_the_engines(engine, tiny_model_path) -> None:
    version = PolicyVersion()
    version.share(engine.version_counter)
    loader = WeightLoader(engine, version=version)
    new = perturbed_model(tiny_model_path, seed=2).state_dict()
    loader.load(pack_buckets(new), LoadOptions(version=PushVersion(3, "three")))
    assert (engine.version, version.index, version.version_uuid) == (3, 3, "three")
    assert loader.held_push == PushVersion(3, "three")
    name = next(iter(engine.weight_metadata()[0]))
    torch.testing.assert_close(engine.model.state_dict()[name], new[name], rtol=0, atol=0)


def test_a_loader_refuses_a_stale_version_and_a_wrong_shape_with_nothing_changed(engine, tiny_model_path) -> None:
    version = PolicyVersion()
    version.share(engine.version_counter)
    loader = WeightLoader(engine, version=version)
    weights = perturbed_model(tiny_model_path, seed=2).state_dict()
    loader.load(weights, LoadOptions(version=PushVersion(2, "two")))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="older"):
        loader.load(perturbed_model(tiny_model_path, seed=3).state_dict(), LoadOptions(version=PushVersion(1, "one")))
    name = next(iter(weights))
    bad = dict(weights, **{name: torch.zeros(3, 3, dtype=weights[name].dtype)})
    with pytest.raises(ValueError, match=name):
        loader.load(bad, LoadOptions(version=PushVersion(4, "four")))
    assert (engine.version, loader.held_push) == (2, PushVersion(2, "two"))
    for key, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(tensor, before[key], rtol=0, atol=0)


def test_a_loader_over_an_engine_receives_for_the_policy_only(engine) -> None:
    loader = WeightLoader(engine, version=None)
    with pytest.raises(ValueError, match="model_id='critic'.*'policy' only"):
        loader.metadata("critic")


def test_a_load_into_an_engine_that_takes_the_version_itself_never_pauses_it(engine, tiny_model_path) -> None:
    """The engine's load lands between two decoding steps and takes the shared version there: the
    loader does not pause it (a pause would stall decoding while the engine copies); an engine with
    a counter of its own is paused, so load, cache reset and version change together."""
    pauses = []
    engine.pause = lambda original=engine.pause: (pauses.append(1), original())[1]
    shared = PolicyVersion()
    shared.share(engine.version_counter)
    WeightLoader(engine, version=shared).load(perturbed_model(tiny_model_path, seed=2).state_dict(),
                                              LoadOptions(version=PushVersion(1, "one")))
    assert pauses == [] and (engine.version, shared.index) == (1, 1)
    separate = PolicyVersion()
    WeightLoader(engine, version=separate).load(perturbed_model(tiny_model_path, seed=3).state_dict(),
                                                LoadOptions(version=PushVersion(2, "two")))
    assert pauses == [1] and (engine.version, separate.index) == (2, 2)
