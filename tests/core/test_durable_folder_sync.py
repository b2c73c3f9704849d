"""``fsync=True`` saves sync the folder after their renames, and say so when they cannot: a
save that returned had promised its new name would survive a power cut. (A failing folder
``fsync`` is injected: an I/O error cannot be made on demand, and root reads any folder.)"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import SafetensorError, save_sharded
from pysafetensors.numpy import load_file, save_file


def _failing_folder_sync(monkeypatch: pytest.MonkeyPatch, code: int) -> list[int]:
    """``os.fsync`` failing with ``code`` on folders (files sync as usual); the folder
    descriptors it was called on."""
    real: Callable[[int], None] = os.fsync
    seen: list[int] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            seen.append(fd)
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_folder_that_cannot_be_synced_is_an_error_naming_the_saved_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(3, np.float32)}, str(path))
    seen = _failing_folder_sync(monkeypatch, errno.EIO)
    with pytest.raises(SafetensorError) as caught:
        save_file({"a": np.ones(3, np.float32)}, str(path), fsync=True)
    assert seen and isinstance(caught.value, OSError) and caught.value.errno == errno.EIO
    assert caught.value.filename == str(tmp_path)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert repr(str(path)) in notes and "in place" in notes and "power cut" in notes
    # The file is the new one, whole; nothing else is left in the folder.
    assert load_file(str(path))["a"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EBADF, errno.EOPNOTSUPP])
def test_systems_that_cannot_sync_folders_at_all_are_let_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    seen = _failing_folder_sync(monkeypatch, code)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "m.safetensors"), fsync=True)
    assert seen


def test_page_cache_saves_do_not_sync_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _failing_folder_sync(monkeypatch, errno.EIO)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "m.safetensors"))
    assert not seen


def test_a_sharded_durable_save_says_its_files_are_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {f"t{i}": np.full(100, i, np.float32) for i in range(3)}
    _failing_folder_sync(monkeypatch, errno.EIO)
    with pytest.raises(SafetensorError) as caught:
        save_sharded(tensors, tmp_path, max_shard_size=500, fsync=True)
    assert "every file of this save" in " ".join(getattr(caught.value, "__notes__", []))
    monkeypatch.undo()
    assert {k: v.tolist() for k, v in load_file(str(tmp_path)).items()} == {
        k: v.tolist() for k, v in tensors.items()
    }
