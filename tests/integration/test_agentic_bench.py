"""``benchmarks/agentic.py`` end to end at its smallest: the tiny model, greedy, a few dialogs per mode.

Speed is not asserted (the machine is shared); the rows' shape and the sameness of the work are.
"""
from __future__ import annotations

import dataclasses
import importlib.util

from benchmarks.agentic import Workload, gpu_rows, ratio_row, run_sample

# greedy, so a dialog's responses are a function of its row: both modes must produce the same ones
SMALLEST = Workload(size="tiny", max_new_tokens=24, temperature=0.0, max_latency_s=0.05, turns_per_batch=8,
                    num_batches=2)
ROW_KEYS = {"row", "metric", "value", "target", "met", "this", "baseline"}
SUMMARY_KEYS = {"turns_per_s", "tokens_per_s", "busy_share", "length_mean", "length_p50", "length_p90"}


def test_lockstep_and_continuous_do_the_same_work() -> None:
    sync = run_sample("transformers", "sync", 4, SMALLEST)
    continuous = run_sample("transformers", "continuous", 4, SMALLEST)
    lagged = run_sample("transformers", "continuous-lag", 6, SMALLEST)

    for sample in (sync, continuous, lagged):
        assert sample.turns == SMALLEST.turns_per_batch * SMALLEST.num_batches
        assert 0 < sample.busy_s <= sample.wall_s * 1.01
        assert all(1 <= n <= SMALLEST.max_new_tokens for n in sample.lengths)
    # greedy: a (dialog, turn) pair both modes ran got the same response length in both
    for other in (continuous, lagged):
        theirs = {tuple(key): n for key, n in zip(other.dialog_keys, other.lengths)}
        common = [(tuple(key), n) for key, n in zip(sync.dialog_keys, sync.lengths) if tuple(key) in theirs]
        assert len(common) >= sync.turns // 2  # the same rows start in the same order
        assert all(theirs[key] == n for key, n in common)
    assert len(lagged.push_s) == SMALLEST.num_batches and set(lagged.lags) <= {0, 1}  # max_policy_lag=1

    row = ratio_row("continuous vs LLMCollector", [continuous], [sync], SMALLEST, 1.3, "lockstep")
    assert ROW_KEYS <= set(row) and isinstance(row["value"], float) and row["met"] == (row["value"] >= 1.3)
    assert SUMMARY_KEYS <= set(row["this"]) and SUMMARY_KEYS <= set(row["baseline"])
    lag_row = ratio_row("lagged", [lagged], [sync], SMALLEST, 2.0, "lockstep")
    assert set(lag_row["this"]["lag_histogram"]) <= {0, 1} and "push_s_median" in lag_row["this"]


def test_gpu_row_says_skipped_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        return  # the GPU row runs for real there (benchmark, not test)
    (row,) = gpu_rows(SMALLEST, 1, more_slots=8)
    assert row["value"] is None and row["met"] is None and "skipped" in row


def test_the_grpo_modes_push_every_batch_and_continuous_batches_hold_whole_groups() -> None:
    from collections import Counter

    from benchmarks.agentic import GROUP_SIZE

    w = dataclasses.replace(SMALLEST, turns_per_batch=16)
    lockstep = run_sample("transformers", "sync-grpo-push", 8, w)
    continuous = run_sample("transformers", "continuous-grpo-push", 8, w)
    for sample in (lockstep, continuous):
        assert len(sample.push_s) == w.num_batches and sample.turns > 0
    assert set(lockstep.lags) == {0} and set(continuous.lags) <= {0, 1}  # max_policy_lag=1
    # whole groups: each (dialog opening, turn) of a timed batch comes once per member of its group
    counts = Counter(tuple(key) for key in continuous.dialog_keys)
    assert all(n % GROUP_SIZE == 0 for n in counts.values()), counts


def test_the_push_modes_account_for_each_push_and_keep_recomputes_nothing() -> None:
    from benchmarks.agentic import accounted_row

    recompute = run_sample("transformers", "continuous-push", 4, SMALLEST)
    keep = run_sample("transformers", "continuous-push-keep", 4, SMALLEST)
    for sample in (recompute, keep):
        assert len(sample.push_s) == SMALLEST.num_batches and sample.prompt_tokens > 0
    assert keep.recomputed_tokens == 0 and keep.recompute_s == 0
    assert recompute.recomputed_tokens >= 0 and (recompute.recompute_s > 0) == (recompute.recomputed_tokens > 0)
    row = accounted_row("accounted", [recompute], [keep])  # the shape of the row (keep as the baseline)
    assert row["push_call_s"] == [round(sum(recompute.push_s), 2)] and row["recomputed_tokens"] == [recompute.recomputed_tokens]


def test_dynamic_sampling_bench_counts_its_groups_and_useful_turns() -> None:
    """``benchmarks/dynamic_sampling.py`` at its smallest: the filtered batches hold useful turns only."""
    from benchmarks.dynamic_sampling import Workload as SamplingWorkload
    from benchmarks.dynamic_sampling import ratio_row as sampling_row
    from benchmarks.dynamic_sampling import run_sample as sampling_sample

    w = SamplingWorkload(size="tiny", max_new_tokens=12, max_latency_s=0.02, num_batches=1, slots=8, groups_per_batch=2)
    base, filtered = sampling_sample("no-filter", w), sampling_sample("filter-os1", w)
    assert base["counts"] is None and 0 <= base["useful_turns"] <= base["turns"]
    counts = filtered["counts"]
    assert filtered["useful_turns"] == filtered["turns"] > 0
    assert counts["groups_kept"] == 2 * 2 and counts["batches"] == 2  # the warm-up batch and the timed one
    assert counts["groups_generated"] >= counts["groups_kept"] + sum(counts["groups_dropped"].values())
    row = sampling_row("filter vs none", [filtered], [base])
    assert {"row", "metric", "value", "this", "baseline"} <= set(row) and "groups kept 4 of" in row["metric"]


def test_the_agent_modes_do_the_chat_env_work_through_the_endpoint() -> None:
    """An agent program through the OpenAI-compatible endpoint, sync and async, over HTTP and in-process, against the same dialogs
    as a ChatEnv task: the same rows start in the same order and greedy replies are the same."""
    from benchmarks.agentic import TARGET_AGENT

    chat_env = run_sample("transformers", "continuous", 4, SMALLEST)
    sdk = ("agent-sdk-inproc",) if importlib.util.find_spec("agents") is not None else ()  # the OpenAI Agents SDK
    for mode in ("agent", "agent-sync", "agent-inproc", "agent-sync-inproc", *sdk):
        agent = run_sample("transformers", mode, 4, SMALLEST)
        assert agent.turns == SMALLEST.turns_per_batch * SMALLEST.num_batches
        theirs = {tuple(key): n for key, n in zip(chat_env.dialog_keys, chat_env.lengths)}
        common = [(tuple(key), n) for key, n in zip(agent.dialog_keys, agent.lengths) if tuple(key) in theirs]
        assert len(common) >= agent.turns // 2 and all(theirs[key] == n for key, n in common)
        row = ratio_row("agent vs ChatEnv", [agent], [chat_env], SMALLEST, TARGET_AGENT, "ChatEnv task")
        assert ROW_KEYS <= set(row) and isinstance(row["value"], float)
