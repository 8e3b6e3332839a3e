"""Environment adapters: turns/s through each adapter vs the same dialogs as a native lmcollect task.

Run: python benchmarks/environments.py [--quick] [--reps 5] [--batches 4] [--adapters skyrl-gym,openenv,verifiers] [--token-delay-s 0.002]
(``python``: the project's virtual environment; the openenv and verifiers rows need ``.venv-envs``,
``make test-envs``: they are skipped, and say so, where their package is missing.)

Each row runs one workload two ways on the same engine, a ``ScriptedEngine`` that answers at once
(so the time is the collector's and the environment's: an adapter's overhead in its worst case; a
real model's generation time would dilute it), under ``ContinuousLLMCollector`` with GRPO groups of 2:

- ``skyrl-gym``: skyrl-gym's own ``gsm8k_multi_turn`` (a wrong answer, its hint, the right answer)
  vs a native ``Task`` writing the same messages and rewards;
- ``openenv``: an in-process OpenEnv ``Environment`` (a number to guess, "higher"/"lower" hints,
  tests/with_envs/openenv_envs.py) vs a native task with the same hints;
- ``verifiers``: a verifiers ``MultiTurnEnv`` with the same game (tests/with_envs/vf_envs.py), its
  rollout run against the collector's endpoint (``AgentEnv``; in-process, or HTTP on loopback with
  ``--verifiers-transport http``) vs the native task.

Modes alternate within each repetition (adapter, native, adapter, ...); each sample builds its
env and collector, collects one warm-up batch, then times ``--batches`` batches of 32 turns. The
metric is the median turns/s and the adapter/native ratio (issue 51's target: >= 0.9). Prints a
table; the last line is JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the adapters' test environments live in tests/
    sys.path.insert(0, str(ROOT))

from lmcollect.collectors import ContinuousLLMCollector  # noqa: E402
from lmcollect.data import History  # noqa: E402
from lmcollect.data.turns import flatten_turns  # noqa: E402
from lmcollect.envs import ChatEnv, make_env  # noqa: E402
from lmcollect.envs.tasks.base import TaskReply  # noqa: E402
from lmcollect.policies import SamplingConfig  # noqa: E402
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script  # noqa: E402

TURNS_PER_BATCH = 32
BATCH_SIZE, REPEATS = 8, 2
SAMPLING = SamplingConfig(max_new_tokens=32)
TRANSPORT = "in_process"
"""The verifiers row's AgentEnv transport (``--verifiers-transport``): in-process, or ``http`` on loopback."""
TOKEN_DELAY_S = 0.0
"""The engine's pause per decoding step (``--token-delay-s``): 0 answers at once (the adapters' worst
case); a few milliseconds paces it like a small model's decoding, with the same replies."""
NEEDS = {"skyrl-gym": "skyrl_gym", "openenv": "openenv", "verifiers": "verifiers"}
_HINT = "Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end in the exact format: '#### ANSWER'."


# ---------------------------------------------------------------- skyrl-gym and its native twin
def gsm8k_rows(num_rows: int = 64) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {k} + {k + 1}? End with '#### ANSWER'."}],
            "reward_spec": {"method": "rule", "ground_truth": str(2 * k + 1)},
            "extra_info": {"max_turns": 3},
        }
        for k in range(num_rows)
    ]


def gsm8k_player(history: History) -> str:
    a, b = (int(x) for x in re.findall(r"\d+", history.messages[0].content)[:2])
    return f"So #### {a + b}" if any(m.role == "assistant" for m in history.messages) else "Maybe #### -1"


class NativeGsm8kTask:
    """What skyrl-gym's gsm8k_multi_turn does to these dialogs, as an lmcollect task."""

    def start(self, sample: dict[str, Any], rng: Any) -> str:
        return str(sample["reward_spec"]["ground_truth"])

    def respond(self, answer: str, history: History) -> TaskReply:
        found = re.search(r"#### (\-?[0-9\.\,]+)", history.messages[-1].content)
        if found is not None and found.group(1) == answer:
            return TaskReply(reward=1.0, done=True)
        return TaskReply(reward=0.2 / 3 if found else 0.0, done=False, messages=[("user", _HINT)])


def skyrl_pair() -> tuple[Callable[[], Any], Callable[[], Any], Callable[[History], str]]:
    rows = gsm8k_rows()
    adapter = lambda: make_env("skyrl-gym:gsm8k_multi_turn", rows=rows, batch_size=BATCH_SIZE, repeats=REPEATS, max_turns=3)  # noqa: E731
    native = lambda: ChatEnv(rows, task=NativeGsm8kTask(), batch_size=BATCH_SIZE, repeats=REPEATS, max_turns=3)  # noqa: E731
    return adapter, native, gsm8k_player


# ---------------------------------------------------------------- the guessing game (OpenEnv, verifiers)
class NativeGuessTask:
    """The number game of the OpenEnv and verifiers rows as an lmcollect task (hints "higher"/"lower")."""

    def __init__(self, secret_of: Callable[[dict[str, Any], Any], int], opening: str | None = None) -> None:
        self.secret_of, self.opening = secret_of, opening

    def start(self, sample: dict[str, Any], rng: Any) -> int:
        return self.secret_of(sample, rng)

    def opening_prompt(self, secret: int, sample: dict[str, Any]) -> str:
        return self.opening or sample["prompt"]

    def respond(self, secret: int, history: History) -> TaskReply:
        found = re.findall(r"-?\d+", history.messages[-1].content)
        guess = int(found[-1]) if found else -1
        if guess == secret:
            return TaskReply(reward=1.0, done=True)
        return TaskReply(reward=0.0, done=False, messages=[("user", "higher" if guess < secret else "lower")])


def _openenv_secret(sample: dict[str, Any], rng: Any) -> int:
    import random

    return random.Random(rng.getrandbits(31)).randrange(10)  # what OpenEnvTask seeds reset with, and the env draws


def openenv_pair() -> tuple[Callable[[], Any], Callable[[], Any], Callable[[History], str]]:
    from lmcollect.compat.openenv import openenv_env
    from tests.with_envs.openenv_envs import GuessEnvironment, bisecting_guesser, guess_action, hint_text

    opening = "Guess my number from 0 to 9. Write only the number."
    rows = [{"prompt": "", "episode": k} for k in range(64)]
    adapter = lambda: openenv_env(GuessEnvironment, action_of=guess_action, text_of=hint_text, rows=rows, batch_size=BATCH_SIZE, repeats=REPEATS, max_turns=5)  # noqa: E731
    native = lambda: ChatEnv(rows, task=NativeGuessTask(_openenv_secret, opening), batch_size=BATCH_SIZE, repeats=REPEATS, max_turns=5)  # noqa: E731
    return adapter, native, bisecting_guesser


def verifiers_pair() -> tuple[Callable[[], Any], Callable[[], Any], Callable[[History], str]]:
    from lmcollect.compat.verifiers import verifiers_env
    from tests.with_envs.vf_envs import bisecting_player, load_environment

    vf_env = load_environment("guess", 64)
    rows = [dict(row) for row in vf_env.get_dataset()]
    native_rows = [{"prompt": row["prompt"][-1]["content"], "answer": row["answer"]} for row in rows]
    adapter = lambda: verifiers_env(vf_env, rows=rows, batch_size=BATCH_SIZE, repeats=REPEATS, seed=0, transport=TRANSPORT)  # noqa: E731
    native = lambda: ChatEnv(native_rows, task=NativeGuessTask(lambda s, _: int(s["answer"])), batch_size=BATCH_SIZE, repeats=REPEATS, max_turns=5)  # noqa: E731
    return adapter, native, bisecting_player


PAIRS = {"skyrl-gym": skyrl_pair, "openenv": openenv_pair, "verifiers": verifiers_pair}


# ---------------------------------------------------------------- measuring
def turns_per_s(make_env_: Callable[[], Any], player: Callable[[History], str], num_batches: int) -> float:
    engine = ScriptedEngine(script=chat_script(player), token_delay_s=TOKEN_DELAY_S)
    collector = ContinuousLLMCollector([make_env_()], engine=engine, tokenizer=ByteTokenizer(), sampling=SAMPLING, dialog_turns_per_batch=TURNS_PER_BATCH)
    with collector:
        collector.next()  # warm-up: threads, the endpoint, first sessions
        start, num_turns = time.perf_counter(), 0
        for _ in range(num_batches):
            num_turns += len(flatten_turns(collector.next()))
        return num_turns / (time.perf_counter() - start)


def measure(adapter: str, reps: int, num_batches: int) -> dict[str, Any]:
    make_adapter, make_native, player = PAIRS[adapter]()
    samples: dict[str, list[float]] = {"adapter": [], "native": []}
    for _ in range(reps):
        for mode, make in (("adapter", make_adapter), ("native", make_native)):
            samples[mode].append(turns_per_s(make, player, num_batches))
    adapter_tps, native_tps = statistics.median(samples["adapter"]), statistics.median(samples["native"])
    return {"adapter": adapter, "adapter_turns_per_s": adapter_tps, "native_turns_per_s": native_tps,
            "ratio": adapter_tps / native_tps, "samples": samples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition of 1 batch per mode: shows it works, measures nothing")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (each: adapter then native)")
    parser.add_argument("--batches", type=int, default=4, help="timed batches of 32 turns per sample")
    parser.add_argument("--adapters", default="skyrl-gym,openenv,verifiers", help="comma-separated: " + ", ".join(PAIRS))
    parser.add_argument("--verifiers-transport", choices=("in_process", "http"), default="in_process", help="the verifiers row's AgentEnv transport")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="engine pause per decoding step (0: answers at once)")
    args = parser.parse_args(argv)
    global TRANSPORT, TOKEN_DELAY_S
    TRANSPORT, TOKEN_DELAY_S = args.verifiers_transport, args.token_delay_s
    reps, num_batches = (1, 1) if args.quick else (args.reps, args.batches)
    rows, skipped = [], {}
    for adapter in args.adapters.split(","):
        if adapter not in PAIRS:
            raise SystemExit(f"--adapters: unknown {adapter!r}; use some of {', '.join(PAIRS)}")
        if importlib.util.find_spec(NEEDS[adapter]) is None:
            skipped[adapter] = f"{NEEDS[adapter]} not installed (pip install 'lmcollect[{adapter}]'; openenv/verifiers: .venv-envs)"
            continue
        rows.append(measure(adapter, reps, num_batches))
    print(f"{'adapter':<10} {'adapter turns/s':>16} {'native turns/s':>15} {'ratio':>7}  (median of {reps}, ScriptedEngine, {TOKEN_DELAY_S * 1e3:g} ms per step)")
    for row in rows:
        print(f"{row['adapter']:<10} {row['adapter_turns_per_s']:>16.1f} {row['native_turns_per_s']:>15.1f} {row['ratio']:>7.2f}")
    for adapter, why in skipped.items():
        print(f"{adapter:<10} skipped: {why}")
    result = {"benchmark": "environments", "quick": args.quick, "token_delay_s": TOKEN_DELAY_S, "reps": reps, "batches": num_batches, "rows": rows, "skipped": skipped}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
