"""Peak memory of generation with per-token log-probs (the policy) vs plain ``model.generate``.

Run: .venv/bin/python benchmarks/memory.py [--batch-size 32] [--new-tokens 256] [--vocab-size 32768] [--out FILE]

Same model (the 'tiny' Qwen2 preset with a 32k-row vocabulary, built offline), same random
prompt token ids, same seed, every response forced to the full budget (``ignore_eos``); the rows
check they generate the same tokens. Rows:

- ``plain``: ``model.generate`` returning token ids only, the floor;
- ``policy``: ``TransformersPolicy.generate_responses``, tokens plus raw log-probs gathered one
  step at a time (the collection path; target <= 1.2x plain);
- ``materialised``: ``generate(output_logits=True)`` then log-softmax over the stacked
  B x T x V logits, what the policy did before (for scale).

How memory is measured: each row runs in a fresh Python process started with
``MALLOC_MMAP_THRESHOLD_=65536``, so glibc serves every tensor above 64 KiB with its own mapping
and returns it to the OS when freed; resident memory then follows live tensor memory.
``tracemalloc`` cannot see torch's allocations and torch keeps no CPU allocator statistics, so
the process's resident set is what we read: after a short warm-up call (first-call allocations
are not the row's), the peak is reset (``/proc/self/clear_refs``, Linux), the call runs, and the
row reports ``VmHWM - VmRSS before the call``: the extra memory the call needed at its peak, model
weights and libraries excluded. The ratio is policy extra / plain extra. Prints a table; the last
line is JSON (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

MIB = 1024 * 1024
MODES = ("plain", "policy", "materialised")
TARGET_RATIO = 1.2


# ------------------------------------------------------------------------------------ one row (child process)
def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _plain(model, tokenizer, prompts, new_tokens: int):
    import torch

    with torch.inference_mode():
        sequences = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=None, top_k=None,
            pad_token_id=tokenizer.pad_token_id,
        )
    return sequences[:, prompts.shape[1] :]


def _policy(model, tokenizer, prompts, new_tokens: int):
    import torch

    from lmcollect.policies import TransformersPolicy

    policy = TransformersPolicy(model, tokenizer, max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    generations = policy.generate_responses(prompts.tolist())
    return torch.stack([g.tokens for g in generations])


def _materialised(model, tokenizer, prompts, new_tokens: int):
    import torch

    with torch.inference_mode():
        out = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=None, top_k=None,
            pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, output_logits=True,
        )
        generated = out.sequences[:, prompts.shape[1] :]
        log_probs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, generated[..., None])
    del log_probs
    return generated


def measure(mode: str, model_path: str, batch_size: int, prompt_len: int, new_tokens: int) -> dict:
    import gc

    import torch

    from lmcollect.models import load_model_and_tokenizer

    run = {"plain": _plain, "policy": _policy, "materialised": _materialised}[mode]
    model, tokenizer = load_model_and_tokenizer(model_path)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch_size, prompt_len), generator=torch.Generator().manual_seed(0))
    run(model, tokenizer, prompts, 4)  # warm-up
    gc.collect()
    _reset_peak()
    before = _status_kib("VmRSS")
    torch.manual_seed(1)
    tokens = run(model, tokenizer, prompts, new_tokens)
    peak = _status_kib("VmHWM")
    assert tokens.shape == (batch_size, new_tokens), tokens.shape
    return {
        "mode": mode,
        "extra_mib": (peak - before) / 1024,
        "rss_before_mib": before / 1024,
        "peak_mib": peak / 1024,
        "tokens_sha1": hashlib.sha1(tokens.numpy().tobytes()).hexdigest(),
    }


# ------------------------------------------------------------------------------------ driver
def run_row(mode: str, args: argparse.Namespace, model_path: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--child", mode, "--model-path", model_path, "--batch-size", str(args.batch_size),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=1, help="runs per row; the median extra memory is reported")
    parser.add_argument("--modes", default=",".join(MODES), help="rows to run, comma-separated")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    return parser


def run(quick: bool = False) -> dict:
    """The memory row for ``lmcollect bench`` (the same measurement with or without ``quick``)."""
    result = measure_rows(_parser().parse_args([]))
    ratio = result["policy_vs_plain"]
    row = {
        "row": f"TransformersPolicy log-probs, B={result['batch_size']}, {result['new_tokens']} tokens, vocab {result['vocab_size']}",
        "metric": "peak extra memory vs plain generate",
        "value": ratio,
        "target": f"<= {TARGET_RATIO}",
        "met": ratio <= TARGET_RATIO,
        "extra_mib": result["extra_mib"],
    }
    return {"rows": [row]}


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model_path, args.batch_size, args.prompt_len, args.new_tokens)))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if "plain" not in modes or "policy" not in modes:
        parser.error("--modes must include plain and policy (the ratio compares them).")
    result = measure_rows(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def measure_rows(args: argparse.Namespace) -> dict:
    """Every row of ``args.modes`` in a fresh process, the table printed, the result as a dict."""
    from lmcollect.models import ModelSpec, get_model_path

    model_path = str(get_model_path(ModelSpec(size="tiny", vocab_size=args.vocab_size)))
    modes = [m for m in args.modes.split(",") if m]
    rows = {}
    for mode in modes:
        runs = [run_row(mode, args, model_path) for _ in range(args.repeats)]
        rows[mode] = {**runs[0], "extra_mib": statistics.median(r["extra_mib"] for r in runs)}
    if len({r["tokens_sha1"] for r in rows.values()}) != 1:
        raise RuntimeError(f"the rows generated different tokens: { {m: r['tokens_sha1'] for m, r in rows.items()} }")
    ratio = rows["policy"]["extra_mib"] / rows["plain"]["extra_mib"]
    print(f"B={args.batch_size}, {args.new_tokens} new tokens, vocab {args.vocab_size}, prompts of {args.prompt_len} tokens")
    print(f"{'row':<14}{'extra MiB':>12}{'peak RSS MiB':>15}{'x plain':>10}")
    for mode, row in rows.items():
        print(f"{mode:<14}{row['extra_mib']:>12.1f}{row['peak_mib']:>15.1f}{row['extra_mib'] / rows['plain']['extra_mib']:>10.2f}")
    result = {
        "benchmark": "memory",
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "vocab_size": args.vocab_size,
        "extra_mib": {mode: round(row["extra_mib"], 1) for mode, row in rows.items()},
        "policy_vs_plain": round(ratio, 3),
        "target": TARGET_RATIO,
    }
    return result


if __name__ == "__main__":
    sys.exit(main())
