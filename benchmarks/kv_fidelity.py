"""What ``kv_policy="keep"`` costs in fidelity: recorded log-probs vs a trainer's forward pass, after real AdamW steps.

Run: python benchmarks/kv_fidelity.py [--size medium] [--engines transformers,vllm] [--quick]
(``python``: the project's virtual environment.)

Each case: ``num_requests`` dialogs (prompts of 96-160 tokens drawn from the shipped corpus) answer
with up to ``max_new_tokens`` sampled tokens under weights ``W0`` (version 0); halfway, the
engine takes ``W1`` (version 1): ``W0`` after one AdamW step at learning rate ``lr`` on a
next-token loss over the dialogs' own first answers (a real optimiser step, as a trainer makes).
Then each dialog's second turn (its first turn's tokens plus a short reply) runs under ``W1``
with the dialog's affinity, so under ``"keep"`` a prefix-caching engine (vLLM) may reuse the
first turn's keys/values computed by ``W0``.

For every generated token, ``dlogp = recorded - reference``, where the reference is a plain forward
pass over the whole sequence with the weights of the token's own version: what a trainer computes
for the importance ratio. Reported per case: mean ``exp(|dlogp|)`` (NeMo-RL's
``token_mult_prob_error``) and max ``|dlogp|``, over all tokens and over the tokens whose context
holds keys/values of older weights (``kv_versions < token_versions``). ``"recompute"`` must stay
within the exactness tolerance (max ``|dlogp|`` <= 1e-4 in fp32). Prints a table; the last line is JSON.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from lmcollect.engines import EngineRequest, TransformersEngine
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer

RECOMPUTE_TOLERANCE = 1e-4  # max |dlogp| of "recompute" in fp32
VLLM_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}


@dataclass(frozen=True, kw_only=True)
class Case:
    engine: str
    kv_policy: str
    lr: float
    num_requests: int = 8
    max_new_tokens: int = 64
    seed: int = 0


# ---------------------------------------------------------------------- weights
def prompts(tokenizer: Any, case: Case) -> list[list[int]]:
    from lmcollect.models.corpus_gen import CORPUS_PATH

    ids = tokenizer(CORPUS_PATH.read_text()[:60_000], add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(case.seed)
    out = []
    for _ in range(case.num_requests):
        length = int(torch.randint(96, 161, (1,), generator=gen))
        start = int(torch.randint(0, len(ids) - length, (1,), generator=gen))
        out.append(ids[start : start + length])
    return out


def adamw_step(model: torch.nn.Module, sequences: list[list[int]], lr: float) -> torch.nn.Module:
    """``model`` after one AdamW step on the next-token loss of ``sequences`` (a copy; ``model`` unchanged)."""
    trained = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=lr)
    optimizer.zero_grad()
    for ids in sequences:
        batch = torch.tensor([ids])
        (trained(input_ids=batch, labels=batch).loss / len(sequences)).backward()
    optimizer.step()
    return trained.eval()


@torch.no_grad()
def forward_log_probs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    return logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


# ---------------------------------------------------------------------- engines
def build_engine(kind: str, path: str, model: torch.nn.Module, tokenizer: Any, kv_policy: str) -> Any:
    if kind == "vllm":
        from lmcollect.engines.vllm.engine import VLLMEngine

        return VLLMEngine(path, engine_kwargs=VLLM_KWARGS, kv_policy=kv_policy)
    return TransformersEngine(copy.deepcopy(model), tokenizer, kv_policy=kv_policy)


def halfway(engine: Any, case: Case, half_s: float) -> threading.Event:
    """Set once the answers are about halfway: after half their decoding steps (TransformersEngine: its
    model's forward passes, counted), or after ``half_s`` (vLLM: half the warm-up turn's time)."""
    reached = threading.Event()
    model = getattr(engine, "model", None)
    if model is None:
        threading.Timer(half_s, reached.set).start()
        return reached
    calls = {"n": 0}

    def hook(*_args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == case.num_requests + case.max_new_tokens // 2:  # the prefills, then half the steps
            reached.set()

    model.register_forward_hook(hook)
    return reached


def push_halfway(engine: Any, futures: list, weights: dict[str, torch.Tensor], reached: threading.Event) -> None:
    """Once ``reached``, push ``weights`` as version 1 between two decoding steps."""
    assert reached.wait(600), "the answers never got halfway"
    assert not all(f.done() for f in futures), "every answer ended before the push: raise max_new_tokens"
    engine.pause()
    engine.load_weights(weights.items(), version=1)
    engine.resume()


def run_case(case: Case, path: str, w0: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    engine = build_engine(case.engine, path, w0, tokenizer, case.kv_policy)
    try:
        first = prompts(tokenizer, case)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=case.max_new_tokens, ignore_eos=True)
        warm = [engine.submit(EngineRequest(prompt_ids=p, sampling=sampling, seed=i)) for i, p in enumerate(first)]
        start = time.perf_counter()
        answers = [f.result(timeout=600) for f in warm]  # a warm-up turn: its time sizes the wait, its text the step
        half_s = (time.perf_counter() - start) / 2
        w1 = adamw_step(w0, [p + a.tokens.tolist() for p, a in zip(first, answers, strict=True)], case.lr)
        reached = halfway(engine, case, half_s)
        futures = [
            engine.submit(EngineRequest(prompt_ids=p, sampling=sampling, seed=100 + i, affinity=f"dialog-{i}"))
            for i, p in enumerate(first)
        ]
        pusher = threading.Thread(target=push_halfway, args=(engine, futures, dict(w1.state_dict()), reached))
        pusher.start()
        turns = [(p, f.result(timeout=600)) for p, f in zip(first, futures, strict=True)]
        pusher.join()
        replies = [prompt + r.tokens.tolist() + prompt[:8] for prompt, r in turns]  # each dialog's next turn
        seconds = [
            engine.submit(EngineRequest(prompt_ids=p, sampling=sampling, seed=200 + i, affinity=f"dialog-{i}",
                                        context_kv_version=int(r.kv_versions.min())))
            for i, (p, (_, r)) in enumerate(zip(replies, turns, strict=True))
        ]  # fmt: skip
        turns += [(p, f.result(timeout=600)) for p, f in zip(replies, seconds, strict=True)]
    finally:
        engine.close()
    return measure(case, turns, {0: w0, 1: w1})


def measure(case: Case, turns: list, weights: dict[int, torch.nn.Module]) -> dict[str, Any]:
    diffs, stale = [], []
    for prompt, result in turns:
        tokens = result.tokens.tolist()
        versions = result.token_versions.clamp(min=0)
        reference = torch.stack([forward_log_probs(weights[v], prompt, tokens) for v in sorted(weights)])
        expected = reference.gather(0, versions[None]).squeeze(0)
        diffs.append(result.log_probs.double() - expected)
        stale.append(result.kv_versions.clamp(min=0) < versions)
    flat, stale_flat = torch.cat(diffs).abs(), torch.cat(stale)
    exact = case.kv_policy == "recompute"
    return {
        "row": f"{case.engine}, kv_policy={case.kv_policy}, AdamW lr {case.lr:g}",
        "metric": "max |dlogp| vs a forward pass of each token's own weights",
        "value": float(flat.max()),
        "target": f"<= {RECOMPUTE_TOLERANCE:g}" if exact else "",
        "met": bool(flat.max() <= RECOMPUTE_TOLERANCE) if exact else None,
        "engine": case.engine,
        "kv_policy": case.kv_policy,
        "lr": case.lr,
        "tokens": flat.numel(),
        "mean_exp_abs_dlogp": float(flat.exp().mean()),
        "max_abs_dlogp": float(flat.max()),
        "stale_context_tokens": int(stale_flat.sum()),
        "max_abs_dlogp_stale": float(flat[stale_flat].max()) if stale_flat.any() else 0.0,
        "mean_exp_abs_dlogp_stale": float(flat[stale_flat].exp().mean()) if stale_flat.any() else 1.0,
    }


def run(*, size: str = "medium", engines: str = "transformers,vllm", quick: bool = False) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    path = str(get_model_path(ModelSpec(size=size)))
    w0, tokenizer = load_model_and_tokenizer(path)
    w0 = w0.float().eval()
    kinds = [k for k in engines.split(",") if k != "vllm" or importlib.util.find_spec("vllm") is not None]
    rows = []
    for lr in (1e-6,) if quick else (1e-6, 1e-5):
        for kind in kinds:
            for policy in ("recompute", "keep"):
                case = Case(engine=kind, kv_policy=policy, lr=lr, num_requests=4 if quick else 8,
                            max_new_tokens=24 if quick else 64)  # fmt: skip
                rows.append(run_case(case, path, w0, tokenizer))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--quick", action="store_true", help="lr 1e-6 only, fewer and shorter answers")
    args = parser.parse_args()
    rows = run(size=args.size, engines=args.engines, quick=args.quick)
    print(f"{'engine':13} {'kv_policy':10} {'lr':>7} {'tokens':>6} {'mean exp|dlogp|':>16} {'max |dlogp|':>12} "
          f"{'stale tokens':>12} {'max |dlogp| stale':>17}")
    for r in rows:
        print(f"{r['engine']:13} {r['kv_policy']:10} {r['lr']:7.0e} {r['tokens']:6d} {r['mean_exp_abs_dlogp']:16.6f} "
              f"{r['max_abs_dlogp']:12.3e} {r['stale_context_tokens']:12d} {r['max_abs_dlogp_stale']:17.3e}")
    print(json.dumps({"benchmark": "kv_fidelity", "rows": rows}))


if __name__ == "__main__":
    main()
