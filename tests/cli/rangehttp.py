"""A tiny threaded HTTP server over a folder that honours single ``Range`` requests.

The stdlib ``SimpleHTTPRequestHandler`` ignores ``Range``, so remote reads would download whole
files. Every request is logged (path, Range, bytes sent) so tests can check that a command read
only the bytes it needed.
"""

from __future__ import annotations

import http.server
import re
import threading
import time
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHTTPServer:
    """Serve ``root`` on 127.0.0.1 at a free port until :meth:`close`."""

    def __init__(self, root: Path, required: dict[str, str] | None = None) -> None:
        self.root = root
        self.log: list[tuple[str, str | None, int]] = []
        #: Headers every request must carry (else 401), as a server of private models does.
        self.required = dict(required or {})
        #: The values each required header arrived with, one dict per request.
        self.seen: list[dict[str, str | None]] = []
        #: Seconds each request waits before it is answered (a distant server).
        self.delay = 0.0
        #: Requests being answered now, and the most there were at once.
        self.in_flight = 0
        self.most_in_flight = 0
        lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                with lock:
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    if server.delay:
                        time.sleep(server.delay)
                    self._answer()
                finally:
                    with lock:
                        server.in_flight -= 1

            def _answer(self) -> None:
                got = {name: self.headers.get(name) for name in server.required}
                with lock:
                    server.seen.append(got)
                if got != server.required:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = server.root / self.path.lstrip("/").split("?", 1)[0]
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                size = len(data)
                header = self.headers.get("Range")
                m = _RANGE.match(header or "")
                if m:
                    start = int(m.group(1))
                    end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
                    if start >= size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    body = data[start : end + 1]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                else:
                    body = data
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                # Logged before the body goes out: the client can have it all, and the test
                # count the log, before this thread runs again after the write.
                with lock:
                    server.log.append((self.path, header, len(body)))
                self.wfile.write(body)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def bytes_sent(self, name: str) -> int:
        """Body bytes sent for ``/name`` so far."""
        return sum(n for path, _, n in self.log if path.lstrip("/") == name)

    def close(self) -> None:
        """Stop serving."""
        self._httpd.shutdown()
        self._httpd.server_close()


__all__ = ["RangeHTTPServer"]
