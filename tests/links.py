"""Ray worker nodes in their own network namespaces, each behind a rate-limited veth link to the head.

A multi-node cluster on one machine, where bandwidth between nodes is no longer free: the head runs
in this process's namespace on a bridge; every worker node runs ``ray start --block`` inside a
namespace of its own, joined to the bridge by a veth pair with a ``tc tbf`` rate limit on both ends
(egress each way), so everything between that node and the rest (object-store transfers, process
group traffic, actor calls) crosses a link of the given rate. No latency is added (``netem`` is not
available here): a link is a bandwidth limit only.

Addresses come from 198.51.100.0/24 (TEST-NET-2, documentation only) and exist only on the bridge
and veths made here; a cluster takes a /28 slice of it ("slot"), claimed with a lock file, so runs
at the same time (two pytest processes) never share an address or a name. Namespaces, bridges and
addresses are machine-wide, so the lock files are too: they live in :data:`LOCK_DIR` (root's
``/run/lmcollect-links``), whatever ``TMPDIR`` says, in a directory only its owner can write, and
are opened without following a symlink or truncating anything (:func:`open_lock`). Everything a slot made is
removed on exit, and a crashed run's leftovers are removed by the next run that claims its slot.
Needs root, ``ip`` and ``tc``: :func:`namespaces_unavailable` says why not, for a skip.

Used by tests/integration/multinode_check.py and benchmarks/links.py::

    with LinkedCluster([NodeLink(name="node_a", rate_mbit=1000)], head_resources={"buffer_node": 1}) as cluster:
        ...  # ray is initialised, attached to the head; actors pinned with resources={"node_a": 0.1}
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

NETWORK = ipaddress.ip_network("198.51.100.0/24")  # TEST-NET-2 (RFC 5737): used only on the links made here
NUM_SLOTS = 16  # /28 slices: up to 16 clusters at once, 13 worker nodes each
SLOT_PREFIX = 28
PREFIX = "lmcnet"  # of every namespace, link and lock file made here
# One place per machine (not under TMPDIR: two runs with other TMPDIRs would claim the same slot):
# root's runtime directory; another user cannot make namespaces, but its lock tests use a fixed path too.
LOCK_DIR = Path("/run/lmcollect-links") if os.geteuid() == 0 else Path(f"/tmp/lmcollect-links-{os.geteuid()}")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class NodeLink:
    """One worker node in its own namespace, and the link that joins it to the head."""

    name: str
    """Custom resource the node offers (1 unit) and the namespace's suffix: pin actors with
    ``resources={name: 0.1}``."""
    rate_mbit: int | None = 1000
    """Rate limit of its link, each way, in Mbit/s (None: the veth's own speed)."""
    num_cpus: float = 1
    """CPUs the node offers to Ray."""
    object_store_memory: int = 150 * 1024 * 1024
    """Bytes of the node's object store."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or len(self.name) > 12:
            raise ValueError(f"name must be an identifier of at most 12 characters, got {self.name!r}.")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {self.rate_mbit}.")


def namespaces_unavailable() -> str | None:
    """Why this process cannot make namespaces and rate-limited veths (None: it can)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (this process is not root)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH (iproute2, util-linux)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"`unshare -n` is not allowed here: {probe.stderr.strip() or probe.returncode}"
    return None


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """One iproute2/tc command (bounded in time); raise with its stderr when it fails and ``check``."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def tbf_args(rate_mbit: int) -> list[str]:
    """``tc`` arguments of a token bucket of ``rate_mbit``: a burst of ~2 ms of traffic (at least
    64 KiB, one GSO segment), and up to 50 ms of queue before packets drop."""
    burst = max(64 * 1024, rate_mbit * 1_000_000 // 8 // 500)
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


@dataclass
class Slot:
    """A claimed /28 of 198.51.100.0/24 and the names that go with it."""

    index: int
    lock: IO[bytes]

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return list(NETWORK.subnets(new_prefix=SLOT_PREFIX))[self.index]  # type: ignore[return-value]

    def ip(self, host: int) -> str:
        return str(self.subnet[host])

    @property
    def tag(self) -> str:
        return f"{PREFIX}{self.index}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"


def lock_dir() -> Path:
    """:data:`LOCK_DIR`, made if missing (mode 0700); refused unless it is a real directory of this
    user that no one else can write (a planted symlink or a directory of another user could redirect
    or swap the lock files)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(LOCK_DIR, 0o700)
    info = os.lstat(LOCK_DIR)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"the slot lock directory {LOCK_DIR} is not a directory (a symlink?); remove it.")
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise RuntimeError(
            f"the slot lock directory {LOCK_DIR} belongs to uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}; "
            f"it must be uid {os.geteuid()}'s with mode 700: remove it (it is made again)."
        )
    return LOCK_DIR


def open_lock(index: int) -> IO[bytes]:
    """Slot ``index``'s lock file in :func:`lock_dir`, opened (made if missing) without following a
    symlink and without truncating: a planted link is refused, its target left alone."""
    path = lock_dir() / f"{PREFIX}-slot{index}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:  # ELOOP: a symlink
        raise RuntimeError(f"cannot open the slot lock {path} ({exc}); a symlink or other file is there: remove it.") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RuntimeError(f"the slot lock {path} is not a regular file; remove it.")
    return os.fdopen(fd, "rb", buffering=0)


def try_lock(index: int) -> IO[bytes] | None:
    """Slot ``index``'s lock file, locked by this process; None when another process holds it."""
    lock = open_lock(index)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def claim_slot() -> Slot:
    """The first slot no other run on this machine holds, locked until its lock file is closed."""
    for index in range(NUM_SLOTS):
        lock = try_lock(index)
        if lock is not None:
            return Slot(index, lock)
    raise RuntimeError(f"all {NUM_SLOTS} slots of {NETWORK} are in use by other linked clusters on this machine")


def remove_stale_clusters() -> list[int]:
    """Remove the leftovers of every slot no running cluster holds (a run killed before it cleaned
    up: SIGKILL, a timeout); returns the slots cleaned. Safe while other clusters run."""
    cleaned = []
    for index in range(NUM_SLOTS):
        if not os.path.lexists(lock_dir() / f"{PREFIX}-slot{index}.lock"):
            continue  # never claimed
        lock = try_lock(index)
        if lock is None:
            continue  # a live cluster's
        slot = Slot(index, lock)
        if _remove_slot_leftovers(slot):
            cleaned.append(index)
        lock.close()
    return cleaned


def _slot_namespaces(slot: Slot) -> list[str]:
    listed = run("ip", "netns", "list", check=False).stdout.split()
    return [name for name in listed if name.startswith(f"{slot.tag}-")]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGTERM every process in ``namespace`` (ours: only this helper starts processes there),
    then SIGKILL what is left after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in run("ip", "netns", "pids", namespace, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [int(p) for p in run("ip", "netns", "pids", namespace, check=False).stdout.split()]
        if not pids:
            return


def _remove_slot_leftovers(slot: Slot, *, ours: bool = False) -> bool:
    """Remove what a run holding this slot left (``ours``: this run, else one that crashed):
    processes, namespaces (their veths go with them), the bridge, the log folders. True if
    anything was there."""
    found = False
    for namespace in _slot_namespaces(slot):
        found = True
        if not ours:
            logger.warning("removing leftover namespace %s of a run that did not clean up", namespace)
        _kill_namespace_processes(namespace)
        run("ip", "netns", "del", namespace, check=False)
    if run("ip", "link", "show", slot.bridge, check=False).returncode == 0:
        found = True
        run("ip", "link", "del", slot.bridge, check=False)
    for folder in Path(tempfile.gettempdir()).glob(f"{slot.tag}-*"):  # the log folders (mkdtemp)
        found = True
        shutil.rmtree(folder, ignore_errors=True)
    return found


def _qdisc_sent_bytes(shown: str) -> int:
    """The "Sent N bytes" of the tbf qdisc in ``tc -s qdisc show`` output (0 without one)."""
    lines = shown.splitlines()
    for line, next_line in itertools.pairwise(lines):
        if line.startswith("qdisc tbf") and "Sent" in next_line:
            return int(next_line.split()[1])
    return 0


@dataclass
class LinkedCluster:
    """A Ray head in this namespace and one worker node per :class:`NodeLink` behind its own link.

    ``with`` starts it, attaches this process (``ray.init``) and waits until every node is alive;
    leaving the block shuts Ray down and removes every process, namespace and link it made, also
    after an error. The head offers ``head_num_cpus`` and ``head_resources``; this process (the
    driver, e.g. a trainer) runs on the head's node.
    """

    nodes: list[NodeLink]
    head_num_cpus: float = 1
    head_resources: dict[str, float] = field(default_factory=dict)
    head_object_store_memory: int = 150 * 1024 * 1024
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)
    _slot: Slot | None = field(default=None, init=False, repr=False)
    _cluster: Any = field(default=None, init=False, repr=False)
    _node_procs: list[subprocess.Popen] = field(default_factory=list, init=False, repr=False)
    _log_dir: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must differ, got {names}.")
        if not 0 < len(names) <= 2**(32 - SLOT_PREFIX) - 3:
            raise ValueError(f"1 to 13 nodes per cluster, got {len(names)}.")

    # ------------------------------------------------------------------ addresses
    @property
    def head_ip(self) -> str:
        assert self._slot is not None, "the cluster is not started"
        return self._slot.ip(1)

    def node_ip(self, name: str) -> str:
        assert self._slot is not None, "the cluster is not started"
        return self._slot.ip(2 + [node.name for node in self.nodes].index(name))

    @property
    def address(self) -> str:
        """The head's GCS address (``ray.init(address=...)``)."""
        return self._cluster.address

    # ------------------------------------------------------------------ links
    def set_rate(self, name: str, rate_mbit: int | None) -> None:
        """Change node ``name``'s link to ``rate_mbit`` each way (None: unlimited), live."""
        assert self._slot is not None, "the cluster is not started"
        i = [node.name for node in self.nodes].index(name)
        namespace = self._slot.namespace(name)
        for prefix, dev in ((), f"{self._slot.tag}h{i}"), (("ip", "netns", "exec", namespace), f"{self._slot.tag}n{i}"):
            run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate_mbit is not None:
                run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *tbf_args(rate_mbit))

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each node's link has carried so far: ``{name: {"to_node": n, "from_node": n}}``
        (what its rate-limited qdiscs sent; 0 where a link has no limit)."""
        assert self._slot is not None, "the cluster is not started"
        found = {}
        for i, node in enumerate(self.nodes):
            namespace = self._slot.namespace(node.name)
            to_node = _qdisc_sent_bytes(run("tc", "-s", "qdisc", "show", "dev", f"{self._slot.tag}h{i}").stdout)
            from_node = _qdisc_sent_bytes(
                run("ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", f"{self._slot.tag}n{i}").stdout
            )
            found[node.name] = {"to_node": to_node, "from_node": from_node}
        return found

    def _make_links(self) -> None:
        slot = self._slot
        assert slot is not None
        run("ip", "link", "add", slot.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.head_ip}/{SLOT_PREFIX}", "dev", slot.bridge)
        run("ip", "link", "set", slot.bridge, "up")
        for i, node in enumerate(self.nodes):
            namespace, host_end, node_end = slot.namespace(node.name), f"{slot.tag}h{i}", f"{slot.tag}n{i}"
            run("ip", "netns", "add", namespace)
            run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end, "netns", namespace)
            run("ip", "link", "set", host_end, "master", slot.bridge, "up")
            run("ip", "-n", namespace, "addr", "add", f"{self.node_ip(node.name)}/{SLOT_PREFIX}", "dev", node_end)
            run("ip", "-n", namespace, "link", "set", node_end, "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            self.set_rate(node.name, node.rate_mbit)

    # ------------------------------------------------------------------ Ray
    def _start_head(self) -> None:
        from ray.cluster_utils import Cluster

        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "node_ip_address": self.head_ip,
                "num_cpus": self.head_num_cpus,
                "resources": self.head_resources,
                "object_store_memory": self.head_object_store_memory,
            },
        )

    def _start_node(self, node: NodeLink) -> None:
        assert self._slot is not None and self._log_dir is not None
        ray_cli = str(Path(sys.executable).with_name("ray"))
        argv = [
            "ip", "netns", "exec", self._slot.namespace(node.name), ray_cli, "start", "--block",
            f"--address={self.address}", f"--node-ip-address={self.node_ip(node.name)}",
            f"--num-cpus={node.num_cpus}", f"--resources={json.dumps({node.name: 1})}",
            f"--object-store-memory={node.object_store_memory}", "--disable-usage-stats",
            f"--temp-dir={Path(self._log_dir) / node.name}",  # its own socket files: two nodes starting at once collide
        ]  # fmt: skip
        log = open(Path(self._log_dir) / f"{node.name}.log", "w")  # noqa: SIM115 - the child writes it
        self._node_procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()

    def _wait_for_nodes(self) -> None:
        import ray

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) == 1 + len(self.nodes):
                return
            if any(proc.poll() is not None for proc in self._node_procs):
                break  # a `ray start` exited: it will not join
            time.sleep(0.5)
        raise RuntimeError(f"worker nodes did not join within {START_TIMEOUT_S} s:\n{self.node_logs()}")

    def node_logs(self) -> str:
        """The tail of every worker node's ``ray start`` output (for failure messages)."""
        if self._log_dir is None:
            return ""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(Path(self._log_dir).glob("*.log")))

    def __enter__(self) -> LinkedCluster:
        import ray

        self._slot = claim_slot()
        try:
            _remove_slot_leftovers(self._slot)
            self._log_dir = tempfile.mkdtemp(prefix=f"{self._slot.tag}-")
            self._make_links()
            self._start_head()
            for node in self.nodes:
                self._start_node(node)
            ray.init(address=self.address, include_dashboard=False, **self.ray_init_kwargs)
            self._wait_for_nodes()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut Ray down and remove every process, namespace and link this cluster made (idempotent)."""
        import ray

        if self._slot is None:
            return
        try:
            ray.shutdown()
            for node in self.nodes:
                _kill_namespace_processes(self._slot.namespace(node.name))
            for proc in self._node_procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_GRACE_S)
            if self._cluster is not None:
                self._cluster.shutdown()
        finally:
            _remove_slot_leftovers(self._slot, ours=True)
            if self._log_dir is not None:
                shutil.rmtree(self._log_dir, ignore_errors=True)
            self._slot.lock.close()
            self._slot, self._cluster, self._node_procs, self._log_dir = None, None, [], None
