"""Any fsspec filesystem (``gcs://``, ``az://``, ``hf://``, ``memory://``...):
:class:`FsspecSource`."""

from __future__ import annotations

import contextlib
import operator
import os
import posixpath
import re
import threading
import weakref
from typing import Any, Final, NoReturn

from ._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
)
from ._remote_read_ahead import DEFAULT_READ_AHEAD
from ._remote_source import (
    DEFAULT_HEAD_BYTES,
    DEFAULT_MAX_GAP,
    DEFAULT_PART_SIZE,
    RemoteSource,
    Transient,
)
from ._remote_urls import option_secrets, shown_location, url_secrets


def _inferred_compression(target: Any) -> str | None:
    """The compression fsspec's ``compression="infer"`` picks for ``target`` (by its name's
    suffix), or None."""
    try:
        from fsspec.utils import infer_compression
    except ImportError:  # reading it needs fsspec anyway: the open says so
        return None
    path = target if isinstance(target, str) else str(getattr(target, "path", ""))
    inferred: str | None = infer_compression(path)
    return inferred


class FsspecSource(RemoteSource):
    """Random access to a file on any fsspec filesystem (``gcs://``, ``az://``, ``hf://``...).

    Reads go through ``fs.cat_file(path, start, end)``, several parts on up to
    ``max_connections`` worker threads, each copying its part into place as it arrives. That
    holds for asynchronous filesystems too (gcsfs, adlfs, fsspec's HTTP): a worker's
    ``cat_file`` runs on the filesystem's event loop, so the parts still travel concurrently,
    at most ``max_connections`` at once for a read and never all held in memory together (one
    ``cat_ranges`` call returns every part before any is copied, and some filesystems run
    its ranges one by one). Each range counts as one request in ``stats``, as does learning
    the size.

    Only filesystems known to serve concurrent reads correctly get parts at once: the
    asynchronous ones, local files, ``memory://``, ``zip://`` (zipfile locks the archive
    around each read) and ``hf://``. Every other filesystem (``tar://``, ``ftp://``, the
    caching layers...) is read one part at a time, by all the sources on that filesystem
    instance together: parallel reads from ``tar://`` returned other parts' bytes, without an
    error.

    Args:
        target: A URL (``memory://x.safetensors``), an ``fsspec.core.OpenFile``, or a path on
            ``fs``.
        fs: The filesystem ``target`` is a path on.
        max_connections: Parts of one read fetched at once (worker threads); reads from
            several threads each take up to that many.
        part_size: Largest single range when a read is split.
        max_gap: Ranges closer than this are merged by ``readinto_many``.
        head_bytes: Bytes fetched and cached when opening.
        retries: Repeats after a short read.
        backoff: First retry delay in seconds; doubles each time, with jitter, up to 20 s.
        read_ahead: The largest window read ahead for small reads in file order (a
            ``get_tensor`` loop); 0 fetches every read as asked.
        **storage_options: Passed to the filesystem when ``target`` is a URL.

    Raises:
        ImportError: fsspec is not installed.
        ValueError: ``target`` is an ``OpenFile`` that decompresses, or ``compression`` is one
            of the storage options: the source reads the stored bytes by range, which a
            compressed stream cannot serve.
        RemoteNotFoundError: The file does not exist.
        RemoteError: ``target`` names a folder, or the filesystem reports no size for it.
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
        read_ahead: int = DEFAULT_READ_AHEAD,
        **storage_options: Any,
    ) -> None:
        # Options checked before url_to_fs, which may already reach the network; the name is
        # known only after it.
        super().__init__(
            "",
            max_connections=max_connections,
            part_size=part_size,
            max_gap=max_gap,
            head_bytes=head_bytes,
            retries=retries,
            backoff=backoff,
            read_ahead=read_ahead,
        )
        # What fsspec's and its backends' exceptions may quote and must not show: the URL's
        # credentials and query string (fsspec keeps them in the path) and secret options.
        self._secrets = tuple(
            (url_secrets(target, query=True) if isinstance(target, str) else [])
            + option_secrets(storage_options)
        )
        failure: Exception | None = None
        compression = storage_options.get("compression")
        if compression is not None:
            # fsspec.open's keyword, which filesystems ignore: the compressed bytes were read
            # as the file's (a header "too large" by a garbage length prefix). "infer" names
            # none for a name without a compression suffix (``.safetensors``): taken, and
            # dropped (fsspec.open's keyword, not the filesystem's).
            inferred = _inferred_compression(target) if compression == "infer" else compression
            if inferred:
                shown = repr(compression) + (
                    f" ({inferred!r} for this name)" if inferred != compression else ""
                )
                raise ValueError(
                    f"cannot read a file with compression={shown} by range; decompress the"
                    " file first, or open it without compression"
                )
            storage_options = {k: v for k, v in storage_options.items() if k != "compression"}
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
            if getattr(target, "compression", None):
                # Its fs and path name the compressed object: read by range, its bytes would
                # be taken for the file's (a garbage length prefix).
                raise ValueError(
                    f"cannot read an fsspec OpenFile with compression={target.compression!r}"
                    " by range; decompress the file first, or open it without compression"
                )
            fs, path = target.fs, str(target.path)
        else:
            raise TypeError(
                f"FsspecSource needs a URL, an fsspec OpenFile or fs=; got {type(target).__name__}"
            )
        name = target if isinstance(target, str) and "://" in target else fs.unstrip_protocol(path)
        if not isinstance(target, str):
            # An OpenFile's path keeps the query string its URL was opened with.
            self._secrets += tuple(url_secrets(name, query=True))
        self._name = shown_location(name)
        self._fs = fs
        self._path = path
        # Parts of a read run on several threads, which only some filesystems serve right (see
        # _reads_may_overlap); the others' reads go one at a time.
        self._one_at_a_time: threading.Lock | None = (
            None if _reads_may_overlap(fs) else _TURNS.of(fs)
        )
        # Keyword arguments for cat_file: fsspec's default one opens a buffered file with a
        # 5 MiB read-ahead, so every range came with up to 5 MiB more (hf://: a 2 KB header
        # fetched 5 MiB, a whole load 1.6 times the file); without a cache it fetches the range.
        self._cat_options: dict[str, str] = {"cache_type": "none"} if _default_cat_file(fs) else {}
        self._open()

    def _after_fork(self) -> None:
        """The base class's, and a new lock for the filesystem's reads (held across one)."""
        super()._after_fork()
        if self._one_at_a_time is not None:
            self._one_at_a_time = _TURNS.of(self._fs)

    def _turn(self) -> contextlib.AbstractContextManager[object]:
        """The filesystem's turn, where its calls go one at a time (see the class): opens
        too (on FTP, ``info`` lists the folder over the one control connection, which shards
        opened ahead used while another source read)."""
        lock = self._one_at_a_time
        return contextlib.nullcontext() if lock is None else lock

    def _open(self) -> None:
        """Learn the size (one request) and cache the first ``head_bytes``."""
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            # info, not size: the same request, and it says whether the path is a folder
            # (object stores and memory:// give a folder size 0, read as an empty file).
            with self._turn():
                info = self._fs.info(self._path)
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, 0, "asking its size failed"), failure)
        if info.get("type") == "directory":
            raise RemoteError(
                f"{self._name}: is a folder, not a file (a folder URL ends with '/', and is"
                " opened as a sharded checkpoint)",
                kind="IsADirectory",
            )
        size = _byte_count(info.get("size"))
        if size is None:
            # Caching layers (blockcache::, filecache::) give no size in info, yet know it.
            with contextlib.suppress(Exception), self._turn():
                size = _byte_count(self._fs.size(self._path))
        if size is None:
            raise RemoteError(
                f"{self._name}: the filesystem reports no size for it ({info.get('size')!r})",
                kind="NoSize",
            )
        self._size = size
        if self._head_bytes and self._size:
            self.prefetch_head(self._head_bytes)

    def _setup_failed(self, target: str, failure: Exception) -> NoReturn:
        """Raise for a filesystem ``url_to_fs`` could not set up, without secrets."""
        twice = re.search(r"multiple values for keyword argument '(\w+)'", str(failure))
        if isinstance(failure, TypeError) and twice:
            # fsspec merges what the URL says (user:password@host:port) with storage_options
            # by keyword, so an option in both places fails inside dict(); say which.
            raise TypeError(
                f"storage option {twice.group(1)!r} of {shown_location(target)} is given twice:"
                " by the URL and in storage_options; give it once"
            ) from None
        for usage in (ImportError, ValueError, TypeError):
            if isinstance(failure, usage):
                # A backend not installed, an unknown protocol, an option it does not take:
                # the caller's to fix, in fsspec's words.
                if not self._quotes_secret(failure):
                    raise failure
                raise usage(self._clean(failure)) from None
        # A chain's missing archive (zip://m::x.zip), or a backend that connects while it is
        # set up (ftp, sftp) and could not.
        error = self._error(
            failure,
            0,
            "the filesystem could not be set up",
            where=shown_location(target),
            kind="ConnectionError",
        )
        self._raise(error, failure)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem read from."""
        return self._fs

    @property
    def path(self) -> str:
        """The path on :attr:`fs`."""
        return self._path

    def _error(
        self,
        exc: Exception,
        offset: int,
        failed: str = "",
        *,
        where: str | None = None,
        kind: str | None = None,
    ) -> Exception:
        """Translate a filesystem's exception, in words without secrets: a missing file or a
        refusal as such, anything else as a RemoteError of ``kind`` saying what ``failed``
        (default: the read at ``offset``). ``where`` names the file (default: this source).
        ``kind`` defaults to ``Timeout`` or ``ConnectionError`` for a server not reached in
        time or at all (:func:`_network_kind`), else ``HTTPError``."""
        where = self._name if where is None else where
        if isinstance(exc, (RemoteError, Transient)):
            return exc
        text = self._clean(exc)
        if isinstance(exc, FileNotFoundError):
            return RemoteNotFoundError(f"{where}: not found ({text})", kind="NotFound")
        if isinstance(exc, PermissionError):
            return RemotePermissionError(
                f"{where}: access denied ({text})", kind="PermissionDenied"
            )
        failed = failed or f"read at offset {offset} failed"
        kind = kind or _network_kind(exc) or "HTTPError"
        return RemoteError(f"{where}: {failed}: {type(exc).__name__}: {text}", kind=kind)

    def _check_length(self, data: bytes, offset: int, want: int) -> None:
        if len(data) > want:
            # More than asked for: the filesystem ignored the range (a retry would fetch as
            # much again), which the source cannot read from.
            raise RemoteError(
                f"{self._name}: the filesystem returned {len(data)} bytes for a read of {want} "
                f"at offset {offset}: it does not honour ranged reads",
                kind="RangeNotSupported",
                offset=offset,
            )
        if len(data) != want:
            raise Transient(
                f"{self._name}: short read: got {len(data)} of {want} bytes at offset {offset}",
                "Truncated",
            )

    def _fetch_once(self, offset: int, out: memoryview, probing: bool) -> None:
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            with self._turn():
                data = self._cat_file(offset, offset + out.nbytes)
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, offset), failure)
        self.stats.add(nbytes=len(data))
        self._check_length(data, offset, out.nbytes)
        out[:] = data

    def _cat_file(self, start: int, end: int) -> bytes:
        """``fs.cat_file`` of ``[start, end)``, without a read-ahead cache where the filesystem
        would add one (see ``_cat_options``)."""
        options = self._cat_options
        if options:
            try:
                return bytes(self._fs.cat_file(self._path, start=start, end=end, **options))
            except TypeError:
                # A file class taking no cache_type, or a layer setting its own (blockcache::
                # passes cache_type="none" itself): read as the filesystem reads by default.
                self._cat_options = {}
        return bytes(self._fs.cat_file(self._path, start=start, end=end))


#: Exception classes (by name: each client library has its own) of a connection that could not
#: be made or was lost: httpx (hf://), aiohttp (HTTP, gcsfs...), requests and urllib3.
_CONNECTION_FAILURES: Final = frozenset(
    {"ConnectionError", "NetworkError", "ClientConnectionError", "NewConnectionError"}
)


def _network_kind(exc: BaseException) -> str | None:
    """``"Timeout"`` or ``"ConnectionError"`` when ``exc``, or an exception it chains to, says
    the server was not reached in time or at all (as the HTTP and S3 sources name these
    failures); None otherwise. Filesystems raise their client library's classes, not
    Python's: ``httpx.ReadTimeout``, ``aiohttp.ServerTimeoutError``, ``httpx.ConnectError``."""
    pending: list[BaseException] = [exc]
    for _ in range(8):  # a chain, not a cycle
        if not pending:
            break
        e = pending.pop()
        names = {cls.__name__ for cls in type(e).__mro__}
        if isinstance(e, TimeoutError) or any("Timeout" in name for name in names):
            return "Timeout"
        if isinstance(e, ConnectionError) or names & _CONNECTION_FAILURES:
            return "ConnectionError"
        pending.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _default_cat_file(fs: Any) -> bool:
    """Whether ``fs`` reads ranges by fsspec's default ``cat_file``: it opens the file and
    reads through the file's cache (a 5 MiB read-ahead unless told otherwise). Asynchronous
    filesystems mirror their own ``_cat_file`` onto the instance, and s3fs, gcsfs, adlfs,
    HTTP, local files and ``memory://`` read exact ranges their own way."""
    try:
        from fsspec.spec import AbstractFileSystem
    except ImportError:
        return False
    method = getattr(fs, "cat_file", None)
    return getattr(method, "__func__", None) is AbstractFileSystem.cat_file


#: Filesystems (and their subclasses) known to serve ``cat_file`` calls from several threads at
#: once: each call opens a file of its own (local files, zip members: zipfile locks the archive
#: around each seek and read; the Hugging Face Hub's, each ranged read a request of its own
#: through one thread-safe httpx client), reads an immutable buffer (memory), or runs on the
#: filesystem's event loop (every asynchronous one: HTTP, S3, GCS, Azure...).
_OVERLAPPING_READS: Final = frozenset(
    {
        "fsspec.asyn.AsyncFileSystem",
        "fsspec.implementations.local.LocalFileSystem",
        "fsspec.implementations.memory.MemoryFileSystem",
        "fsspec.implementations.zip.ZipFileSystem",
        "huggingface_hub.hf_file_system.HfFileSystem",
    }
)
#: Asynchronous filesystems that read through another filesystem (named by the attribute),
#: whose reads are as safe as that one's.
_WRAPPED: Final = {
    "fsspec.implementations.asyn_wrapper.AsyncFileSystemWrapper": "sync_fs",
    "fsspec.implementations.dirfs.DirFileSystem": "fs",
}
#: Asynchronous filesystems whose reads are not safe to overlap: kerchunk's references read
#: from any filesystem, through lazily loaded caches.
_ONE_AT_A_TIME: Final = frozenset({"fsspec.implementations.reference.ReferenceFileSystem"})


def _reads_may_overlap(fs: Any) -> bool:
    """Whether ``fs`` is known to serve several ``cat_file`` calls at once correctly.

    Only those of :data:`_OVERLAPPING_READS` are (after unwrapping :data:`_WRAPPED`): the
    others' reads go one at a time. Up to 8 parts at once served wrong bytes from fsspec's tar
    filesystem (one file object for every member, seek then read, no lock), its caching layers
    (blockcache::), and its FTP filesystem (one control connection), with no error.
    """
    for _ in range(8):  # wrappers of wrappers, not for ever
        names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(fs).__mro__}
        wrapped = next((_WRAPPED[n] for n in names if n in _WRAPPED), None)
        if wrapped is None:
            return not names & _ONE_AT_A_TIME and bool(names & _OVERLAPPING_READS)
        fs = getattr(fs, wrapped, None)
    return False


class _Turns:
    """One lock per filesystem instance whose reads go one at a time, shared by every source
    on it: fsspec hands the sources of one server the same instance (``ftp://host/a`` and
    ``ftp://host/b`` share one FTP connection), which a lock per source let two of them use
    at once."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._guard = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    def of(self, fs: Any) -> threading.Lock:
        """The lock of ``fs``'s reads (a new one in a forked child: a parent's thread may have
        held the old one at the fork)."""
        if os.getpid() != self._pid:
            self._reset()
        key = id(fs)
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
                # Forgotten with the filesystem, before its id can be another's. One that
                # cannot be referenced weakly keeps its entry (a lock's worth).
                with contextlib.suppress(TypeError):
                    weakref.finalize(fs, self._locks.pop, key, None)
            return lock


_TURNS: Final = _Turns()
if hasattr(os, "register_at_fork"):
    # At the fork, not at the child's first use: two of its threads asking at once could
    # each reset the table and get a lock of its own for one filesystem.
    os.register_at_fork(after_in_child=_TURNS._reset)


def _byte_count(value: object) -> int | None:
    """A size as a filesystem's ``info`` gives it (an int, a numpy integer, a whole float), or
    None for anything else (None, a negative number, a bool, text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() and value >= 0 else None
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return count if count >= 0 else None


class FsspecFolder(FsspecSource):
    """A folder on an fsspec filesystem, listed one level deep (:meth:`names`): with the
    filesystem, options and errors of :class:`FsspecSource`, and nothing opened."""

    def _open(self) -> None:
        """Nothing to open: a folder is listed."""

    def names(self) -> tuple[list[str], set[str]]:
        """Every name in the folder, one level deep, and those of them that are files: one
        ``fs.ls``.

        Raises:
            RemoteNotFoundError: The folder does not exist.
            RemotePermissionError: Listing is refused.
            RemoteError: Anything else the filesystem reports.
        """
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            entries = list(self._fs.ls(self._path, detail=True))
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._raise(self._error(failure, 0, "listing the folder failed"), failure)
        own = self._path.rstrip("/")
        names: list[str] = []
        files: set[str] = set()
        for entry in entries:
            full = str(entry.get("name", "") if isinstance(entry, dict) else entry).rstrip("/")
            name = posixpath.basename(full)
            if not name or full == own:  # some filesystems list the folder itself
                continue
            names.append(name)
            if isinstance(entry, dict) and entry.get("type") == "file":
                files.add(name)
        return names, files
