"""FsspecSource on fsspec's ``memory://`` and ``file://`` filesystems, and the dispatcher."""

from __future__ import annotations

import gzip
import io
import json
import random
import socket
import struct
import tarfile
import threading
import time
import traceback
import tracemalloc
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pysafetensors._range_reads import read_ranges_into
from pysafetensors._remote import (
    DEFAULT_HEAD_BYTES,
    FsspecSource,
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
    open_source,
    read_prefix,
)

from .test_remote_http import _tensor_span

fsspec = pytest.importorskip("fsspec")
memory_fs = pytest.importorskip("fsspec.implementations.memory")


@pytest.fixture
def mem_url(data_dir: Path) -> Iterator[tuple[str, Path]]:
    """A copy of the test files under a fresh ``memory://`` folder."""
    root = f"memory://pst-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for path in data_dir.iterdir():
        if path.is_file():
            fs.pipe_file(f"{root}/{path.name}", path.read_bytes())
    yield root, data_dir
    fs.rm(root, recursive=True)


def _read(src: FsspecSource, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    src.readinto(offset, memoryview(buf))
    return bytes(buf)


def test_open_is_size_plus_head(mem_url: tuple[str, Path]) -> None:
    root, data_dir = mem_url
    data = (data_dir / "model.safetensors").read_bytes()
    with FsspecSource(f"{root}/model.safetensors") as src:
        assert src.size == len(data)
        assert src.stats.requests == 2  # size, then the first 64 KiB
        assert src.stats.bytes_fetched == DEFAULT_HEAD_BYTES
        (n,) = struct.unpack("<Q", read_prefix(src, 8))
        assert _read(src, 8, n) == data[8 : 8 + n]
        assert src.stats.requests == 2


def test_random_ranges_and_counts(mem_url: tuple[str, Path]) -> None:
    root, data_dir = mem_url
    data = (data_dir / "blob.bin").read_bytes()
    rnd = random.Random(5)
    with FsspecSource(f"{root}/blob.bin", part_size=200_000, head_bytes=0) as src:
        for _ in range(30):
            offset = rnd.randrange(len(data))
            length = rnd.randrange(0, min(len(data) - offset, 500_000) + 1)
            assert _read(src, offset, length) == data[offset : offset + length]
        src.stats.reset()
        _read(src, 1000, 1_000_000)
        assert src.stats.requests == 5
        assert src.stats.bytes_fetched == 1_000_000


def test_adjacent_ranges_one_request(mem_url: tuple[str, Path]) -> None:
    root, data_dir = mem_url
    data = (data_dir / "model.safetensors").read_bytes()
    spans = [_tensor_span(data, f"block.{i}.bias") for i in range(12)]
    with FsspecSource(f"{root}/model.safetensors") as src:
        src.stats.reset()
        out = bytearray(sum(n for _, n in spans))
        read_ranges_into(src, spans, memoryview(out))
        assert bytes(out) == b"".join(data[s : s + n] for s, n in spans)
        assert src.stats.requests == 1


class _CountingMemoryFS(memory_fs.MemoryFileSystem):  # type: ignore[misc]
    """A memory filesystem whose ranged reads take a little while and count how many run at
    once, and how many bytes they hand back."""

    cachable = False
    lock = threading.Lock()
    now = peak = calls = 0

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        cls = type(self)
        with cls.lock:
            cls.now += 1
            cls.calls += 1
            cls.peak = max(cls.peak, cls.now)
        try:
            time.sleep(0.01)
            return super().cat_file(path, start, end, **kwargs)  # type: ignore[no-any-return]
        finally:
            with cls.lock:
                cls.now -= 1


def _async_counting_fs() -> Any:
    """fsspec's own asynchronous wrapper (``async_wrapper::``) over the counting filesystem:
    a real ``async_impl`` filesystem whose coroutines run on fsspec's event loop."""
    wrapper = pytest.importorskip("fsspec.implementations.asyn_wrapper")
    _CountingMemoryFS.now = _CountingMemoryFS.peak = _CountingMemoryFS.calls = 0
    fs = wrapper.AsyncFileSystemWrapper(_CountingMemoryFS(skip_instance_cache=True))
    assert fs.async_impl
    return fs


def test_async_filesystems_read_max_connections_parts_at_once(mem_url: tuple[str, Path]) -> None:
    """Parts of a read from an asynchronous filesystem travel concurrently, at most
    max_connections at once, each copied into place as it arrives: one cat_ranges call
    returned them all before any was copied (a read held twice in memory), ran up to
    fsspec's batch size (1280) at once, and ran one at a time on this wrapper."""
    root, data_dir = mem_url
    data = (data_dir / "blob.bin").read_bytes()
    path = f"{root}/blob.bin".removeprefix("memory://")
    fs = _async_counting_fs()
    with FsspecSource(
        path, fs=fs, head_bytes=0, read_ahead=0, part_size=100_000, max_connections=3
    ) as src:
        ranges = [(10, 5), (500_000, 950_000), (2_000_000, 7)]
        out = bytearray(950_012)
        src.readinto_many(ranges, memoryview(out))
        assert bytes(out) == b"".join(data[o : o + n] for o, n in ranges)
        assert src.stats.bytes_fetched == 950_012
        assert src.stats.requests == _CountingMemoryFS.calls + 1  # and asking the size
    assert _CountingMemoryFS.calls >= 12  # 1 + at least 10 + 1 parts
    assert 2 <= _CountingMemoryFS.peak <= 3


def test_async_filesystems_hold_a_few_parts_not_the_whole_read(mem_url: tuple[str, Path]) -> None:
    root, _ = mem_url
    fs = _async_counting_fs()
    blob = bytes(range(256)) * (32 << 12)  # 32 MiB
    path = f"{root}/big.bin".removeprefix("memory://")
    fs.pipe_file(path, blob)
    out = bytearray(len(blob))
    with FsspecSource(
        path, fs=fs, head_bytes=0, read_ahead=0, part_size=1 << 20, max_connections=4
    ) as src:
        tracemalloc.start()
        try:
            src.readinto(0, memoryview(out))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert out == blob
    # Four 1 MiB parts in flight (and their copies inside the filesystem), not 32 MiB.
    assert peak < 12 << 20, peak


def test_scattered_pieces_on_async_filesystems(mem_url: tuple[str, Path]) -> None:
    """readinto_scattered on an asynchronous filesystem: pieces to several buffers, some
    merged into one part (scattered from it), a large one split into parts (received whole)."""
    root, data_dir = mem_url
    data = (data_dir / "blob.bin").read_bytes()
    fs = _async_counting_fs()
    path = f"{root}/blob.bin".removeprefix("memory://")
    shared = bytearray(300)
    large = bytearray(250_000)
    pieces = [
        (1000, 100, memoryview(shared), 0),
        (1150, 100, memoryview(shared), 200),  # near the first: one part, scattered
        (1100, 50, memoryview(shared), 100),
        (600_000, 250_000, memoryview(large), 0),  # three parts, received in place
    ]
    with FsspecSource(path, fs=fs, head_bytes=0, read_ahead=0, part_size=100_000) as src:
        src.readinto_scattered(pieces)
        assert src.stats.requests == _CountingMemoryFS.calls + 1 == 5  # and asking the size
    assert bytes(shared) == data[1000:1100] + data[1100:1150] + bytes(50) + data[1150:1250]
    assert bytes(large) == data[600_000:850_000]


def test_a_folder_is_not_read_as_an_empty_file(mem_url: tuple[str, Path], tmp_path: Path) -> None:
    # memory:// and object stores give a folder size 0: it was "header too small (file is
    # 0 bytes)", naming neither the URL nor the folder; on file:// an IsADirectoryError.
    root, _ = mem_url
    for url in (root, tmp_path.as_uri()):
        with pytest.raises(RemoteError) as info:
            FsspecSource(url)
        assert info.value.kind == "IsADirectory"
        assert "is a folder, not a file" in str(info.value)
        assert url in str(info.value)


class _NoSizeFS(memory_fs.MemoryFileSystem):  # type: ignore[misc]
    """A filesystem that knows a file exists but not its size (some HTTP servers)."""

    cachable = False

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return {**super().info(path, **kwargs), "size": None}


def test_a_filesystem_that_gives_no_size_is_a_clear_error(mem_url: tuple[str, Path]) -> None:
    # It was "asking its size failed: TypeError: int() argument must be ... not 'NoneType'".
    root, _ = mem_url
    path = f"{root}/model.safetensors".removeprefix("memory://")
    with pytest.raises(RemoteError) as info:
        FsspecSource(path, fs=_NoSizeFS(skip_instance_cache=True))
    assert info.value.kind == "NoSize"
    assert "reports no size" in str(info.value)


def test_a_compressed_open_file_is_refused(tmp_path: Path, data_dir: Path) -> None:
    # Its fs and path name the compressed bytes, which were served as the file's: a garbage
    # length prefix (HeaderTooLarge) instead of saying why.
    local = tmp_path / "model.safetensors.gz"
    with gzip.open(local, "wb") as f:
        f.write((data_dir / "small.safetensors").read_bytes())
    with pytest.raises(ValueError, match="compression='gzip'"):
        FsspecSource(fsspec.open(str(local), "rb", compression="gzip"))


def test_a_sharded_checkpoint_inside_a_zip_archive(tmp_path: Path) -> None:
    """An index read through a chain (zip://member::file:///x.zip) is an index, and its shards
    are found beside it in the same archive. The chain's outer path was taken for the
    object's: the index was opened as a safetensors file (HeaderTooLarge)."""
    np = pytest.importorskip("numpy")
    from pysafetensors import safe_open
    from pysafetensors.numpy import save

    shards = {
        "sub/model-00001-of-00002.safetensors": save({"a": np.arange(4, dtype=np.int32)}),
        "sub/model-00002-of-00002.safetensors": save({"b": np.arange(3, dtype=np.int32)}),
    }
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    archive = tmp_path / "ckpt.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name, blob in shards.items():
            zf.writestr(name, blob)
        zf.writestr("sub/model.safetensors.index.json", json.dumps(index))
        zf.writestr(
            "top.safetensors.index.json",
            json.dumps({"weight_map": {"a": "sub/model-00001-of-00002.safetensors"}}),
        )
    outer = archive.as_uri()
    with safe_open(f"zip://sub/model.safetensors.index.json::{outer}", "numpy") as f:
        got = {k: f.get_tensor(k).tolist() for k in f.keys()}  # noqa: SIM118 - the API
        assert got == {"a": [0, 1, 2, 3], "b": [0, 1, 2]}
    with safe_open(f"zip://top.safetensors.index.json::{outer}", "numpy") as f:
        assert f.get_tensor("a").tolist() == [0, 1, 2, 3]


def test_open_file_and_file_url(tmp_path: Path, data_dir: Path) -> None:
    data = (data_dir / "small.safetensors").read_bytes()
    local = tmp_path / "small.safetensors"
    local.write_bytes(data)
    with FsspecSource(fsspec.open(str(local), "rb")) as src:
        assert src.head == data
    src2 = open_source(local.as_uri())
    try:
        assert isinstance(src2, FsspecSource)
        assert _read(src2, 0, len(data)) == data
    finally:
        src2.close()


def test_missing(mem_url: tuple[str, Path]) -> None:
    root, _ = mem_url
    with pytest.raises(RemoteNotFoundError) as info:
        open_source(f"{root}/nope.safetensors")
    assert isinstance(info.value, FileNotFoundError)
    assert "nope.safetensors" in str(info.value)


def test_dispatch(mem_url: tuple[str, Path]) -> None:
    root, _ = mem_url
    src = open_source(f"{root}/small.safetensors", storage_options={"head_bytes": 8})
    try:
        assert isinstance(src, FsspecSource) and len(src.head) == 8
    finally:
        src.close()
    with pytest.raises(TypeError):
        open_source(42)


def _shown(exc: BaseException) -> str:
    """What a traceback of ``exc`` prints of it and the exceptions it chains to (their
    messages and arguments; not the source lines, which quote the test's own literals)."""
    texts = []
    seen: BaseException | None = exc
    while seen is not None:
        texts += [*traceback.format_exception_only(seen), repr(seen.args)]
        seen = seen.__cause__ or seen.__context__
    return "".join(texts)


def test_errors_show_no_credentials_from_the_url(mem_url: tuple[str, Path], tmp_path: Path) -> None:
    # fsspec keeps user:password@ (memory://) and the query string (file://) in the path it
    # quotes in its own FileNotFoundError.
    root, _ = mem_url
    url = root.replace("memory://", "memory://alice:s3cr3t-pw@") + "/missing.safetensors"
    with pytest.raises(RemoteNotFoundError) as info:
        open_source(url)
    assert "missing.safetensors" in str(info.value)
    assert "s3cr3t-pw" not in _shown(info.value) and "alice" not in _shown(info.value)
    signed = f"{(tmp_path / 'gone.safetensors').as_uri()}?X-Amz-Signature=deadbeef42"
    with pytest.raises(RemoteNotFoundError) as info:
        FsspecSource(signed)
    assert "gone.safetensors" in str(info.value)
    assert "deadbeef42" not in _shown(info.value)


class _TokenFS(fsspec.AbstractFileSystem):  # type: ignore[misc]
    """A filesystem that, as backends do, quotes its credentials in its errors."""

    protocol = "pst-token"

    def __init__(self, token: str = "", fail_setup: bool = False, **kwargs: object) -> None:
        if fail_setup:
            raise ConnectionError(f"could not log in with token {token}")
        super().__init__(**kwargs)
        self.token = token

    def info(self, path: str, **kwargs: object) -> dict[str, object]:
        detail = self.storage_options.get("connection_string", "")
        raise PermissionError(f"token {self.token} {detail} is not allowed to read {path}")


def test_errors_show_no_secret_storage_options() -> None:
    fsspec.register_implementation("pst-token", _TokenFS, clobber=True)
    with pytest.raises(RemotePermissionError) as info:
        FsspecSource("pst-token://bucket/model.safetensors", token="tok-0123456789")
    assert "bucket/model.safetensors" in str(info.value)
    assert "tok-0123456789" not in _shown(info.value)
    with pytest.raises(RemoteError) as setup:
        FsspecSource("pst-token://b/m.safetensors", token="tok-9876543210", fail_setup=True)
    assert setup.value.kind == "ConnectionError"
    assert "could not log in" in str(setup.value)
    assert "tok-9876543210" not in _shown(setup.value)


def test_a_backend_that_cannot_connect_is_a_remote_error_without_the_password() -> None:
    # fsspec's FTP filesystem logs in while it is set up: a refused connection came out as a
    # bare ConnectionRefusedError, not a SafetensorError.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the connection is tried
    with pytest.raises(RemoteError) as info:
        FsspecSource(f"ftp://bob:pw-7654321@127.0.0.1:{port}/m.safetensors")
    assert info.value.kind == "ConnectionError"
    assert str(info.value).startswith(f"ftp://127.0.0.1:{port}/m.safetensors: ")
    assert "ConnectionRefusedError" in str(info.value)
    assert "pw-7654321" not in _shown(info.value)


def test_an_option_in_both_the_url_and_storage_options_is_named() -> None:
    # fsspec merged them by keyword and failed inside dict() ("got multiple values for keyword
    # argument 'password'"), naming neither the URL nor where the second value came from.
    for option in ("password", "username", "port"):
        with pytest.raises(TypeError) as info:
            FsspecSource("ftp://bob:pw-7654321@127.0.0.1:1/m.safetensors", **{option: "x"})
        message = str(info.value)
        assert message == (
            f"storage option {option!r} of ftp://127.0.0.1:1/m.safetensors is given twice:"
            " by the URL and in storage_options; give it once"
        )
        assert "pw-7654321" not in _shown(info.value)


def test_chained_urls_show_no_credentials(tmp_path: Path) -> None:
    # fsspec chains (simplecache::..., zip://m::...) were shown whole: redact and the secrets
    # took the chain for one URL that did not parse.
    with pytest.raises(RemoteNotFoundError) as info:
        FsspecSource("simplecache::memory://al:secretpw9@x/m.safetensors")
    assert "secretpw9" not in _shown(info.value) and "m.safetensors" in str(info.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteError) as refused:
        FsspecSource(f"simplecache::ftp://bob:pw-7654321@127.0.0.1:{port}/m.safetensors")
    assert refused.value.kind == "ConnectionError" and "pw-7654321" not in _shown(refused.value)
    assert str(refused.value).startswith(f"simplecache::ftp://127.0.0.1:{port}/m.safetensors: ")


def test_a_missing_archive_of_a_chain_is_not_found(tmp_path: Path) -> None:
    # It became a RemoteError of kind ConnectionError, which `except FileNotFoundError` missed.
    with pytest.raises(RemoteNotFoundError) as info:
        FsspecSource(f"zip://m.safetensors::{(tmp_path / 'gone.zip').as_uri()}")
    assert isinstance(info.value, FileNotFoundError) and info.value.kind == "NotFound"


def test_an_open_file_s_query_string_is_not_shown(tmp_path: Path) -> None:
    url = f"{(tmp_path / 'gone.safetensors').as_uri()}?X-Amz-Signature=deadbeef42"
    with pytest.raises(RemoteNotFoundError) as info:
        FsspecSource(fsspec.open(url, "rb"))
    assert "deadbeef42" not in _shown(info.value)


def test_a_connection_string_option_is_a_secret() -> None:
    fsspec.register_implementation("pst-token", _TokenFS, clobber=True)
    with pytest.raises(RemotePermissionError) as info:
        FsspecSource(
            "pst-token://b/m.safetensors", token="", connection_string="AccountKey=abc123xyz"
        )
    assert "AccountKey=abc123xyz" not in _shown(info.value)


def test_redact_hides_a_password_that_parses_as_a_port_and_a_path() -> None:
    # "2024/hunter2" unencoded: host "alice", port 2024, path "/hunter2@..." to urlsplit;
    # shown whole in every message. An '@' in an S3 key (no port) keeps its meaning.
    from pysafetensors._remote_urls import redact

    shown = redact("http://alice:2024/hunter2@127.0.0.1:9/model.safetensors")
    assert "hunter2" not in shown and "2024" not in shown
    assert shown == "http://127.0.0.1:9/model.safetensors"
    assert redact("s3://bucket/a@b/m.safetensors") == "s3://bucket/a@b/m.safetensors"


def test_redact_takes_chains_and_ipv6_hosts() -> None:
    from pysafetensors._remote_urls import redact

    assert redact("http://u:pw@[::1]:8080/m.safetensors?sig=1") == (
        "http://[::1]:8080/m.safetensors?..."
    )
    assert redact("simplecache::s3://k:s@bucket/m.safetensors") == (
        "simplecache::s3://bucket/m.safetensors"
    )
    assert redact("zip://m.safetensors::https://u:p@host/a.zip?x=1") == (
        "zip://m.safetensors::https://host/a.zip?..."
    )


class _NoRangeFS(memory_fs.MemoryFileSystem):  # type: ignore[misc]
    """A filesystem whose ranged reads return the whole file, as some backends do."""

    protocol = "pst-norange"
    calls = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.replace("pst-norange://", "memory://"))  # type: ignore[no-any-return]

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        type(self).calls += 1
        return super().cat_file(path, **kwargs)  # type: ignore[no-any-return]


def test_a_filesystem_ignoring_ranges_is_refused_at_once() -> None:
    # It was a "short read" (got 17 MB of 64 KiB), retried: the whole file fetched twice.
    fsspec.register_implementation("pst-norange", _NoRangeFS, clobber=True)
    fs = fsspec.filesystem("pst-norange")
    fs.pipe_file("/norange/m.safetensors", b"x" * 300_000)
    _NoRangeFS.calls = 0
    with pytest.raises(RemoteError) as info:
        FsspecSource("pst-norange:///norange/m.safetensors")
    assert info.value.kind == "RangeNotSupported"
    assert "does not honour ranged reads" in str(info.value)
    assert _NoRangeFS.calls == 1
    fs.rm("/norange", recursive=True)


def test_index_urls_name_their_object_and_neighbours() -> None:
    from pysafetensors._remote_urls import is_folder_url, url_dirname, url_join, url_path

    cases = {
        # A top-level object of an fsspec URL was taken for a host: not an index, and its
        # folder "memory:" (the scheme's slashes eaten).
        "memory://m.safetensors.index.json": ("m.safetensors.index.json", "memory://"),
        "zip://d/m.index.json::file:///x.zip": ("d/m.index.json", "zip://d::file:///x.zip"),
        "simplecache::s3://b/d/m.index.json": ("b/d/m.index.json", "simplecache::s3://b/d"),
        "gs://b/d/m.index.json?x=1": ("b/d/m.index.json", "gs://b/d"),
        # Read by this library's own sources, never as chains: '::' is in the path or host.
        "https://h/a::b/m.index.json": ("/a::b/m.index.json", "https://h/a::b"),
        "http://[::1]:8000/d/m.index.json": ("/d/m.index.json", "http://[::1]:8000/d"),
        "s3://b/a::b/m.index.json": ("b/a::b/m.index.json", "s3://b/a::b"),
    }
    for url, (path, folder) in cases.items():
        assert (url_path(url), url_dirname(url)) == (path, folder), url
    assert url_join("memory://", "s.safetensors") == "memory://s.safetensors"
    assert (
        url_join("zip://d::file:///x.zip", "s.safetensors")
        == "zip://d/s.safetensors::file:///x.zip"
    )
    assert is_folder_url("zip://d/::file:///x.zip")
    assert not is_folder_url("zip://d/m.index.json::file:///x/")


def test_tar_members_read_right_in_parallel(tmp_path: Path) -> None:
    """fsspec's tar filesystem reads every member through one shared file object (seek, then
    read, no lock): the parts of a read fetched on several threads got each other's bytes, so
    tensors loaded from tar:// held wrong values (or failed with ReadError)."""
    np = pytest.importorskip("numpy")
    from pysafetensors.numpy import load_file, save

    rng = np.random.default_rng(7)
    tensors = {f"t{i:02d}": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(24)}
    blob = save(tensors)  # 6 MiB: about a hundred parts of 64 KiB
    archive = tmp_path / "ckpt.tar"
    with tarfile.open(archive, "w") as tf:
        info = tarfile.TarInfo("model.safetensors")
        info.size = len(blob)
        tf.addfile(info, io.BytesIO(blob))
    for _ in range(3):
        got = load_file(
            f"tar://model.safetensors::{archive.as_uri()}",
            storage_options={"part_size": 64 << 10, "max_connections": 8},
        )
        assert sorted(got) == sorted(tensors)
        for name, tensor in tensors.items():
            np.testing.assert_array_equal(got[name], tensor, err_msg=name)


def test_sources_sharing_a_filesystem_that_is_not_thread_safe_take_turns(
    tmp_path: Path,
) -> None:
    """fsspec hands the sources of one server the same filesystem instance (ftp://host/a and
    ftp://host/b share one FTP connection): reads serialised per source still ran two at once
    on it. Two members of a tar archive on one shared instance stand in for that here."""
    tar_fs = pytest.importorskip("fsspec.implementations.tar")
    names = ("a.safetensors", "b.safetensors")
    archive = tmp_path / "ckpt.tar"
    blobs = {name: random.Random(name).randbytes(3 << 20) for name in names}
    with tarfile.open(archive, "w") as tf:
        for name, blob in blobs.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
    fs = tar_fs.TarFileSystem(str(archive), skip_instance_cache=True)
    results: dict[str, bytes | Exception] = {}

    def read(name: str) -> None:
        try:
            with FsspecSource(name, fs=fs, head_bytes=0, read_ahead=0, part_size=32 << 10) as src:
                for _ in range(3):
                    out = bytearray(src.size)
                    src.readinto(0, memoryview(out))
                    if out != blobs[name]:
                        results[name] = bytes(out)
                        return
                results[name] = blobs[name]
        except Exception as exc:  # noqa: BLE001 - checked below
            results[name] = exc

    threads = [threading.Thread(target=read, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in names:
        assert results[name] == blobs[name], name


def test_opening_a_file_takes_the_filesystems_turn_too(tmp_path: Path) -> None:
    """Only reads took turns: ``info`` at open ran beside another source's ``cat_file`` on the
    one connection (on FTP, a folder listing), as shards opened ahead do. A filesystem whose
    calls record any overlap stands in for one with a single connection."""
    fsspec = pytest.importorskip("fsspec")
    blob = random.Random(3).randbytes(1 << 20)
    overlaps: list[str] = []
    busy = threading.Lock()

    class OneConnection(fsspec.AbstractFileSystem):  # type: ignore[misc]
        protocol = "oneconn"

        def _call(self, what: str) -> None:
            if not busy.acquire(blocking=False):
                overlaps.append(what)
                return
            try:
                time.sleep(0.002)
            finally:
                busy.release()

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            self._call("info")
            return {"name": path, "size": len(blob), "type": "file"}

        def cat_file(self, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
            self._call("cat_file")
            return blob[start:end]

    fs = OneConnection(skip_instance_cache=True)
    stop = threading.Event()

    def keep_reading() -> None:
        with FsspecSource("a", fs=fs, head_bytes=0, read_ahead=0, part_size=64 << 10) as src:
            out = bytearray(256 << 10)
            while not stop.is_set():
                src.readinto(0, memoryview(out))

    reader = threading.Thread(target=keep_reading)
    reader.start()
    try:
        for k in range(20):
            FsspecSource(f"d{k}/b", fs=fs, head_bytes=0).close()
    finally:
        stop.set()
        reader.join()
    assert overlaps == []


def test_an_fsspec_openfile_opens_like_its_url(tmp_path: Path) -> None:
    # safe_open and load_file refused it ("expected str, bytes or os.PathLike object, not
    # OpenFile"), and a compression storage option read the compressed bytes as the file's
    # (a header "too large" by a garbage length prefix).
    import gzip

    import fsspec
    import numpy as np

    from pysafetensors import safe_open
    from pysafetensors.numpy import load_file, save

    data = save({"a": np.arange(6, dtype=np.float32)})
    (tmp_path / "m.safetensors").write_bytes(data)
    (tmp_path / "m.safetensors.gz").write_bytes(gzip.compress(data))
    with safe_open(fsspec.open(str(tmp_path / "m.safetensors")), "np") as f:
        assert np.array_equal(f.get_tensor("a"), np.arange(6, dtype=np.float32))
    loaded = load_file(fsspec.open(f"file://{tmp_path / 'm.safetensors'}"))
    assert np.array_equal(loaded["a"], np.arange(6, dtype=np.float32))
    with pytest.raises(ValueError, match="compression='gzip' by range"):
        safe_open(fsspec.open(str(tmp_path / "m.safetensors.gz"), compression="gzip"), "np")
    with pytest.raises(ValueError, match="compression='gzip' by range"):
        safe_open(
            f"file://{tmp_path / 'm.safetensors.gz'}", "np", storage_options={"compression": "gzip"}
        )
    # "infer" (fsspec.open's default in some callers) names none for a .safetensors name.
    with safe_open(
        f"file://{tmp_path / 'm.safetensors'}", "np", storage_options={"compression": "infer"}
    ) as f:
        assert np.array_equal(f.get_tensor("a"), np.arange(6, dtype=np.float32))
    with pytest.raises(ValueError, match=r"compression='infer' \('gzip' for this name\) by"):
        safe_open(
            f"file://{tmp_path / 'm.safetensors.gz'}",
            "np",
            storage_options={"compression": "infer"},
        )
    # An opened one is a file object, read through its own read: decompressed.
    with (
        fsspec.open(str(tmp_path / "m.safetensors.gz"), compression="gzip") as fh,
        safe_open(fh, "np") as f,
    ):
        assert np.array_equal(f.get_tensor("a"), np.arange(6, dtype=np.float32))
