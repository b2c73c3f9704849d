"""``tuning.configure(preallocate=True)``: every save reserves its file's space before writing,
so a full disk or a file size limit fails it at once. Before, only ``save_file`` reserved
space, and it dropped the error of a failed reservation and wrote on until the limit; the
streaming writers and ``reshard``/``merge``/``extract`` left sparse files."""

from __future__ import annotations

import errno
import glob
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import StreamingWriter, tuning
from pysafetensors.numpy import save_file

MIB = 1 << 20

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="posix_fallocate")


@pytest.fixture(autouse=True)
def _reserving(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, 2 * MIB)
        except OSError as exc:
            pytest.skip(f"this file system reserves no space: {exc}")
    probe.unlink()


def _reserved(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_streaming_writer_reserves_its_file(tmp_path: Path) -> None:
    decl = {"x": ("F32", (4 * MIB,))}  # 16 MiB
    with tuning.configured(preallocate=True):
        writer = StreamingWriter(tmp_path / "s.safetensors", decl)
    try:
        (partial,) = glob.glob(str(tmp_path / ".s.safetensors.*"))
        assert _reserved(partial) >= 16 * MIB
    finally:
        writer.abort()
    writer = StreamingWriter(tmp_path / "s.safetensors", decl)  # the default: sparse
    try:
        (partial,) = glob.glob(str(tmp_path / ".s.safetensors.*"))
        assert _reserved(partial) < MIB
    finally:
        writer.abort()


_FILLED = textwrap.dedent(
    """
    import os, resource, signal, sys
    import numpy as np
    from pysafetensors import StreamingWriter, WriteError, reshard, tuning, _reshard, _writer
    from pysafetensors.numpy import save_file

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    tuning.configure(preallocate=True)
    calls = []
    real = _writer.write_layout
    _writer.write_layout = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    header = []
    real_header = _reshard.write_all
    _reshard.write_all = lambda *a, **k: (header.append(1), real_header(*a, **k))[1]
    folder = sys.argv[1]
    try:
        save_file({"x": np.ones(2 << 20, np.float32)}, folder + "/a.safetensors")
    except WriteError as exc:
        print("save_file", exc.errno, len(calls))
    try:
        StreamingWriter(folder + "/b.safetensors", {"x": ("F32", (2 << 20,))})
    except WriteError as exc:
        print("StreamingWriter", exc.errno)
    try:
        reshard(sys.argv[2], folder + "/c", max_shard_size="100MB")
    except WriteError as exc:
        print("reshard", exc.errno, len(header))
    print(sorted(os.listdir(folder)), os.listdir(folder + "/c"))
    """
)


def test_a_file_over_the_limit_fails_before_anything_is_written(tmp_path: Path) -> None:
    source = tmp_path / "m.safetensors"
    save_file({f"t{i}": np.ones(MIB // 2, np.float32) for i in range(4)}, source)  # 8 MiB
    (tmp_path / "out").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _FILLED, str(tmp_path / "out"), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    # The 8 MiB save failed at its reservation (EFBIG), its tensors never written; the
    # streaming writer failed when opened, before taking any part; reshard before writing its
    # output's header (its folder stays, empty); nothing was left behind.
    assert out == [
        f"save_file {errno.EFBIG} 0",
        f"StreamingWriter {errno.EFBIG}",
        f"reshard {errno.EFBIG} 0",
        "['c'] []",
    ]


def test_unreservable_files_still_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that cannot reserve space (``EOPNOTSUPP``) saves as without the option."""
    from pysafetensors.numpy import load_file

    def refuse(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    with tuning.configured(preallocate=True):
        save_file({"x": np.arange(MIB, dtype=np.float32)}, tmp_path / "a.safetensors")
    assert np.array_equal(
        load_file(tmp_path / "a.safetensors")["x"], np.arange(MIB, dtype=np.float32)
    )
