"""Buffers through a shared-memory file: written once, mapped read-only, removed after the call."""
from __future__ import annotations

import os

import numpy as np
import pytest

from lmcollect.engines.shm_payload import SHM_DIR, buffers_in_shared_memory, map_shared_buffers, shared_memory_available

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs a writable /dev/shm (Linux)")


def test_buffers_round_trip_and_the_file_is_private_and_removed() -> None:
    buffers = [np.arange(10, dtype=np.uint8), np.zeros(0, dtype=np.uint8), np.full(7, 200, dtype=np.uint8)]
    with buffers_in_shared_memory(buffers) as shared:
        assert os.stat(shared.path).st_mode & 0o777 == 0o600
        mapped = map_shared_buffers(shared.as_args())
    assert not os.path.exists(shared.path)
    assert [m.tolist() for m in mapped] == [b.tolist() for b in buffers]  # the mapping outlives the file
    assert not mapped[0].flags.writeable


def test_the_file_is_removed_when_the_call_fails() -> None:
    with pytest.raises(RuntimeError, match="worker failed"), buffers_in_shared_memory([np.ones(4, dtype=np.uint8)]) as shared:
        raise RuntimeError("worker failed")
    assert not os.path.exists(shared.path)


def test_a_worker_maps_only_push_files() -> None:
    with pytest.raises(ValueError, match="not a push buffer file"):
        map_shared_buffers({"path": "/etc/passwd", "sizes": [1]})
    with pytest.raises(ValueError, match="not a push buffer file"):
        map_shared_buffers({"path": f"{SHM_DIR}/other-file", "sizes": [1]})
    with pytest.raises(ValueError, match="not a push buffer file"):
        map_shared_buffers({"path": f"{SHM_DIR}/lmcollect-push-../../etc/passwd", "sizes": [1]})
