"""A vLLMUpdater pushing into a vLLM engine in a RayLLMCollector on another Ray node (all on this machine).

Run by tests/integration/test_vllm_multinode.py in its own process (it starts its own two-node Ray
cluster). The updater is built without a master_address: it must pick this node's IP as Ray
reports it (not loopback), the engine's worker must join the group there, and collection must go
on with the new version. Prints "VLLM MULTINODE OK <json>" when every check passes.
"""
from __future__ import annotations

import functools
import json
import tempfile

import ray
from ray.cluster_utils import Cluster

from lmcollect.ray.collector import RayLLMCollector
from lmcollect.data import keys
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies.vllm_policy import VLLMPolicy
from lmcollect.weight_sync.vllm_updater import LOOPBACK, vLLMUpdater

ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1, resources={"engine_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as cache_dir:
            model_path = get_model_path(ModelSpec(size="tiny"), cache_dir=cache_dir)
            trainer_model = load_model_and_tokenizer(get_model_path(ModelSpec(size="tiny", seed=1), cache_dir=cache_dir))[0]
            updater = vLLMUpdater(timeout_s=120)
            collector = RayLLMCollector(
                ChatEnv(arithmetic_dataset(16, seed=0), reward_fn=MathAnswerReward(), batch_size=2, seed=0),
                policy_factory=functools.partial(VLLMPolicy, str(model_path), engine_kwargs=ENGINE_KWARGS, max_new_tokens=8),
                dialog_turns_per_batch=2,
                weight_updater=updater,
                track_policy_version=True,
                remote_config={
                    "num_cpus": 0.5,
                    "resources": {"engine_node": 0.1},
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
                }
            finally:
                collector.shutdown()
        assert result["collector_node"] != result["trainer_node"], result
        assert address == ray.util.get_node_ip_address() and address != LOOPBACK, result
        assert result["versions"] == [1, 1], result
        print("VLLM MULTINODE OK", json.dumps(result))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
