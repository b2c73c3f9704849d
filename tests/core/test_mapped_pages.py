"""Pages of a read-only file mapping let go once read: out of the resident set, the same
bytes when read again, and never a range outside the file's mappings."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from pysafetensors._mapped_pages import drop_mapped_pages, file_mappings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


def test_read_pages_leave_the_resident_set_and_read_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    data = np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = np.frombuffer(mapping, np.uint8)
        address = view.ctypes.data
        maps = file_mappings(str(path))
        assert any(start <= address < end for start, end in maps)
        before = _rss_file_kib()
        assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # all touched
        touched = _rss_file_kib()
        assert touched - before > 24 << 10
        drop_mapped_pages(address + 1, view.nbytes - 1, maps)  # all but the first page
        assert touched - _rss_file_kib() > 24 << 10
        assert np.array_equal(view, data)  # read again: the same bytes
    finally:
        del view
        mapping.close()


def test_anonymous_memory_is_never_dropped(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * (1 << 20))
    with open(path, "rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        maps = file_mappings(str(path))
        assert maps
        memory = np.full(4 << 20, 7, np.uint8)
        # Dropping anonymous pages would zero them: a range outside the file's maps is left.
        drop_mapped_pages(memory.ctypes.data, memory.nbytes, maps)
        assert int(memory.min()) == 7
    finally:
        mapping.close()
    assert file_mappings(str(tmp_path / "missing")) == []
