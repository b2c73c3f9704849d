"""``deadline`` against servers that trickle where http.client reads on its own: the status
line and headers, a redirect's body, a chunk-size line. Each byte comes well within the socket
``timeout``, so only the deadline can end the request.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pysafetensors._errors import RemoteError
from pysafetensors._remote import HTTPSource

from .rawserver import RawServer, Script, requested_range

#: Pause between the bytes a trickling server sends (the socket timeout is several times this).
DRIP_SECONDS = 0.05
#: How long a trickling server goes on before it hangs up: far past the deadline, so that a
#: client the deadline does not stop fails the timing assertion instead of hanging the tests.
DRIP_FOR = 12.0
DEADLINE = 1.0


def _open_past_deadline(url: str) -> tuple[RemoteError, float]:
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        HTTPSource(url, deadline=DEADLINE, timeout=10 * DRIP_SECONDS, retries=0)
    return info.value, time.monotonic() - started


@pytest.mark.parametrize(
    "opening",
    [
        b"HTTP/1.1 206 Partial Content\r\nX-Pad: ",  # an endless header line
        b"HTTP/1.1 206 ",  # a trickling status line
    ],
    ids=["endless-header", "trickling-status-line"],
)
def test_deadline_ends_a_trickling_reply_head(
    raw: Callable[[Script], RawServer], opening: bytes
) -> None:
    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(opening)
        server.drip(conn, b"a", DRIP_SECONDS, DRIP_FOR)

    server = raw(script)
    error, elapsed = _open_past_deadline(server.url())
    assert error.kind == "Timeout", error
    assert f"deadline of {DEADLINE:g} s" in str(error)
    assert elapsed < DEADLINE + 5


def test_deadline_ends_a_trickling_redirect_body(raw: Callable[[Script], RawServer]) -> None:
    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: /y.safetensors\r\nContent-Length: 60000\r\n\r\n"
        )
        server.drip(conn, b"a", DRIP_SECONDS, DRIP_FOR)

    server = raw(script)
    error, elapsed = _open_past_deadline(server.url())
    assert error.kind == "Timeout", error
    assert "redirect" in str(error)
    assert elapsed < DEADLINE + 5
    assert server.requests == 1  # the redirect was not followed


def test_deadline_ends_an_endless_chunk_size_line(
    raw: Callable[[Script], RawServer], data_dir: Path
) -> None:
    data = (data_dir / "small.safetensors").read_bytes()

    def script(conn: socket.socket, request: bytes) -> None:
        first, last = requested_range(request)
        last = min(last, len(data) - 1)
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % (first, last, len(data))
        )
        # A chunk size of zeros cut short reads as "0", the end of the body.
        server.drip(conn, b"0", DRIP_SECONDS, DRIP_FOR)

    server = raw(script)
    error, elapsed = _open_past_deadline(server.url())
    assert error.kind == "Timeout", error
    assert elapsed < DEADLINE + 5


def test_a_connection_the_deadline_did_not_end_is_reused(
    raw: Callable[[Script], RawServer], data_dir: Path
) -> None:
    # Requests well within their deadline: the watchdog must leave their connections alone.
    data = (data_dir / "small.safetensors").read_bytes()
    server = raw(lambda conn, request: server.serve_ranges(data)(conn, request))
    with HTTPSource(server.url(), deadline=0.3, head_bytes=8, retries=0) as src:
        for offset in (8, 20, 40):
            time.sleep(0.4)  # past the previous request's deadline
            buf = bytearray(10)
            src.readinto(offset, memoryview(buf))
            assert bytes(buf) == data[offset : offset + 10]
    assert server.requests == 1 and len(server.seen) == 4


def test_a_redirect_body_that_stalls_does_not_leave_its_connection_in_the_pool(
    raw: Callable[[Script], RawServer],
) -> None:
    # A redirect's body that stopped arriving (the socket timed out) was given up, but its
    # connection went back to the shared pool with the rest of the body still to come: the
    # next request on it read those bytes as its reply (here, a fake 206 of other content).
    real = b"REAL-FILE-CONTENT-0123456789"
    fake = (
        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-7/8\r\n"
        b"Content-Length: 8\r\n\r\nEVILEVIL"
    )
    first = b"x" * 10

    def script(conn: socket.socket, request: bytes) -> None:
        while request:
            if b" /f " in request.split(b"\r\n", 1)[0]:
                conn.sendall(
                    b"HTTP/1.1 302 Found\r\nLocation: /g\r\nContent-Length: %d\r\n\r\n"
                    % (len(first) + len(fake))
                    + first
                )
                time.sleep(0.8)  # past the client's timeout
                conn.sendall(fake)  # the rest of the redirect's body
            else:
                conn.sendall(
                    b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-%d/%d\r\n"
                    b"Content-Length: %d\r\n\r\n" % (len(real) - 1, len(real), len(real)) + real
                )
            request = server.read_request(conn)

    server = raw(script)
    with HTTPSource(server.url("f"), timeout=0.5, head_bytes=64, retries=0) as src:
        assert src.size == len(real)
        buf = bytearray(len(real))
        src.readinto(0, memoryview(buf))
        assert bytes(buf) == real
