"""A small threaded HTTP/1.1 file server with ``Range`` support and switchable misbehaviour.

The stdlib ``SimpleHTTPRequestHandler`` ignores ``Range`` (cpython #86809), so the remote tests
bring their own. URLs are ``/<name>`` (well-behaved) or ``/<mode>/<name>``:

``ignore-range``       answers 200 with the whole body, as servers without range support do
``truncate``           promises the range, sends half of it, then drops the connection (only
                       for ranges not starting at byte 0, so that opening still works)
``auth``               401 unless ``Authorization: Bearer letmein`` is sent
``forbidden``          always 403
``missing``            always 404
``slow``               waits ``SLOW_SECONDS`` before answering (to observe parallel requests)
``redirect``           302 to ``/<name>`` on the same host
``redirect-other``     302 to ``/auth/<name>`` on ``localhost`` (another host name, same server)
``wrong-range``        206 whose Content-Range starts one byte late
``no-content-range``   206 with the right body and Content-Length but no Content-Range
``redirect-to``        302 to ``redirect_base + "/" + name`` (another port, scheme or host)
``redirect-endless``   302 to ``/<name>`` whose chunked body never ends (until the client
                       hangs up, or ``ENDLESS_SECONDS``)
``gzip``               206 with a gzip-compressed body, despite ``Accept-Encoding: identity``
``bad-length``         206 whose Content-Length is ``"²"`` (``str.isdigit`` says yes, ``int`` no)
``bad-range``          206 whose Content-Range starts with ``"¹"``
``no-etag``            no ETag, only Last-Modified (from the file's mtime), as
                       ``python -m http.server`` does
``trickle``            sends ranges not starting at byte 0 in 1 KiB pieces, ``TRICKLE_SECONDS``
                       apart, as a stalled-but-alive server does
``stall``              sends half of a range not starting at byte 0, then nothing more until
                       the client hangs up (or ``ENDLESS_SECONDS``)

Faults queued with :meth:`RangeServer.inject` (a status code, or ``"reset"`` to close the
connection without answering) are served first, one per request, for any mode.

Every request is logged with its path, Range header, status, body bytes, client port and
Authorization header, so tests can assert exactly what went over the wire. Paths are
percent-decoded to find the file, as real servers do; the log keeps them as sent.

``RangeServer(root, ssl_context=ctx)`` serves HTTPS instead.
"""

from __future__ import annotations

import collections
import contextlib
import email.utils
import gzip
import http.server
import os
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLOW_SECONDS = 0.05
TRICKLE_SECONDS = 0.05
ENDLESS_SECONDS = 20.0
TOKEN = "Bearer letmein"
MODES = frozenset(
    {
        "ignore-range",
        "truncate",
        "auth",
        "forbidden",
        "missing",
        "slow",
        "redirect",
        "redirect-other",
        "wrong-range",
        "no-content-range",
        "redirect-to",
        "redirect-endless",
        "gzip",
        "bad-length",
        "bad-range",
        "no-etag",
        "trickle",
        "stall",
    }
)


@dataclass
class Record:
    """One request as the server saw it."""

    path: str
    range: str | None
    status: int
    nbytes: int
    client_port: int
    authorization: str | None = None


class RangeServer:
    """Serve a directory on 127.0.0.1 on a free port, in a background thread."""

    def __init__(self, root: Path, ssl_context: ssl.SSLContext | None = None) -> None:
        self.root = root
        self.scheme = "http" if ssl_context is None else "https"
        #: Where ``redirect-to`` sends clients (scheme://host:port, no trailing slash).
        self.redirect_base = ""
        self.log: list[Record] = []
        self.lock = threading.Lock()
        self.inflight = 0
        self.max_inflight = 0
        self.faults: dict[str, collections.deque[int | str]] = {}
        handler = type("Handler", (_Handler,), {"owner": self})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        # Clients that reset connections on purpose would otherwise print tracebacks.
        self.httpd.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        if ssl_context is not None:
            self.httpd.socket = ssl_context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}/{path.lstrip('/')}"

    def inject(self, path: str, *faults: int | str) -> None:
        """Queue faults for the next requests to ``/path``."""
        with self.lock:
            self.faults.setdefault("/" + path.lstrip("/"), collections.deque()).extend(faults)

    def reset(self) -> None:
        # A request the previous test gave up on (a client-side timeout against a "slow"
        # path) is still being served, and would be logged in the next test's records.
        stop = time.monotonic() + 5
        while self.inflight and time.monotonic() < stop:
            time.sleep(0.005)
        with self.lock:
            self.log.clear()
            self.faults.clear()
            self.max_inflight = 0
            self.redirect_base = ""

    def records(self, path: str | None = None) -> list[Record]:
        with self.lock:
            if path is None:
                return list(self.log)
            want = "/" + path.lstrip("/")
            return [r for r in self.log if r.path == want]

    def requests(self, path: str | None = None) -> int:
        return len(self.records(path))

    def bytes_sent(self, path: str | None = None) -> int:
        return sum(r.nbytes for r in self.records(path))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the client's connection pool is exercised
    owner: RangeServer
    timeout = 10  # idle keep-alive connections end eventually
    # Headers and body go out in separate writes; without this, Nagle and delayed ACKs add
    # 40 ms to every keep-alive request.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _record(self, status: int, nbytes: int) -> None:
        with self.owner.lock:
            self.owner.log.append(
                Record(
                    self.path,
                    self.headers.get("Range"),
                    status,
                    nbytes,
                    self.client_address[1],
                    self.headers.get("Authorization"),
                )
            )

    def _plain(self, status: int, body: bytes = b"", **headers: str) -> None:
        # Logged before anything is sent: once the client has a reply, a test may look.
        self._record(status, len(body) if self.command != "HEAD" else 0)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _endless_redirect(self, location: str) -> None:
        self._record(302, 0)
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        if self.command == "HEAD":
            return
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
        deadline = time.monotonic() + ENDLESS_SECONDS
        try:
            while time.monotonic() < deadline:
                self.wfile.write(chunk)
        except OSError:
            pass  # the client hung up, as it should

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        owner = self.owner
        with owner.lock:
            owner.inflight += 1
            owner.max_inflight = max(owner.max_inflight, owner.inflight)
            queue = owner.faults.get(self.path)
            fault = queue.popleft() if queue else None
        try:
            self._serve(fault)
        finally:
            with owner.lock:
                owner.inflight -= 1

    def _serve(self, fault: int | str | None) -> None:
        if fault == "reset":
            self._record(0, 0)
            # SO_LINGER 0 makes close() send a RST, like a crashed proxy.
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            self.close_connection = True
            return
        if isinstance(fault, int):
            self._plain(fault, b"injected fault\n", Retry_After="0")
            return
        parts = urllib.parse.unquote(self.path.split("?", 1)[0]).lstrip("/").split("/", 1)
        mode = parts[0] if len(parts) == 2 and parts[0] in MODES else "ok"
        name = parts[1] if mode != "ok" else "/".join(parts)
        if mode == "missing":
            self._plain(404, b"no such file\n")
            return
        if mode == "forbidden":
            self._plain(403, b"forbidden\n")
            return
        if mode == "auth" and self.headers.get("Authorization") != TOKEN:
            self._plain(401, b"who are you\n", WWW_Authenticate="Bearer")
            return
        if mode == "redirect":
            self._plain(302, b"", Location=f"/{name}")
            return
        if mode == "redirect-other":
            self._plain(302, b"", Location=f"http://localhost:{self.owner.port}/auth/{name}")
            return
        if mode == "redirect-endless":
            self._endless_redirect(f"/{name}")
            return
        if mode == "redirect-to":
            self._plain(302, b"", Location=f"{self.owner.redirect_base}/{name}")
            return
        if mode == "slow":
            time.sleep(SLOW_SECONDS)
        file = self.owner.root / name
        if not file.is_file():
            self._plain(404, b"no such file\n")
            return
        data = file.read_bytes()
        size = len(data)
        st = os.stat(file)
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        if mode == "no-etag":
            etag = ""
        spec = self.headers.get("Range")
        if mode == "ignore-range" or not spec:
            self._send_body(200, data, etag)
            return
        span = _parse_range(spec, size)
        if span is None:
            self._plain(416, b"", Content_Range=f"bytes */{size}")
            return
        first, last = span
        body = data[first : last + 1]
        if mode == "gzip":
            body = gzip.compress(body)
        truncate = mode in ("truncate", "stall") and first > 0
        sent = 0 if self.command == "HEAD" else len(body) // 2 if truncate else len(body)
        self._record(206, sent)
        self.send_response(206)
        if mode == "wrong-range":
            self.send_header("Content-Range", f"bytes {first + 1}-{last + 1}/{size}")
        elif mode == "bad-range":
            self.send_header("Content-Range", f"bytes \u00b9-{last}/{size}")
        elif mode != "no-content-range":
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", "\u00b2" if mode == "bad-length" else str(len(body)))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        if etag:
            self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if mode == "gzip":
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        if self.command == "HEAD":
            return
        if mode == "trickle" and first > 0:
            self._trickle(body)
            return
        self.wfile.write(body[:sent])
        if truncate:
            self.wfile.flush()
            self.close_connection = True
            if mode == "stall":
                # Alive but silent: wait for the client to give up and hang up.
                self.connection.settimeout(ENDLESS_SECONDS)
                with contextlib.suppress(OSError):
                    self.connection.recv(1)

    def _trickle(self, body: bytes) -> None:
        try:
            for i in range(0, len(body), 1024):
                self.wfile.write(body[i : i + 1024])
                self.wfile.flush()
                time.sleep(TRICKLE_SECONDS)
        except OSError:
            # The client gave up (its deadline), as the test wants.
            self.close_connection = True

    def _send_body(self, status: int, data: bytes, etag: str) -> None:
        self._record(status, len(data) if self.command != "HEAD" else 0)
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        if etag:
            self.send_header("ETag", etag)
        self.end_headers()
        if self.command == "HEAD":
            return
        try:
            self.wfile.write(data)
        except OSError:
            # The client refused the body (as it should for a large 200); stop quietly.
            self.close_connection = True


def _parse_range(spec: str, size: int) -> tuple[int, int] | None:
    """Parse a single ``bytes=a-b`` / ``a-`` / ``-n`` range; None if unsatisfiable."""
    unit, _, value = spec.partition("=")
    if unit.strip() != "bytes" or "," in value:
        return None
    first_text, _, last_text = value.strip().partition("-")
    if not first_text:
        n = int(last_text)
        if n == 0 or size == 0:
            return None
        return max(0, size - n), size - 1
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)
