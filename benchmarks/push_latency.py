"""Push latency into a continuous engine, as the collector sees it, next to what it cannot avoid.

A ``ContinuousLLMCollector`` over an engine that keeps decoding (8 requests always running) takes
``update_policy_weights_(weights)`` of the model's own weights: pause (requests kept), check, load,
prefix-cache reset, version, resume. Alternated with it, in the same process and engine:

- **raw reload**: the same tensors written with no check, no packing and no version, between two
  decoding steps: ``param.copy_`` for transformers, vLLM's own ``reload_weights`` in its worker for
  vLLM (the engine's internals, as a baseline must reach them); the write alone is timed;
- **direct load** (vLLM): the worker's own load of the same tensors (``_lmcollect_reload``: straight
  into the parameters, then the CPU GEMMs packed again, ``lmcollect/engines/vllm/direct_load.py``),
  timed the same way: the row "direct load / vLLM's reload_weights" compares the two;
- **one decoding step**: the engine's time per step for the same 8 requests (a batch of 8 x 64
  tokens, wall time / 64).

Rows: the median push latency (target for the small model: <= 0.15 s) and push / (raw reload +
one step) (target for the medium model: <= 1.5). Run: ``python benchmarks/push_latency.py``
(``--quick``: the small model only, fewer repetitions).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

TARGET_SMALL_S = 0.15
TARGET_RATIO = 1.5
IN_FLIGHT = 8
STEP_TOKENS = 64
ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}


def _engine(backend: str, path: str):
    from lmcollect.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(path)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    if backend == "vllm":
        from lmcollect.engines.vllm.engine import VLLMEngine

        return VLLMEngine(path, engine_kwargs=ENGINE_KWARGS), tokenizer, weights
    from lmcollect.engines import TransformersEngine

    return TransformersEngine(model.eval(), tokenizer, max_batch_size=2 * IN_FLIGHT), tokenizer, weights


def _raw_reload(backend: str, engine: Any, weights: dict[str, torch.Tensor]) -> Callable[[], float]:
    """The same tensors written with nothing around them, between two decoding steps; returns the
    seconds the write took (not the wait for the step under way, which the push's figure includes
    and the "one decoding step" term stands for)."""
    if backend == "vllm":
        items = dict(weights)

        def reload(llm: Any) -> float:
            start = time.perf_counter()
            llm.collective_rpc(lambda worker: worker.reload_weights(weights_iterator=iter(items.items()),
                                                                     is_checkpoint_format=True))
            return time.perf_counter() - start

        return lambda: engine.run_on_engine(reload)
    params = dict(engine.model.state_dict())

    def copy() -> float:
        with engine._between_steps(), torch.no_grad():  # the engine's private hook: the baseline skips its checks
            start = time.perf_counter()
            for name, tensor in weights.items():
                params[name].copy_(tensor)
            return time.perf_counter() - start

    return copy


def _request(max_new_tokens: int):
    from lmcollect.engines import EngineRequest
    from lmcollect.engines.sampling import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True)
    return EngineRequest(prompt_ids=list(range(5, 45)), sampling=sampling)


def _step_s(engine: Any) -> float:
    """Seconds per decoding step of ``IN_FLIGHT`` requests (run alone: the background load is paused)."""
    start = time.perf_counter()
    for future in [engine.submit(_request(STEP_TOKENS)) for _ in range(IN_FLIGHT)]:
        future.result(timeout=600)
    return (time.perf_counter() - start) / STEP_TOKENS


class Load:
    """Keeps ``IN_FLIGHT`` requests decoding on the engine until stopped."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        running: list[Any] = []
        while not self._stop.is_set():
            running = [f for f in running if not f.done()]
            running += [self.engine.submit(_request(256)) for _ in range(IN_FLIGHT - len(running))]
            time.sleep(0.005)
        for future in running:
            future.result(timeout=600)

    def __enter__(self) -> Load:
        self._thread.start()
        time.sleep(1.0)  # the requests are decoding
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=600)


def measure(backend: str, size: str, reps: int, *, path: str | None = None) -> dict[str, Any]:
    """Push latency, raw reload and decoding step of ``backend`` on the ``size`` preset (or the model at ``path``)."""
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.envs import ChatEnv, SingleTurnTask, arithmetic_dataset
    from lmcollect.models import ModelSpec, get_model_path

    path = path or str(get_model_path(ModelSpec(size=size)))
    engine, tokenizer, weights = _engine(backend, path)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=tokenizer, dialog_turns_per_batch=1,
                                       track_policy_version=True)
    raw = _raw_reload(backend, engine, weights)
    direct = _direct_load(engine, weights) if backend == "vllm" else None
    push_s, raw_s, step_s, direct_s = [], [], [], []
    try:
        with Load(engine):
            collector.update_policy_weights_(weights)  # warm-up
            raw()
            for _ in range(reps):
                start = time.perf_counter()
                collector.update_policy_weights_(weights)
                push_s.append(time.perf_counter() - start)
                time.sleep(0.3)
                raw_s.append(raw())
                time.sleep(0.3)
                if direct is not None:
                    direct_s.append(direct())
                    time.sleep(0.3)
        for _ in range(max(1, reps // 2)):
            step_s.append(_step_s(engine))
    finally:
        collector.shutdown()
        engine.close()
    push, reload, step = (statistics.median(x) for x in (push_s, raw_s, step_s))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return {"backend": backend, "size": size, "mib": round(nbytes / 2**20, 1), "push_s": push, "raw_reload_s": reload,
            "step_s": step, "samples_push": [round(x, 4) for x in push_s], "samples_raw": [round(x, 4) for x in raw_s],
            "direct_load_s": statistics.median(direct_s) if direct_s else None}


def _direct_load(engine: Any, weights: dict[str, torch.Tensor]) -> Callable[[], float]:
    """The worker's own load of the same tensors (the engine's full-push path without its checks and packing)."""
    items = dict(weights)

    def load(llm: Any) -> float:
        start = time.perf_counter()
        llm.collective_rpc("_lmcollect_reload", args=(items,))
        return time.perf_counter() - start

    return lambda: engine.run_on_engine(load)


def rows_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    label = f"{m['backend']} {m['size']} ({m['mib']} MiB)"
    ratio = m["push_s"] / (m["raw_reload_s"] + m["step_s"])
    details = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
    rows = [{
        "row": f"push into a continuous {label}",
        "metric": "push s / (raw reload s + one decoding step s)",
        "value": round(ratio, 2),
        "target": f"<= {TARGET_RATIO}" if m["size"] == "medium" else "",
        "met": ratio <= TARGET_RATIO if m["size"] == "medium" else None,
        **details,
    }]
    if m.get("direct_load_s"):
        rows.append({
            "row": f"{label}: the worker's direct load vs vLLM's reload_weights, same tensors",
            "metric": "direct load s / reload_weights s",
            "value": round(m["direct_load_s"] / m["raw_reload_s"], 3),
            "target": "",
            "met": None,
        })
    if m["size"] == "small":
        rows.append({
            "row": f"push into a continuous {label}",
            "metric": "median push latency seen by the collector, s",
            "value": round(m["push_s"], 3),
            "target": f"<= {TARGET_SMALL_S}",
            "met": m["push_s"] <= TARGET_SMALL_S,
        })
    return rows


def run(*, quick: bool = False, reps: int = 7, sizes: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    sizes = sizes or (("small",) if quick else ("small", "medium"))
    backends = ["transformers"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])
    rows = []
    for size in sizes:
        for backend in backends:
            rows += rows_of(measure(backend, size, 5 if quick else reps))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model only, fewer repetitions")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--sizes", default=None, help="comma-separated model presets (default small,medium)")
    args = parser.parse_args()
    sizes = tuple(args.sizes.split(",")) if args.sizes else None
    rows = run(quick=args.quick, reps=args.reps, sizes=sizes)
    for row in rows:
        print(f"{row['row']:52} {row['metric']:48} {row['value']} (target {row['target'] or '-'})")
    print(json.dumps({"benchmark": "push_latency", "rows": rows}))


if __name__ == "__main__":
    main()
