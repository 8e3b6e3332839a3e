"""Engine capabilities: declared once (EngineCapabilities), read with capabilities_of, and the one
base load_weights (EngineBase) refusing by them, naming the fix."""
from __future__ import annotations

import pytest
import torch

from lmcollect.engines import EngineCapabilities, EngineRouter, capabilities_of
from lmcollect.engines.kv_policy import configure_kv_policy, push_costs_of
from lmcollect.engines.protocol import check_engine_loads, version_counter_of
from lmcollect.engines.weight_group import GroupPush
from lmcollect.testing import ScriptedEngine
from lmcollect.weights.lora import LoraAdapter, LoraLayerWeights
from tests.unit.test_engine_router import HeldEngine, WorkerHeldEngine


def tiny_adapter() -> LoraAdapter:
    return LoraAdapter(layers={"w": LoraLayerWeights(torch.zeros(1, 1), torch.zeros(1, 1), 1.0)}, rank=1)


def test_an_engine_that_declares_nothing_loads_full_weights_only() -> None:
    engine = HeldEngine("user")
    assert capabilities_of(engine) == EngineCapabilities()
    assert capabilities_of(engine).loads("full") and not capabilities_of(engine).loads("lora_adapter")
    assert version_counter_of(engine) is None and push_costs_of(engine) == []
    assert check_engine_loads(engine, [("w", torch.zeros(1))]) == "full"
    with pytest.raises(TypeError, match=r"HeldEngine does not load LoRA adapters.*merge_and_unload"):
        check_engine_loads(engine, tiny_adapter())
    with pytest.raises(TypeError, match="HeldEngine has no worker processes.*RayRemoteWeightUpdater"):
        check_engine_loads(engine, GroupPush())
    assert configure_kv_policy(engine, "recompute") == "recompute"
    with pytest.raises(ValueError, match="kv_policy='keep'.*use kv_policy='recompute'"):
        configure_kv_policy(engine, "keep")


def test_a_capabilities_attribute_of_another_type_is_refused() -> None:
    engine = HeldEngine("odd")
    engine.capabilities = {"loads_lora_adapters": True}  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="declare an EngineCapabilities"):
        capabilities_of(engine)


def test_a_router_offers_what_every_replica_loads() -> None:
    plain, workers = HeldEngine("a"), WorkerHeldEngine("b")
    assert capabilities_of(EngineRouter([WorkerHeldEngine("c"), workers])).loads_group_pushes
    router = EngineRouter([plain, workers])
    try:
        assert not capabilities_of(router).loads_group_pushes and capabilities_of(router).has_version_counter
        assert version_counter_of(router) is router.version_counter
        with pytest.raises(TypeError, match="EngineRouter has no worker processes"):
            router.load_weights(GroupPush(), version=1)
        assert plain.events == [] and router.version == -1  # refused before any replica was called
    finally:
        router.close()


def test_the_base_load_weights_refuses_by_name_before_reading() -> None:
    engine = ScriptedEngine()
    try:
        assert capabilities_of(engine) == EngineCapabilities(has_version_counter=True)
        with pytest.raises(TypeError, match="ScriptedEngine does not load LoRA adapters"):
            engine.load_weights(tiny_adapter(), version=0)
        with pytest.raises(TypeError, match=r"got \['convert_dtype'\] with full weights; it takes no keyword"):
            engine.load_weights([("tag", torch.ones(1))], version=0, convert_dtype=True)
        with pytest.raises(TypeError, match="version must be an int"):
            engine.load_weights([("tag", torch.ones(1))], version=1.0)
        assert engine.version == -1
        engine.load_weights([("tag", torch.ones(1))], version=0)
        assert engine.version == 0 and version_counter_of(engine) is engine.version_counter
    finally:
        engine.close()
