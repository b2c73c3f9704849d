"""``safe_open`` of open file objects: read through their descriptor only where it holds
exactly their bytes, and through a descriptor of its own."""

from __future__ import annotations

import bz2
import gzip
import io
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import safe_open
from pysafetensors.numpy import save, save_file

BACKENDS = ["mmap", "pread"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_closed_callers_descriptor_reused_by_another_file_is_not_read(
    tmp_path: Path, backend: str
) -> None:
    # pread used the caller's descriptor itself: closed, its number went to the next file
    # opened, and the handle returned that file's bytes as its own tensor.
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, a)
    save_file({"a": np.full(4, 7, np.float32)}, b)
    with open(a, "rb") as fh:
        handle = safe_open(fh, "np", backend=backend)
    with open(b, "rb") as other, handle:
        assert other.fileno() >= 0
        assert np.array_equal(handle.get_tensor("a"), np.zeros(4, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opener", [gzip.open, bz2.open])
def test_compressed_file_objects_are_read_through_the_object(
    tmp_path: Path, backend: str, opener: object
) -> None:
    # Their fileno() is the compressed file's: it was read as the safetensors file.
    path = tmp_path / "m.safetensors.z"
    with opener(path, "wb") as out:  # type: ignore[operator]
        out.write(save({"a": np.arange(10, dtype=np.float32)}))
    with opener(path, "rb") as fh, safe_open(fh, "np", backend=backend) as f:  # type: ignore[operator]
        assert np.array_equal(f.get_tensor("a"), np.arange(10, dtype=np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_still_in_the_objects_buffer_are_read(tmp_path: Path, backend: str) -> None:
    # The descriptor was read without flushing: a header error, or the file's older bytes.
    with tempfile.TemporaryFile(dir=tmp_path) as tmp:
        tmp.write(save({"a": np.arange(10, dtype=np.float32)}))
        with safe_open(tmp, "np", backend=backend) as f:
            assert np.array_equal(f.get_tensor("a"), np.arange(10, dtype=np.float32))
    path = tmp_path / "s.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, path)
    with open(path, "r+b") as fh:
        fh.write(save({"a": np.full(4, 7, np.float32)}))
        with safe_open(fh, "np", backend=backend) as f:
            assert np.array_equal(f.get_tensor("a"), np.full(4, 7, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_only_file_object_is_refused_at_open(tmp_path: Path, backend: str) -> None:
    # pread opened it (its descriptor reopened for reading) and every tensor read failed as an
    # I/O error, "Bad file descriptor"; mmap raised a bare PermissionError.
    path = tmp_path / "w.safetensors"
    with open(path, "wb") as fh:
        fh.write(save({"a": np.zeros(4, np.float32)}))
        fh.flush()
        with pytest.raises(io.UnsupportedOperation, match="not open for reading .mode 'wb'"):
            safe_open(fh, "np", backend=backend)


def test_a_bytes_path_to_a_folder_or_index_opens_the_checkpoint(tmp_path: Path) -> None:
    # Bytes paths open files; a folder or index given so was read as one file.
    from pysafetensors import save_sharded
    from pysafetensors.numpy import load_file

    save_sharded({"a": np.ones(300, np.float32), "b": np.zeros(300, np.float32)}, tmp_path, 1500)
    index = tmp_path / "model.safetensors.index.json"
    for target in (os.fsencode(tmp_path), os.fsencode(index)):
        with safe_open(target, "np") as f:
            assert sorted(f.keys()) == ["a", "b"]
        assert sorted(load_file(target)) == ["a", "b"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_callers_position_is_left_where_it_was(backend: str) -> None:
    # An object read through its own seek and read was left after the last tensor read: a
    # caller appending to the buffer then wrote over the file's bytes.
    data = save({"a": np.arange(1000, dtype=np.float32), "b": np.ones((8, 8), np.int16)})
    buf = io.BytesIO()
    buf.write(data)
    with safe_open(buf, "np", backend=backend) as f:
        assert buf.tell() == len(data)
        assert np.array_equal(f.get_tensor("b"), np.ones((8, 8), np.int16))
        assert buf.tell() == len(data)
        assert np.array_equal(f.get_slice("a")[10:20], np.arange(10, 20, dtype=np.float32))
        assert buf.tell() == len(data)
    buf.write(b"TRAILER")
    assert buf.getvalue() == data + b"TRAILER"
    # Read from the start whatever the position, as a plain file read by its descriptor is.
    buf = io.BytesIO(data)
    buf.seek(5)
    with safe_open(buf, "np", backend=backend) as f:
        assert np.array_equal(f.get_tensor("a"), np.arange(1000, dtype=np.float32))
    assert buf.tell() == 5


def test_a_text_mode_file_object_is_refused_at_open(tmp_path: Path) -> None:
    # Its read returns str: the error came from inside the first read, naming nothing.
    path = tmp_path / "t.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, path)
    with (
        open(path, encoding="latin-1") as fh,
        pytest.raises(TypeError, match=r"open in text mode; open the file in binary mode \('rb'\)"),
    ):
        safe_open(fh, "np")
    # Text files behind wrappers that are no io.TextIOBase: the failure came from inside
    # the first read ("a bytes-like object is required, not 'str'", an AttributeError).
    with tempfile.NamedTemporaryFile("w+", dir=tmp_path) as named:
        with pytest.raises(TypeError, match="open in text mode") as info:
            safe_open(named, "np")
        assert str(info.value).startswith(f"{named.name}: ")
    with tempfile.SpooledTemporaryFile(mode="w+") as spooled:
        with pytest.raises(TypeError, match="open in text mode") as info:
            safe_open(spooled, "np")
        assert str(info.value).startswith("<file object>: ")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decompressing_stream_gets_its_position_back_once_at_close(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeking back in a gzip file or a zip member decompresses again from its start: put
    back after every read, a loop over 800 tensors took 17 s instead of 0.1 s."""
    import zipfile

    tensors = {f"t{i:03}": np.full(64, i, np.float32) for i in range(200)}
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("model.safetensors", save(tensors))
    backward: list[tuple[int, int]] = []
    real_seek = zipfile.ZipExtFile.seek

    def counting_seek(self: zipfile.ZipExtFile, offset: int, whence: int = 0) -> int:
        before = self.tell()
        after = real_seek(self, offset, whence)
        if after < before:
            backward.append((before, after))
        return after

    monkeypatch.setattr(zipfile.ZipExtFile, "seek", counting_seek)
    with zipfile.ZipFile(archive) as z, z.open("model.safetensors") as member:
        member.read(7)  # the caller's position
        with safe_open(member, "np", backend=backend) as f:
            backward.clear()  # the open's own size probe and header read
            for name in f.offset_keys():
                assert np.array_equal(f.get_tensor(name), tensors[name])
            assert len(backward) <= 1  # at most one rewind, not one per tensor
        assert member.tell() == 7  # put back at close


class _Recording:
    """A binary stream recording its reads; ``whole_on_zero``: ``read(0)`` reads it all (as
    some wrappers take a falsy size)."""

    def __init__(self, data: bytes, *, seekable: bool = True, whole_on_zero: bool = False):
        self._buf = io.BytesIO(data)
        self._seekable = seekable
        self._whole_on_zero = whole_on_zero
        self.reads: list[int] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def tell(self) -> int:
        return self._buf.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._buf.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        self.reads.append(size)
        return self._buf.read(-1 if (size == 0 and self._whole_on_zero) else size)


def test_the_text_probe_reads_nothing_from_a_stream_that_cannot_seek() -> None:
    # A chunked HTTP response blocked in read(0) (reading the next chunk's size line).
    stream = _Recording(b"\0" * 64, seekable=False)
    with pytest.raises(io.UnsupportedOperation, match="cannot seek"):
        safe_open(stream, "np")
    assert stream.reads == []


def test_the_text_probe_puts_the_position_back() -> None:
    data = save({"a": np.arange(10, dtype=np.float32)})
    stream = _Recording(data, whole_on_zero=True)
    stream.seek(3)
    with safe_open(stream, "np") as f:
        assert np.array_equal(f.get_tensor("a"), np.arange(10, dtype=np.float32))
    assert stream.tell() == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_handles_on_one_decompressing_stream_put_the_callers_position_back(
    tmp_path: Path, backend: str
) -> None:
    path = tmp_path / "m.safetensors.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(save({"a": np.arange(100, dtype=np.float32)}))
    with gzip.open(path, "rb") as fh:
        fh.read(5)
        first = safe_open(fh, "np", backend=backend)
        first.get_tensor("a")
        second = safe_open(fh, "np", backend=backend)  # opened where the first left it
        second.get_tensor("a")
        first.close()
        assert np.array_equal(second.get_tensor("a"), np.arange(100, dtype=np.float32))
        second.close()
        assert fh.tell() == 5


def test_a_pipe_is_refused_as_a_file_that_cannot_seek(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    with open(read_end, "rb") as fh:
        os.close(write_end)
        with pytest.raises(io.UnsupportedOperation, match="cannot seek .a pipe or stream."):
            safe_open(fh, "np")
