"""PushConfig: one config type for every updater; the spec's vLLMUpdater keywords fill it, and each
updater refuses the options only the other mechanism reads (no Ray cluster, no vLLM engine)."""
from __future__ import annotations

import ast
import inspect

import pytest

from lmcollect.ray.updater import RayPushConfig, RayRemoteWeightUpdater
from lmcollect.weight_sync import PushConfig, vLLMUpdater
from lmcollect.weights import push_config


def test_every_field_has_a_docstring() -> None:
    body = next(n for n in ast.parse(inspect.getsource(push_config)).body if getattr(n, "name", "") == "PushConfig")
    assert isinstance(body, ast.ClassDef)
    undocumented = [
        node.target.id
        for node, after in zip(body.body, [*body.body[1:], None])
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str))
    ]
    assert undocumented == []


def test_the_former_ray_name_is_the_same_class() -> None:
    assert RayPushConfig is PushConfig
    assert RayPushConfig(timeout_s=60, packing="flat").packing == "flat"


def test_the_spec_keywords_fill_the_config() -> None:
    updater = vLLMUpdater("10.1.2.3", 29500, None, 2, config=PushConfig(timeout_s=60, verify=True))
    assert (updater.config.master_address, updater.config.master_port, updater.config.vllm_tp_size) == ("10.1.2.3", 29500, 2)
    assert (updater.master_address, updater.master_port, updater.vllm_tp_size, updater.timeout_s) == ("10.1.2.3", 29500, 2, 60)
    assert updater.config.verify and updater.model_metadata is None
    assert vLLMUpdater().vllm_tp_size == 1 and vLLMUpdater().config == PushConfig()
    same = vLLMUpdater(vllm_tp_size=2, config=PushConfig(vllm_tp_size=2))  # agreeing twice is fine
    assert same.vllm_tp_size == 2


def test_a_keyword_that_disagrees_with_the_config_names_both() -> None:
    with pytest.raises(ValueError, match=r"vllm_tp_size=2 and config=PushConfig\(vllm_tp_size=4\)"):
        vLLMUpdater(vllm_tp_size=2, config=PushConfig(vllm_tp_size=4))
    with pytest.raises(ValueError, match="master_address='a' and config=PushConfig\\(master_address='b'\\)"):
        vLLMUpdater("a", config=PushConfig(master_address="b"))


def test_a_config_of_another_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="vLLMUpdater\\(config=...\\) takes a PushConfig"):
        vLLMUpdater(config={"timeout_s": 60})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RayRemoteWeightUpdater\\(config=...\\) takes a PushConfig.*got dict"):
        RayRemoteWeightUpdater(None, [], config={"timeout_s": 60})  # type: ignore[arg-type]


def test_vllm_updater_refuses_ray_only_options_and_no_timeout() -> None:
    with pytest.raises(ValueError, match="zero_copy=True.*Ray only"):
        vLLMUpdater(config=PushConfig(zero_copy=True))
    with pytest.raises(ValueError, match="packing='flat'"):
        vLLMUpdater(config=PushConfig(packing="flat"))
    with pytest.raises(ValueError, match="timeout_s=None"):
        vLLMUpdater(config=PushConfig(timeout_s=None))


def test_ray_updater_refuses_process_group_options() -> None:
    with pytest.raises(ValueError, match="verify=True, backend='gloo'.*process group only"):
        RayRemoteWeightUpdater(None, [], config=PushConfig(verify=True, backend="gloo"))
    assert RayRemoteWeightUpdater(None, [], config=PushConfig(timeout_s=None)).config.timeout_s is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"vllm_tp_size": 0}, "vllm_tp_size"),
        ({"master_port": -1}, "master_port"),
        ({"backend": "mpi"}, "backend"),
        ({"bucket_size_bytes": 0}, "bucket_size_bytes"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"delta": True, "link_gbit": 10.0}, "delta='auto'"),
    ],
)
def test_bad_values_name_the_option(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PushConfig(**options)


def test_the_spec_constructor_arguments_stay() -> None:
    """The spec (vLLMUpdater, RayRemoteWeightUpdater) fixes these positional arguments and defaults."""
    vllm = inspect.signature(vLLMUpdater).parameters
    assert [(n, p.default) for n, p in vllm.items()][:4] == [
        ("master_address", None), ("master_port", None), ("model_metadata", None), ("vllm_tp_size", None)
    ]
    ray = inspect.signature(RayRemoteWeightUpdater).parameters
    assert [(n, p.default) for n, p in ray.items()][:3] == [
        ("policy_weights", None), ("remote_collectors", None), ("max_interval", 0)
    ]
    assert vllm["config"].kind is ray["config"].kind is inspect.Parameter.KEYWORD_ONLY


# ---------------------------------------------------------------------- one declaration per option
def test_a_process_group_config_is_a_push_config_plus_the_group_size() -> None:
    from lmcollect.transports.process_group import ProcessGroupConfig
    from lmcollect.weights.delta import DeltaConfig

    pushed = PushConfig(timeout_s=30, convert_dtype=True, bucket_size_bytes=256, digest=False, backend="gloo")
    built = ProcessGroupConfig(num_receivers=2, push=pushed)
    assert built.push == pushed and built.num_receivers == 2
    assert (built.timeout_s, built.convert_dtype, built.bucket_size_bytes, built.digest, built.backend) == (
        30, True, 256, False, "gloo")  # fmt: skip
    keywords = ProcessGroupConfig(num_receivers=2, timeout_s=30, convert_dtype=True, bucket_size_bytes=256,
                                  digest=False, backend="gloo")  # fmt: skip
    assert keywords == built  # the documented keywords build the same config
    defaults = ProcessGroupConfig()  # the group's defaults where PushConfig leaves a field to the mechanism
    assert (defaults.master_address, defaults.master_port, defaults.bucket_size_bytes) == ("127.0.0.1", 0, 64 * 2**20)
    assert (defaults.num_receivers, defaults.delta, ProcessGroupConfig(delta=DeltaConfig()).delta) == (1, None, DeltaConfig())
    assert not {"timeout_s", "convert_dtype", "digest"} & set(ProcessGroupConfig.__dataclass_fields__)
    with pytest.raises(ValueError, match="packing='flat'.*Ray only"):
        ProcessGroupConfig(packing="flat")
    with pytest.raises(TypeError, match="unknown option.*'num_recievers'"):
        ProcessGroupConfig(num_recievers=2)
    with pytest.raises(ValueError, match="num_receivers must be an int >= 1"):
        ProcessGroupConfig(num_receivers=0)
    with pytest.raises(ValueError, match="delta='auto'"):
        ProcessGroupConfig(delta="auto")


def test_the_local_updater_reads_a_push_config_and_its_keywords_fill_it() -> None:
    from lmcollect.weight_sync import LocalWeightUpdater

    assert LocalWeightUpdater().config == PushConfig()
    updater = LocalWeightUpdater(config=PushConfig(convert_dtype=True), allow_non_finite=True)
    assert (updater.convert_dtype, updater.allow_non_finite) == (True, True)
    assert updater.config == PushConfig(convert_dtype=True, allow_non_finite=True)
    with pytest.raises(ValueError, match="convert_dtype=False and config=PushConfig"):
        LocalWeightUpdater(config=PushConfig(convert_dtype=True), convert_dtype=False)
    with pytest.raises(ValueError, match="in place.*delta=True"):
        LocalWeightUpdater(config=PushConfig(delta=True))
    with pytest.raises(ValueError, match="zero_copy=True.*Ray only"):
        LocalWeightUpdater(config=PushConfig(zero_copy=True))
