"""Remote byte sources: HTTP(S) range requests, S3 and any fsspec filesystem.

Every source here implements the :class:`~pysafetensors._sources.ByteSource` protocol, so the
reader treats a URL exactly like a local file. What they add over local sources:

* **Few requests to open.** Opening fetches the first ``head_bytes`` (64 KiB by default) in the
  same request that learns the size. That usually holds the 8-byte length prefix and the whole
  header, so a reader needs one request to list tensors, two when the header is longer.
  Reads that fall inside those bytes are served from memory.
* **Verified ranges.** A reply is only taken as the range asked for when the server says so
  (``206`` with a matching ``Content-Range``; ``ContentRange`` for S3). A server that ignores
  ``Range`` and answers ``200`` with the whole file is refused, unless the whole file is small,
  in which case it is kept in memory once and no further request is made.
* **Parallel parts.** Large ranges are split into ``part_size`` pieces fetched by
  ``max_connections`` threads, straight into the caller's buffer.
* **Coalescing.** :meth:`RemoteSource.readinto_many` merges ranges separated by less than
  ``max_gap`` bytes into one request (object stores charge per request, and latency dominates
  small reads), then fetches the groups in parallel.
* **Clear errors.** Missing objects, denied access, truncated bodies, ignored ranges and
  exhausted retries raise :class:`~pysafetensors._errors.RemoteError` (an ``OSError``) with the
  URL, minus any query string, since that often carries signatures.
* **Counters.** ``source.stats`` counts requests, bytes received and retries, thread-safely, so
  tests and the CLI can report what a command transferred.

:func:`open_source` picks the backend from the URL scheme.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import inspect
import math
import numbers
import operator
import os
import posixpath
import random
import re
import reprlib
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, NoReturn, SupportsIndex, TypeVar

from ._errors import (
    ClosedFileError,
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
)
from ._sources import _check_range

__all__ = [
    "DEFAULT_HEAD_BYTES",
    "DEFAULT_MAX_GAP",
    "DEFAULT_PART_SIZE",
    "FsspecSource",
    "HTTPSource",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "RemoteSource",
    "RemoteStats",
    "S3Source",
    "open_source",
    "read_prefix",
]

#: Bytes fetched when a source opens. The hub reads 100 kB for the same purpose and reports that
#: about 97% of headers of popular models fit; 64 KiB keeps small files to one request while
#: wasting little on a large one.
DEFAULT_HEAD_BYTES: Final = 64 << 10
#: Size of one ranged request when a large read is split. 8 MiB is what object-store loaders
#: (Run:ai streamer, s3transfer) settle on: large enough to amortise latency, small enough to
#: spread over connections.
DEFAULT_PART_SIZE: Final = 8 << 20
#: Ranges closer than this are fetched as one request; the gap bytes are downloaded and dropped.
DEFAULT_MAX_GAP: Final = 1 << 20
#: A server that ignores ``Range`` is tolerated only for files up to this size.
DEFAULT_ACCEPT_FULL_BODY: Final = 1 << 20

_USER_AGENT: Final = "pysafetensors"
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
#: Bytes of a redirect's body read to keep its connection for reuse; a longer body closes it.
_REDIRECT_BODY_MAX: Final = 64 << 10
_TRANSIENT_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Longest ``Retry-After`` honoured; beyond it the backoff schedule applies.
_MAX_RETRY_AFTER: Final = 10.0


class RemoteStats:
    """Thread-safe counters of what a remote source transferred.

    Attributes are read without tearing; use :meth:`as_dict` for a consistent snapshot.
    """

    __slots__ = ("_bytes", "_lock", "_requests", "_retries")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0
        self._bytes = 0
        self._retries = 0

    def add(self, *, requests: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        """Add to the counters.

        Args:
            requests: Requests sent (each one counts, including failed ones and redirects).
            nbytes: Body bytes received.
            retries: Attempts repeated after a transient failure.
        """
        with self._lock:
            self._requests += requests
            self._bytes += nbytes
            self._retries += retries

    @property
    def requests(self) -> int:
        """Number of requests sent."""
        return self._requests

    @property
    def bytes_fetched(self) -> int:
        """Number of body bytes received."""
        return self._bytes

    @property
    def retries(self) -> int:
        """Number of attempts repeated after a transient failure."""
        return self._retries

    def as_dict(self) -> dict[str, int]:
        """Return a consistent snapshot of all counters."""
        with self._lock:
            return {
                "requests": self._requests,
                "bytes_fetched": self._bytes,
                "retries": self._retries,
            }

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self._requests = self._bytes = self._retries = 0

    def __repr__(self) -> str:
        d = self.as_dict()
        return (
            f"RemoteStats(requests={d['requests']}, bytes_fetched={d['bytes_fetched']}, "
            f"retries={d['retries']})"
        )


class _Transient(Exception):
    """A failure worth retrying: 5xx, 429, reset connections, truncated bodies."""

    def __init__(self, message: str, kind: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


@dataclass
class _Item:
    """One requested range: ``length`` bytes at file ``offset`` go to ``out[pos:pos+length]``."""

    offset: int
    pos: int
    length: int


@dataclass
class _Part:
    """One request. ``direct`` parts land in ``target``; others are scattered to ``items``."""

    offset: int
    length: int
    target: memoryview | None
    items: list[_Item]


def _as_bytes(out: memoryview) -> memoryview:
    return out if out.format == "B" and out.ndim == 1 else out.cast("B")


_URL_CREDENTIALS: Final = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s\"']+@")


def _scrubbed(exc: BaseException) -> str:
    """An exception's text without ``user:password@`` in the URLs it quotes (botocore names
    the endpoint URL as given, credentials included)."""
    return _URL_CREDENTIALS.sub(r"\1", str(exc))


def _url_userinfo(url: str) -> str:
    """The ``user:password`` a URL carries before its host ('' when none), as :func:`_redact`
    drops it: in a URL that does not parse (or has no ``://``), everything up to the last
    ``@``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rpartition("@")[0]
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return rest.rpartition("@")[0]
    return parts.netloc.rpartition("@")[0]


def _url_secrets(url: str, *, query: bool = False) -> list[str]:
    """What of ``url`` an exception quoting it must not show: its ``user:password`` and the
    password alone (where long enough not to match ordinary text); with ``query``, its query
    string too (a signed URL's signature). Exceptions quote URLs also without their scheme,
    as paths, which :data:`_URL_CREDENTIALS` cannot recognise."""
    info = _url_userinfo(url)
    password = info.partition(":")[2]
    found = [x for x in (info, password if len(password) >= 4 else "") if x]
    if query:
        q = url.partition("?")[2].partition("#")[0]
        if len(q) >= 4:
            found.append(q)
    return found


#: Storage option names whose values are secrets (fsspec backends: ``password``, ``token``,
#: ``secret``, ``key``, ``account_key``, ``sas_token``, ``client_secret``, ``session_token``...).
_SECRET_OPTION: Final = re.compile(r"pass|secret|token|key|cred|auth|sas|sig", re.IGNORECASE)


def _option_secrets(options: Mapping[str, Any]) -> list[str]:
    """String values of secret-looking storage options (nested mappings too), long enough not
    to match ordinary text."""
    found: list[str] = []
    pending: list[tuple[str, Any]] = list(options.items())
    while pending:
        name, value = pending.pop()
        if isinstance(value, Mapping):
            pending.extend((f"{name}.{k}", v) for k, v in value.items())
        elif isinstance(value, str) and len(value) >= 4 and _SECRET_OPTION.search(name):
            found.append(value)
    return found


def _quotes_secret(exc: BaseException, secrets: Sequence[str]) -> bool:
    """Whether ``exc``, or any exception it chains to, quotes a URL with credentials or one of
    ``secrets``: in its message, its arguments or (botocore's) keyword arguments."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        texts = [str(e), repr(e.args)]
        kwargs = getattr(e, "kwargs", None)
        if isinstance(kwargs, Mapping):
            texts.extend(map(str, kwargs.values()))
        for text in texts:
            if _URL_CREDENTIALS.search(text) or any(s and s in text for s in secrets):
                return True
        pending.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return False


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


def shown_location(path: str) -> str:
    """A path or URL as messages and output show it: a URL without its credentials and query
    string (a password or a signed URL's signature must not reach a terminal, logs or JSON)."""
    return _redact(path) if "://" in path else path


def _redact(url: str) -> str:
    """Drop credentials and the query string (signed URLs carry secrets there).

    Never raises: it names the URL in error messages, including those about malformed URLs.
    A URL that does not parse, or whose port is not a number, shows nothing before the last
    ``@`` after its scheme: a password with an unencoded ``/``, ``?`` or ``#`` ends the
    authority early (``http://user:pa/ss@host/f`` parses as host ``user`` and port ``pa``),
    leaving the rest of the password in what would be shown as path, query or fragment.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:  # that, or an unbalanced '[' in the host
        scheme, sep, rest = url.partition("://")
        if sep and "@" in rest:
            rest = rest.rpartition("@")[2]
        base, query, _ = rest.partition("?")
        authority, slash, path = base.partition("#")[0].partition("/")
        return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}" + (
            "?..." if query else ""
        )
    # The netloc as written, less any user:password.
    netloc = parts.netloc.rpartition("@")[2]
    suffix = "?..." if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + suffix


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


def url_path(url: str) -> str:
    """The part of a URL that names the object, for tests on its name such as the suffix.

    For ``http(s)://`` and fsspec URLs that is the path, without query string or fragment
    (``.../model.safetensors.index.json?download=true`` is an index). For ``s3://`` it is
    ``bucket/key`` whole, since S3 keys may contain ``?`` and ``#``.
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in ("s3", "s3a"):
        return rest
    try:
        return urllib.parse.urlsplit(url).path
    except ValueError:
        return url.partition("?")[0].partition("#")[0]


def shown_name(path: str) -> str:
    """The file name of a path or URL, as labels and output names show it: a URL's without its
    query string (a signed URL's signature) or fragment."""
    if "://" in path:
        return posixpath.basename(url_path(path))
    return os.path.basename(path)


def url_dirname(url: str) -> str:
    """The URL of the folder holding the object ``url`` names, without query or fragment.

    A query string belongs to one object (a signed URL's signature, ``?download=true``), so it
    is not carried to the folder's other objects.
    """
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in ("http", "https"):
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            return posixpath.dirname(url)
        return urllib.parse.urlunsplit(
            (parts.scheme, parts.netloc, posixpath.dirname(parts.path), "", "")
        )
    return posixpath.dirname(url)


def url_join(base: str, name: str) -> str:
    """The URL of file ``name`` (a relative path, as in an index) in the folder ``base``.

    For ``http(s)`` the name is percent-encoded, so that ``?``, ``#`` or ``%`` in a file name
    stay part of the path; S3 keys and fsspec paths take names as they are.
    """
    if base.partition("://")[0].lower() in ("http", "https"):
        name = urllib.parse.quote(name, safe="/")
    return posixpath.join(base, name)


# ------------------------------------------------------------------------------------- options


def _shown_value(value: object) -> str:
    """An option's value as error messages quote it: its repr, shortened, and its type."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _int_option(name: str, value: object, minimum: int) -> int:
    """Check an integer option (numpy integers are fine, bool and float are not).

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: It is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{name} must be an integer, got {_shown_value(value)}")
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def _seconds_option(name: str, value: object, *, limit: bool = True) -> float | None:
    """Check a duration in seconds.

    With ``limit`` (a timeout, a deadline) it must be above 0; None or infinity mean no limit
    and give None. Otherwise (a delay) it must be finite and >= 0.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: It is out of range or NaN.
    """
    if value is None and limit:
        return None
    # numbers.Real: numpy's floats and ints too (np.float32 is no float subclass).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {_shown_value(value)}")
    seconds = float(value)
    if limit:
        if not seconds > 0:  # NaN too
            raise ValueError(
                f"{name} must be a positive number of seconds (or None for no limit), got {value!r}"
            )
        return None if math.isinf(seconds) else seconds
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def _optional_str(name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string or None, got {_shown_value(value)}")


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
            raise TypeError(f"headers: a header name must be a string, got {_shown_value(name)}")
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


def _check_common(
    *,
    max_connections: object,
    part_size: object,
    max_gap: object,
    head_bytes: object,
    retries: object,
    backoff: object,
    accept_full_body: object,
) -> None:
    """Check the options every remote source takes (see :class:`RemoteSource`)."""
    _int_option("max_connections", max_connections, 1)
    _int_option("part_size", part_size, 1)
    _int_option("max_gap", max_gap, 0)
    _int_option("head_bytes", head_bytes, 0)
    _int_option("retries", retries, 0)
    _seconds_option("backoff", backoff, limit=False)
    _int_option("accept_full_body", accept_full_body, 0)


_S = TypeVar("_S", bound="RemoteSource")


class RemoteSource:
    """Shared machinery of the remote sources: head cache, splitting, coalescing, threads.

    Subclasses implement :meth:`_fetch_once` (one request for an exact range) and call
    :meth:`_open` from their constructor.
    """

    #: Texts a client library's exceptions may quote that must not be shown: credentials in
    #: a URL, a signed URL's query string, secret storage options (see :meth:`_clean`).
    _secrets: tuple[str, ...] = ()

    def _clean(self, exc: BaseException | str) -> str:
        """An exception's text without the credentials and secrets it may quote."""
        text = _scrubbed(exc) if isinstance(exc, BaseException) else exc
        for secret in self._secrets:
            text = text.replace(secret + "@", "").replace(secret, "...")
        return text

    def _quotes_secret(self, exc: BaseException) -> bool:
        return _quotes_secret(exc, self._secrets)

    def _raise(self, error: Exception, cause: BaseException) -> NoReturn:
        """Raise ``error`` chained to ``cause``, unless ``cause`` quotes credentials (then a
        traceback, ``logging.exception`` or ``--debug`` would print them). Call it outside an
        ``except`` clause, or the cause is chained anyway as ``__context__``."""
        if self._quotes_secret(cause):
            raise error from None
        raise error from cause

    def __init__(
        self,
        name: str,
        *,
        max_connections: int = 8,
        part_size: int = DEFAULT_PART_SIZE,
        max_gap: int = DEFAULT_MAX_GAP,
        head_bytes: int = DEFAULT_HEAD_BYTES,
        retries: int = 3,
        backoff: float = 0.2,
        accept_full_body: int = DEFAULT_ACCEPT_FULL_BODY,
    ) -> None:
        _check_common(
            max_connections=max_connections,
            part_size=part_size,
            max_gap=max_gap,
            head_bytes=head_bytes,
            retries=retries,
            backoff=backoff,
            accept_full_body=accept_full_body,
        )
        self._name = name
        self._max_connections = operator.index(max_connections)
        self._part_size = operator.index(part_size)
        self._max_gap = operator.index(max_gap)
        self._head_bytes = operator.index(head_bytes)
        self._retries = operator.index(retries)
        self._backoff = float(backoff)
        self._accept_full_body = operator.index(accept_full_body)
        self._size = -1
        # The first bytes of the object; all of it when a server ignored Range on a small file.
        # Replaced, never mutated, so readers need no lock.
        self._head = b""
        self._etag: str | None = None
        self._head_lock = threading.Lock()
        # Parallel reads in flight on the shared workers, which close() waits for.
        self._runs = threading.Condition()
        self._running = 0
        self._pid = os.getpid()
        self._closed = False
        self.stats = RemoteStats()
        """Counters of requests and bytes transferred by this source."""

    # ------------------------------------------------------------------ protocol

    @property
    def size(self) -> int:
        """Total number of bytes in the object."""
        return self._size

    @property
    def name(self) -> str:
        """The URL, without credentials or query string."""
        return self._name

    @property
    def head(self) -> bytes:
        """The first bytes of the object, fetched when it was opened (possibly empty)."""
        return self._head

    def view(self, offset: int, length: int) -> memoryview | None:
        """Return None: remote bytes cannot be mapped."""
        return None

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``.

        Bytes cached at open are copied without a request; a range larger than ``part_size``
        is fetched as parallel parts straight into ``out``.

        Raises:
            SafetensorError: The range lies outside the object.
            RemoteError: The store failed after retries, or sent something other than the range.
        """
        out = _as_bytes(out)
        self._check_open()
        _check_range(self, offset, out.nbytes)
        self.readinto_many([(offset, out.nbytes)], out)

    def readinto_many(
        self, ranges: Sequence[tuple[int, int]], out: memoryview, *, max_gap: int | None = None
    ) -> None:
        """Read several ``(offset, length)`` ranges back to back into ``out``.

        Ranges whose gap is below ``max_gap`` are merged into one request (the gap bytes are
        discarded); groups and large ranges are split into ``part_size`` requests fetched in
        parallel. Where a part maps onto one contiguous piece of ``out`` it is received there
        directly; otherwise through a scratch buffer of at most ``part_size`` bytes.

        Args:
            ranges: ``(offset, length)`` pairs, in the order their bytes go into ``out``.
            out: Buffer of exactly the total length.
            max_gap: This call's merge distance instead of the source's (0: only touching
                ranges share a request, so exactly their bytes are fetched).

        Raises:
            ValueError: ``out`` does not hold exactly the total length.
            SafetensorError: A range lies outside the object.
            RemoteError: The store failed.
        """
        out = _as_bytes(out)
        self._check_open()
        items: list[_Item] = []
        pos = 0
        for offset, length in ranges:
            _check_range(self, offset, length)
            if length:
                items.append(_Item(offset, pos, length))
            pos += length
        if pos != out.nbytes:
            raise ValueError(f"ranges cover {pos} bytes but the buffer holds {out.nbytes}")
        items = self._serve_from_head(items, out)
        if items:
            gap = self._max_gap if max_gap is None else max_gap
            self._run(self._plan(items, out, gap), out)

    def prefetch_head(self, nbytes: int) -> memoryview:
        """Make sure the first ``nbytes`` (bounded by the size) are cached; return them.

        One request fetches what is missing. Later reads inside those bytes need no request.
        """
        self._check_open()
        nbytes = max(0, min(nbytes, self._size))
        with self._head_lock:
            head = self._head
            if len(head) < nbytes:
                extra = bytearray(nbytes - len(head))
                view = memoryview(extra)
                self._run(self._plan([_Item(len(head), 0, len(extra))], view, self._max_gap), view)
                head = self._head = head + bytes(extra)
        return memoryview(head)[:nbytes]

    def close(self) -> None:
        """Wait for parallel reads in flight, then release the source's resources. Idempotent."""
        self._closed = True
        if os.getpid() == self._pid:  # a forked child has none of the parent's reads in flight
            with self._runs:
                self._runs.wait_for(lambda: not self._running)
        self._release()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, size={self._size})"

    # ------------------------------------------------------------------ for subclasses

    def _fetch_once(self, offset: int, out: memoryview, probing: bool) -> None:
        """Send one request for ``out.nbytes`` bytes at ``offset`` and fill ``out`` exactly.

        When ``probing`` the size is not known yet: the implementation sets ``self._size``
        from the reply, fills ``out`` with the bytes available (``out`` may be longer than the
        object) and records ``self._head``.

        Raises:
            _Transient: The failure may go away on retry.
            RemoteError: It will not.
        """
        raise NotImplementedError

    def _release(self) -> None:
        """Release backend resources (connections, clients)."""

    def _open(self) -> None:
        """Learn the size and cache the first ``head_bytes`` with one request.

        A ``head_bytes`` above ``part_size`` is fetched as a first part, which tells the size,
        then the rest of it that the object holds: the buffer for the first request is
        allocated before the size is known.
        """
        # A range of at least one byte: the reply's Content-Range is what tells the size.
        probe = bytearray(max(min(self._head_bytes, self._part_size), 1))
        self._fetch(0, memoryview(probe), probing=True)
        if self._head_bytes == 0 and len(self._head) < self._size:
            self._head = b""  # honour "cache nothing" (unless the server sent the whole file)
        elif len(self._head) < min(self._head_bytes, self._size):
            self.prefetch_head(self._head_bytes)

    def _fetch(self, offset: int, out: memoryview, probing: bool = False) -> None:
        """Call :meth:`_fetch_once` with bounded retries and exponential backoff with jitter."""
        attempt = 0
        while True:
            try:
                self._fetch_once(offset, out, probing)
                return
            except _Transient as exc:
                if attempt >= self._retries or self._closed:
                    raise RemoteError(
                        f"{exc} (gave up on {self._name} after {attempt + 1} attempts)",
                        kind=exc.kind,
                        offset=offset,
                    ) from exc
                delay = self._backoff * (2**attempt) * (0.5 + random.random())
                if exc.retry_after is not None:
                    delay = max(delay, min(exc.retry_after, _MAX_RETRY_AFTER))
                attempt += 1
                self.stats.add(retries=1)
                time.sleep(delay)

    def _cached_whole(self, body: bytes, size: int) -> None:
        """Keep a whole small object in memory after a server ignored ``Range``."""
        self._size = size
        self._head = body

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedFileError(f"{self._name} is closed", kind="ClosedFile")

    # ------------------------------------------------------------------ planning

    def _serve_from_head(self, items: list[_Item], out: memoryview) -> list[_Item]:
        head = self._head
        cached = len(head)
        if not cached:
            return items
        rest: list[_Item] = []
        for it in items:
            if it.offset < cached:
                k = min(cached - it.offset, it.length)
                out[it.pos : it.pos + k] = head[it.offset : it.offset + k]
                if k < it.length:
                    rest.append(_Item(it.offset + k, it.pos + k, it.length - k))
            else:
                rest.append(it)
        return rest

    def _plan(self, items: list[_Item], out: memoryview, max_gap: int) -> list[_Part]:
        """Group ranges closer than ``max_gap``, then cut each group into balanced parts."""
        items = sorted(items, key=lambda it: it.offset)
        groups: list[list[_Item]] = []
        end = -1
        for it in items:
            if groups and it.offset - end <= max_gap:
                groups[-1].append(it)
                end = max(end, it.offset + it.length)
            else:
                groups.append([it])
                end = it.offset + it.length
        parts: list[_Part] = []
        for group in groups:
            parts.extend(self._cut(group, out))
        return parts

    def _cut(self, group: list[_Item], out: memoryview) -> list[_Part]:
        start = group[0].offset
        stop = max(it.offset + it.length for it in group)
        hull = stop - start
        # Balanced sizes: 8 MiB + 1 byte becomes two halves, not 8 MiB and a 1-byte request.
        count = -(-hull // self._part_size)
        step = -(-hull // count)
        buckets: list[list[_Item]] = [[] for _ in range(count)]
        for it in group:
            first = (it.offset - start) // step
            last = (it.offset + it.length - 1 - start) // step
            for k in range(first, last + 1):
                buckets[k].append(it)
        parts: list[_Part] = []
        for k, bucket in enumerate(buckets):
            if not bucket:
                continue  # a part that falls wholly inside a gap
            p_start = start + k * step
            p_stop = min(start + (k + 1) * step, stop)
            # Trim to the bytes wanted, so no part begins or ends inside a gap.
            p_start = max(p_start, min(it.offset for it in bucket))
            p_stop = min(p_stop, max(it.offset + it.length for it in bucket))
            parts.append(self._part(p_start, p_stop, bucket, out))
        return parts

    @staticmethod
    def _part(p_start: int, p_stop: int, bucket: list[_Item], out: memoryview) -> _Part:
        # Direct when every item maps file bytes to ``out`` with one shift and they tile the
        # part without gaps: the usual case of adjacent tensors read in file order.
        delta = bucket[0].pos - bucket[0].offset
        covered = p_start
        direct = True
        for it in bucket:  # sorted by offset
            if it.pos - it.offset != delta or it.offset > covered:
                direct = False
                break
            covered = max(covered, it.offset + it.length)
        if direct and covered >= p_stop:
            target = out[p_start + delta : p_stop + delta]
            return _Part(p_start, p_stop - p_start, target, [])
        return _Part(p_start, p_stop - p_start, None, bucket)

    def _do_part(self, part: _Part, out: memoryview) -> None:
        if part.target is not None:
            self._fetch(part.offset, part.target)
            return
        scratch = bytearray(part.length)
        self._fetch(part.offset, memoryview(scratch))
        p_stop = part.offset + part.length
        for it in part.items:
            a = max(it.offset, part.offset)
            b = min(it.offset + it.length, p_stop)
            dst = it.pos + (a - it.offset)
            out[dst : dst + (b - a)] = scratch[a - part.offset : b - part.offset]

    def _run(self, parts: list[_Part], out: memoryview) -> None:
        if not parts:
            return
        if len(parts) == 1:
            self._do_part(parts[0], out)
            return
        with self._runs:
            self._running += 1
        try:
            _WORKERS.run(lambda p: self._do_part(p, out), parts, self._max_connections)
        finally:
            with self._runs:
                self._running -= 1
                self._runs.notify_all()


# ------------------------------------------------------------------------------------------ HTTP


#: ``bytes first-last/total``, ``bytes */total`` or ``bytes first-last/*`` (RFC 9110 14.4).
#: ASCII digits only: ``str.isdigit`` also accepts ``"²"``, which ``int`` refuses.
_CONTENT_RANGE: Final = re.compile(
    r"[ \t]*bytes[ \t]+(?:(\d+)[ \t]*-[ \t]*(\d+)|\*)[ \t]*/[ \t]*(\d+|\*)[ \t]*",
    re.ASCII | re.IGNORECASE,
)
_DECIMAL: Final = re.compile(r"[ \t]*(\d+)[ \t]*", re.ASCII)


def _parse_content_range(
    value: str | None, where: str
) -> tuple[int | None, int | None, int | None]:
    """Parse a ``Content-Range`` value; parts it does not give (or no header) are None.

    Raises:
        RemoteError: The header is present but malformed (kind ``InvalidResponse``).
    """
    if value is None:
        return None, None, None
    match = _CONTENT_RANGE.fullmatch(value)
    if match is None:
        raise RemoteError(
            f"{where}: malformed Content-Range {value!r} (expected 'bytes first-last/total')",
            kind="InvalidResponse",
        )
    first, last, total = match.groups()
    return (
        None if first is None else int(first),
        None if last is None else int(last),
        None if total == "*" else int(total),
    )


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
        raise RemoteError(f"{where}: malformed {name} {value!r}", kind="InvalidResponse")
    return int(match.group(1))


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
    where = _redact(url)
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


class _Workers:
    """The worker threads every remote source's parallel reads share.

    One pool per source kept up to ``max_connections`` idle threads per source for as long as
    the source was open: a handle that had read from 64 shards of a remote checkpoint held
    408 idle threads. A read runs at most ``max_connections`` workers here, each taking the
    next part until none is left; workers never wait on other workers, so a full pool only
    queues reads, it cannot deadlock. A read started on a worker (none does now) runs inline.
    """

    #: Threads at most, shared by all sources (a source's reads use ``max_connections``).
    SIZE: Final = 64

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.SIZE, thread_name_prefix="pysafetensors-remote"
                )
            return self._pool

    def run(self, do: Callable[[_Part], None], parts: list[_Part], width: int) -> None:
        """``do(part)`` for every part on at most ``width`` workers; re-raise the first failure
        once every worker has stopped (none writes into the caller's buffer after that)."""
        if getattr(self._local, "worker", False):
            for part in parts:
                do(part)
            return
        pending = collections.deque(parts)
        lock = threading.Lock()
        failures: list[BaseException] = []

        def worker() -> None:
            self._local.worker = True
            try:
                while True:
                    with lock:
                        if failures or not pending:
                            return
                        part = pending.popleft()
                    try:
                        do(part)
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        with lock:
                            failures.append(exc)
                        return
            finally:
                self._local.worker = False

        pool = self._executor()
        for future in [pool.submit(worker) for _ in range(min(width, len(parts)))]:
            future.result()
        if failures:
            raise failures[0]


_WORKERS: Final = _Workers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKERS._reset)  # the parent's threads are not here


class _ConnectionPool:
    """Idle keep-alive connections of one source, kept in the process-wide store.

    A connection is used by one thread at a time: it is taken out while a request runs and put
    back only after its response was read in full. Idle connections are shared by every source
    that talks to the same (scheme, host, port) with the same TLS context (a connection is
    never handed to a source that would have verified its peer otherwise), at most
    :data:`_IDLE_PER_HOST` each: kept per source, a handle on 200 shards of one server held
    over a thousand idle sockets and ran out of descriptors. Each request sets its own timeout.
    """

    def __init__(self, timeout: float | None, ssl_context: ssl.SSLContext | None) -> None:
        self._timeout = timeout
        self._ssl = ssl_context

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
        return made, False

    def put(self, key: _Key, conn: _Conn) -> None:
        _IDLE.give((key, self._ssl), conn)


#: Idle connections kept per (scheme, host, port, TLS context), for all sources together.
_IDLE_PER_HOST: Final = 16


class _IdleConnections:
    """The process-wide store of idle keep-alive connections (see :class:`_ConnectionPool`)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        # The key holds the TLS context itself (not its id), so it cannot be reused by another.
        self._idle: dict[tuple[_Key, ssl.SSLContext | None], list[_Conn]] = {}

    def take(self, key: tuple[_Key, ssl.SSLContext | None]) -> _Conn | None:
        with self._lock:
            idle = self._idle.get(key)
            return idle.pop() if idle else None

    def give(self, key: tuple[_Key, ssl.SSLContext | None], conn: _Conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < _IDLE_PER_HOST:
                idle.append(conn)
                return
        conn.close()

    def _after_fork(self) -> None:
        # The child's copies of the parent's sockets: closed here, the parent's stay open.
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
        timeout: Seconds to wait for a connection, or for each read on it (None: no limit).
            It bounds every socket operation, not a whole request: a server that keeps sending
            a few bytes before each timeout runs out holds a request open indefinitely (see
            ``deadline``).
        deadline: Seconds one request may take in all, from sending it to its last body byte
            (None: no limit), status line and headers included: when it passes the request's
            socket is shut down. A request past it fails as a timeout and is retried like one.
            It must allow a ``part_size`` request at the slowest acceptable rate.
        max_connections: Parallel requests for split or coalesced reads.
        part_size: Largest single request when a read is split.
        max_gap: Ranges closer than this are merged into one request by ``readinto_many``.
        head_bytes: Bytes fetched and cached when opening (0: only learn the size); at most
            the file's size is kept.
        retries: Repeats after transient failures (5xx, 429, resets, truncated bodies).
        backoff: First retry delay in seconds; doubles each time, with jitter.
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
        max_redirects: int = 5,
        accept_full_body: int = DEFAULT_ACCEPT_FULL_BODY,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"an http(s) URL must be a string, got {type(url).__name__}")
        if url.partition("://")[0].lower() not in ("http", "https"):
            raise ValueError(f"not an http(s) URL: {_redact(url)}")
        # Options are checked before anything is sent: a bad one must not surface later as a
        # failed request, or as a crash in the middle of a retry.
        own_headers = _headers_option(headers)
        timeout = _seconds_option("timeout", timeout)
        deadline = _seconds_option("deadline", deadline)
        max_redirects = _int_option("max_redirects", max_redirects, 0)
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError(
                f"ssl_context must be an ssl.SSLContext or None, got {type(ssl_context).__name__}"
            )
        # Malformed URLs fail here, before any request and without retries.
        origin_key, _ = _parse_http_url(url)
        super().__init__(
            _redact(url),
            max_connections=max_connections,
            part_size=part_size,
            max_gap=max_gap,
            head_bytes=head_bytes,
            retries=retries,
            backoff=backoff,
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
        # Idle connections live in the process-wide store: nothing to release at close.
        self._conns = _ConnectionPool(timeout, ssl_context)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

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
                if not late and isinstance(exc, (http.client.InvalidURL, ValueError)):
                    # http.client refused what we would send (a header value with a line
                    # break, a character outside Latin-1): no retry can fix that. Its message
                    # quotes the offending value, which may be a credential: name the headers,
                    # not the values.
                    raise RemoteError(
                        f"{self._name}: cannot send the request: {_refused_request(exc, headers)}",
                        kind="InvalidRequest",
                    ) from None
                if reused and not late and isinstance(exc, _STALE):
                    # The server closed an idle keep-alive connection: not a failure, and
                    # not worth a retry's backoff. Try again on a fresh connection.
                    continue
                self.stats.add(requests=1)
                if late:
                    assert clock is not None
                    raise self._past_deadline(clock, "before the reply") from exc
                raise _Transient(
                    f"request to {self._name} failed: {exc!r}", "ConnectionError"
                ) from exc
            except BaseException:
                conn.close()
                if clock is not None:
                    clock.done()
                raise
            self.stats.add(requests=1)
            if clock is not None and clock.fired:
                # The status line or headers were cut short by the watchdog, and may look
                # complete to http.client.
                conn.close()
                clock.done()
                raise self._past_deadline(clock, "before the reply")
            return resp, conn, key, clock

    def _past_deadline(self, clock: _Clock, when: str) -> _Transient:
        return _Transient(
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
                location = resp.getheader("Location")
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
                        f"{_redact(location)} ({_invalid_url(location, exc)})",
                        kind="InvalidURL",
                    ) from None
                if url.partition("://")[0].lower() not in ("http", "https"):
                    raise RemoteError(
                        f"{self._name}: redirected ({status}) to {_redact(url)}, which is not "
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
            _Transient: The deadline passed (kind ``Timeout``).
        """
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
        where = _redact(url)
        if status in (200, 206):
            self._check_encoding(resp, where)
        if status == 206:
            self._handle_partial(resp, where, offset, out, probing, clock)
        elif status == 200:
            self._handle_whole(resp, where, offset, out, probing, clock)
        elif status == 416:
            total = _parse_content_range(resp.getheader("Content-Range"), where)[2]
            if probing and total == 0:
                # An empty file has no byte 0 to ask for; it is still a valid (empty) object.
                self._size = 0
                self._head = b""
                return
            raise RemoteError(
                f"{where}: range {offset}-{offset + out.nbytes - 1} not satisfiable (416); the "
                f"server reports {total if total is not None else 'an unknown number of'} bytes"
                + ("" if probing else f", this source expected {self._size}"),
                kind="RangeNotSatisfiable",
                offset=offset,
            )
        elif status in (404, 410):
            raise RemoteNotFoundError(f"{where}: not found ({status})", kind="NotFound")
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
            raise _Transient(
                f"{where}: server error {status} {resp.reason}",
                "HTTPError",
                _retry_after(resp.getheader("Retry-After")),
            )
        else:
            raise RemoteError(f"{where}: unexpected HTTP {status} {resp.reason}", kind="HTTPError")

    @staticmethod
    def _check_encoding(resp: http.client.HTTPResponse, where: str) -> None:
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

    def _check_validators(self, resp: http.client.HTTPResponse, where: str, probing: bool) -> None:
        """Refuse a reply from another version of the file than the one opened.

        The ETag decides when both the first reply and this one carry one; otherwise
        Last-Modified does (servers such as ``python -m http.server`` send only that).
        """
        etag = resp.getheader("ETag")
        modified = resp.getheader("Last-Modified")
        if probing:
            self._etag = etag
            self._modified = modified
        elif etag and self._etag:
            if etag != self._etag:
                raise RemoteError(
                    f"{where} changed while open (ETag {self._etag} became {etag}); reopen it",
                    kind="Changed",
                )
        elif modified and self._modified and modified != self._modified:
            raise RemoteError(
                f"{where} changed while open (Last-Modified {self._modified} became "
                f"{modified}); reopen it",
                kind="Changed",
            )

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
        first, last, total = _parse_content_range(resp.getheader("Content-Range"), where)
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
            raise _Transient(
                f"{where}: Content-Length {length} disagrees with the range of {want} bytes",
                "Truncated",
            )
        self._check_validators(resp, where, probing)
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
                n = resp.readinto(out[done:])
                if not n:
                    break
                done += n
        except (OSError, http.client.HTTPException) as exc:
            self.stats.add(nbytes=done)
            if clock is not None and clock.expired():
                raise self._past_deadline(
                    clock, f"after {done} of {total} bytes at offset {offset}"
                ) from exc
            raise _Transient(
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
            raise _Transient(
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
        self._check_validators(resp, where, probing)
        self._cached_whole(bytes(body), length)
        want = out.nbytes if not probing else min(out.nbytes, max(0, length - offset))
        out[:want] = body[offset : offset + want]


# -------------------------------------------------------------------------------------------- S3

#: S3 error codes that mean "this object or bucket is not there".
_S3_MISSING: Final = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchVersion", "NotFound", "404"})
#: S3 error codes about credentials or permissions.
_S3_DENIED: Final = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "403",
    }
)


def _split_s3_url(url: str) -> tuple[str, str]:
    # Not urlsplit: keys may contain '?' and '#', which are not query or fragment in S3.
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a") or "/" not in rest:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    bucket, _, key = rest.partition("/")
    if not bucket or not key:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    return bucket, key


class S3Source(RemoteSource):
    """Random access to an S3 object (or any S3-compatible store) with ranged ``GetObject``.

    Needs ``boto3`` (``pip install 'pysafetensors[s3]'``). Credentials come from boto3's usual
    chain (environment, shared config, instance roles); the endpoint from ``endpoint_url``, else
    ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (for MinIO, R2, moto...). S3 serves one
    range per request, so coalescing matters more here than over HTTP.

    Every reply must carry a ``ContentRange`` matching the request, and the object's ETag must
    not change while it is open.

    Args:
        url: ``s3://bucket/key``.
        client: A ready boto3 S3 client; when given, the other client options are ignored.
        endpoint_url: S3 endpoint, overriding the environment.
        region_name: Region for the client.
        anon: Send unsigned requests (public buckets).
        version_id: Read this version of the object.
        client_kwargs: Extra keyword arguments for ``boto3.session.Session().client``.
        max_connections: Parallel requests (also the client's connection pool size).
        part_size: Largest single request when a read is split.
        max_gap: Ranges closer than this are merged into one request by ``readinto_many``.
        head_bytes: Bytes fetched and cached when opening.
        retries: Repeats after a truncated body (botocore retries throttling and 5xx itself).
        backoff: First retry delay in seconds.

    Raises:
        ImportError: boto3 is not installed.
        TypeError: An option of the wrong type.
        ValueError: Not an ``s3://bucket/key`` URL, or an option out of range.
        RemoteNotFoundError: NoSuchKey, NoSuchBucket.
        RemotePermissionError: AccessDenied, InvalidAccessKeyId, missing credentials...
        RemoteError: Anything else the store or the connection reports.
    """

    def __init__(
        self,
        url: str,
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        anon: bool = False,
        version_id: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        max_connections: int = 8,
        part_size: int = DEFAULT_PART_SIZE,
        max_gap: int = DEFAULT_MAX_GAP,
        head_bytes: int = DEFAULT_HEAD_BYTES,
        retries: int = 3,
        backoff: float = 0.2,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"an s3:// URL must be a string, got {type(url).__name__}")
        self._bucket, self._key = _split_s3_url(url)
        for option, value in (
            ("endpoint_url", endpoint_url),
            ("region_name", region_name),
            ("version_id", version_id),
        ):
            _optional_str(option, value)
        if not isinstance(anon, bool):
            raise TypeError(f"anon must be True or False, got {_shown_value(anon)}")
        if client_kwargs is not None and not isinstance(client_kwargs, Mapping):
            raise TypeError(
                f"client_kwargs must be a mapping or None, got {type(client_kwargs).__name__}"
            )
        super().__init__(
            f"s3://{self._bucket}/{self._key}",
            max_connections=max_connections,
            part_size=part_size,
            max_gap=max_gap,
            head_bytes=head_bytes,
            retries=retries,
            backoff=backoff,
            # S3 always honours Range; a reply without ContentRange is a broken proxy.
            accept_full_body=DEFAULT_ACCEPT_FULL_BODY,
        )
        self._version_id = version_id
        try:
            import botocore.exceptions
        except ImportError as exc:
            raise ImportError(
                "reading s3:// URLs needs boto3: pip install 'pysafetensors[s3]' "
                "(or pass an fsspec URL with s3fs installed through FsspecSource)"
            ) from exc
        self._botoexc: Any = botocore.exceptions
        # Recent botocore reads these variables itself; reading them here also covers old ones.
        endpoint = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        given_endpoint = (client_kwargs or {}).get("endpoint_url")
        given_endpoint = given_endpoint if isinstance(given_endpoint, str) else None
        if client is not None:
            given_endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None)
            given_endpoint = given_endpoint if isinstance(given_endpoint, str) else None
            endpoint = None
        #: Credentials in the endpoint URL: botocore's exceptions quote the URL as given (the
        #: messages here are cleaned of them, and an exception quoting them is not chained).
        secrets: list[str] = []
        for url_given in (endpoint, given_endpoint):
            secrets.extend(_url_secrets(url_given) if url_given else ())
        self._secrets = tuple(secrets)
        if client is None:
            failure: Exception | None = None
            try:
                client = self._make_client(
                    endpoint, region_name, anon, max_connections, client_kwargs or {}
                )
            except Exception as exc:
                if not self._quotes_secret(exc):
                    raise
                failure = exc
            if failure is not None:
                # Outside the except clause: not even as __context__.
                raise ValueError(
                    f"{self._name}: the S3 endpoint URL (shown without its credentials) was "
                    f"refused: {self._clean(failure)}"
                ) from None
        self._client = client
        try:
            self._open()
        except BaseException:
            self.close()  # a head_bytes above part_size may have started worker threads
            raise

    @staticmethod
    def _make_client(
        endpoint: str | None,
        region_name: str | None,
        anon: bool,
        max_connections: int,
        client_kwargs: Mapping[str, Any],
    ) -> Any:
        import boto3
        import botocore
        from botocore.config import Config

        config = Config(
            max_pool_connections=max(10, max_connections),
            retries={"max_attempts": 4, "mode": "standard"},
            signature_version=botocore.UNSIGNED if anon else None,
        )
        kwargs: dict[str, Any] = dict(client_kwargs)
        given = kwargs.get("config")
        # A user's Config (timeouts, say) is merged over ours rather than replacing it: as a
        # whole it dropped anon=True (requests were then signed, or failed without
        # credentials), the connection pool size and the retry settings.
        kwargs["config"] = config.merge(given) if given is not None else config
        if anon:
            # Anonymous means unsigned, whatever the given Config says.
            kwargs["config"] = kwargs["config"].merge(Config(signature_version=botocore.UNSIGNED))
        if endpoint:
            kwargs.setdefault("endpoint_url", endpoint)
        if region_name:
            kwargs.setdefault("region_name", region_name)
        # A private session: the default one is not safe to build clients from concurrently.
        return boto3.session.Session().client("s3", **kwargs)

    def _error(self, exc: Exception, offset: int, probing: bool) -> Exception:
        """Translate a botocore exception into a RemoteError or a _Transient."""
        bexc = self._botoexc
        where = self._name
        if isinstance(exc, bexc.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            message = self._clean(str(err.get("Message", "")) or code)
            if code in _S3_MISSING or status == 404:
                what = "bucket" if code == "NoSuchBucket" else "object"
                return RemoteNotFoundError(
                    f"{where}: no such {what} ({code or status}: {message})", kind="NotFound"
                )
            if code in _S3_DENIED or status in (401, 403):
                return RemotePermissionError(
                    f"{where}: access denied ({code or status}: {message}); check the AWS "
                    "credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE), the endpoint, or pass "
                    "anon=True for a public bucket",
                    kind="PermissionDenied",
                )
            if code in ("PreconditionFailed",) or status == 412:
                return RemoteError(f"{where} changed while open; reopen it", kind="Changed")
            if code == "InvalidRange" or status == 416:
                return RemoteError(
                    f"{where}: range at offset {offset} not satisfiable ({message})",
                    kind="RangeNotSatisfiable",
                    offset=offset,
                )
            if status >= 500 or code in ("SlowDown", "InternalError", "RequestTimeout"):
                return _Transient(f"{where}: {code or status}: {message}", "HTTPError")
            return RemoteError(f"{where}: {code or status}: {message}", kind="HTTPError")
        if isinstance(exc, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
            return RemotePermissionError(
                f"{where}: no usable AWS credentials ({self._clean(exc)}); set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, configure a profile, or pass "
                "anon=True",
                kind="PermissionDenied",
            )
        if isinstance(
            exc,
            (
                bexc.IncompleteReadError,
                bexc.ResponseStreamingError,
                bexc.ReadTimeoutError,
                bexc.ConnectionClosedError,
            ),
        ):
            return _Transient(f"{where}: transfer interrupted: {self._clean(exc)}", "Truncated")
        # Endpoint unreachable and the like: botocore already retried.
        return RemoteError(f"{where}: {self._clean(exc)}", kind="ConnectionError")

    def _fetch_once(self, offset: int, out: memoryview, probing: bool) -> None:
        bexc = self._botoexc
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": self._key,
            "Range": f"bytes={offset}-{offset + out.nbytes - 1}",
        }
        if self._version_id:
            kwargs["VersionId"] = self._version_id
        self.stats.add(requests=1)
        # Failures are raised after their except clause, so that one quoting the endpoint's
        # credentials is not chained (see _raise).
        failure: Exception | None = None
        empty = False
        try:
            resp = self._client.get_object(**kwargs)
        except bexc.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            # An empty object has no byte 0; ask for its size instead.
            empty = probing and code == "InvalidRange"
            failure = None if empty else exc
        except bexc.BotoCoreError as exc:
            failure = exc
        if empty:
            self._probe_empty()
            return
        if failure is not None:
            error = self._error(failure, offset, probing)
            if isinstance(failure, bexc.BotoCoreError) and isinstance(error, _Transient):
                # botocore already retried the request itself (its max_attempts): a timeout or
                # a dropped connection here is final, not a truncated body for our retries
                # (which multiplied botocore's: ~20 minutes against a stalled endpoint at the
                # defaults).
                error = RemoteError(f"{self._name}: {self._clean(failure)}", kind="ConnectionError")
            self._raise(error, failure)
        body = resp["Body"]
        try:
            self._consume(resp, body, offset, out, probing)
        except bexc.BotoCoreError as exc:
            failure = exc
        finally:
            body.close()
        if failure is not None:
            self._raise(self._error(failure, offset, probing), failure)

    def _probe_empty(self) -> None:
        bexc = self._botoexc
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        if self._version_id:
            kwargs["VersionId"] = self._version_id
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            resp = self._client.head_object(**kwargs)
        except (bexc.ClientError, bexc.BotoCoreError) as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, 0, True), failure)
        size = int(resp.get("ContentLength", 0))
        if size != 0:
            raise RemoteError(
                f"{self._name}: range 0- refused although the object has {size} bytes",
                kind="RangeNotSatisfiable",
            )
        self._size = 0
        self._etag = resp.get("ETag")

    def _consume(
        self, resp: Mapping[str, Any], body: Any, offset: int, out: memoryview, probing: bool
    ) -> None:
        where = self._name
        first, last, total = _parse_content_range(resp.get("ContentRange"), where)
        length = int(resp.get("ContentLength", -1))
        etag = resp.get("ETag")
        if first is None or last is None or total is None:
            # No ContentRange: the range was ignored and the body is the whole object.
            if length < 0 or length > self._accept_full_body:
                raise RemoteError(
                    f"{where}: the store ignored the Range and is sending the whole object "
                    f"({length} bytes); ranged reads are not supported there",
                    kind="RangeNotSupported",
                )
            if not probing and (
                length != self._size or (etag and self._etag and etag != self._etag)
            ):
                # Another version of the object (as for ranged replies, and as the HTTP source
                # checks a whole body): its bytes must not be read at this version's offsets.
                raise RemoteError(f"{where} changed while open; reopen it", kind="Changed")
            whole = bytearray(length)
            self._read_body(body, memoryview(whole), offset)
            if probing:
                self._etag = etag
            self._cached_whole(bytes(whole), length)
            want = min(out.nbytes, max(0, length - offset))
            out[:want] = whole[offset : offset + want]
            return
        want = min(out.nbytes, total - offset) if probing else out.nbytes
        if first != offset or last != offset + want - 1:
            raise RemoteError(
                f"{where}: asked for bytes {offset}-{offset + want - 1}, store sent {first}-{last}",
                kind="RangeMismatch",
            )
        if probing:
            self._etag = etag
        elif total != self._size or (etag and self._etag and etag != self._etag):
            raise RemoteError(f"{where} changed while open; reopen it", kind="Changed")
        self._read_body(body, out[:want], offset)
        if probing:
            self._size = total
            self._head = bytes(out[:want])

    def _read_body(self, body: Any, out: memoryview, offset: int) -> None:
        done = 0
        total = out.nbytes
        try:
            while done < total:
                n = int(body.readinto(out[done:]))
                if not n:
                    break
                done += n
        finally:
            self.stats.add(nbytes=done)
        if done < total:
            raise _Transient(
                f"{self._name}: response truncated: got {done} of {total} bytes at offset {offset}",
                "Truncated",
            )


# ---------------------------------------------------------------------------------------- fsspec


class FsspecSource(RemoteSource):
    """Random access to a file on any fsspec filesystem (``gcs://``, ``az://``, ``hf://``...).

    Reads go through ``fs.cat_file(path, start, end)``; several parts through one
    ``fs.cat_ranges`` call on asynchronous filesystems (which run them concurrently), else
    through worker threads. Each range counts as one request in ``stats``, as does learning
    the size.

    Args:
        target: A URL (``memory://x.safetensors``), an ``fsspec.core.OpenFile``, or a path on
            ``fs``.
        fs: The filesystem ``target`` is a path on.
        max_connections: Worker threads for synchronous filesystems.
        part_size: Largest single range when a read is split.
        max_gap: Ranges closer than this are merged by ``readinto_many``.
        head_bytes: Bytes fetched and cached when opening.
        retries: Repeats after a short read.
        backoff: First retry delay in seconds.
        **storage_options: Passed to the filesystem when ``target`` is a URL.

    Raises:
        ImportError: fsspec is not installed.
        RemoteNotFoundError: The file does not exist.
        RemotePermissionError: The filesystem refused access.
    """

    def __init__(
        self,
        target: Any,
        *,
        fs: Any = None,
        max_connections: int = 8,
        part_size: int = DEFAULT_PART_SIZE,
        max_gap: int = DEFAULT_MAX_GAP,
        head_bytes: int = DEFAULT_HEAD_BYTES,
        retries: int = 1,
        backoff: float = 0.2,
        **storage_options: Any,
    ) -> None:
        common: dict[str, Any] = {
            "max_connections": max_connections,
            "part_size": part_size,
            "max_gap": max_gap,
            "head_bytes": head_bytes,
            "retries": retries,
            "backoff": backoff,
        }
        # Before url_to_fs, which may already reach the network.
        _check_common(**common, accept_full_body=DEFAULT_ACCEPT_FULL_BODY)
        # What fsspec's and its backends' exceptions may quote and must not show: the URL's
        # credentials and query string (fsspec keeps them in the path) and secret options.
        self._secrets = tuple(
            (_url_secrets(target, query=True) if isinstance(target, str) else [])
            + _option_secrets(storage_options)
        )
        failure: Exception | None = None
        if fs is not None:
            path = str(target)
        elif isinstance(target, str):
            try:
                from fsspec.core import url_to_fs
            except ImportError as exc:
                raise ImportError(
                    "reading this URL needs fsspec: pip install 'pysafetensors[remote]'"
                ) from exc
            try:
                fs, path = url_to_fs(target, **storage_options)
            except Exception as exc:
                failure = exc
            if failure is not None:  # outside the except clause: see _raise
                self._setup_failed(target, failure)
        elif hasattr(target, "fs") and hasattr(target, "path"):
            fs, path = target.fs, str(target.path)
        else:
            raise TypeError(
                f"FsspecSource needs a URL, an fsspec OpenFile or fs=; got {type(target).__name__}"
            )
        name = target if isinstance(target, str) and "://" in target else fs.unstrip_protocol(path)
        super().__init__(_redact(name) if "://" in name else name, **common)
        self._fs = fs
        self._path = path
        self.stats.add(requests=1)
        try:
            self._size = int(fs.size(path))
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, 0, "asking its size failed"), failure)
        if self._head_bytes and self._size:
            self.prefetch_head(self._head_bytes)

    def _setup_failed(self, target: str, failure: Exception) -> NoReturn:
        """Raise for a filesystem ``url_to_fs`` could not set up, without secrets."""
        for usage in (ImportError, ValueError, TypeError):
            if isinstance(failure, usage):
                # A backend not installed, an unknown protocol, an option it does not take:
                # the caller's to fix, in fsspec's words.
                if not self._quotes_secret(failure):
                    raise failure
                raise usage(self._clean(failure)) from None
        # A backend that connects while it is set up (ftp, sftp) and could not.
        where = shown_location(target)
        self._raise(
            RemoteError(
                f"{where}: the filesystem could not be set up: "
                f"{type(failure).__name__}: {self._clean(failure)}",
                kind="ConnectionError",
            ),
            failure,
        )

    @property
    def fs(self) -> Any:
        """The fsspec filesystem read from."""
        return self._fs

    @property
    def path(self) -> str:
        """The path on :attr:`fs`."""
        return self._path

    def _error(self, exc: Exception, offset: int, failed: str = "") -> Exception:
        """Translate a filesystem's exception, in words without secrets; ``failed`` says what
        failed (default: the read at ``offset``)."""
        where = self._name
        if isinstance(exc, (RemoteError, _Transient)):
            return exc
        text = self._clean(exc)
        if isinstance(exc, FileNotFoundError):
            return RemoteNotFoundError(f"{where}: not found ({text})", kind="NotFound")
        if isinstance(exc, PermissionError):
            return RemotePermissionError(
                f"{where}: access denied ({text})", kind="PermissionDenied"
            )
        failed = failed or f"read at offset {offset} failed"
        return RemoteError(f"{where}: {failed}: {type(exc).__name__}: {text}", kind="HTTPError")

    def _check_length(self, data: bytes, offset: int, want: int) -> None:
        if len(data) != want:
            raise _Transient(
                f"{self._name}: short read: got {len(data)} of {want} bytes at offset {offset}",
                "Truncated",
            )

    def _fetch_once(self, offset: int, out: memoryview, probing: bool) -> None:
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            data = self._fs.cat_file(self._path, start=offset, end=offset + out.nbytes)
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, offset), failure)
        self.stats.add(nbytes=len(data))
        self._check_length(data, offset, out.nbytes)
        out[:] = data

    def _run(self, parts: list[_Part], out: memoryview) -> None:
        if len(parts) < 2 or not getattr(self._fs, "async_impl", False):
            super()._run(parts, out)
            return
        # Async filesystems fetch a batch concurrently on their own event loop.
        n = len(parts)
        self.stats.add(requests=n)
        failure: Exception | None = None
        try:
            blobs = self._fs.cat_ranges(
                [self._path] * n,
                [p.offset for p in parts],
                [p.offset + p.length for p in parts],
                on_error="return",
            )
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, parts[0].offset), failure)
        failed: list[_Part] = []
        for part, blob in zip(parts, blobs, strict=True):
            if isinstance(blob, BaseException) or len(blob) != part.length:
                failed.append(part)
                continue
            self.stats.add(nbytes=len(blob))
            self._deliver(part, blob, out)
        # Anything that failed goes through the one-request path, with its retries and errors.
        for part in failed:
            self._do_part(part, out)

    @staticmethod
    def _deliver(part: _Part, data: bytes, out: memoryview) -> None:
        if part.target is not None:
            part.target[:] = data
            return
        p_stop = part.offset + part.length
        for it in part.items:
            a = max(it.offset, part.offset)
            b = min(it.offset + it.length, p_stop)
            dst = it.pos + (a - it.offset)
            out[dst : dst + (b - a)] = data[a - part.offset : b - part.offset]


# -------------------------------------------------------------------------------------- dispatch


def _check_options(cls: type, options: Mapping[str, Any], kind: str) -> None:
    """Refuse storage options ``cls`` does not take, naming the ones it does (a misspelt
    ``header=`` would otherwise surface as a bare "unexpected keyword argument")."""
    params = inspect.signature(cls).parameters  # the constructor, less self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [n for n, p in params.items() if n not in ("self", "url") and p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"unknown storage option{'s' if len(unknown) > 1 else ''} for {kind} URLs: "
            f"{', '.join(map(repr, unknown))} (expected any of: {', '.join(known)})"
        )


def open_source(
    target: Any, *, storage_options: Mapping[str, Any] | None = None, **options: Any
) -> RemoteSource:
    """Open a remote byte source chosen by the URL scheme.

    ``http(s)://`` uses :class:`HTTPSource`, ``s3://`` :class:`S3Source` (boto3), any other
    ``scheme://`` :class:`FsspecSource`; an ``fsspec.core.OpenFile`` also goes to fsspec.

    Args:
        target: URL or fsspec OpenFile.
        storage_options: Options for the backend, in the fsspec/pandas/xarray idiom; merged
            with ``options`` (``options`` wins).
        **options: Keyword arguments of the chosen class (``headers=``, ``endpoint_url=``,
            ``head_bytes=``...).

    Returns:
        An open source; close it (or use ``with``) when done.

    Raises:
        ValueError: ``target`` is a string without a scheme.
        TypeError: ``target`` is neither a string nor an OpenFile, or an option is unknown.
    """
    merged = {**(storage_options or {}), **options}
    if isinstance(target, str):
        scheme, sep, _ = target.partition("://")
        scheme = scheme.lower()
        if not sep or not scheme:
            raise ValueError(f"not a URL (expected scheme://...): {target!r}")
        if scheme in ("http", "https"):
            _check_options(HTTPSource, merged, "http(s)")
            return HTTPSource(target, **merged)
        if scheme in ("s3", "s3a"):
            _check_options(S3Source, merged, "s3")
            return S3Source(target, **merged)
        return FsspecSource(target, **merged)
    if hasattr(target, "fs") and hasattr(target, "path"):
        return FsspecSource(target, **merged)
    raise TypeError(f"cannot open {type(target).__name__} as a remote source")


def read_prefix(source: Any, n: int) -> bytes:
    """Return the first ``n`` bytes of a source (fewer if it is shorter).

    On a remote source this reuses, or extends with one request, the bytes cached at open,
    so a reader can ask for the length prefix and then the header without extra requests.
    """
    n = max(0, min(n, int(source.size)))
    if isinstance(source, RemoteSource):
        return bytes(source.prefetch_head(n))
    buf = bytearray(n)
    source.readinto(0, memoryview(buf))
    return bytes(buf)
