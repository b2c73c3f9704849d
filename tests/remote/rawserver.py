"""A raw loopback HTTP server for replies that http.server cannot produce: half a header
line, a status line sent byte by byte, a chunk-size line that never ends, or a request whose
every header line the test wants to see as sent.

Each connection runs ``script(conn, request)`` in a thread, ``request`` being the bytes of the
first request up to its blank line.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable

Script = Callable[[socket.socket, bytes], None]


class RawServer:
    """Answer each connection on 127.0.0.1 with ``script(conn, request)``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        #: Connections accepted.
        self.requests = 0
        #: Every request read by :meth:`read_request`, as sent.
        self.seen: list[bytes] = []
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
                request = self.read_request(conn)
                if request:
                    self.script(conn, request)
            except OSError:
                pass  # the client hung up (at its deadline, say)

    def read_request(self, conn: socket.socket) -> bytes:
        """The next request's bytes up to its blank line; b"" when the client hung up."""
        request = b""
        while b"\r\n\r\n" not in request:
            data = conn.recv(65536)
            if not data:
                return b""
            request += data
        self.seen.append(request)
        return request

    def drip(self, conn: socket.socket, byte: bytes, every: float, until: float) -> None:
        """Send ``byte`` every ``every`` seconds for ``until`` seconds, or until the client
        leaves or the server closes."""
        stop = time.monotonic() + until
        while time.monotonic() < stop and not self.stop.is_set():
            conn.sendall(byte)
            time.sleep(every)

    def serve_ranges(self, data: bytes) -> Script:
        """A script answering every request on a connection with a ``206`` of ``data``'s
        requested range (keep-alive)."""

        def script(conn: socket.socket, request: bytes) -> None:
            while request:
                first, last = requested_range(request)
                last = min(last, len(data) - 1)
                body = data[first : last + 1]
                conn.sendall(
                    b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                    b'Content-Length: %d\r\nETag: "1"\r\n\r\n%s'
                    % (first, last, len(data), len(body), body)
                )
                request = self.read_request(conn)

        return script

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def requested_range(request: bytes) -> tuple[int, int]:
    """The ``first, last`` of a request's ``Range: bytes=first-last``."""
    match = re.search(rb"\r\nRange: bytes=(\d+)-(\d+)\r\n", request, re.IGNORECASE)
    assert match is not None, request
    return int(match[1]), int(match[2])
