"""PushConfig(delta="auto"): the settings it takes and refuses (the choice itself: test_cost_model.py,
and over real actors: tests/integration/test_delta_sync_ray.py)."""
from __future__ import annotations

import pytest

from lmcollect.weight_sync import PushConfig
from lmcollect.weights.cost_model import PushCostModel


def test_auto_takes_a_link_rate_and_a_cost_model() -> None:
    config = PushConfig(delta="auto", link_gbit=10.0, cost_model=PushCostModel(per_byte_s=1e-9))
    assert config.delta == "auto" and config.link_gbit == 10.0
    assert PushConfig(delta="auto").link_gbit is None  # measured from the first full push


@pytest.mark.parametrize("delta", [False, True])
def test_a_link_rate_without_auto_is_refused(delta: bool) -> None:
    with pytest.raises(ValueError, match="delta='auto'"):
        PushConfig(delta=delta, link_gbit=10.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="link_gbit must be positive"):
        PushConfig(delta="auto", link_gbit=0.0)
    with pytest.raises(ValueError, match="zero_copy"):
        PushConfig(delta="auto", zero_copy=True)
    with pytest.raises(TypeError):
        PushConfig(delta="sometimes")  # type: ignore[arg-type]
