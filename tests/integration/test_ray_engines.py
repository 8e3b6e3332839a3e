"""Engines in Ray actors: RayEngine proxies behind an EngineRouter, driven by a ContinuousLLMCollector."""
from __future__ import annotations

import contextlib
import functools
import threading
import time

import pytest
import torch

from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.engines import TransformersEngine
from lmcollect.ray.engine import ray_engine_replicas
from lmcollect.envs import ChatEnv, GuessingGameTask, guessing_game_dataset
from lmcollect.models import load_model_and_tokenizer
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.weights.buckets import pack_buckets
from tests.engine_contract import CHECKS, EngineCase, hf_case, model_eos_token_ids
from tests.factories import make_holdable_tiny_engine, perturbed_model

pytestmark = pytest.mark.integration

GREEDY = SamplingConfig(max_new_tokens=8, temperature=0)


def guessing_env() -> ChatEnv:
    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=1, max_turns=4, seed=0)


def collect(engine, tokenizer, *, slots: int, turns: int, **kwargs) -> list:
    envs = [guessing_env() for _ in range(slots)]
    collector = ContinuousLLMCollector(envs, engine=engine, tokenizer=tokenizer, sampling=GREEDY, dialog_turns_per_batch=turns, **kwargs)
    collector.set_seed(0)
    with collector:
        return flatten_turns(collector.next())


# ---------------------------------------------------------------------- the engine contract, through actors
HOLD_S = 2.0  # a held decoding step (in the actor) lasts this long: the driver pauses the engine meanwhile


@pytest.fixture(scope="module")
def actor_case(ray_cluster, tiny_model_path):
    """A router of two engines in Ray actors (started once for every check; ``close`` runs last)."""
    import ray

    model, tokenizer = load_model_and_tokenizer(tiny_model_path)
    new = perturbed_model(tiny_model_path, seed=2)
    router = ray_engine_replicas(
        functools.partial(make_holdable_tiny_engine, str(tiny_model_path)), num_replicas=2, remote_config={"num_cpus": 0.25}
    )

    @contextlib.contextmanager
    def hold_step(step: int):
        ray.get([e.actor.call.remote("arm_hold", step, HOLD_S) for e in router.engines], timeout=30)
        reached, done = threading.Event(), threading.Event()

        def watch() -> None:  # the driver learns that a replica entered the held step
            while not done.is_set() and not reached.is_set():
                if any(ray.get([e.actor.call.remote("hold_reached") for e in router.engines], timeout=30)):
                    reached.set()
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield reached
        finally:
            done.set()
            watcher.join(timeout=30)

    yield hf_case(router, model, new, hold_step=hold_step, eos_token_ids=model_eos_token_ids(model, tokenizer))
    router.close()


def test_replicas_in_actors_answer_like_one_engine_and_keep_dialogs_on_one_replica(actor_case: EngineCase, tiny_model_path) -> None:
    """On the contract's router (first, before the contract checks; its start weights are pushed back at the end)."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_path)
    router = actor_case.engine
    try:
        # one slot: its dialogs run one after another, so both runs yield the same turns in the same
        # order whatever the timing (with several slots, which turns finish first is a race)
        routed = collect(router, tokenizer, slots=1, turns=12, track_policy_version=True)
        local = TransformersEngine(model, tokenizer)
        alone = collect(local, tokenizer, slots=1, turns=12)
        local.close()
        assert len(routed) == len(alone) == 12
        assert all(torch.equal(a[keys.TOKENS_RESPONSE], b[keys.TOKENS_RESPONSE]) for a, b in zip(routed, alone))
        replicas = {router.replica_of(str(int(t[keys.TRAJ_IDS]))) for t in routed}
        assert replicas == {0, 1}  # successive dialogs went to both replicas; each dialog's turns stayed on one (affinity)
        # a push reaches every replica, between two decoding steps
        trainer = perturbed_model(tiny_model_path, seed=2)
        collector = ContinuousLLMCollector(
            [guessing_env()], engine=router, tokenizer=tokenizer, sampling=GREEDY, dialog_turns_per_batch=2, track_policy_version=True
        )
        with collector:
            collector.next()
            collector.update_policy_weights_(trainer)
            after = flatten_turns(collector.next())
        assert [engine.version for engine in router.engines] == [collector.version_index()] * 2
        assert all(int(t[keys.POLICY_VERSION]) == collector.version_index() for t in after[-1:])
    finally:
        router.load_weights(actor_case.old_weights.items(), version=router.version + 1)  # the contract's start weights


def test_a_lora_adapter_reaches_every_replica_in_its_actor(actor_case: EngineCase, tiny_model_path) -> None:
    """Before the contract checks: the adapter travels to both actors' engines, each merges it."""
    pytest.importorskip("peft")
    from lmcollect.engines import EngineRequest
    from lmcollect.weights.lora import lora_adapter
    from tests.engine_contract import generate_greedy
    from tests.factories import merged_copy, trained_lora

    router = actor_case.engine
    start = load_model_and_tokenizer(tiny_model_path)[0]
    start.load_state_dict(actor_case.old_weights)
    peft_model = trained_lora(tiny_model_path, seed=41, base=start)
    merged = merged_copy(peft_model)
    try:
        router.load_weights(lora_adapter(peft_model), version=router.version + 1)
        assert len({engine.version for engine in router.engines}) == 1
        sampling = SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True)
        prompts = [[3, 4, 5 + i, 6] for i in range(4)]
        futures = [
            router.submit(EngineRequest(prompt_ids=p, sampling=sampling, request_id=f"lora-{i}", affinity=f"d{i}"))
            for i, p in enumerate(prompts)
        ]
        for prompt, future in zip(prompts, futures, strict=True):
            assert future.result(60).tokens.tolist() == generate_greedy(merged, prompt, 6, min_new_tokens=6)
    finally:
        # the contract's start weights, as a sender's buckets: through the router and each actor as they
        # are (the contract checks that follow answer as these weights)
        router.load_weights(pack_buckets(actor_case.old_weights), version=router.version + 1)


@pytest.mark.parametrize("check", list(CHECKS))  # in order: "close" is the last check
def test_engine_contract_through_actors(actor_case: EngineCase, check: str) -> None:
    CHECKS[check](actor_case)
