"""A cost model of weight pushes over a link, fitted on measured pushes, and the delta-or-full choice it implies.

One push of ``F`` bytes of weights (a full push) or of a delta of ``D`` bytes, over a link of
``bandwidth_gbit``, in ``num_buckets`` buckets::

    full_s  = fixed_s + num_buckets * per_bucket_s + F * per_byte_s + 8 F / (bandwidth * link_efficiency)
    delta_s = fixed_s + num_buckets * per_bucket_s + D * per_delta_byte_s + 8 D / (bandwidth * link_efficiency)
              + F * delta_per_full_byte_s

where a transfer's rate is also capped at ``max_gbit``, the rate the copying path reaches (on few
CPU cores a fast link is not the limit). ``per_byte_s`` is what a byte of a full push costs besides
the link (packing, the object store's or the process group's copies, the receiver's load);
``per_delta_byte_s`` the same for a byte of a delta (gathering the changed values, scattering them
on the receiver, checksums: dearer than a copy); ``delta_per_full_byte_s`` is what delta mode costs
per byte of the *whole* model however little changed (the sender compares every element with its
base; a vLLM engine still reloads every tensor); ``link_efficiency`` is the fraction of the
nominal rate a transfer reaches. A delta pays when what it saves on the link and in copies
outweighs that: below :meth:`PushCostModel.breakeven_gbit` for its size.

:func:`fit_push_cost` fits the coefficients by least squares on measured pushes
(``benchmarks/links.py``); ``per_bucket_s`` (a round trip per bucket) is given, not fitted, since
the links there add no latency. Pure Python and numpy: no torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

GBIT = 1e9


@dataclass(frozen=True, kw_only=True)
class MeasuredPush:
    """One measured push, a point :func:`fit_push_cost` fits."""

    kind: Literal["full", "delta"]
    """A full push (``nbytes == full_nbytes``) or a delta push."""
    nbytes: int
    """Bytes sent: the weights, or the delta's arrays."""
    full_nbytes: int
    """Bytes of a full push of the same weights."""
    bandwidth_gbit: float
    """Nominal rate of the link, Gbit/s."""
    seconds: float
    """Measured time of the push (median)."""
    num_buckets: int = 1
    """Buckets (messages) the push was sent in."""

    def __post_init__(self) -> None:
        if self.kind not in ("full", "delta"):
            raise ValueError(f"kind must be 'full' or 'delta', got {self.kind!r}.")
        if self.kind == "full" and self.nbytes != self.full_nbytes:
            raise ValueError(f"a full push sends full_nbytes, got nbytes={self.nbytes} != {self.full_nbytes}.")
        if not (self.bandwidth_gbit > 0 and self.seconds > 0 and self.full_nbytes > 0 and self.nbytes >= 0):
            raise ValueError(f"bandwidth_gbit, seconds and full_nbytes must be positive, got {self}.")


@dataclass(frozen=True, kw_only=True)
class PushCostModel:
    """Predicted seconds of a full or a delta push (the formula in the module docstring)."""

    fixed_s: float = 0.0
    """Seconds every push costs whatever its size (remote calls, pause and resume, checks)."""
    per_byte_s: float = 0.0
    """Seconds per byte of a full push, besides the link: copies, packing, the receiver's load."""
    per_delta_byte_s: float = 0.0
    """Seconds per byte of a delta, besides the link: gathering, scattering, checksums."""
    delta_per_full_byte_s: float = 0.0
    """Seconds per byte of the whole model that delta mode adds: the sender's comparison with its
    base (and, for an engine that reloads every tensor after a delta, that reload)."""
    link_efficiency: float = 1.0
    """Fraction of the link's nominal rate a transfer reaches."""
    max_gbit: float = math.inf
    """The fastest a transfer goes on any link (Gbit/s): the rate of the path that copies the
    bytes (e.g. Ray's object transfer on a few CPU cores); ``inf``: only the link limits."""
    per_bucket_s: float = 0.0
    """Seconds per bucket (message): the link's round trip and a message's handling."""

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_byte_s", "per_delta_byte_s", "delta_per_full_byte_s", "per_bucket_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}.")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}.")
        if not self.max_gbit > 0:
            raise ValueError(f"max_gbit must be positive (inf: no limit), got {self.max_gbit}.")

    def transfer_s(self, nbytes: float, bandwidth_gbit: float) -> float:
        """Seconds ``nbytes`` spend on a link of ``bandwidth_gbit`` (copies excluded)."""
        _check_bandwidth(bandwidth_gbit)
        return 8 * nbytes / (min(bandwidth_gbit * self.link_efficiency, self.max_gbit) * GBIT)

    def full_push_s(self, full_nbytes: float, bandwidth_gbit: float, *, num_buckets: int = 1) -> float:
        """Predicted seconds of a full push of ``full_nbytes``."""
        return (
            self._common_s(num_buckets) + full_nbytes * self.per_byte_s + self.transfer_s(full_nbytes, bandwidth_gbit)
        )

    def delta_push_s(
        self, full_nbytes: float, delta_nbytes: float, bandwidth_gbit: float, *, num_buckets: int = 1
    ) -> float:
        """Predicted seconds of a delta push of ``delta_nbytes`` for weights of ``full_nbytes``."""
        return (
            self._common_s(num_buckets)
            + delta_nbytes * self.per_delta_byte_s
            + self.transfer_s(delta_nbytes, bandwidth_gbit)
            + full_nbytes * self.delta_per_full_byte_s
        )

    def delta_pays(self, full_nbytes: float, delta_fraction: float, bandwidth_gbit: float) -> bool:
        """True when a delta of ``delta_fraction`` of the full bytes is predicted faster than a full push."""
        _check_fraction(delta_fraction)
        delta_s = self.delta_push_s(full_nbytes, delta_fraction * full_nbytes, bandwidth_gbit)
        return delta_s < self.full_push_s(full_nbytes, bandwidth_gbit)

    def breakeven_gbit(self, delta_fraction: float) -> float:
        """The link rate (Gbit/s) below which a delta of ``delta_fraction`` of the bytes pays; ``inf``:
        it pays on any link (its copies alone save more than it costs), 0: on none. The model size
        cancels out: every term but the fixed ones grows with it."""
        _check_fraction(delta_fraction)
        saved = 1.0 - delta_fraction  # of the full bytes, not sent
        spare_s_per_byte = (  # per full byte, what a delta saves besides the link
            self.per_byte_s - delta_fraction * self.per_delta_byte_s - self.delta_per_full_byte_s
        )
        if spare_s_per_byte >= 0:
            return math.inf if saved > 0 else 0.0
        # saved * 8 / (bw * eff) == -spare  ->  bw = saved * 8 / (eff * -spare)
        rate_gbit = saved * 8 / -spare_s_per_byte / GBIT  # the transfer rate at which it breaks even
        if rate_gbit >= self.max_gbit:
            return math.inf  # even the fastest transfer is slow enough for the delta to pay
        return rate_gbit / self.link_efficiency

    def effective_gbit(self, full_nbytes: float, full_push_s: float) -> float:
        """The link rate (Gbit/s, nominal) that explains a full push of ``full_nbytes`` taking
        ``full_push_s``; ``inf`` when the model's copies alone take that long (a link too fast to matter)."""
        on_link_s = full_push_s - self._common_s(1) - full_nbytes * self.per_byte_s
        rate_gbit = 8 * full_nbytes / on_link_s / GBIT if on_link_s > 0 else math.inf
        if rate_gbit >= self.max_gbit:
            return math.inf  # as fast as copies go: the link is not what limits
        return rate_gbit / self.link_efficiency

    def predict(self, push: MeasuredPush) -> float:
        """Predicted seconds of a push like ``push`` (its kind, bytes, link and buckets)."""
        if push.kind == "full":
            return self.full_push_s(push.full_nbytes, push.bandwidth_gbit, num_buckets=push.num_buckets)
        return self.delta_push_s(push.full_nbytes, push.nbytes, push.bandwidth_gbit, num_buckets=push.num_buckets)

    def _common_s(self, num_buckets: int) -> float:
        return self.fixed_s + num_buckets * self.per_bucket_s


def fit_push_cost(points: Sequence[MeasuredPush], *, per_bucket_s: float = 0.0) -> PushCostModel:
    """Fit a model to measured pushes: the link's efficiency and ``max_gbit`` by a search over a
    grid, the other coefficients by least squares on relative errors (small pushes weigh as much
    as large ones); a coefficient the data would make negative is fixed at 0 and the rest refit.
    Needs pushes at two or more rates and, for the delta coefficient, delta pushes."""
    if len(points) < 2:
        raise ValueError(f"fit_push_cost needs at least 2 measured pushes, got {len(points)}.")
    if len({p.bandwidth_gbit for p in points}) < 2:
        raise ValueError("fit_push_cost needs pushes at two or more link rates to tell the link from the copies.")
    efficiencies = [float(e) for e in np.linspace(1.0, 0.3, 15)]
    caps = [math.inf, *(float(c) for c in np.geomspace(0.1, 1000, 81))]  # steps of 12%
    best = min((_fit_linear(points, per_bucket_s, e, c) for e in efficiencies for c in caps), key=lambda f: f[1])
    model = best[0]
    finer_caps = [model.max_gbit]
    if math.isfinite(model.max_gbit):
        finer_caps = [float(c) for c in np.geomspace(model.max_gbit / 1.13, model.max_gbit * 1.13, 25)]
    finer_efficiencies = np.linspace(
        min(1.0, model.link_efficiency + 0.05), max(0.05, model.link_efficiency - 0.05), 11
    )
    finer = (_fit_linear(points, per_bucket_s, float(e), c) for e in finer_efficiencies for c in finer_caps)
    return min([best, *finer], key=lambda f: f[1])[0]


def _fit_linear(
    points: Sequence[MeasuredPush], per_bucket_s: float, efficiency: float, max_gbit: float
) -> tuple[PushCostModel, float]:
    """The least-squares model for a given link (efficiency, cap), and its squared relative error."""
    link = PushCostModel(link_efficiency=efficiency, max_gbit=max_gbit)
    # columns: fixed, bytes of a full push, bytes of a delta, full bytes of a delta push; the link's seconds are known
    features = np.array([_columns(p) for p in points])
    targets = np.array(
        [p.seconds - p.num_buckets * per_bucket_s - link.transfer_s(p.nbytes, p.bandwidth_gbit) for p in points]
    )
    weights = 1.0 / np.array([p.seconds for p in points])
    coefs = np.zeros(4)
    active = [j for j in range(4) if np.any(features[:, j])]
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active] * weights[:, None], targets * weights, rcond=None)
        if np.all(solution >= 0):
            coefs[active] = solution
            break
        active.pop(int(np.argmin(solution)))  # the most negative: fixed at 0, refit the rest
    model = PushCostModel(
        fixed_s=float(coefs[0]),
        per_byte_s=float(coefs[1]),
        per_delta_byte_s=float(coefs[2]),
        delta_per_full_byte_s=float(coefs[3]),
        link_efficiency=efficiency,
        max_gbit=max_gbit,
        per_bucket_s=per_bucket_s,
    )
    return model, sum((model.predict(p) / p.seconds - 1.0) ** 2 for p in points)


def _columns(push: MeasuredPush) -> list[float]:
    if push.kind == "full":
        return [1.0, float(push.nbytes), 0.0, 0.0]
    return [1.0, 0.0, float(push.nbytes), float(push.full_nbytes)]


RAY_CPU_PUSH_COST = PushCostModel(
    per_byte_s=0.52e-9,
    per_delta_byte_s=6.4e-9,
    delta_per_full_byte_s=1.26e-9,
    link_efficiency=0.95,
    max_gbit=5.06,
)
"""``RayRemoteWeightUpdater`` pushing the medium model (bf16) into 2 collectors on another node,
fitted on benchmarks/links.py over 1 and 10 Gbit/s links on this project's 2-core CPU machine
(docs/scaling.md, the run of 2026-12-04 16:42 UTC): Ray's object transfer tops out near ``max_gbit``
there, so a small delta (1.5% of the bytes) pays on any link, and one of 15% of the bytes only below
about 4 Gbit/s. On GPUs and fast links fit your own (:func:`fit_push_cost`)."""


@dataclass
class DeltaChooser:
    """Chooses delta or full for each push from a :class:`PushCostModel`, the link's rate and the
    size of the last delta (``PushConfig(delta="auto")``).

    The rate is the user's (``bandwidth_gbit``) or, when None, the one :meth:`observe` derives from
    the last full push's time through the model (the slowest receiver's). The delta's size is
    ``expected_delta_fraction`` of the full bytes until a delta push has been seen, then the last
    one's. Until a full push has been timed with no rate given, it chooses delta (the first push is
    full anyway, and times the link).
    """

    model: PushCostModel
    bandwidth_gbit: float | None = None
    expected_delta_fraction: float = 0.05
    _measured_gbit: float | None = None

    def __post_init__(self) -> None:
        if self.bandwidth_gbit is not None:
            _check_bandwidth(self.bandwidth_gbit)
        _check_fraction(self.expected_delta_fraction)

    @property
    def link_gbit(self) -> float | None:
        """The rate decisions use: the user's, else the measured one (None: not measured yet)."""
        return self.bandwidth_gbit if self.bandwidth_gbit is not None else self._measured_gbit

    def use_delta(self, full_nbytes: int) -> bool:
        """Whether the next push of ``full_nbytes`` should be a delta push."""
        gbit = self.link_gbit
        if gbit is None:
            return True
        if math.isinf(gbit):
            return self.model.breakeven_gbit(self.expected_delta_fraction) == math.inf
        return self.model.delta_pays(full_nbytes, self.expected_delta_fraction, gbit)

    def observe(self, kind: str, nbytes: int, full_nbytes: int, seconds: float | None) -> None:
        """Learn from a push that went out: a delta's size, or (timed) a full push's link rate."""
        if kind == "delta" and full_nbytes > 0:
            self.expected_delta_fraction = min(1.0, nbytes / full_nbytes)
        elif kind == "full" and seconds is not None and seconds > 0 and full_nbytes > 0:
            self._measured_gbit = self.model.effective_gbit(full_nbytes, seconds)


VLLM_CPU_PUSH_COST = PushCostModel(
    per_byte_s=1.47e-9,
    per_delta_byte_s=4.3e-9,
    delta_per_full_byte_s=2.40e-9,
    link_efficiency=0.95,
)
"""``vLLMUpdater`` pushing the medium model (bf16) into a vLLM engine on another node over gloo,
fitted in the same run as :data:`RAY_CPU_PUSH_COST` (docs/scaling.md): the engine reloads every
tensor even for a delta, so deltas pay below about 8 Gbit/s (1.5% of the bytes changed) or 4.5
Gbit/s (15%) on this machine. On GPUs and fast links fit your own (:func:`fit_push_cost`)."""


def check_auto_delta_options(delta: Any, link_gbit: float | None, cost_model: PushCostModel | None) -> None:
    """The checks of ``delta="auto"``'s options, for every updater that has them: ``link_gbit``
    positive or None, and neither option without ``delta="auto"``."""
    if delta == "auto":
        if link_gbit is not None and not link_gbit > 0:
            raise ValueError(f"link_gbit must be positive or None (measured), got {link_gbit}; e.g. 10.")
    elif link_gbit is not None or cost_model is not None:
        raise ValueError(
            f"link_gbit and cost_model only choose between delta and full pushes: set delta='auto' (delta is {delta!r})."
        )


def _check_bandwidth(bandwidth_gbit: float) -> None:
    if not bandwidth_gbit > 0:
        raise ValueError(f"bandwidth_gbit must be positive, got {bandwidth_gbit}; e.g. 10 for a 10 Gbit/s link.")


def _check_fraction(fraction: float) -> None:
    if not 0 <= fraction <= 1:
        raise ValueError(f"delta_fraction must be in [0, 1], got {fraction}.")
