"""The engine's pack sets in shared memory: private files kept from push to push, mapped once by a worker."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lmcollect.engines.vllm.shm_payload import (
    ALIGN_BYTES,
    SHM_DIR,
    MappedBufferFiles,
    SharedPackSets,
    buffer_offsets,
    shared_memory_available,
)

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs a writable /dev/shm (Linux)")


@pytest.fixture
def sets():
    sets = SharedPackSets()
    yield sets
    sets.close()


def test_buffers_start_aligned_one_after_another() -> None:
    assert buffer_offsets([10, 0, 64, 3]) == [0, 64, 64, 128]
    assert all(offset % ALIGN_BYTES == 0 for offset in buffer_offsets([7, 13, 1000, 1]))


def test_a_worker_reads_what_the_engine_packed_and_the_files_are_private(sets: SharedPackSets) -> None:
    out, where = sets.buffers(0, [10, 0, 7])
    out[0].copy_(torch.arange(10, dtype=torch.uint8))
    out[2].fill_(200)
    assert os.stat(where.path).st_mode & 0o777 == 0o600 and where.path.startswith(f"{SHM_DIR}/lmcollect-push-")
    views = MappedBufferFiles().views(where.as_args())
    assert [v.tolist() for v in views] == [list(range(10)), [], [200] * 7]
    assert not views[0].flags.writeable  # the worker maps read-only


def test_each_set_keeps_its_file_and_a_worker_maps_it_once(sets: SharedPackSets) -> None:
    worker = MappedBufferFiles()
    (first, at0), (_, at1) = sets.buffers(0, [100]), sets.buffers(1, [100])
    assert at0.path != at1.path and sorted(sets.paths) == sorted([at0.path, at1.path])
    first[0].fill_(1)
    seen = worker.views(at0.as_args())[0]
    again, at0_again = sets.buffers(0, [100])  # the next push into set 0: the same file, the same mapping
    assert at0_again == at0
    again[0].fill_(2)
    assert worker.views(at0.as_args())[0].base is seen.base and seen.tolist() == [2] * 100
    worker.views(at1.as_args())
    assert worker.paths == [at0.path, at1.path]


def test_a_set_too_small_for_a_push_gets_a_new_file_and_the_old_one_goes(sets: SharedPackSets) -> None:
    worker = MappedBufferFiles()
    _, small = sets.buffers(0, [64])
    _, other = sets.buffers(1, [64])
    worker.views(small.as_args())
    worker.views(other.as_args())
    big_out, big = sets.buffers(0, [64, 4096])
    assert big.path != small.path and not os.path.exists(small.path)
    big_out[1].fill_(7)
    assert worker.views(big.as_args())[1].tolist() == [7] * 4096
    assert worker.paths == [other.path, big.path]  # the replaced file's mapping fell out


def test_close_removes_the_files_and_mappings_outlive_them() -> None:
    sets = SharedPackSets()
    out, where = sets.buffers(0, [16])
    out[0].fill_(9)
    view = MappedBufferFiles().views(where.as_args())[0]
    sets.close()
    sets.close()  # idempotent
    assert not os.path.exists(where.path) and sets.paths == []
    assert view.tolist() == [9] * 16  # e.g. a worker's base weights after the engine closed


def test_a_worker_maps_only_push_files_and_only_their_bytes(sets: SharedPackSets, tmp_path) -> None:
    worker = MappedBufferFiles()
    for path in ("/etc/passwd", f"{SHM_DIR}/other-file", f"{SHM_DIR}/lmcollect-push-../../etc/passwd"):
        with pytest.raises(ValueError, match="not a push buffer file"):
            worker.views({"path": path, "offsets": [0], "sizes": [1]})
    link = SHM_DIR / f"lmcollect-push-test-link-{os.getpid()}"
    target = tmp_path / "secret"
    target.write_bytes(b"secret")
    link.symlink_to(target)
    try:
        with pytest.raises(OSError):  # never through a link
            worker.views({"path": str(link), "offsets": [0], "sizes": [1]})
    finally:
        link.unlink()
    _, where = sets.buffers(0, [100])
    args = where.as_args()
    with pytest.raises(ValueError, match="outside"):
        worker.views({**args, "offsets": [64], "sizes": [100]})
    with pytest.raises(ValueError, match="outside"):
        worker.views({**args, "offsets": [-1], "sizes": [1]})
    assert np.array_equal(worker.views(args)[0], np.zeros(100, dtype=np.uint8))
