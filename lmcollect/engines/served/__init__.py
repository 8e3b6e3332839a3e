"""A vLLM server as an engine: :class:`VLLMServerEngine` (HTTP prompts, control endpoints for pushes),
the launcher :class:`VLLMServer`, the control-endpoint guard that runs inside the server, and the bounded HTTP client."""

from __future__ import annotations

from lmcollect.engines.served.engine import (
    PauseLeaseRenewer,
    VLLMServerEngine,
    check_server_config,
    master_address_for,
)
from lmcollect.engines.served.http import MAX_RESPONSE_BYTES, VLLMServerError, request_json
from lmcollect.engines.served.launcher import VLLMServer, free_port, serve_command

__all__ = [
    "MAX_RESPONSE_BYTES", "PauseLeaseRenewer", "VLLMServer", "VLLMServerEngine", "VLLMServerError", "check_server_config",
    "free_port", "master_address_for", "request_json", "serve_command",
]  # fmt: skip
