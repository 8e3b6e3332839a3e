"""Weight sync through Ray's object store: one object per push, pulled by each collector actor."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from lmcollect.ray.bounded import get_within
from lmcollect.ray.carrier import put_weights
from lmcollect.ray.loader_proxy import ActorWeightLoader
from lmcollect.ray.push_handle import PushHandle, gather_refs
from lmcollect.transports.base import WeightReceiver, WeightSender
from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weight_sync.sender import Payload, PushSender
from lmcollect.weights.buckets import WeightBuckets, pack_buckets, view_buckets
from lmcollect.weights.cost_model import RAY_CPU_PUSH_COST, DeltaChooser
from lmcollect.weights.delta import (
    DeltaBase,
    DeltaConfig,
    PreparedPush,
    PushStats,
    distinct_nbytes,
    distinct_tensors,
    resolve_delta,
)
from lmcollect.weights.lora import LoraAdapter, check_adapter
from lmcollect.weights.push_config import PushConfig
from lmcollect.weights.tensors import (
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


class WeightMailbox:
    """Holds the newest push (version and ObjectRef); a plain class, run as a tiny actor."""

    def __init__(self) -> None:
        self._version = 0
        self._refs: list[Any] = []

    def publish(self, version: int, refs: list[Any]) -> None:
        # refs arrive wrapped in a list, so Ray passes the ObjectRef itself, not its value
        self._version, self._refs = version, refs

    def latest(self, after_version: int) -> tuple[int, list[Any]] | None:
        return None if self._version <= after_version else (self._version, self._refs)

    def ready(self) -> bool:
        return True


class RayObjectStoreSender(WeightSender):
    """Puts each push into the object store once and posts its ref in a mailbox actor.

    Receivers (in collector actors, on any node) pull the newest push when their collector's
    ``receive_weights()`` runs: they map the object zero-copy and the collector loads it
    (checked, in place, under its policy lock, one version bump). Older pushes are freed once
    no receiver reads them.

    Example::

        sender = RayObjectStoreSender()
        collector.register_scheme_receiver({"policy": sender.make_receiver()}, synchronize_weights=False)
        sender.send(trainer_model)
        collector.receive_weights()

    Args:
        actor_options: options of the mailbox actor (default: no CPU reserved).
        call_timeout_s: longest a call into the mailbox waits (a hung mailbox raises
            :class:`~lmcollect.ray.bounded.CallTimeoutError` naming this knob).
        start_timeout_s: longest the first push waits for the mailbox actor to start (a new
            worker process: slow on a busy node), before its own ``call_timeout_s`` bound.
        allow_non_finite: publish weights holding NaN or infinite values; False (the default):
            such a push is refused before anything is put (receivers load what comes as checked here).
    """

    def __init__(
        self,
        *,
        actor_options: dict[str, Any] | None = None,
        call_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        allow_non_finite: bool = False,
    ) -> None:
        options = {"num_cpus": 0, **(actor_options or {})}
        self._mailbox = ray.remote(**options)(WeightMailbox).remote()
        self._version = 0
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self._started = False
        self.allow_non_finite = allow_non_finite

    def send(self, weights: object) -> None:
        weights = to_weight_dict(weights)
        if not self.allow_non_finite:
            raise_if_problems(non_finite_problems(weights), where=" before publishing (or allow_non_finite=True)")
        if not self._started:
            _wait_started(self._mailbox, self.start_timeout_s, "RayObjectStoreSender(start_timeout_s=...)")
            self._started = True
        ref = put_weights(weights)
        get_within(
            self._mailbox.publish.remote(self._version + 1, [ref]),
            timeout_s=self.call_timeout_s,
            call="RayObjectStoreSender.send (publish)",
            knob="RayObjectStoreSender(call_timeout_s=...)",
        )
        self._version += 1

    def make_receiver(self, *, call_timeout_s: float = 60.0) -> RayObjectStoreReceiver:
        """A receiver of this sender's pushes (its first pull waits up to ``start_timeout_s`` for the mailbox)."""
        return RayObjectStoreReceiver(
            self._mailbox,
            call_timeout_s=call_timeout_s,
            start_timeout_s=None if self._started else self.start_timeout_s,
        )

    def close(self) -> None:
        ray.kill(self._mailbox)


class RayObjectStoreReceiver(WeightReceiver):
    """Pulls the newest push from a :class:`RayObjectStoreSender` 's mailbox (see the sender)."""

    def __init__(self, mailbox: Any, *, call_timeout_s: float = 60.0, start_timeout_s: float | None = None) -> None:
        super().__init__()
        self._mailbox = mailbox
        self._seen = 0
        self.call_timeout_s = call_timeout_s
        self._start_timeout_s = start_timeout_s  # None: the mailbox is known to run

    def receive(self, timeout_s: float | None = None) -> WeightDict | None:
        """Views of the newest push's tensors (valid while the caller holds them), or None."""
        if self._start_timeout_s is not None:
            _wait_started(self._mailbox, self._start_timeout_s, "RayObjectStoreSender(start_timeout_s=...)")
            self._start_timeout_s = None
        knob = "make_receiver(call_timeout_s=...)"
        found = get_within(
            self._mailbox.latest.remote(self._seen),
            timeout_s=self.call_timeout_s,
            call="RayObjectStoreReceiver.receive (latest)",
            knob=knob,
        )
        if found is None:
            return None
        version, (ref,) = found
        buckets = get_within(
            ref, timeout_s=self.call_timeout_s, call="RayObjectStoreReceiver.receive (the weights)", knob=knob
        )
        self._seen = version
        return buckets.tensors()


def _wait_started(mailbox: Any, timeout_s: float, knob: str) -> None:
    """Wait for the mailbox actor to start (a new worker process: slow on a busy node), bounded on
    its own, so that each call's bound is for the call alone."""
    get_within(mailbox.ready.remote(), timeout_s=timeout_s, call="starting the weight mailbox actor", knob=knob)


class ObjectStorePushSender(PushSender[int]):
    """``RayRemoteWeightUpdater``'s mechanism: one ``ray.put`` per push, loaded by every collector actor.

    :meth:`check` tests the weights on the driver against the metadata every worker reported once
    (names, shapes, dtypes; NaN/Inf unless ``allow_non_finite``), so a bad push reaches no worker;
    :meth:`send` puts them once (views of their bytes, or flat buckets with ``packing="flat"``) and
    asks each target's :class:`~lmcollect.ray.loader_proxy.ActorWeightLoader` to load the object
    (mapped zero-copy, copied in place, or pointed at with ``zero_copy``); :meth:`wait` gathers the
    answers, or hands back a :class:`~lmcollect.ray.push_handle.PushHandle`. At most one push is in
    flight: the next one first waits for it. With delta pushes, :meth:`plan` encodes the delta for
    the workers holding its base (the others, and any that refuse it, get the full weights).
    ``max_interval``: a worker is skipped until it missed that many pushes in a row.
    """

    def __init__(self, loaders: list[ActorWeightLoader], config: PushConfig, *, max_interval: int = 0) -> None:
        self.loaders = loaders
        self.config = config
        self.max_interval = max_interval
        self._missed = [0] * len(loaders)  # pushes each worker missed in a row
        self._missed_before_push = list(self._missed)
        self._held: list[PushVersion | None] = [None] * len(loaders)  # what each worker got from us
        self._metadata: list[tuple[dict, dict]] | None = None
        self._in_flight: PushHandle | None = None
        self._pack_out: list | None = None
        auto = config.delta == "auto"
        delta = None if auto else resolve_delta(config.delta)  # type: ignore[arg-type]
        self.delta_base = DeltaBase(delta) if delta is not None else None
        self._chooser = (
            DeltaChooser(config.cost_model or RAY_CPU_PUSH_COST, bandwidth_gbit=config.link_gbit) if auto else None
        )
        self._started = 0.0

    def add_worker(self, loader: ActorWeightLoader) -> None:
        self.loaders.append(loader)
        self._missed.append(0)
        self._held.append(None)
        self._metadata = None

    # ------------------------------------------------------------------ what every worker holds
    def metadata(self) -> list[tuple[dict, dict]]:
        """Each worker's (metadata, aliases), fetched once."""
        if self._metadata is None:
            refs = {i: loader.metadata_ref() for i, loader in enumerate(self.loaders)}
            found = gather_refs(refs, what="report its model's weight metadata", timeout_s=self.config.timeout_s)
            self._metadata = [found[i] for i in range(len(self.loaders))]
        return self._metadata

    def workers_version(self) -> int:
        """The highest version index the workers hold."""
        refs = {i: loader.version_index_ref() for i, loader in enumerate(self.loaders)}
        found = gather_refs(refs, what="report its policy version", timeout_s=self.config.timeout_s)
        return max(found.values(), default=0)

    def skip(self, worker_id: int) -> bool:
        """True while worker ``worker_id`` has missed fewer than ``max_interval`` pushes in a row."""
        if self._missed[worker_id] < self.max_interval:
            self._missed[worker_id] += 1
            return True
        self._missed[worker_id] = 0
        return False

    def reset_delta_base(self) -> None:
        if self.delta_base is not None:
            self.settle_in_flight()
            self.delta_base.reset()

    def settle_in_flight(self) -> None:
        handle, self._in_flight = self._in_flight, None
        if handle is not None:
            handle.settle()

    # ------------------------------------------------------------------ one push
    def before_push(self) -> None:
        if not self.loaders:
            raise ValueError(
                "this RayRemoteWeightUpdater has no workers: pass remote_collectors=[...] or register a collector."
            )
        self.settle_in_flight()
        self._started = time.perf_counter()

    def prepare(self, weights: WeightDict) -> WeightDict:
        """Names spelled as the workers' models spell them (a policy wrapping ``.model`` sends
        ``model.*``); with ``delta="auto"``, delta mode chosen for this push."""
        expected, aliases = self.metadata()[0]
        weights = align_names(weights, set(expected) | set(aliases))
        if self._chooser is not None:
            self._choose_delta(weights)
        return weights

    def check(self, payload: Payload, worker_ids: list[int]) -> None:
        """Against what every targeted worker reported, so a bad push reaches none of them."""
        metadata = self.metadata()
        if isinstance(payload, LoraAdapter):
            for worker_id in worker_ids:
                check_adapter(payload, metadata[worker_id][0], receiver=f"worker {worker_id}'s model")
            return
        self._missed_before_push = list(self._missed)  # restored if the push is refused after the skips count
        convert = self.config.convert_dtype
        if not self.config.allow_non_finite and self.delta_base is None:  # with delta: on what is sent (plan)
            held = narrowest_held_dtypes(payload, (metadata[w] for w in worker_ids)) if convert else None
            raise_if_problems(non_finite_problems(payload, dtypes=held))  # on the values the workers will hold
        per_worker = problems_per_receiver(payload, (metadata[w] for w in worker_ids), convert_dtype=convert)
        groups: dict[tuple[str, ...], list[int]] = {}  # the same problems -> the workers that have them
        for worker_id, found in zip(worker_ids, per_worker, strict=True):
            if found:
                groups.setdefault(tuple(found), []).append(worker_id)
        problems = [
            p if len(groups) == 1 else f"worker(s) {workers}: {p}" for found, workers in groups.items() for p in found
        ]
        raise_if_problems(problems, where=f" for worker(s) {sorted(w for ws in groups.values() for w in ws)}")

    def plan(self, payload: Payload, targets: list[int]) -> DeltaPlan | None:
        """With delta pushes: the delta for the workers holding the base, encoded and checked."""
        if isinstance(payload, LoraAdapter) or self.delta_base is None or not targets:
            return None  # an adapter is never a delta; the workers' delta base stays as it was
        try:
            return self._plan_delta(payload, targets)
        except Exception:
            self._missed = self._missed_before_push  # refused before anything changed: the skip counts too
            raise

    def send(self, payload: Payload, targets: list[int], pushed: PushVersion, plan: DeltaPlan | None) -> Sent:
        """One ``ray.put`` shared by every target (an adapter, the weights, or a delta and the full
        weights for the workers that do not hold its base)."""
        if plan is not None:
            return Sent(*self._send_delta_plan(plan, pushed))
        if not targets:
            return Sent({}, None)
        if isinstance(payload, LoraAdapter):
            stats, payload_ref = PushStats.lora(payload.nbytes, num_receivers=len(targets)), put_weights(payload)
        else:
            buckets = self._buckets(payload)
            stats, payload_ref = PushStats.full(buckets.nbytes, num_full=len(targets)), put_weights(buckets)
        self.last_push_stats = stats
        return Sent({i: self.load(i, payload_ref, pushed) for i in targets})

    def wait(
        self, sent: Sent, targets: list[int], pushed: PushVersion, *, wait: bool, on_done: Callable[[], None]
    ) -> PushHandle | None:
        """Wait for every target (or hand back a :class:`PushHandle` with ``wait=False``); a waited
        full or delta push also tells ``delta="auto"`` what it cost."""
        handle = PushHandle(
            sent.refs,
            timeout_s=self.config.timeout_s,
            on_done=on_done,
            repair=sent.repair,
            on_settled=lambda ok, repaired: self._record_held(targets, pushed if ok else None, repaired),
        )
        if wait:
            handle.wait()
        else:
            self._in_flight = handle
        stats = self.last_push_stats
        if self._chooser is not None and targets and stats is not None and stats.kind != "lora":
            seconds = time.perf_counter() - self._started if wait else None  # only a waited push is timed
            self._chooser.observe(stats.kind, stats.nbytes, stats.full_nbytes, seconds)
        return None if wait else handle

    def load(self, worker_id: int, payload_ref: Any, pushed: PushVersion) -> Any:
        """Ask worker ``worker_id`` to load the full push (or adapter) behind ``payload_ref``."""
        # NaN/Inf were refused here, before ray.put (or allowed by the config): not checked again in the actor
        options = LoadOptions(
            version=pushed, convert_dtype=self.config.convert_dtype, zero_copy=self.config.zero_copy,
            allow_non_finite=True,
        )  # fmt: skip
        return self.loaders[worker_id].load_ref(payload_ref, options)  # remembered for a restart

    # ------------------------------------------------------------------ helpers
    def _buckets(self, weights: WeightDict) -> WeightBuckets:
        if self.config.packing == "views":
            return view_buckets(weights)
        buckets = pack_buckets(
            weights, bucket_size_bytes=self.config.bucket_size_bytes, out=self._pack_out, device="cpu"
        )
        self._pack_out = buckets.buffers  # reused next push: ray.put copies, so this is free again
        return buckets

    def _choose_delta(self, weights: WeightDict) -> None:
        """``delta="auto"``: turn delta mode on (a base kept from the next push) or off (base dropped)."""
        assert self._chooser is not None
        use_delta = self._chooser.use_delta(distinct_nbytes(weights))
        if use_delta and self.delta_base is None:
            self.delta_base = DeltaBase(DeltaConfig())
            logger.info("delta='auto': delta pushes (link %s Gbit/s)", self._chooser.link_gbit)
        elif not use_delta and self.delta_base is not None:
            self.delta_base = None
            logger.info("delta='auto': full pushes (link %s Gbit/s)", self._chooser.link_gbit)

    @property
    def uses_delta(self) -> bool:
        """Whether the next push may be a delta push (with ``delta="auto"``: what was chosen last)."""
        return self.delta_base is not None

    # ------------------------------------------------------------------ delta pushes
    def _plan_delta(self, weights: WeightDict, targets: list[int]) -> DeltaPlan:
        """Encode the delta for the workers holding the base (nothing changes yet); check what is
        sent for NaN/Inf: the changed values, or the whole weights for a full push."""
        base = self.delta_base
        assert base is not None
        dtypes = agreed_held_dtypes(  # the base is kept, and compared, in the workers' dtypes
            distinct_tensors(weights),
            self.metadata(),
            why_one="a delta base needs one: give every collector the same dtype, or push with PushConfig(delta=False).",
        )
        eligible = [i for i in targets if base.version is not None and self._held[i] == base.version]
        encoded = base.encode(weights, dtypes) if eligible else None
        delta_targets = eligible if encoded is not None else []
        plan = DeltaPlan(weights, dtypes, encoded, delta_targets, [i for i in targets if i not in delta_targets])
        if not self.config.allow_non_finite:
            raise_if_problems(non_finite_problems(plan.sent_values(), dtypes=dtypes))
        return plan

    def _send_delta_plan(
        self, plan: DeltaPlan, pushed: PushVersion
    ) -> tuple[dict[int, Any], Callable[[list[int]], dict[int, Any]]]:
        """Commit the plan into the base, then send the delta and/or the full weights (the base)."""
        base = self.delta_base
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
            return {i: self.load(i, full_ref[0], pushed) for i in worker_ids}

        refs: dict[int, Any] = {}
        if plan.delta_targets:
            assert plan.encoded is not None, "a plan has delta targets only when the delta was encoded"
            delta_ref = put_weights(plan.encoded.delta)
            options = LoadOptions(version=pushed, convert_dtype=self.config.convert_dtype)
            for i in plan.delta_targets:  # not remembered for restarts: a restarted worker gets a full push
                refs[i] = self.loaders[i].load_ref(delta_ref, options, remember=False)
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


@dataclass
class Sent:
    """What :meth:`ObjectStorePushSender.send` started: a reference per target, and the full push
    for the workers that refuse a delta (None: not a delta push)."""

    refs: dict[int, Any]
    repair: Callable[[list[int]], dict[int, Any]] | None = None


@dataclass
class DeltaPlan(PreparedPush):
    """One delta-mode push, decided before anything changes (``encoded`` None: a full push for every target)."""

    delta_targets: list[int] = field(default_factory=list)
    full_targets: list[int] = field(default_factory=list)
