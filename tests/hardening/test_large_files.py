"""Files larger than the machine's memory: mapped without reserving memory for them, and an
allocation that cannot be made names what it was for.

The files are sparse (a header, then a hole), so they take no disk space.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import safe_open

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="overcommit, RLIMIT_AS and /proc are Linux's"
)


def _sparse_file(path: Path, nbytes: int) -> None:
    """A file of one uint8 tensor ``w`` of ``nbytes`` zeros, all of them a hole."""
    entry = {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}
    header = json.dumps({"w": entry}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        try:
            f.truncate(8 + len(header) + nbytes)
        except OSError as exc:  # a file system that cannot hold a file that large
            pytest.skip(f"cannot make a sparse file of {nbytes} bytes here: {exc}")


def _memory_and_swap() -> int:
    sizes = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            sizes[key] = int(value.split()[0]) * 1024
    return sizes["MemTotal"] + sizes.get("SwapTotal", 0)


def test_a_file_larger_than_memory_and_swap_opens_mapped(tmp_path: Path) -> None:
    """The default (heuristic) overcommit refuses any one private writable map larger than RAM
    and swap together: the copy-on-write map of such a file failed with ENOMEM at open, where
    the reference (a read-only map) opens it. Such a map reserves nothing now."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() != "0":
            pytest.skip("the kernel's overcommit is not the default heuristic")
    nbytes = 2 * _memory_and_swap() // 4096 * 4096
    path = tmp_path / "huge.safetensors"
    _sparse_file(path, nbytes)

    import safetensors

    with safetensors.safe_open(path, "np") as ref:
        expected = ref.get_slice("w")[nbytes - 8 :]
    with safe_open(path, "np") as f:
        got = f.get_slice("w")[nbytes - 8 :]
        assert f.get_slice("w").get_shape() == [nbytes]
    assert np.array_equal(got, expected) and not got.any()

    import pysafetensors.torch

    # torch's load_file views the map: nothing is read but the page touched.
    tensors = pysafetensors.torch.load_file(path)
    assert tensors["w"].shape == (nbytes,)
    assert int(tensors["w"][-1]) == 0
    tensors["w"][-1] = 7  # copy-on-write: one page copied, the file unchanged
    assert int(tensors["w"][-1]) == 7
    del tensors
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        assert f.read() == b"\0"


_CHILD = textwrap.dedent(
    """
    import resource, sys
    import pysafetensors.numpy
    from pysafetensors import safe_open

    path, limit = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    for backend in ("mmap", "pread"):
        try:
            pysafetensors.numpy.load_file(path, backend=backend)
        except (MemoryError, OSError) as exc:
            print(backend, "load_file", type(exc).__name__, exc)
    with safe_open(path, "np", backend="pread") as f:
        print("pread slice", f.get_slice("w")[:3].tolist())
        try:
            f.get_tensor("w")
        except MemoryError as exc:
            print("pread get_tensor", type(exc).__name__, exc)
    """
)


def test_running_out_of_memory_names_what_was_loading(tmp_path: Path) -> None:
    """numpy's MemoryError says how much, not for what; a map's ENOMEM says neither. Both now
    name the file, the size, and the tensor where one was asked for."""
    nbytes = 8 << 30
    path = tmp_path / "big.safetensors"
    _sparse_file(path, nbytes)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(6 << 30)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(
        (" ".join(line.split()[:2]), line.split(maxsplit=2)[2]) for line in proc.stdout.splitlines()
    )
    size = f"{nbytes:,} bytes"
    assert lines["mmap load_file"].startswith("OSError [Errno 12] "), lines
    assert f"mapping its {path.stat().st_size:,} bytes failed" in lines["mmap load_file"]
    assert "backend='pread'" in lines["mmap load_file"]
    assert repr(str(path)) in lines["mmap load_file"]
    assert lines["pread slice"] == "[0, 0, 0]"
    assert lines["pread get_tensor"].startswith(
        f"MemoryError out of memory loading tensor 'w' ({size}) from {path}: "
    )
    assert lines["pread load_file"].startswith(
        f"MemoryError out of memory loading the tensors from {path} ({size}): "
    )
