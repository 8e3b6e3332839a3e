"""TransformersEngine: continuous batching over a tiny model, checked against generate() and forward passes."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch

from lmcollect.engines import EngineClosedError, EngineProtocol, EngineRequest, EngineResult, TransformersEngine
from lmcollect.policies import SamplingConfig
from tests.engine_contract import forward_log_probs, generate_greedy
from tests.factories import perturbed_model

TIMEOUT_S = 60
PROMPT_LENGTHS = (3, 9, 5, 14, 2, 7)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


@pytest.fixture(scope="module")
def old_model(tiny_model_path):
    """The weights the engines start with (perturbed: a fresh tiny model repeats one token)."""
    return perturbed_model(tiny_model_path, seed=1)


@pytest.fixture(scope="module")
def new_model(tiny_model_path):
    """The weights pushed mid-generation."""
    return perturbed_model(tiny_model_path, seed=2)


@pytest.fixture
def make_engine(tiny_model_path, tokenizer):
    """Builds engines on a private copy of the old weights (loads write into it); closes them after the test."""
    engines = []

    def make(**kwargs) -> TransformersEngine:
        engine = TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_new_tokens: int, **options) -> SamplingConfig:
    return SamplingConfig(temperature=0, max_new_tokens=max_new_tokens, **options)


def result_of(future: Future) -> EngineResult:
    return future.result(timeout=TIMEOUT_S)


class BatchSizes:
    """Records the batch size of every forward pass of a model (prefills are batches of one)."""

    def __init__(self, model) -> None:
        self.sizes: list[int] = []
        model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _module, _args, kwargs, _output) -> None:
        self.sizes.append(kwargs["input_ids"].shape[0])


class BlockOnCall:
    """Makes the model's ``call``-th forward pass (1-based) signal :attr:`reached`, then hold until
    ``until()`` is true (the test thread's pause, load or close is waiting on the step), at most TIMEOUT_S."""

    def __init__(self, model, call: int, until: Callable[[], bool]) -> None:
        self.reached = threading.Event()
        self.num_calls, self.call, self.until = 0, call, until
        model.register_forward_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.num_calls += 1
        if self.num_calls == self.call:
            self.reached.set()
            deadline = time.monotonic() + TIMEOUT_S
            while not self.until() and time.monotonic() < deadline:
                time.sleep(0.01)


# ---------------------------------------------------------------------- batching
def test_engine_satisfies_the_protocol(make_engine):
    engine = make_engine()
    assert isinstance(engine, EngineProtocol)
    assert engine.version == -1 and engine.num_in_flight == 0


def test_greedy_requests_joining_and_leaving_a_running_batch_equal_generate(make_engine, old_model):
    engine = make_engine(max_batch_size=3)
    sizes = BatchSizes(engine.model)
    ids, budgets = prompts(), [24, 3, 10, 6, 18, 4]
    requests = [EngineRequest(prompt_ids=p, sampling=greedy(n)) for p, n in zip(ids, budgets)]
    submit_at = {1: 1, 3: 2, 4: 3, 8: 4, 9: 5}  # forward call -> request submitted during it
    futures = [engine.submit(requests[0])]

    def submit_later(*_args) -> None:  # runs in the loop thread: the request joins at the next step
        if len(sizes.sizes) in submit_at:
            futures.append(engine.submit(requests[submit_at[len(sizes.sizes)]]))

    engine.model.register_forward_hook(submit_later)
    first = result_of(futures[0])  # 24 steps: every other request was submitted meanwhile
    results = [first, *(result_of(f) for f in futures[1:])]
    assert len(results) == len(requests)
    for prompt, budget, result in zip(ids, budgets, results):
        assert result.tokens.tolist() == generate_greedy(old_model, prompt, budget)
        assert result.finish_reason == "length" and result.tokens.dtype == torch.int64
        assert result.token_versions.tolist() == [-1] * budget
    assert max(sizes.sizes) == 3 and 2 in sizes.sizes  # batched, never above max_batch_size
    assert engine.num_in_flight == 0


def test_max_batch_size_bounds_the_running_batch(make_engine, old_model):
    engine = make_engine(max_batch_size=2)
    sizes = BatchSizes(engine.model)
    ids = prompts()
    engine.pause()
    futures = [engine.submit(EngineRequest(prompt_ids=p, sampling=greedy(5))) for p in ids]
    assert engine.num_in_flight == len(ids)
    engine.resume()
    results = [result_of(f) for f in futures]
    assert max(sizes.sizes) == 2
    for prompt, result in zip(ids, results):
        assert result.tokens.tolist() == generate_greedy(old_model, prompt, 5)


# ---------------------------------------------------------------------- log-probs and sampling
def test_log_probs_equal_a_forward_pass(make_engine, old_model):
    engine = make_engine(max_batch_size=4)
    ids = prompts()
    samplings = [
        greedy(12),
        SamplingConfig(temperature=1.0, max_new_tokens=12),
        SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=9),
    ]
    futures = [
        engine.submit(EngineRequest(prompt_ids=p, sampling=samplings[i % 3], seed=i)) for i, p in enumerate(ids)
    ]
    for prompt, future in zip(ids, futures):
        result = result_of(future)
        assert result.log_probs.dtype == torch.float32
        expected = forward_log_probs(old_model, prompt, result.tokens.tolist())
        torch.testing.assert_close(result.log_probs, expected, atol=1e-5, rtol=0)


def test_seeded_sampling_does_not_depend_on_batch_companions(make_engine):
    engine = make_engine(max_batch_size=4)
    ids = prompts()
    sampling = SamplingConfig(temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=16)
    request = EngineRequest(prompt_ids=ids[1], sampling=sampling, seed=7)
    alone = result_of(engine.submit(request))
    sizes = BatchSizes(engine.model)
    before = [engine.submit(EngineRequest(prompt_ids=p, sampling=sampling, seed=100 + i)) for i, p in enumerate(ids[2:4])]
    future = engine.submit(request)
    after = engine.submit(EngineRequest(prompt_ids=ids[4], sampling=greedy(10)))
    in_company = result_of(future)
    [result_of(f) for f in [*before, after]]
    assert max(sizes.sizes) >= 3  # it shared its steps with other requests
    assert in_company.tokens.tolist() == alone.tokens.tolist()
    torch.testing.assert_close(in_company.log_probs, alone.log_probs, atol=1e-5, rtol=0)
    other_seed = result_of(engine.submit(EngineRequest(prompt_ids=ids[1], sampling=sampling, seed=8)))
    assert other_seed.tokens.tolist() != alone.tokens.tolist()


def test_sampled_log_probs_follow_the_warped_distribution(make_engine):
    engine = make_engine()
    prompt = prompts()[0]
    sampling = SamplingConfig(temperature=0.5, top_k=3, max_new_tokens=8, sampled_log_probs=True)
    result = result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=sampling, seed=0)))
    assert result.sampled_log_probs is not None and result.sampled_log_probs.shape == result.log_probs.shape
    assert (result.sampled_log_probs > result.log_probs).all()  # a sharper, truncated distribution
    assert result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(4)))).sampled_log_probs is None


def test_repetition_penalty_matches_generate(make_engine, old_model):
    engine = make_engine()
    for prompt in prompts()[:3]:
        result = result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(12, repetition_penalty=1.5))))
        assert result.tokens.tolist() == generate_greedy(old_model, prompt, 12, repetition_penalty=1.5)


# ---------------------------------------------------------------------- stopping
def test_stop_token_ids_end_the_response_with_the_stop_token(make_engine, old_model):
    engine = make_engine()
    prompt = prompts()[3]
    full = generate_greedy(old_model, prompt, 12)
    stop = full[4]
    result = result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(12), stop_token_ids=(stop,))))
    assert result.tokens.tolist() == full[: full.index(stop) + 1] and result.finish_reason == "stop"
    # min_new_tokens holds the stop token back (it is never drawn before then)
    request = EngineRequest(prompt_ids=prompt, sampling=greedy(12, min_new_tokens=8), stop_token_ids=(stop,))
    held = result_of(engine.submit(request))
    assert len(held.tokens) >= 8 and stop not in held.tokens[:7].tolist()


def test_the_model_eos_stops_unless_ignore_eos(tiny_model_path, tokenizer, old_model):
    prompt = prompts()[3]
    full = generate_greedy(old_model, prompt, 12)
    model = perturbed_model(tiny_model_path, seed=1)
    model.generation_config.eos_token_id = full[5]  # pretend that token is the model's eos
    with TransformersEngine(model, tokenizer) as engine:
        stopped = result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(12))))
        ignored = result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(12, ignore_eos=True))))
    assert stopped.tokens.tolist() == full[: full.index(full[5]) + 1] and stopped.finish_reason == "stop"
    assert len(ignored.tokens) == 12 and full[5] not in ignored.tokens.tolist() and ignored.finish_reason == "length"


def test_stop_strings_end_the_response_at_the_completing_token(make_engine, old_model, tokenizer):
    engine = make_engine()
    prompt = prompts()[1]
    full = generate_greedy(old_model, prompt, 16)
    stop_string = tokenizer.decode(full[:6], skip_special_tokens=True)[-2:]
    first = next(n for n in range(1, 17) if stop_string in tokenizer.decode(full[:n], skip_special_tokens=True))
    request = EngineRequest(prompt_ids=prompt, sampling=greedy(16, stop_strings=(stop_string,)))
    result = result_of(engine.submit(request))
    assert result.tokens.tolist() == full[:first] and result.finish_reason == "stop"


def test_max_new_tokens_ends_with_length(make_engine):
    engine = make_engine()
    result = result_of(engine.submit(EngineRequest(prompt_ids=prompts()[0], sampling=greedy(1))))
    assert len(result.tokens) == 1 and result.finish_reason == "length"


# ---------------------------------------------------------------------- weights
def segment_checks(result: EngineResult, prompt: list[int], switch: int, old_model, new_model) -> None:
    """Tokens before ``switch`` are the old weights' greedy answer, those after are the new weights'
    answer to the prefix, and each segment's log-probs equal a forward pass under its weights."""
    tokens = result.tokens.tolist()
    assert result.token_versions.tolist() == [-1] * switch + [1] * (len(tokens) - switch)
    assert tokens[:switch] == generate_greedy(old_model, prompt, switch)
    assert tokens[switch:] == generate_greedy(new_model, prompt + tokens[:switch], len(tokens) - switch)
    old = forward_log_probs(old_model, prompt, tokens)[:switch]
    new = forward_log_probs(new_model, prompt, tokens)[switch:]
    torch.testing.assert_close(result.log_probs, torch.cat([old, new]), atol=1e-5, rtol=0)


def test_pause_load_resume_switches_versions_exactly_at_the_load(make_engine, old_model, new_model):
    engine = make_engine()
    ids = prompts()[:2]
    engine.pause()
    futures = [engine.submit(EngineRequest(prompt_ids=p, sampling=greedy(14, ignore_eos=True))) for p in ids]
    # step 1: two prefills (calls 1, 2); steps 2.. one batched decode each: call 5 ends step 4
    block = BlockOnCall(engine.model, call=5, until=lambda: engine._paused)
    engine.resume()
    assert block.reached.wait(TIMEOUT_S)
    engine.pause()
    assert not any(f.done() for f in futures) and engine.num_in_flight == 2
    engine.load_weights(new_model.state_dict().items(), version=1)
    engine.reset_prefix_cache()
    assert engine.version == 1
    engine.resume()
    for prompt, future in zip(ids, futures):
        segment_checks(result_of(future), prompt, 4, old_model, new_model)


def test_load_while_running_waits_for_the_step_and_switches_cleanly(make_engine, old_model, new_model):
    engine = make_engine()
    prompt = prompts()[3]
    block = BlockOnCall(engine.model, call=3, until=lambda: engine._between_steps_waiting > 0)
    future = engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(12, ignore_eos=True)))
    assert block.reached.wait(TIMEOUT_S)
    engine.load_weights(new_model.state_dict().items(), version=1)  # waits for the held step
    result = result_of(future)
    versions = result.token_versions.tolist()
    assert 1 in versions, f"the load waited until the request ended: token versions {versions}"
    switch = versions.index(1)
    assert 3 <= switch < 12
    segment_checks(result, prompt, switch, old_model, new_model)


@pytest.mark.parametrize(
    "corrupt, named",
    [
        (lambda w: w.pop("model.norm.weight"), "missing 'model.norm.weight'"),
        (lambda w: w.update({"model.extra.weight": torch.zeros(2)}), "unexpected 'model.extra.weight'"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(3)}), "'model.norm.weight' has shape (3,)"),
        (lambda w: w.update({"model.norm.weight": torch.ones(256, dtype=torch.float64)}), "has dtype torch.float64"),
    ],
)
def test_a_bad_load_is_refused_with_nothing_changed(make_engine, new_model, corrupt, named):
    engine = make_engine()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = dict(new_model.state_dict())
    corrupt(weights)
    with pytest.raises(ValueError, match="no weight was changed") as error:
        engine.load_weights(weights.items(), version=1)
    assert named in str(error.value)
    assert engine.version == -1
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_load_accepts_names_of_a_policy_wrapping_the_model(make_engine, new_model):
    engine = make_engine(version=3)
    engine.load_weights(((f"model.{k}", v) for k, v in new_model.state_dict().items()), version=4)
    assert engine.version == 4
    assert torch.equal(engine.model.model.norm.weight, new_model.model.norm.weight)


# ---------------------------------------------------------------------- lifecycle and errors
def test_close_fails_pending_futures(make_engine):
    engine = make_engine()
    engine.pause()
    requests = [EngineRequest(prompt_ids=p, sampling=greedy(4), request_id=f"r{i}") for i, p in enumerate(prompts()[:3])]
    futures = [engine.submit(request) for request in requests]
    engine.close()
    for i, future in enumerate(futures):
        with pytest.raises(EngineClosedError, match=f"request 'r{i}'"):
            result_of(future)
    assert engine.num_in_flight == 0
    with pytest.raises(EngineClosedError, match="closed"):
        engine.submit(EngineRequest(prompt_ids=[5]))


def test_a_request_cancelled_while_queued_is_dropped(make_engine):
    engine = make_engine()
    engine.pause()
    kept, cancelled = (engine.submit(EngineRequest(prompt_ids=p, sampling=greedy(3))) for p in prompts()[:2])
    assert cancelled.cancel()
    engine.resume()
    assert len(result_of(kept).tokens) == 3
    assert cancelled.cancelled() and engine.num_in_flight == 0


def test_close_fails_running_requests(make_engine):
    engine = make_engine()
    block = BlockOnCall(engine.model, call=2, until=lambda: engine._closed)
    future = engine.submit(EngineRequest(prompt_ids=prompts()[0], sampling=greedy(30, ignore_eos=True)))
    assert block.reached.wait(TIMEOUT_S)
    engine.close()
    with pytest.raises(EngineClosedError):
        result_of(future)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(make_engine, old_model):
    engine = make_engine()
    calls = {"n": 0}

    def fail_third_call(*_args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")

    handle = engine.model.register_forward_hook(fail_third_call)
    future = engine.submit(EngineRequest(prompt_ids=prompts()[0], sampling=greedy(8)))
    with pytest.raises(RuntimeError, match="boom"):
        result_of(future)
    handle.remove()
    prompt = prompts()[2]
    after = result_of(engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(5))))
    assert after.tokens.tolist() == generate_greedy(old_model, prompt, 5)
    assert engine.num_in_flight == 0


def test_bad_requests_and_settings_are_refused_naming_them(make_engine, tiny_model_path, tokenizer):
    engine = make_engine()
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit(EngineRequest(prompt_ids=[]))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.submit(EngineRequest(prompt_ids=[1, 5000]))
    with pytest.raises(TypeError, match="EngineRequest"):
        engine.submit([1, 2, 3])
    with pytest.raises(ValueError, match="max_batch_size"):
        TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer, max_batch_size=0)
    with pytest.raises(TypeError, match="version must be an int"):
        engine.load_weights([], version="1")
    with pytest.raises(ValueError, match="version must be >= -1"):
        engine.load_weights([], version=-2)


# ---------------------------------------------------------------------- the lockstep batch path (model.generate)
def test_a_generate_batch_equals_the_continuous_loop_request_by_request(make_engine, old_model):
    """One model.generate call answers what submit() answers: greedy tokens, raw log-probs, and a
    seeded request's sample, which does not depend on the rest of the batch."""
    engine = make_engine()
    ids = prompts()
    sampled = SamplingConfig(temperature=0.9, top_k=50, max_new_tokens=10, ignore_eos=True)
    for sampling, seeds in [(greedy(10, ignore_eos=True), [None] * len(ids)), (sampled, list(range(len(ids))))]:
        requests = [EngineRequest(prompt_ids=p, sampling=sampling, seed=s) for p, s in zip(ids, seeds)]
        together = engine.generate_batch(requests)
        for request, result in zip(requests, together):
            alone = result_of(engine.submit(request))
            assert result.tokens.tolist() == alone.tokens.tolist()
            torch.testing.assert_close(result.log_probs, alone.log_probs, atol=1e-4, rtol=0)
            assert result.finish_reason == "length" and set(result.token_versions.tolist()) == {engine.version}
    smaller = engine.generate_batch([EngineRequest(prompt_ids=ids[0], sampling=sampled, seed=0)])
    assert smaller[0].tokens.tolist() == together[0].tokens.tolist()


def test_a_generate_batch_stops_rows_on_their_stop_ids_and_takes_no_load_inside(make_engine, old_model, new_model):
    engine = make_engine()
    ids = prompts()[:3]
    first = engine.generate_batch([EngineRequest(prompt_ids=p, sampling=greedy(8, ignore_eos=True)) for p in ids])
    stop = first[1].tokens[2].item()  # row 1 draws it third
    stopped = engine.generate_batch(
        [EngineRequest(prompt_ids=p, sampling=greedy(8, ignore_eos=True), stop_token_ids=(stop,)) for p in ids]
    )
    assert stopped[1].finish_reason == "stop" and stopped[1].tokens.tolist() == first[1].tokens[:3].tolist()
    engine.load_weights(new_model.state_dict().items(), version=3)
    after = engine.generate_batch([EngineRequest(prompt_ids=ids[0], sampling=greedy(4, ignore_eos=True))])[0]
    assert after.tokens.tolist() == generate_greedy(new_model, ids[0], 4, min_new_tokens=4)
    assert after.token_versions.tolist() == [3] * 4


def test_a_generate_batch_refuses_rows_sampled_differently(make_engine):
    engine = make_engine()
    rows = [EngineRequest(prompt_ids=[5, 6], sampling=greedy(4), request_id="a"),
            EngineRequest(prompt_ids=[5, 6], sampling=greedy(5), request_id="b")]
    with pytest.raises(ValueError, match="'b' has other sampling or stop_token_ids than 'a'.*submit"):
        engine.generate_batch(rows)
    assert engine.num_in_flight == 0


def test_an_engine_travels_as_its_model_and_version(make_engine, old_model):
    import pickle

    engine = make_engine()
    engine.load_weights(old_model.state_dict().items(), version=4)
    copy = pickle.loads(pickle.dumps(engine))
    try:
        assert copy.version == 4 and copy.num_in_flight == 0
        request = EngineRequest(prompt_ids=[5, 9, 11], sampling=greedy(5, ignore_eos=True))
        assert result_of(copy.submit(request)).tokens.tolist() == result_of(engine.submit(request)).tokens.tolist()
    finally:
        copy.close()


def test_the_lockstep_policy_hands_a_batch_generating_engine_its_batch_whole(make_engine, tokenizer):
    from lmcollect.engines import BatchGenerating
    from lmcollect.policies import EnginePolicy

    engine = make_engine()
    assert isinstance(engine, BatchGenerating)
    calls = BatchSizes(engine.model)
    policy = EnginePolicy(engine, tokenizer=tokenizer, sampling=greedy(3, ignore_eos=True))
    generations = policy.generate_responses(prompts()[:4])
    assert calls.sizes[0] == 4  # one padded prefill of the four rows: model.generate, not the loop
    assert [g.token_versions.tolist() for g in generations] == [[engine.version] * 3] * 4


def test_a_generate_batch_waits_for_a_paused_engine_at_most_the_policys_timeout(make_engine, tokenizer):
    from lmcollect.policies import EnginePolicy

    engine = make_engine()
    policy = EnginePolicy(engine, tokenizer=tokenizer, sampling=greedy(3, ignore_eos=True), timeout_s=0.2)
    engine.pause()
    with pytest.raises(TimeoutError, match="waited 0.2 s for the paused engine to resume"):
        policy.generate_responses(prompts()[:2])
    assert engine.num_in_flight == 0
    engine.resume()
    assert len(policy.generate_responses(prompts()[:2])) == 2
