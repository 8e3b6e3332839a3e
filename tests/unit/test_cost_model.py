"""The push cost model: its formula, its fit to measured pushes, and the delta-or-full choice it drives."""
from __future__ import annotations

import math

import pytest

from lmcollect.weights.cost_model import DeltaChooser, MeasuredPush, PushCostModel, fit_push_cost

GB = 1_000_000_000
# a model shaped like the CPU pushes measured over the links: copies cost, a capped transfer rate
TRUE = PushCostModel(
    fixed_s=0.05, per_byte_s=1.5e-9, per_delta_byte_s=8e-9, delta_per_full_byte_s=1.0e-9, link_efficiency=0.9, max_gbit=3.0
)


def measured(model: PushCostModel, kind: str, full: int, fraction: float, gbit: float) -> MeasuredPush:
    nbytes = full if kind == "full" else int(fraction * full)
    push = MeasuredPush(kind=kind, nbytes=nbytes, full_nbytes=full, bandwidth_gbit=gbit, seconds=1.0)
    return MeasuredPush(kind=kind, nbytes=nbytes, full_nbytes=full, bandwidth_gbit=gbit, seconds=model.predict(push))


def grid(model: PushCostModel) -> list[MeasuredPush]:
    return [
        measured(model, kind, full, fraction, gbit)
        for gbit in (0.5, 1, 2, 10)
        for full in (GB // 7, GB)
        for kind, fraction in (("full", 1.0), ("delta", 0.02), ("delta", 0.1))
    ]


def test_full_push_is_bytes_over_the_link_plus_copies_plus_fixed_costs() -> None:
    model = PushCostModel(fixed_s=0.1, per_byte_s=1e-9, link_efficiency=0.5, per_bucket_s=0.01)
    # 1 GB at 8 Gbit/s, half efficient: 2 s on the link, 1 s of copies, 0.1 s fixed, 3 buckets
    assert model.full_push_s(GB, 8, num_buckets=3) == pytest.approx(2 + 1 + 0.1 + 0.03)
    capped = PushCostModel(max_gbit=4)
    assert capped.full_push_s(GB, 100) == pytest.approx(2.0)  # the copying path, not the link, limits


def test_a_delta_pays_for_its_bytes_and_a_pass_over_the_whole_model() -> None:
    model = PushCostModel(per_delta_byte_s=10e-9, delta_per_full_byte_s=1e-9)
    # 1% of 1 GB: 0.01 s on the link, 0.1 s to gather and scatter, 1 s comparing the whole model
    assert model.delta_push_s(GB, GB // 100, 8) == pytest.approx(0.01 + 0.1 + 1.0)


def test_fit_recovers_the_model_that_made_the_points() -> None:
    fitted = fit_push_cost(grid(TRUE))
    for push in grid(TRUE):
        assert fitted.predict(push) == pytest.approx(push.seconds, rel=0.05)
    assert fitted.max_gbit == pytest.approx(TRUE.max_gbit, rel=0.1)
    assert fitted.delta_per_full_byte_s == pytest.approx(TRUE.delta_per_full_byte_s, rel=0.1)
    assert fitted.per_delta_byte_s == pytest.approx(TRUE.per_delta_byte_s, rel=0.1)


def test_fit_keeps_coefficients_physical_when_the_data_disagree() -> None:
    # a delta faster than its bytes allow: the fit must not answer with a negative cost
    points = [*grid(PushCostModel(per_byte_s=1e-9)), MeasuredPush(kind="delta", nbytes=GB // 10, full_nbytes=GB, bandwidth_gbit=1, seconds=0.01)]
    fitted = fit_push_cost(points)
    assert min(fitted.fixed_s, fitted.per_byte_s, fitted.delta_per_full_byte_s) >= 0
    assert 0 < fitted.link_efficiency <= 1


def test_fit_needs_two_rates() -> None:
    one_rate = [measured(TRUE, "full", GB, 1.0, 1), measured(TRUE, "delta", GB, 0.1, 1)]
    with pytest.raises(ValueError, match="two or more link rates"):
        fit_push_cost(one_rate)


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.2])
def test_breakeven_rate_splits_where_delta_pays(fraction: float) -> None:
    model = PushCostModel(per_byte_s=0.2e-9, delta_per_full_byte_s=1e-9)
    breakeven = model.breakeven_gbit(fraction)
    assert 0 < breakeven < math.inf
    assert model.delta_pays(GB, fraction, breakeven * 0.9)
    assert not model.delta_pays(GB, fraction, breakeven * 1.1)


def test_a_large_delta_breaks_even_on_a_slower_link_than_a_small_one() -> None:
    model = PushCostModel(per_byte_s=0.2e-9, per_delta_byte_s=2e-9, delta_per_full_byte_s=1e-9)
    assert model.breakeven_gbit(0.2) < model.breakeven_gbit(0.02)


def test_breakeven_is_infinite_when_copies_or_the_cap_make_every_link_slow() -> None:
    assert PushCostModel(per_byte_s=2e-9, delta_per_full_byte_s=1e-9).breakeven_gbit(0.05) == math.inf
    capped = PushCostModel(per_byte_s=0.2e-9, delta_per_full_byte_s=1e-9, max_gbit=2)
    assert capped.breakeven_gbit(0.05) == math.inf
    assert capped.delta_pays(GB, 0.05, 400)
    assert PushCostModel().breakeven_gbit(1.0) == 0.0  # nothing saved: never


def test_effective_rate_inverts_a_full_push() -> None:
    model = PushCostModel(fixed_s=0.05, per_byte_s=1e-9, link_efficiency=0.8)
    assert model.effective_gbit(GB, model.full_push_s(GB, 5)) == pytest.approx(5)
    assert model.effective_gbit(GB, 0.5) == math.inf  # faster than its copies: not the link


def test_chooser_uses_the_given_rate() -> None:
    model = PushCostModel(per_byte_s=0.2e-9, delta_per_full_byte_s=1e-9)
    breakeven = model.breakeven_gbit(0.05)
    assert DeltaChooser(model, bandwidth_gbit=breakeven / 2).use_delta(GB)
    assert not DeltaChooser(model, bandwidth_gbit=breakeven * 2).use_delta(GB)


def test_chooser_measures_the_link_from_a_full_push_and_learns_the_delta_size() -> None:
    model = PushCostModel(per_byte_s=0.2e-9, delta_per_full_byte_s=1e-9)
    chooser = DeltaChooser(model, expected_delta_fraction=0.02)
    assert chooser.use_delta(GB)  # nothing known yet: the first push is full anyway and times the link
    chooser.observe("full", GB, GB, model.full_push_s(GB, 1))  # a 1 Gbit/s link
    assert chooser.link_gbit == pytest.approx(1) and chooser.use_delta(GB)
    chooser.observe("delta", GB * 95 // 100, GB, 9.0)  # deltas turn out nearly the whole model: not worth it
    assert not chooser.use_delta(GB)
    fast = DeltaChooser(model)
    fast.observe("full", GB, GB, model.full_push_s(GB, 400))
    assert not fast.use_delta(GB)


@pytest.mark.parametrize(
    "kwargs",
    [{"fixed_s": -1.0}, {"per_byte_s": math.nan}, {"link_efficiency": 0.0}, {"link_efficiency": 1.5}, {"max_gbit": 0}],
)
def test_model_rejects_unphysical_coefficients(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PushCostModel(**kwargs)


def test_measured_push_and_chooser_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="full push sends"):
        MeasuredPush(kind="full", nbytes=1, full_nbytes=2, bandwidth_gbit=1, seconds=1)
    with pytest.raises(ValueError, match="bandwidth_gbit"):
        DeltaChooser(PushCostModel(), bandwidth_gbit=0)
    with pytest.raises(ValueError, match="delta_fraction"):
        PushCostModel().delta_pays(GB, 1.5, 1)


def test_the_shipped_fits_break_even_where_docs_scaling_says() -> None:
    """docs/scaling.md's table: Ray deltas of 1.5% pay on any link, of 15% below 4.1 Gbit/s; vLLM's
    below 8.3 and 4.5 Gbit/s (the engine reloads every tensor even for a delta)."""
    from lmcollect.weights.cost_model import RAY_CPU_PUSH_COST, VLLM_CPU_PUSH_COST

    assert RAY_CPU_PUSH_COST.breakeven_gbit(0.015) == math.inf
    assert RAY_CPU_PUSH_COST.breakeven_gbit(0.152) == pytest.approx(4.1, rel=0.05)
    assert VLLM_CPU_PUSH_COST.breakeven_gbit(0.015) == pytest.approx(8.3, rel=0.05)
    assert VLLM_CPU_PUSH_COST.breakeven_gbit(0.152) == pytest.approx(4.5, rel=0.05)
