"""The machinery every remote source shares: options, counters, the head cache, splitting
and coalescing reads into parts, and the process-wide pool of worker threads."""

from __future__ import annotations

import collections
import math
import numbers
import operator
import os
import random
import re
import reprlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, NoReturn, SupportsIndex, TypeVar

from ._errors import (
    ClosedFileError,
    RemoteError,
)
from ._interrupts import interrupts_deferred
from ._reader_pool import wait_all
from ._remote_read_ahead import DEFAULT_READ_AHEAD, ReadAhead, may_wait_here
from ._remote_urls import quotes_secret, scrubbed
from ._sources import check_range

#: Bytes fetched when a source opens. The hub reads 100 kB for the same purpose and reports that
#: about 97% of headers of popular models fit; 64 KiB keeps small files to one request while
#: wasting little on a large one.
DEFAULT_HEAD_BYTES: Final = 64 << 10
#: Size of one ranged request when a large read is split. 8 MiB is what object-store loaders
#: (Run:ai streamer, s3transfer) settle on: large enough to amortise latency, small enough to
#: spread over connections.
DEFAULT_PART_SIZE: Final = 8 << 20
#: The smallest part of a read spread over the connections (``readinto_spread``): below it
#: a request's round trip outweighs what another connection adds.
MIN_SPREAD_PART: Final = 1 << 20
#: Ranges closer than this are fetched as one request; the gap bytes are downloaded and dropped.
DEFAULT_MAX_GAP: Final = 1 << 20
#: A server that ignores ``Range`` is tolerated only for files up to this size.
DEFAULT_ACCEPT_FULL_BODY: Final = 1 << 20

#: Longest ``Retry-After`` honoured; beyond it the backoff schedule applies.
_MAX_RETRY_AFTER: Final = 10.0
#: Longest delay before a retry, as botocore's standard retry mode caps it: doubled without a
#: bound, the backoff slept for minutes (0.5 s doubled 11 times, with jitter: up to 25 minutes).
MAX_BACKOFF: Final = 20.0

#: A byte position or count in a header: 20 digits at most (more than any file has), after any
#: leading zeros. Unbounded, a value of over 4300 digits made int() raise a bare ValueError.
HEADER_NUMBER: Final = r"0*(\d{1,20})"
_CONTENT_RANGE: Final = re.compile(
    rf"[ \t]*bytes[ \t]+(?:{HEADER_NUMBER}[ \t]*-[ \t]*{HEADER_NUMBER}|\*)"
    rf"[ \t]*/[ \t]*(?:{HEADER_NUMBER}|\*)[ \t]*",
    re.ASCII | re.IGNORECASE,
)
_HEADER_REPR: Final = reprlib.Repr()
_HEADER_REPR.maxstring = 100


def shown_header(value: str) -> str:
    """A header's value as messages quote it: its repr, shortened to 100 characters (a hostile
    server's may be megabytes long)."""
    return _HEADER_REPR.repr(value)


def parse_content_range(value: str | None, where: str) -> tuple[int | None, int | None, int | None]:
    """Parse a ``Content-Range`` value; parts it does not give (or no header) are None.

    Raises:
        RemoteError: The header is present but malformed (kind ``InvalidResponse``).
    """
    if value is None:
        return None, None, None
    match = _CONTENT_RANGE.fullmatch(value)
    if match is None:
        raise RemoteError(
            f"{where}: malformed Content-Range {shown_header(value)} (expected "
            "'bytes first-last/total')",
            kind="InvalidResponse",
        )
    first, last, total = match.groups()
    return (
        None if first is None else int(first),
        None if last is None else int(last),
        None if total is None else int(total),
    )


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


class Transient(Exception):
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
    out: memoryview


@dataclass
class RangePart:
    """One request. ``direct`` parts land in ``target``; others are scattered to ``items``."""

    offset: int
    length: int
    target: memoryview | None
    items: list[_Item]


def _as_bytes(out: memoryview) -> memoryview:
    return out if out.format == "B" and out.ndim == 1 else out.cast("B")


def shown_value(value: object) -> str:
    """An option's value as error messages quote it: its repr, shortened, and its type."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def int_option(name: str, value: object, minimum: int) -> int:
    """Check an integer option (numpy integers are fine, bool and float are not).

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: It is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{name} must be an integer, got {shown_value(value)}")
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def _seconds(name: str, value: object) -> float:
    """A number of seconds (numpy's numbers too), not yet range-checked.

    Raises:
        TypeError: ``value`` is not a number.
    """
    # numbers.Real: numpy's floats and ints too (np.float32 is no float subclass).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {shown_value(value)}")
    return float(value)


def seconds_option(name: str, value: object) -> float | None:
    """Check a time limit (a timeout, a deadline): above 0; None or infinity mean no limit
    and give None.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: It is not above 0, or NaN.
    """
    if value is None:
        return None
    seconds = _seconds(name, value)
    if not seconds > 0:  # NaN too
        raise ValueError(
            f"{name} must be a positive number of seconds (or None for no limit), got {value!r}"
        )
    return None if math.isinf(seconds) else seconds


def _delay_option(name: str, value: object) -> float:
    """Check a delay: finite and >= 0.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: It is negative, infinite or NaN.
    """
    seconds = _seconds(name, value)
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def optional_str(name: str, value: object) -> None:
    """Refuse an option ``name`` that is neither a string nor None, with a TypeError."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string or None, got {shown_value(value)}")


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
        """An exception's text without the credentials and secrets it may quote.

        The exact secrets go first: scrubbing ``user:password@`` first could leave a password
        that holds an '@' in part, which no longer matched it whole.
        """
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret + "@", "").replace(secret, "...")
        return scrubbed(text)

    def _quotes_secret(self, exc: BaseException) -> bool:
        return quotes_secret(exc, self._secrets)

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
        read_ahead: int = DEFAULT_READ_AHEAD,
    ) -> None:
        # Checked and converted before anything is sent (subclasses call this before any
        # request): a bad option must not surface later as a failed request.
        self._name = name
        self._max_connections = int_option("max_connections", max_connections, 1)
        self._part_size = int_option("part_size", part_size, 1)
        self._max_gap = int_option("max_gap", max_gap, 0)
        self._head_bytes = int_option("head_bytes", head_bytes, 0)
        self._retries = int_option("retries", retries, 0)
        self._backoff = _delay_option("backoff", backoff)
        self._accept_full_body = int_option("accept_full_body", accept_full_body, 0)
        self._read_ahead = int_option("read_ahead", read_ahead, 0)
        # Made once the size is known (see readinto); None: not yet, or read_ahead=0.
        self._ahead: ReadAhead | None = None
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
        _LIVE.add(self)
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

    @property
    def max_gap(self) -> int:
        """Ranges closer than this are fetched in one request (the ``max_gap`` option)."""
        return self._max_gap

    def view(self, offset: int, length: int) -> memoryview | None:
        """Return None: remote bytes cannot be mapped."""
        return None

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``.

        Bytes cached at open are copied without a request; a range larger than ``part_size``
        is fetched as parallel parts straight into ``out``. Smaller reads that follow one
        another in the file are served from a window read ahead (see ``_remote_read_ahead``;
        the ``read_ahead`` option, 0 to turn it off).

        Raises:
            SafetensorError: The range lies outside the object.
            RemoteError: The store failed after retries, or sent something other than the range.
        """
        out = _as_bytes(out)
        self._check_open()
        check_range(self, offset, out.nbytes)
        n = out.nbytes
        head = self._head  # once: prefetch_head() may replace it meanwhile
        if 0 < n < self._part_size and self._read_ahead and offset + n > len(head):
            cached = max(0, len(head) - offset)
            if cached:
                # Bytes cached at open cost no request: counted in the read-ahead's run, the
                # header's made the first windows twice as large as the loop's reads.
                out[:cached] = head[offset:]
                offset, out, n = offset + cached, out[cached:], n - cached
            # Small reads in order (a get_tensor loop) are served from a window read ahead.
            ahead = self._ahead
            if ahead is None:
                with self._head_lock:
                    if self._ahead is None:
                        self._ahead = ReadAhead(
                            self._read_ahead,
                            self._size,
                            self.readinto_spread,
                        )
                    ahead = self._ahead
            if ahead.read(offset, out):
                return
        self.readinto_many([(offset, n)], out)

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
            check_range(self, offset, length)
            if length:
                items.append(_Item(offset, pos, length, out))
            pos += length
        if pos != out.nbytes:
            raise ValueError(f"ranges cover {pos} bytes but the buffer holds {out.nbytes}")
        self._read_items(items, max_gap)

    def readinto_spread(self, offset: int, out: memoryview) -> None:
        """Read one range whose bytes are all needed before the caller goes on (a read-ahead
        window, a planned block) in parts spread over the connections: at least
        :data:`MIN_SPREAD_PART` each, at most ``part_size``. Cut into ``part_size`` parts, a
        16 MiB window was two requests on two connections while six stood idle.

        Raises:
            SafetensorError: The range lies outside the object.
            RemoteError: The store failed.
        """
        out = _as_bytes(out)
        self._check_open()
        check_range(self, offset, out.nbytes)
        if not out.nbytes:
            return
        part = min(
            self._part_size,
            max(MIN_SPREAD_PART, -(-out.nbytes // self._max_connections)),
        )
        items = self._serve_from_head([_Item(offset, 0, out.nbytes, out)])
        if items:
            self._run(self._plan(items, self._max_gap, part))

    def readinto_scattered(
        self, pieces: Sequence[tuple[int, int, memoryview, int]], *, max_gap: int | None = None
    ) -> None:
        """Read each ``(offset, length, out, pos)`` piece: ``length`` bytes at ``offset`` into
        ``out[pos:pos + length]``.

        One plan for all pieces, as :meth:`readinto_many` makes for its ranges, whatever
        buffers they go to: a load whose parts go to several buffers (the parts themselves;
        whole small tensors to gather parts from) fetched each group of ranges on its own,
        and a request merged across a gap fetched again the bytes another group's requests
        fetched too (a 6 MB file's column split fetched 10.3 MB). Pieces that touch in the
        file and follow each other in the same ``out`` object are received in place.

        Raises:
            ValueError: A piece does not fit its buffer.
            SafetensorError: A piece lies outside the object.
            RemoteError: The store failed.
        """
        self._check_open()
        items: list[_Item] = []
        for offset, length, piece_out, pos in pieces:
            if piece_out.readonly or not piece_out.c_contiguous:
                # Refused before any request, not by the socket's readinto mid-read.
                raise ValueError("each piece's buffer must be writable and contiguous")
            out = _as_bytes(piece_out)  # the same object for a 1-D byte buffer
            check_range(self, offset, length)
            if not 0 <= pos <= pos + length <= out.nbytes:
                raise ValueError(f"{length} bytes at {pos} do not fit a buffer of {out.nbytes}")
            if length:
                items.append(_Item(offset, pos, length, out))
        self._read_items(items, max_gap)

    def _read_items(self, items: list[_Item], max_gap: int | None) -> None:
        items = self._serve_from_head(items)
        if items:
            self._run(self._plan(items, self._max_gap if max_gap is None else max_gap))

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
                self._run(self._plan([_Item(len(head), 0, len(extra), view)], self._max_gap))
                head = self._head = head + bytes(extra)
        return memoryview(head)[:nbytes]

    def close(self) -> None:
        """Wait for parallel reads in flight, then release the source's resources. Idempotent."""
        self._closed = True
        if self._ahead is not None:
            self._ahead.close()
        # A forked child has none of the parent's reads in flight; see may_wait_here for where
        # a close() must not wait for its own reads.
        if os.getpid() == self._pid and may_wait_here():
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
            Transient: The failure may go away on retry.
            RemoteError: It will not.
        """
        raise NotImplementedError

    def _release(self) -> None:
        """Release backend resources (connections, clients)."""

    def _after_fork(self) -> None:
        """In a forked child: new locks for those a parent's thread may have held at the fork
        (subclasses add theirs)."""
        self._head_lock = threading.Lock()
        self._runs = threading.Condition()
        self._running = 0  # the parent's reads in flight are not here
        self.stats._lock = threading.Lock()

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
            except Transient as exc:
                if attempt >= self._retries or self._closed:
                    raise RemoteError(
                        f"{exc} (gave up on {self._name} after {attempt + 1} attempts)",
                        kind=exc.kind,
                        offset=offset,
                    ) from exc
                delay = self._retry_delay(attempt, exc.retry_after)
                attempt += 1
                self.stats.add(retries=1)
                time.sleep(delay)

    def _retry_delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt + 1``: ``backoff`` doubled each time,
        with jitter (x0.5 to x1.5), at most :data:`MAX_BACKOFF`; at least a ``Retry-After``
        the server sent, up to :data:`_MAX_RETRY_AFTER`."""
        # A bounded exponent: 2.0**1024 overflows a float.
        delay = self._backoff * 2.0 ** min(attempt, 64) * (0.5 + random.random())
        delay = min(delay, MAX_BACKOFF)
        if retry_after is not None:
            delay = max(delay, min(retry_after, _MAX_RETRY_AFTER))
        return delay

    def _cached_whole(self, body: bytes, size: int) -> None:
        """Keep a whole small object in memory after a server ignored ``Range``."""
        self._size = size
        self._head = body

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedFileError(f"{self._name} is closed", kind="ClosedFile")

    # ------------------------------------------------------------------ planning

    def _serve_from_head(self, items: list[_Item]) -> list[_Item]:
        head = self._head
        cached = len(head)
        if not cached:
            return items
        rest: list[_Item] = []
        for it in items:
            if it.offset < cached:
                k = min(cached - it.offset, it.length)
                it.out[it.pos : it.pos + k] = head[it.offset : it.offset + k]
                if k < it.length:
                    rest.append(_Item(it.offset + k, it.pos + k, it.length - k, it.out))
            else:
                rest.append(it)
        return rest

    def _plan(
        self, items: list[_Item], max_gap: int, part_size: int | None = None
    ) -> list[RangePart]:
        """Group ranges closer than ``max_gap``, then cut each group into balanced parts of
        at most ``part_size`` (the source's by default)."""
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
        parts: list[RangePart] = []
        for group in groups:
            parts.extend(self._cut(group, part_size or self._part_size))
        return parts

    def _cut(self, group: list[_Item], part_size: int) -> list[RangePart]:
        start = group[0].offset
        stop = max(it.offset + it.length for it in group)
        hull = stop - start
        # Balanced sizes: 8 MiB + 1 byte becomes two halves, not 8 MiB and a 1-byte request.
        count = -(-hull // part_size)
        step = -(-hull // count)
        buckets: list[list[_Item]] = [[] for _ in range(count)]
        for it in group:
            first = (it.offset - start) // step
            last = (it.offset + it.length - 1 - start) // step
            for k in range(first, last + 1):
                buckets[k].append(it)
        parts: list[RangePart] = []
        for k, bucket in enumerate(buckets):
            if not bucket:
                continue  # a part that falls wholly inside a gap
            p_start = start + k * step
            p_stop = min(start + (k + 1) * step, stop)
            # Trim to the bytes wanted, so no part begins or ends inside a gap.
            p_start = max(p_start, min(it.offset for it in bucket))
            p_stop = min(p_stop, max(it.offset + it.length for it in bucket))
            parts.append(self._part(p_start, p_stop, bucket))
        return parts

    @staticmethod
    def _part(p_start: int, p_stop: int, bucket: list[_Item]) -> RangePart:
        # Direct when every item maps file bytes to one buffer with one shift and they tile
        # the part without gaps: the usual case of adjacent tensors read in file order.
        out = bucket[0].out
        delta = bucket[0].pos - bucket[0].offset
        covered = p_start
        direct = True
        for it in bucket:  # sorted by offset
            if it.out is not out or it.pos - it.offset != delta or it.offset > covered:
                direct = False
                break
            covered = max(covered, it.offset + it.length)
        if direct and covered >= p_stop:
            target = out[p_start + delta : p_stop + delta]
            return RangePart(p_start, p_stop - p_start, target, [])
        return RangePart(p_start, p_stop - p_start, None, bucket)

    def _do_part(self, part: RangePart) -> None:
        if part.target is not None:
            self._fetch(part.offset, part.target)
            return
        scratch = bytearray(part.length)
        self._fetch(part.offset, memoryview(scratch))
        self._scatter(part, scratch)

    @staticmethod
    def _scatter(part: RangePart, data: bytes | bytearray) -> None:
        """Copy a fetched part's bytes to the pieces of its items."""
        p_stop = part.offset + part.length
        view = memoryview(data)  # slices of it copy nothing
        for it in part.items:
            a = max(it.offset, part.offset)
            b = min(it.offset + it.length, p_stop)
            dst = it.pos + (a - it.offset)
            it.out[dst : dst + (b - a)] = view[a - part.offset : b - part.offset]

    def _run(self, parts: list[RangePart]) -> None:
        if not parts:
            return
        if len(parts) == 1:
            self._do_part(parts[0])
            return
        with self._runs:
            self._running += 1
        try:
            _WORKERS.run(self._do_part, parts, self._max_connections)
        finally:
            with self._runs:
                self._running -= 1
                self._runs.notify_all()


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

    def run(self, do: Callable[[RangePart], None], parts: list[RangePart], width: int) -> None:
        """``do(part)`` for every part on at most ``width`` workers; re-raise the first failure
        once every worker has stopped (none writes into the caller's buffer after that)."""
        if getattr(self._local, "worker", False):
            for part in parts:
                do(part)
            return
        pending = collections.deque(parts)
        lock = threading.Lock()
        failures: list[BaseException] = []
        stopped = threading.Event()  # an interrupt: the workers stop after their part

        def worker() -> None:
            self._local.worker = True
            try:
                while True:
                    with lock:
                        if failures or not pending or stopped.is_set():
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

        count = min(width, len(parts))
        if threading.current_thread().daemon:
            # A daemon thread's read (a window fetched ahead) is not waited for at exit: nor
            # are its parts, on daemon threads of their own (the pool's are joined at exit).
            threads = [
                threading.Thread(target=worker, name="pysafetensors-remote-daemon", daemon=True)
                for _ in range(count)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            futures: list[Future[None]] = []
            try:
                # A Ctrl-C held until all are submitted (see _reader_pool._submit): raised
                # inside submit, it could leave the shared pool's semaphore locked for good.
                with interrupts_deferred():
                    pool = self._executor()
                    for _ in range(count):
                        futures.append(pool.submit(worker))
            except RuntimeError:
                # The interpreter is shutting down (a thread still reading after the main
                # thread returned): the pool takes no more work, so this thread reads the rest.
                worker()
            except BaseException as exc:
                # A Ctrl-C: raised once every worker has stopped, so that none then writes
                # into the caller's buffer (as run_parallel's are waited for); another one
                # while waiting is raised at once (a stalled read).
                stopped.set()
                wait_all(futures, stopped, exc)
                raise
            # Workers hand their own failures over (in ``failures``): this is an interrupt
            # that came while waiting, or None.
            interrupted = wait_all(futures, stopped)
            if interrupted is not None:
                try:
                    raise interrupted
                finally:
                    del interrupted
        if failures:
            # Out of the list this frame holds (see run_parallel): no exception-frame cycle.
            error = failures[0]
            failures.clear()
            try:
                raise error
            finally:
                del error


_WORKERS: Final = _Workers()

#: The sources of this process, whose locks a forked child renews: a parent's thread may have
#: held one at the fork (``prefetch_head`` holds the head's across a request), and the child's
#: next read would wait for it for ever.
_LIVE: Final[weakref.WeakSet[RemoteSource]] = weakref.WeakSet()


def _renew_locks() -> None:
    for source in list(_LIVE):
        source._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKERS._reset)  # the parent's threads are not here
    os.register_at_fork(after_in_child=_renew_locks)
