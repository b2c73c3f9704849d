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
from pysafetensors.numpy import load_file, save_file

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


@pytest.mark.parametrize("call", ["get_tensors", "read_into"])
def test_a_mapped_file_cut_inside_its_header_names_the_tensor(tmp_path: Path, call: str) -> None:
    """The error's offset was the new end of the file, inside the header, so no tensor was
    found to name; it is the first byte asked for that is gone."""
    path = tmp_path / "m.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32)}, path)
    with safe_open(path, "np") as f:
        start = f.header.data_start + f.header.tensors["a"].begin
        os.truncate(path, 20)
        with pytest.raises(SafetensorError) as info:
            if call == "get_tensors":
                f.get_tensors()
            else:
                f.read_into({"a": np.empty(4, np.float32)})
    assert info.value.kind == "FileTruncated" and info.value.tensor == "a"
    assert info.value.offset == start


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
    elif mode == "numpy-copies":
        w = f.get_tensors()["w"]       # copies, as the reference's numpy arrays are
        before = float(w.sum())
        os.truncate(path, start + 1000)
        print("same", float(w.sum()) == before, flush=True)
    else:
        import torch
        with safe_open(path, "pt", backend="mmap") as t:
            w = t.get_tensors()["w"]   # a zero-copy view of the mapping, as the reference's
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


def test_numpy_arrays_survive_a_truncation(tmp_path: Path) -> None:
    """numpy get_tensors/load_file under mmap gave private mappings, not copies: touching one
    after the file was truncated killed the process (SIGBUS), where the reference's numpy
    arrays (copies) are unaffected."""
    path = tmp_path / "m.safetensors"
    _make(path, 1.0)
    proc = _child(path, "numpy-copies")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-500:])
    assert proc.stdout.split() == ["same", "True"]


def test_numpy_arrays_do_not_change_with_a_file_rewritten_in_place(tmp_path: Path) -> None:
    # The reference's own save_file truncates and rewrites a file in place: pages of a private
    # mapping not yet written to are the page cache's, so the arrays changed with the file.
    path = tmp_path / "m.safetensors"
    save_file({"w": np.zeros(1 << 20, np.float32)}, str(path))
    for backend in ("mmap", "pread"):
        got = load_file(str(path), backend=backend)
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size - 4 * (1 << 20))
            f.write(np.ones(1 << 20, np.float32).tobytes())
        assert float(got["w"].sum()) == 0.0, backend
        save_file({"w": np.zeros(1 << 20, np.float32)}, str(path))


def test_truncated_file_mmap_view_already_handed_out_is_sigbus(tmp_path: Path) -> None:
    """The documented limit of the mmap backend: an existing view of truncated pages (torch
    tensors view the mapping, as the reference's do)."""
    pytest.importorskip("torch")
    path = tmp_path / "m.safetensors"
    _make(path, 1.0)
    proc = _child(path, "view-first")
    assert "got view" in proc.stdout
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-500:])
    assert "sum" not in proc.stdout  # never silently wrong data: the process dies instead
