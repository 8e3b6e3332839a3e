"""Security suite: the integration fixtures its Ray tests need (one local cluster per pytest worker), and the served toy."""
from tests.integration.conftest import ray_cluster  # noqa: F401 - the session's one local Ray cluster
from tests.security.served_toy import served_toy  # noqa: F401 - the control guard over a toy vLLM, on loopback
