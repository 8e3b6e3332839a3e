"""Start-up: VLLMPolicy vs the bare vLLM engine with the same settings, each in a fresh process.

Run: python benchmarks/startup.py [--reps 3] [--size small]
(``python``: the project's virtual environment, e.g. ``<venv>/bin/python``.)

Each sample is a new Python process that times, from before its first vLLM or lmcollect import to
an engine ready to generate: ``raw`` imports vllm and builds ``vllm.LLM(model=...)`` with the
settings VLLMPolicy would pass (same dtype, log-prob mode, KV cache, eager mode, in-process
engine core); ``policy`` imports lmcollect and builds ``VLLMPolicy(path, engine_kwargs=...)``
(worker extension, tokenizer, stop ids, engine thread). The two alternate; medians. Prints a
table; the last line is JSON. Skipped without vLLM.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

TARGET = 1.3  # VLLMPolicy start-up / bare engine start-up
ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}

_SAMPLE = r"""
import json, sys, time
start = time.perf_counter()
mode, path, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if mode == "raw":
    import vllm
    vllm.LLM(model=path, dtype="float32", logprobs_mode="raw_logprobs", **kwargs)
else:
    from lmcollect.policies.vllm_policy import VLLMPolicy
    VLLMPolicy(path, engine_kwargs=kwargs)
print("STARTUP_S", time.perf_counter() - start)
"""


def sample(mode: str, path: str) -> float:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _SAMPLE, mode, path, json.dumps(ENGINE_KWARGS)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("STARTUP_S ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} start-up sample failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return float(lines[-1].split()[1])


def run(*, quick: bool = False, reps: int = 3, size: str = "small") -> list[dict]:
    """The start-up row (``lmcollect bench`` calls this); [] without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not installed: skipping the start-up row")
        return []
    from lmcollect.models import ModelSpec, get_model_path

    path = str(get_model_path(ModelSpec(size=size)))
    reps = 2 if quick else reps
    sample("raw", path)  # warm-up: the first process after install compiles and caches bytecode
    raw_s, policy_s = [], []
    for _ in range(reps):
        raw_s.append(sample("raw", path))
        policy_s.append(sample("policy", path))
    ratio = statistics.median(policy_s) / statistics.median(raw_s)
    return [{
        "row": f"VLLMPolicy start-up, {size} model",
        "metric": "s, vs bare vllm.LLM start-up (same settings, fresh processes)",
        "value": round(ratio, 3),
        "target": f"<= {TARGET}",
        "met": ratio <= TARGET,
        "policy_s": round(statistics.median(policy_s), 2),
        "raw_s": round(statistics.median(raw_s), 2),
        "samples_policy": [round(x, 2) for x in policy_s],
        "samples_raw": [round(x, 2) for x in raw_s],
    }]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", default="small")
    args = parser.parse_args()
    rows = run(reps=args.reps, size=args.size)
    for row in rows:
        print(f"{row['row']:34} {row['value']:.3f} (policy {row['policy_s']} s, raw {row['raw_s']} s), target {row['target']}")
    print(json.dumps({"benchmark": "startup", "rows": rows}))


if __name__ == "__main__":
    main()
