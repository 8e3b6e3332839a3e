"""vLLMUpdater losing a member of its gloo group: the engine worker, or the sender, dies mid-push.

One engine actor (``VLLMReplicas``, ``max_restarts=1``) behind a local collector serves every
case, in order: a NaN push is refused before the group forms; a push goes through; the worker
SIGKILLs itself after the first buffer of the next push (``WeightPushError`` within
``timeout_s``), comes back, and the trainer forms a new group and pushes again; then a sender in
another process dies after the first buffer of a push, and the engine keeps the weights (and the
collector the version) it had.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
import torch

from lmcollect import LLMCollector
from lmcollect.data import keys
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.weight_sync import WeightPushError
from lmcollect.engines.weight_group import GroupPush
from lmcollect.weights.version import PushVersion
from tests.factories import make_arithmetic_env
from tests.faults.fault_factories import DIE_MID_PUSH_ENV, DyingSender
from tests.integration.conftest import CPU_ENGINE_KWARGS, QUESTIONS, chat_batch

pytest.importorskip("vllm")
from lmcollect.policies.vllm_policy import VLLMPolicy  # noqa: E402
from lmcollect.ray.vllm_replicas import VLLMReplicas  # noqa: E402
from lmcollect.weight_sync.vllm_updater import vLLMUpdater  # noqa: E402
from lmcollect.weight_sync import PushConfig  # noqa: E402

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 8
TIMEOUT_S = 20.0
BUCKET_SIZE_BYTES = 1 << 20  # the tiny model's 9 MB go in several buffers: a worker can die between two
ENGINE_KWARGS = {**CPU_ENGINE_KWARGS, "worker_extension_cls": "tests.faults.fault_factories.DyingReceiverExtension"}


def model_of_seed(tiny_model_path: Path, seed: int) -> torch.nn.Module:
    """The tiny model's architecture with the weights of the tiny model of ``seed``."""
    path = tiny_model_path if seed == 0 else get_model_path(ModelSpec(size="tiny", seed=seed), cache_dir=tiny_model_path.parent)
    return load_model_and_tokenizer(path)[0]


def wait_until_ready(actor, timeout_s: float = 180.0) -> float:
    """Seconds until a restarting engine actor answers (calls to it fail while it restarts)."""
    started = time.monotonic()
    while True:
        try:
            ray.get(actor.version.remote(), timeout=10)
            return time.monotonic() - started
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() - started < timeout_s, "the engine actor did not come back"
            time.sleep(0.5)


def answers(policy) -> list[list[int]]:
    out = policy(chat_batch(QUESTIONS))
    return [out[i][keys.TOKENS_RESPONSE].tolist() for i in range(len(QUESTIONS))]


@pytest.mark.fault_timeout(240)
def test_vllm_worker_or_sender_dying_mid_push(ray_cluster, tiny_model_path: Path, tmp_path: Path, fault_table) -> None:
    tokenizer = load_model_and_tokenizer(tiny_model_path)[1]
    models = {seed: model_of_seed(tiny_model_path, seed) for seed in (0, 1, 2)}
    expected = {
        seed: answers(TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS))
        for seed, model in models.items()
    }
    marker = tmp_path / "die-mid-push"
    replicas = VLLMReplicas(tiny_model_path, engine_kwargs=ENGINE_KWARGS, env_vars={DIE_MID_PUSH_ENV: str(marker)},
                            remote_config={"num_cpus": 0.5, "max_restarts": 1})
    policy = VLLMPolicy(tiny_model_path, engine=replicas, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    updater = vLLMUpdater(config=PushConfig(timeout_s=TIMEOUT_S, bucket_size_bytes=BUCKET_SIZE_BYTES))
    collector = LLMCollector(make_arithmetic_env(), policy=policy, dialog_turns_per_batch=4, weight_updater=updater,
                             track_policy_version=True)
    try:
        # NaN: refused before the group forms, so nothing reaches the engine
        nan_model = model_of_seed(tiny_model_path, 1)
        with torch.no_grad():
            nan_model.model.norm.weight[0] = float("nan")
        with pytest.raises(ValueError, match=r"'model.norm.weight' holds NaN"):
            collector.update_policy_weights_(nan_model)
        assert updater._sender is None and collector.policy_version == 0
        assert answers(policy) == expected[0]
        fault_table.add("push of NaN weights (vLLM)", "vLLMUpdater.push_weights of a model with a NaN",
                        "ValueError before the group forms; the engine's answers and version unchanged", None, None)

        collector.update_policy_weights_(models[1])
        assert collector.policy_version == 1 and answers(policy) == expected[1]

        # the engine worker dies after the first buffer of a push
        marker.touch()
        started = time.monotonic()
        with pytest.raises(WeightPushError, match="replica 0 failed during receive_weights"):
            collector.update_policy_weights_(models[2])
        worker_error_s = time.monotonic() - started
        assert worker_error_s < TIMEOUT_S and not marker.exists()
        assert collector.policy_version == 1  # the collector never took the failed push's version
        restart_s = wait_until_ready(replicas.actors[0])  # restarted: the checkpoint's weights again
        collector.update_policy_weights_(models[2])  # a new group with the restarted engine
        assert collector.policy_version == 3 and answers(policy) == expected[2]
        fault_table.add(
            "vLLM engine worker killed mid-push (gloo)",
            "the worker's process SIGKILLs itself after the first 1 MiB buffer of a push",
            f"WeightPushError naming replica 0; the engine actor is back {restart_s:.0f} s later; the next push "
            "forms a new group and goes through (answers = the pushed model's)",
            worker_error_s,
            None,
        )

        # a sender in another process dies after the first buffer of a push into the engine
        sender = ray.remote(num_cpus=0.1)(DyingSender).remote(1, timeout_s=TIMEOUT_S, bucket_size_bytes=BUCKET_SIZE_BYTES)
        info = ray.get(sender.connection_info.remote())
        joined = sender.connect.remote()
        collector.join_policy_weight_group(info, ranks_per_replica=1)
        ray.get(joined)
        dying = sender.send_and_die.remote(models[1].state_dict(), 1)
        started = time.monotonic()
        with pytest.raises(RuntimeError):  # the worker's receive fails: its peer is gone
            collector.receive_weights(GroupPush(timeout_s=TIMEOUT_S), version=PushVersion(9))
        sender_error_s = time.monotonic() - started
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dying, timeout=TIMEOUT_S)
        assert collector.policy_version == 3, "the version of a push that never arrived was taken"
        assert answers(policy) == expected[2], "the engine kept part of a broken push"
        fault_table.add(
            "sender dies mid-broadcast (vLLM engine, gloo)",
            "a sender actor SIGKILLs itself after the first 1 MiB buffer of a push into the engine",
            "the worker's receive_weights raises; the engine keeps the weights it had (answers unchanged) and "
            "the collector its version",
            sender_error_s,
            None,
        )
        updater.init()  # the trainer forms its group again and pushes
        collector.update_policy_weights_(models[1])
        assert collector.policy_version == 4 and answers(policy) == expected[1]
    finally:
        collector.shutdown()
        replicas.shutdown()
