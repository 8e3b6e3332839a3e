"""The local LLMCollector: every collection mode, bookkeeping, background collection and bad input."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors import CollectionConfig, ContinuousLLMCollector, LLMCollector, PolicyVersion
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import (
    AsyncEnvPool,
    ChatEnv,
    GuessingGameTask,
    MathAnswerReward,
    arithmetic_dataset,
    binary_search_player,
    guessing_game_dataset,
)
from lmcollect.testing import ScriptedPolicy
from lmcollect.weights.version import PushVersion


def guessing_env(batch_size: int = 3, seed: int = 0) -> ChatEnv:
    return ChatEnv(
        guessing_game_dataset(64, seed=seed, low=1, high=20, max_turns=5),
        task=GuessingGameTask(low=1, high=20, max_turns=5),
        batch_size=batch_size,
        max_turns=5,
        seed=seed,
    )


def arithmetic_env(batch_size: int = 4, seed: int = 0) -> ChatEnv:
    return ChatEnv(arithmetic_dataset(64, seed=seed), reward_fn=MathAnswerReward(), batch_size=batch_size, seed=seed)


def guesser() -> ScriptedPolicy:
    return ScriptedPolicy(binary_search_player)


def all_turns(batches) -> list:
    return [turn for batch in batches for turn in flatten_turns(batch)]


def check_trajectories_complete(turns) -> None:
    """Every trajectory's step counts are 0..n-1 in order, done only on the last."""
    by_traj: dict[int, list] = {}
    for turn in turns:
        by_traj.setdefault(int(turn[keys.TRAJ_IDS]), []).append(turn)
    for traj_id, traj in by_traj.items():
        steps = [int(t[keys.STEP_COUNT]) for t in traj]
        assert steps == list(range(len(traj))), f"trajectory {traj_id} has steps {steps}"
        dones = [bool(t[keys.NEXT_DONE]) for t in traj]
        assert not any(dones[:-1]), f"trajectory {traj_id} is done before its last turn"


def test_steps_mode_shape_and_counts() -> None:
    collector = LLMCollector(guessing_env(3), policy=guesser(), dialog_turns_per_batch=7, total_dialog_turns=27)
    batches = list(collector)
    # T = ceil(7 / 3) = 3 steps per env: 9 turns per batch, 3 batches reach 27
    assert [b.batch_size for b in batches] == [torch.Size([3, 3])] * 3
    assert collector.turns_run == 27
    turns = all_turns(batches)
    assert len({(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in turns}) == 27  # no duplicate
    # trajectories continue across batches: per env row, turns are consecutive
    for env_index in range(3):
        row = [t for t in turns if int(t[keys.ENV_INDEX]) == env_index]
        for prev, nxt in zip(row, row[1:]):
            if bool(prev[keys.NEXT_DONE]):
                assert int(nxt[keys.STEP_COUNT]) == 0 and int(nxt[keys.TRAJ_IDS]) > int(prev[keys.TRAJ_IDS])
            else:
                assert int(nxt[keys.TRAJ_IDS]) == int(prev[keys.TRAJ_IDS])
                assert int(nxt[keys.STEP_COUNT]) == int(prev[keys.STEP_COUNT]) + 1


def test_flatten_data() -> None:
    collector = LLMCollector(guessing_env(3), policy=guesser(), dialog_turns_per_batch=6, flatten_data=True)
    assert collector.next().batch_size == torch.Size([6])


def test_stop_iteration_says_why() -> None:
    collector = LLMCollector(arithmetic_env(4), policy=ScriptedPolicy("#### 1"), dialog_turns_per_batch=4, total_dialog_turns=8)
    assert len(list(collector)) == 2
    with pytest.raises(StopIteration, match="total_dialog_turns=8"):
        collector.next()


def test_multi_turn_prompt_grows_and_env_replies() -> None:
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=2, yield_completed_trajectories=True)
    batch = collector.next()
    turns = flatten_turns(batch)
    first_traj = [t for t in turns if int(t[keys.TRAJ_IDS]) == int(turns[0][keys.TRAJ_IDS])]
    assert len(first_traj) >= 2, "binary search on 1..20 needs more than one guess for most secrets"
    for prev, nxt in zip(first_traj, first_traj[1:]):
        prev_prompt, next_prompt = prev[keys.HISTORY_PROMPT], nxt[keys.HISTORY_PROMPT]
        assert len(next_prompt) == len(prev_prompt) + 2  # + assistant guess + env reply
        assert next_prompt.messages[-1].content in ("Higher.", "Lower.")
        assert len(nxt[keys.TEXT_PROMPT]) > len(prev[keys.TEXT_PROMPT])
    assert float(first_traj[-1][keys.NEXT_REWARD]) == 1.0  # binary search always finds it in 5
    assert all(float(t[keys.NEXT_REWARD]) == 0.0 for t in first_traj[:-1])


def test_yield_completed_trajectories_contiguous_and_carried_over() -> None:
    collector = LLMCollector(
        guessing_env(3), policy=guesser(), dialog_turns_per_batch=5, total_dialog_turns=60, yield_completed_trajectories=True
    )
    batches = list(collector)
    seen: list[int] = []
    for batch in batches:
        assert batch.batch_dims == 1 and batch.numel() >= 5
        turns = flatten_turns(batch)
        assert bool(turns[-1][keys.NEXT_DONE])
        ids = [int(t[keys.TRAJ_IDS]) for t in turns]
        # contiguous: each id appears in one run
        runs = [ids[0]] + [b for a, b in zip(ids, ids[1:]) if a != b]
        assert len(runs) == len(set(runs))
        seen.extend(runs)
        check_trajectories_complete(turns)
    assert len(seen) == len(set(seen)), "a trajectory was yielded twice"


def test_yield_only_last_steps() -> None:
    collector = LLMCollector(guessing_env(3), policy=guesser(), dialog_turns_per_batch=4, total_dialog_turns=40, yield_only_last_steps=True)
    batches = list(collector)
    assert batches and all(b.batch_size == torch.Size([4]) for b in batches)
    ids = [int(t[keys.TRAJ_IDS]) for t in all_turns(batches)]
    assert len(ids) == len(set(ids))
    assert all(bool(t[keys.NEXT_DONE]) for t in all_turns(batches))
    assert collector.turns_run >= 40  # counts every turn run, also the dropped ones


def test_versions_stamped_and_bumped() -> None:
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=4, track_policy_version=True)
    first = collector.next()
    assert collector.policy_version == 0 and collector.get_policy_version() == 0
    collector.increment_version()
    second = collector.next()
    assert set(first[keys.POLICY_VERSION].flatten().tolist()) == {0}
    assert set(second[keys.POLICY_VERSION].flatten().tolist()) == {1}
    # trajectories spanning the update know both ends
    spanning = [t for t in flatten_turns(second) if int(t[keys.TRAJ_MIN_VERSION]) == 0]
    assert all(int(t[keys.TRAJ_MAX_VERSION]) == 1 for t in spanning)


def test_uuid_versions() -> None:
    version = PolicyVersion("uuid")
    collector = LLMCollector(arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2, track_policy_version=version)
    before = collector.policy_version
    collector.increment_version()
    assert isinstance(before, str) and collector.policy_version != before
    batch = collector.next()
    assert flatten_turns(batch)[0][keys.POLICY_VERSION] == collector.policy_version


def test_untracked_version_is_none() -> None:
    collector = LLMCollector(arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2)
    assert collector.policy_version is None
    assert set(collector.next()[keys.POLICY_VERSION].flatten().tolist()) == {-1}


def test_unique_trajectory_ids_across_envs_with_async_pool() -> None:
    pool = AsyncEnvPool([lambda: guessing_env(2, seed=1), lambda: guessing_env(2, seed=2)])
    collector = LLMCollector(
        pool, policy=guesser(), dialog_turns_per_batch=6, total_dialog_turns=48, async_envs=True, yield_completed_trajectories=True
    )
    turns = all_turns(list(collector))
    collector.shutdown()
    check_trajectories_complete(turns)
    slots = {int(t[keys.ENV_INDEX]) for t in turns}
    assert slots == {0, 1, 2, 3}  # both sub-envs' elements produced trajectories
    assert len({(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in turns}) == len(turns)


def test_async_steps_mode_keeps_every_turn() -> None:
    pool = AsyncEnvPool([lambda: arithmetic_env(2, seed=1), lambda: arithmetic_env(2, seed=2)])
    collector = LLMCollector(pool, policy=ScriptedPolicy("#### 3"), dialog_turns_per_batch=8, total_dialog_turns=32, async_envs=True)
    batches = list(collector)
    collector.shutdown()
    assert all(b.batch_size == torch.Size([4, 2]) for b in batches)
    ids = [int(t[keys.TRAJ_IDS]) for t in all_turns(batches)]
    assert len(ids) == len(set(ids)) == 8 * len(batches)
    # a faster env may not run past the budget: every turn run is yielded, exactly 32
    assert len(batches) == 4 and collector.turns_yielded == collector.turns_run == len(ids) == 32
    assert collector.num_buffered_turns == 0


def test_postproc_runs_on_every_batch() -> None:
    def add_flag(batch):
        batch.set("postprocessed", torch.ones(batch.batch_size, dtype=torch.bool))
        return batch

    collector = LLMCollector(arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2, total_dialog_turns=6, postproc=add_flag)
    assert all(bool(b["postprocessed"].all()) for b in collector)


def test_reset_at_each_iter_starts_fresh_dialogs() -> None:
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=2, reset_at_each_iter=True)
    for _ in range(3):
        batch = collector.next()
        assert batch[keys.STEP_COUNT].flatten().tolist() == [0, 0]


def test_replay_buffer_mode_yields_none_and_fills_buffer() -> None:
    buffer = ReplayBuffer(capacity=100)
    collector = LLMCollector(arithmetic_env(4), policy=ScriptedPolicy("1"), dialog_turns_per_batch=4, total_dialog_turns=12, replay_buffer=buffer)
    assert list(collector) == [None, None, None]
    assert len(buffer) == 12 and buffer.write_count == 12
    assert collector.getattr_rb("capacity") == 100


def test_start_pause_shutdown() -> None:
    buffer = ReplayBuffer(capacity=10_000)
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=2, replay_buffer=buffer)
    collector.start()
    deadline = time.monotonic() + 30
    while len(buffer) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(buffer) >= 10 and collector.is_running()
    with collector.pause():
        frozen = collector.turns_run
        time.sleep(0.2)
        assert collector.turns_run == frozen  # nothing collected while paused
    deadline = time.monotonic() + 30
    while collector.turns_run == frozen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert collector.turns_run > frozen  # resumed
    collector.shutdown()
    collector.shutdown()  # idempotent
    assert not collector.is_running() and not collector.is_initialized()
    with pytest.raises(RuntimeError, match="shut down"):
        collector.next()


def test_start_stops_at_total() -> None:
    buffer = ReplayBuffer(capacity=1000)
    collector = LLMCollector(arithmetic_env(4), policy=ScriptedPolicy("1"), dialog_turns_per_batch=4, total_dialog_turns=20, replay_buffer=buffer)
    collector.start()
    deadline = time.monotonic() + 30
    while collector.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(buffer) == 20
    collector.async_shutdown(timeout=5)


def test_same_seed_same_data() -> None:
    def run(seed: int) -> list[str]:
        collector = LLMCollector(arithmetic_env(4), policy=ScriptedPolicy(lambda h: h.messages[-1].content[-4:]), dialog_turns_per_batch=8)
        assert collector.set_seed(seed) == seed + 1
        return [t[keys.TEXT_RESPONSE] for t in flatten_turns(collector.next())]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_state_dict_round_trip() -> None:
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=4, track_policy_version=True)
    collector.next()
    collector.increment_version()
    state = collector.state_dict()
    assert {"policy_state_dict", "env_state_dict"} <= set(state)
    other = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=4, track_policy_version=True)
    other.load_state_dict(state)
    assert other.policy_version == 1 and other.turns_run == collector.turns_run


def test_reset_index_starts_new_trajectory_in_that_slot() -> None:
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=2)
    first = collector.next()
    collector.reset(index=[1])
    second = collector.next()
    assert int(second[1, 0][keys.STEP_COUNT]) == 0
    assert int(second[1, 0][keys.TRAJ_IDS]) != int(first[1, 0][keys.TRAJ_IDS])


def test_attribute_access_and_models() -> None:
    policy = guesser()
    collector = LLMCollector(guessing_env(2), policy=policy, dialog_turns_per_batch=2)
    assert collector.getattr_env("batch_size") == torch.Size([2])
    assert collector.getattr_policy("num_calls") == 0
    assert collector.get_model("policy") is policy  # a policy without .model is its own model
    assert collector.get_policy_model() is policy
    with pytest.raises(ValueError, match="unknown model_id 'value_net'"):
        collector.get_model("value_net")
    with pytest.raises(AttributeError, match="replay_buffer"):
        collector.getattr_rb("capacity")
    assert collector.dialog_turns_per_batch == 2 and collector.total_dialog_turns == -1
    assert collector.rollout().batch_size == torch.Size([2, 1])
    assert collector.is_initialized()


def test_cascade_execute_uses_attribute_and_item_access() -> None:
    collector = LLMCollector(guessing_env(2), policy=guesser(), dialog_turns_per_batch=2)
    collector._receiver_schemes["policy"] = type("Scheme", (), {"echo": staticmethod(lambda x, worker_idx=None: (x, worker_idx))})()
    assert collector.cascade_execute("_receiver_schemes['policy'].echo", 5, worker_idx=0) == (5, 0)
    with pytest.raises(ValueError, match="private attribute '__import__'"):
        collector.cascade_execute("__import__('os').system('true')")


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_dialog_turns_per_batch(bad) -> None:
    with pytest.raises(ValueError, match="dialog_turns_per_batch"):
        LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), dialog_turns_per_batch=bad)


def test_policy_and_policy_factory_exclusive() -> None:
    with pytest.raises(TypeError, match="policy or policy_factory"):
        LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), policy_factory=ScriptedPolicy, dialog_turns_per_batch=2)


def test_no_policy() -> None:
    with pytest.raises(TypeError, match="policy="):
        LLMCollector(arithmetic_env(), dialog_turns_per_batch=2)


def test_yield_modes_follow_the_spec_rule() -> None:
    # yield_only_last_steps=True means "completed trajectories, last step only": both True is
    # the same thing, and last steps without completed trajectories is the contradiction.
    both = LLMCollector(guessing_env(3), policy=guesser(), dialog_turns_per_batch=4, total_dialog_turns=40,
                        yield_only_last_steps=True, yield_completed_trajectories=True)
    batch = both.next()
    assert batch.batch_size == torch.Size([4]) and all(bool(t[keys.NEXT_DONE]) for t in flatten_turns(batch))
    with pytest.raises(TypeError, match="yield_completed_trajectories=False"):
        LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), dialog_turns_per_batch=2, yield_only_last_steps=True, yield_completed_trajectories=False)
    with pytest.raises(ValueError, match="flatten_data=False"):
        LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), dialog_turns_per_batch=2, yield_completed_trajectories=True, flatten_data=False)


def test_empty_dataset() -> None:
    with pytest.raises(ValueError, match="empty"):
        LLMCollector(lambda: ChatEnv([], batch_size=2), policy=ScriptedPolicy(), dialog_turns_per_batch=2)


def test_policy_output_missing_key() -> None:
    def lazy_policy(td):
        return td  # answers nothing

    collector = LLMCollector(arithmetic_env(), policy=lazy_policy, dialog_turns_per_batch=2)
    with pytest.raises(ValueError, match=r"returned no \[\('history', 'response'\)"):
        collector.next()


def test_start_needs_replay_buffer() -> None:
    collector = LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), dialog_turns_per_batch=2)
    with pytest.raises(ValueError, match="replay_buffer"):
        collector.start()


def test_reward_error_names_element_and_keeps_collected_turns() -> None:
    calls = {"n": 0}

    def flaky_reward(history) -> float:
        calls["n"] += 1
        if calls["n"] == 7:  # fails once, in the middle of the second step
            raise ZeroDivisionError("boom")
        return 1.0

    env = ChatEnv(arithmetic_dataset(64, seed=0), reward_fn=flaky_reward, batch_size=4, seed=0)
    collector = LLMCollector(env, policy=ScriptedPolicy("#### 1"), dialog_turns_per_batch=8, flatten_data=True)
    with pytest.raises(RuntimeError, match=r"(?s)env element 2.*What is") as info:
        collector.next()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    batch = collector.next()  # the 4 turns of the first step were kept
    ids = sorted(int(t[keys.TRAJ_IDS]) for t in flatten_turns(batch))
    assert ids == list(range(ids[0], ids[0] + 8))  # consecutive ids of the collector's block


def test_receive_weights_rejects_conflicting_arguments() -> None:
    collector = LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), dialog_turns_per_batch=2)
    with pytest.raises(ValueError, match="only one"):
        collector.receive_weights({"a": torch.zeros(1)}, weights={"a": torch.zeros(1)})


@pytest.mark.parametrize(
    "options", [{"version": PushVersion(3)}, {"convert_dtype": True}, {"zero_copy": True}], ids=lambda o: next(iter(o))
)
def test_receive_weights_without_weights_refuses_options_of_given_weights(options: dict) -> None:
    collector = LLMCollector(arithmetic_env(), policy=ScriptedPolicy(), dialog_turns_per_batch=2, track_policy_version=True)
    (name,) = options
    with pytest.raises(TypeError, match=rf"{name}=.*but no weights.*receive_weights\(weights"):
        collector.receive_weights(**options)
    assert collector.policy_version == 0


def test_iterating_from_a_second_thread_is_serialised() -> None:
    collector = LLMCollector(arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2, total_dialog_turns=40)
    out: list = []
    threads = [threading.Thread(target=lambda: out.extend(collector.next() for _ in range(5))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = sorted(int(t[keys.TRAJ_IDS]) for batch in out for t in flatten_turns(batch))
    assert ids == list(range(ids[0], ids[0] + 20))


# ---------------------------------------------------------------------- the shared config
def test_collection_config_is_built_once_and_shared_by_both_schedulers() -> None:
    config = CollectionConfig(dialog_turns_per_batch=3, total_dialog_turns=6, yield_completed_trajectories=True)
    assert (config.mode, config.flatten) == ("trajectories", True)
    lockstep = LLMCollector(guessing_env(3), policy=guesser(), **config.arguments())
    assert lockstep.config == config and lockstep.total_dialog_turns == 6
    assert sum(batch.numel() for batch in lockstep) >= 6
    continuous = ContinuousLLMCollector(
        lambda: guessing_env(1), engine=guesser().engine, tokenizer=guesser().tokenizer, max_dialogs_in_flight=2,
        **config.arguments(),
    )
    # the continuous scheduler's batches are always flat: its config says so, the rest is the same
    assert continuous.config.flatten_data is True and continuous.config.mode == config.mode
    assert continuous.dialog_turns_per_batch == 3
    continuous.shutdown()


def test_collection_config_names_the_bad_argument() -> None:
    with pytest.raises(ValueError, match="total_dialog_turns"):
        CollectionConfig(dialog_turns_per_batch=2, total_dialog_turns=0)
    with pytest.raises(TypeError, match="yield_completed_trajectories=False"):
        CollectionConfig(dialog_turns_per_batch=2, yield_only_last_steps=True, yield_completed_trajectories=False)


# the keyword arguments of torchrl's RayLLMCollector documentation page (the spec)
RAY_SPEC_ARGUMENTS = (
    "policy policy_factory dialog_turns_per_batch total_dialog_turns yield_only_last_steps yield_completed_trajectories "
    "postproc async_envs replay_buffer reset_at_each_iter flatten_data weight_updater ray_init_config remote_config "
    "track_policy_version sync_iter verbose num_cpus num_gpus"
).split()


def test_the_ray_collectors_take_their_local_collectors_arguments_plus_the_ray_ones() -> None:
    """One Ray wrapper: its signature is the local collector's plus RayActorConfig's, checked before any actor starts."""
    import dataclasses
    import inspect

    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.ray import RayContinuousLLMCollector, RayLLMCollector
    from lmcollect.ray.collector import RayActorConfig

    ray_fields = [f.name for f in dataclasses.fields(RayActorConfig)]
    lockstep = inspect.signature(RayLLMCollector).parameters
    assert set(RAY_SPEC_ARGUMENTS) <= set(lockstep)
    assert list(lockstep) == [*inspect.signature(LLMCollector).parameters, *ray_fields]
    continuous = list(inspect.signature(RayContinuousLLMCollector).parameters)
    local = list(inspect.signature(ContinuousLLMCollector).parameters)
    assert continuous == [name if name != "engine" else "engine_factory" for name in local] + ray_fields
    with pytest.raises(TypeError, match="RayLLMCollector\\(\\): got an unexpected keyword argument 'polcy'.*LLMCollector's"):
        RayLLMCollector(lambda: None, dialog_turns_per_batch=2, polcy=1)
    with pytest.raises(TypeError, match="missing a required argument: 'dialog_turns_per_batch'"):
        RayLLMCollector(lambda: None, policy=lambda td: td)
    with pytest.raises(TypeError, match="missing a required argument: 'engine_factory'"):
        RayContinuousLLMCollector(lambda: None, engine=object(), tokenizer=None, dialog_turns_per_batch=2)
    with pytest.raises(TypeError, match="engine_factory must be a callable"):
        RayContinuousLLMCollector(lambda: None, engine_factory=object(), tokenizer=None, dialog_turns_per_batch=2)


def test_the_ray_collectors_forwards_carry_the_local_members_signature_and_docstring() -> None:
    """Each forward line makes a method (or property) calling the actor's member of that name, typed and documented as the local one."""
    import inspect

    from lmcollect.collectors.collector_worker import WorkerMethods
    from lmcollect.ray import RayLLMCollector
    from lmcollect.ray.forwarding import forward, forward_attribute

    forwarded = {
        name: m for name, m in vars(RayLLMCollector).items() if isinstance(getattr(m, "forwarded_to", None), str)
    }
    assert len(forwarded) >= 28  # the spec page's getters, state, seeding, weights metadata... (see ray/collector.py)
    spec_members = (
        "as_remote async_shutdown cascade_execute dialog_turns_per_batch get_model get_policy_model get_policy_version "
        "getattr_env getattr_policy getattr_rb increment_version init_updater is_initialized iterator load_state_dict "
        "next pause policy_version register_scheme_receiver reset rollout set_seed shutdown start state_dict "
        "total_dialog_turns weight_updater worker_idx"
    ).split()  # the members of the spec page of torchrl's RayLLMCollector
    assert [name for name in spec_members if not hasattr(RayLLMCollector, name)] == []
    for name, member in forwarded.items():
        local = inspect.getattr_static(LLMCollector, name, None) or inspect.getattr_static(WorkerMethods, name)
        assert member.__doc__ == local.__doc__, name
        if isinstance(local, property):
            assert isinstance(member, property) and member.fset is None, name
        else:
            assert inspect.signature(member) == inspect.signature(local), name

    calls = []

    class Proxy:
        def _call(self, method: str, *args: object, **kwargs: object) -> object:
            calls.append((method, args, kwargs))
            return 7

        reset = forward(LLMCollector.reset)
        turns_run = forward_attribute(LLMCollector.turns_run)

    assert Proxy().reset([1], seed=3) == 7 and Proxy().turns_run == 7
    assert calls == [("reset", ([1],), {"seed": 3}), ("get_attribute", ("turns_run",), {})]
    with pytest.raises(TypeError, match="forward_attribute\\(\\) takes a class's property"):
        forward_attribute(LLMCollector.reset)
