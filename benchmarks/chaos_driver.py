"""The process the chaos harness kills: one training-shaped collection run that resumes from its checkpoint.

Run by ``benchmarks/chaos.py`` as ``python -m benchmarks.chaos_driver CONFIG.json`` (a fresh
interpreter per run), or forked from ``python -m benchmarks.chaos_driver --serve`` (a fork server
that imports torch and lmcollect once: the short form's restarts then cost a fork, not an import). It builds a
collection setup (a scenario: lockstep, lockstep-ds, continuous, tiny, tiny-delta, tiny-lora or ray; GRPO
groups, a replay buffer),
restores ``<workdir>/ckpt`` if a checkpoint is there (the recipe of docs/checkpoints.md: build the
same setup, ``load_checkpoint``), then for each batch: collect, write it to the buffer, sample the
buffer, push the trainer's weights for the next version (one push per batch: full, delta or LoRA
adapter, see :data:`PUSHES`), and every
``ckpt_every`` batches ``save_checkpoint`` (the continuous collector paused around it).

Everything it yields goes to ``<workdir>/log.jsonl``, one JSON line per event, written before the
next step (a SIGKILL loses no written line; a torn last line is dropped by the reader):
``start`` (the batch it resumed at, the restore time, whether the restored weights equal the
trainer's for that version), ``batch`` (every turn's ids, tokens, log-probs and versions, the
buffer's sample), ``ckpt`` (the save time). The trainer here is a function of the step (the weights
of version ``v`` are :func:`trainer_weights`), so the checkpoint's policy version is the step.

A planned kill inside this run's ``nth`` save (``config["save_kill"]``) is done by the process itself with SIGKILL:
``"collector"`` while the collector's state is taken (no file written), ``"buffer"`` after the
collector's file is written and before the buffer's (a torn save), ``"delay"`` after a delay from
the start of the save (any moment of it, the manifest's replace and the old files' removal included).
A planned kill inside this run's ``nth`` push (``config["push_kill"]``, :func:`kill_inside_push`) too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from lmcollect.buffers import ReplayBuffer
from lmcollect.checkpoint import MANIFEST, load_checkpoint, save_checkpoint
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns

RAY_TEMP_DIR_ENV = "LMCOLLECT_CHAOS_RAY_TEMP_DIR"
"""Where the driver's local Ray cluster keeps its files: the harness's temp root + "/ray" (set by the harness)."""
TURNS_PER_BATCH = 8
GROUP_SIZE = 2


PUSHES = {"tiny": "full", "tiny-delta": "delta", "tiny-lora": "lora", "vllm": "delta"}
"""The tiny model's scenarios' pushes: full weights, deltas (a :class:`~lmcollect.weights.delta.DeltaBase` of the
last push; a restarted driver has none, so its first push is full) or LoRA adapters (merged by the engine
into its kept base; a checkpoint holds base and adapter). ``vllm``: the tiny model in a multiprocess vLLM
engine, its pushes full then deltas (vLLM's delta path: staged in its worker, committed whole)."""
VLLM_ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 28, "enforce_eager": True, "distributed_executor_backend": "mp"}
"""vLLM's layout with a process per part: the engine core in its own process (``multiprocess=True``) and
its worker in another (the ``mp`` executor), so the harness can kill either."""
ENGINE_TIMEOUT_S = 120.0
"""The vLLM engine's bound on start-up and control calls, and the policy's on a request's result: the
bound within which a killed engine process must reach the driver as an error."""
CALL_TIMEOUT_S = 30.0
"""The ray scenario's actors' ``call_timeout_s``: the bound within which a killed actor must reach the
driver as an error."""
ERROR_BOUNDS_S = {"ray": CALL_TIMEOUT_S, "vllm": ENGINE_TIMEOUT_S}
"""Per scenario with processes the harness kills: the documented bound on the driver's error."""
LORA_RANK = 2


def model_kind(scenario: str) -> str:
    """``tiny`` for every scenario on the tiny model (the tiny ones differ in their pushes only; ``vllm``
    serves it in vLLM), else the scenario."""
    return "tiny" if scenario in PUSHES else scenario


def trainer_weights(scenario: str, version: int, model: Any = None) -> dict[str, torch.Tensor]:
    """The weights the trainer pushes as ``version`` (a pure function of it: the trainer's state);
    ``tiny-lora``: the base with :func:`trainer_adapter` merged (what the engine holds after its push)."""
    if model_kind(scenario) != "tiny":
        return {"tag": torch.tensor([float(version)])}
    if scenario == "tiny-lora":
        base = {name: tensor.detach() for name, tensor in model.named_parameters()}
        return {**base, **trainer_adapter(version, model).merged_into(base)}
    generator = torch.Generator().manual_seed(1000 + version)
    if PUSHES.get(scenario) == "delta":  # a few elements of each tensor move per version: a sparse delta
        return {name: _nudged(tensor.detach(), version) for name, tensor in model.named_parameters()}
    return {  # named_parameters: each tied tensor once (a push of both names would set it twice)
        name: tensor.detach() + torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.02
        for name, tensor in model.named_parameters()
    }


def _nudged(tensor: torch.Tensor, version: int) -> torch.Tensor:
    out = tensor.clone()
    flat = out.view(-1)
    flat[: min(8, flat.numel())] += 0.01 * version
    return out


def trainer_adapter(version: int, model: Any) -> Any:
    """The LoRA adapter the trainer pushes as ``version``: rank 2 on the model's first attention query."""
    from lmcollect.weights.lora import LoraAdapter, LoraLayerWeights

    name = next(n for n, _ in model.named_parameters() if n.endswith("q_proj.weight"))
    out_features, in_features = dict(model.named_parameters())[name].shape
    generator = torch.Generator().manual_seed(2000 + version)
    lora_a = torch.randn(LORA_RANK, in_features, generator=generator) * 0.05
    lora_b = torch.randn(out_features, LORA_RANK, generator=generator) * 0.05
    return LoraAdapter(layers={name: LoraLayerWeights(lora_a, lora_b, 2.0)}, rank=LORA_RANK)


class Pusher:
    """The trainer's side of a push, as ``PUSHES`` says (full weights for the non-tiny scenarios)."""

    def __init__(self, scenario: str) -> None:
        from lmcollect.weights.delta import DeltaBase, DeltaConfig

        self.scenario = scenario
        self.base = DeltaBase(DeltaConfig()) if PUSHES.get(scenario) == "delta" else None
        self.kinds: list[str] = []
        """What each push of this run was (``full``, ``delta``, ``lora``): logged with the batch."""

    def push(self, collector: Any, version: int, model: Any) -> None:
        from lmcollect.weights.delta import DeltaRejectedError
        from lmcollect.weights.version import PushVersion

        if PUSHES.get(self.scenario) == "lora":
            collector.receive_weights(trainer_adapter(version, model), version=PushVersion(version))
            self.kinds.append("lora")
            return
        weights = trainer_weights(self.scenario, version, model)
        if self.base is None:
            collector.update_policy_weights_(weights)
            self.kinds.append("full")
            return
        pushed = PushVersion(version)  # one push, one id: a delta applies to the very push it was made from
        encoded = self.base.encode(weights)
        if encoded is not None:
            try:
                collector.receive_weights(encoded.delta, version=pushed)
            except DeltaRejectedError:
                encoded = None
            else:
                self.base.commit(encoded, pushed)
                self.kinds.append("delta")
                return
        collector.receive_weights(weights, version=pushed)
        self.base.snapshot(weights, pushed)
        self.kinds.append("full")


def build(scenario: str, model_dir: str | None) -> tuple[Any, Any, Any]:
    """The collector, the buffer and (tiny) the base model of ``scenario``, built the same way every run."""
    from lmcollect.envs import ChatEnv, GuessingGameTask, binary_search_player, guessing_game_dataset

    rows = guessing_game_dataset(256, seed=0, low=1, high=20, max_turns=5)
    task = GuessingGameTask(low=1, high=20, max_turns=5)
    buffer = ReplayBuffer(capacity=10_000, seed=0)
    if scenario == "continuous":
        return _continuous(rows, task, binary_search_player), buffer, None
    if scenario == "ray":
        return (*_ray(rows, task, binary_search_player), None)
    env = ChatEnv(rows, task=task, batch_size=2 * GROUP_SIZE, repeats=GROUP_SIZE, max_turns=5, seed=0)
    from lmcollect.collectors import LLMCollector

    dynamic_sampling = None
    if scenario == "lockstep":
        from lmcollect.testing import ScriptedPolicy

        policy, base = ScriptedPolicy(binary_search_player), None
    elif scenario == "lockstep-ds":
        from lmcollect.collectors import DynamicSampling, drop_uniform_rewards

        policy, base = _seeded_scripted_policy(binary_search_player), None
        dynamic_sampling = DynamicSampling(group_filter=drop_uniform_rewards())
    elif scenario == "vllm":
        policy, base = _vllm_policy(model_dir)
    elif model_kind(scenario) == "tiny":
        if model_dir is None:
            raise ValueError("the tiny scenario needs model_dir (the tiny model's folder: get_model_path).")
        from lmcollect.models import load_model_and_tokenizer
        from lmcollect.policies import TransformersPolicy

        base, tokenizer = load_model_and_tokenizer(model_dir)
        model, _ = load_model_and_tokenizer(model_dir)
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=6, temperature=1.0, seed=0)
    else:
        raise ValueError(f"unknown scenario {scenario!r}; use lockstep, continuous, tiny or ray.")
    collector = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=TURNS_PER_BATCH,
        track_policy_version=True,
        dynamic_sampling=dynamic_sampling,
    )
    collector.worker_idx = 0
    return collector, buffer, base


def _vllm_policy(model_dir: str | None) -> tuple[Any, Any]:
    """An ``EnginePolicy`` over the tiny model in a multiprocess ``VLLMEngine`` (engine core and worker in
    processes of their own, see :data:`VLLM_ENGINE_KWARGS`), sampling at temperature 1 with per-request
    seeds; and the base model (what the trainer's weights are made from)."""
    if model_dir is None:
        raise ValueError("the vllm scenario needs model_dir (the tiny model's folder: get_model_path).")
    from lmcollect.engines.vllm.engine import VLLMEngine
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import EnginePolicy, SamplingConfig

    base, tokenizer = load_model_and_tokenizer(model_dir)
    engine = VLLMEngine(model_dir, engine_kwargs=dict(VLLM_ENGINE_KWARGS), multiprocess=True, timeout_s=ENGINE_TIMEOUT_S)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    return EnginePolicy(engine, tokenizer=tokenizer, sampling=sampling, seed=0, timeout_s=ENGINE_TIMEOUT_S), base


def engine_pids() -> dict[str, int]:
    """The vLLM engine core's process (this process's child) and its worker's (the core's child), found by
    the titles vLLM gives them (``VLLM::EngineCore``, ``VLLM::Worker...``)."""
    from lmcollect.engines.vllm.reaper import children

    def titled(pids: set[int], title: str) -> list[int]:
        return [pid for pid in pids if title in _cmdline(pid)]

    core = titled(children(os.getpid()), "EngineCore")
    workers = titled(children(core[0]), "Worker") if core else []
    if len(core) != 1 or len(workers) != 1:
        raise RuntimeError(f"expected one vLLM engine core and one worker, found {core} and {workers}.")
    return {"core": core[0], "worker": workers[0]}


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _seeded_scripted_policy(player: Any) -> Any:
    """An ``EnginePolicy`` over a scripted engine whose answer depends on the request's seed too: the
    player's answer for even seeds, "pass" (an invalid guess, reward 0) for odd ones. The members of a
    group get different seeds, so some groups have mixed rewards (kept by ``drop_uniform_rewards``) and
    some uniform (dropped). The seeds are drawn by the policy (seeded, and part of its checkpointed state),
    so a restored run answers as the uninterrupted one."""
    from lmcollect.policies import EnginePolicy, SamplingConfig
    from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine

    tokenizer = ByteTokenizer()
    seeds = threading.local()

    def script(prompt_ids: list[int]) -> list[int]:
        if seeds.current % 2:
            return tokenizer.encode("pass")
        return tokenizer.encode(player(tokenizer.parse_chat(tokenizer.decode(prompt_ids))))

    class SeededScriptedEngine(ScriptedEngine):
        def submit(self, request: Any) -> Any:
            seeds.current = request.seed  # read by script() inside this call
            return super().submit(request)

    engine = SeededScriptedEngine(script=script)
    return EnginePolicy(engine, tokenizer=tokenizer, sampling=SamplingConfig(temperature=1.0, max_new_tokens=64), seed=0)


def _continuous(rows: Any, task: Any, player: Any) -> Any:
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.envs import ChatEnv
    from lmcollect.policies import SamplingConfig
    from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script

    envs = [
        ChatEnv(rows, task=task, batch_size=GROUP_SIZE, repeats=GROUP_SIZE, max_turns=5, seed=seed) for seed in range(2)
    ]
    engine = ScriptedEngine(script=chat_script(player), token_delay_s=0.0005)
    collector = ContinuousLLMCollector(
        envs,
        engine=engine,
        tokenizer=ByteTokenizer(),
        sampling=SamplingConfig(max_new_tokens=64),
        dialog_turns_per_batch=TURNS_PER_BATCH,
        track_policy_version=True,
    )
    collector.worker_idx = 0
    return collector


def _ray(rows: Any, task: Any, player: Any) -> tuple[Any, Any]:
    """``RayLLMCollector`` and ``RayReplayBuffer`` (two actors) on a local cluster of this process."""
    import functools

    import ray

    from lmcollect.envs import ChatEnv
    from lmcollect.ray import RayReplayBuffer
    from lmcollect.ray.collector import RayLLMCollector
    from lmcollect.testing import ScriptedPolicy

    # Ray's files under the harness's temp root: the run's TMPDIR is for lmcollect's (and too long for Ray's sockets)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=os.environ[RAY_TEMP_DIR_ENV])
    make_env = functools.partial(
        ChatEnv, rows, task=task, batch_size=2 * GROUP_SIZE, repeats=GROUP_SIZE, max_turns=5, seed=0
    )
    collector = RayLLMCollector(
        make_env,
        policy_factory=functools.partial(ScriptedPolicy, player),
        dialog_turns_per_batch=TURNS_PER_BATCH,
        track_policy_version=True,
        num_cpus=0.25,
        call_timeout_s=CALL_TIMEOUT_S,
    )
    collector.worker_idx = 0
    buffer = RayReplayBuffer(capacity=10_000, seed=0, remote_config={"num_cpus": 0.25}, call_timeout_s=CALL_TIMEOUT_S)
    return collector, buffer


def actor_pids(collector: Any, buffer: Any) -> dict[str, int]:
    """The collector's and the buffer's actor processes (what the harness kills in the ray scenario)."""
    import ray

    buffer_pid = ray.get(buffer._actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
    return {"collector": int(collector.process_info()["pid"]), "buffer": int(buffer_pid)}


def turn_record(turn: Any) -> dict[str, Any]:
    """What the harness compares of one turn: its ids, its prompt draw, and the response's tokens,
    log-probs (rounded to 1e-4: another process may split a matmul's sums differently) and versions."""
    from lmcollect.envs import PROMPT_ID

    def ints(key: Any) -> list[int]:
        return [int(x) for x in turn[key].reshape(-1).tolist()]

    return {
        "traj": int(turn[keys.TRAJ_IDS]),
        "step": int(turn[keys.STEP_COUNT]),
        "group": int(turn[keys.GROUP_ID]),
        "prompt": int(turn[PROMPT_ID]),
        "env": int(turn[keys.ENV_INDEX]),
        "done": bool(turn[keys.NEXT_DONE].reshape(-1)[0]),
        "tokens": ints(keys.TOKENS_RESPONSE),
        "log_probs": [round(float(x), 4) for x in turn[keys.LOG_PROBS_RESPONSE].reshape(-1).tolist()],
        "versions": ints(keys.TOKEN_VERSIONS),
        "policy_version": int(turn[keys.POLICY_VERSION]),
    }


class Log:
    """``log.jsonl``, appended one whole line per ``os.write`` (a kill tears at most the last line)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, **event: Any) -> None:
        os.write(self._fd, (json.dumps({**event, "t": time.time()}) + "\n").encode())


class _KillingBuffer:
    """The replay buffer as ``save_checkpoint`` sees it, killing this process when asked for its state
    (the collector's file is written by then: a torn save)."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self._buffer = buffer

    def state_dict(self) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL")


class _KillingCollector:
    def __init__(self, collector: Any) -> None:
        self._collector = collector

    def state_dict(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL")


def save(folder: Path, collector: Any, buffer: ReplayBuffer, kill: dict[str, Any] | None) -> None:
    """``save_checkpoint``, with the planned kill inside it if ``kill`` says so."""
    collectors: list[Any] = [collector]
    replay_buffer: Any = buffer
    if kill is not None and kill["point"] == "collector":
        collectors = [_KillingCollector(collector)]
    elif kill is not None and kill["point"] == "buffer":
        replay_buffer = _KillingBuffer(buffer)
    elif kill is not None:
        timer = threading.Timer(kill["delay_s"], os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    save_checkpoint(folder, collectors, replay_buffer=replay_buffer)


def restore(config: dict[str, Any], collector: Any, buffer: ReplayBuffer, base: Any, log: Log) -> int:
    """Load the checkpoint if there is one (the documented recipe); the batch to continue at."""
    folder = Path(config["workdir"]) / "ckpt"
    start = time.monotonic()
    pids = actor_pids(collector, buffer) if config["scenario"] == "ray" else {}
    if config["scenario"] == "vllm":
        pids = engine_pids()
    bound = ERROR_BOUNDS_S.get(config["scenario"])
    if not (folder / MANIFEST).exists():
        log.write(event="start", batch=0, restored=False, restore_s=0.0, weights_ok=True, pids=pids, error_bound_s=bound)
        return 0
    load_checkpoint(folder, [collector], replay_buffer=buffer)
    batch = int(collector.policy_version)
    expected = trainer_weights(config["scenario"], batch, base)
    held = held_weights(config["scenario"], collector)
    weights_ok = all(torch.equal(held[name], tensor.to(held[name].dtype)) for name, tensor in expected.items())
    restore_s = time.monotonic() - start
    log.write(
        event="start", batch=batch, restored=True, restore_s=restore_s, weights_ok=weights_ok, pids=pids, error_bound_s=bound
    )
    return batch


def _sampling_counts(collector: Any) -> dict[str, Any] | None:
    """Dynamic sampling's counts so far (groups kept, dropped by reason), or None without it."""
    counts = getattr(collector, "sampling_counts", None)
    if counts is None:
        return None
    return {"kept": int(counts.groups_kept), "dropped": dict(sorted(counts.groups_dropped.items()))}


def kill_inside_push(collector: Any, kill: dict[str, Any]) -> None:
    """SIGKILL this process inside this run's ``kill["nth"]`` push, in the collector's weight loader (every
    push goes through it: full, delta, adapter): as the load begins (``"before"``: nothing loaded) or once
    it has loaded (``"after"``: the engine holds the new weights and version, the trainer never heard
    back). Either way the push is not acknowledged: a restore must give the checkpoint's version's weights.
    The ray scenario's loader is in its actor: not hooked (no ``push:mid`` kill is planned there)."""
    if not hasattr(collector, "weight_loader"):
        raise ValueError("push:mid kills need an in-process collector (its weight_loader); the ray one has none.")
    loader = collector.weight_loader
    load, pushes = loader.load, [0]

    def killing_load(*args: Any, **kwargs: Any) -> Any:
        pushes[0] += 1
        if pushes[0] == kill["nth"] and kill["point"] == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = load(*args, **kwargs)
        if pushes[0] == kill["nth"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    loader.load = killing_load


def held_weights(scenario: str, collector: Any) -> dict[str, torch.Tensor]:
    """The weights the collector's engine or model holds now."""
    if scenario == "continuous":
        return collector.engine.model.state_dict()
    if scenario in ("lockstep", "lockstep-ds"):
        return collector.policy.engine.model.state_dict()
    if scenario == "ray":
        return collector.state_dict()["policy_state_dict"]
    if scenario == "vllm":  # the worker's base (a delta applies to it; no adapter here)
        held = collector.policy.engine.checkpoint_weights()
        if held is None:
            raise RuntimeError("the vLLM engine holds the weights it was built with after a restore; expected a push.")
        return held[0]
    return collector.get_policy_model().state_dict()


def run(config: dict[str, Any]) -> None:
    workdir = Path(config["workdir"])
    log = Log(workdir / "log.jsonl")
    collector, buffer, base = build(config["scenario"], config.get("model_dir"))
    first = restore(config, collector, buffer, base, log)
    if config.get("push_kill") is not None:
        kill_inside_push(collector, config["push_kill"])
    pusher = Pusher(config["scenario"])
    try:
        for index in range(first, config["num_batches"]):
            _one_batch(config, index, collector, buffer, base, pusher, log)
    except Exception as error:  # a killed engine process or actor: logged (when, what), then the exit
        log.write(event="error", type=type(error).__name__, message=str(error)[:300])
        raise
    log.write(event="done", batch=config["num_batches"])
    if config["scenario"] == "continuous":
        collector.shutdown()
        collector.engine.close()
    elif config["scenario"] == "ray":
        collector.shutdown()
        buffer.shutdown()
    elif config["scenario"] == "vllm":
        collector.policy.engine.close()


def _one_batch(
    config: dict[str, Any], index: int, collector: Any, buffer: Any, base: Any, pusher: Pusher, log: Log
) -> None:
    """Collect batch ``index``, write it to the buffer, sample it, push the next version, log it all, and
    checkpoint when it is time."""
    start = time.monotonic()
    batch = collector.next()
    turns = [turn_record(t) for t in flatten_turns(batch)]
    buffer.extend(batch)
    sampled = flatten_turns(buffer.sample(4))
    pusher.push(collector, index + 1, base)
    collect_s = time.monotonic() - start
    sample = [[int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])] for t in sampled]
    counts = _sampling_counts(collector)
    push = pusher.kinds[-1]
    log.write(event="batch", batch=index, turns=turns, sample=sample, collect_s=collect_s, push=push, counts=counts)
    if (index + 1) % config["ckpt_every"] == 0:
        _checkpoint(config, index + 1, collector, buffer, log)


def _checkpoint(config: dict[str, Any], batch: int, collector: Any, buffer: ReplayBuffer, log: Log) -> None:
    config["saves"] = config.get("saves", 0) + 1  # this run's saves so far
    kill = config.get("save_kill")
    kill = kill if kill is not None and kill["nth"] == config["saves"] else None
    start = time.monotonic()
    if config["scenario"] == "continuous":
        with collector.pause():
            save(Path(config["workdir"]) / "ckpt", collector, buffer, kill)
    else:
        save(Path(config["workdir"]) / "ckpt", collector, buffer, kill)
    log.write(event="ckpt", batch=batch, save_s=time.monotonic() - start)


def run_child(config_path: str) -> None:
    """In a forked child: a session of its own, stderr to the run's file, TMPDIR the run's; run; exit."""
    code = 1
    try:
        os.setsid()
        config = json.loads(Path(config_path).read_text())
        stderr = os.open(Path(config["workdir"]) / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(stderr, 2)
        os.environ.setdefault(RAY_TEMP_DIR_ENV, os.path.join(tempfile.gettempdir(), "ray"))  # the harness's root
        os.environ["TMPDIR"] = str(Path(config["workdir"]) / "tmp")
        tempfile.tempdir = None
        run(config)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def serve() -> None:
    """A fork server: import everything once, then for each config path read on stdin fork a child that
    runs it (a new process holding nothing of the earlier runs but the imported modules: what it
    knows of them comes from the checkpoint), print ``{"pid": ...}``, wait for it, print its exit."""
    import lmcollect.collectors  # imported once, before the forks
    import lmcollect.envs
    import lmcollect.policies
    import lmcollect.testing

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            run_child(line.strip())
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        run(json.loads(Path(sys.argv[1]).read_text()))
