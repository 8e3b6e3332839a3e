"""VLLMServerPolicy and vLLMUpdater against a real ``vllm serve`` of the tiny model (CPU, loopback).

Run with a Python that has vLLM: ``python -m pytest tests/integration/test_vllm_server.py``. One
server for the module (started on a free loopback port, 30-60 s here: one process imports vLLM
and runs the engine; stopped at the end, its whole process group), with its control endpoints on behind a
generated token, a short pause lease and the test worker extension that can hold a decoding step
(tests/vllm_hold.py, for the engine contract). The tests run in file order: the engine contract
pushes and puts the start weights back, the push test changes the server's weights and the last
test stops the server.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tensordict import TensorDictBase

from lmcollect.collectors.lockstep.collector import LLMCollector
from lmcollect.data import keys
from lmcollect.engines import EngineRequest
from lmcollect.engines.protocol import PromptTooLongError
from lmcollect.engines.vllm_common import checkpoint_eos_token_ids
from lmcollect.engines.weight_group import GroupPush, join_weight_group
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupSender
from lmcollect.weights.version import PushVersion
from tests.engine_contract import CHECKS, EngineCase, hf_case
from tests.integration.conftest import MAX_NEW_TOKENS, QUESTIONS, chat_batch
from tests.token_checks import check_token_exact, collect_dialogs, guessing_env
from tests.vllm_hold import HOLDING_EXTENSION, held_step

pytest.importorskip("vllm")
from lmcollect.policies.vllm_policy import VLLMPolicy  # noqa: E402
from lmcollect.engines.served import (  # noqa: E402
    VLLMServer,
    VLLMServerEngine,
    VLLMServerError,
    free_port,
    master_address_for,
    request_json,
    serve_command,
)
from lmcollect.policies.vllm_server import VLLMServerPolicy  # noqa: E402
from lmcollect.engines.served.control import CONTROL_TOKEN_HEADER  # noqa: E402
from lmcollect.weight_sync.vllm_updater import vLLMUpdater  # noqa: E402
from lmcollect.weight_sync import PushConfig  # noqa: E402

pytestmark = pytest.mark.integration

# conftest's CPU_ENGINE_KWARGS as flags: a KV cache that fits, no torch.compile
SERVE_ARGS = ["--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager"]
REPO_ROOT = Path(__file__).resolve().parents[2]  # where the server's worker imports tests.vllm_hold from
CONTRACT_ATOL = 1e-4  # vLLM against transformers
PUSH_TIMEOUT_S = 60.0
START_TIMEOUT_S = 240.0
PAUSE_LEASE_S = 5.0  # short, so an abandoned pause ends within a test; pushes renew it every third
ROWS = [{"prompt": q} for q in QUESTIONS]
NUM_DIALOG_TURNS = 16
IM_START = 1


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    # the test's worker extension: lmcollect's weight receiver plus the contract's step hold (the
    # last --worker-extension-cls wins over serve_command's)
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    with VLLMServer(
        model_dir,
        serve_args=[*SERVE_ARGS, "--worker-extension-cls", HOLDING_EXTENSION],
        env={"PYTHONPATH": python_path},
        control_endpoints=True,
        pause_lease_s=PAUSE_LEASE_S,
        start_timeout_s=START_TIMEOUT_S,
        log_path=log_path,
    ) as served:
        yield served
    assert not served.running


@pytest.fixture(scope="module")
def new_model_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, tiny_model_path: Path) -> Path:
    """The session model's folder (and eos config) with other weights: those of the tiny model of seed 1."""
    folder = tmp_path_factory.mktemp("tiny-seed1-eos")
    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    seed1 = get_model_path(ModelSpec(size="tiny", seed=1), cache_dir=tiny_model_path.parent)
    shutil.copyfile(seed1 / "model.safetensors", folder / "model.safetensors")
    return folder


def transformers_answers(model_path: Path, td: TensorDictBase) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens.full, log-probs) of plain transformers' greedy answers, the model read from ``model_path``."""
    model, tokenizer = load_model_and_tokenizer(model_path)
    return answers_of(TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)(td))


def assert_same_answers(got: TensorDictBase, want: list[tuple[torch.Tensor, torch.Tensor]], atol: float = 1e-5) -> None:
    for i, (tokens, log_probs) in enumerate(want):
        assert torch.equal(got[i][keys.TOKENS_FULL], tokens), f"element {i}"
        torch.testing.assert_close(got[i][keys.LOG_PROBS_RESPONSE], log_probs, atol=atol, rtol=0)


def answers_of(td: TensorDictBase) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(td[i][keys.TOKENS_FULL], td[i][keys.LOG_PROBS_RESPONSE]) for i in range(td.batch_size[0])]


def make_env() -> ChatEnv:
    return ChatEnv(arithmetic_dataset(32, seed=0), reward_fn=MathAnswerReward(), batch_size=4, seed=0)


# ------------------------------------------------------------------------------------ generation
def test_answers_exactly_like_the_in_process_engine(server: VLLMServer, greedy_policy: VLLMPolicy) -> None:
    # with the token, the policy reads the server's configuration (/server_info) and checks its log-probs mode
    policy = VLLMServerPolicy(
        server.url, control_token=server.control_token, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS
    )
    assert policy.engine.model == str(policy.model_path) and policy.base_url == server.url
    td = chat_batch(QUESTIONS)
    got, want = policy(td), greedy_policy(td)
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    assert_same_answers(got, answers_of(want))
    for i in range(len(QUESTIONS)):
        assert got[i]["text", "response"] == want[i]["text", "response"]
        assert got[i][keys.LOG_PROBS_RESPONSE].dtype == torch.float32
    # conftest's model_dir stops at an extra eos: that answer ends with it, before the budget
    assert got[0][keys.TOKENS_RESPONSE].numel() < MAX_NEW_TOKENS
    # the same answers with one request at a time
    one_at_a_time = VLLMServerPolicy(
        server.url, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, max_concurrent_requests=1
    )
    assert_same_answers(one_at_a_time(td), answers_of(want))


def test_seeded_sampling_matches_the_in_process_engine(
    server: VLLMServer, greedy_policy: VLLMPolicy, model_dir: Path
) -> None:
    td = chat_batch(QUESTIONS * 2)  # repeated prompts: each request has its own seed
    sampling = {"temperature": 1.0, "top_k": 50, "max_new_tokens": 8, "seed": 7}
    served = VLLMServerPolicy(server.url, **sampling)
    local = VLLMPolicy(model_dir, engine=greedy_policy.engine, **sampling)
    got, want = served(td), local(td)
    assert_same_answers(got, answers_of(want))
    assert not torch.equal(got[0][keys.TOKENS_RESPONSE], got[len(QUESTIONS)][keys.TOKENS_RESPONSE])
    served.set_seed(7)
    assert_same_answers(served(td), answers_of(got))


def test_multi_turn_dialogs_are_token_exact_and_equal_the_in_process_ones(
    server: VLLMServer, greedy_policy: VLLMPolicy
) -> None:
    policy = VLLMServerPolicy(server.url, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    got = collect_dialogs(guessing_env(4, system_prompt="Be brief.", rows=ROWS), policy, NUM_DIALOG_TURNS)
    want = collect_dialogs(guessing_env(4, system_prompt="Be brief.", rows=ROWS), greedy_policy, NUM_DIALOG_TURNS)
    counts = check_token_exact(got, policy.stop_token_ids, IM_START)
    assert counts.num_stopped > 0 and counts.num_truncated > 0, counts
    got_turns, want_turns = [t for turns in got for t in turns], [t for turns in want for t in turns]
    assert len(got_turns) == len(want_turns) == NUM_DIALOG_TURNS
    for got_turn, want_turn in zip(got_turns, want_turns):
        assert torch.equal(got_turn[keys.TOKENS_FULL], want_turn[keys.TOKENS_FULL])
        got_log_probs, want_log_probs = got_turn[keys.LOG_PROBS_RESPONSE], want_turn[keys.LOG_PROBS_RESPONSE]
        torch.testing.assert_close(got_log_probs, want_log_probs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ errors
def test_errors_name_the_server(server: VLLMServer) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VLLMServerError, match=f"cannot reach the vLLM server at {nobody}/v1/models"):
        VLLMServerPolicy(nobody)
    with pytest.raises(ValueError, match="does not serve model='other'"):
        VLLMServerPolicy(server.url, model="other")
    with pytest.raises(ValueError, match="no /v1 path"):
        VLLMServerPolicy(server.url + "/v1")
    engine = VLLMServerEngine(server.url, control_token=server.control_token)
    with pytest.raises(PromptTooLongError, match="5000 tokens.*context of 4096 tokens"):  # refused before sending
        engine.submit(EngineRequest(prompt_ids=[1] * 5000, sampling=SamplingConfig(max_new_tokens=4)))
    unknown_token = [1, 2, 10**7]  # past the vocabulary: the server refuses it
    fine, refused = (
        engine.submit(EngineRequest(prompt_ids=prompt, sampling=SamplingConfig(max_new_tokens=4)))
        for prompt in ([1, 2, 3], unknown_token)
    )
    assert fine.result(timeout=60).tokens.numel() == 4  # the other request of the batch is answered
    with pytest.raises(VLLMServerError, match=f"{server.url}/v1/completions failed with HTTP 400"):
        refused.result(timeout=60)
    with pytest.raises(VLLMServerError, match="no_such_method"):
        engine.collective_rpc("no_such_method")
    assert engine.call("GET", "/is_paused") == {"is_paused": False}  # a failed call still resumed the server
    assert master_address_for(server.url) == "127.0.0.1"
    command = serve_command("/m", host="127.0.0.1", port=1, serve_args=["--dtype", "bfloat16"])
    assert command[-2:] == ["--dtype", "bfloat16"] and "--logprobs-mode" in command  # the caller's flags come last


# ------------------------------------------------------------------------------------ control endpoints
def test_control_requests_without_the_token_are_refused_and_the_server_keeps_serving(server: VLLMServer) -> None:
    assert server.control_token and server.control_token not in " ".join(server.command)
    cmdline = Path(f"/proc/{server.process.pid}/cmdline")
    if cmdline.exists():  # what `ps` shows other users
        assert server.control_token.encode() not in cmdline.read_bytes()
    wrong = {CONTROL_TOKEN_HEADER: "wrong-token-0123456789abcdef"}
    for path in ["/pause?mode=abort", "/collective_rpc", "/reset_prefix_cache", "/sleep", "/server_info"]:
        for headers, status in [({}, 401), (wrong, 403)]:
            with pytest.raises(VLLMServerError) as refused:
                request_json("POST", server.url + path, {"method": "load_weights"}, timeout_s=30, headers=headers)
            assert refused.value.status == status, (path, headers)
    # a web page's cross-site request is refused even with the token (wait_ready already checked the launch proof)
    cross_site = {CONTROL_TOKEN_HEADER: server.control_token, "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    with pytest.raises(VLLMServerError, match="control request refused") as refused:
        request_json("POST", server.url + "/pause?mode=abort", timeout_s=30, headers=cross_site)
    assert refused.value.status == 403
    with pytest.raises(VLLMServerError, match="pass control_token"):
        VLLMServerEngine(server.url).collective_rpc("load_weights")
    engine = VLLMServerEngine(server.url, control_token=server.control_token)
    assert engine.call("GET", "/is_paused") == {"is_paused": False}
    policy = VLLMServerPolicy(server.url, temperature=0.0, max_new_tokens=4)  # generation needs no token
    assert policy(chat_batch(QUESTIONS[:1]))[0][keys.TOKENS_RESPONSE].numel() > 0


def test_a_pause_nobody_renews_ends_after_the_lease(server: VLLMServer) -> None:
    engine = VLLMServerEngine(server.url, control_token=server.control_token)
    engine.call("POST", "/pause?mode=wait&clear_cache=false")  # and this client never resumes
    started = time.monotonic()
    assert engine.call("GET", "/is_paused") == {"is_paused": True}
    limit_s = PAUSE_LEASE_S + 30.0
    while engine.call("GET", "/is_paused")["is_paused"]:
        assert time.monotonic() - started < limit_s, f"still paused {limit_s} s after an abandoned pause"
        time.sleep(0.2)
    assert time.monotonic() - started > PAUSE_LEASE_S * 0.5
    log = server.log_path.read_text(encoding="utf-8", errors="replace")
    assert "nobody renewed the pause" in log  # the guard resumed it, not something else
    policy = VLLMServerPolicy(server.url, temperature=0.0, max_new_tokens=4)
    assert policy(chat_batch(QUESTIONS[:1]))[0][keys.TOKENS_RESPONSE].numel() > 0


# ------------------------------------------------------------------------------------ the engine contract
class GroupPusher:
    """A trainer's pushes into the server's workers, as ``vLLMUpdater`` makes them: a
    ``ProcessGroupSender`` the workers joined checks the weights against what they accept (a misfit
    is refused there, before anything is sent), then broadcasts them while the engine's
    ``load_weights(GroupPush(...))`` has the workers receive and reload."""

    def __init__(self, engine: VLLMServerEngine, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        self.engine, self.timeout_s = engine, timeout_s
        address = master_address_for(engine.base_url)
        config = ProcessGroupConfig(master_address=address, num_receivers=1, backend="gloo", timeout_s=timeout_s)
        self.sender = ProcessGroupSender(config)
        with ThreadPoolExecutor(1) as pool:  # the workers' join returns once the sender has connected
            joined = pool.submit(join_weight_group, engine, self.sender.connection_info(), ranks_per_replica=1)
            self.sender.connect()
            joined.result(timeout=timeout_s)

    def __call__(self, weights: dict[str, torch.Tensor], version: int) -> None:
        prepared = self.sender.prepare(weights)  # ValueError "... no weight was changed" for a misfit
        push = GroupPush(timeout_s=self.timeout_s, verify=True)
        if version < self.engine.version:  # the engine refuses it (StalePushError) before its workers receive
            self.engine.load_weights(push, version=version)
            raise AssertionError(f"the engine took version {version} over its newer {self.engine.version}")
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(self.engine.load_weights, push, version=version)
            self.sender.send(prepared, version=PushVersion(version))
            (report,) = received.result(timeout=self.timeout_s)
        assert report["checksums"] == self.sender.last_checksums(), "the worker holds other bytes than were sent"

    def close(self) -> None:
        self.sender.close()


@pytest.fixture(scope="module")
def served_case(
    server: VLLMServer, model_dir: Path, new_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineCase]:
    """The server behind a VLLMServerEngine of its own, pushed through a process group; its HTTP
    answers come whole, so a push never lands inside one (``responses_span_pushes=False``)."""
    engine = VLLMServerEngine(server.url, control_token=server.control_token, timeout_s=120.0)
    pusher = GroupPusher(engine)
    old, tokenizer = load_model_and_tokenizer(model_dir)
    new = load_model_and_tokenizer(new_model_dir)[0].eval()
    folder = tmp_path_factory.mktemp("served-held-steps")
    yield hf_case(
        engine, old.eval(), new, hold_step=lambda step: held_step(engine, step, folder), log_prob_atol=CONTRACT_ATOL,
        push=pusher, responses_span_pushes=False, eos_token_ids=checkpoint_eos_token_ids(model_dir, tokenizer),
    )  # fmt: skip
    pusher.close()
    engine.close()


@pytest.mark.parametrize("check", list(CHECKS))  # in order: "close" (of the case's engine, not the server) is last
def test_served_engine_contract(served_case: EngineCase, check: str) -> None:
    CHECKS[check](served_case)
    engine = served_case.engine
    assert isinstance(engine, VLLMServerEngine)
    assert engine.call("GET", "/is_paused") == {"is_paused": False}  # every check, even close, leaves it running


# ------------------------------------------------------------------------------------ weight sync
def test_push_into_the_server_answers_like_transformers_with_the_pushed_weights(
    server: VLLMServer, new_model_dir: Path
) -> None:
    want_new = transformers_answers(new_model_dir, chat_batch(QUESTIONS))  # vLLM against transformers: 1e-4
    policy = VLLMServerPolicy(
        server.url, control_token=server.control_token, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS
    )
    updater = vLLMUpdater(config=PushConfig(verify=True, timeout_s=60))
    collector = LLMCollector(
        make_env(), policy=policy, dialog_turns_per_batch=4, weight_updater=updater, track_policy_version=True
    )
    td = chat_batch(QUESTIONS)
    old = answers_of(policy(td))
    assert collector.next()[keys.POLICY_VERSION].reshape(-1).tolist() == [0] * 4

    # another job sharing the server keeps asking during the push: the pause waits for its
    # running requests, queues the new ones, and resumes
    other_job = VLLMServerPolicy(server.url, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, check_server=False)
    stop = threading.Event()
    other_answers: list[TensorDictBase] = []

    def ask_until_stopped() -> None:
        while not stop.is_set():
            other_answers.append(other_job(td))

    with ThreadPoolExecutor(1) as pool:
        asking = pool.submit(ask_until_stopped)
        collector.update_policy_weights_(load_model_and_tokenizer(new_model_dir)[0])
        stop.set()
        asking.result(timeout=120)  # no request of the other job failed
    assert other_answers
    assert collector.policy_version == 1
    (info,) = updater.last_push_info  # one worker (tp 1); its checksums came back as JSON and matched
    assert info["rank"] == 1 and len(info["checksums"]) >= 1
    assert policy.engine.call("GET", "/is_paused") == {"is_paused": False}
    assert_same_answers(policy(td), want_new, atol=1e-4)
    assert_same_answers(other_job(td), want_new, atol=1e-4)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(old, want_new))  # the push changed the answers
    assert collector.next()[keys.POLICY_VERSION].reshape(-1).tolist() == [1] * 4

    with pytest.raises(ValueError, match="older|lower|version"):  # versions only go up
        updater.push_weights(load_model_and_tokenizer(new_model_dir)[0], version=1)
    collector.shutdown()
    updater.close()


def test_stopped_server_leaves_no_process_and_fails_clearly(server: VLLMServer) -> None:
    policy = VLLMServerPolicy(server.url, temperature=0.0, max_new_tokens=4)
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # the API server, engine core and worker are all gone
    with pytest.raises(VLLMServerError, match=f"cannot reach the vLLM server at {server.url}/v1/completions"):
        policy(chat_batch(QUESTIONS[:1]))
