"""A small stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, enough for
``huggingface_hub.HfFileSystem`` (``hf://`` URLs) to list, resolve and read model repositories.

It serves the endpoints ``HfFileSystem`` calls: repository info (``/api/models/<repo>`` and
``.../revision/<rev>``), folder listings (``.../tree/<rev>/<path>``), file info
(``POST .../paths-info/<rev>``) and downloads (``/<repo>/resolve/<rev>/<path>``, with
``Range``). Repositories are added with :meth:`HubServer.add`; every download is logged with
its path, Range header and body size, so tests can count the bytes that went over the wire.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True)
class Download:
    path: str
    range: str | None
    status: int
    nbytes: int


class HubServer:
    """A threaded HTTP/1.1 server answering as the Hub does for the calls above."""

    def __init__(self) -> None:
        self._repos: dict[tuple[str, str], dict[str, bytes]] = {}
        self.downloads: list[Download] = []
        self.api_calls: list[str] = []
        #: Seconds each download waits before it is answered (a distant server).
        self.delay = 0.0
        #: Downloads being answered now, and the most there were at once.
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, b"")

            def do_HEAD(self) -> None:
                hub._answer(self, b"")

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                hub._answer(self, self.rfile.read(n))

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo: str, revision: str, files: dict[str, bytes]) -> None:
        """Serve ``files`` (path in the repository -> contents) as ``repo`` at ``revision``."""
        self._repos[(repo, revision)] = dict(files)

    def downloaded(self) -> int:
        """Body bytes sent for downloads so far."""
        return sum(d.nbytes for d in self.downloads)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _send(
        self,
        handler: http.server.BaseHTTPRequestHandler,
        status: int,
        body: bytes = b"",
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def _json(self, handler: http.server.BaseHTTPRequestHandler, value: object) -> None:
        body = json.dumps(value).encode()
        self._send(handler, 200, body, (("Content-Type", "application/json"),))

    def _missing(self, handler: http.server.BaseHTTPRequestHandler, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(
            handler, 404, body, (("X-Error-Code", code), ("Content-Type", "application/json"))
        )

    def _answer(self, handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        path = urllib.parse.urlsplit(handler.path).path
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if m:
            self.api_calls.append(path)
            revision = urllib.parse.unquote(m.group(2) or "main")
            files = self._repos.get((m.group(1), revision))
            if files is None:
                return self._missing(handler, "RepositoryNotFound")
            sha = hashlib.sha1(f"{m.group(1)}@{revision}".encode()).hexdigest()
            siblings = [{"rfilename": name} for name in files]
            return self._json(handler, {"id": m.group(1), "sha": sha, "siblings": siblings})
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
        if m:
            self.api_calls.append(path)
            files = self._repos.get((m.group(1), urllib.parse.unquote(m.group(2))))
            if files is None:
                return self._missing(handler, "RevisionNotFound")
            return self._json(handler, self._listing(files, urllib.parse.unquote(m.group(3) or "")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/(.+)", path)
        if m:
            self.api_calls.append(path)
            files = self._repos.get((m.group(1), urllib.parse.unquote(m.group(2)))) or {}
            asked = urllib.parse.parse_qs(body.decode()).get("paths", [])
            return self._json(
                handler, [self._entry(files, name) for name in asked if name in files]
            )
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            files = self._repos.get((m.group(1), urllib.parse.unquote(m.group(2)))) or {}
            data = files.get(urllib.parse.unquote(m.group(3)))
            if data is None:
                return self._missing(handler, "EntryNotFound")
            asked_range = handler.headers.get("Range")
            status, first, last = 200, 0, len(data) - 1
            headers: tuple[tuple[str, str], ...] = (("ETag", '"v1"'),)
            if asked_range:
                start, _, end = asked_range.partition("=")[2].partition("-")
                status, first, last = 206, int(start), min(int(end or last), last)
                headers += (("Content-Range", f"bytes {first}-{last}/{len(data)}"),)
            piece = data[first : last + 1]
            with self._lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                if handler.command != "HEAD":
                    self.downloads.append(Download(path, asked_range, status, len(piece)))
            try:
                if self.delay:
                    time.sleep(self.delay)
                return self._send(handler, status, piece, headers)
            finally:
                with self._lock:
                    self.in_flight -= 1
        return self._missing(handler, "NotFound")

    @staticmethod
    def _entry(files: dict[str, bytes], name: str) -> dict[str, object]:
        data = files[name]
        return {
            "type": "file",
            "path": name,
            "size": len(data),
            "oid": hashlib.sha1(data).hexdigest(),
        }

    def _listing(self, files: dict[str, bytes], folder: str) -> list[dict[str, object]]:
        folder = folder.strip("/")
        out: list[dict[str, object]] = []
        folders: set[str] = set()
        for name in files:
            if folder and not name.startswith(folder + "/"):
                continue
            rest = name[len(folder) + 1 :] if folder else name
            if "/" in rest:
                sub = (folder + "/" if folder else "") + rest.split("/")[0]
                if sub not in folders:
                    folders.add(sub)
                    out.append({"type": "directory", "path": sub, "oid": "0" * 40})
            else:
                out.append(self._entry(files, name))
        return out
