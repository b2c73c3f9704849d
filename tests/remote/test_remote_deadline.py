"""``deadline`` against servers that trickle where http.client reads on its own: the status
line and headers, a redirect's body, a chunk-size line. Each byte comes well within the socket
``timeout``, so only the deadline can end the request.

The servers here are raw loopback sockets: http.server cannot send half a header line.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pysafetensors._errors import RemoteError
from pysafetensors._remote import HTTPSource

#: Pause between the bytes a trickling server sends (the socket timeout is several times this).
DRIP_SECONDS = 0.05
#: How long a trickling server goes on before it hangs up: far past the deadline, so that a
#: client the deadline does not stop fails the timing assertion instead of hanging the tests.
DRIP_FOR = 12.0
DEADLINE = 1.0

Script = Callable[[socket.socket, bytes], None]


class RawServer:
    """Answer each connection on 127.0.0.1 with ``script(conn, request)``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str = "x.safetensors") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(65536)
                    if not data:
                        return
                    request += data
                self.script(conn, request)
            except OSError:
                pass  # the client hung up, as it should at its deadline

    def drip(self, conn: socket.socket, byte: bytes) -> None:
        """Send ``byte`` every DRIP_SECONDS until DRIP_FOR has passed or the client leaves."""
        until = time.monotonic() + DRIP_FOR
        while time.monotonic() < until and not self.stop.is_set():
            conn.sendall(byte)
            time.sleep(DRIP_SECONDS)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def raw() -> Iterator[Callable[[Script], RawServer]]:
    servers: list[RawServer] = []

    def start(script: Script) -> RawServer:
        servers.append(RawServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _requested_range(request: bytes) -> tuple[int, int]:
    match = re.search(rb"\r\nRange: bytes=(\d+)-(\d+)\r\n", request, re.IGNORECASE)
    assert match is not None, request
    return int(match[1]), int(match[2])


def _open_past_deadline(url: str) -> tuple[RemoteError, float]:
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        HTTPSource(url, deadline=DEADLINE, timeout=10 * DRIP_SECONDS, retries=0)
    return info.value, time.monotonic() - started


def test_deadline_ends_endless_headers(raw: Callable[[Script], RawServer]) -> None:
    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\nX-Pad: ")
        server.drip(conn, b"a")

    server = raw(script)
    error, elapsed = _open_past_deadline(server.url())
    assert error.kind == "Timeout", error
    assert f"deadline of {DEADLINE:g} s" in str(error)
    assert elapsed < DEADLINE + 5


def test_deadline_ends_a_trickling_status_line(raw: Callable[[Script], RawServer]) -> None:
    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 206 ")
        server.drip(conn, b"x")

    server = raw(script)
    error, elapsed = _open_past_deadline(server.url())
    assert error.kind == "Timeout", error
    assert elapsed < DEADLINE + 5


def test_deadline_ends_a_trickling_redirect_body(raw: Callable[[Script], RawServer]) -> None:
    def script(conn: socket.socket, request: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: /y.safetensors\r\nContent-Length: 60000\r\n\r\n"
        )
        server.drip(conn, b"a")

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
        first, last = _requested_range(request)
        last = min(last, len(data) - 1)
        conn.sendall(
            b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % (first, last, len(data))
        )
        # A chunk size of zeros cut short reads as "0", the end of the body.
        server.drip(conn, b"0")

    server = raw(script)
    error, elapsed = _open_past_deadline(server.url())
    assert error.kind == "Timeout", error
    assert elapsed < DEADLINE + 5


def test_a_connection_the_deadline_did_not_end_is_reused(
    raw: Callable[[Script], RawServer], data_dir: Path
) -> None:
    # Requests well within their deadline: the watchdog must leave their connections alone.
    data = (data_dir / "small.safetensors").read_bytes()
    ports: list[int] = []

    def script(conn: socket.socket, request: bytes) -> None:
        ports.append(conn.getpeername()[1])
        while request:
            first, last = _requested_range(request)
            last = min(last, len(data) - 1)
            body = data[first : last + 1]
            conn.sendall(
                b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                b'Content-Length: %d\r\nETag: "1"\r\n\r\n%s'
                % (first, last, len(data), len(body), body)
            )
            request = b""
            while b"\r\n\r\n" not in request:
                more = conn.recv(65536)
                if not more:
                    return
                request += more

    server = raw(script)
    with HTTPSource(server.url(), deadline=0.3, head_bytes=8, retries=0) as src:
        for offset in (8, 20, 40):
            time.sleep(0.4)  # past the previous request's deadline
            buf = bytearray(10)
            src.readinto(offset, memoryview(buf))
            assert bytes(buf) == data[offset : offset + 10]
    assert server.requests == 1 and len(ports) == 1
