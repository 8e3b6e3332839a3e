"""Chaos: SIGKILL a collection run at random moments (from a seed), resume it from its checkpoint, and check
that the interrupted run yields exactly what the uninterrupted one does.

Run: ``python benchmarks/chaos.py --kills 200`` (the long form) or ``--quick`` (>= 20 kills, the
suite's short form: tests/faults/test_chaos_short.py). Prints a table and ends with one JSON line.

Each episode runs one scenario of :mod:`benchmarks.chaos_driver` (``lockstep``: ``LLMCollector``
over the scripted engine; ``lockstep-ds``: the same with dynamic sampling, ``drop_uniform_rewards``;
``continuous``: ``ContinuousLLMCollector`` over the scripted engine; ``tiny``, ``tiny-delta``,
``tiny-lora``: the lockstep collector over the tiny HF model sampling at temperature 1, with full,
delta or LoRA adapter pushes; ``ray``: ``RayLLMCollector`` and ``RayReplayBuffer`` on a local Ray
cluster; the tiny and ray ones in the long form only) as a child process in its own session, with
GRPO groups, a replay buffer, a push per batch and a checkpoint every ``ckpt_every`` batches. The harness kills it as planned (``driver``: SIGKILL after a random delay
once it has restored; ``restore``: SIGKILL while it starts and loads the checkpoint; ``save:*``:
the driver kills itself inside ``save_checkpoint``; ``push:mid``: it kills itself inside a push,
in the collector's weight loader as the load begins or once it loaded, unacknowledged; ``actor:*``: SIGKILL of the ray scenario's
collector or buffer actor, after which the driver must fail within its call timeout), restarts it
the way docs/checkpoints.md says (build the same setup, ``load_checkpoint``), and goes on until the
planned batches are done.

Checks after every episode: the batches kept (each run's batches up to where the next run resumed)
are exactly batches 0..N-1, once each; lockstep, tiny and ray runs equal the uninterrupted reference
turn for turn (ids, prompt draws, tokens, log-probs, versions) and in the buffer's samples; continuous
runs (whose turn order depends on timing) yield each (group, dialog, step) at most once, whole groups
only, group ids without a gap but the last two (groups still under way at the end), tokens equal to
the reference's for the same prompt draw and step, and each token's log-prob that of its recorded
version's weights; weights after
each restore equal the trainer's last push; nothing is left behind (processes of the run's session,
``/dev/shm/lmcollect-*`` files, files in the run's TMPDIR, stray files in the checkpoint folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
_LAUNCHED: list[subprocess.Popen[bytes] | ServedChild] = []
"""Every driver process started (ended by :func:`end_runs` if still running when the harness stops)."""
SAVE_POINTS = ("collector", "buffer", "delay")
PUSH_POINTS = ("before", "after")
"""Where a ``push:mid`` kill lands in the engine's load: as it begins, or once it has loaded (not acknowledged)."""
TINY = ("tiny", "tiny-delta", "tiny-lora")
"""The tiny model's scenarios: full pushes, delta pushes, LoRA adapter pushes."""
SCENARIOS = ("lockstep", "lockstep-ds", "continuous", *TINY, "ray", "vllm")
"""``lockstep-ds``: lockstep with dynamic sampling (``drop_uniform_rewards``; a seeded scripted player whose
groups are some mixed, some uniform)."""
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Ray's processes that outlive a SIGKILLed driver that started a local cluster (Ray 2.60): Ray's
leftovers, not lmcollect's, so counted apart (and ended by the harness)."""


@dataclass(kw_only=True)
class ChaosConfig:
    kills: int = 200
    """Kills to plan in all (a planned kill that lands after the run ended is reported as missed)."""
    seed: int = 0
    """Seeds the plan: scenarios, kill kinds and moments."""
    num_batches: int = 12
    """Batches each episode collects to the end."""
    ckpt_every: int = 2
    """A checkpoint every this many batches (the interval the overhead is reported at)."""
    kills_per_episode: int = 4
    """Kills planned in one episode before it is let run to the end."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Scenarios drawn for the episodes (the ``tiny*`` ones need the tiny model: built locally, no download)."""
    tiny_share: float = 0.1
    """The share of episodes on the tiny model, its three push kinds alike (each of its restarts loads
    the model: ~10 s here)."""
    ray_share: float = 0.1
    """The share of episodes through Ray actors (each restart starts a local Ray cluster: ~30 s here)."""
    vllm_share: float = 0.06
    """The share of episodes on the tiny model in a multiprocess vLLM engine (each restart starts vLLM's
    engine core and worker processes: ~30 s here)."""
    run_timeout_s: float = 120.0
    """Bound of one driver process (a run that exceeds it is killed and reported)."""
    fork_server: bool = False
    """Fork each run from a process that imported torch and lmcollect once (the short form: restarts
    cost a fork, not an import); False: a fresh interpreter per run (recovery times as a user's)."""

    def __post_init__(self) -> None:
        if self.kills < 1 or self.kills_per_episode < 1:
            raise ValueError(f"kills and kills_per_episode must be >= 1, got {self.kills}, {self.kills_per_episode}.")
        if self.num_batches < 2 * self.ckpt_every:
            raise ValueError(f"num_batches={self.num_batches} must hold two checkpoints; use >= {2 * self.ckpt_every}.")
        unknown = set(self.scenarios) - set(SCENARIOS)
        if unknown:
            raise ValueError(f"unknown scenarios {sorted(unknown)}; use {', '.join(SCENARIOS)}.")


@dataclass
class Report:
    kills: list[dict[str, Any]] = field(default_factory=list)
    missed: int = 0
    lost: int = 0
    duplicated: int = 0
    token_diffs: int = 0
    weight_mismatches: int = 0
    leftovers: list[str] = field(default_factory=list)
    ray_agents_left: int = 0
    """Ray's agent processes a SIGKILLed ray-scenario driver left (see :data:`RAY_AGENTS`)."""
    vllm_file_stores_left: int = 0
    """vLLM's file-store files SIGKILLed engine cores left (see :data:`VLLM_FILE_STORES`)."""
    problems: list[str] = field(default_factory=list)
    pushes: Counter[str] = field(default_factory=Counter)
    """The kept batches' pushes by kind (full, delta, lora): what the weights checks covered."""
    overhead: dict[str, float] = field(default_factory=dict)
    """Per scenario: the reference run's checkpoint time / collection time."""
    episodes: int = 0
    scenarios: Counter[str] = field(default_factory=Counter)
    """Episodes by scenario."""


# ---------------------------------------------------------------------- the plan
def plan_episodes(config: ChaosConfig) -> Iterator[dict[str, Any]]:
    """Episodes (scenario and kills) drawn from ``config.seed``, for as long as the caller asks (a
    planned kill can land after its run ended: the harness asks for episodes until ``kills`` landed)."""
    rng = random.Random(config.seed)
    while True:
        yield {
            "scenario": (scenario := _plan_scenario(rng, config)),
            "kills": [_plan_kill(rng, scenario) for _ in range(config.kills_per_episode)],
        }


def _plan_scenario(rng: random.Random, config: ChaosConfig) -> str:
    """``tiny``, ``ray`` and ``vllm`` in their shares of the episodes (each restart costs them ~10 s, ~30 s
    and ~30 s here), the others alike in the rest."""
    roll = rng.random()
    shared = (
        ([s for s in config.scenarios if s in TINY], config.tiny_share),
        (["ray"] if "ray" in config.scenarios else [], config.ray_share),
        (["vllm"] if "vllm" in config.scenarios else [], config.vllm_share),
    )
    for names, share in shared:
        if names:
            if roll < share:
                return rng.choice(names)
            roll -= share
    others = [s for s in config.scenarios if s not in (*TINY, "ray", "vllm")]
    return rng.choice(others) if others else rng.choice(config.scenarios)


def _plan_kill(rng: random.Random, scenario: str) -> dict[str, Any]:
    roll = rng.random()
    if scenario == "vllm" and roll < 0.5:  # the vllm scenario's own kinds: its engine's two processes
        return {"kind": rng.choice(["engine:core", "engine:worker"]), "fraction": rng.random()}
    if scenario == "vllm":  # the other half: the kinds of every scenario, in their usual shares
        roll = (roll - 0.5) * 2
    if scenario == "ray" and roll < 0.7:  # the ray scenario's own kinds: its two actors
        return {"kind": rng.choice(["actor:collector", "actor:buffer"]), "fraction": rng.random()}
    if scenario == "ray":  # (a SIGKILLed driver leaves Ray's own agents behind: not drawn here)
        roll = 0.6 + rng.random() * 0.4
    if roll < 0.45:
        return {"kind": "driver", "fraction": rng.random()}
    if roll < 0.55 and scenario != "ray":  # the ray scenario's engine is in its actor: not hooked
        return {"kind": "push:mid", "point": rng.choice(PUSH_POINTS), "nth": rng.randint(1, 3)}
    if roll < 0.65:
        return {"kind": "restore", "fraction": rng.random()}
    point = rng.choice(SAVE_POINTS)
    return {"kind": f"save:{point}", "point": point, "nth": rng.randint(1, 2), "fraction": rng.random()}


# ---------------------------------------------------------------------- one driver process
class ForkServer:
    """``chaos_driver --serve``: each run is a fork of one process that imported torch and lmcollect once."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.chaos_driver", "--serve"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="chaos-fork-server").start()
        self.next_message(timeout_s)  # {"ready": true}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.messages.put(json.loads(line))

    def next_message(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the chaos fork server said nothing within {timeout_s} s") from None

    def fork(self, config_path: Path) -> ServedChild:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{config_path}\n")
        self.proc.stdin.flush()
        return ServedChild(self, self.next_message(30.0)["pid"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still waiting on a child: end_runs() ended it, or will
            self.proc.kill()
            self.proc.wait(timeout=30)


class ServedChild:
    """A forked run, with the few ``Popen`` methods the harness uses (its exit comes from the server)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self.server.messages.empty():
            self.returncode = self.server.next_message(1.0)["returncode"]
        return self.returncode

    def wait(self, timeout: float) -> int:
        if self.returncode is None:
            try:
                self.returncode = self.server.next_message(timeout)["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired("chaos_driver (forked)", timeout) from None
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


class Run:
    """One driver process in its own session (so its leftovers can be found), logging to ``workdir``:
    a fresh interpreter, or a fork of ``server``."""

    def __init__(self, workdir: Path, config: dict[str, Any], timeout_s: float, server: ForkServer | None) -> None:
        (workdir / "config.json").write_text(json.dumps(config))
        (workdir / "tmp").mkdir(exist_ok=True)
        self.launched = time.monotonic()
        self.deadline = self.launched + timeout_s
        self.proc: subprocess.Popen[bytes] | ServedChild
        if server is not None:
            self.proc = server.fork(workdir / "config.json")
        else:
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(workdir / "tmp"),
                   "LMCOLLECT_CHAOS_RAY_TEMP_DIR": os.path.join(tempfile.gettempdir(), "ray")}  # the driver's RAY_TEMP_DIR_ENV
            with (workdir / "stderr.txt").open("ab") as stderr:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.chaos_driver", str(workdir / "config.json")],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,
                )
        with (workdir / "sessions.txt").open("a") as out:  # the session id is the leader's pid
            out.write(f"{self.proc.pid}\n")
        _LAUNCHED.append(self.proc)

    def kill(self) -> float:
        os.kill(self.proc.pid, signal.SIGKILL)
        return time.monotonic()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            return -999


def read_log(path: Path) -> list[dict[str, Any]]:
    """The driver's events (a last line torn by a kill is dropped)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def wait_for_start(log: Path, run: Run, num_starts: int) -> bool:
    """Wait (bounded by the run's deadline) for the run's ``start`` event; False if it exited first."""
    while time.monotonic() < run.deadline:
        if sum(e["event"] == "start" for e in read_log(log)) > num_starts:
            return True
        if run.proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


# ---------------------------------------------------------------------- one episode
def run_reference(
    root: Path, scenario: str, config: ChaosConfig, model_dir: str | None, server: ForkServer | None
) -> list[dict[str, Any]]:
    """The uninterrupted run of ``scenario``: its events are what every interrupted run must yield."""
    workdir = root / f"reference-{scenario}"
    workdir.mkdir()
    run = Run(workdir, _driver_config(workdir, scenario, config, model_dir), config.run_timeout_s, server)
    rc = run.wait()
    events = read_log(workdir / "log.jsonl")
    if rc != 0 or events[-1]["event"] != "done":
        raise RuntimeError(f"the reference run of {scenario} failed (exit {rc}): {_tail(workdir)}")
    return events


def _driver_config(
    workdir: Path,
    scenario: str,
    config: ChaosConfig,
    model_dir: str | None,
    save_kill: dict[str, Any] | None = None,
    push_kill: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "workdir": str(workdir),
        "num_batches": config.num_batches,
        "ckpt_every": config.ckpt_every,
        "model_dir": model_dir,
        "save_kill": save_kill,
        "push_kill": push_kill,
    }


def run_episode(
    workdir: Path,
    episode: dict[str, Any],
    config: ChaosConfig,
    reference: list[dict[str, Any]],
    report: Report,
    model_dir: str | None,
    server: ForkServer | None = None,
) -> None:
    """Run the episode's planned kills, each followed by a restart, then a run to the end; check it all."""
    workdir.mkdir()
    scenario = episode["scenario"]
    episode_run = EpisodeRuns(workdir, scenario, config, model_dir, _reference_timing(reference), report, server)
    shm_before = _shm_files()
    for kill in episode["kills"]:
        if any(e["event"] == "done" for e in read_log(workdir / "log.jsonl")):
            report.missed += 1  # the episode ran to its end before this kill's turn
            continue
        episode_run.run_once(kill)
    episode_run.run_once(None)  # the run to the end (after a kill), or a restore of the finished run
    _check_episode(workdir, scenario, read_log(workdir / "log.jsonl"), reference, report, shm_before)
    report.episodes += 1
    report.scenarios[scenario] += 1


class EpisodeRuns:
    """The runs of one episode: start (resuming), kill as planned, and time each kill's recovery (from
    the kill to the next run's ``start`` event: a process start and ``load_checkpoint``)."""

    def __init__(
        self,
        workdir: Path,
        scenario: str,
        config: ChaosConfig,
        model_dir: str | None,
        timing: dict[str, float],
        report: Report,
        server: ForkServer | None,
    ) -> None:
        self.workdir, self.scenario, self.config, self.model_dir = workdir, scenario, config, model_dir
        self.server = server
        self.timing, self.report, self.log = timing, report, workdir / "log.jsonl"
        self.awaiting: list[tuple[dict[str, Any], float]] = []  # kills whose recovery is not timed yet
        self.startup_s = 0.3 if server is not None else 2.5  # launch to restored: measured on each restore

    def run_once(self, kill: dict[str, Any] | None) -> None:
        num_starts = sum(e["event"] == "start" for e in read_log(self.log))
        save_kill = None
        if kill is not None and kill["kind"].startswith("save:"):
            save_kill = {
                "nth": kill["nth"],
                "point": kill["point"],
                "delay_s": kill["fraction"] * self.timing["save_s"],
            }
        push_kill = None
        if kill is not None and kill["kind"] == "push:mid":
            push_kill = {"nth": kill["nth"], "point": kill["point"]}
        config = _driver_config(self.workdir, self.scenario, self.config, self.model_dir, save_kill, push_kill)
        run = Run(self.workdir, config, self.config.run_timeout_s, self.server)
        if kill is not None and kill["kind"] == "restore":
            time.sleep(kill["fraction"] * self.startup_s)
            if run.proc.poll() is None:
                self._killed(run, kill)
                return
        started = wait_for_start(self.log, run, num_starts)
        if started:
            self._recovered(num_starts)
            self.startup_s = time.monotonic() - run.launched
        if kill is not None and kill["kind"] == "driver" and started:
            self._kill_later(run, kill)
            return
        if kill is not None and kill["kind"].startswith(("actor:", "engine:")) and started:
            self._kill_process_later(run, kill)
            return
        self._finish(run, kill, save_kill or push_kill)

    def _kill_later(self, run: Run, kill: dict[str, Any]) -> None:
        start_batch = [e for e in read_log(self.log) if e["event"] == "start"][-1]["batch"]
        left = (self.config.num_batches - start_batch) / self.config.num_batches
        time.sleep(kill["fraction"] * left * self.timing["run_s"])
        if run.proc.poll() is None:
            self._killed(run, kill)
        else:
            self._finish(run, kill, None)

    def _kill_process_later(self, run: Run, kill: dict[str, Any]) -> None:
        """SIGKILL a process the driver depends on (``actor:*``: the collector's or the buffer's actor;
        ``engine:*``: the vLLM engine core or its worker); the driver's next call into it must fail
        within its bound (``call_timeout_s``; the engine's ``timeout_s``), and the driver exit: the time
        to that exit is kept."""
        start = [e for e in read_log(self.log) if e["event"] == "start"][-1]
        left = (self.config.num_batches - start["batch"]) / self.config.num_batches
        time.sleep(kill["fraction"] * left * self.timing["run_s"])
        if run.proc.poll() is not None or read_log(self.log)[-1]["event"] == "done":
            self._finish(run, kill, None)  # too late: the run collected its last batch
            return
        try:
            os.kill(start["pids"][kill["kind"].split(":")[1]], signal.SIGKILL)
        except ProcessLookupError:  # the driver is shutting its actors or engine down: the run is at its end
            self._finish(run, kill, None)
            return
        killed_at, killed_wall = time.monotonic(), time.time()
        rc = run.wait()
        if rc == 0:  # the kill landed after the driver's last call into that process
            self.report.missed += 1
            return
        self._note_kill(kill, killed_at)
        errors = [e for e in read_log(self.log) if e["event"] == "error" and e["t"] >= killed_wall]
        record = self.report.kills[-1]
        # the driver's error (its loop logs it), else its exit: what the user's process sees, and when
        record["time_to_error_s"] = errors[0]["t"] - killed_wall if errors else time.monotonic() - killed_at
        record["error"] = errors[0]["type"] if errors else f"exit {rc}"
        bound = start["error_bound_s"]
        if record["time_to_error_s"] > bound:
            self.report.problems.append(
                f"{self.workdir.name}: {kill['kind']} reached the driver after {record['time_to_error_s']:.1f} s, "
                f"past its bound of {bound} s"
            )
        if rc == -999:
            self.report.problems.append(f"{self.workdir.name}: the driver did not end after {kill['kind']} was killed")

    def _finish(self, run: Run, kill: dict[str, Any] | None, self_kill: dict[str, Any] | None) -> None:
        """Wait for the run's end; a kill it did itself (inside a save or a push) is noted, and where the
        next run must resume: the last complete checkpoint (unknown for a save killed after a delay)."""
        rc = run.wait()
        if rc == -signal.SIGKILL and kill is not None and self_kill is not None:
            # the last complete checkpoint: a logged save, or the one a run resumed from (a save:delay kill
            # after the manifest's replace completes a checkpoint that no "ckpt" line names)
            done = [e["batch"] for e in read_log(self.log) if e["event"] in ("ckpt", "start")]
            expect = (max(done, default=0),) if kill.get("point") != "delay" else None
            self._note_kill(kill, time.monotonic(), expect_start=expect)
            return
        if kill is not None:
            self.report.missed += 1
        if rc != 0:
            self.report.problems.append(f"{self.workdir.name}: the driver exited with {rc}: {_tail(self.workdir)}")

    def _killed(self, run: Run, kill: dict[str, Any]) -> None:
        killed_at = run.kill()
        run.wait()
        self._note_kill(kill, killed_at)

    def _note_kill(self, kill: dict[str, Any], killed_at: float, expect_start: tuple[int, ...] | None = None) -> None:
        record = {"kind": kill["kind"], "scenario": self.scenario, "expect_start": expect_start}
        self.report.kills.append(record)
        self.awaiting.append((record, killed_at))

    def _recovered(self, num_starts: int) -> None:
        """This run restored: time every kill since the last restore, and check a torn save was not loaded."""
        now = time.monotonic()
        start = [e for e in read_log(self.log) if e["event"] == "start"][num_starts]
        for record, killed_at in self.awaiting:
            record["recovery_s"], record["restore_s"] = now - killed_at, start["restore_s"]
            expected = record.pop("expect_start")
            if expected is not None and start["batch"] not in expected:
                self.report.problems.append(
                    f"{self.workdir.name}: a kill inside a save or a push ({record['kind']}) resumed at batch {start['batch']}, "
                    f"not at the last complete checkpoint's {expected}"
                )
        self.awaiting.clear()


def _reference_timing(events: list[dict[str, Any]]) -> dict[str, float]:
    saves = [e["save_s"] for e in events if e["event"] == "ckpt"]
    first, done = events[0], events[-1]
    return {
        "run_s": done["t"] - first["t"],  # start to done: batches, pushes, buffer, saves
        "save_s": statistics.median(saves),
    }


def _tail(workdir: Path) -> str:
    path = workdir / "stderr.txt"
    return path.read_text(errors="replace")[-1500:] if path.exists() else ""


# ---------------------------------------------------------------------- the checks
def kept_batches(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each run's batches up to where the next run resumed (what a trainer that restarts keeps)."""
    runs: list[list[dict[str, Any]]] = []
    starts: list[int] = []
    for event in events:
        if event["event"] == "start":
            runs.append([])
            starts.append(event["batch"])
        elif event["event"] == "batch" and runs:
            runs[-1].append(event)
    kept: list[dict[str, Any]] = []
    problems: list[str] = []
    for i, batches in enumerate(runs):
        end = starts[i + 1] if i + 1 < len(runs) else None
        kept.extend(b for b in batches if end is None or b["batch"] < end)
    indices = [b["batch"] for b in kept]
    if indices != list(range(len(indices))):
        problems.append(f"the batches kept are {indices}, not 0..{len(indices) - 1} once each")
    return kept, problems


def _check_episode(
    workdir: Path,
    scenario: str,
    events: list[dict[str, Any]],
    reference: list[dict[str, Any]],
    report: Report,
    shm_before: set[str],
) -> None:
    kept, problems = kept_batches(events)
    report.problems.extend(f"{workdir.name}: {p}" for p in problems)
    expected = [e for e in reference if e["event"] == "batch"]
    if len(kept) != len(expected):
        report.problems.append(f"{workdir.name}: {len(kept)} batches kept, the reference has {len(expected)}")
    if scenario == "continuous":
        _check_continuous(kept, expected, report, workdir.name)
    else:
        _check_exact(kept, expected, report, workdir.name)
    report.weight_mismatches += sum(1 for e in events if e["event"] == "start" and not e["weights_ok"])
    report.pushes.update(b.get("push", "full") for b in kept)
    report.leftovers.extend(_leftovers(workdir, shm_before, report))


def turn_key(turn: dict[str, Any]) -> tuple[int, int, int]:
    return turn["group"], turn["traj"], turn["step"]


def _check_exact(kept: list[dict[str, Any]], expected: list[dict[str, Any]], report: Report, name: str) -> None:
    """Lockstep: turn for turn the reference's, and the buffer's samples too."""
    got = [t for b in kept for t in b["turns"]]
    want = [t for b in expected for t in b["turns"]]
    _count_pairs(got, want, report)
    by_key = {turn_key(t): t for t in want}
    diffs = [(t, by_key[turn_key(t)]) for t in got if turn_key(t) in by_key and t != by_key[turn_key(t)]]
    report.token_diffs += len(diffs)
    if diffs:
        report.problems.append(f"{name}: {len(diffs)} turns differ from the reference's, e.g. {diffs[0]}")
    samples = [a["batch"] for a, b in zip(kept, expected, strict=False) if a["sample"] != b["sample"]]
    counts = [a["batch"] for a, b in zip(kept, expected, strict=False) if a.get("counts") != b.get("counts")]
    report.token_diffs += len(counts)
    if counts:
        report.problems.append(f"{name}: dynamic sampling's counts (kept, dropped) differ after batches {counts}")
    report.token_diffs += len(samples)
    if samples:
        report.problems.append(f"{name}: the buffer's samples differ from the reference's after batches {samples}")


def _count_pairs(got: list[dict[str, Any]], want: list[dict[str, Any]], report: Report) -> None:
    counts = Counter(turn_key(t) for t in got)
    report.duplicated += sum(n - 1 for n in counts.values() if n > 1)
    report.lost += sum(1 for t in want if turn_key(t) not in counts)


def _check_continuous(
    kept: list[dict[str, Any]], expected: list[dict[str, Any]], report: Report, name: str, group_size: int = 2
) -> None:
    """Continuous: timing decides which groups fill which batch, so: every (group, dialog, step) at most
    once, whole groups, tokens as the reference's for the same prompt draw and step, log-probs that of
    each token's version (a push of version v sets the scripted weights' tag to v: log-prob -v)."""
    got = [t for b in kept for t in b["turns"]]
    counts = Counter(turn_key(t) for t in got)
    report.duplicated += sum(n - 1 for n in counts.values() if n > 1)
    report.problems.extend(f"{name}: {p}" for p in whole_group_problems(got))

    def draw(turn: dict[str, Any]) -> tuple[int, int, int]:  # a group's slots are one env's elements
        return turn["env"] // group_size, turn["prompt"], turn["step"]

    tokens = {draw(t): t["tokens"] for b in expected for t in b["turns"]}
    for turn in got:
        want = tokens.get(draw(turn))
        wrong_log_probs = turn["log_probs"] != [-float(v) for v in turn["versions"]]
        stale = turn["policy_version"] > min(turn["versions"])
        if (want is not None and want != turn["tokens"]) or wrong_log_probs or stale:
            report.token_diffs += 1
            report.problems.append(f"{name}: turn {turn} differs (reference tokens {want})")
    report.lost += len(_missing_groups(got))


def whole_group_problems(turns: list[dict[str, Any]], group_size: int = 2) -> list[str]:
    """Every group: ``group_size`` dialogs of one prompt draw, each with steps 0..n-1 and the last done."""
    groups: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for turn in turns:
        groups.setdefault(turn["group"], {}).setdefault(turn["traj"], []).append(turn)
    problems = []
    for group, dialogs in groups.items():
        prompts = {t["prompt"] for d in dialogs.values() for t in d}
        if len(dialogs) != group_size or len(prompts) != 1:
            problems.append(f"group {group} has {len(dialogs)} dialogs over prompts {sorted(prompts)}")
        for traj, dialog in dialogs.items():
            steps = sorted(t["step"] for t in dialog)
            if steps != list(range(len(steps))) or not max(dialog, key=lambda t: t["step"])["done"]:
                problems.append(f"group {group}: dialog {traj} is split (steps {steps})")
    return problems


def _missing_groups(turns: list[dict[str, Any]]) -> list[int]:
    """Group ids below the highest one yielded that were never yielded: groups admitted and lost.
    (Groups finish out of order, so a few still under way at the end are allowed: the last slots' worth.)"""
    seen = {t["group"] for t in turns}
    if not seen:
        return []
    gaps = sorted(set(range(max(seen))) - seen)
    return gaps[:-2] if len(gaps) > 2 else []


SHM_PATTERNS = ("lmcollect-*", "psm_*")
"""Shared memory a run can leave: lmcollect's push files, and Python's ``SharedMemory`` segments (vLLM's
message queues between its engine core and its workers)."""
TMPDIR_CACHES = ("torchinductor_",)
"""What a run keeps in its TMPDIR by design: torch's compile cache."""
VLLM_FILE_STORES = "vllm_dist_"
"""vLLM's file store (``torch.distributed`` rendezvous), made and removed by its engine core in the temporary
folder: one whose core was SIGKILLed stays (2-3 KB). vLLM's leftover, not lmcollect's: counted apart."""


def _shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for pattern in SHM_PATTERNS for p in shm.glob(pattern)} if shm.is_dir() else set()


def _leftovers(workdir: Path, shm_before: set[str], report: Report) -> list[str]:
    found = [f"/dev/shm/{name}" for name in sorted(_shm_files() - shm_before)]
    in_tmpdir = [p for p in (workdir / "tmp").iterdir() if not p.name.startswith(TMPDIR_CACHES)]
    report.vllm_file_stores_left += sum(p.name.startswith(VLLM_FILE_STORES) for p in in_tmpdir)
    found += [f"{workdir.name}: {p.name} in TMPDIR" for p in in_tmpdir if not p.name.startswith(VLLM_FILE_STORES)]
    for pid in _session_processes(workdir):
        command = _command_of(pid)
        if command.startswith(RAY_AGENTS):  # Ray's, after a SIGKILLed driver: counted apart
            report.ray_agents_left += 1
        else:
            found.append(f"{workdir.name}: process {pid} ({command[:60]}) of a killed run")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a process of a run this harness started: ended once counted
    found += [f"{workdir.name}: ckpt/{name}" for name in stray_checkpoint_files(workdir / "ckpt")]
    return found


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _session_processes(workdir: Path) -> list[int]:
    """Processes still running in a session the harness started (each run is its own session, led by its
    pid); zombies are not counted (ended, holding nothing: an exit status their new parent, init, reads)."""
    path = workdir / "sessions.txt"
    sessions = {int(line) for line in path.read_text().split()} if path.exists() else set()
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions and fields[0] != "Z":  # field 6 of stat: the session id; 3: the state
            alive.append(int(stat.parent.name))
    return alive


def stray_checkpoint_files(folder: Path) -> list[str]:
    """Files in a checkpoint folder that its manifest does not name (a crashed save's remains)."""
    if not folder.is_dir():
        return []
    manifest = json.loads((folder / "manifest.json").read_text())
    buffer = manifest.get("replay_buffer") or {}
    named = {e["file"] for e in manifest["collectors"] + buffer.get("segments", [])} | (
        {buffer["file"]} if buffer else set()
    )  # the buffer: its head file and its segments (lmcollect/checkpoint_buffer.py)
    return sorted(p.name for p in folder.iterdir() if p.name not in named | {"manifest.json", ".save.lock"})


# ---------------------------------------------------------------------- the whole run and its table
def run_chaos(config: ChaosConfig, root: Path | None = None) -> dict[str, Any]:
    scenarios = sorted(set(config.scenarios))
    model_dir = _tiny_model_dir(root or Path(tempfile.gettempdir())) if {*TINY, "vllm"} & set(scenarios) else None
    report = Report()
    started = time.monotonic()
    server = ForkServer() if config.fork_server else None
    try:
        with tempfile.TemporaryDirectory(prefix="lmcollect-chaos-", dir=root) as tmp:
            references = {s: run_reference(Path(tmp), s, config, model_dir, server) for s in scenarios}
            for i, episode in enumerate(plan_episodes(config)):
                if len(report.kills) >= config.kills:
                    break
                workdir = Path(tmp) / f"episode-{i:03d}-{episode['scenario']}"
                run_episode(workdir, episode, config, references[episode["scenario"]], report, model_dir, server)
            for scenario, events in references.items():
                save_s = sum(e["save_s"] for e in events if e["event"] == "ckpt")
                report.overhead[scenario] = save_s / sum(e["collect_s"] for e in events if e["event"] == "batch")
    finally:
        end_runs()  # a harness interrupted mid-run (a test's time bound) leaves no driver behind
        if server is not None:
            server.close()
    return summarize(report, config, time.monotonic() - started)


def end_runs() -> None:
    """SIGKILL every driver this harness started that still runs (by its pid, nothing else)."""
    while _LAUNCHED:
        proc = _LAUNCHED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


def _tiny_model_dir(root: Path) -> str:
    from lmcollect.models import ModelSpec, get_model_path

    return str(get_model_path(ModelSpec(size="tiny"), cache_dir=root / "lmcollect-chaos-models"))


def summarize(report: Report, config: ChaosConfig, wall_s: float) -> dict[str, Any]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for kill in report.kills:
        by_kind.setdefault(kill["kind"], []).append(kill)
    kinds = {kind: _kind_row(kills) for kind, kills in sorted(by_kind.items())}
    return {
        "config": asdict(config),
        "kills": len(report.kills),
        "missed": report.missed,
        "episodes": report.episodes,
        "scenarios": dict(sorted(report.scenarios.items())),
        "kinds": kinds,
        "checkpoint_overhead": report.overhead,
        "lost": report.lost,
        "duplicated": report.duplicated,
        "token_diffs": report.token_diffs,
        "weight_mismatches": report.weight_mismatches,
        "pushes": dict(sorted(report.pushes.items())),
        "leftovers": report.leftovers,
        "ray_agents_left": report.ray_agents_left,
        "vllm_file_stores_left": report.vllm_file_stores_left,
        "problems": report.problems,
        "wall_s": wall_s,
    }


def _kind_row(kills: list[dict[str, Any]]) -> dict[str, Any]:
    """Kills of one kind: recovery (kill to restored) median and max; for actor kills, the longest time
    from the kill to the driver's error."""
    times = [k["recovery_s"] for k in kills if "recovery_s" in k] or [float("nan")]
    errors = [k["time_to_error_s"] for k in kills if "time_to_error_s" in k]
    return {
        "kills": len(kills),
        "recovery_median_s": statistics.median(times),
        "recovery_max_s": max(times),
        "time_to_error_max_s": max(errors) if errors else None,
        "errors": dict(Counter(k["error"] for k in kills if "error" in k)),
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        "| kill kind | kills | recovery median (s) | recovery max (s) | kill to the driver's error, max (s) | errors |",
        "|---|---|---|---|---|---|",
    ]
    for kind, row in summary["kinds"].items():
        error = "-" if row["time_to_error_max_s"] is None else f"{row['time_to_error_max_s']:.2f}"
        recovery = f"{row['recovery_median_s']:.2f} | {row['recovery_max_s']:.2f}"
        errors = ", ".join(f"{name} {n}" for name, n in row.get("errors", {}).items()) or "-"
        lines.append(f"| {kind} | {row['kills']} | {recovery} | {error} | {errors} |")
    overhead = ", ".join(f"{name} {share:.1%}" for name, share in summary["checkpoint_overhead"].items())
    lines += [
        "",
        f"kills {summary['kills']} (planned kills that landed after the run ended: {summary['missed']}), "
        f"episodes {summary['episodes']} ("
        + ", ".join(f"{name} {n}" for name, n in summary["scenarios"].items())
        + f"), wall {summary['wall_s']:.0f} s",
        f"checkpoint overhead (save time / collection time, a checkpoint every "
        f"{summary['config']['ckpt_every']} batches): {overhead}",
        f"pairs lost {summary['lost']}, duplicated {summary['duplicated']}, token diffs {summary['token_diffs']}, "
        f"weights wrong after a restore {summary['weight_mismatches']}, leftovers {len(summary['leftovers'])}",
        "pushes kept, by kind: " + ", ".join(f"{kind} {n}" for kind, n in summary["pushes"].items()),
    ]
    if summary["ray_agents_left"]:
        lines.append(
            f"Ray's agents left by SIGKILLed drivers (Ray's, ended by the harness): {summary['ray_agents_left']}"
        )
    if summary.get("vllm_file_stores_left"):
        lines.append(f"vLLM's file stores left by SIGKILLed engine cores (vLLM's): {summary['vllm_file_stores_left']}")
    lines += [f"problem: {p}" for p in summary["problems"]] + [f"leftover: {x}" for x in summary["leftovers"]]
    return "\n".join(lines)


def quick_config(seed: int = 0) -> ChaosConfig:
    """The suite's short form: >= 20 kills on the scripted engine, under two minutes."""
    return ChaosConfig(
        kills=20,
        seed=seed,
        num_batches=8,
        ckpt_every=2,
        kills_per_episode=5,
        scenarios=("lockstep", "lockstep-ds", "continuous"),
        fork_server=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the short form: 20 kills, scripted engine only")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)} (long form)"
    )
    args = parser.parse_args(argv)
    scenarios = tuple(name.strip() for name in args.scenarios.split(",") if name.strip())
    config = quick_config(args.seed) if args.quick else ChaosConfig(kills=args.kills, seed=args.seed, scenarios=scenarios)
    summary = run_chaos(config)
    print(format_table(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
