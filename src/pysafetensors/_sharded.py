"""Open a sharded checkpoint (an index JSON or a model folder) as if it were one file.

``safe_open`` hands a folder or a ``*.index.json`` path to :class:`ShardedSafeOpen`. Opening
reads the index only (and checks that every shard it names exists); a shard's header is read
the first time one of its tensors, or the file order of all tensors, is asked for, and its
tensors' bytes only when they are asked for.

A tensor is read from the shard the index places it in, and must be there; a shard's other
tensors read as they are whatever the index says of the rest of it (an index entry left from
an earlier save, a tensor the index does not list or places elsewhere): the hub holds such
checkpoints, and transformers loads them. :meth:`ShardedSafeOpen.validate` reads every header
and checks the whole checkpoint: each tensor the index places in a shard is there, each tensor
there is placed there by the index, none is in two shards, and ``total_size`` matches the bytes
of tensor data.

Folder resolution, in order: ``model.safetensors.index.json``; ``model.safetensors``; a single
``*.safetensors.index.json`` (e.g. diffusers' ``diffusion_pytorch_model.safetensors.index.json``);
a single ``*.safetensors``; otherwise an error that lists what the folder holds. A folder URL
(``s3://bucket/ckpt/``, one whose path ends with ``/``) is listed and follows the same rule; an
``http(s)`` one, which cannot be listed, is tried for the first two names.
"""

from __future__ import annotations

import contextlib
import errno
import json
import operator
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import (
    Callable,
    Collection,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Final, NamedTuple, TypeVar

from ._adapter import get_adapter
from ._errors import (
    ClosedFileError,
    HeaderError,
    RemoteNotFoundError,
    SafetensorError,
    first_five,
    looks_like_url,
    tensor_not_found,
)
from ._file_pool import MIN_OPEN, descriptor_budget, file_identity
from ._format import MAX_HEADER_SIZE, TensorInfo, check_max_header_size
from ._interrupts import ClosedWhenDropped
from ._ordered_opens import ahead_for, in_order
from ._read_targets import check_targets, device_bytes, writable_bytes
from ._reader import (
    HandleBehaviour,
    SafeSlice,
    TensorMeta,
    check_backend,
    check_slice_reads,
    check_tensor_name,
    check_threads,
    open_source_for,
    safe_open,
)
from ._remote_urls import (
    check_index_options,
    is_folder_url,
    shown_location,
    shown_name,
    url_dirname,
    url_in_folder,
    url_join,
    url_path,
)
from ._sharding import (
    SHARD_SUFFIX,
    declared_total_size,
    normal_shard_name,
    unsafe_shard_name,
)
from ._sources import ByteSource, starts_like_safetensors
from ._writer import partial_stem, partial_target

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "MissingShardError",
    "Resolved",
    "ShardIndexError",
    "ShardedSafeOpen",
    "resolve_checkpoint",
    "shown",
]

#: What ``ShardedSafeOpen._per_shard`` groups: a tensor name, or a request naming one.
_Item = TypeVar("_Item")

INDEX_NAME: Final = "model.safetensors.index.json"
SINGLE_NAME: Final = "model.safetensors"
#: An index is metadata; refuse absurd sizes before parsing (the hub's cap is 10 MiB; ours is
#: the header cap, since an index lists as many names as a header).
MAX_INDEX_SIZE: Final = MAX_HEADER_SIZE


class ShardIndexError(SafetensorError, ValueError):
    """Raised when an index is malformed or disagrees with its shards, a folder is ambiguous,
    or the checkpoint was saved again while open.

    ``kind`` says which: ``InvalidIndex``, ``UnsafeShardName``, ``TensorNotInShard``,
    ``TensorInTwoShards``, ``UnindexedTensor``, ``TotalSizeMismatch``, ``AmbiguousFolder``,
    ``CheckpointChanged``.
    """


class MissingShardError(SafetensorError, FileNotFoundError):
    """Raised when a shard named by an index, or any checkpoint in a folder, does not exist,
    or a folder holds shards without their index (kind ``MissingIndex``)."""


def shown(path: str) -> str:
    """A path or URL for an error message: a URL without its credentials and query string
    (user:password, a signed URL's signature)."""
    return repr(shown_location(path))


def _join(base: str, name: str) -> str:
    return url_join(base, name) if looks_like_url(base) else os.path.join(base, name)


def is_index_path(path: str) -> bool:
    """Whether ``path`` names an index; for a URL, its path part does (``?download=true``).

    A local file so named that holds tensors is no index (the reference opens it as a file).
    """
    if looks_like_url(path):
        return url_path(path).endswith(".index.json")
    return path.endswith(".index.json") and not starts_like_safetensors(path)


#: A shard's file name as the hub's pattern makes them: ``<stem>-00002-of-00005.safetensors``.
_SHARD_NAME: Final = re.compile(r".*" + SHARD_SUFFIX + r"\.safetensors")


class Resolved(NamedTuple):
    """What :func:`resolve_checkpoint` found."""

    #: The index or file to open.
    path: str
    #: Whether ``path`` is an index.
    is_index: bool
    #: ``path`` already opened while it was looked for (an index found in an ``http(s)``
    #: folder URL: that request is the one opening it makes), for the caller to read and
    #: close; None when nothing was opened.
    source: ByteSource | None = None


def resolve_checkpoint(path: str, storage_options: dict[str, Any] | None = None) -> Resolved:
    """Find the file to open for a folder, index or file path, or a URL.

    A local folder and a folder URL (one whose path ends with ``/``) that can be listed (S3,
    fsspec filesystems: one listing, one level deep) follow the same rule (:func:`_choose`);
    an ``http(s)`` folder URL, which cannot be listed, is tried for
    ``model.safetensors.index.json``, then ``model.safetensors``, keeping its query string
    for those requests. ``storage_options`` are the remote source's, for a URL. Options that
    cannot go to every shard of an index or folder URL are refused before any request.

    Raises:
        MissingShardError: The folder holds no checkpoint, or only shards of one.
        ShardIndexError: The folder holds several candidates and no rule picks one.
        RemoteNotFoundError: An ``http(s)`` folder URL has neither name.
        RemoteError: A folder URL could not be listed or probed (anything but a missing
            file, as it is raised).
        ValueError: ``storage_options`` that cannot go to every shard (S3's ``version_id``
            for an index or folder URL).
    """
    if looks_like_url(path):
        folder = is_folder_url(path)
        if folder or is_index_path(path):
            check_index_options(path, storage_options)
        if folder:
            return _resolve_folder_url(path, storage_options)
        return Resolved(path, is_index_path(path))
    if not os.path.isdir(path):
        return Resolved(path, is_index_path(path))
    name, is_index = _choose(
        path, lambda n: os.path.isfile(os.path.join(path, n)), lambda: os.listdir(path), path
    )
    return Resolved(os.path.join(path, name), is_index)


def _resolve_folder_url(url: str, storage_options: dict[str, Any] | None) -> Resolved:
    from ._remote import list_folder, open_source

    if url.partition("://")[0].lower() not in ("http", "https"):
        names, files = list_folder(url, storage_options)
        name, is_index = _choose(url, files.__contains__, lambda: names)
        return Resolved(url_in_folder(url, name), is_index)
    # HTTP lists nothing: the names a folder's checkpoint has by convention, the index first
    # (as the rule prefers it). A found index stays open for the caller, who would open it
    # next; a single file is only probed (a byte), since its handle opens it again.
    for name, is_index, head in ((INDEX_NAME, True, {}), (SINGLE_NAME, False, {"head_bytes": 0})):
        candidate = url_in_folder(url, name)
        try:
            source = open_source(candidate, storage_options=storage_options, **head)
        except RemoteNotFoundError:
            continue  # only a missing file moves on: a refusal or an outage is raised as is
        if is_index:
            return Resolved(candidate, True, source)
        source.close()
        return Resolved(candidate, False)
    raise RemoteNotFoundError(
        f"no safetensors checkpoint at the folder URL {shown(url)}: neither {INDEX_NAME} nor "
        f"{SINGLE_NAME} is there (a folder over HTTP cannot be listed: give the URL of its "
        "index or file)",
        kind="NotFound",
    )


def _unfinished_commit(names: list[str], folder: str | None = None) -> str:
    """Why a folder of shards has no index, from the names it holds (sorted).

    A save killed while it renamed its files into place (a few milliseconds; a reshard into
    the source's own folder included) leaves its index, and the shards it had not renamed yet,
    in temporary files: they may hold the only copy of some tensors, and the next save to
    those names deletes them once they are a minute old. Such a save is finished by hand, so
    the message says which file to rename to what.

    ``folder``: the local folder holding ``names``. Its newest temporary index is the stopped
    save's, and is read for the names of its shards: a name too long to fit in a temporary
    file's name is cut there (:func:`partial_stem`), and only the index tells what it stands
    for. Temporary files older than an earlier temporary index are an earlier stopped save's.
    ``None`` (a URL): from the names alone.
    """
    stems = {n: stem for n in names if (stem := partial_target(n)) is not None}
    modified = _modified_times(folder, stems)
    indexes: dict[str, set[str] | None] = {}  # temporary index -> its shards' names
    for temp, stem in stems.items():
        named = stem.endswith(_INDEX_END)
        if named or (folder is not None and _CUT_STEM.fullmatch(stem)):
            shards = _shard_names(folder, temp)
            if named or shards is not None:
                indexes[temp] = shards
    if not indexes:
        return "the checkpoint is incomplete (a save or download that did not finish?)"
    newest, *earlier = sorted(indexes, key=lambda n: modified.get(n, 0.0), reverse=True)
    # The stopped save wrote its shards after an earlier stopped save wrote its index.
    since = max((modified.get(n, 0.0) for n in earlier), default=float("-inf"))
    shard_names = indexes[newest]
    if shard_names is None:  # the names say it all, unless cut
        by_stem = {s: s for s in stems.values() if s.endswith(".safetensors")}
        index_name = stems[newest]
    else:
        by_stem = {partial_stem(name): name for name in shard_names}
        index_name = _index_name(stems[newest], shard_names)
    targets: dict[str, str] = {}  # target -> its newest temporary file
    for temp in sorted(stems, key=lambda n: modified.get(n, 0.0)):
        if stems[temp] in by_stem and modified.get(temp, 0.0) > since:
            targets[by_stem[stems[temp]]] = temp
    renames = [(newest, index_name)] + [(targets[t], t) for t in sorted(targets)]
    # Names cut to fit are each listed (the rule below does not give them); then a few more.
    cut = [r for r in renames if stems[r[0]] != r[1]]
    plain = [r for r in renames if stems[r[0]] == r[1]]
    listed = "; ".join(f"{temp} to {target}" for temp, target in cut + plain[:5])
    message = (
        "a save was stopped while it renamed its files into place. Its index and the shards it "
        "had not renamed yet wait in temporary files, which may hold the only copy of some "
        f"tensors: to finish that save, rename {listed}"
    )
    if len(plain) > 5:
        message += (
            f"; and {len(plain) - 5} more, each to its name without the leading '.' and the "
            "'.<12 hex digits>.partial' ending"
        )
    if time.time() - modified.get(newest, 0.0) < 60:
        # A save still running holds such files too, for the few milliseconds of its renames
        # (or, before its first rename, for as long as it writes): it finishes them itself.
        message += " (unless that save is still running: then wait for it)"
    others = sorted(set(stems) - {temp for temp, _ in renames})
    if others:
        # Files of earlier stopped saves, or of saves to other names: not this save's.
        message += (
            f" (the other {len(others)} temporary file(s) there, {first_five(others)}, are not "
            "that save's)"
        )
    return message


#: How an index's name ends (the shard names' pattern, then this).
_INDEX_END: Final = ".safetensors.index.json"
#: A temporary file's stem for a name too long to keep whole (see :func:`partial_stem`).
_CUT_STEM: Final = re.compile(r".*~[0-9a-f]{16}", re.DOTALL)


def _index_name(stem: str, shard_names: Iterable[str]) -> str:
    """The name of the index whose temporary file's stem is ``stem``: the stem itself, or
    for a cut one, the index name the shards' pattern gives (``X-00001-of-00002.safetensors``:
    ``X.safetensors.index.json``) that the stem stands for."""
    for shard in shard_names:
        name = re.sub(SHARD_SUFFIX + r"\.safetensors\Z", "", shard) + _INDEX_END
        if partial_stem(name) == stem:
            return name
    return stem if stem.endswith(_INDEX_END) else f"its index's name (cut to {stem} here)"


def _modified_times(folder: str | None, names: Iterable[str]) -> dict[str, float]:
    """The modification times of the files ``names`` in the local ``folder`` (those that
    can be read; none for a URL)."""
    times: dict[str, float] = {}
    if folder is not None:
        for name in names:
            with contextlib.suppress(OSError):
                times[name] = os.stat(os.path.join(folder, name)).st_mtime
    return times


def _shard_names(folder: str | None, temp: str) -> set[str] | None:
    """The shard names the temporary file ``temp`` in the local ``folder`` lists as an
    index, or None when it is not one (or for a URL)."""
    if folder is None:
        return None
    path = os.path.join(folder, temp)
    if starts_like_safetensors(path):  # a shard, not read whole
        return None
    try:
        weight_map, _ = _parse_index(path)
    except (OSError, SafetensorError):
        return None
    return set(weight_map.values())


def _choose(
    folder: str,
    is_file: Callable[[str], bool],
    listing: Callable[[], Iterable[str]],
    local: str | None = None,
) -> tuple[str, bool]:
    """The rule for a folder: ``(name, is_index)`` of the file to open in ``folder`` (a path
    or URL, named in errors), from which names are files and, if those do not decide,
    everything the folder holds (``listing``, called then only). ``local``: the folder's
    path when it is on this machine, whose files an error may then read (``None``: a URL).

    Raises:
        MissingShardError: The folder holds no checkpoint, or only shards of one.
        ShardIndexError: The folder holds several candidates and no rule picks one.
    """
    for name, is_index in ((INDEX_NAME, True), (SINGLE_NAME, False)):
        if is_file(name):
            return name, is_index
    names = sorted(listing())
    indexes = [n for n in names if n.endswith(_INDEX_END)]
    if len(indexes) == 1:
        return indexes[0], True
    files = [n for n in names if n.endswith(".safetensors")]
    shards = [m for n in files if (m := _SHARD_NAME.fullmatch(n)) and int(m["count"]) > 1]
    if files and not indexes and len(shards) == len(files):
        # Shards of a larger checkpoint without its index (written last): a save interrupted
        # while its files were renamed into place, or a partial download. One of them alone
        # would otherwise open as the whole model, silently missing the other shards' tensors.
        listed = first_five([m.group(0) for m in shards])
        raise MissingShardError(
            f"folder {shown(folder)} holds shards of a checkpoint ({listed}) but no index: "
            f"{_unfinished_commit(names, local)}; pass one shard's path to open that file alone",
            kind="MissingIndex",
        )
    if len(files) == 1 and not indexes:
        return files[0], False
    if not indexes and not files:
        # A save stopped before its first rename (into a new folder) left only its files.
        stopped = _unfinished_commit(names, local)
        raise MissingShardError(
            f"no safetensors checkpoint in folder {shown(folder)}: expected {INDEX_NAME}, "
            f"{SINGLE_NAME}, "
            "a single *.safetensors.index.json or a single *.safetensors"
            + (f"; {stopped}" if stopped.startswith("a save was stopped") else ""),
            kind="NoCheckpoint",
        )
    found = ", ".join(indexes + files)
    raise ShardIndexError(
        f"folder {shown(folder)} holds several checkpoints and no {INDEX_NAME} or {SINGLE_NAME} "
        "says "
        f"which to open: {found}; pass the index or file path instead",
        kind="AmbiguousFolder",
    )


def _check_shard_name(name: str, index: str, tensor: str) -> None:
    why = unsafe_shard_name(name)
    if why is not None:
        raise ShardIndexError(
            f"index {shown(index)} names shard {name!r} for tensor {tensor!r}, which is refused "
            f"({why}): an index may name only .safetensors files inside its own folder",
            kind="UnsafeShardName",
            tensor=tensor,
        )


def _read_bytes(
    path: str, storage_options: dict[str, Any] | None, source: ByteSource | None = None
) -> bytes:
    """The bytes of the index at ``path``, read through ``source`` if given (then closed
    here), else through one opened here."""
    if source is None:
        source = open_source_for(path, "pread", storage_options)
    try:
        if source.size > MAX_INDEX_SIZE:
            raise ShardIndexError(
                f"index {shown(path)} is {source.size} bytes; the limit is {MAX_INDEX_SIZE}",
                kind="InvalidIndex",
            )
        buf = bytearray(source.size)
        if buf:
            source.readinto(0, memoryview(buf))
        return bytes(buf)
    finally:
        source.close()


def _parse_index(
    path: str, storage_options: dict[str, Any] | None = None, source: ByteSource | None = None
) -> tuple[dict[str, str], dict[str, Any] | None]:
    raw = _read_bytes(path, storage_options, source)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: arrays or objects nested deeper than the parser's recursion limit.
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ShardIndexError(
            f"index {shown(path)} is not valid JSON: {why}", kind="InvalidIndex"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise ShardIndexError(
            f'index {shown(path)} must be a JSON object with a "weight_map" object',
            kind="InvalidIndex",
        )
    weight_map: dict[str, str] = {}
    # Each distinct shard name checked once: a million entries naming a few hundred shards
    # took 7 s checking each entry's name (Windows path rules included), 1.4 s to parse.
    normal: dict[str, str] = {}
    for tensor, shard in obj["weight_map"].items():
        if not isinstance(shard, str):
            raise ShardIndexError(
                f"index {shown(path)}: weight_map[{tensor!r}] must be a file name, got "
                f"{type(shard).__name__}",
                kind="InvalidIndex",
                tensor=tensor,
            )
        name = normal.get(shard)
        if name is None:
            _check_shard_name(shard, path, tensor)
            name = normal[shard] = normal_shard_name(shard)
        weight_map[tensor] = name
    metadata = obj.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ShardIndexError(
            f'index {shown(path)}: "metadata" must be an object, got {type(metadata).__name__}',
            kind="InvalidIndex",
        )
    return weight_map, metadata


def _read_index(
    path: str, storage_options: dict[str, Any] | None, source: ByteSource | None = None
) -> tuple[dict[str, str], dict[str, Any] | None, tuple[int, ...] | None]:
    """:func:`_parse_index`, and for a local index the identity of the version read (None for
    a URL, which may come opened: ``source``, closed here). Read again if it changed while
    being read (a save renaming a new one in)."""
    if looks_like_url(path):
        return (*_parse_index(path, storage_options, source), None)
    for _ in range(3):
        try:
            before: tuple[int, ...] | None = file_identity(os.stat(path))
        except OSError:
            before = None  # reading it says what is wrong (or it was just being replaced)
        weight_map, metadata = _parse_index(path, storage_options)
        try:
            after = file_identity(os.stat(path))
        except OSError:
            continue
        if after == before:
            return weight_map, metadata, after
    raise ShardIndexError(
        f"index {shown(path)} kept changing while it was read (a save in progress?); open it "
        "again once the save is done",
        kind="CheckpointChanged",
    )


# Every sharded handle, so that a forked child gets new locks: one that another thread held at
# the fork (opening a shard, which can take a while) would be waited for forever, that thread
# being absent from the child.
_HANDLES: weakref.WeakSet[ShardedSafeOpen] = weakref.WeakSet()


def _new_locks_in_child() -> None:
    for handle in list(_HANDLES):
        handle._lock = threading.RLock()
        handle._opening = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_in_child)


def _tensors_by_shard(weight_map: Mapping[str, str]) -> dict[str, list[str]]:
    """The tensors a weight map places in each shard, in the map's order."""
    by_shard: dict[str, list[str]] = {}
    for tensor, placed in weight_map.items():
        by_shard.setdefault(placed, []).append(tensor)
    return by_shard


class ShardedSafeOpen(HandleBehaviour, ClosedWhenDropped):
    """A sharded checkpoint opened as one file: the same methods as :class:`safe_open`.

    Args:
        filename: A ``*.index.json`` path or URL, a model folder, or a folder URL (its path
            ending with ``/``; see :func:`resolve_checkpoint`).
        framework: As for :class:`safe_open`.
        device: As for :class:`safe_open`.
        backend: ``"mmap"`` or ``"pread"``, used for every shard.
        max_header_size: Largest header accepted per shard.
        **options: Reader options for every shard (``threads=``, ``slice_reads=``); for a URL,
            ``storage_options=`` (headers, endpoint...) apply to the index and every shard.
            Shards of an index URL are found next to it; its query string is not carried to
            them (it belongs to the index: a signature, ``?download=true``).

    Raises:
        ShardIndexError: The index is malformed or the folder is ambiguous.
        MissingShardError: A shard the index names does not exist, or the folder is empty
            (over a URL, a missing shard is the remote's ``RemoteNotFoundError``, as
            the index itself would be; both are ``FileNotFoundError``).
            An ``http(s)`` folder URL with neither name is a ``RemoteNotFoundError``.
        ValueError: ``storage_options`` that cannot go to every shard of an index or folder
            URL (an S3 ``version_id``).

    Example:
        >>> with safe_open("path/to/model_folder", framework="pt") as f:  # doctest: +SKIP
        ...     w = f.get_tensor("model.embed_tokens.weight")
    """

    def __init__(
        self,
        filename: Any,
        framework: str,
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        max_header_size: int = MAX_HEADER_SIZE,
        **options: Any,
    ) -> None:
        # Open shards, least recently used first: past a budget of descriptors, local ones not
        # in use are closed again in that order (see _over_budget).
        self._handles: dict[str, safe_open] = {}
        self._pins: dict[str, int] = {}  # reads in progress per shard: never closed under them
        self._budget: int | None = None  # most local shards open at once; None: not limited
        self._starved: int | None = None  # the budget after the process ran out of descriptors
        # The version of each local shard first opened: one closed for the budget and opened
        # again must still be it.
        self._identities: dict[str, tuple[int, ...]] = {}
        self._shard_at: dict[str, str] | None = None  # shard path to shard name, once needed
        self._opening: dict[str, threading.Lock] = {}  # one per shard being opened
        self._by_shard: dict[str, list[str]] | None = None  # the index's tensors per shard
        # Per-shard reader options (threads=, slice_reads=, storage_options=) pass through.
        self._options = options
        self._closed = True
        # Fail on a bad framework, device or backend now (in the reference's order), not at
        # the first tensor.
        get_adapter(framework).check_device(device)
        check_backend(backend)
        if "slice_reads" in options:
            check_slice_reads(options["slice_reads"])
        if options.get("threads") is not None:
            check_threads(options["threads"])
        self._framework = framework
        self._device = device
        self._backend = backend
        self._max_header_size = check_max_header_size(max_header_size)
        self._lock = threading.RLock()
        _HANDLES.add(self)  # for new locks in a forked child
        # The shards the checkpoint lists (a single file's only once it has been read).
        self._shards: list[str] = []

        path = os.fsdecode(os.fspath(filename))
        target, is_index, opened = resolve_checkpoint(path, self._options.get("storage_options"))
        self._path = target
        self._base = url_dirname(target) if looks_like_url(target) else os.path.dirname(target)
        # Where the files are, to open and stat them: shards are opened as their tensors are
        # first read, and a relative path is the folder it named then, not wherever os.chdir
        # has gone since (the index, looked up there, read as saved again). Paths shown and
        # returned stay as given.
        local = not looks_like_url(target)
        self._path_at = os.path.abspath(target) if local else target
        self._base_at = os.path.abspath(self._base) if local else self._base
        # A single file opened as a checkpoint is read from its own path (a URL keeps its
        # query string and escapes), not rebuilt from its folder and name.
        self._single: tuple[str, str] | None = None
        self._index_metadata: dict[str, Any] | None
        # The local index's identity when read, checked again as each shard is opened.
        self._index_identity: tuple[int, ...] | None = None
        if is_index:
            self._weight_map, self._index_metadata, self._index_identity = _read_index(
                target, self._options.get("storage_options"), opened
            )
            self._shards = sorted(set(self._weight_map.values()))
            if not looks_like_url(target):
                for shard in self._shards:
                    path = self._shard_path(shard)
                    try:
                        st = os.stat(path)
                    except OSError:
                        st = None
                    if st is not None and stat.S_ISREG(st.st_mode):
                        # Each shard's version as the checkpoint is opened: one rewritten in
                        # place before its first read (a saver that writes shards under their
                        # names and the index last, as transformers and accelerate do, leaves
                        # the index as it was) is refused when opened, not read as this save.
                        self._identities[shard] = file_identity(st)
                    else:
                        what = (
                            "is not a regular file"
                            if os.path.lexists(path)
                            else f"does not exist in {self._base!r}"
                        )
                        raise self._missing_shard(target, shard, what)
            self._closed = False
        else:
            # A folder with one file: the file is its own index.
            shard = shown_name(target)
            self._single = (shard, target)
            self._closed = False
            # Not in self._shards until read: a file that is not there is the OSError safe_open
            # raises, not a shard that went away (see _checked_handle).
            with self._shard(shard) as handle:
                self._weight_map = dict.fromkeys(handle.offset_keys(), shard)
                meta = handle.metadata()
            self._index_metadata = None if meta is None else dict(meta)
            self._shards = [shard]

    # ------------------------------------------------------------------ context and lifetime

    def __enter__(self) -> ShardedSafeOpen:
        return self

    def __exit__(self, _exc_type: object, _exc_value: object, _traceback: object) -> None:
        # The reference's parameters (so a manual __exit__() is refused alike).
        self.close()

    def close(self) -> None:
        """Close every shard opened so far. Tensors already returned stay valid."""
        with self._lock:
            self._closed = True
            handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    def _live(self) -> None:
        if self._closed:
            raise ClosedFileError("File is closed", kind="FileClosed")

    # ---------------------------------------------------------------------------- shards

    @property
    def path(self) -> str:
        """The index (or single file) that was opened."""
        return self._path

    def _shard_path(self, shard: str) -> str:
        if self._single is not None and self._single[0] == shard:
            return self._single[1]
        return _join(self._base, shard)

    def _shard_file(self, shard: str) -> str:
        """:meth:`_shard_path` for opening the file: absolute where the path given was not."""
        if self._single is not None and self._single[0] == shard:
            return self._path_at
        return _join(self._base_at, shard)

    def files(self) -> list[str]:
        """Paths of the shards, in shard-name order."""
        return [self._shard_path(s) for s in self._shards]

    def shard_of(self, name: str) -> str:
        """Path of the shard that holds ``name`` (per the index).

        For a URL, the shard's URL as it is opened: ``user:password@`` included (it is a
        location to open, not a message; the index's query string is not in it).

        Raises:
            TensorNotFoundError: No tensor of that name.
        """
        self._live()
        return self._shard_path(self._shard_name(name))

    def _shard_name(self, name: str) -> str:
        check_tensor_name(name)
        try:
            return self._weight_map[name]
        except KeyError:
            raise tensor_not_found(name) from None

    @contextlib.contextmanager
    def _shard(self, shard: str) -> Iterator[safe_open]:
        """The open handle on ``shard`` (opened and checked the first time), kept open for the
        ``with`` block: the descriptor budget closes only shards no block is using."""
        handle = self._pin(shard)
        try:
            yield handle
        finally:
            self._unpin(shard)

    def _on_shard(self, name: str, method: Callable[[safe_open, str], Any]) -> Any:
        """``method(handle, name)`` on the handle of ``name``'s shard, kept open meanwhile.
        Pinned by hand, not by :meth:`_shard`: its generator doubled the cost of a
        ``get_tensor_meta``."""
        shard = self._shard_name(name)
        handle = self._pin(shard)
        try:
            self._in_shard(shard, handle, (name,))
            return method(handle, name)
        finally:
            self._unpin(shard)

    def _unpin(self, shard: str) -> None:
        with self._lock:
            left = self._pins[shard] - 1
            if left:
                self._pins[shard] = left
            else:
                del self._pins[shard]
            budget = self._budget
            if budget is None or len(self._handles) <= budget:
                return
            # Shards kept open past the budget because they were in use go now.
            evicted = self._over_budget()
        for old in evicted:
            old.close()

    def _pin(self, shard: str) -> safe_open:
        self._live()
        with self._lock:
            handle = self._used(shard)
            if handle is not None:
                return handle
            # One lock per shard, not the handle's: opening a remote shard can take the
            # network's time, and reads from shards already open (or opening others) must not
            # wait for it.
            opening = self._opening.setdefault(shard, threading.Lock())
        with opening:
            with self._lock:
                handle = self._used(shard)
            if handle is not None:
                return handle
            handle = self._checked_handle(shard)
            try:
                with self._lock:
                    self._live()  # closed meanwhile: this handle would never be closed
                    self._handles[shard] = handle
                    self._pins[shard] = self._pins.get(shard, 0) + 1
                    evicted = self._over_budget()
            except BaseException:
                handle.close()
                raise
        for old in evicted:
            old.close()
        return handle

    def _used(self, shard: str) -> safe_open | None:
        """The open handle on ``shard``, pinned and made the most recently used; None if the
        shard is not open. Called under the lock."""
        handle = self._handles.pop(shard, None)
        if handle is not None:
            self._handles[shard] = handle  # to the end: dicts keep insertion order
            self._pins[shard] = self._pins.get(shard, 0) + 1
        return handle

    def _over_budget(self) -> list[safe_open]:
        """Take the least recently used shards not in use out of the open ones until as many
        are open as the budget allows; the caller closes them (outside the lock). Called
        under the lock."""
        budget = self._budget
        if budget is None or len(self._handles) <= budget:
            return []
        evicted = []
        for shard in list(self._handles):
            if len(self._handles) <= budget:
                break
            if shard not in self._pins:
                evicted.append(self._handles.pop(shard))
        return evicted

    def _checked_handle(self, shard: str, *, raw: bool = False) -> safe_open:
        """A new handle on ``shard``, checked to be the shard the checkpoint was opened with
        (``raw``: opened by :meth:`_open_raw`); the caller owns it. Its tensors are checked
        against the index by :meth:`validate`, and each one read by :meth:`_in_shard`."""
        try:
            handle = self._new_shard_handle(shard, raw=raw)
        except OSError as exc:
            # Gone or unreadable since the checkpoint was opened: a save over it (with other
            # shard names, or the hub's, which removes the old files first) says so before
            # the bare OSError would, which `except SafetensorError` did not catch.
            self._check_index_unchanged(shard)
            if (
                isinstance(exc, FileNotFoundError)
                and not isinstance(exc, SafetensorError)
                and shard in self._shards  # listed, so it was there once
            ):
                raise MissingShardError(
                    f"shard {shard!r} of {shown(self._path)} no longer exists (removed "
                    "since the checkpoint was opened)",
                    kind="MissingShard",
                ) from exc
            missing = self._missing_remote_shard(shard, exc)
            if missing is not None:
                raise missing from exc
            raise
        try:
            self._check_index_unchanged(shard)
            self._check_same_version(shard, handle)
        except BaseException:
            handle.close()
            raise
        return handle

    def _missing_remote_shard(self, shard: str, exc: OSError) -> MissingShardError | None:
        """The error for a shard of a remote index that the server does not have, or None.

        A remote index's shards are first asked for when read: one that is not there is the
        index's missing shard, named with the index and a tensor placed there, as a local one
        is when the index opens (not a bare 404 naming the shard's URL)."""
        if (
            not isinstance(exc, RemoteNotFoundError)
            or shard not in self._shards
            or self._single is not None  # a file opened as a checkpoint: no index to name
        ):
            return None
        return self._missing_shard(self._path, shard, f"does not exist: {exc}")

    def _missing_shard(self, index: str, shard: str, what: str) -> MissingShardError:
        """A shard ``index`` places tensors in that is not there (``what`` says how), named
        with one of those tensors."""
        example = next(t for t, s in self._weight_map.items() if s == shard)
        return MissingShardError(
            f"index {shown(index)} places tensors (e.g. {example!r}) in shard {shard!r}, "
            f"which {what}",
            kind="MissingShard",
            tensor=example,
        )

    def _new_shard_handle(self, shard: str, *, raw: bool = False) -> safe_open:
        path = self._shard_file(shard)
        open_handle = self._open_raw if raw else self._open_handle
        local = not looks_like_url(path)
        if local and (self._budget is None or len(self._handles) >= self._budget):
            self._set_budget()
        try:
            return open_handle(path)
        except OSError as exc:
            if not local or exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        # Out of descriptors (other files of the process, slices holding shards open, a
        # lower limit than the budget assumed): close every shard not in use and try again,
        # keeping half as many open from now on; then the same of the process's other
        # checkpoint handles, each of which counted the limit for itself.
        failure: OSError | None = None
        for handles in ([self], [h for h in list(_HANDLES) if h is not self]):
            if not sum(h._give_back_idle() for h in handles) and failure is not None:
                break  # nothing more to close
            try:
                return open_handle(path)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                failure = exc
        assert failure is not None
        raise OSError(
            failure.errno,
            f"out of file descriptors opening shard {shard!r} of {shown(self._path)}: this "
            f"handle keeps {len(self._handles)} shards open, and slices keep their shard "
            "open until they are freed; raise the limit (`ulimit -n`)",
            path,
        ) from failure

    def _give_back_idle(self) -> int:
        """Close every local shard not in use and keep half as many open from now on (the
        process ran out of descriptors). Returns how many were closed."""
        with self._lock:
            self._budget = self._starved = max(MIN_OPEN, len(self._handles) // 2)
            idle = [s for s in self._handles if s not in self._pins]
            evicted = [self._handles.pop(s) for s in idle]
        for old in evicted:
            old.close()
        return len(evicted)

    def _set_budget(self) -> None:
        """Ask for descriptors enough for the shards open so far and more, and keep as many
        shards open as the limit then allows."""
        # Each open shard holds a descriptor or two (a second for partial reads) until it is
        # closed: a checkpoint of 1,500 shards ran out of them under the common soft limit of
        # 1,024, and one of 2,500 under a hard limit of 4,096.
        budget = descriptor_budget(len(self._handles))
        if budget is not None:
            # The budget is the process's: shards other handles keep open count against it
            # (each handle counting the whole limit for itself, seven handles of 600 shards
            # left the process no descriptor to open anything else).
            others = sum(len(h._handles) for h in list(_HANDLES) if h is not self)
            budget = max(MIN_OPEN, budget - others)
        with self._lock:
            if self._starved is not None:
                budget = self._starved if budget is None else min(budget, self._starved)
            self._budget = budget

    def _open_raw(self, path: str) -> safe_open:
        """A shard opened as it is, for :meth:`validate` to read every header: not checked
        against the index (so that a tensor in two shards is reported as such), numpy arrays
        by positioned reads."""
        return safe_open(
            path,
            "numpy",
            backend="pread",
            max_header_size=self._max_header_size,
            storage_options=self._options.get("storage_options"),
        )

    def _open_handle(self, path: str) -> safe_open:
        try:
            return safe_open(
                path,
                self._framework,
                device=self._device,
                backend=self._backend,
                max_header_size=self._max_header_size,
                **self._options,
            )
        except HeaderError as exc:
            # The header's own message says what is wrong, not in which of the shards.
            raise type(exc)(
                f"shard {shown(path)}: {exc}",
                kind=exc.kind,
                tensor=exc.tensor,
                offset=exc.offset,
            ) from exc

    def _check_same_version(self, shard: str, handle: safe_open) -> None:
        """Refuse a shard that is not the file found under its name when the checkpoint was
        opened (rewritten in place before its first read, or closed for the descriptor budget
        and replaced meanwhile, without a new index)."""
        fd = getattr(handle._live(), "fd", -1)
        if fd < 0:
            return
        identity = file_identity(os.fstat(fd))
        with self._lock:
            first = self._identities.setdefault(shard, identity)
        if first != identity:
            raise ShardIndexError(
                f"shard {shard!r} of {shown(self._path)} changed since the checkpoint was opened "
                "(replaced or rewritten, the index not): its tensors may not be of the save the "
                "others were read from. Open the checkpoint again.",
                kind="CheckpointChanged",
            )

    def _check_index_unchanged(self, shard: str) -> None:
        """Refuse a shard opened after the checkpoint was saved again over the one opened.

        Shards are opened as their tensors are first read, and a save renames new shards over
        old ones (the trainer's periodic re-save, same names and layout): one handle, or a
        ``load_file`` running meanwhile, read some shards of each save, and nothing told. A
        save removes or replaces the index before it renames any shard (ours, the hub's), so a
        shard opened while the index is still the one read is the old save's: the check
        comes after the shard is opened.
        """
        if self._index_identity is None:
            return
        try:
            now = file_identity(os.stat(self._path_at))
        except OSError:
            now = None
        if now != self._index_identity:
            raise ShardIndexError(
                f"checkpoint {shown(self._path)} was saved again (or is being saved) since it was "
                f"opened: shard {shard!r} may hold the new save's tensors. Open it again.",
                kind="CheckpointChanged",
            )

    def _check_shard(self, shard: str, handle: safe_open) -> None:
        present = handle.header.tensors
        for name in present:
            placed = self._weight_map.get(name)
            if placed is None:
                raise ShardIndexError(
                    f"shard {shard!r} holds tensor {name!r}, which index {shown(self._path)} does "
                    "not list",
                    kind="UnindexedTensor",
                    tensor=name,
                )
            if placed != shard:
                raise ShardIndexError(
                    f"tensor {name!r} is in shard {shard!r} but index {shown(self._path)} places "
                    f"it in {placed!r}",
                    kind="TensorInTwoShards",
                    tensor=name,
                )
        self._in_shard(shard, handle, self._placed(shard))

    def _placed(self, shard: str) -> list[str]:
        """The tensors the index places in ``shard``, in the index's order."""
        by_shard = self._by_shard
        if by_shard is None:
            # Built once: a scan of the whole weight map per shard opened made loading 50,000
            # tensors from 2,000 shards take 2.9 s instead of 0.4 s.
            weight_map = self._weight_map
            by_shard = _tensors_by_shard(weight_map)
            with self._lock:
                # Not over the map drop_stale_entries swapped in meanwhile (with its own).
                if self._weight_map is weight_map:
                    self._by_shard = by_shard
        return by_shard.get(shard, [])

    def _indexed(self, shard: str, handle: safe_open, names: Collection[str]) -> Collection[str]:
        """Those of ``names`` (every tensor of ``shard``) the index places there, checked to
        be all it places there: the others are left out of reads, as an index that omits
        them asks. ``names`` itself when that is all of them.

        Raises:
            ShardIndexError: A tensor placed there is not there (``TensorNotInShard``).
        """
        placed = self._placed(shard)
        self._in_shard(shard, handle, placed)
        if len(names) == len(placed):
            return names
        return [n for n in names if self._weight_map.get(n) == shard]

    def _in_shard(self, shard: str, handle: safe_open, names: Iterable[str]) -> None:
        """Check that ``shard`` holds each of ``names`` (placed there by the index).

        Raises:
            ShardIndexError: One is not there (``TensorNotInShard``).
        """
        present = handle.header.tensors
        for name in names:
            if name not in present:
                raise ShardIndexError(
                    f"index {shown(self._path)} places tensor {name!r} in shard {shard!r}, which "
                    "does not contain it",
                    kind="TensorNotInShard",
                    tensor=name,
                )

    @contextlib.contextmanager
    def _source_at(self, path: str) -> Iterator[ByteSource]:
        """The open source of the shard at ``path`` (as :meth:`files` names it), kept open for
        the ``with`` block: the one its header was read through, so its bytes are that
        version's."""
        if self._shard_at is None:
            self._shard_at = {self._shard_path(shard): shard for shard in self._shards}
        with self._shard(self._shard_at[path]) as handle:
            yield handle._live()

    def _locate(self, name: str) -> tuple[str, int, TensorInfo]:
        """Where a tensor's bytes are: ``(shard path, file offset, header entry)``."""
        shard = self._shard_name(name)
        with self._shard(shard) as handle:
            self._in_shard(shard, handle, (name,))
            header = handle.header
        info = header.tensors[name]
        return self._shard_path(shard), header.data_start + info.begin, info

    def _locate_all(self, names: Sequence[str]) -> dict[str, tuple[str, int, TensorInfo]]:
        """:meth:`_locate` of each of ``names``, in their order: a shard's handle pinned and
        its tensors checked once for all of its names (a pin, a check and a context manager
        per tensor were ~20 us each of 100,000). Where a name is wrong, the errors are
        :meth:`_locate`'s, the first name's first."""
        try:
            by_shard: dict[str, list[str]] = {}
            for name in names:
                by_shard.setdefault(self._shard_name(name), []).append(name)
            found: dict[str, tuple[str, int, TensorInfo]] = {}
            for shard, held in by_shard.items():
                with self._shard(shard) as handle:
                    self._in_shard(shard, handle, held)
                    header = handle.header
                path, start, tensors = self._shard_path(shard), header.data_start, header.tensors
                for name in held:
                    info = tensors[name]
                    found[name] = (path, start + info.begin, info)
        except Exception:  # noqa: BLE001 - raised again below, in the order _locate meets it
            # Which error comes first (an unknown name, a shard that will not open, a tensor
            # not in its shard): one name at a time, as the caller would have met them.
            return {name: self._locate(name) for name in names}
        return {name: found[name] for name in names}

    def validate(self) -> None:
        """Read every shard's header and check the whole checkpoint against the index.

        Raises:
            ShardIndexError: A tensor is missing, misplaced, in two shards or not indexed, or
                ``total_size`` disagrees with the bytes of tensor data.
            HeaderError: A shard is malformed.
        """
        self._live()
        seen: dict[str, str] = {}
        data_bytes = 0
        remote = looks_like_url(self._path)

        def opened(shard: str) -> tuple[safe_open, bool, Exception | None]:
            """The shard opened raw (:meth:`_open_raw`), and for a remote checkpoint its
            checked handle pinned too, or why not: raised in the shard's turn, after the raw
            checks. A local one is checked to be the shard the checkpoint was opened with
            (a save since, another version of the file), within the descriptor budget."""
            if not remote:
                return self._checked_handle(shard, raw=True), False, None
            try:
                raw = self._open_raw(self._shard_path(shard))
            except OSError as exc:
                missing = self._missing_remote_shard(shard, exc)
                if missing is not None:
                    raise missing from exc
                raise
            try:
                self._pin(shard)
            except Exception as exc:  # noqa: BLE001 - raised in its turn, see above
                return raw, False, exc
            return raw, True, None

        def let_go(shard: str, raw: safe_open, pinned: bool) -> None:
            raw.close()
            if pinned:
                self._unpin(shard)

        # A remote checkpoint's shards opened a few ahead (two round trips each).
        opens = in_order(
            opened,
            self._shards,
            discard=lambda shard, result: let_go(shard, *result[:2]),
            ahead=self._open_ahead,
        )
        with contextlib.closing(opens):
            for shard, future in opens:
                raw, pinned, failure = future.result()
                try:
                    for name, info in raw.header.tensors.items():
                        if name in seen:
                            raise ShardIndexError(
                                f"tensor {name!r} is in two shards: {seen[name]!r} and {shard!r}",
                                kind="TensorInTwoShards",
                                tensor=name,
                            )
                        seen[name] = shard
                        data_bytes += info.nbytes
                    self._check_shard(shard, raw)
                finally:
                    let_go(shard, raw, pinned)
                if failure is not None:
                    raise failure
                if not remote:
                    with self._shard(shard):
                        pass
        total = (self._index_metadata or {}).get("total_size")
        if (
            total is not None
            and is_index_path(self._path)
            and declared_total_size(total) != data_bytes
        ):
            raise ShardIndexError(
                f"index {shown(self._path)} declares total_size {total!r} but its shards hold "
                f"{data_bytes} bytes of tensor data",
                kind="TotalSizeMismatch",
            )

    # ------------------------------------------------------------------------ header access

    def keys(self) -> list[str]:
        """Tensor names, sorted (from the index; no shard is read)."""
        self._live()
        return sorted(self._weight_map)

    def offset_keys(self) -> list[str]:
        """Tensor names in file order: shard by shard (by name), each in data-offset order.

        Reads every shard's header (not its data).
        """
        self._live()
        out: list[str] = []
        with contextlib.closing(self._pinned_in_turn(self._shards)) as pinned:
            for shard, handle in pinned:
                out.extend(self._indexed(shard, handle, handle.offset_keys()))
        return out

    def metadata(self) -> dict[str, str] | None:
        """The index's ``"metadata"`` (values that are not strings, such as ``total_size``, as
        their JSON text); for a folder with a single file, that file's ``__metadata__``."""
        self._live()
        meta = self._index_metadata
        if meta is None:
            return None
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}

    def index_metadata(self) -> dict[str, Any] | None:
        """The index's ``"metadata"`` with its JSON values as they are (``total_size`` an int)."""
        self._live()
        return None if self._index_metadata is None else dict(self._index_metadata)

    def shard_metadata(self) -> list[dict[str, str] | None]:
        """Each shard's own ``__metadata__``, in shard-name order (reads every shard's header;
        for a single file, its metadata)."""
        self._live()
        out = []
        with contextlib.closing(self._pinned_in_turn(self._shards)) as pinned:
            for _, handle in pinned:
                out.append(handle.metadata())
        return out

    def weight_map(self) -> dict[str, str]:
        """Tensor name to shard file name, in the index's order."""
        self._live()
        return dict(self._weight_map)

    def drop_stale_entries(self) -> dict[str, str]:
        """Leave out of this handle the index's entries for tensors their shard does not hold
        (entries left from an earlier save, say), as transformers loads such checkpoints.

        Reads every shard's header. Afterwards :meth:`keys`, :meth:`offset_keys`,
        :meth:`get_tensors` and the rest see only the tensors that are there; asking for a
        dropped name is :class:`TensorNotFoundError`. :func:`pysafetensors.torch.load_model`
        calls it, with a warning naming what it dropped. A read another thread has under way
        meanwhile may still see the index as it was.

        Returns:
            The entries dropped, tensor name to shard name, in the index's order.
        """
        self._live()
        absent: set[str] = set()
        with contextlib.closing(self._pinned_in_turn(self._shards)) as pinned:
            for shard, handle in pinned:
                present = handle.header.tensors
                absent.update(n for n in self._placed(shard) if n not in present)
        if not absent:
            return {}
        with self._lock:
            weight_map = self._weight_map
            dropped = {n: s for n, s in weight_map.items() if n in absent}
            kept = {n: s for n, s in weight_map.items() if n not in absent}
            # Both swapped whole, the tensors per shard built from the map it goes with.
            self._weight_map = kept
            self._by_shard = _tensors_by_shard(kept)
        return dropped

    def get_tensor_meta(self, name: str) -> TensorMeta:
        """A tensor's dtype, shape and offsets (within its shard), without reading its data."""
        self._live()
        meta: TensorMeta = self._on_shard(name, safe_open.get_tensor_meta)
        return meta

    # ---------------------------------------------------------------------------- tensor data

    def get_tensor(self, name: str) -> Any:
        """Load one tensor from its shard.

        Raises:
            TensorNotFoundError: No tensor of that name.
            ShardIndexError: The shard disagrees with the index.
        """
        check_tensor_name(name)  # before the handle's state, as the reference
        self._live()
        return self._on_shard(name, safe_open.get_tensor)

    def get_tensors(self) -> dict[str, Any]:
        """Load every tensor, in file order (see :meth:`offset_keys`)."""
        self._live()
        out: dict[str, Any] = {}

        def handle_for(shard: str) -> tuple[safe_open, bool]:
            """The shard's open handle, pinned (True), or a handle of this call's own."""
            with self._lock:
                handle = self._used(shard)
            if handle is not None:
                return handle, True
            # A shard not open yet is read through a handle of this call's own, closed once
            # read (its tensors stay valid): a load of hundreds of shards held a descriptor
            # per shard until the end. Not shared, so no other thread's read can meet it
            # closed.
            self._live()
            return self._checked_handle(shard), False

        def let_go(shard: str, handle: safe_open, pinned: bool) -> None:
            if pinned:
                self._unpin(shard)
            else:
                handle.close()

        # Remote shards are opened a few ahead (a round trip each) while one is read.
        opens = in_order(
            handle_for,
            self._shards,
            discard=lambda shard, opened: let_go(shard, *opened),
            ahead=self._open_ahead,
        )
        with contextlib.closing(opens):
            for shard, future in opens:
                handle, pinned = future.result()
                try:
                    names = handle.header.tensors
                    kept = self._indexed(shard, handle, names)  # checked before any read
                    tensors = handle.get_tensors()
                    out.update(tensors if kept is names else {k: tensors[k] for k in kept})
                finally:
                    let_go(shard, handle, pinned)
        return out

    def read_into(self, targets: Mapping[str, Any]) -> None:
        """Read tensors' bytes into memory the caller already has, each shard's together
        (see :meth:`safe_open.read_into`).

        Raises:
            TensorNotFoundError: A name is not in the checkpoint.
            ValueError: A buffer is read-only, not contiguous, or not the tensor's size.
        """
        self._live()
        check_targets(targets)
        # Every buffer checked before any is filled, as in one file: read shard by shard, a
        # later shard's unfit buffer was refused with the earlier ones already overwritten.
        for info, target in zip(self._infos(list(targets)), targets.values(), strict=True):
            if device_bytes(target, info) is None:
                writable_bytes(target, info)

        def read(handle: safe_open, group: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            handle.read_into(dict(group))
            return []

        self._per_shard(list(targets.items()), operator.itemgetter(0), read)

    def get_slice(self, name: str) -> SafeSlice:
        """A lazy view of one tensor that reads only what is indexed."""
        check_tensor_name(name)  # before the handle's state, as the reference
        self._live()
        piece: SafeSlice = self._on_shard(name, safe_open.get_slice)
        return piece

    def _infos(self, names: Iterable[str]) -> list[TensorInfo]:
        """The header entries of ``names`` (within their shards), in their order: each shard's
        from its own handle, pinned meanwhile.

        Raises:
            TensorNotFoundError: A name is not in the checkpoint.
        """
        self._live()
        wanted = list(names)
        found = self._per_shard(
            wanted,
            lambda name: name,
            lambda handle, group: zip(group, handle._infos(group), strict=True),
        )
        return [found[name] for name in wanted]

    def _read_slices(
        self, requests: list[tuple[str, Any]], *, map_fragmented: bool = False
    ) -> dict[str, Any]:
        """``{name: get_slice(name)[index]}`` for many tensors (``load_shard``): each shard's
        requests read together by that shard's ``safe_open._read_slices``, in request order."""
        self._live()
        got = self._per_shard(
            requests,
            operator.itemgetter(0),
            lambda handle, group: handle._read_slices(group, map_fragmented=map_fragmented).items(),
        )
        return {name: got[name] for name, _ in requests}

    def _per_shard(
        self,
        items: list[_Item],
        name_of: Callable[[_Item], str],
        work: Callable[[safe_open, list[_Item]], Iterable[tuple[str, Any]]],
    ) -> dict[str, Any]:
        """``work(handle, group)`` on each shard's handle (pinned meanwhile) with the items of
        its tensors, in the order their shards are first met; the ``(name, value)`` pairs
        every call gave, as one dict."""
        by_shard: dict[str, list[_Item]] = {}
        for item in items:
            by_shard.setdefault(self._shard_name(name_of(item)), []).append(item)
        got: dict[str, Any] = {}
        with contextlib.closing(self._pinned_in_turn(list(by_shard))) as pinned:
            for shard, handle in pinned:
                group = by_shard[shard]
                self._in_shard(shard, handle, map(name_of, group))
                got.update(work(handle, group))
        return got

    @property
    def _open_ahead(self) -> int:
        """How many shards to open ahead of the one read (see :func:`ahead_for`)."""
        return ahead_for([self._path])

    def _pinned_in_turn(self, shards: list[str]) -> Generator[tuple[str, safe_open], None, None]:
        """``(shard, handle)`` for each shard in turn, pinned until the next is asked for.

        Remote shards not open yet are opened a few ahead (a round trip each); one never
        handed over is unpinned as soon as it is open.
        """
        opens = in_order(
            self._pin,
            shards,
            discard=lambda shard, _: self._unpin(shard),
            ahead=self._open_ahead,
        )
        with contextlib.closing(opens):
            for shard, opened in opens:
                handle = opened.result()
                try:
                    yield shard, handle
                finally:
                    self._unpin(shard)

    def __iter__(self) -> Iterator[str]:
        return iter(self.offset_keys())

    def __len__(self) -> int:
        self._live()
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        self._live()
        return name in self._weight_map
