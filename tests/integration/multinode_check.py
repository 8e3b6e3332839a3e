"""The multi-node paths for real, on one three-node Ray cluster started on this machine.

Run by tests/integration/test_multinode.py in its own process (it starts its own cluster, once for
all checks). With ``--links`` the two worker nodes run in network namespaces of their own, each
behind a 1 Gbit/s rate-limited link to the head (tests/links.py), so every byte between nodes
crosses a real link; without it, all three nodes share loopback. The checks:

- two RayLLMCollectors on two nodes fill a RayReplayBuffer on a third; prints "MULTINODE OK <json>";
- with ``--vllm``: a vLLMUpdater built without a master_address pushes into a vLLM engine in a
  RayLLMCollector on another node. It must pick this node's IP as Ray reports it (not loopback),
  the engine's worker must join the group there, and collection must go on with the new version;
  prints "VLLM MULTINODE OK <json>";
- with ``--links``: prints "LINKS <json>": each node's address and the bytes its link carried.
"""
from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import (
    ChatEnv,
    GuessingGameTask,
    MathAnswerReward,
    arithmetic_dataset,
    binary_search_player,
    guessing_game_dataset,
)
from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.collector import RayLLMCollector
from lmcollect.ray.group import RayCollectorGroup
from lmcollect.testing import ScriptedPolicy

ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}
LINK_RATE_MBIT = 1000
NODES = ("node_a", "node_b")


def check_collectors_and_buffer() -> None:
    buffer = RayReplayBuffer(capacity=1000, remote_config={"resources": {"buffer_node": 0.1}})
    make_env = functools.partial(
        ChatEnv, guessing_game_dataset(32, seed=0), task=GuessingGameTask(), batch_size=2, max_turns=5, seed=0
    )
    with RayCollectorGroup(
        2,
        env=make_env,
        policy_factory=functools.partial(ScriptedPolicy, binary_search_player),
        dialog_turns_per_batch=4,
        total_dialog_turns=16,
        replay_buffer=buffer,
        remote_configs=[{"num_cpus": 0.5, "resources": {"node_a": 0.1}}, {"num_cpus": 0.5, "resources": {"node_b": 0.1}}],
    ) as group:
        nodes = [c.process_info()["node_id"] for c in group]
        group.start()
        deadline = time.monotonic() + 120
        while len(buffer) < 32 and time.monotonic() < deadline:
            time.sleep(0.2)
    buffer_node = ray.get(buffer.actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
    sample = buffer.sample(32, replace=False)
    ids = {(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in flatten_turns(sample)}
    result = {"collector_nodes": nodes, "buffer_node": buffer_node, "turns": len(buffer), "unique": len(ids)}
    assert len(set(nodes)) == 2 and buffer_node not in nodes, result
    assert len(buffer) == 32 and len(ids) == 32, result
    print("MULTINODE OK", json.dumps(result), flush=True)


def check_vllm_push_across_nodes() -> None:
    from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
    from lmcollect.policies.vllm_policy import VLLMPolicy
    from lmcollect.weight_sync import PushConfig
    from lmcollect.weight_sync.vllm_updater import LOOPBACK, vLLMUpdater

    with tempfile.TemporaryDirectory() as cache_dir:
        model_path = get_model_path(ModelSpec(size="tiny"), cache_dir=cache_dir)
        trainer_model = load_model_and_tokenizer(get_model_path(ModelSpec(size="tiny", seed=1), cache_dir=cache_dir))[0]
        updater = vLLMUpdater(config=PushConfig(timeout_s=120))
        collector = RayLLMCollector(
            ChatEnv(arithmetic_dataset(16, seed=0), reward_fn=MathAnswerReward(), batch_size=2, seed=0),
            policy_factory=functools.partial(VLLMPolicy, str(model_path), engine_kwargs=ENGINE_KWARGS, max_new_tokens=8),
            dialog_turns_per_batch=2,
            weight_updater=updater,
            track_policy_version=True,
            remote_config={
                "num_cpus": 0.5,
                "resources": {"node_a": 0.1},
                "runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
            },
        )
        try:
            collector_node = collector.process_info()["node_id"]
            collector.update_policy_weights_(trainer_model)
            address = updater._sender.connection_info()["master_address"]
            batch = collector.next().reshape(-1)
            result = {
                "trainer_node": ray.get_runtime_context().get_node_id(),
                "collector_node": collector_node,
                "master_address": address,
                "versions": batch[keys.POLICY_VERSION].tolist(),
                "pushed_bytes": updater.last_push_stats.nbytes if updater.last_push_stats else None,
            }
        finally:
            collector.shutdown()
    assert result["collector_node"] != result["trainer_node"], result
    assert address == ray.util.get_node_ip_address() and address != LOOPBACK, result
    assert result["versions"] == [1, 1], result
    print("VLLM MULTINODE OK", json.dumps(result), flush=True)


@contextlib.contextmanager
def loopback_cluster() -> Iterator[None]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"buffer_node": 1}})
    for name in NODES:
        cluster.add_node(num_cpus=1, resources={name: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still removes its cluster
    if "--links" not in argv:
        with loopback_cluster():
            run_checks(argv)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.links, run as a script
    from tests.links import LinkedCluster, NodeLink

    nodes = [NodeLink(name=name, rate_mbit=LINK_RATE_MBIT) for name in NODES]
    with LinkedCluster(nodes, head_resources={"buffer_node": 1}) as cluster:
        run_checks(argv)
        result = {
            "head_ip": cluster.head_ip,
            "node_ips": {name: cluster.node_ip(name) for name in NODES},
            "rate_mbit": LINK_RATE_MBIT,
            "bytes": cluster.link_bytes(),
            "ray_node_ips": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
        }
        print("LINKS", json.dumps(result), flush=True)


def run_checks(argv: list[str]) -> None:
    check_collectors_and_buffer()
    if "--vllm" in argv:
        check_vllm_push_across_nodes()


if __name__ == "__main__":
    main(sys.argv[1:])
