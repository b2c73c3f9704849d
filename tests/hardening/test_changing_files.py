"""Files that change under an open reader.

What happens (and is documented in SECURITY.md):

* replaced with ``os.replace`` (how every safe writer, ours included, updates a file): both
  backends keep serving the old inode's bytes, which are still correct for the old header.
* truncated in place, pread backend: a read past the new end raises ``SafetensorError`` with
  kind ``ShortRead`` and the offset where data stopped.
* truncated in place, mmap backend: a tensor requested after the truncation raises
  ``SafetensorError`` with kind ``FileTruncated`` (the size is re-checked with ``fstat`` before
  a view is handed out). A tensor handed out *before* the truncation is a view of the mapping;
  touching its pages afterwards kills the process with SIGBUS, which no Python code can catch.
  That case is shown in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import SafetensorError, safe_open
from pysafetensors.numpy import save_file

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX file semantics")

ROWS = 4096  # 4096 x 256 float32 = 4 MiB: many pages past any truncation point


def _make(path: Path, fill: float) -> np.ndarray:
    arr = np.full((ROWS, 256), fill, np.float32)
    save_file({"a": np.arange(16, dtype=np.int64), "w": arr}, path)
    return arr


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_replaced_file_keeps_serving_the_old_inode(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "m.safetensors"
    old = _make(path, 1.0)
    with safe_open(path, "np", backend=backend) as f:
        other = tmp_path / "new.safetensors"
        _make(other, 2.0)
        os.replace(other, path)
        np.testing.assert_array_equal(f.get_tensor("w"), old)
        np.testing.assert_array_equal(f.get_slice("w")[10:20], old[10:20])
        assert f.get_tensors()["w"][0, 0] == 1.0
    with safe_open(path, "np", backend=backend) as g:
        assert g.get_tensor("w")[0, 0] == 2.0


def test_truncated_file_pread_raises_short_read(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _make(path, 1.0)
    with safe_open(path, "np", backend="pread") as f:
        start = f.header.data_start + f.header.tensors["w"].begin
        os.truncate(path, start + 1000)
        with pytest.raises(SafetensorError) as info:
            f.get_tensor("w")
        assert info.value.kind == "ShortRead"
        assert info.value.offset == start + 1000
        with pytest.raises(SafetensorError, match="truncated or replaced"):
            f.get_slice("w")[ROWS - 1]
        # Bytes still present are still served.
        np.testing.assert_array_equal(f.get_tensor("a"), np.arange(16))


_MMAP_CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from pysafetensors import SafetensorError, safe_open

    path, mode = sys.argv[1], sys.argv[2]
    f = safe_open(path, "np", backend="mmap")
    start = f.header.data_start + f.header.tensors["w"].begin
    if mode == "after-open":
        os.truncate(path, start + 1000)
        try:
            f.get_tensor("w")
        except SafetensorError as exc:
            print("error", exc.kind, exc.offset, flush=True)
        try:
            f.get_slice("w")[-1]
        except SafetensorError as exc:
            print("error", exc.kind, exc.offset, flush=True)
        print("a", int(f.get_tensor("a").sum()), flush=True)
    else:
        w = f.get_tensors()["w"]       # a zero-copy view of a mapping (get_tensor copies)
        print("got view", flush=True)
        os.truncate(path, start + 1000)
        print("sum", float(w.sum()), flush=True)   # touches pages past the new end
    """
)


def _child(path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _MMAP_CHILD, str(path), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_truncated_file_mmap_raises_before_handing_out_a_view(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _make(path, 1.0)
    proc = _child(path, "after-open")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("error FileTruncated")
    assert lines[1].startswith("error FileTruncated")
    assert lines[2] == f"a {sum(range(16))}"


def test_truncated_file_mmap_view_already_handed_out_is_sigbus(tmp_path: Path) -> None:
    """The documented limit of the mmap backend: an existing view of truncated pages."""
    path = tmp_path / "m.safetensors"
    _make(path, 1.0)
    proc = _child(path, "view-first")
    assert "got view" in proc.stdout
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-500:])
    assert "sum" not in proc.stdout  # never silently wrong data: the process dies instead
