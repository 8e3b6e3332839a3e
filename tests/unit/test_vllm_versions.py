"""Token versions from vLLM's weight-version spans (no vLLM needed)."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from lmcollect.engines.vllm.common import token_versions_of


class Span(NamedTuple):
    version: str
    start: int
    end: int


def test_spans_give_each_token_its_version() -> None:
    versions = token_versions_of([Span("-1", 0, 3), Span("4", 3, 5)], 5)
    assert versions.tolist() == [-1, -1, -1, 4, 4] and versions.dtype == torch.long
    assert token_versions_of([], 0).tolist() == []


@pytest.mark.parametrize(
    ("spans", "num_tokens", "match"),
    [
        (None, 2, "no weight versions"),
        ([Span("1", 0, 2), Span("2", 3, 4)], 4, "not contiguous"),
        ([Span("1", 0, 2)], 3, "cover 2 of 3"),
    ],
)
def test_bad_spans_are_errors(spans: list[Span] | None, num_tokens: int, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        token_versions_of(spans, num_tokens)
