"""The local Ray cluster fixture of tests/integration, for the adapters' Ray-form tests (test_adapters_ray.py)."""
from __future__ import annotations

from tests.integration.conftest import ray_cluster  # noqa: F401 - a session fixture, shut down at the end
