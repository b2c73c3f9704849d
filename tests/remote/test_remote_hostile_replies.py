"""Replies that http.client takes at face value and that gave wrong bytes, or downloads without
end: validators that vanish, transfer codings it does not decode, interim replies, endless
trailers of a redirect's chunked body, and a certificate that does not verify."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable

import numpy as np
import pytest

from pysafetensors import RemoteError, safe_open
from pysafetensors._remote_http import HTTPSource
from pysafetensors._remote_source import parse_content_range
from pysafetensors.numpy import save

from .rangeserver import RangeServer
from .rawserver import RawServer, Script, requested_range

OLD = save({"w": np.zeros(50_000, np.float32)})
NEW = save({"w": np.full(50_000, 7, np.float32)})
assert len(OLD) == len(NEW)


def _partial(data: bytes, request: bytes, extra: bytes = b"") -> bytes:
    first, last = requested_range(request)
    last = min(last, len(data) - 1)
    body = data[first : last + 1]
    return (
        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n%s\r\n%s"
        % (first, last, len(data), len(body), extra, body)
    )


@pytest.mark.parametrize(
    "validators",
    [b'ETag: "v1"\r\n', b"Last-Modified: Mon, 30 Nov 2026 10:00:00 GMT\r\n"],
    ids=["etag", "last-modified"],
)
def test_a_reply_without_the_validator_the_file_had_is_a_change(
    raw: Callable[[Script], RawServer], validators: bytes
) -> None:
    """The file replaced by one of the same size, and the later replies name no version: it
    read half old, half new."""
    replies: list[bytes] = []

    def script(conn: socket.socket, request: bytes) -> None:
        first = not replies
        replies.append(request)
        conn.sendall(_partial(OLD if first else NEW, request, validators if first else b""))

    server = raw(script)
    with pytest.raises(RemoteError) as info:  # at open, or at the read: any reply after the first
        safe_open(server.url(), "np", storage_options={"head_bytes": 100}).get_tensor("w")
    assert info.value.kind == "Changed" and "reopen it" in str(info.value)
    assert len(replies) >= 2


def test_a_reply_that_drops_the_etag_is_a_change_whatever_its_last_modified(
    raw: Callable[[Script], RawServer],
) -> None:
    """The file had an ETag and a Last-Modified at open; later replies (a front end that
    strips ETags, say) keep the Last-Modified, which has one-second granularity, and the file
    was replaced within that second: it read half old, half new."""
    modified = b"Last-Modified: Mon, 30 Nov 2026 10:00:00 GMT\r\n"
    replies: list[bytes] = []

    def script(conn: socket.socket, request: bytes) -> None:
        first = not replies
        replies.append(request)
        extra = b'ETag: "v1"\r\n' + modified if first else modified
        conn.sendall(_partial(OLD if first else NEW, request, extra))

    server = raw(script)
    with pytest.raises(RemoteError, match="without the ETag") as info:
        safe_open(server.url(), "np", storage_options={"head_bytes": 100}).get_tensor("w")
    assert info.value.kind == "Changed" and "reopen it" in str(info.value)


def test_a_server_that_names_no_version_is_read_unchecked(
    raw: Callable[[Script], RawServer],
) -> None:
    """Documented: without ETag or Last-Modified there is nothing to compare."""

    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(_partial(OLD, request))

    server = raw(script)
    with safe_open(server.url(), "np", storage_options={"head_bytes": 1000}) as f:
        assert not f.get_tensor("w").any()


@pytest.mark.parametrize("coding", [b"gzip", b"gzip, chunked", b"deflate"])
def test_a_transfer_coding_other_than_chunked_is_refused(
    raw: Callable[[Script], RawServer], coding: bytes
) -> None:
    """http.client decodes "chunked" alone: the coded bytes became the tensor's."""

    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(_partial(OLD, request, b"Transfer-Encoding: %s\r\n" % coding))

    server = raw(script)
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url(), retries=0)
    assert info.value.kind == "ContentEncoding" and "Transfer-Encoding" in str(info.value)


def test_interim_replies_are_skipped_and_bounded(raw: Callable[[Script], RawServer]) -> None:
    """``103 Early Hints`` was taken for the reply; ``100 Continue`` sent for ever was read for
    ever (no timeout fires while bytes keep coming)."""

    def hints(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        conn.sendall(_partial(OLD, request))

    with HTTPSource(raw(hints).url()) as src:
        assert src.size == len(OLD)

    def flood(conn: socket.socket, request: bytes) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 30:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * 64)

    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"more than 16 interim \(1xx\) replies"):
        HTTPSource(raw(flood).url(), retries=0)
    assert time.monotonic() - started < 10


def test_a_redirect_body_with_endless_trailers_is_not_read(
    raw: Callable[[Script], RawServer],
) -> None:
    """http.client reads a chunked body's trailer lines without a limit: gigabytes in
    seconds, from a redirect whose body is not even wanted."""

    def script(conn: socket.socket, request: bytes) -> None:
        if b"GET /start" in request:
            conn.sendall(
                b"HTTP/1.1 302 Found\r\nLocation: /x.safetensors\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n0\r\n"
            )
            started = time.monotonic()
            while time.monotonic() - started < 30:
                conn.sendall(b"X-Trailer: " + b"a" * 1000 + b"\r\n")
        else:
            conn.sendall(_partial(OLD, request))

    server = raw(script)
    started = time.monotonic()
    with HTTPSource(server.url("start")) as src:
        assert src.size == len(OLD)
    assert time.monotonic() - started < 10


def test_a_certificate_that_does_not_verify_is_named(tls_server: RangeServer) -> None:
    """It was reported as a request we refused to send (the certificate error is also a
    ValueError), blaming the caller's headers or URL."""
    with pytest.raises(RemoteError) as info:
        HTTPSource(tls_server.url("small.safetensors"), retries=0)
    assert info.value.kind == "TLSError"
    assert "TLS certificate verification failed" in str(info.value)
    assert isinstance(ssl.SSLCertVerificationError("x"), ValueError)  # why it was misread


def test_an_s3_reply_without_the_etag_the_object_had_is_a_change(
    raw: Callable[[Script], RawServer],
) -> None:
    """An S3-compatible store (boto3 against a loopback server) that stops naming the
    object's version while it is replaced by one of the same size."""
    pytest.importorskip("boto3")
    from pysafetensors._remote_s3 import S3Source

    replies: list[bytes] = []

    def script(conn: socket.socket, request: bytes) -> None:
        first = not replies
        replies.append(request)
        conn.sendall(_partial(OLD if first else NEW, request, b'ETag: "v1"\r\n' if first else b""))

    server = raw(script)
    endpoint = f"http://127.0.0.1:{server.port}"
    with pytest.raises(RemoteError) as info:
        source = S3Source(
            "s3://models/x.safetensors", endpoint_url=endpoint, anon=True, retries=0, head_bytes=100
        )
        source.readinto(len(OLD) - 1000, memoryview(bytearray(1000)))
    assert info.value.kind == "Changed"
    assert len(replies) >= 2 and replies[0].startswith(b"GET /models/x.safetensors")


@pytest.mark.parametrize("header", ["Content-Range", "Content-Length"])
def test_a_number_too_long_to_convert_is_a_malformed_reply(
    raw: Callable[[Script], RawServer], header: str
) -> None:
    """A header value of more digits than Python converts (4300) raised a bare ValueError
    from int(), naming neither the URL nor the header; S3's Content-Range went the same way."""
    huge = b"9" * 5000
    fields = {
        "Content-Range": b"Content-Range: bytes 0-9/%s\r\nContent-Length: 10" % huge,
        "Content-Length": b"Content-Range: bytes 0-9/20\r\nContent-Length: %s" % huge,
    }

    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\n%s\r\n\r\n%s" % (fields[header], bytes(10)))

    server = raw(script)
    with pytest.raises(RemoteError, match=f"malformed {header}") as info:
        HTTPSource(server.url(), head_bytes=10, retries=0)
    assert info.value.kind == "InvalidResponse"
    assert str(info.value).startswith(server.url() + ": ")
    assert len(str(info.value)) < 300  # the value is not quoted whole
    with pytest.raises(RemoteError, match="malformed Content-Range") as s3:
        parse_content_range("bytes 0-9/" + "9" * 5000, "s3://b/k")
    assert s3.value.kind == "InvalidResponse" and str(s3.value).startswith("s3://b/k: ")
    # Leading zeros are still only zeros.
    assert parse_content_range("bytes 0-9/" + "0" * 5000 + "20", "u") == (0, 9, 20)


def test_a_redirect_to_a_location_in_raw_utf8_is_followed_to_that_path(
    raw: Callable[[Script], RawServer],
) -> None:
    """A Location header of raw UTF-8 bytes (``/modèle.safetensors``, as some servers send
    it): http.client decodes header bytes as Latin-1, and the mojibake was percent-encoded
    again, so the request went to ``/mod%C3%83%C2%A8le.safetensors`` (a 404)."""
    data = save({"w": np.arange(1000, dtype=np.float32)})

    def script(conn: socket.socket, request: bytes) -> None:
        while request:
            path = request.split(b" ", 2)[1]
            if path == b"/start":
                reply = b"HTTP/1.1 302 Found\r\nLocation: /mod\xc3\xa8le.safetensors\r\n"
                conn.sendall(reply + b"Content-Length: 0\r\n\r\n")
            elif path == b"/mod%C3%A8le.safetensors":
                first, last = requested_range(request)
                last = min(last, len(data) - 1)
                conn.sendall(
                    b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                    b"Content-Length: %d\r\n\r\n%s"
                    % (first, last, len(data), last - first + 1, data[first : last + 1])
                )
            else:
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            request = server.read_request(conn)

    server = raw(script)
    with safe_open(server.url("start"), "np") as f:
        assert f.get_tensor("w").tolist() == list(range(1000))
    with HTTPSource(server.url("start")) as src:
        assert src.url == server.url("modèle.safetensors")
