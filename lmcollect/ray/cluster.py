"""Starting or attaching to Ray (and shutting down only what we started), building actor options
without mutating the caller's dicts, and what the cluster holds."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import ray

logger = logging.getLogger(__name__)


_DRIVER_DEFAULTS: dict[str, Any] = {}  # ray.init options set by ray_driver_defaults (a CLI command's)


@contextlib.contextmanager
def ray_driver_defaults(**options: Any) -> Iterator[None]:
    """Inside the block, :func:`init_ray` starts or attaches with these ``ray.init`` options unless
    its caller gives others (e.g. ``log_to_driver=False`` for a command that keeps the workers'
    output off the terminal, whichever code starts Ray within it)."""
    saved = dict(_DRIVER_DEFAULTS)
    _DRIVER_DEFAULTS.update(options)
    try:
        yield
    finally:
        _DRIVER_DEFAULTS.clear()
        _DRIVER_DEFAULTS.update(saved)


def init_ray(ray_init_config: dict[str, Any] | None = None) -> None:
    """Make sure Ray runs: attach to ``address`` / ``RAY_ADDRESS`` if given, else start locally.

    A local cluster uses the machine's CPUs and has no dashboard.
    """
    if ray.is_initialized():
        return
    config = {**_DRIVER_DEFAULTS, **(ray_init_config or {})}
    attaching = config.get("address") is not None or "RAY_ADDRESS" in os.environ
    if not attaching:
        # Ray 2.60 maps a loopback node address to the machine's own address, so we do not pass
        # one; the cluster is local to this machine and has no dashboard. "local" starts a new one:
        # without it ray.init() joins the newest cluster already running here (another job's).
        config["address"] = "local"
        config.setdefault("num_cpus", os.cpu_count())
    config.setdefault("include_dashboard", False)
    config.setdefault("log_to_driver", True)
    address = config.get("address") or os.environ.get("RAY_ADDRESS")
    if attaching and address not in (None, "auto", "local"):
        check_reachable(address)  # ray.init retries an unreachable address for minutes
    logger.info("ray.init(%s)", config)
    ray.init(**config)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError naming ``address`` (``host:port``) if nothing listens there."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port (e.g. a ray:// client URL with a path): let Ray judge it
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster answers at address {address!r} ({exc}); start one (`ray start --head`), fix the "
            "address (--address / ray_init_config={'address': ...} / RAY_ADDRESS), or leave it unset to start "
            "a local cluster."
        ) from exc


def actor_options(
    remote_config: dict[str, Any] | None,
    *,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``defaults`` < ``remote_config`` < explicit ``num_cpus`` / ``num_gpus`` (a new dict)."""
    options = {**(defaults or {}), **(remote_config or {})}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    if num_gpus is not None:
        options["num_gpus"] = num_gpus
    return options


def torch_threads_for(num_cpus: float | None) -> int:
    """Torch threads an actor with ``num_cpus`` CPUs should use (Ray leaves OMP at 1 otherwise)."""
    if num_cpus is None or num_cpus < 1:
        return 1
    return int(num_cpus)


def with_thread_env(options: dict[str, Any], num_threads: int) -> dict[str, Any]:
    """``options`` with ``OMP_NUM_THREADS`` in the actor's environment (unless the caller set it).

    Ray runs a threaded actor's calls on other threads than the one that built it; OpenMP gives
    each new thread the environment's thread count, so ``torch.set_num_threads`` in ``__init__``
    alone would leave the work on one core.
    """
    runtime_env = dict(options.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.setdefault("OMP_NUM_THREADS", str(num_threads))
    runtime_env["env_vars"] = env_vars
    return {**options, "runtime_env": runtime_env}


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Ray is running inside the block: attached to ``address``, already running, or started here.

    A cluster started here is shut down on exit; one that was attached to or already running
    (e.g. a test session's) is left as it was.
    """
    started_here = not ray.is_initialized()
    init_ray({"address": address} if address else None)
    try:
        yield
    finally:
        if started_here:
            logger.info("shutting the local Ray session down")
            ray.shutdown()


def ray_logs_dir() -> str | None:
    """The folder of this Ray session's logs (the workers' stdout and stderr), if Ray runs here."""
    from ray._private import worker  # no public call says where the session's logs are

    node = getattr(worker, "_global_node", None)
    return str(node.get_logs_dir_path()) if node is not None else None


def pickle_by_value(module: ModuleType) -> None:
    """Ship ``module``'s functions and classes to Ray workers by value (it is not importable there,
    e.g. a script loaded from a file path)."""
    ray.cloudpickle.register_pickle_by_value(module)


def cluster_resource(name: str) -> float:
    """How much of resource ``name`` (e.g. "GPU") the Ray cluster this process is attached to has."""
    return float(ray.cluster_resources().get(name, 0.0))
