"""Security suite: the integration fixtures its Ray tests need (one local cluster per pytest worker)."""
from tests.integration.conftest import ray_cluster  # noqa: F401 - the session's one local Ray cluster
