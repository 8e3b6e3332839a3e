"""The transport contract: what every weight sender x receiver pair must do.

Each check takes a :class:`TransportPair` (a sender, the receiver it feeds, and the collector whose
model that receiver loads into) and uses only its few methods, so every mechanism (in-process,
shared memory, the Ray object store, a process group) is held to the same behaviour:

- a full push arrives bit-exact and bumps the version once;
- a delta push (pushes after the first carry only what changed) arrives bit-exact;
- a LoRA adapter push leaves the base with the adapter merged on it;
- a refused payload (a wrong name, shape or dtype, NaN/Inf) raises one error naming the tensor, and
  the target's weights stay bitwise equal, its version unchanged; the pair still works afterwards;
- a push older than the version held is refused and changes nothing;
- a dead peer is an error within the pair's bound, never a hang.

A mechanism that lacks a feature leaves it out of :attr:`TransportPair.supports`; the check then
asserts the pair *refuses* it clearly (an error naming what it does not take, nothing changed)
instead of skipping. A pair's test module builds it (``tests/unit/test_transport_contract.py``
for the pairs without Ray, ``tests/integration/test_transport_contract_ray.py`` for the Ray
object store) and runs ``CHECKS`` over it.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcollect.collectors import LLMCollector
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.weights.delta import DeltaBase, DeltaConfig, WeightDelta
from lmcollect.weights.lora import LoraAdapter, LoraLayerWeights
from lmcollect.weights.version import PushVersion
from tests.factories import make_arithmetic_env

FEATURES = frozenset({"delta", "adapter", "version", "dead_peer"})
"""What a pair may lack: delta pushes, LoRA adapter pushes, versions carried by the push, a peer
(another process or actor) that can die on its own."""

ADAPTED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight")
"""The layers of the tiny model that the contract's adapter adapts."""
SMALL_CHANGE = "model.norm.weight"
"""The one tensor a delta push changes (a small fraction of the model: a delta is worth sending)."""


class TransportPair(abc.ABC):
    """A sender and its receiver, wired to ``collector`` (whose policy model the pushes land in).

    Subclasses say how a push travels; the checks read the result from the collector only.
    """

    supports: frozenset[str] = frozenset()
    """The :data:`FEATURES` this mechanism has; the rest must be refused clearly."""
    bound_s: float = 10.0
    """How long the call after a peer died may take to raise (the pair's own timeout, plus slack)."""

    def __init__(self, collector: LLMCollector) -> None:
        self.collector = collector

    @abc.abstractmethod
    def push(self, weights: Any, *, version: int | None = None) -> None:
        """Send ``weights`` (a dict of tensors, a :class:`LoraAdapter` or a :class:`WeightDelta`) and
        have the receiver load them into the collector; raises what either side raises. ``version``:
        the push's version (None: the mechanism's next one); passed on only when given, so a pair
        that carries no version refuses it."""

    @abc.abstractmethod
    def last_kind(self) -> str:
        """What the last push travelled as: "full", "delta" or "lora"."""

    @abc.abstractmethod
    def kill_peer(self) -> None:
        """Take the other side away (close it, kill its process or actor)."""

    @abc.abstractmethod
    def call_after_peer_died(self) -> None:
        """The call that must raise (within :attr:`bound_s`) once :meth:`kill_peer` ran; for a pair
        without ``"dead_peer"``, the call that must return within the bound, changing nothing."""

    def close(self) -> None:  # noqa: B027 - optional hook: a pair may hold nothing to release
        """Release what the pair started."""


class SchemePullPair(TransportPair):
    """A sender whose receiver is registered with a collector as its ``"policy"`` scheme: a push
    publishes, then the collector pulls (``receive_weights``); every push is a whole snapshot."""

    def __init__(self, collector: LLMCollector, sender: Any, receiver: Any) -> None:
        super().__init__(collector)
        self.sender = sender
        self.collector.register_scheme_receiver({"policy": receiver}, synchronize_weights=False)

    def push(self, weights: Any, *, version: int | None = None) -> None:
        self.sender.send(weights, **({} if version is None else {"version": version}))
        self.collector.receive_weights()

    def last_kind(self) -> str:
        return "full"


def tiny_collector(model_path: Path, **kwargs: Any) -> LLMCollector:
    """The target every pair pushes into: a collector over a fresh copy of the tiny transformers
    model (its policy's engine merges LoRA adapters), tracking versions."""
    model, tokenizer = load_model_and_tokenizer(model_path)
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=4)
    env = make_arithmetic_env()
    return LLMCollector(env, policy=policy, dialog_turns_per_batch=2, track_policy_version=True, **kwargs)


# ---------------------------------------------------------------------- weights to push
def held_weights(pair: TransportPair) -> dict[str, torch.Tensor]:
    """A private copy of what the collector's model holds now."""
    return {name: t.detach().clone() for name, t in pair.collector.get_policy_model().state_dict().items()}


def pushable(pair: TransportPair) -> dict[str, torch.Tensor]:
    """The model's distinct tensors (no tied aliases), as the senders take them."""
    metadata, _ = pair.collector.weight_metadata()
    held = held_weights(pair)
    return {name: held[name] for name in metadata}


def noisy(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + torch.randn(t.shape, generator=generator, dtype=t.dtype) * 0.05 for name, t in weights.items()}


def small_change(weights: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {**weights, SMALL_CHANGE: weights[SMALL_CHANGE] + by}


def an_adapter(weights: dict[str, torch.Tensor], seed: int, rank: int = 4) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name in ADAPTED:
        out_features, in_features = weights[name].shape
        lora_a = torch.randn(rank, in_features, generator=generator) * 0.1
        lora_b = torch.randn(out_features, rank, generator=generator) * 0.1
        layers[name] = LoraLayerWeights(lora_a, lora_b, scaling=2.0)
    return LoraAdapter(layers=layers, rank=rank)


def a_delta(weights: dict[str, torch.Tensor]) -> WeightDelta:
    """A well-formed delta of a small change of ``weights`` (for pairs that must refuse deltas)."""
    base = DeltaBase(DeltaConfig())
    base.snapshot(weights, PushVersion(1))
    encoded = base.encode(small_change(weights, by=1.0))
    assert encoded is not None, "a change of one small tensor encodes as a delta"
    return encoded.delta


# ---------------------------------------------------------------------- assertions
def assert_holds(pair: TransportPair, expected: dict[str, torch.Tensor], what: str) -> None:
    held = held_weights(pair)
    wrong = [name for name, t in expected.items() if not torch.equal(held[name], t)]
    assert not wrong, f"{what}: the collector's model differs from the push in {wrong[:5]}"


def assert_unchanged(pair: TransportPair, before: dict[str, torch.Tensor], version: int, what: str) -> None:
    assert_holds(pair, before, f"{what} changed weights")
    assert pair.collector.policy_version == version, (
        f"{what} changed the version ({version} -> {pair.collector.policy_version})"
    )


def assert_refused(pair: TransportPair, push: Callable[[], None], match: str, what: str) -> None:
    """``push`` raises a TypeError/ValueError matching ``match`` and nothing changes."""
    before, version = held_weights(pair), pair.collector.policy_version
    with pytest.raises((TypeError, ValueError), match=match):
        push()
    assert_unchanged(pair, before, version, what)


# ---------------------------------------------------------------------- the checks
def check_full_push_arrives_exact(pair: TransportPair) -> None:
    start = pushable(pair)
    version = pair.collector.policy_version
    for step in (1, 2):
        weights = noisy(start, seed=step)
        pair.push(weights)
        assert_holds(pair, weights, f"full push {step}")
        assert pair.last_kind() == "full"
        assert pair.collector.policy_version == version + step, "a push bumps the version exactly once"


def check_delta_push(pair: TransportPair) -> None:
    """With ``"delta"``: after a full push, a small change travels as a delta and arrives bit-exact
    (twice: a delta's base is the delta before it). Without: a delta is refused, naming it."""
    weights = noisy(pushable(pair), seed=3)
    if "delta" not in pair.supports:
        assert_refused(pair, lambda: pair.push(a_delta(weights)), "WeightDelta", "a refused delta")
        return
    pair.push(weights)
    assert pair.last_kind() == "full", "the first push has no base to be a delta of"
    version = pair.collector.policy_version
    for step in (1, 2):
        weights = small_change(weights, by=0.25 * step)
        pair.push(weights)
        assert pair.last_kind() == "delta", "a change of one small tensor should travel as a delta"
        assert_holds(pair, weights, f"delta push {step}")
        assert pair.collector.policy_version == version + step


def check_adapter_push(pair: TransportPair) -> None:
    """With ``"adapter"``: the adapted layers hold the base plus the adapter's product, the rest
    stays the base (bitwise); a second adapter replaces the first on the same base. Without: an
    adapter is refused, naming it."""
    base = noisy(pushable(pair), seed=4)
    adapter = an_adapter(base, seed=5)
    if "adapter" not in pair.supports:
        assert_refused(pair, lambda: pair.push(adapter), "LoraAdapter|adapter", "a refused adapter")
        return
    pair.push(base)
    version = pair.collector.policy_version
    for step, current in enumerate((adapter, an_adapter(base, seed=6)), start=1):
        pair.push(current)
        assert pair.last_kind() == "lora"
        held = held_weights(pair)
        for name, merged in current.merged_into(base).items():
            torch.testing.assert_close(held[name], merged, rtol=0, atol=1e-6, msg=f"adapted layer {name}")
        assert_holds(pair, {k: v for k, v in base.items() if k not in current.layers}, "the layers not adapted")
        assert pair.collector.policy_version == version + step


def with_nan(tensor: torch.Tensor) -> torch.Tensor:
    spoiled = tensor.clone()
    spoiled[0] = float("nan")
    return spoiled


SPOILERS: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "wrong_name": (lambda w: w.update(bogus=torch.zeros(2)), "bogus"),
    "missing": (lambda w: w.pop(SMALL_CHANGE), SMALL_CHANGE),
    "shape": (lambda w: w.update({SMALL_CHANGE: torch.zeros(3)}), SMALL_CHANGE),
    "dtype": (lambda w: w.update({SMALL_CHANGE: w[SMALL_CHANGE].double()}), SMALL_CHANGE),
    "non_finite": (lambda w: w.update({SMALL_CHANGE: with_nan(w[SMALL_CHANGE])}), SMALL_CHANGE),
}
"""Ways a payload is bad -> what its error must name."""


def check_refused_payload_changes_nothing(pair: TransportPair) -> None:
    """Every bad payload is refused with an error naming the tensor; the collector's weights stay
    bitwise equal and its version unchanged; a good push still arrives afterwards."""
    good = noisy(pushable(pair), seed=7)
    pair.push(good)
    for name, (spoil, named) in SPOILERS.items():
        bad = dict(good)
        spoil(bad)
        assert_refused(pair, lambda bad=bad: pair.push(bad), named, f"a payload with a {name} tensor")
    after = noisy(good, seed=8)
    pair.push(after)
    assert_holds(pair, after, "the good push after the refused ones")


def check_stale_version_refused(pair: TransportPair) -> None:
    """With ``"version"``: a push older than the version held is refused and changes nothing (the
    version held is the one pushed). Without: a version is refused, naming the argument."""
    weights = noisy(pushable(pair), seed=9)
    held = pair.collector.policy_version
    if "version" not in pair.supports:
        assert_refused(pair, lambda: pair.push(weights, version=held + 5), "version", "a push with a version")
        return
    pair.push(weights, version=held + 5)
    assert pair.collector.policy_version == held + 5, "the collector takes the version the push carries"
    older = noisy(weights, seed=10)
    assert_refused(pair, lambda: pair.push(older, version=held + 3), "version", "a stale push")
    newer = noisy(weights, seed=11)
    pair.push(newer, version=held + 6)
    assert_holds(pair, newer, "the push after the stale one")


def check_dead_peer_errors_within_bound(pair: TransportPair) -> None:
    """With ``"dead_peer"``: once the other side is gone, the pair's next call raises within its
    bound (it does not hang). Without (both sides live in one process): the call after the sender
    closed returns within the bound and loads nothing."""
    weights = noisy(pushable(pair), seed=12)
    pair.push(weights)
    version = pair.collector.policy_version
    pair.kill_peer()
    started = time.monotonic()
    if "dead_peer" in pair.supports:
        with pytest.raises(Exception) as failure:  # each mechanism has its own error type
            pair.call_after_peer_died()
        assert not isinstance(failure.value, AssertionError), failure.value
    else:
        pair.call_after_peer_died()
        assert_unchanged(pair, weights, version, "a pull after the sender closed")
    elapsed = time.monotonic() - started
    assert elapsed < pair.bound_s, f"the call took {elapsed:.1f} s, above the pair's bound {pair.bound_s} s"


CHECKS: dict[str, Callable[[TransportPair], None]] = {
    "full": check_full_push_arrives_exact,
    "delta": check_delta_push,
    "adapter": check_adapter_push,
    "refused_payload": check_refused_payload_changes_nothing,
    "stale_version": check_stale_version_refused,
    "dead_peer": check_dead_peer_errors_within_bound,
}
