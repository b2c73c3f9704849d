"""HTTP(S) range requests: :class:`HTTPSource`, with its URL rules, deadlines, redirects and
the process-wide pool of idle connections."""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import Any, Final

from ._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
)
from ._remote_read_ahead import DEFAULT_READ_AHEAD
from ._remote_source import (
    DEFAULT_ACCEPT_FULL_BODY,
    DEFAULT_HEAD_BYTES,
    DEFAULT_MAX_GAP,
    DEFAULT_PART_SIZE,
    HEADER_NUMBER,
    RemoteSource,
    Transient,
    int_option,
    parse_content_range,
    seconds_option,
    shown_header,
    shown_value,
)
from ._remote_urls import redact

_USER_AGENT: Final = "pysafetensors"
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
#: Bytes of a redirect's body read to keep its connection for reuse; a longer body closes it.
_REDIRECT_BODY_MAX: Final = 64 << 10
_TRANSIENT_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Most bytes one receive of a body asks for: what a timeout can leave uncounted.
_RECEIVE_STEP: Final = 1 << 20
_DECIMAL: Final = re.compile(rf"[ \t]*{HEADER_NUMBER}[ \t]*", re.ASCII)


def _refused_request(exc: Exception, headers: Mapping[str, str]) -> str:
    """Why http.client refused to send a request, without the header values it quotes."""
    bad = [k for k, v in headers.items() if not _sendable_header(k, v)]
    if bad:
        return (
            f"the value of header {', '.join(map(repr, bad))} has a line break or a character "
            "outside Latin-1"
        )
    if isinstance(exc, http.client.InvalidURL):
        return "the URL is not valid"
    return f"{type(exc).__name__} (the request's headers or URL)"


def _sendable_header(name: str, value: str) -> bool:
    try:
        name.encode("latin-1")
        str(value).encode("latin-1")
    except UnicodeEncodeError:
        return False
    text = f"{name}{value}"
    return "\r" not in text and "\n" not in text


def _invalid_url(url: str, exc: ValueError) -> str:
    """Why ``url`` does not parse, without quoting it: urllib's messages quote the port or
    the host as parsed, which for a password with an unencoded ``/``, ``?`` or ``#`` is part
    of the password."""
    reason = (
        "the port is not a number from 0 to 65535"
        if str(exc).startswith("Port ")
        else "the host cannot be parsed"
    )
    if "@" in url:
        reason += "; a user name or password with '/', '?', '#' or '@' must be percent-encoded"
    return reason


def _basic_auth(url: str) -> str | None:
    """``Basic <base64>`` for a URL's ``user:password@``, or None without one."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return None
    if parts.username is None:
        return None
    pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")


def _headers_option(headers: object) -> dict[str, str]:
    """Check the ``headers`` option; return a copy.

    Values are never quoted in messages: they are often credentials.

    Raises:
        TypeError: Not a mapping of strings to strings.
        ValueError: A ``Range`` header (each read sets its own), an ``Accept-Encoding`` other
            than ``identity`` (a compressed body has no byte correspondence with the file), or
            two names that differ only in case (both would be sent).
    """
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise TypeError(
            f"headers must be a mapping of header names to values, got {type(headers).__name__}"
        )
    seen: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str):
            raise TypeError(f"headers: a header name must be a string, got {shown_value(name)}")
        if not isinstance(value, str):
            raise TypeError(
                f"headers: the value of {name!r} must be a string, got {type(value).__name__}"
            )
        lower = name.lower()
        if lower in seen:
            raise ValueError(
                f"headers: {seen[lower]!r} and {name!r} name the same header (names are not "
                "case-sensitive); give it once"
            )
        seen[lower] = name
        if lower == "range":
            raise ValueError(
                f"headers: {name!r} cannot be set; every read sends the Range it needs"
            )
        if lower == "accept-encoding" and value.strip().lower() != "identity":
            raise ValueError(
                f"headers: {name!r} can only be 'identity': a compressed body does not match "
                "the file's byte ranges"
            )
    return dict(headers)


#: ``bytes first-last/total``, ``bytes */total`` or ``bytes first-last/*`` (RFC 9110 14.4).
#: ASCII digits only: ``str.isdigit`` also accepts ``"²"``, which ``int`` refuses.
def _int_header(resp: http.client.HTTPResponse, name: str, where: str) -> int | None:
    """The decimal value of header ``name``, or None when it is absent.

    Raises:
        RemoteError: The header is present but not a decimal number (kind ``InvalidResponse``).
    """
    value = resp.getheader(name)
    if value is None:
        return None
    match = _DECIMAL.fullmatch(value)
    if match is None:
        raise RemoteError(
            f"{where}: malformed {name} {shown_header(value)}", kind="InvalidResponse"
        )
    return int(match.group(1))


def _location(resp: http.client.HTTPResponse) -> str | None:
    """A redirect's ``Location``, its raw UTF-8 bytes read as UTF-8 (as ``requests`` does).

    http.client decodes header bytes as Latin-1: ``/modèle`` sent as UTF-8 became
    ``/modÃ¨le``, percent-encoded again into a request for another path. A value that is not
    UTF-8 is kept as decoded.
    """
    location = resp.getheader("Location")
    if location is None:
        return None
    try:
        return location.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return location


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date; the backoff schedule is good enough


#: How a keep-alive connection the server has since closed fails on its next use.
_STALE: Final = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
)

_Conn = http.client.HTTPConnection
_Key = tuple[str, str, int]

#: Left as they are in a request path: RFC 3986 ``pchar`` and ``/``, plus ``%`` so that escapes
#: already in the URL are kept (a ``%`` that starts no escape is encoded first). Everything else
#: (spaces, non-ASCII as UTF-8) is percent-encoded, as browsers and ``requests`` do.
_PATH_SAFE: Final = "/:@!$&'()*+,;=%"
_QUERY_SAFE: Final = _PATH_SAFE + "?"
_STRAY_PERCENT: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
#: ``urlsplit`` silently deletes tabs and line breaks, which would request another URL.
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
#: Of the caller's headers, the only ones sent where credentials may not go (see
#: ``HTTPSource._headers_for``): everything else is assumed to possibly carry a secret.
_PUBLIC_HEADERS: Final = frozenset({"user-agent", "accept", "accept-language", "cache-control"})


def _quote(text: str, safe: str) -> str:
    return urllib.parse.quote(_STRAY_PERCENT.sub("%25", text), safe=safe)


def _parse_http_url(url: str) -> tuple[_Key, str]:
    """Split an ``http(s)`` URL into its connection key and the request target to send.

    The path and query are percent-encoded where needed (existing ``%XX`` escapes and reserved
    characters are kept); the fragment is dropped, as browsers do.

    Raises:
        RemoteError: The URL cannot be requested (kind ``InvalidURL``): not http(s), no host,
            a bad port, or control characters.
    """
    where = redact(url)
    if _CONTROL.search(url):
        raise RemoteError(
            f"{where!r}: the URL contains a control character (tab, line break...); "
            "percent-encode it",
            kind="InvalidURL",
        )
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RemoteError(
            f"{where}: invalid URL ({_invalid_url(url, exc)})", kind="InvalidURL"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"{where}: not an http(s) URL with a host", kind="InvalidURL")
    key = (scheme, parts.hostname, port or (443 if scheme == "https" else 80))
    target = _quote(parts.path or "/", _PATH_SAFE)
    if parts.query:
        target += "?" + _quote(parts.query, _QUERY_SAFE)
    return key, target


def _credentials_may_go(origin: _Key, key: _Key) -> bool:
    """Whether headers meant for ``origin`` may be sent to ``key`` (scheme, host, port).

    Only to the same scheme, host and port, or from ``http`` on port 80 to ``https`` on 443 of
    the same host (an upgrade), as ``requests`` decides. Never to another host, to plain
    ``http`` from ``https``, or to another port, where someone else may be listening.
    """
    if key == origin:
        return True
    (o_scheme, o_host, o_port), (scheme, host, port) = origin, key
    return host == o_host and (o_scheme, o_port, scheme, port) == ("http", 80, "https", 443)


class _Clock:
    """The deadline of one request.

    Two things enforce it. Each body read gets a socket timeout of at most the time left
    (:meth:`arm`). And :data:`_WATCHDOG` shuts the request's socket down when the deadline
    passes, since http.client reads a status line, headers, chunk sizes and a redirect's body
    with many receives of its own, each of which a trickling server can keep within the socket
    timeout. Once the watchdog has fired, whatever was read is discarded (a shut-down read may
    end a header or chunk-size line early, which http.client takes as complete): the request
    fails as a timeout and its connection is closed. :meth:`done` ends the watch, before the
    connection may go back to the pool, so that it never shuts down a pooled connection.
    """

    __slots__ = ("conn", "deadline", "fired", "finished", "lock", "sock", "stop", "timeout")

    def __init__(self, deadline: float, timeout: float | None, conn: _Conn) -> None:
        self.deadline = deadline
        self.timeout = timeout
        self.stop = time.monotonic() + deadline
        #: The connection, whose socket the watchdog shuts down (it may still be connecting).
        self.conn: _Conn | None = conn
        #: Its socket once the request is sent: a "Connection: close" reply detaches it from conn.
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.fired = False
        self.finished = False
        _WATCHDOG.watch(self)

    def left(self) -> float:
        """Seconds the next operation may take: ``timeout``, or less as the deadline nears.

        Raises:
            TimeoutError: The deadline has passed.
        """
        left = self.stop - time.monotonic()
        if left <= 0 or self.fired:
            raise TimeoutError(f"deadline of {self.deadline:g} s exceeded")
        return left if self.timeout is None else min(self.timeout, left)

    def arm(self) -> None:
        """Bound the next socket operation by the time left."""
        if self.sock is not None:
            self.sock.settimeout(self.left())

    def expired(self) -> bool:
        """Whether the deadline has passed (a timeout then is the deadline's doing)."""
        return self.fired or time.monotonic() >= self.stop

    def fire(self) -> bool:
        """Shut the request's socket down: the watchdog calls this at the deadline.

        Returns:
            Whether to call again shortly: the connection has no socket yet (connecting).
        """
        with self.lock:
            if self.finished:
                return False
            self.fired = True
            sock = self.sock
            if sock is None and self.conn is not None:
                sock = self.conn.sock
            if sock is None:
                return True
            # The plain socket's shutdown, also for TLS: it ends a read blocked in another
            # thread (SSLSocket.shutdown would first drop the TLS object under it). OSError:
            # already closed.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            return False

    def done(self) -> bool:
        """End the watch. Idempotent.

        Returns:
            Whether the watchdog fired: what was read since may be cut short, and the
            connection must not be reused.
        """
        with self.lock:
            first = not self.finished
            self.finished = True
            self.conn = self.sock = None
            fired = self.fired
        if first:
            _WATCHDOG.forget(self)
        return fired


class _Watchdog:
    """One daemon thread that shuts down the sockets of requests past their deadline.

    It holds only the requests in flight (a few per connection), sleeping until the earliest
    deadline among them; a request that ends first is simply dropped.
    """

    #: How soon a request still connecting when its deadline passed is looked at again.
    RECHECK: Final = 0.05

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._due: dict[_Clock, float] = {}
        self._next = float("inf")
        self._thread: threading.Thread | None = None

    def watch(self, clock: _Clock) -> None:
        with self._cond:
            self._due[clock] = clock.stop
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="pysafetensors-deadline", daemon=True
                )
                self._thread.start()
            elif clock.stop < self._next:
                self._cond.notify()

    def forget(self, clock: _Clock) -> None:
        with self._cond:
            self._due.pop(clock, None)

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while True:
                    now = time.monotonic()
                    due = [c for c, t in self._due.items() if t <= now]
                    if due:
                        for clock in due:
                            del self._due[clock]
                        self._next = float("inf")
                        break
                    self._next = min(self._due.values(), default=float("inf"))
                    # A bounded wait: Condition.wait refuses an infinite timeout.
                    cond.wait(min(self._next - now, 3600.0))
            again = [clock for clock in due if clock.fire()]
            if again:
                with cond:
                    recheck = time.monotonic() + self.RECHECK
                    for clock in again:
                        if not clock.finished:
                            self._due[clock] = recheck


_WATCHDOG: Final = _Watchdog()
if hasattr(os, "register_at_fork"):
    # A forked child has none of the parent's threads, and may inherit the lock held.
    os.register_at_fork(after_in_child=_WATCHDOG._reset)


#: Interim (1xx) replies taken before a request's final reply.
_MAX_INTERIM: Final = 16


class _Response(http.client.HTTPResponse):
    """http.client's response, which also skips interim replies other than ``100 Continue``
    (``103 Early Hints``: it took them for the final reply), and at most
    :data:`_MAX_INTERIM` of them (it read ``100 Continue`` lines for as long as a server sent
    them, which no timeout bounds).
    """

    _interim = 0

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            # Private in http.client (3.10 to 3.13 alike), absent from its type stubs.
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 <= status < 200 or status == 101:
                return version, status, reason
            self._interim += 1
            if self._interim > _MAX_INTERIM:
                raise http.client.HTTPException(
                    f"more than {_MAX_INTERIM} interim (1xx) replies before the reply"
                )
            if status == 100:
                return version, status, reason  # begin() skips its headers and reads on
            http.client.parse_headers(self.fp)  # bounded in count and line length


class _ConnectionPool:
    """Idle keep-alive connections of one source, kept in the process-wide store.

    A connection is used by one thread at a time: it is taken out while a request runs and put
    back only after its response was read in full. Idle connections are shared by every source
    that talks to the same (scheme, host, port) with the same TLS context (a connection is
    never handed to a source that would have verified its peer otherwise), at most
    :data:`_IDLE_PER_HOST` each: kept per source, a handle on 200 shards of one server held
    over a thousand idle sockets and ran out of descriptors. Each request sets its own timeout.

    The idle connections of a TLS context given as ``ssl_context`` are closed with the last
    open source using it (:meth:`close`, or when it is collected): no other source may take
    them, and a context made for each file kept every closed file's connections open.
    """

    def __init__(self, timeout: float | None, ssl_context: ssl.SSLContext | None) -> None:
        self._timeout = timeout
        self._ssl = ssl_context
        _IDLE.retain(ssl_context)
        self._released = weakref.finalize(self, _IDLE.release, ssl_context)

    def close(self) -> None:
        """Stop using the TLS context (once): its idle connections close with its last user."""
        self._released()

    def get(self, key: _Key) -> tuple[_Conn, bool]:
        """Return a connection and whether it was reused (so may have gone stale)."""
        conn = _IDLE.take((key, self._ssl))
        if conn is not None:
            return conn, True
        scheme, host, port = key
        if scheme == "https":
            ctx = self._ssl or ssl.create_default_context()
            made: _Conn = http.client.HTTPSConnection(
                host, port, timeout=self._timeout, context=ctx
            )
        else:
            made = http.client.HTTPConnection(host, port, timeout=self._timeout)
        made.response_class = _Response
        made._create_connection = _connect  # type: ignore[attr-defined]  # see _connect
        return made, False

    def put(self, key: _Key, conn: _Conn) -> None:
        _IDLE.give((key, self._ssl), conn)


def _resolve(host: str, port: int, timeout: float | None) -> list[Any]:
    """``getaddrinfo`` for a TCP connection to ``host``, within ``timeout`` seconds.

    The system resolver takes no timeout of its own: a name server that did not answer held
    a read for its retries (30 s and more), past ``timeout`` and the deadline alike. It runs
    on a thread of its own, left to finish in the background when it takes too long.

    Raises:
        TimeoutError: No answer within ``timeout``.
        OSError: The name does not resolve.
    """
    if timeout is None:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    outcome: list[Any] = []
    answered = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            outcome.append(exc)
        answered.set()

    threading.Thread(target=lookup, name="pysafetensors-resolve", daemon=True).start()
    if not answered.wait(timeout):
        raise TimeoutError(f"resolving {host} took over {timeout:g} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    infos: list[Any] = outcome[0]
    return infos


def _connect(
    address: tuple[str, int], timeout: Any = None, source_address: Any = None
) -> socket.socket:
    """``socket.create_connection`` with the name resolved within ``timeout`` (see
    :func:`_resolve`); http.client calls it to connect (its ``_create_connection``)."""
    # socket's "global default" stand-in when no timeout was given: the socket keeps the
    # process's default (as create_connection leaves it); None, given, makes it blocking.
    given = timeout is None or isinstance(timeout, (int, float))
    seconds = timeout if isinstance(timeout, (int, float)) else None
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in _resolve(host, port, seconds):
        sock = socket.socket(family, kind, proto)
        try:
            if given:
                sock.settimeout(seconds)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:  # a Ctrl-C while connecting: the socket is nobody's
            sock.close()
            raise
        return sock
    raise error or OSError(f"{host} resolves to no address")


#: Idle connections kept per (scheme, host, port, TLS context), for all sources together.
_IDLE_PER_HOST: Final = 16


class _IdleConnections:
    """The process-wide store of idle keep-alive connections (see :class:`_ConnectionPool`)."""

    def __init__(self) -> None:
        #: Open sources using each TLS context given (the default one, None, is not counted).
        self._users: dict[ssl.SSLContext, int] = {}
        #: Contexts released and not yet counted down (see release).
        self._released: collections.deque[ssl.SSLContext] = collections.deque()
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        # The key holds the TLS context itself (not its id), so it cannot be reused by another.
        self._idle: dict[tuple[_Key, ssl.SSLContext | None], list[_Conn]] = {}

    def retain(self, ctx: ssl.SSLContext | None) -> None:
        """A source starts using ``ctx``."""
        if ctx is not None:
            with self._lock:
                self._users[ctx] = self._users.get(ctx, 0) + 1
        self._settle_if_free()

    def release(self, ctx: ssl.SSLContext | None) -> None:
        """A source stops using ``ctx``: with the last one, its idle connections are closed.

        Queued, and counted down under the lock when it is free: a dropped source's finalizer
        runs wherever the collector does, on a thread that may hold this lock (waiting for it
        there deadlocked the thread on itself).
        """
        if ctx is not None:
            self._released.append(ctx)
            self._settle_if_free()

    def _settle(self) -> list[_Conn]:
        """Count down the contexts released (lock held); the idle connections of those no
        source uses any more, to close after letting the lock go."""
        conns: list[_Conn] = []
        while self._released:
            ctx = self._released.popleft()
            left = self._users.get(ctx, 0) - 1
            if left > 0:
                self._users[ctx] = left
                continue
            self._users.pop(ctx, None)
            for key in [k for k in self._idle if k[1] is ctx]:
                conns += self._idle.pop(key)
        return conns

    def _settle_if_free(self) -> None:
        while self._released and self._lock.acquire(blocking=False):
            try:
                conns = self._settle()
            finally:
                self._lock.release()
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.close()

    def take(self, key: tuple[_Key, ssl.SSLContext | None]) -> _Conn | None:
        with self._lock:
            idle = self._idle.get(key)
            conn = idle.pop() if idle else None
        self._settle_if_free()
        return conn

    def give(self, key: tuple[_Key, ssl.SSLContext | None], conn: _Conn) -> None:
        kept = False
        with self._lock:
            # A context no open source uses any more (a read that ended after the last close):
            # nothing would take the connection.
            if key[1] is None or key[1] in self._users:
                idle = self._idle.setdefault(key, [])
                if len(idle) < _IDLE_PER_HOST:
                    idle.append(conn)
                    kept = True
        self._settle_if_free()
        if not kept:
            conn.close()

    def _after_fork(self) -> None:
        # The child's copies of the parent's sockets: closed here, the parent's stay open. The
        # child's copies of the sources still release their contexts.
        conns = [c for idle in self._idle.values() for c in idle]
        self._reset()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()


_IDLE: Final = _IdleConnections()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_IDLE._after_fork)


class HTTPSource(RemoteSource):
    """Random access to a file served over HTTP(S), with ``Range`` requests.

    Only the standard library is used: ``http.client`` with a small pool of keep-alive
    connections shared by up to ``max_connections`` worker threads. Proxies from the
    environment are not used.

    Opening sends one ``GET`` for ``bytes=0-(head_bytes-1)``: the reply must be ``206`` with a
    ``Content-Range`` whose total gives the size. If the server ignores ``Range`` (``200``)
    and the file is at most ``accept_full_body`` bytes, the whole body is kept in memory
    and no other request is made; a larger ``200`` is refused without reading it.

    Redirects are followed (up to ``max_redirects``, to ``http(s)`` URLs only) and the final URL
    is reused for later reads, since hubs redirect to a CDN; if that URL later answers
    401/403/404 (signed URLs expire), the original URL is resolved again once. ``headers`` are
    meant for the original URL's scheme, host and port: on a redirect to another host, to
    another port, or from ``https`` to ``http``, only ``User-Agent``, ``Accept``,
    ``Accept-Language`` and ``Cache-Control`` of them are sent (``Authorization``, ``Cookie``
    and any other header may carry credentials). An ``http`` to ``https`` upgrade on the
    default ports keeps them.

    The file must not change while open: every reply's ``ETag`` (or, from a server that sends
    none, its ``Last-Modified``) and size must match those seen when it was opened.

    Paths and query strings are percent-encoded where needed (spaces, non-ASCII); ``%XX``
    escapes already in the URL are kept.

    Args:
        url: ``http://`` or ``https://`` URL. The query string is kept.
        headers: Extra request headers, e.g. ``{"Authorization": "Bearer ..."}``; names and
            values are strings. A ``User-Agent`` replaces the library's. ``Range`` cannot be
            given, nor an ``Accept-Encoding`` other than ``identity``.
        timeout: Seconds to wait for the host's name to resolve, for a connection, or for
            each read on it (None: no limit). It bounds every socket operation, not a whole
            request: a server that keeps sending
            a few bytes before each timeout runs out holds a request open indefinitely (see
            ``deadline``).
        deadline: Seconds one request may take in all, from sending it to its last body byte
            (None: no limit), status line and headers included: when it passes the request's
            socket is shut down. A request past it fails as a timeout and is retried like one.
            It must allow a ``part_size`` request at the slowest acceptable rate.
        max_connections: Parallel requests of one split or coalesced read (reads from
            several threads each take up to that many).
        part_size: Largest single request when a read is split.
        max_gap: Ranges closer than this are merged into one request by ``readinto_many``.
        head_bytes: Bytes fetched and cached when opening (0: only learn the size); at most
            the file's size is kept.
        retries: Repeats after transient failures (5xx, 429, resets, truncated bodies).
        backoff: First retry delay in seconds; doubles each time, with jitter, up to 20 s.
        read_ahead: The largest window read ahead for small reads in file order (a
            ``get_tensor`` loop); 0 fetches every read as asked.
        max_redirects: Redirects followed per request.
        accept_full_body: Largest ``200`` whole-body reply accepted from a server that
            ignores ``Range``.
        ssl_context: TLS settings for ``https`` (default: system trust store).

    Raises:
        TypeError: An option of the wrong type (a string for a number, say).
        ValueError: An option out of range, or a header that cannot be given (see ``headers``).
        RemoteNotFoundError: 404 or 410.
        RemotePermissionError: 401 or 403.
        RemoteError: Ranges not supported, too many redirects, a malformed URL (kind
            ``InvalidURL``, at once), a compressed body (``ContentEncoding``), a malformed reply
            (``InvalidResponse``), the file changed (``Changed``), other errors, or transient
            errors that persisted through the retries.
    """

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = 30.0,
        deadline: float | None = None,
        max_connections: int = 8,
        part_size: int = DEFAULT_PART_SIZE,
        max_gap: int = DEFAULT_MAX_GAP,
        head_bytes: int = DEFAULT_HEAD_BYTES,
        retries: int = 3,
        backoff: float = 0.2,
        read_ahead: int = DEFAULT_READ_AHEAD,
        max_redirects: int = 5,
        accept_full_body: int = DEFAULT_ACCEPT_FULL_BODY,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"an http(s) URL must be a string, got {type(url).__name__}")
        if url.partition("://")[0].lower() not in ("http", "https"):
            raise ValueError(f"not an http(s) URL: {redact(url)}")
        # Options are checked before anything is sent: a bad one must not surface later as a
        # failed request, or as a crash in the middle of a retry.
        own_headers = _headers_option(headers)
        timeout = seconds_option("timeout", timeout)
        deadline = seconds_option("deadline", deadline)
        max_redirects = int_option("max_redirects", max_redirects, 0)
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError(
                f"ssl_context must be an ssl.SSLContext or None, got {type(ssl_context).__name__}"
            )
        # Malformed URLs fail here, before any request and without retries.
        origin_key, _ = _parse_http_url(url)
        super().__init__(
            redact(url),
            max_connections=max_connections,
            part_size=part_size,
            max_gap=max_gap,
            head_bytes=head_bytes,
            retries=retries,
            backoff=backoff,
            read_ahead=read_ahead,
            accept_full_body=accept_full_body,
        )
        self._origin = url
        self._url = url
        self._origin_key = origin_key
        self._headers = own_headers
        basic = _basic_auth(url)
        if basic is not None and not any(k.lower() == "authorization" for k in self._headers):
            # user:password@host in the URL, as curl and requests take it (origin only).
            self._headers["Authorization"] = basic
        self._timeout = timeout
        self._deadline = deadline
        # Validator of servers that send no ETag (``python -m http.server``, some CDNs).
        self._modified: str | None = None
        self._max_redirects = max_redirects
        # Idle connections live in the process-wide store; those of a TLS context given go with
        # its last user (_release).
        self._conns = _ConnectionPool(timeout, ssl_context)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _release(self) -> None:
        self._conns.close()

    @property
    def url(self) -> str:
        """The URL reads go to: the original one, or where it redirected."""
        return self._url

    def _headers_for(self, key: _Key, first: int, last: int) -> dict[str, str]:
        headers = dict(self._headers)
        if not _credentials_may_go(self._origin_key, key):
            # Credentials meant for the origin must not leak to a CDN, another site, another
            # port, or the network in clear text. Which custom headers carry secrets cannot be
            # known (X-Api-Key, Private-Token, X-JFrog-Art-Api...), so only harmless ones stay.
            headers = {k: v for k, v in headers.items() if k.lower() in _PUBLIC_HEADERS}
        # The caller's User-Agent replaces ours, whatever its case. Range and Accept-Encoding
        # are ours alone (the options refuse a Range, and any Accept-Encoding but identity).
        own = {k.lower() for k in headers}
        headers = {
            k: v for k, v in headers.items() if k.lower() not in ("range", "accept-encoding")
        }
        headers["Range"] = f"bytes={first}-{last}"
        # A compressed body has no byte correspondence with the file: ask for none.
        headers["Accept-Encoding"] = "identity"
        if "user-agent" not in own:
            headers["User-Agent"] = _USER_AGENT
        return headers

    def _send(
        self, url: str, first: int, last: int
    ) -> tuple[http.client.HTTPResponse, _Conn, _Key, _Clock | None]:
        key, target = _parse_http_url(url)
        headers = self._headers_for(key, first, last)
        while True:
            conn, reused = self._conns.get(key)
            clock = None
            refusal: RemoteError | None = None
            try:
                if self._deadline is not None:
                    clock = _Clock(self._deadline, self._timeout, conn)
                    # Pooled connections carry the last request's timeout (another source's,
                    # or one a deadline shortened): set this request's. (A deadline already
                    # past raises TimeoutError here, handled as any timeout below.)
                    conn.timeout = clock.left()
                else:
                    conn.timeout = self._timeout
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                conn.request("GET", target, headers=headers)
                if clock is not None:
                    # Kept for the body: a "Connection: close" reply detaches it from conn.
                    clock.sock = conn.sock
                    clock.arm()
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                # A read the watchdog cut short can fail in any way: the deadline decides.
                late = clock is not None and (clock.done() or clock.expired())
                refusal = None if late else self._refusal(exc, headers)
                if refusal is None:
                    if reused and not late and isinstance(exc, _STALE):
                        # The server closed an idle keep-alive connection: not a failure,
                        # and not worth a retry's backoff. Try again on a fresh connection.
                        continue
                    self.stats.add(requests=1)
                    if late:
                        assert clock is not None
                        raise self._past_deadline(clock, "before the reply") from exc
                    raise Transient(
                        f"request to {self._name} failed: {exc!r}",
                        # A timeout told apart from a refused or dropped connection.
                        "Timeout" if isinstance(exc, TimeoutError) else "ConnectionError",
                    ) from exc
            except BaseException:
                conn.close()
                if clock is not None:
                    clock.done()
                raise
            if refusal is not None:
                # Outside the except clause: the exception refused may quote a header's value
                # (a credential), which must not stay reachable as __context__ either.
                raise refusal
            self.stats.add(requests=1)
            if clock is not None and clock.fired:
                # The status line or headers were cut short by the watchdog, and may look
                # complete to http.client.
                conn.close()
                clock.done()
                raise self._past_deadline(clock, "before the reply")
            return resp, conn, key, clock

    def _refusal(self, exc: BaseException, headers: Mapping[str, str]) -> RemoteError | None:
        """The error for a request that no retry can fix, or None: a server certificate that
        failed verification, or a request http.client refused to send."""
        if isinstance(exc, ssl.SSLCertVerificationError):
            # Also a ValueError, but no refusal of ours. Its reason names no secret.
            return RemoteError(
                f"{self._name}: TLS certificate verification failed: "
                f"{exc.verify_message or exc.reason or exc}",
                kind="TLSError",
            )
        if isinstance(exc, (http.client.InvalidURL, ValueError)):
            # http.client refused what we would send (a header value with a line break, a
            # character outside Latin-1): no retry can fix that. Its message quotes the
            # offending value, which may be a credential: name the headers, not the values.
            return RemoteError(
                f"{self._name}: cannot send the request: {_refused_request(exc, headers)}",
                kind="InvalidRequest",
            )
        return None

    def _past_deadline(self, clock: _Clock, when: str) -> Transient:
        return Transient(
            f"{self._name}: request took longer than the deadline of {clock.deadline:g} s ({when})",
            "Timeout",
        )

    def _finish(
        self, resp: http.client.HTTPResponse, conn: _Conn, key: _Key, clock: _Clock | None
    ) -> None:
        """Return the connection to the pool if the response was consumed and allows it.

        The request's deadline watch ends first: the watchdog must not shut down a connection
        in the pool, and a connection it shut down is not reused.
        """
        fired = clock is not None and clock.done()
        if not fired and resp.isclosed() and not resp.will_close:
            self._conns.put(key, conn)
        else:
            conn.close()

    def _fetch_once(self, offset: int, out: memoryview, probing: bool) -> None:
        try:
            self._fetch_from(self._url, offset, out, probing)
        except (RemoteNotFoundError, RemotePermissionError):
            if self._url == self._origin:
                raise
            # A redirect target (often a signed CDN URL) may have expired: resolve again.
            self._url = self._origin
            self._fetch_from(self._url, offset, out, probing)

    def _fetch_from(self, url: str, offset: int, out: memoryview, probing: bool) -> None:
        want = out.nbytes
        last = offset + want - 1
        for _ in range(self._max_redirects + 1):
            resp, conn, key, clock = self._send(url, offset, last)
            status = resp.status
            if status in _REDIRECTS:
                location = _location(resp)
                try:
                    self._skip_body(resp, clock)
                except BaseException:
                    conn.close()
                    if clock is not None:
                        clock.done()
                    raise
                self._finish(resp, conn, key, clock)
                if not location:
                    raise RemoteError(
                        f"{self._name}: redirect ({status}) without a Location header",
                        kind="HTTPError",
                    )
                try:
                    url = urllib.parse.urljoin(url, location)
                    urllib.parse.urlsplit(url).port  # noqa: B018 - a malformed host or port
                except ValueError as exc:
                    raise RemoteError(
                        f"{self._name}: redirect ({status}) to a malformed URL "
                        f"{redact(location)} ({_invalid_url(location, exc)})",
                        kind="InvalidURL",
                    ) from None
                if url.partition("://")[0].lower() not in ("http", "https"):
                    raise RemoteError(
                        f"{self._name}: redirected ({status}) to {redact(url)}, which is not "
                        "an http(s) URL",
                        kind="InvalidURL",
                    )
                continue
            try:
                self._handle(resp, url, offset, out, probing, clock)
            except BaseException:
                conn.close()
                if clock is not None:
                    clock.done()
                raise
            self._finish(resp, conn, key, clock)
            if probing or url != self._url:
                # Later reads go straight to where the server sent us.
                self._url = url
            return
        raise RemoteError(
            f"{self._name}: more than {self._max_redirects} redirects", kind="TooManyRedirects"
        )

    def _skip_body(self, resp: http.client.HTTPResponse, clock: _Clock | None) -> None:
        """Read a redirect's body, which is not needed, so that the connection can be reused.

        A short body is read; a longer one (or an endless chunked one) is not read past
        ``_REDIRECT_BODY_MAX``: the connection is closed instead (_finish), never the whole
        body held in memory. A body that fails to arrive only costs the connection, unless the
        request's deadline passed meanwhile.

        Raises:
            Transient: The deadline passed (kind ``Timeout``).
        """
        if resp.chunked or resp.length is None or resp.length > _REDIRECT_BODY_MAX:
            # Not read: a chunked body may end in endless trailer lines, which http.client
            # reads without a limit (gigabytes in seconds, no timeout firing). The connection
            # is closed instead.
            resp.will_close = True
            resp.close()
            return
        try:
            if clock is not None:
                clock.arm()
            resp.read(_REDIRECT_BODY_MAX)
        except (OSError, http.client.HTTPException) as exc:
            if clock is not None and clock.expired():
                raise self._past_deadline(clock, "reading a redirect's body") from exc
            # The rest of the body may still arrive: the connection must not be reused (a
            # later request, perhaps another file's, would read it as its reply).
            resp.will_close = True
            resp.close()
            return
        if clock is not None and clock.fired:
            raise self._past_deadline(clock, "reading a redirect's body")

    def _handle(
        self,
        resp: http.client.HTTPResponse,
        url: str,
        offset: int,
        out: memoryview,
        probing: bool,
        clock: _Clock | None,
    ) -> None:
        status = resp.status
        where = redact(url)
        if status in (200, 206):
            self._check_encoding(resp, where)
        if status == 206:
            self._handle_partial(resp, where, offset, out, probing, clock)
        elif status == 200:
            self._handle_whole(resp, where, offset, out, probing, clock)
        elif status == 416:
            total = parse_content_range(resp.getheader("Content-Range"), where)[2]
            if probing and total == 0:
                # An empty file has no byte 0 to ask for; it is still a valid (empty) object.
                self._size = 0
                self._head = b""
                return
            if not probing and 0 <= offset < self._size and total != self._size:
                # A range within the size the file had when opened: it is shorter now.
                raise RemoteError(
                    f"{where} changed while open (the server now reports "
                    f"{total if total is not None else 'an unknown number of'} bytes, "
                    f"{self._size} when opened); reopen it",
                    kind="Changed",
                    offset=offset,
                )
            raise RemoteError(
                f"{where}: range {offset}-{offset + out.nbytes - 1} not satisfiable (416); the "
                f"server reports {total if total is not None else 'an unknown number of'} bytes"
                + ("" if probing else f", this source expected {self._size}"),
                kind="RangeNotSatisfiable",
                offset=offset,
            )
        elif status in (404, 410):
            raise RemoteNotFoundError(
                f"{where}: not found ({status})",
                kind="NotFound",
                offset=None if probing else offset,
            )
        elif status in (401, 403) and self._withheld(url):
            raise RemotePermissionError(
                f"{where}: {'authentication required' if status == 401 else 'access denied'} "
                f"({status}) after a redirect from {self._name}; the headers given were "
                "not sent to it (they go to the original scheme, host and port only)",
                kind="PermissionDenied",
            )
        elif status == 401:
            raise RemotePermissionError(
                f"{where}: authentication required (401); pass credentials with "
                "headers={'Authorization': 'Bearer ...'}",
                kind="PermissionDenied",
            )
        elif status == 403:
            raise RemotePermissionError(
                f"{where}: access denied (403); check the credentials in headers= or, for a "
                "signed URL, that it has not expired",
                kind="PermissionDenied",
            )
        elif status in _TRANSIENT_STATUS:
            raise Transient(
                f"{where}: server error {status} {resp.reason}",
                "HTTPError",
                _retry_after(resp.getheader("Retry-After")),
            )
        else:
            raise RemoteError(f"{where}: unexpected HTTP {status} {resp.reason}", kind="HTTPError")

    @staticmethod
    def _check_encoding(resp: http.client.HTTPResponse, where: str) -> None:
        # http.client decodes one transfer coding, "chunked" alone: any other (gzip, or
        # "gzip, chunked") would hand over the coded bytes, chunk-size lines included.
        transfer = (resp.getheader("Transfer-Encoding") or "").strip()
        if transfer and transfer.lower() != "chunked":
            raise RemoteError(
                f"{where}: the server sent a body with Transfer-Encoding {transfer!r}; only "
                "'chunked' can be decoded here, other codings do not give the file's bytes",
                kind="ContentEncoding",
            )
        # Every request says Accept-Encoding: identity. A server or proxy that compresses
        # anyway sends bytes that are not the file's; a retry would get the same.
        encoding = (resp.getheader("Content-Encoding") or "").strip()
        if encoding and encoding.lower() != "identity":
            raise RemoteError(
                f"{where}: the server sent a body with Content-Encoding {encoding!r} although "
                "the request asked for none (Accept-Encoding: identity); compressed bytes do not "
                "match the file's byte ranges, so the file cannot be read from this server "
                "(a compressing proxy or a server setting is the usual cause)",
                kind="ContentEncoding",
            )

    def _check_validators(
        self, resp: http.client.HTTPResponse, where: str, probing: bool, offset: int
    ) -> None:
        """Refuse a reply from another version of the file than the one opened (the error
        carries the request's ``offset``, so that a reader names the tensor read there).

        The ETag decides when the first reply carried one, and every later reply must carry
        the same (a reply without it, its Last-Modified unchanged, was taken for the file
        opened: Last-Modified has one-second granularity, and a file replaced within that
        second read half old, half new); otherwise Last-Modified does (servers such as
        ``python -m http.server`` send only that). A server that never sends either cannot
        be checked at all (documented).
        """
        etag = resp.getheader("ETag")
        modified = resp.getheader("Last-Modified")
        if probing:
            self._etag = etag
            self._modified = modified
        elif self._etag:
            if etag != self._etag:
                raise self._changed(where, "ETag", self._etag, etag, offset)
        elif self._modified and modified != self._modified:
            raise self._changed(where, "Last-Modified", self._modified, modified, offset)

    @staticmethod
    def _changed(where: str, validator: str, old: str, new: str | None, offset: int) -> RemoteError:
        """The error for a reply that names another version of the file, or none."""
        if new:
            text = f"{where} changed while open ({validator} {old} became {new}); reopen it"
        else:
            # Nothing says it is still that file (a replaced file read half old, half new).
            text = (
                f"{where}: a reply without the {validator} the file had when opened ({old}; "
                "it may have been replaced); reopen it"
            )
        return RemoteError(text, kind="Changed", offset=offset)

    def _withheld(self, url: str) -> bool:
        """Whether headers given were left out of the request to ``url`` (another host)."""
        private = any(k.lower() not in _PUBLIC_HEADERS for k in self._headers)
        return private and not _credentials_may_go(self._origin_key, _parse_http_url(url)[0])

    def _handle_partial(
        self,
        resp: http.client.HTTPResponse,
        where: str,
        offset: int,
        out: memoryview,
        probing: bool,
        clock: _Clock | None,
    ) -> None:
        if "multipart" in (resp.getheader("Content-Type") or ""):
            raise RemoteError(
                f"{where}: server answered a single range with a multipart body",
                kind="RangeNotSupported",
            )
        first, last, total = parse_content_range(resp.getheader("Content-Range"), where)
        length = _int_header(resp, "Content-Length", where)
        if probing:
            if first is None or last is None or total is None:
                raise RemoteError(
                    f"{where}: 206 reply without a usable Content-Range "
                    f"({resp.getheader('Content-Range')!r}); cannot learn the file size",
                    kind="RangeNotSupported",
                )
            want = min(out.nbytes, total - offset)
        else:
            want = out.nbytes
            if total is not None and total != self._size:
                raise RemoteError(
                    f"{where} changed size while open ({self._size} bytes, now {total}); reopen it",
                    kind="Changed",
                    offset=offset,
                )
        if first is None:
            # Some servers omit Content-Range; fsspec accepts an exact Content-Length.
            if length != want:
                raise RemoteError(
                    f"{where}: 206 reply without Content-Range and with Content-Length {length}"
                    f" for a request of {want} bytes",
                    kind="RangeNotSupported",
                )
        elif first != offset or last != offset + want - 1:
            raise RemoteError(
                f"{where}: asked for bytes {offset}-{offset + want - 1}, server sent "
                f"{first}-{last}",
                kind="RangeMismatch",
            )
        if length is not None and length != want:
            raise Transient(
                f"{where}: Content-Length {length} disagrees with the range of {want} bytes",
                "Truncated",
            )
        self._check_validators(resp, where, probing, offset)
        self._read_exact(resp, where, offset, out[:want], clock)
        if probing:
            assert total is not None
            self._size = total
            self._head = bytes(out[:want])

    def _read_exact(
        self,
        resp: http.client.HTTPResponse,
        where: str,
        offset: int,
        out: memoryview,
        clock: _Clock | None,
    ) -> None:
        done = 0
        total = out.nbytes
        try:
            while done < total:
                if clock is not None:
                    # Each receive within the time left; the watchdog ends a read that goes on
                    # past the deadline (readinto fills its buffer however slowly bytes come).
                    clock.arm()
                # In bounded steps: the response's buffered reader fills all it is given before
                # returning, and a timeout mid-way loses its count (a stall after half a body
                # read as "after 0 bytes").
                n = resp.readinto(out[done : done + _RECEIVE_STEP])
                if not n:
                    break
                done += n
        except (OSError, http.client.HTTPException) as exc:
            self.stats.add(nbytes=done)
            if clock is not None and clock.expired():
                raise self._past_deadline(
                    clock, f"after {done} of {total} bytes at offset {offset}"
                ) from exc
            raise Transient(
                f"{where}: connection dropped after {done} of {total} bytes at offset {offset} "
                f"({exc!r})",
                "Truncated",
            ) from exc
        self.stats.add(nbytes=done)
        if clock is not None and clock.fired:
            # A chunk-size line cut short by the watchdog reads as a valid one (or as the end
            # of the body): nothing read under a fired deadline is kept.
            raise self._past_deadline(clock, f"after {done} of {total} bytes at offset {offset}")
        if done < total:
            raise Transient(
                f"{where}: response truncated: got {done} of {total} bytes at offset {offset}",
                "Truncated",
            )

    def _handle_whole(
        self,
        resp: http.client.HTTPResponse,
        where: str,
        offset: int,
        out: memoryview,
        probing: bool,
        clock: _Clock | None,
    ) -> None:
        # The server ignored Range. Reading a large body to find our bytes would download the
        # whole file for every read; accept it only when the file is small, and only once.
        length = _int_header(resp, "Content-Length", where)
        if (
            length is None
            or length > self._accept_full_body
            or (not probing and length != self._size)
        ):
            size = "an unknown number of" if length is None else str(length)
            raise RemoteError(
                f"{where}: the server ignored the Range header and started sending the whole "
                f"file ({size} bytes, status 200); it does not support range requests, which "
                "lazy reading needs (download the file instead)",
                kind="RangeNotSupported",
            )
        body = bytearray(length)
        self._read_exact(resp, where, 0, memoryview(body), clock)
        self._check_validators(resp, where, probing, offset)
        self._cached_whole(bytes(body), length)
        want = out.nbytes if not probing else min(out.nbytes, max(0, length - offset))
        out[:want] = body[offset : offset + want]
