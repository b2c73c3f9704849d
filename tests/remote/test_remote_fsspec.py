"""FsspecSource on fsspec's ``memory://`` and ``file://`` filesystems, and the dispatcher."""

from __future__ import annotations

import random
import socket
import struct
import traceback
import uuid
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


def _batching_memory_fs(calls: list[int]) -> Any:
    """A memory filesystem that looks asynchronous, so parts go through one cat_ranges call
    (each call's number of ranges appended to ``calls``)."""
    fs = fsspec.filesystem("memory")

    class Batching(type(fs)):  # type: ignore[misc]
        async_impl = True

        def cat_ranges(self, paths, starts, ends, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(len(paths))
            return super().cat_ranges(paths, starts, ends, **kwargs)

    return Batching(skip_instance_cache=True)


def test_batched_cat_ranges_on_async_filesystems(mem_url: tuple[str, Path]) -> None:
    root, data_dir = mem_url
    data = (data_dir / "blob.bin").read_bytes()
    calls: list[int] = []
    batching = _batching_memory_fs(calls)
    path = f"{root}/blob.bin".removeprefix("memory://")
    with FsspecSource(path, fs=batching, head_bytes=0, part_size=100_000) as src:
        ranges = [(10, 5), (500_000, 250_000), (2_000_000, 7)]
        out = bytearray(250_012)
        src.readinto_many(ranges, memoryview(out))
        assert bytes(out) == b"".join(data[o : o + n] for o, n in ranges)
    assert calls == [5]  # one call for 1 + 3 + 1 parts


def test_scattered_pieces_on_async_filesystems(mem_url: tuple[str, Path]) -> None:
    """readinto_scattered through one cat_ranges call: pieces to several buffers, some
    merged into one part (scattered from it), a large one split into parts (received whole)."""
    root, data_dir = mem_url
    data = (data_dir / "blob.bin").read_bytes()
    calls: list[int] = []
    batching = _batching_memory_fs(calls)
    path = f"{root}/blob.bin".removeprefix("memory://")
    shared = bytearray(300)
    large = bytearray(250_000)
    pieces = [
        (1000, 100, memoryview(shared), 0),
        (1150, 100, memoryview(shared), 200),  # near the first: one part, scattered
        (1100, 50, memoryview(shared), 100),
        (600_000, 250_000, memoryview(large), 0),  # three parts, received in place
    ]
    with FsspecSource(path, fs=batching, head_bytes=0, part_size=100_000) as src:
        src.readinto_scattered(pieces)
    assert bytes(shared) == data[1000:1100] + data[1100:1150] + bytes(50) + data[1150:1250]
    assert bytes(large) == data[600_000:850_000]
    assert calls == [4]


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
