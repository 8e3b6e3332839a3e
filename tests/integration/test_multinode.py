"""The multi-node paths for real: one three-node Ray cluster started on this machine, in a subprocess.

The subprocess (multinode_check.py) runs every check on one cluster (a cluster costs ~15 s to start
here); each test reads its own line of the output. Where this process may make network namespaces
(root, iproute2), the two worker nodes sit behind 1 Gbit/s rate-limited links (tests/links.py);
elsewhere the cluster runs over loopback and the link test skips, saying why.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.links import namespaces_unavailable, remove_stale_clusters

pytestmark = pytest.mark.integration

HAS_VLLM = importlib.util.find_spec("vllm") is not None
NO_LINKS = namespaces_unavailable()


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("multinode_check.py")
    argv = [sys.executable, str(script), *(["--vllm"] if HAS_VLLM else []), *([] if NO_LINKS else ["--links"])]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=500)
    finally:
        if NO_LINKS is None:  # a killed run (the timeout) leaves its namespaces: remove them
            remove_stale_clusters()


def _printed(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def _line(result: subprocess.CompletedProcess, prefix: str) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith(prefix + " ")]
    assert lines, _printed(result)
    return json.loads(lines[-1][len(prefix) + 1 :])


def test_collectors_on_two_nodes_buffer_on_a_third(checked: subprocess.CompletedProcess) -> None:
    assert any(line.startswith("MULTINODE OK") for line in checked.stdout.splitlines()), _printed(checked)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_push_into_an_engine_on_another_node_uses_this_node_ip(checked: subprocess.CompletedProcess) -> None:
    assert checked.returncode == 0 and "VLLM MULTINODE OK" in checked.stdout, _printed(checked)


@pytest.mark.skipif(NO_LINKS is not None, reason=f"no rate-limited links here: {NO_LINKS}")
def test_worker_nodes_talk_to_the_head_over_their_rate_limited_links(checked: subprocess.CompletedProcess) -> None:
    links = _line(checked, "LINKS")
    nodes = ["node_a", "node_b"]
    assert links["ray_node_ips"] == sorted([links["head_ip"], *links["node_ips"].values()]), links
    assert all(ip.startswith("198.51.100.") for ip in links["ray_node_ips"]), links
    # both collectors' turns went to the buffer on the head, through their links
    assert all(links["bytes"][name]["from_node"] > 0 and links["bytes"][name]["to_node"] > 0 for name in nodes), links
    if HAS_VLLM:  # the process-group push reached node_a's engine over its link, from the head's address
        push = _line(checked, "VLLM MULTINODE OK")
        assert push["master_address"] == links["head_ip"], (push, links)
        assert links["bytes"]["node_a"]["to_node"] > push["pushed_bytes"], (push, links)


@pytest.mark.skipif(NO_LINKS is not None, reason=f"no rate-limited links here: {NO_LINKS}")
def test_a_crashed_runs_namespaces_links_and_processes_are_removed_by_the_next_run() -> None:
    from tests import links

    slot = links.claim_slot()
    namespace = slot.namespace("crashed")
    links.run("ip", "link", "add", slot.bridge, "type", "bridge")
    links.run("ip", "netns", "add", namespace)
    orphan = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])
    try:
        slot.lock.close()  # the run "dies" holding all three
        assert slot.index in links.remove_stale_clusters()
        assert orphan.wait(timeout=10) != 0  # killed
        assert namespace not in links.run("ip", "netns", "list").stdout
        assert links.run("ip", "link", "show", slot.bridge, check=False).returncode != 0
    finally:
        orphan.kill()
        links.remove_stale_clusters()
