"""Two RayLLMCollectors on two nodes and a RayReplayBuffer on a third, all on this machine.

Run by tests/integration/test_multinode.py in its own process (it starts its own Ray cluster).
Prints "MULTINODE OK <json>" when every check passes.
"""
from __future__ import annotations

import functools
import json
import time

import ray
from ray.cluster_utils import Cluster

from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.group import RayCollectorGroup
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, GuessingGameTask, binary_search_player, guessing_game_dataset
from lmcollect.policies import ScriptedPolicy


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"buffer_node": 1}})
    for name in ("node_a", "node_b"):
        cluster.add_node(num_cpus=1, resources={name: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    try:
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
        print("MULTINODE OK", json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
