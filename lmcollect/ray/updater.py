"""RayRemoteWeightUpdater: one object-store copy per push, loaded in place by every collector actor."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from lmcollect.collectors.shared.weights import HoldsWeightUpdater
from lmcollect.ray.carrier import put_weights
from lmcollect.ray.loader_proxy import ActorWeightLoader
from lmcollect.weight_sync.base import WeightPushError, WeightUpdaterBase, WorkerIds
from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weights.buckets import WeightBuckets, pack_buckets, view_buckets
from lmcollect.weights.cost_model import RAY_CPU_PUSH_COST, DeltaChooser
from lmcollect.weights.delta import (
    DeltaBase,
    DeltaConfig,
    DeltaRejectedError,
    PreparedPush,
    PushStats,
    distinct_nbytes,
    distinct_tensors,
    resolve_delta,
)
from lmcollect.weights.lora import LoraAdapter
from lmcollect.weights.push_config import PushConfig, push_config_or_default
from lmcollect.weights.tensors import (
    Metadata,
    WeightDict,
    agreed_held_dtypes,
    align_names,
    narrowest_held_dtypes,
    non_finite_problems,
    problems_per_receiver,
    raise_if_problems,
    to_weight_dict,
)
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)


RayPushConfig = PushConfig
"""Deprecated: the former name of :class:`~lmcollect.weights.push_config.PushConfig` (the same class), kept
so code that names it keeps working; new code imports ``PushConfig`` from ``lmcollect.weight_sync``."""


class RayRemoteWeightUpdater(WeightUpdaterBase[int]):
    """Pushes weights to collectors running as Ray actors (``RayLLMCollector`` s or actor handles).

    One push, in order: (1) check the weights on the driver against the metadata every worker
    reported once (names, shapes, dtypes; no NaN/Inf unless ``allow_non_finite``): a bad push
    raises one ValueError and no worker changes anything; (2) ``ray.put`` the weights once (a layout plus byte buffers), shared by
    every worker; (3) each targeted worker maps the object zero-copy, checks it again, pauses its
    policy (write lock), copies into its parameters in place, resets its prefix cache, takes the
    push's version (the updater's counter, or ``push_weights(version=N)``) and resumes; (4) ``push_weights`` returns when all have applied (or, with
    ``wait=False``, at once with a :class:`PushHandle`). At most one push is in flight: a new
    push first waits for the previous one, so workers apply pushes in order.

    With ``PushConfig(delta=True)``, step (2) puts only the elements that changed since the
    last push (compared bit for bit with the driver's copy of it) for the workers that hold that
    push; each checks the delta's base version, writes it and verifies per-tensor checksums,
    or refuses with its weights untouched. Workers that did not hold the base, or refused, get
    the full weights within the same push (``last_push_stats`` says who got what).

    Args:
        policy_weights: what ``push_weights()`` pushes when given nothing (a module, TensorDict
            or dict, read at push time).
        remote_collectors: ``RayLLMCollector`` objects or collector actor handles; worker ``i``
            is ``remote_collectors[i]``. None: the collector this updater gets registered with.
        max_interval: a worker is skipped until it has missed ``max_interval`` pushes in a row
            (0: every push reaches every worker).
        config: timeout, dtype conversion, packing, delta, zero copy (see
            :class:`~lmcollect.weights.push_config.PushConfig`; its process-group options are refused).

    Example::

        collectors = [RayLLMCollector(make_env, policy_factory=make_policy, dialog_turns_per_batch=64)
                      for _ in range(2)]
        updater = RayRemoteWeightUpdater(trainer_model, collectors)
        for step in range(num_steps):
            batch = collectors[step % 2].next()
            train_step(trainer_model, batch)
            updater.push_weights()  # every collector now generates with the new weights
    """

    def __init__(
        self,
        policy_weights: Any = None,
        remote_collectors: list[Any] | None = None,
        max_interval: int = 0,
        *,
        config: PushConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(max_interval, bool) or not isinstance(max_interval, int) or max_interval < 0:
            raise ValueError(f"max_interval must be an int >= 0 (0: update every push), got {max_interval!r}.")
        self._policy_weights = policy_weights
        # each worker's target: a proxy of its actor's loader (a RayLLMCollector's remembers pushes for restarts)
        self._loaders = [_loader_of(c, i) for i, c in enumerate(remote_collectors or [])]
        self.max_interval = max_interval
        self.config = push_config_or_default(config, updater="RayRemoteWeightUpdater")
        self.config.check_for("ray", updater="RayRemoteWeightUpdater")
        self._missed = [0] * len(self._loaders)  # pushes each worker missed in a row
        self._missed_before_push = list(self._missed)
        self._worker_metadata: list[tuple[dict, dict]] | None = None
        self._in_flight: PushHandle | None = None
        self._pack_out: list | None = None
        auto = self.config.delta == "auto"
        delta = None if auto else resolve_delta(self.config.delta)  # type: ignore[arg-type]
        self._delta_base = DeltaBase(delta) if delta is not None else None
        self._chooser = (
            DeltaChooser(self.config.cost_model or RAY_CPU_PUSH_COST, bandwidth_gbit=self.config.link_gbit)
            if auto
            else None
        )
        self._held: list[PushVersion | None] = [None] * len(self._loaders)  # what each worker got from us

    def register_collector(self, collector: Any) -> None:
        """Register the collector; with no ``remote_collectors`` it becomes worker 0."""
        super().register_collector(collector)
        if not self._loaders:
            self._loaders = [_loader_of(collector, 0)]
            self._missed = [0]
            self._held = [None]

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Fetch every worker's weight metadata now, so the first push does not wait for it."""
        self._fetch_metadata()

    def all_worker_ids(self) -> list[int]:
        """Indices of the remote collectors: ``[0, ..., len(remote_collectors) - 1]``."""
        return list(range(len(self._loaders)))

    # ------------------------------------------------------------------ the steps of a push
    def _get_server_weights(self) -> WeightDict | None:
        return None if self._policy_weights is None else to_weight_dict(self._policy_weights)

    def reset_delta_base(self) -> None:
        """Forget the last pushed weights (with ``delta``): the next push is a full push to every worker."""
        if self._delta_base is not None:
            self._settle_in_flight()
            self._delta_base.reset()

    def _skip_update(self, worker_id: int) -> bool:
        if self._missed[worker_id] < self.max_interval:
            self._missed[worker_id] += 1
            return True
        self._missed[worker_id] = 0
        return False

    def _validate(self, weights: WeightDict, worker_ids: list[int]) -> None:
        """Check against what every targeted worker reported, so a bad push reaches none of them."""
        self._missed_before_push = list(self._missed)  # restored if the push is refused after the skips count
        convert = self.config.convert_dtype
        check_finite = not self.config.allow_non_finite and self._delta_base is None  # with delta: on what is sent
        if check_finite and not convert:
            raise_if_problems(non_finite_problems(weights))
        metadata = self._fetch_metadata()
        if check_finite and convert:  # on the values the workers will hold
            held = narrowest_held_dtypes(weights, (metadata[worker_id] for worker_id in worker_ids))
            raise_if_problems(non_finite_problems(weights, dtypes=held))
        per_worker = problems_per_receiver(weights, (metadata[w] for w in worker_ids), convert_dtype=convert)
        groups: dict[tuple[str, ...], list[int]] = {}  # the same problems -> the workers that have them
        for worker_id, found in zip(worker_ids, per_worker, strict=True):
            if found:
                groups.setdefault(tuple(found), []).append(worker_id)
        problems = [
            p if len(groups) == 1 else f"worker(s) {workers}: {p}" for found, workers in groups.items() for p in found
        ]
        raise_if_problems(problems, where=f" for worker(s) {sorted(w for ws in groups.values() for w in ws)}")

    def _workers_version(self) -> int:
        refs = {i: loader.version_index_ref() for i, loader in enumerate(self._loaders)}
        found = gather_refs(refs, what="report its policy version", timeout_s=self.config.timeout_s)
        return max(found.values(), default=0)

    def _fetch_metadata(self) -> list[tuple[dict, dict]]:
        if self._worker_metadata is None:
            refs = {i: loader.metadata_ref() for i, loader in enumerate(self._loaders)}
            found = gather_refs(refs, what="report its model's weight metadata", timeout_s=self.config.timeout_s)
            self._worker_metadata = [found[i] for i in range(len(self._loaders))]
        return self._worker_metadata

    def _payload(self, weights: WeightDict) -> WeightBuckets:
        if self.config.packing == "views":
            return view_buckets(weights)
        buckets = pack_buckets(
            weights, bucket_size_bytes=self.config.bucket_size_bytes, out=self._pack_out, device="cpu"
        )
        self._pack_out = buckets.buffers  # reused next push: ray.put copies, so this is free again
        return buckets

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: Any, version: PushVersion) -> Any:
        """Ask worker ``worker_id`` to apply the payload behind the ObjectRef ``server_weights``."""
        # NaN/Inf were refused here, before ray.put (or allowed by the config): not checked again in the actor
        options = LoadOptions(
            version=version,
            convert_dtype=self.config.convert_dtype,
            zero_copy=self.config.zero_copy,
            allow_non_finite=True,
        )
        return self._loaders[worker_id].load_ref(server_weights, options)  # remembered for a restart

    def _aligned(self, weights: WeightDict) -> WeightDict:
        """Names spelled as the workers' models spell them (a policy wrapping ``.model`` sends ``model.*``)."""
        expected, aliases = self._fetch_metadata()[0]
        return align_names(weights, set(expected) | set(aliases))

    # ------------------------------------------------------------------ pushing
    def push_weights(
        self,
        policy_or_weights: Any = None,
        worker_ids: WorkerIds = None,
        *,
        wait: bool = True,
        version: int | None = None,
    ) -> PushHandle | None:
        """Push to ``worker_ids`` (default: all) as ``version`` (default: one more than the last
        push; only ever up). Returns None once every targeted worker has applied the weights, or
        with ``wait=False`` a :class:`PushHandle` right away."""
        handle = self._push(policy_or_weights, worker_ids, version=version, wait=wait)
        assert handle is None or isinstance(handle, PushHandle)
        return handle

    def _before_push(self) -> None:
        if not self._loaders:
            raise ValueError(
                "this RayRemoteWeightUpdater has no workers: pass remote_collectors=[...] or register a collector."
            )
        self._settle_in_flight()

    def _prepare_weights(self, weights: WeightDict) -> WeightDict:
        weights = self._aligned(weights)
        if self._chooser is not None:
            self._choose_delta(weights)
        return weights

    def _adapter_metadata(self, worker_id: int) -> Metadata | None:
        return self._fetch_metadata()[worker_id][0]

    def _plan(self, payload: WeightDict | LoraAdapter, targets: list[int]) -> _DeltaPlan | None:
        """With delta pushes: the delta for the workers holding the base, encoded and checked."""
        if isinstance(payload, LoraAdapter) or self._delta_base is None or not targets:
            return None  # an adapter is never a delta; the workers' delta base stays as it was
        try:
            return self._plan_delta(payload, targets)
        except Exception:
            self._missed = self._missed_before_push  # refused before anything changed: the skip counts too
            raise

    def _send(
        self, payload: WeightDict | LoraAdapter, targets: list[int], pushed: PushVersion, plan: _DeltaPlan | None
    ) -> _Sent:
        """One ``ray.put`` shared by every target (an adapter, the weights, or a delta and the full
        weights for the workers that do not hold its base)."""
        if plan is not None:
            return _Sent(*self._send_delta_plan(plan, pushed))
        if isinstance(payload, LoraAdapter):
            stats, payload_ref = PushStats.lora(payload.nbytes, num_receivers=len(targets)), put_weights(payload)
        elif targets:
            buckets = self._payload(payload)
            stats, payload_ref = PushStats.full(buckets.nbytes, num_full=len(targets)), put_weights(buckets)
        else:
            return _Sent({}, None)
        self.last_push_stats = stats
        return _Sent(
            {
                i: self._sync_weights_with_worker(worker_id=i, server_weights=payload_ref, version=pushed)
                for i in targets
            }
        )

    def _finish(
        self, sent: _Sent, targets: list[int], pushed: PushVersion, *, started: float, wait: bool
    ) -> PushHandle | None:
        """Wait for every target (or hand back a :class:`PushHandle` with ``wait=False``); a waited
        full or delta push also tells ``delta="auto"`` what it cost."""
        handle = self._handle(sent.refs, targets, pushed, repair=sent.repair, wait=wait)
        self._record_call_s(started if wait else None)
        stats = self.last_push_stats
        if self._chooser is not None and targets and stats is not None and stats.kind != "lora":
            seconds = time.perf_counter() - started if wait else None  # only a waited push is timed
            self._chooser.observe(stats.kind, stats.nbytes, stats.full_nbytes, seconds)
        return handle

    def _choose_delta(self, weights: WeightDict) -> None:
        """``delta="auto"``: turn delta mode on (a base kept from the next push) or off (base dropped)."""
        assert self._chooser is not None
        use_delta = self._chooser.use_delta(distinct_nbytes(weights))
        if use_delta and self._delta_base is None:
            self._delta_base = DeltaBase(DeltaConfig())
            logger.info("delta='auto': delta pushes (link %s Gbit/s)", self._chooser.link_gbit)
        elif not use_delta and self._delta_base is not None:
            self._delta_base = None
            logger.info("delta='auto': full pushes (link %s Gbit/s)", self._chooser.link_gbit)

    @property
    def uses_delta(self) -> bool:
        """Whether the next push may be a delta push (with ``delta="auto"``: what was chosen last)."""
        return self._delta_base is not None

    def _handle(
        self,
        refs: dict[int, Any],
        targets: list[int],
        pushed: PushVersion,
        *,
        repair: Callable[[list[int]], dict[int, Any]] | None,
        wait: bool,
    ) -> PushHandle | None:
        """Wait for the push's ``refs`` (or hand them back in a :class:`PushHandle` with ``wait=False``)."""
        handle = PushHandle(
            refs,
            timeout_s=self.config.timeout_s,
            on_done=self._run_post_hooks if targets else None,
            repair=repair,
            on_settled=lambda ok, repaired: self._record_held(targets, pushed if ok else None, repaired),
        )
        if wait:
            handle.wait()
            return None
        self._in_flight = handle
        return handle

    def _settle_in_flight(self) -> None:
        handle, self._in_flight = self._in_flight, None
        if handle is not None:
            handle.settle()

    # ------------------------------------------------------------------ delta pushes
    def _plan_delta(self, weights: WeightDict, targets: list[int]) -> _DeltaPlan:
        """Encode the delta for the workers holding the base (nothing changes yet); check what is
        sent for NaN/Inf: the changed values, or the whole weights for a full push."""
        base = self._delta_base
        assert base is not None
        dtypes = agreed_held_dtypes(  # the base is kept, and compared, in the workers' dtypes
            distinct_tensors(weights),
            self._fetch_metadata(),
            why_one="a delta base needs one: give every collector the same dtype, or push with PushConfig(delta=False).",
        )
        eligible = [i for i in targets if base.version is not None and self._held[i] == base.version]
        encoded = base.encode(weights, dtypes) if eligible else None
        delta_targets = eligible if encoded is not None else []
        plan = _DeltaPlan(weights, dtypes, encoded, delta_targets, [i for i in targets if i not in delta_targets])
        if not self.config.allow_non_finite:
            raise_if_problems(non_finite_problems(plan.sent_values(), dtypes=dtypes))
        return plan

    def _send_delta_plan(
        self, plan: _DeltaPlan, pushed: PushVersion
    ) -> tuple[dict[int, Any], Callable[[list[int]], dict[int, Any]]]:
        """Commit the plan into the base, then send the delta and/or the full weights (the base)."""
        base = self._delta_base
        assert base is not None
        if plan.encoded is not None:
            base.commit(plan.encoded, pushed)
        else:
            base.snapshot(plan.weights, pushed, plan.dtypes)
        tensors = base.tensors  # the pushed weights until the next push (which settles this one first)
        full_ref: list[Any] = []

        def send_full(worker_ids: list[int]) -> dict[int, Any]:
            if not full_ref:
                full_ref.append(put_weights(tensors))
            return {
                i: self._sync_weights_with_worker(worker_id=i, server_weights=full_ref[0], version=pushed)
                for i in worker_ids
            }

        refs: dict[int, Any] = {}
        if plan.delta_targets:
            assert plan.encoded is not None, "a plan has delta targets only when the delta was encoded"
            delta_ref = put_weights(plan.encoded.delta)
            options = LoadOptions(version=pushed, convert_dtype=self.config.convert_dtype)
            for i in plan.delta_targets:  # not remembered for restarts: a restarted worker gets a full push
                refs[i] = self._loaders[i].load_ref(delta_ref, options, remember=False)
        refs.update(send_full(plan.full_targets) if plan.full_targets else {})
        full_nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if plan.encoded is not None and plan.delta_targets:
            self.last_push_stats = plan.encoded.stats(num_full=len(plan.full_targets))
        else:
            self.last_push_stats = PushStats.full(full_nbytes, num_full=len(plan.full_targets))
        return refs, send_full

    def _record_held(self, targets: list[int], version: PushVersion | None, repaired: list[int]) -> None:
        """After a push settled: what each targeted worker holds (None: unknown, it failed)."""
        for i in targets:
            self._held[i] = version
        stats = self.last_push_stats
        if repaired and stats is not None:
            self.last_push_stats = replace(stats, num_full=stats.num_full + len(repaired), num_repaired=len(repaired))


RayWeightUpdater = RayRemoteWeightUpdater


@dataclass
class _Sent:
    """What :meth:`RayRemoteWeightUpdater._send` started: a reference per target, and the full push
    for the workers that refuse a delta (None: not a delta push)."""

    refs: dict[int, Any]
    repair: Callable[[list[int]], dict[int, Any]] | None = None


@dataclass
class _DeltaPlan(PreparedPush):
    """One delta-mode push, decided before anything changes (``encoded`` None: a full push for every target)."""

    delta_targets: list[int] = field(default_factory=list)
    full_targets: list[int] = field(default_factory=list)


class PushHandle:
    """A push in flight (``push_weights(..., wait=False)``): :meth:`wait` returns once every
    targeted worker has applied the weights, and raises if one failed."""

    def __init__(
        self,
        refs: dict[int, Any],
        *,
        timeout_s: float | None,
        on_done: Callable[[], None] | None = None,
        repair: Callable[[list[int]], dict[int, Any]] | None = None,
        on_settled: Callable[[bool, list[int]], None] | None = None,
    ) -> None:
        self._refs = refs
        self._timeout_s = timeout_s
        self._on_done = on_done
        self._repair = repair  # a full push to the workers that refused a delta
        self._on_settled = on_settled  # (applied everywhere?, workers repaired)
        self._error: BaseException | None = None
        self._finished = not refs
        self._reported = False
        if self._finished:
            if on_settled is not None:
                on_settled(True, [])
            if on_done is not None:
                on_done()

    @property
    def worker_ids(self) -> list[int]:
        """The workers this push updates (skipped workers are not in it)."""
        return sorted(self._refs)

    def done(self) -> bool:
        """True when every targeted worker has answered (applied, or failed)."""
        if self._finished:
            return True
        refs = list(self._refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every targeted worker applied the push (None: the updater's timeout_s)."""
        self._reported = True
        self._wait(self._timeout_s if timeout_s is None else timeout_s)

    def settle(self) -> None:
        """Wait for the push; raise its error only if nobody has seen it yet."""
        try:
            self._wait(self._timeout_s)
        except Exception:
            if self._reported:
                logger.info("an earlier push failed (already reported); pushing the next one")
                return
            self._reported = True
            raise

    def _wait(self, timeout_s: float | None) -> None:
        if self._error is not None:
            raise self._error
        if self._finished:
            return
        repaired: list[int] = []
        try:
            tolerate = DeltaRejectedError if self._repair is not None else None
            results = gather_refs(self._refs, what="apply the weights", timeout_s=timeout_s, tolerate=tolerate)
            repaired = sorted(i for i, result in results.items() if isinstance(result, DeltaRejectedError))
            if repaired:
                assert self._repair is not None, "refusals are tolerated only by a push that can repair them"
                logger.info(
                    "worker(s) %s refused the delta push (%s); sending them a full push", repaired, results[repaired[0]]
                )
                gather_refs(
                    self._repair(repaired), what="apply a full push after refusing a delta", timeout_s=timeout_s
                )
        except Exception as exc:
            self._error = exc
            if self._on_settled is not None:
                self._on_settled(False, repaired)
            raise
        self._finished = True
        if self._on_settled is not None:
            self._on_settled(True, repaired)
        if self._on_done is not None:
            self._on_done()


def gather_refs(
    refs: dict[int, Any], *, what: str, timeout_s: float | None, tolerate: type[Exception] | None = None
) -> dict[int, Any]:
    """worker -> result of each ref; fails fast, naming the worker, if one died, raised or timed out.
    A worker raising ``tolerate`` gets that exception as its result instead."""
    worker_of = {ref: worker for worker, ref in refs.items()}
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs.values())
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            late = sorted(worker_of[r] for r in pending)
            raise WeightPushError(
                f"worker(s) {late} did not {what} within timeout_s={timeout_s}; they may be hung "
                "or overloaded. Raise PushConfig(timeout_s=...) if they are only slow."
            )
        for ref in ready:
            results[worker_of[ref]] = _get(ref, worker_of[ref], what, tolerate)
    return results


def _get(ref: Any, worker: int, what: str, tolerate: type[Exception] | None = None) -> Any:
    try:
        return ray.get(ref)
    except RayActorError as exc:
        raise WeightPushError(f"worker {worker} died before it could {what}: {_first_line(exc)}") from exc
    except RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        if tolerate is not None and isinstance(cause, tolerate):
            return cause
        if isinstance(cause, (ValueError, TypeError)):
            kind = ValueError if isinstance(cause, ValueError) else TypeError
            raise kind(f"worker {worker} rejected the push: {cause}") from exc
        raise WeightPushError(f"worker {worker} failed to {what}: {cause!r}") from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def _loader_of(collector: Any, index: int) -> ActorWeightLoader:
    """The target of ``remote_collectors[index]``: a proxy of its actor's weight loader."""
    if isinstance(collector, ActorHandle):
        return ActorWeightLoader(collector)
    target = collector.weight_target() if isinstance(collector, HoldsWeightUpdater) else None
    if isinstance(target, ActorWeightLoader):  # a RayLLMCollector's (it remembers pushes for restarts)
        return target
    raise TypeError(
        f"remote_collectors[{index}] is a {type(collector).__name__}; pass RayLLMCollector objects or "
        "the actor handles of collector actors."
    )
