"""ContinuousLLMCollector with the scripted engine and the tool task: flow, layout, ids, lag, versions, memory."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import pytest
import torch

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.collectors.shared.batcher import CollectedTurn
from lmcollect.collectors.continuous.turn_flow import TurnFlow
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, leaf_keys, non_tensor_values
from lmcollect.buffers import ReplayBuffer
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from lmcollect.envs import ChatEnv, SingleTurnTask, arithmetic_dataset
from lmcollect.envs.tasks.tool_calc import ToolCalcTask, tool_calc_dataset, tool_calc_player
from lmcollect.policies import SamplingConfig
from lmcollect.policies.outputs import Generation, answer_prompts
from lmcollect.collectors.shared.versioning import PolicyVersion
from lmcollect.weights.delta import WeightDelta
from lmcollect.weights.version import PushVersion
from tests.factories import corrupted_delta, run_in_thread

ROWS = tool_calc_dataset(256, seed=0)
SAMPLING = SamplingConfig(max_new_tokens=64)


def tool_env(seed: int, task: ToolCalcTask | None = None) -> ChatEnv:
    return ChatEnv(ROWS, task=task or ToolCalcTask(max_latency_s=0.0), batch_size=1, max_turns=5, seed=seed)


def tool_engine(**kwargs) -> ScriptedEngine:
    return ScriptedEngine(script=chat_script(tool_calc_player), **kwargs)


def make_collector(envs, engine=None, **kwargs) -> ContinuousLLMCollector:
    kwargs.setdefault("dialog_turns_per_batch", 4)
    return ContinuousLLMCollector(
        envs, engine=engine or tool_engine(), tokenizer=ByteTokenizer(), sampling=SAMPLING, **kwargs
    )


def turns_of(batch) -> list:
    return flatten_turns(batch)


def value(turn, key):
    """A turn's entry: a tensor, or the Python object (History, str) stored there."""
    return non_tensor_values(turn, key)[0]


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class GatedTask(ToolCalcTask):
    """Tool calls wait until ``gate`` is set (a tool that hangs until the test lets it answer)."""

    def __init__(self) -> None:
        super().__init__(max_latency_s=0.0)
        self.gate = threading.Event()

    async def arespond(self, state, history):
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        return await super().arespond(state, history)


class CountingTask(ToolCalcTask):
    """Counts tool calls waiting at the same time (shared by every slot's env)."""

    def __init__(self, latency_s: float) -> None:
        super().__init__(min_latency_s=latency_s, max_latency_s=latency_s)
        self.waiting = 0
        self.max_waiting = 0
        self._lock = threading.Lock()

    async def arespond(self, state, history):
        with self._lock:
            self.waiting += 1
            self.max_waiting = max(self.max_waiting, self.waiting)
        try:
            return await super().arespond(state, history)
        finally:
            with self._lock:
                self.waiting -= 1


class EnginePolicy:
    """A synchronous policy over an engine (the lockstep baseline): every prompt submitted, then awaited."""

    def __init__(self, engine, tokenizer, sampling) -> None:
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling

    def _generate(self, prompt_ids):
        from lmcollect.engines.protocol import EngineRequest

        futures = [self.engine.submit(EngineRequest(prompt_ids=ids, sampling=self.sampling, stop_token_ids=(256,))) for ids in prompt_ids]
        return [Generation(f.result().tokens, f.result().log_probs) for f in futures]

    def __call__(self, td):
        return answer_prompts(td, self.tokenizer, self._generate, sampling=self.sampling, stop_token_ids=[256])


# ---------------------------------------------------------------------- flow without a barrier
def test_a_hung_tool_call_in_one_dialog_does_not_hold_the_others() -> None:
    gated = GatedTask()
    envs = [tool_env(0, gated)] + [tool_env(seed) for seed in (1, 2, 3)]
    with make_collector(envs, dialog_turns_per_batch=4) as collector:
        batches = [turns_of(next(iter(collector))) for _ in range(3)]
        turns = [t for batch in batches for t in batch]
        assert all(int(t[keys.ENV_INDEX]) != 0 for t in turns), "slot 0's tool call is still hanging"
        assert max(int(t[keys.STEP_COUNT]) for t in turns) >= 1, "the other dialogs went on to later turns"
        gated.gate.set()
        later = [t for _ in range(6) for t in turns_of(collector.next())]
        assert any(int(t[keys.ENV_INDEX]) == 0 for t in later)


def test_tool_calls_of_many_dialogs_wait_at_once() -> None:
    task = CountingTask(latency_s=0.2)
    envs = [tool_env(seed, task) for seed in range(8)]
    with make_collector(envs, dialog_turns_per_batch=8) as collector:
        collector.next()
        # sequential tool calls would never overlap; 8 dialogs waiting 200 ms each do
        assert task.max_waiting >= 4


# ---------------------------------------------------------------------- layout and ids
def test_turns_have_the_synchronous_collectors_layout_and_values() -> None:
    sync = LLMCollector(
        tool_env(5), policy=EnginePolicy(tool_engine(), ByteTokenizer(), SAMPLING),
        dialog_turns_per_batch=6, flatten_data=True, track_policy_version=True,
    )
    cont = make_collector([tool_env(5)], dialog_turns_per_batch=6, track_policy_version=True)
    sync.set_worker_idx(0)
    cont.set_worker_idx(0)
    with cont:
        expected = [t for _ in range(2) for t in turns_of(sync.next())]
        got = [t for _ in range(2) for t in turns_of(cont.next())]
    sync.shutdown()
    assert len(got) == len(expected) == 12
    for mine, theirs in zip(got, expected):
        assert set(leaf_keys(mine)) == set(leaf_keys(theirs)) | {keys.TOKEN_VERSIONS, keys.PREFIX_MISMATCH}
        for key in leaf_keys(theirs):
            a, b = value(mine, key), value(theirs, key)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), key
            else:
                assert type(a) is type(b) and a == b, key
        versions = mine.get(keys.TOKEN_VERSIONS)
        assert versions.dtype == torch.int64 and versions.shape == mine.get(keys.TOKENS_RESPONSE).shape


def test_ids_are_unique_and_trajectories_contiguous() -> None:
    envs = [tool_env(seed) for seed in range(4)]
    with make_collector(envs, dialog_turns_per_batch=8, total_dialog_turns=64) as collector:
        turns = [t for batch in collector for t in turns_of(batch)]
    assert len(turns) == 64
    ids = [(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in turns]
    assert len(set(ids)) == len(ids)
    steps = defaultdict(list)
    slots = defaultdict(set)
    for t in turns:
        steps[int(t[keys.TRAJ_IDS])].append(int(t[keys.STEP_COUNT]))
        slots[int(t[keys.TRAJ_IDS])].add(int(t[keys.ENV_INDEX]))
    assert all(sorted(s) == list(range(len(s))) for s in steps.values())
    assert all(len(s) == 1 for s in slots.values())
    # a group id names one prompt draw of one slot
    groups = {(int(t[keys.GROUP_ID]), int(t[keys.ENV_INDEX]), int(t[keys.ENV_PROMPT_ID])) for t in turns}
    assert len({g for g, _, _ in groups}) == len(groups)


def test_completed_trajectories_come_whole() -> None:
    envs = [tool_env(seed) for seed in range(3)]
    with make_collector(envs, dialog_turns_per_batch=8, yield_completed_trajectories=True) as collector:
        turns = [t for _ in range(3) for t in turns_of(collector.next())]
    by_traj = defaultdict(list)
    for t in turns:
        by_traj[int(t[keys.TRAJ_IDS])].append(t)
    for traj in by_traj.values():
        assert [int(t[keys.STEP_COUNT]) for t in traj] == list(range(len(traj)))
        assert bool(traj[-1][keys.NEXT_DONE]) and float(traj[-1][keys.NEXT_REWARD]) == 1.0


# ---------------------------------------------------------------------- bounded lag, versions, pushes
@pytest.mark.parametrize("max_policy_lag", [0, 1, 2])
def test_lag_of_every_consumed_turn_is_bounded_under_pushes_every_batch(max_policy_lag: int) -> None:
    # varied tool latency and many slots: turns finish far out of start order
    envs = [tool_env(seed, ToolCalcTask(max_latency_s=0.03)) for seed in range(8)]
    collector = make_collector(
        envs, engine=tool_engine(token_delay_s=0.0005), dialog_turns_per_batch=4, total_dialog_turns=80,
        track_policy_version=True, max_policy_lag=max_policy_lag,
    )
    lags, consumed = [], 0
    for batch in collector:
        now = collector.version_index()
        lags += [now - int(t[keys.POLICY_VERSION]) for t in turns_of(batch)]
        consumed += len(turns_of(batch))
        collector.update_policy_weights_({"tag": torch.tensor([float(now + 1)])})
    collector.shutdown()
    assert max(lags) <= max_policy_lag
    assert consumed == 80 and collector.turns_run == 80  # nothing discarded
    assert collector.leftover_turns is None


def test_token_versions_name_the_weights_of_each_token_across_a_push() -> None:
    engine = ScriptedEngine(num_tokens=40, token_delay_s=0.01)  # each token reveals the tag it was generated with
    envs = [ChatEnv(arithmetic_dataset(8, seed=s), task=SingleTurnTask(), batch_size=1, seed=s) for s in range(2)]
    collector = make_collector(envs, engine=engine, dialog_turns_per_batch=2, track_policy_version=True)
    tags = {0: 0.0, 1: 7.0}
    join = run_in_thread(collector.next)
    wait_until(lambda: engine.num_steps >= 3)
    collector.update_policy_weights_({"tag": torch.tensor([tags[1]])})  # lands between two decoding steps
    batch = join()
    collector.shutdown()
    spanned = 0
    for turn in turns_of(batch):
        versions = turn.get(keys.TOKEN_VERSIONS).tolist()
        tokens = turn.get(keys.TOKENS_RESPONSE).tolist()
        log_probs = turn.get(keys.LOG_PROBS_RESPONSE).tolist()
        spanned += len(set(versions)) == 2
        assert int(turn[keys.POLICY_VERSION]) == 0 and versions == sorted(versions)
        for token, log_prob, version in zip(tokens, log_probs, versions):
            assert log_prob == -tags[version]
            assert token in (ord("0") + int(tags[version]) % 10, ByteTokenizer.eos_token_id)
    assert spanned == 2
    assert engine.num_prefix_cache_resets == 1


def test_a_push_loads_between_two_steps_without_a_pause_and_the_cache_is_reset_once() -> None:
    """The engine's counter is the collector's version, so its load (which lands between two decoding steps
    by itself) takes the version: no pause, decoding goes on while the weights are copied."""
    engine = tool_engine()
    calls = []
    for name in ("pause", "load_weights", "reset_prefix_cache", "resume"):
        method = getattr(engine, name)
        setattr(engine, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])
    with make_collector([tool_env(0)], engine=engine, track_policy_version=True) as collector:
        collector.update_policy_weights_({"tag": torch.tensor([1.0])})
        # the load resets the engine's prefix cache itself: the collector does not reset it again
        assert calls == ["load_weights"] and engine.num_prefix_cache_resets == 1
        assert collector.policy_version == 1 and engine.version == 1
        with pytest.raises(ValueError, match="tag"):
            collector.update_policy_weights_({"bias": torch.tensor([1.0])})
        assert engine.version == 1


def test_a_local_weight_updater_pushes_into_the_engine_with_its_version() -> None:
    from lmcollect.weight_sync import LocalWeightUpdater

    engine = tool_engine()
    trainer = {"tag": torch.tensor([3.0])}
    with make_collector([tool_env(0)], engine=engine, weight_updater=LocalWeightUpdater(trainer),
                        track_policy_version=True) as collector:
        collector.update_policy_weights_()
        collector.update_policy_weights_(version=5)
        assert (collector.policy_version, engine.version, float(engine.model.tag)) == (5, 5, 3.0)
        turn = turns_of(collector.next())[0]
        assert set(turn.get(keys.TOKEN_VERSIONS).tolist()) == {5} and int(turn[keys.POLICY_VERSION]) == 5


def test_a_load_straight_into_the_engine_is_the_collectors_version_with_no_collector_step() -> None:
    """One counter: the collector reads its engine's version (index and uuid); nothing copies one into the other."""
    engine = tool_engine()
    with make_collector([tool_env(0)], engine=engine, track_policy_version=PolicyVersion("uuid")) as collector:
        assert engine.version == collector.version_index() == 0  # the collector's starting weights
        pushed = PushVersion(4)
        engine.load_weights([("tag", torch.tensor([2.0]))], version=pushed)
        assert engine.version == collector.version_index() == 4 and collector.policy_version == pushed.uuid
        engine.load_weights([("tag", torch.tensor([3.0]))], version=7)  # a bare index: a uuid of its own
        assert engine.version == collector.version_index() == 7 and collector.policy_version != pushed.uuid
        held = collector.policy_version
        with pytest.raises(ValueError, match="holds version 7, which is newer"):
            engine.load_weights([("tag", torch.tensor([9.0]))], version=6)
        with pytest.raises(ValueError, match="tag"):
            engine.load_weights([("bias", torch.tensor([9.0]))], version=8)
        assert (engine.version, collector.version_index(), collector.policy_version) == (7, 7, held)
        assert float(engine.model.tag) == 3.0
        turn = turns_of(collector.next())[0]
        assert set(turn.get(keys.TOKEN_VERSIONS).tolist()) == {7} and non_tensor_values(turn, keys.POLICY_VERSION)[0] == held


def test_an_untracked_collector_reports_minus_one_while_its_engine_counts_its_loads() -> None:
    engine = tool_engine()
    with make_collector([tool_env(0)], engine=engine, track_policy_version=False) as collector:
        collector.update_policy_weights_({"tag": torch.tensor([1.0])})
        collector.update_policy_weights_({"tag": torch.tensor([2.0])})
        assert (collector.policy_version, collector.version_index(), engine.version) == (None, 0, 2)
        turn = turns_of(collector.next())[0]
        assert int(turn[keys.POLICY_VERSION]) == -1 and set(turn.get(keys.TOKEN_VERSIONS).tolist()) == {-1}  # untracked


def test_set_seed_gives_every_slot_of_a_factory_its_own_prompts() -> None:
    make_env = lambda: tool_env(0)  # noqa: E731 - identical envs until seeded
    with make_collector(make_env, max_dialogs_in_flight=4, dialog_turns_per_batch=4) as collector:
        collector.set_seed(10)
        turns = [t for _ in range(3) for t in turns_of(collector.next())]
    first_prompts = {int(t[keys.ENV_INDEX]): value(t, keys.HISTORY_PROMPT).messages[0].content for t in turns
                     if int(t[keys.STEP_COUNT]) == 0}
    assert len(first_prompts) >= 3 and len(set(first_prompts.values())) == len(first_prompts)


# ---------------------------------------------------------------------- backpressure, pause, shutdown
def test_a_consumer_that_stops_reading_stops_admission() -> None:
    envs = [tool_env(seed) for seed in range(8)]
    with make_collector(envs, dialog_turns_per_batch=4) as collector:
        collector.next()
        wait_until(lambda: collector.num_in_flight == 0 and collector.num_buffered_turns > 0)
        run = collector.turns_run
        time.sleep(0.3)
        assert collector.turns_run == run, "generation went on without a reader"
        assert collector.num_buffered_turns <= 4 + 8  # dialog_turns_per_batch + max_dialogs_in_flight
        assert collector.turns_run - 4 == collector.num_buffered_turns
        collector.next()  # reading again admits again
        wait_until(lambda: collector.turns_run > run)


def test_pause_and_shutdown_mid_flight_keep_every_finished_turn() -> None:
    buffer = ReplayBuffer(capacity=10_000)
    envs = [tool_env(seed, ToolCalcTask(max_latency_s=0.01)) for seed in range(6)]
    collector = make_collector(envs, engine=tool_engine(token_delay_s=0.002), dialog_turns_per_batch=4, replay_buffer=buffer)
    collector.start()
    wait_until(lambda: len(buffer) >= 8)
    with collector.pause():
        assert collector.num_in_flight == 0
        run, written = collector.turns_run, len(buffer)
        assert written + collector.num_buffered_turns == run
        time.sleep(0.1)
        assert (collector.turns_run, len(buffer)) == (run, written)
    wait_until(lambda: collector.turns_run > run)
    collector.shutdown()  # mid-flight: turns under way finish, leftovers go to the buffer
    turns = flatten_turns(buffer.sample(len(buffer), replace=False))
    assert len(turns) == collector.turns_run
    steps = defaultdict(set)
    for t in turns:
        steps[int(t[keys.TRAJ_IDS])].add(int(t[keys.STEP_COUNT]))
    assert all(s == set(range(len(s))) for s in steps.values()), "a dialog was left half-written"


def test_state_dict_needs_a_pause_and_restores_the_dialogs() -> None:
    collector = make_collector([tool_env(s) for s in range(2)], dialog_turns_per_batch=4, track_policy_version=True)
    collector.next()
    with pytest.raises(RuntimeError, match="pause"):
        collector.state_dict()
    with collector.pause():
        state = collector.state_dict()
        buffered = collector.num_buffered_turns  # inside the pause: after it, turns under way finish
    collector.shutdown()
    fresh = make_collector([tool_env(s) for s in range(2)], dialog_turns_per_batch=4, track_policy_version=True)
    fresh.load_state_dict(state)
    assert fresh.num_buffered_turns == buffered and fresh.turns_run == state["turns_run"]
    with fresh:
        turns = turns_of(fresh.next())
    seen = {int(t[keys.TRAJ_IDS]) for t in turns}
    assert seen  # dialogs continue with their ids
    assert len({(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in turns}) == len(turns)


def test_a_checkpoint_of_a_paused_collector_restores_its_unconsumed_turns(tmp_path) -> None:
    from lmcollect import load_checkpoint, save_checkpoint

    collector = make_collector([tool_env(s) for s in range(2)], dialog_turns_per_batch=4, track_policy_version=True)
    collector.next()
    collector.update_policy_weights_({"tag": torch.tensor([2.0])})
    with collector.pause():
        save_checkpoint(tmp_path / "ckpt", [collector])
        buffered, run = collector.num_buffered_turns, collector.turns_run
    collector.shutdown()
    engine = tool_engine()
    fresh = make_collector([tool_env(s) for s in range(2)], engine=engine, dialog_turns_per_batch=4, track_policy_version=True)
    load_checkpoint(tmp_path / "ckpt", [fresh])
    assert (fresh.num_buffered_turns, fresh.turns_run, fresh.policy_version) == (buffered, run, 1)
    assert (engine.version, float(engine.model.tag)) == (1, 2.0)  # the weights came back into the engine
    with fresh:
        assert len(turns_of(fresh.next())) == 4


# ---------------------------------------------------------------------- the release rule, alone
def _turn(slot: int) -> CollectedTurn:
    from tensordict import TensorDict

    return CollectedTurn(slot=slot, traj_id=slot, done=False, td=TensorDict({}, batch_size=[]))


def test_a_batch_waits_for_old_turns_that_would_otherwise_miss_their_deadline() -> None:
    flow = TurnFlow(mode="steps", num_slots=8, turns_per_batch=2, capacity=6, max_policy_lag=2, max_turns=None)
    for _ in range(6):  # six turns start under version 0: deadlines at version 2
        flow.start_turn(0, new_dialog=True)
    assert not flow.may_start(new_dialog=True, version_index=0)
    flow.finish_turn(0, _turn(0))
    flow.finish_turn(0, _turn(1))
    assert flow.ready(0)
    flow.pop(0)
    assert not flow.may_start(new_dialog=True, version_index=0), "the batch's push has not come yet"
    assert flow.may_start(new_dialog=True, version_index=1)
    for _ in range(2):
        flow.start_turn(1, new_dialog=True)
    flow.finish_turn(1, _turn(2))
    flow.finish_turn(1, _turn(3))
    # at version 1, releasing the two version-1 turns would leave four version-0 turns for one batch
    assert not flow.ready(1)
    flow.finish_turn(0, _turn(4))
    flow.finish_turn(0, _turn(5))
    assert flow.ready(1)
    flow.pop(1)  # takes the two oldest
    flow.finish_turn(0, _turn(6))
    flow.finish_turn(0, _turn(7))
    assert flow.ready(2)


def test_a_consumer_that_never_pushes_is_told_instead_of_hanging() -> None:
    envs = [tool_env(seed) for seed in range(4)]
    with make_collector(envs, dialog_turns_per_batch=4, max_policy_lag=1, track_policy_version=True) as collector:
        collector.next()
        collector.next()
        with pytest.raises(RuntimeError, match="update_policy_weights_"):
            collector.next()
        collector.update_policy_weights_({"tag": torch.tensor([1.0])})
        assert turns_of(collector.next())


@pytest.mark.parametrize("pushes_before", [1, 3])
def test_pushes_before_collection_begins_do_not_let_more_batches_run(pushes_before: int) -> None:
    """The trainer's first weights, pushed before the first batch, are where versions start counting:
    with max_policy_lag=1 two batches may still come without a push, not a third."""
    envs = [tool_env(seed) for seed in range(4)]
    with make_collector(envs, dialog_turns_per_batch=4, max_policy_lag=1, track_policy_version=True) as collector:
        for tag in range(pushes_before):
            collector.update_policy_weights_({"tag": torch.tensor([float(tag)])})
        first = collector.version_index()
        assert first == pushes_before
        for _ in range(2):
            assert {int(t[keys.POLICY_VERSION]) for t in turns_of(collector.next())} == {first}
        with pytest.raises(RuntimeError, match="update_policy_weights_"):
            collector.next()


# ---------------------------------------------------------------------- arguments
def test_arguments_are_checked_naming_the_knob() -> None:
    class PairEnv:  # batch size 2 and no split_elements(): its elements cannot run as slots
        batch_size = torch.Size([2])

        def reset(self, td=None): ...

        def step(self, td): ...

    with pytest.raises(ValueError, match="batch_size=1"):
        make_collector([PairEnv()])
    with pytest.raises(ValueError, match="flatten_data"):
        make_collector([tool_env(0)], flatten_data=False)
    with pytest.raises(ValueError, match="max_policy_lag"):
        make_collector([tool_env(0)], max_policy_lag=1, yield_completed_trajectories=True, track_policy_version=True)
    with pytest.raises(ValueError, match="track_policy_version"):
        make_collector([tool_env(0)], max_policy_lag=1)
    with pytest.raises(ValueError, match="max_policy_lag"):
        make_collector([tool_env(0)], max_policy_lag=-1)
    with pytest.raises(TypeError, match="EngineProtocol"):
        ContinuousLLMCollector([tool_env(0)], engine=object(), tokenizer=ByteTokenizer(), dialog_turns_per_batch=2)
    with pytest.raises(ValueError, match="max_dialogs_in_flight"):
        make_collector([tool_env(0), tool_env(1)], max_dialogs_in_flight=3)


def test_a_failing_env_surfaces_naming_the_slot_and_collection_goes_on() -> None:
    class Broken(ToolCalcTask):
        calls = 0

        async def arespond(self, state, history):
            Broken.calls += 1
            if Broken.calls == 2:
                raise KeyError("tool down")
            return await super().arespond(state, history)

    with make_collector([tool_env(0, Broken(max_latency_s=0.0))], dialog_turns_per_batch=2) as collector:
        with pytest.raises(Exception, match="tool down") as info:
            while True:
                collector.next()
        assert any("slot 0" in note for note in info.value.__notes__)
        assert turns_of(collector.next())  # a new dialog takes the slot


def test_docs_example_runs_as_written() -> None:
    from tests.unit.test_readme import doc_block

    namespace: dict = {}
    exec(doc_block("ContinuousLLMCollector(envs"), namespace)  # noqa: S102 - our own docs (docs/continuous.md)
    collector = namespace["collector"]
    assert collector.turns_run == 128 and collector.policy_version == 4
    collector.shutdown()


# ---------------------------------------------------------------------- with a real model
@pytest.fixture(scope="module")
def tiny_parts(tiny_model_path):
    from lmcollect.models import load_model_and_tokenizer
    from tests.factories import perturbed_model

    _, tokenizer = load_model_and_tokenizer(tiny_model_path)
    return tokenizer, lambda seed: perturbed_model(tiny_model_path, seed=seed)


def guessing_env(seed: int) -> ChatEnv:
    from lmcollect.envs import GuessingGameTask, guessing_game_dataset

    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=1, max_turns=5, seed=seed)


def test_with_the_transformers_engine_turns_equal_the_synchronous_policys(tiny_parts) -> None:
    from lmcollect.engines import TransformersEngine
    from lmcollect.policies import TransformersPolicy

    tokenizer, make_model = tiny_parts
    policy = TransformersPolicy(make_model(1), tokenizer, max_new_tokens=8, temperature=0)
    sync = LLMCollector(guessing_env(3), policy=policy, dialog_turns_per_batch=6, flatten_data=True)
    engine = TransformersEngine(make_model(1), tokenizer)
    cont = ContinuousLLMCollector(
        [guessing_env(3)], engine=engine, tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=8, temperature=0),
        stop_token_ids=policy.stop_token_ids, dialog_turns_per_batch=6,
    )
    with cont:
        got, expected = turns_of(cont.next()), turns_of(sync.next())
    engine.close()
    assert max(int(t[keys.STEP_COUNT]) for t in got) >= 1  # multi-turn: prompts extend the previous tokens
    for mine, theirs in zip(got, expected):
        for key in (keys.TOKENS_PROMPT, keys.TOKENS_RESPONSE, keys.TOKENS_FULL, keys.ASSISTANT_MASK):
            assert torch.equal(mine.get(key), theirs.get(key)), key
        assert torch.allclose(mine.get(keys.LOG_PROBS_RESPONSE), theirs.get(keys.LOG_PROBS_RESPONSE), atol=1e-5)
        assert value(mine, keys.HISTORY_FULL) == value(theirs, keys.HISTORY_FULL)


def _forward_log_probs(model, full: torch.Tensor, num_prompt: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(full.unsqueeze(0)).logits[0].float()
    return torch.log_softmax(logits, -1)[num_prompt - 1 : -1].gather(1, full[num_prompt:, None])[:, 0]


def test_a_push_mid_turn_on_a_real_model_each_segment_has_its_weights_log_probs(tiny_parts) -> None:
    from lmcollect.engines import TransformersEngine

    tokenizer, make_model = tiny_parts
    old, new = make_model(1), make_model(2)
    engine = TransformersEngine(make_model(1), tokenizer)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=tokenizer, dialog_turns_per_batch=1, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=160, temperature=0, ignore_eos=True),
    )
    join = run_in_thread(collector.next, timeout_s=120)
    wait_until(lambda: engine.num_in_flight == 1)
    time.sleep(0.05)
    collector.update_policy_weights_(new)  # lands between two decoding steps of the running turn
    turn = turns_of(join())[0]
    collector.shutdown()
    engine.close()
    versions = turn.get(keys.TOKEN_VERSIONS)
    assert set(versions.tolist()) == {0, 1}, "the push should land mid-turn"
    full, num_prompt = turn.get(keys.TOKENS_FULL), turn.get(keys.TOKENS_PROMPT).numel()
    stored = turn.get(keys.LOG_PROBS_RESPONSE)
    for model, version in ((old, 0), (new, 1)):
        segment = versions == version
        expected = _forward_log_probs(model, full, num_prompt)[segment]
        assert torch.allclose(stored[segment], expected, atol=1e-4), version


def test_a_collector_over_an_engine_that_holds_a_push_counts_on_from_its_version() -> None:
    engine = ScriptedEngine()
    engine.load_weights({"tag": torch.tensor([5.0])}.items(), version=5)  # an earlier collector's push
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=ByteTokenizer(), dialog_turns_per_batch=2, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=3),
    )
    assert collector.version_index() == 5
    with collector:
        turns = flatten_turns(collector.next())
    engine.close()
    for turn in turns:
        assert int(turn[keys.POLICY_VERSION]) == 5 and set(turn.get(keys.TOKEN_VERSIONS).tolist()) == {5}


def test_a_delta_push_over_the_transformers_engine_equals_the_full_push(tiny_parts) -> None:
    from lmcollect.engines import TransformersEngine
    from lmcollect.weights.delta import DeltaBase, DeltaConfig, DeltaRejectedError
    from lmcollect.weights.version import PushVersion

    tokenizer, make_model = tiny_parts
    trainer = make_model(2)
    v1, v2 = PushVersion(1), PushVersion(2)
    base = DeltaBase(DeltaConfig())
    base.snapshot(trainer.state_dict(), v1)
    first = {name: tensor.clone() for name, tensor in trainer.state_dict().items()}
    with torch.no_grad():
        for param in list(trainer.parameters())[1:3]:  # a small, sparse change: what a delta carries
            param.view(-1)[:5] += 0.5
    second = trainer.state_dict()
    delta = base.encode(second).delta
    outputs, states = [], []
    for use_delta in (False, True):
        engine = TransformersEngine(make_model(1), tokenizer)
        env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
        collector = ContinuousLLMCollector(
            [env], engine=engine, tokenizer=tokenizer, dialog_turns_per_batch=2, track_policy_version=True,
            sampling=SamplingConfig(max_new_tokens=6, temperature=0),
        )
        collector.receive_weights(first, version=v1)
        if use_delta:
            before = {k: v.clone() for k, v in engine.model.state_dict().items()}
            with pytest.raises(DeltaRejectedError):  # applies to version 1, not to a version 7
                collector.receive_weights(WeightDelta(PushVersion(7), delta.entries, delta.arrays), version=v2)
            with pytest.raises(DeltaRejectedError, match="checksum"):  # one bit flipped in transit
                collector.receive_weights(corrupted_delta(delta), version=v2)
            with pytest.raises(DeltaRejectedError, match="holds version 1"):  # the engine checks the base too
                engine.load_weights(WeightDelta(PushVersion(3), delta.entries, delta.arrays), version=4)
            assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
            assert engine.version == collector.version_index() == 1
        collector.receive_weights(delta if use_delta else second, version=v2)
        with collector:
            turns = turns_of(collector.next())
        engine.close()
        outputs.append([t.get(keys.TOKENS_RESPONSE) for t in turns])
        states.append(engine.model.state_dict())
        assert {int(t[keys.POLICY_VERSION]) for t in turns} == {2}
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_a_delta_push_into_an_engine_that_cannot_load_deltas_names_the_fix() -> None:
    from lmcollect.engines import capabilities_of
    from lmcollect.weights.version import PushVersion

    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    engine = ScriptedEngine()  # no loads_weight_deltas (as a vLLM server's engine)
    assert not capabilities_of(engine).loads_weight_deltas
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), dialog_turns_per_batch=1)
    delta = WeightDelta(PushVersion(1), (), None)
    with pytest.raises(TypeError, match="delta=False"):
        collector.receive_weights(delta, version=PushVersion(2))
    collector.shutdown()
