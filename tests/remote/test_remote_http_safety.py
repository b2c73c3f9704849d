"""HTTPSource against loopback servers that test its guards: where credentials go, URLs that
need encoding or cannot work, malformed or compressed replies, files replaced on servers without
ETags, and servers too slow for a deadline."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors._errors import RemoteError
from pysafetensors._remote import HTTPSource, RemotePermissionError
from pysafetensors._remote_http import _IDLE, _credentials_may_go
from pysafetensors._remote_source import parse_content_range

from .rangeserver import TOKEN, TRICKLE_SECONDS, RangeServer

FAST = {"backoff": 0.001}
AUTH = {"Authorization": TOKEN, "Cookie": "session=1", "X-Api-Key": "k", "User-Agent": "ua"}


def _read(src: HTTPSource, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    src.readinto(offset, memoryview(buf))
    return bytes(buf)


# ------------------------------------------------------------------------------ credentials


def test_credentials_follow_a_redirect_to_the_same_origin(server: RangeServer) -> None:
    server.redirect_base = f"http://127.0.0.1:{server.port}"
    with HTTPSource(server.url("redirect-to/auth/small.safetensors"), headers=AUTH) as src:
        assert src.size > 0
    assert server.records("auth/small.safetensors")[0].authorization == TOKEN


def test_credentials_do_not_follow_a_redirect_to_another_port(
    server: RangeServer, data_dir: Path
) -> None:
    other = RangeServer(data_dir)
    try:
        server.redirect_base = f"http://127.0.0.1:{other.port}"
        # The message says why the headers given did not reach it, and where they go.
        with pytest.raises(RemotePermissionError, match=r"401\) after a redirect from .*not sent"):
            HTTPSource(server.url("redirect-to/auth/small.safetensors"), headers=AUTH)
        (record,) = other.records("auth/small.safetensors")
        assert record.authorization is None and record.status == 401
    finally:
        other.close()
    # The origin did get them. (Filtered by path: a handler of an earlier test on this shared
    # server, e.g. a trickling one the client gave up on, may log after the reset.)
    origin = server.records("redirect-to/auth/small.safetensors")
    assert [r.authorization for r in origin] == [TOKEN]


def test_credentials_do_not_follow_a_downgrade_from_https_to_http(
    tls_server: RangeServer, server: RangeServer, tls_cert: tuple[Path, Path]
) -> None:
    # The reviewer's case: https://host redirects to http://host (same host name); the token
    # would cross the network in clear text.
    tls_server.redirect_base = f"http://127.0.0.1:{server.port}"
    ctx = ssl.create_default_context(cafile=str(tls_cert[0]))
    with pytest.raises(RemotePermissionError, match="401"):
        HTTPSource(
            tls_server.url("redirect-to/auth/small.safetensors"), headers=AUTH, ssl_context=ctx
        )
    (record,) = server.records("auth/small.safetensors")
    assert record.authorization is None
    assert [r.authorization for r in tls_server.records("redirect-to/auth/small.safetensors")] == [
        TOKEN
    ]


def test_https_source_reads_over_tls(tls_server: RangeServer, tls_cert: tuple[Path, Path]) -> None:
    ctx = ssl.create_default_context(cafile=str(tls_cert[0]))
    with HTTPSource(tls_server.url("auth/small.safetensors"), headers=AUTH, ssl_context=ctx) as src:
        assert src.size > 0


def _key(server: RangeServer) -> tuple[str, str, int]:
    """The idle connections' key of ``server``'s origin."""
    return ("https", "127.0.0.1", server.port)


def _idle_with(contexts: list[ssl.SSLContext]) -> int:
    """Idle connections kept for any of ``contexts``."""
    with _IDLE._lock:
        return sum(len(conns) for (_, ctx), conns in _IDLE._idle.items() if ctx in contexts)


def test_idle_connections_of_a_tls_context_no_source_uses_are_closed(
    tls_server: RangeServer, tls_cert: tuple[Path, Path]
) -> None:
    """Idle connections are kept per TLS context: a context made for each file (30 files, 8
    parallel parts each) left every one's connections open after its file was closed, never
    to be reused (only a source with that very context may take them): 186 sockets."""
    contexts = []
    for _ in range(30):
        contexts.append(ssl.create_default_context(cafile=str(tls_cert[0])))
        with HTTPSource(
            tls_server.url("blob.bin"), ssl_context=contexts[-1], part_size=1 << 17
        ) as src:
            _read(src, 0, 1 << 20)  # 8 parts at once: 8 connections
            assert _idle_with(contexts[-1:]) >= 1
    assert _idle_with(contexts) == 0
    # Files sharing a context (the shards of a checkpoint) still share its connections, until
    # the last of them is closed.
    shared = ssl.create_default_context(cafile=str(tls_cert[0]))
    first = HTTPSource(tls_server.url("blob.bin"), ssl_context=shared, part_size=1 << 17)
    with HTTPSource(
        tls_server.url("blob.bin"), ssl_context=shared, head_bytes=0, read_ahead=0
    ) as second:
        _read(first, 0, 1 << 20)
        first.close()
        with _IDLE._lock:
            ports = {c.sock.getsockname()[1] for c in _IDLE._idle[(_key(tls_server), shared)]}
        assert ports
        tls_server.reset()
        _read(second, 0, 10)
        (record,) = tls_server.records()
        assert record.client_port in ports  # a connection the closed file had used
    assert _idle_with([shared]) == 0


def test_a_context_released_while_its_lock_is_held_is_settled_later(
    tls_server: RangeServer, tls_cert: tuple[Path, Path]
) -> None:
    """A dropped source's finalizer releases its TLS context wherever the collector runs, also
    on a thread holding the store's lock: it waited for that lock, for ever."""
    ctx = ssl.create_default_context(cafile=str(tls_cert[0]))
    with HTTPSource(tls_server.url("blob.bin"), ssl_context=ctx, part_size=1 << 17) as src:
        _read(src, 0, 1 << 20)
        _IDLE.retain(ctx)  # the finalizer's source, still open
    assert _idle_with([ctx]) >= 1
    done = threading.Event()

    def release_under_the_lock() -> None:
        with _IDLE._lock:
            _IDLE.release(ctx)  # as a finalizer run there by the collector
        done.set()

    worker = threading.Thread(target=release_under_the_lock, daemon=True)
    worker.start()
    assert done.wait(5), "release waited for the lock its own thread held"
    _IDLE.take((_key(tls_server), None))  # the next call settles it
    assert _idle_with([ctx]) == 0


def test_which_redirects_keep_credentials() -> None:
    origin = ("https", "hub.example", 443)
    assert _credentials_may_go(origin, ("https", "hub.example", 443))
    assert not _credentials_may_go(origin, ("http", "hub.example", 80))  # downgrade
    assert not _credentials_may_go(origin, ("https", "hub.example", 8443))  # other port
    assert not _credentials_may_go(origin, ("https", "cdn.example", 443))  # other host
    # An upgrade to https on the default ports is the same site (as requests decides).
    assert _credentials_may_go(("http", "hub.example", 80), ("https", "hub.example", 443))
    assert not _credentials_may_go(("http", "hub.example", 8080), ("https", "hub.example", 443))


def test_only_harmless_headers_reach_another_origin() -> None:
    src = HTTPSource.__new__(HTTPSource)
    src._origin_key = ("https", "hub.example", 443)
    src._headers = dict(AUTH)
    same = src._headers_for(("https", "hub.example", 443), 0, 9)
    other = src._headers_for(("https", "cdn.example", 443), 0, 9)
    assert same["Authorization"] == TOKEN and same["X-Api-Key"] == "k"
    assert set(other) == {"User-Agent", "Range", "Accept-Encoding"}
    assert other["User-Agent"] == "ua"


# ------------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("name", "url_name", "sent"),
    [
        ("a b é.bin", "a b é.bin", "/a%20b%20%C3%A9.bin"),  # raw: encoded once
        ("a b é.bin", "a%20b%20%C3%A9.bin", "/a%20b%20%C3%A9.bin"),  # escapes kept, not doubled
        ("100%.bin", "100%.bin", "/100%25.bin"),  # a '%' starting no escape is encoded
        ("x;y=1,z.bin", "x;y=1,z.bin", "/x;y=1,z.bin"),  # reserved characters kept
    ],
)
def test_paths_are_percent_encoded(
    server: RangeServer, data_dir: Path, name: str, url_name: str, sent: str
) -> None:
    target = data_dir / name
    target.write_bytes(b"0123456789" * 10)
    try:
        with HTTPSource(server.url(url_name) + "?sig=a b&x=%2F", head_bytes=4) as src:
            assert _read(src, 50, 5) == b"01234"
        paths = {r.path for r in server.records()}
        assert paths == {sent + "?sig=a%20b&x=%2F"}
    finally:
        target.unlink()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999/x.safetensors",
        "http://127.0.0.1:abc/x.safetensors",
        "http://127.0.0.1:1/x.safetensors\r\nX-Injected: 1",
        "http://[::1/x.safetensors",
    ],
)
def test_malformed_urls_fail_at_once(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import pysafetensors._remote_source as remote_source

    slept: list[float] = []
    monkeypatch.setattr(remote_source.time, "sleep", slept.append)
    with pytest.raises(RemoteError) as info:
        HTTPSource(url, retries=3, backoff=1.0)
    assert info.value.kind == "InvalidURL"
    assert slept == []  # no retry, no backoff


def test_unsendable_header_fails_at_once(server: RangeServer) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(
            server.url("small.safetensors"), headers={"Authorization": "a\r\nX: y"}, backoff=1.0
        )
    assert info.value.kind == "InvalidRequest"
    assert server.requests() == 0


@pytest.mark.parametrize("value", ["Bearer SECRET\r\nX: y", "Bearer SECRET\u20ac"])
def test_an_unsendable_header_s_value_is_not_quoted(server: RangeServer, value: str) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url("small.safetensors"), headers={"Authorization": value})
    assert "'Authorization'" in str(info.value)
    assert "SECRET" not in str(info.value) and info.value.__cause__ is None
    # Not even as the exception being handled when it was raised (error reporters walk it).
    assert info.value.__context__ is None


def test_sharded_errors_do_not_show_credentials_or_signatures(
    server: RangeServer, data_dir: Path
) -> None:
    import json

    from pysafetensors import ShardIndexError, safe_open

    folder = data_dir / "leak"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"nope": "small.safetensors"}})
    )
    (folder / "small.safetensors").write_bytes((data_dir / "small.safetensors").read_bytes())
    (folder / "bad.safetensors.index.json").write_text("{not json")
    base = server.url("leak/").replace("http://", "http://user:hunter2@")
    for name in ("model", "bad"):
        url = f"{base}{name}.safetensors.index.json?sig=SECRET"
        with pytest.raises(ShardIndexError) as info, safe_open(url, "np") as f:
            f.validate()
        text = str(info.value)
        assert "hunter2" not in text and "SECRET" not in text, text


def test_a_remote_index_s_missing_shard_is_a_missing_shard_error(
    server: RangeServer, data_dir: Path
) -> None:
    """A shard the server does not have is the index's missing shard, as a local index's is
    (the index and a tensor it places there named), not a bare 404 naming the shard's URL."""
    import json

    from pysafetensors import MissingShardError, safe_open
    from pysafetensors._errors import RemoteNotFoundError
    from pysafetensors.numpy import load_file, save_file

    folder = data_dir / "gap"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(
        # The missing shard last: opens ahead of the one that fails are not waited for, and
        # a request still in flight would land in the next test's records.
        json.dumps({"weight_map": {"a": "here.safetensors", "b": "zz-gone.safetensors"}})
    )
    save_file({"a": np.zeros(2, np.float32)}, folder / "here.safetensors")
    url = server.url("gap/model.safetensors.index.json")
    with safe_open(url, "np") as f:
        assert f.get_tensor("a").nbytes == 8  # shards open as they are needed
        calls = [lambda: f.get_tensor("b"), f.validate, f.offset_keys]
        for call in calls:
            with pytest.raises(MissingShardError) as info:
                call()
            assert info.value.kind == "MissingShard" and info.value.tensor == "b"
            text = str(info.value)
            assert "model.safetensors.index.json" in text and "'zz-gone.safetensors'" in text
            assert "not found (404)" in text
            assert isinstance(info.value.__cause__, RemoteNotFoundError)
    with pytest.raises(MissingShardError):
        load_file(url)


def test_a_remote_single_file_gone_is_not_called_an_index_s_shard(
    server: RangeServer, data_dir: Path
) -> None:
    """A folder URL holding one file opens that file as the checkpoint: gone from the
    server, it is the file that is not found (there is no index to name)."""
    from pysafetensors import MissingShardError
    from pysafetensors._errors import RemoteNotFoundError
    from pysafetensors._sharded import ShardedSafeOpen
    from pysafetensors.numpy import save_file

    target = data_dir / "lone" / "model.safetensors"
    target.parent.mkdir(exist_ok=True)
    save_file({"a": np.zeros(2, np.float32)}, target)
    with ShardedSafeOpen(server.url("lone/"), framework="np") as f:
        target.unlink()
        with pytest.raises(RemoteNotFoundError) as info:
            f.validate()
        assert not isinstance(info.value, MissingShardError)
        assert "index" not in str(info.value)


def test_redirect_to_another_scheme_is_refused(server: RangeServer) -> None:
    server.redirect_base = "file:///etc"
    with pytest.raises(RemoteError, match="not an http") as info:
        HTTPSource(server.url("redirect-to/passwd"), backoff=1.0)
    assert info.value.kind == "InvalidURL"
    assert server.requests() == 1


# -------------------------------------------------------------------------- malformed replies


@pytest.mark.parametrize(
    ("mode", "header"), [("bad-length", "Content-Length"), ("bad-range", "Content-Range")]
)
def test_non_ascii_digits_are_a_remote_error(server: RangeServer, mode: str, header: str) -> None:
    # '²' and '¹' pass str.isdigit() but not int(): a RemoteError at once, not a ValueError.
    with pytest.raises(RemoteError, match=f"malformed {header}") as info:
        HTTPSource(server.url(f"{mode}/small.safetensors"), backoff=1.0)
    assert info.value.kind == "InvalidResponse"
    assert server.requests() == 1


def test_content_range_forms() -> None:
    assert parse_content_range("bytes 0-9/100", "u") == (0, 9, 100)
    assert parse_content_range("Bytes  5 - 9 / * ", "u") == (5, 9, None)
    assert parse_content_range("bytes */100", "u") == (None, None, 100)
    assert parse_content_range(None, "u") == (None, None, None)
    for bad in ("", "bytes 0-9", "items 0-9/100", "bytes 0-9/１００", "bytes -9/100"):
        with pytest.raises(RemoteError):
            parse_content_range(bad, "u")


def test_compressed_body_is_reported_at_once(server: RangeServer) -> None:
    with pytest.raises(RemoteError, match="Content-Encoding 'gzip'") as info:
        HTTPSource(server.url("gzip/model.safetensors"), backoff=1.0)
    assert info.value.kind == "ContentEncoding"
    assert server.requests() == 1


# ---------------------------------------------------------------- files replaced on the server


def _replace(path: Path, data: bytes, mtime: int) -> None:
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))


def test_replacement_without_etag_is_detected_by_last_modified(
    server: RangeServer, data_dir: Path
) -> None:
    target = data_dir / "no-etag.bin"
    _replace(target, b"a" * 200_000, 1_700_000_000)
    try:
        with HTTPSource(server.url("no-etag/no-etag.bin"), **FAST) as src:
            assert _read(src, 100_000, 10) == b"a" * 10  # unchanged: fine
            _replace(target, b"b" * 200_000, 1_700_000_100)  # same size, newer
            with pytest.raises(RemoteError, match="Last-Modified") as info:
                _read(src, 150_000, 10)
            assert info.value.kind == "Changed"
    finally:
        target.unlink()


# ------------------------------------------------------------------------------- deadlines


def test_timeout_alone_does_not_stop_a_trickling_server(server: RangeServer) -> None:
    # Each 1 KiB piece comes well within the socket timeout: the read goes on, slowly. This is
    # what the documentation warns about, and what ``deadline`` is for.
    with HTTPSource(server.url("trickle/blob.bin"), head_bytes=0, timeout=5) as src:
        started = time.monotonic()
        assert len(_read(src, 1, 4096)) == 4096
        assert time.monotonic() - started >= 3 * TRICKLE_SECONDS


def test_deadline_stops_a_trickling_server(server: RangeServer) -> None:
    # 100 KiB at 1 KiB per TRICKLE_SECONDS would take 5 s.
    with HTTPSource(
        server.url("trickle/blob.bin"), head_bytes=0, timeout=5, deadline=0.5, retries=0
    ) as src:
        started = time.monotonic()
        with pytest.raises(RemoteError, match="deadline of 0.5 s") as info:
            _read(src, 1, 100 << 10)
        elapsed = time.monotonic() - started
    assert info.value.kind == "Timeout"
    assert 0.4 < elapsed < 2.0


def test_deadline_covers_the_wait_for_the_reply(server: RangeServer) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url("slow/small.safetensors"), deadline=0.01, retries=1, **FAST)
    assert info.value.kind == "Timeout" and "after 2 attempts" in str(info.value)


def test_reads_under_a_deadline_are_exact(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    with HTTPSource(server.url("blob.bin"), deadline=30, part_size=1 << 20) as src:
        assert _read(src, 12_345, 2_500_000) == data[12_345:2_512_345]
        assert _read(src, 3, 7) == data[3:10]
    with pytest.raises(ValueError, match="deadline"):
        HTTPSource(server.url("blob.bin"), deadline=0)


@pytest.mark.parametrize("bound", ["timeout", "deadline"])
def test_a_name_that_resolves_slowly_is_bounded(
    server: RangeServer, bound: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The system resolver takes no timeout: a name server that did not answer held the open
    for its own retries, past ``timeout`` and ``deadline`` alike. (No resolver here can be
    made slow: the lookup of one name is delayed in the process.)"""
    real = socket.getaddrinfo
    port = server.url("x").split(":")[2].split("/")[0]

    def slow(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.invalid":
            time.sleep(3)
            return real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    limit = {"timeout": 0.3} if bound == "timeout" else {"timeout": 30, "deadline": 0.3}
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        HTTPSource(f"http://slow.invalid:{port}/small.safetensors", retries=0, **limit)
    assert time.monotonic() - started < 2
    if bound == "timeout":  # as a connection that times out
        assert "resolving slow.invalid took over 0.3 s" in str(info.value)
    else:
        assert info.value.kind == "Timeout" and "deadline of 0.3 s" in str(info.value)
    # A name that answers in time is connected to as before.
    HTTPSource(server.url("small.safetensors"), retries=0, **limit).close()
