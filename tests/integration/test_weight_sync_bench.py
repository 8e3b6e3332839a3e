"""``benchmarks/weight_sync.py``'s LoRA rows at their smallest: the tiny model, no Ray, a stand-in updater.

Speed is not asserted (the machine is shared); what B pushes (the full merged weights of the same
model), the alternation and the rows' shape (read by ``lmcollect bench``) are.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.weight_sync import LORA_TARGETS, adamw_step, lora_rounds, lora_rows, medium_lora_model, merged_weights
from lmcollect.cli.bench import normalize_row
from lmcollect.weights.delta import PushStats
from lmcollect.weights.kept_base import KeptBase
from lmcollect.weights.lora import is_lora_source, lora_adapter

pytest.importorskip("peft")


class StandInUpdater:
    """Holds what it was pushed as a receiver would: full weights as they are, an adapter merged into its kept base."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.held = {k: v.clone() for k, v in weights.items()}
        self.kept = KeptBase()
        self.kinds: list[str] = []
        self.last_push_stats: PushStats | None = None

    def push_weights(self, source) -> None:
        if is_lora_source(source):
            adapter = lora_adapter(source)
            self.kept.merge_into(adapter, self.held)
            self.last_push_stats = PushStats.lora(adapter.nbytes, num_receivers=1)
        else:
            self.held = {k: v.clone() for k, v in source.items()}
            self.last_push_stats = PushStats.full(
                sum(t.numel() * t.element_size() for t in source.values()), num_full=1
            )
        self.kinds.append(self.last_push_stats.kind)


def test_lora_rounds_alternate_adapter_and_merged_full_pushes(tiny_model_path) -> None:
    peft_model, optimizer, base_state = medium_lora_model(str(tiny_model_path))
    updater = StandInUpdater(base_state)
    landed = []

    def check(model) -> None:  # after the last adapter push: the receiver holds the merged model
        reference = copy.deepcopy(model).merge_and_unload().state_dict()
        for name in reference:
            torch.testing.assert_close(updater.held[name], reference[name], rtol=0, atol=1e-6, msg=name)
        landed.append(True)

    adapter_s, full_s, merge_s, stats, full_nbytes = lora_rounds(updater, peft_model, optimizer, base_state, 2, check)
    assert updater.kinds == ["lora"] + ["lora", "full", "full", "lora"] * 3 and landed == [True]
    assert len(adapter_s) == len(full_s) == len(merge_s) == len(stats) == 2
    # B pushes every tensor of the model, the adapted ones merged (one AdamW step moved them off the base)
    merged = merged_weights(peft_model, base_state)
    assert merged.keys() == base_state.keys()
    assert full_nbytes == sum(t.numel() * t.element_size() for t in base_state.values())
    adapted = [k for k in merged if k.endswith(tuple(f"{t}.weight" for t in LORA_TARGETS))]
    assert len(adapted) == 4 * peft_model.config.num_hidden_layers
    assert all(not torch.equal(merged[k], base_state[k]) for k in adapted)
    adamw_step(peft_model, optimizer, seed=9)  # the adapter moves on: so does what B would push
    assert not torch.equal(merged_weights(peft_model, base_state)[adapted[0]], merged[adapted[0]])

    full, adapter, size = lora_rows("Ray", [0.1, 0.3], [1.0, 1.2], merge_s, stats, full_nbytes, memcpy_gb_s=0.3)
    assert full["gb"] > 0 and "metric" not in full
    assert adapter["value"] == pytest.approx(0.2 / 1.1, abs=1e-3) and adapter["met"] is True
    assert size["value"] == pytest.approx(stats[0].nbytes / full_nbytes, abs=1e-5) and size["met"] is True
    for r in (full, adapter, size):  # lmcollect bench shows each with a metric, and the two ratios with targets
        shown = normalize_row("weight_sync", r)
        assert {"row", "metric", "value", "target", "met"} <= set(shown) and shown["metric"]
    assert normalize_row("weight_sync", size)["target"] == "<= 0.05"
    assert normalize_row("weight_sync", adapter)["target"] == "<= 0.2"
