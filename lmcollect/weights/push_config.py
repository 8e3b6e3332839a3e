"""PushConfig: how an updater pushes weights, one config type for every updater (Ray and process group)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from lmcollect.weights.cost_model import PushCostModel, check_auto_delta_options
from lmcollect.weights.delta import DeltaConfig, resolve_delta

Mechanism = Literal["in process", "ray", "process group"]
Backend = Literal["auto", "gloo", "nccl"]

# The options only one mechanism reads; the others refuse them when set (so none is silently ignored).
# Each group is what that mechanism's sender adds to the options every mechanism reads.
RAY_ONLY = ("packing", "zero_copy")
PROCESS_GROUP_ONLY = ("verify", "digest", "backend", "master_address", "master_port", "vllm_tp_size")
ONLY_FOR: dict[str, tuple[str, ...]] = {"ray": RAY_ONLY, "process group": PROCESS_GROUP_ONLY}
NOT_IN_PROCESS = ("delta", "link_gbit", "cost_model", "bucket_size_bytes")
"""What an in-process push (``LocalWeightUpdater``: a copy into the model) has no use for."""


@dataclass(frozen=True, kw_only=True)
class PushConfig:
    """How an updater pushes: ``LocalWeightUpdater(config=...)``, ``RayRemoteWeightUpdater(config=...)``,
    ``vLLMUpdater(config=...)`` and a process group's ``ProcessGroupConfig(push=...)``.

    The options every mechanism reads come first; those marked "Ray only" or "process group only"
    are refused by the other mechanisms when set to anything but their default (an in-process
    push also refuses the delta and bucket options: it copies the weights in place).

    Example::

        config = PushConfig(delta="auto", timeout_s=60, convert_dtype=True)
        RayRemoteWeightUpdater(trainer_model, collectors, config=config)
        vLLMUpdater(config=PushConfig(verify=True, timeout_s=60))
    """

    timeout_s: float | None = 300.0
    """Longest wait for every targeted worker to apply a push (and, process group, for ``init``
    to form the group). A worker that died fails the push at once, one that takes longer with
    ``WeightPushError``. None: no limit (Ray only: a process-group push needs a bound)."""
    convert_dtype: bool = False
    """Cast floating tensors to the receiving model's dtype (e.g. an fp32 trainer into a bf16
    engine; only the engine's bytes travel); False: a dtype mismatch rejects the push."""
    allow_non_finite: bool = False
    """Push weights holding NaN or infinite values; False: such a push is refused before any worker
    changes anything (one min/max pass per floating tensor; with delta, over the changed values only)."""
    bucket_size_bytes: int | None = None
    """Largest buffer the weights are packed into. None: the mechanism's default (process group:
    64 MiB; Ray with ``packing="flat"``: one buffer per dtype; Ray ``"views"`` packs no buffer)."""
    delta: bool | DeltaConfig | Literal["auto"] = False
    """Delta pushes (True, or a :class:`~lmcollect.weights.delta.DeltaConfig`): after the first push
    only the elements that changed since the last one travel, with per-tensor checksums; the sender
    keeps a copy of the last push (in the receivers' dtypes). A receiver that holds another version
    or whose checksum fails gets the full weights in the same push. False: full pushes. "auto":
    before each push, a delta if ``cost_model`` predicts it faster than a full push over the link
    (``link_gbit``, or the rate measured from the last full push) for a delta the size of the last
    one (5% of the bytes before any), else a full push with no copy kept; see docs/scaling.md."""
    link_gbit: float | None = None
    """With ``delta="auto"``: the rate of the link to the receivers (the slowest), in Gbit/s. None:
    measured, through ``cost_model``, from the time of each full push (the first push is full)."""
    cost_model: PushCostModel | None = None
    """With ``delta="auto"``: the push cost model it decides by (None: the updater's own fit on this
    project's CPU machine, ``RAY_CPU_PUSH_COST`` or ``VLLM_CPU_PUSH_COST``; fit yours with
    ``fit_push_cost`` on benchmarks/links.py)."""
    packing: Literal["views", "flat"] = "views"
    """Ray only. "views": each tensor's bytes go straight into the one object-store object (one
    copy on the driver). "flat": copy into one buffer per dtype first (one more copy, fewer buffers)."""
    zero_copy: bool = False
    """Ray only. Workers point their model's tensors at the pushed object instead of copying it:
    Ray maps the object store's shared memory into every worker on a node, so a push costs one copy
    (the driver's ``ray.put``) however many collectors share the node, and they hold one copy of the
    weights between them. The mapped memory is read-only: only pushes write it (a later copying
    load or delta push first gives the model private tensors again). Not with ``delta``, which
    patches the weights in place."""
    verify: bool = False
    """Process group only. Workers return a CRC32 of every bucket of the weights they now hold
    (after a delta: of the patched copy); a mismatch with the sender's raises ``WeightPushError``."""
    digest: bool = True
    """Process group only. Authenticate every full push's bytes with a keyed digest that each
    worker verifies before it reloads anything (see ``ProcessGroupConfig.digest``); False: for an
    engine on a network nothing untrusted reaches, to save hashing every byte on both sides."""
    backend: Backend = "auto"
    """Process group only. "auto" (NCCL when the pushed weights are on CUDA, else gloo), "gloo" or "nccl"."""
    master_address: str | None = None
    """Process group only. The address the workers reach the trainer at (rank 0). None: chosen
    when the group forms: loopback when every engine worker is on this Ray node (or Ray is not
    running here), else this node's IP as Ray reports it. The rendezvous store listens on every
    interface regardless: firewall ``master_port``."""
    master_port: int | None = None
    """Process group only. Port of the rendezvous store, on all interfaces (None: a free one)."""
    vllm_tp_size: int | None = None
    """Process group only. Tensor-parallel size of each vLLM engine replica (None: 1)."""

    def __post_init__(self) -> None:
        if self.delta != "auto":
            resolve_delta(self.delta)  # a TypeError for anything but a bool, a DeltaConfig or "auto"
        check_auto_delta_options(self.delta, self.link_gbit, self.cost_model)
        if self.zero_copy and self.delta:
            raise ValueError(
                "zero_copy=True and delta cannot be combined: a delta patches the workers' weights in place, "
                "zero-copy weights are read-only shared memory. Pick one (delta for small changes over a "
                "slow link, zero_copy for collectors sharing a node)."
            )
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {self.timeout_s}.")
        if self.packing not in ("views", "flat"):
            raise ValueError(f"packing must be 'views' or 'flat', got {self.packing!r}.")
        _check_positive_int("bucket_size_bytes", self.bucket_size_bytes)
        _check_positive_int("vllm_tp_size", self.vllm_tp_size)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}.")
        if self.master_port is not None and (
            isinstance(self.master_port, bool) or not isinstance(self.master_port, int) or self.master_port < 0
        ):
            raise ValueError(f"master_port must be an int >= 0 or None (a free one), got {self.master_port!r}.")

    def check_for(self, mechanism: Mechanism, *, updater: str) -> None:
        """Refuse the options the other mechanisms alone read, when set (a ValueError naming them)."""
        defaults = {f.name: f.default for f in fields(self)}
        for other, only in ONLY_FOR.items():
            set_ = [f"{name}={getattr(self, name)!r}" for name in only if getattr(self, name) != defaults[name]]
            if other != mechanism and set_:
                raise ValueError(
                    f"{updater} pushes through the {mechanism} mechanism, which does not read PushConfig "
                    f"option(s) {', '.join(set_)}: remove them (they are {'Ray' if other == 'ray' else other} only)."
                )
        unused = [f"{name}={getattr(self, name)!r}" for name in NOT_IN_PROCESS if getattr(self, name) != defaults[name]]
        if mechanism == "in process" and unused:
            raise ValueError(
                f"{updater} copies the weights in place, in this process: PushConfig option(s) {', '.join(unused)} "
                "are for pushes that travel (Ray, process group); remove them."
            )
        if mechanism == "process group" and self.timeout_s is None:
            raise ValueError(
                f"{updater} needs a bound on each push: PushConfig(timeout_s=None) (no limit) is Ray only; "
                "give timeout_s in seconds, e.g. 300."
            )


def with_keywords(config: PushConfig, *, updater: str, **keywords: Any) -> PushConfig:
    """``config`` with an updater's constructor keywords that were given (not None) set in it.

    A keyword that disagrees with a field ``config`` set to something else is a ValueError,
    so neither silently wins.
    """
    given = {name: value for name, value in keywords.items() if value is not None}
    defaults = PushConfig()
    clashes = [
        f"{name}={value!r} and config=PushConfig({name}={getattr(config, name)!r})"
        for name, value in given.items()
        if getattr(config, name) not in (value, getattr(defaults, name))
    ]
    if clashes:
        raise ValueError(
            f"{updater} got {'; '.join(clashes)}: give each setting once (the keyword or the config field)."
        )
    return replace(config, **given)


def push_config_or_default(config: PushConfig | None, *, updater: str) -> PushConfig:
    """``config``, or the defaults when None; anything else is a TypeError naming the fix."""
    if config is None:
        return PushConfig()
    if not isinstance(config, PushConfig):
        raise TypeError(
            f"{updater}(config=...) takes a PushConfig (lmcollect.weight_sync), got {type(config).__name__}."
        )
    return config


def _check_positive_int(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
