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

:func:`open_source` picks the backend from the URL scheme. The sources live in modules of
their own: ``_remote_source`` (what they share), ``_remote_http``, ``_remote_s3`` and
``_remote_fsspec``; ``_remote_urls`` shows and joins URLs without their secrets.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from ._errors import RemoteError, RemoteNotFoundError, RemotePermissionError
from ._remote_fsspec import FsspecFolder, FsspecSource
from ._remote_http import HTTPSource
from ._remote_s3 import S3Folder, S3Source
from ._remote_source import (
    DEFAULT_ACCEPT_FULL_BODY,
    DEFAULT_HEAD_BYTES,
    DEFAULT_MAX_GAP,
    DEFAULT_PART_SIZE,
    RemoteSource,
    RemoteStats,
)
from ._remote_urls import shown_location, shown_name, url_dirname, url_join, url_path

__all__ = [
    "DEFAULT_ACCEPT_FULL_BODY",
    "DEFAULT_HEAD_BYTES",
    "DEFAULT_MAX_GAP",
    "DEFAULT_PART_SIZE",
    "FsspecSource",
    "HTTPSource",
    "RemoteError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "RemoteSource",
    "RemoteStats",
    "S3Source",
    "check_option_names",
    "list_folder",
    "open_source",
    "read_prefix",
    "shown_location",
    "shown_name",
    "url_dirname",
    "url_join",
    "url_path",
]


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


def check_option_names(target: str, storage_options: Mapping[str, Any] | None) -> None:
    """Refuse, before anything is sent, options the URL's source does not take (what
    :func:`open_source` would refuse when it gets there: a command opening two URLs of
    different schemes with the same options must not fetch from the first, then refuse).

    Raises:
        TypeError: An option is unknown to the source of ``target``'s scheme.
    """
    scheme = target.partition("://")[0].lower()
    options = dict(storage_options or {})
    if scheme in ("http", "https"):
        _check_options(HTTPSource, options, "http(s)")
    elif scheme in ("s3", "s3a"):
        _check_options(S3Source, options, "s3")
    # fsspec filesystems take any options.


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


def list_folder(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[list[str], set[str]]:
    """The names in the folder URL ``url`` (one ending in ``/``), one level deep, and those of
    them that are files: one ``ListObjectsV2`` for ``s3://`` (per 1,000 names), one ``ls`` for
    an fsspec filesystem. HTTP cannot list a folder.

    Raises:
        ValueError: An ``http(s)`` URL, or not a folder URL.
        TypeError: An option the URL's source does not take.
        RemoteError: The listing failed (:class:`RemoteNotFoundError` for a missing bucket or
            folder, :class:`RemotePermissionError` when refused).
    """
    scheme = url.partition("://")[0].lower()
    options = dict(storage_options or {})
    folder: S3Folder | FsspecFolder
    if scheme in ("http", "https"):
        raise ValueError(f"an http(s) folder cannot be listed: {shown_location(url)}")
    if scheme in ("s3", "s3a"):
        _check_options(S3Source, options, "s3")
        folder = S3Folder(url, **options)
    else:
        folder = FsspecFolder(url, **options)
    with folder:
        return folder.names()


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
