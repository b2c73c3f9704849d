"""Reshard, merge and extract checkpoints by copying tensor bytes file to file.

Tensors are never decoded: each one's bytes go from its place in a source shard to its place
in the output with ``os.copy_file_range`` (in the kernel; on filesystems with reflinks, no data
is even copied), falling back to ``os.sendfile`` and then to ``pread``/``pwrite`` in bounded
chunks. Remote sources are read in bounded chunks. Peak memory is one chunk, whatever the
model's size.

Outputs are planned as a direct save would plan them (the hub's splitter for shards, the
reference's layout for each file), so resharding, merging or extracting gives the files that
saving the same tensors, in the same order, with :func:`~pysafetensors.save_sharded` (or
``save_file`` with ``{"format": "pt", ...}`` metadata) gives.

Tensor order (which decides shard boundaries) is the source index's ``weight_map`` order; for a
single source file it is the file's data order. For a hub-written checkpoint that is the state
dict's order only while no tensor exceeded the shard limit: the hub's splitter gives such a
tensor a shard of its own ahead of the others, so a reshard of it to a new limit may split
differently from a direct save of the original state dict.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from ._errors import (
    SafetensorError,
    first_five,
    input_path,
    looks_like_url,
    make_folder,
    output_path,
    write_error,
)
from ._format import MAX_HEADER_SIZE, TensorInfo
from ._layout import build_layout
from ._name_globs import glob_matcher
from ._sharded import MAX_INDEX_SIZE, ShardedSafeOpen, is_index_path, shown
from ._sharding import (
    COMPUTED_KEYS,
    DEFAULT_FILENAME_PATTERN,
    MAX_SHARD_SIZE,
    SHARD_SUFFIX,
    ShardPlan,
    as_header_metadata,
    index_filename,
    model_metadata,
    parse_size,
    pattern_family,
    pattern_for_stem,
    split_into_shards,
    write_checkpoint,
)
from ._sources import ByteSource
from ._writer import SaveGroup, Writeback, atomic_output, pwrite_all, reserve_space, write_all

__all__ = ["copy_range", "extract", "merge", "reshard", "select_names"]

#: Bytes per step of the fallback copies (and per progress report).
COPY_CHUNK: Final = 8 << 20
# copy_file_range refuses some pairs of files (different filesystems on old kernels, special
# files); these errors mean "use another way", anything else is a real I/O error.
_FALLBACK_ERRNOS: Final = frozenset(
    getattr(errno, n)
    for n in ("EXDEV", "EINVAL", "ENOSYS", "EOPNOTSUPP", "ENOTSUP", "EBADF", "EPERM")
    if hasattr(errno, n)
)

Progress = Callable[[int, int], None]


def _short(source: str, src_off: int, length: int) -> SafetensorError:
    return SafetensorError(
        f"{source} ended early while copying {length} bytes at offset {src_off} (was it "
        "truncated while being copied?)",
        kind="ShortRead",
        offset=src_off,
    )


def copy_range(
    src_fd: int,
    src_off: int,
    dst_fd: int,
    dst_off: int,
    length: int,
    *,
    source: str = "the source",
) -> None:
    """Copy ``length`` bytes between two files at explicit offsets, without a Python buffer
    when the kernel allows it.

    Tries ``os.copy_file_range``, then ``os.sendfile``, then ``pread``/``pwrite`` in chunks of
    :data:`COPY_CHUNK` bytes. Neither file's position matters (except that ``sendfile`` moves
    the destination's). ``source`` names the source file in errors.

    Raises:
        SafetensorError: The source is shorter than expected.
        OSError: A real I/O error.
    """
    done = 0
    cfr = getattr(os, "copy_file_range", None)
    if cfr is not None:
        try:
            while done < length:
                n = cfr(src_fd, dst_fd, min(length - done, 1 << 30), src_off + done, dst_off + done)
                if n <= 0:
                    raise _short(source, src_off + done, length - done)
                done += n
            return
        except OSError as exc:
            if exc.errno not in _FALLBACK_ERRNOS:
                raise
    sendfile = getattr(os, "sendfile", None)
    if sendfile is not None:
        try:
            os.lseek(dst_fd, dst_off + done, os.SEEK_SET)
            while done < length:
                n = sendfile(dst_fd, src_fd, src_off + done, min(length - done, 1 << 30))
                if n <= 0:
                    raise _short(source, src_off + done, length - done)
                done += n
            return
        except OSError as exc:
            if exc.errno not in _FALLBACK_ERRNOS:
                raise
    buf = bytearray(min(COPY_CHUNK, length - done))
    view = memoryview(buf)
    while done < length:
        want = min(len(buf), length - done)
        n = os.preadv(src_fd, [view[:want]], src_off + done)
        if n <= 0:
            raise _short(source, src_off + done, length - done)
        pwrite_all(dst_fd, view[:n], dst_off + done)
        done += n


def _copy_from_source(source: ByteSource, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    """Bounded-chunk copy from a source without a file descriptor (remote, file object)."""
    buf = bytearray(min(COPY_CHUNK, n))
    view = memoryview(buf)
    done = 0
    while done < n:
        want = min(len(buf), n - done)
        source.readinto(src_off + done, view[:want])
        pwrite_all(dst_fd, view[:want], dst_off + done)
        done += want


class _Sources:
    """The source shards' bytes, read through the handles their headers were read with: the
    same files, whatever a save (this one, resharding in place, or another) renamed over
    their paths since."""

    def __init__(self, source_at: Callable[[str], AbstractContextManager[ByteSource]]) -> None:
        self._source_at = source_at

    def copy(
        self, path: str, name: str, src_off: int, dst_fd: int, dst_off: int, n: int, output: str
    ) -> None:
        """Copy tensor ``name``'s ``n`` bytes at ``src_off`` of shard ``path`` to ``dst_off``
        of ``output`` (open as ``dst_fd``).

        Raises:
            SafetensorError: The shard ended early, or an I/O error (a :class:`WriteError`
                naming the tensor and both files: a copy in the kernel does not say which
                side failed).
        """
        if not n:
            return
        where = f"{shown(path)} (tensor {name!r})"
        # Opening the shard again (after the handle closed it for want of descriptors) fails
        # as an error of its own, outside the try: it names the shard, not the output.
        with self._source_at(path) as source:
            fd = getattr(source, "fd", -1)
            try:
                if fd >= 0:  # a local file: copied by the kernel
                    copy_range(fd, src_off, dst_fd, dst_off, n, source=where)
                else:
                    _copy_from_source(source, src_off, dst_fd, dst_off, n)
            except OSError as exc:
                if isinstance(exc, SafetensorError):  # the source's own error (remote, read)
                    raise
                raise write_error(
                    exc, output, detail=f", copying {n} bytes from offset {src_off} of {where}"
                ) from exc


def _source_order(src: ShardedSafeOpen) -> list[str]:
    if is_index_path(src.path):
        return list(src.weight_map())
    return src.offset_keys()


def _source_metadata(
    src: ShardedSafeOpen, shard_metas: list[dict[str, str] | None], fmt: str | None
) -> tuple[str, dict[str, Any]]:
    """The ``format`` and the metadata a direct save of the source's tensors would have been
    given: the model's metadata (:func:`model_metadata`: what every shard agrees on, then the
    index's) without ``format`` and without the keys an index computes (a file's own
    ``total_size`` key would otherwise replace the index's, user keys winning as in the hub, and
    the index would declare a size its shards do not hold). The format is ``fmt`` where given,
    else the source's own (a TensorFlow or Flax checkpoint stays one), else ``"pt"``.
    ``shard_metas``: the source's :meth:`~ShardedSafeOpen.shard_metadata`."""
    meta = model_metadata(shard_metas, src.index_metadata() if is_index_path(src.path) else None)
    meta = {k: v for k, v in (meta or {}).items() if k not in COMPUTED_KEYS}
    own = meta.pop("format", None)
    if fmt is None:
        fmt = own if isinstance(own, str) else "pt"
    return fmt, meta


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _identity(path: str) -> tuple[int, int] | str:
    """What tells files apart: device and inode, or the resolved path of one not there."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return st.st_dev, st.st_ino


def _refuse_output_over_source(
    src: ShardedSafeOpen,
    out: str,
    *,
    op: str,
    sharded: bool,
    whole: bool,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
) -> None:
    """Refuse an output that would replace part of the source checkpoint with less than it.

    Sources are read from descriptors opened before anything is written, so the write itself
    would succeed; what it leaves behind would not: a single output file renamed over a shard
    leaves an index naming tensors that are gone, and a sharded output in an index's own folder
    replaces that index (and cleans its shards). ``whole``: the output holds every tensor of
    the source (a merge or a reshard), which loses nothing where the source is the whole
    checkpoint there.
    """
    if sharded:
        _refuse_sharded_output_over_source(src, out, op=op, whole=whole, pattern=filename_pattern)
        return
    _refuse_single_file_beside_index(src, out, op=op)
    if not os.path.exists(out):
        return
    sources = [src.path, *src.files()] if is_index_path(src.path) else [src.path]
    for path in sources:
        if looks_like_url(path) or not _same_file(out, path):
            continue
        if whole and not is_index_path(src.path):
            return
        raise SafetensorError(
            f"{op}: the output {out!r} is the source checkpoint's file {path!r}; writing it "
            "would destroy the checkpoint. Write to another path.",
            kind="OutputIsSource",
        )


def _refuse_single_file_beside_index(src: ShardedSafeOpen, out: str, *, op: str) -> None:
    """Refuse a single file written next to the source's index under the name of its single
    file (``model.safetensors`` beside ``model.safetensors.index.json``): the hub's tools and
    transformers look for that file before the index, and would load it as the model."""
    if looks_like_url(src.path) or not is_index_path(src.path):
        return
    folder, index = os.path.split(src.path)
    single = index.removesuffix(".index.json")
    if not single.endswith(".safetensors") or os.path.basename(out) != single:
        return
    if not _same_file(os.path.dirname(out) or ".", folder or "."):
        return
    raise SafetensorError(
        f"{op}: the output {out!r} would sit beside the source's index {shown(src.path)} "
        f"under the name loaders open before any index ({single}): they would load it as the "
        "whole model. Write to another path.",
        kind="OutputIsSource",
    )


def _refuse_sharded_output_over_source(
    src: ShardedSafeOpen, out: str, *, op: str, whole: bool, pattern: str
) -> None:
    """The sharded case of :func:`_refuse_output_over_source`.

    A sharded save into a folder replaces, or cleans up, every file there of its pattern's
    family (single file, shards, index). A source file among them is lost unless the output
    holds the whole checkpoint that file belongs to: an extract never does (it writes part of
    the source), a reshard does unless its source is one shard of a larger checkpoint there
    (the folder's index names it), which would leave that shard's tensors only.
    """
    if looks_like_url(src.path) or not os.path.isdir(out):
        return
    if is_index_path(src.path):
        home = _same_file(out, os.path.dirname(src.path) or ".")
        if whole and home:
            return  # resharding a checkpoint in place: every file is rewritten or kept
        # Shards may sit in a subfolder of the index's ("sub/model-00001-of-00003..."): an
        # output there replaces or cleans them up, and the index left names files gone.
        family = pattern_family(pattern)
        inside = [
            p
            for p in src.files()
            if family.fullmatch(os.path.basename(p)) and _same_file(out, os.path.dirname(p) or ".")
        ]
        if not home and not inside:
            return
        what = f"the source checkpoint {shown(src.path)}"
        if not home:
            what = f"shard {shown(inside[0])} of {what}"
        raise SafetensorError(
            f"{op}: the output folder {out!r} holds {what}; writing there would "
            f"{'replace it with part of it' if home else 'replace or delete that shard'}. "
            "Write to another folder.",
            kind="OutputIsSource",
        )
    # The source as the folder names it, if it does: by identity, so that a path through a
    # symlink or another hard link is the same file.
    family = pattern_family(pattern)
    names = [
        n
        for n in sorted(os.listdir(out))
        if family.fullmatch(n) and _same_file(os.path.join(out, n), src.path)
    ]
    # A shard of the checkpoint the output replaces, whatever its name or subfolder: the
    # new index takes the old one's place, and that checkpoint's other shards are lost.
    replaced = os.path.join(out, index_filename(pattern))
    in_replaced = _index_names_file(replaced, src.path)
    if not names and not in_replaced:
        return  # not a file the save writes or cleans up: the source stays
    # Named by an index, or by its own name when the index is gone (a save killed in its
    # commit, shards fetched without it): the clean-up would delete the other shards.
    indexed = in_replaced or names[0] in _named_by_other_indexes(out, set())
    a_shard = indexed or _shard_of_many(names[0])
    if whole and not a_shard:
        return  # the folder's single-file checkpoint, resharded in place
    what = (
        "one shard of the checkpoint there"
        if a_shard
        else "a file the sharded output would replace or delete"
    )
    instead = "."
    if whole:
        instead = (
            ", or reshard the whole checkpoint (its folder or index)."
            if indexed
            else ", or restore the checkpoint's index and reshard it whole."
        )
    raise SafetensorError(
        f"{op}: the source {shown(src.path)} is {what}; writing the output into {out!r} "
        f"would leave only {'its' if whole else 'part of its'} tensors. Write to another "
        f"folder{instead}",
        kind="OutputIsSource",
    )


def _write_one(
    path: str,
    infos: list[tuple[str, int, TensorInfo]],
    metadata: Mapping[str, str],
    sources: _Sources,
    *,
    fsync: bool,
    max_header_size: int,
    progress: Progress | None,
    state: list[int],
    group: SaveGroup | None = None,
) -> None:
    by_name = {info.name: (spath, off, info) for spath, off, info in infos}
    layout = build_layout(
        ((i.name, i.dtype, i.shape) for _, _, i in infos), metadata, max_header_size=max_header_size
    )
    with atomic_output(path, fsync=fsync, group=group) as fd:
        os.ftruncate(fd, layout.file_size)
        reserve_space(fd, layout.file_size)  # tuning's preallocate: a full disk fails at once
        write_all(fd, layout.header)
        base = len(layout.header)
        writeback = Writeback(fd) if fsync else None
        planned = layout.tensors
        i = 0
        while i < len(planned):
            # A run of tensors written one after another whose bytes lie one after another in
            # one source shard (a shard's tensors, kept in their order): one copy for all. A
            # copy per tensor was most of merging 100,000 small tensors.
            spath, off, info = by_name[planned[i].name]
            end, j = off + info.nbytes, i + 1
            while j < len(planned):
                s, o, following = by_name[planned[j].name]
                if s != spath or o != end:
                    break
                end += following.nbytes
                j += 1
            _copy_run(sources, planned[i:j], by_name, fd, base, path)
            for t in planned[i:j]:
                if writeback is not None:
                    writeback.wrote(base + t.begin, t.nbytes)
                if progress is not None:
                    state[0] += t.nbytes
                    progress(state[0], state[1])
            i = j


def _copy_run(
    sources: _Sources,
    run: Sequence[TensorInfo],
    by_name: Mapping[str, tuple[str, int, TensorInfo]],
    fd: int,
    base: int,
    output: str,
) -> None:
    """Copy ``run`` (tensors of the output one after another, from bytes one after another
    of one shard) in one copy; where that fails, tensor by tensor, so that the error is the
    one of the tensor it is about (the offset and name a copy per tensor gave)."""
    first = run[0]
    spath, off, _ = by_name[first.name]
    if len(run) > 1:
        try:
            sources.copy(
                spath, first.name, off, fd, base + first.begin, run[-1].end - first.begin, output
            )
            return
        except (OSError, SafetensorError):
            pass  # the copies one by one raise the error again, about its tensor
    for t in run:
        spath, off, info = by_name[t.name]
        sources.copy(spath, t.name, off, fd, base + t.begin, info.nbytes, output)


def _warn_disagreeing_keys(
    src: ShardedSafeOpen, shard_metas: list[dict[str, str] | None], kept: Collection[str]
) -> None:
    """Warn of the metadata keys some source shards hold (``shard_metas``) that the output does
    not keep (not in ``kept``: the shards disagree on them), where the caller gave no
    ``metadata``."""
    held = {k for meta in shard_metas for k in meta or {}}
    # ``format`` is written whatever the shards say, and the computed keys anew.
    dropped = sorted(held - set(kept) - {"format", *COMPUTED_KEYS})
    if dropped:
        keys = first_five([repr(k) for k in dropped])
        warnings.warn(
            f"the shards of {shown(src.path)} disagree on metadata {keys} (some shards hold "
            "it, or they hold different values): the output keeps only what every shard "
            "agrees on (metadata= sets it, as `pysafetensors metadata set` on the output does)",
            UserWarning,
            stacklevel=4,  # the caller of reshard/merge/extract
        )


def _warn_disagreeing_format(
    src: ShardedSafeOpen, shard_metas: list[dict[str, str] | None], fmt: str
) -> None:
    """Warn where the source shards disagree on ``format`` (``pt`` in one, ``np`` in another,
    or missing from some) and the output's, ``fmt``, chosen without the caller asking, is not
    every shard's that has one: the other keys the shards disagree on are dropped with a
    warning, this one was replaced silently. (Shards of ``pt`` and shards without a format
    give ``pt``, which changes nothing that was there.)"""
    formats = {(meta or {}).get("format") for meta in shard_metas}
    if len(formats) < 2 or formats - {None} <= {fmt}:
        return
    held = sorted(repr(f) for f in formats if f is not None)
    missing = " (and some shards have none)" if None in formats else ""
    warnings.warn(
        f"the shards of {shown(src.path)} disagree on metadata 'format': {', '.join(held)}"
        f"{missing}; the output's is {fmt!r} (format= sets it, as `pysafetensors metadata set`"
        " on the output does)",
        UserWarning,
        stacklevel=4,  # the caller of reshard/merge/extract
    )


def _rewrite(
    src: ShardedSafeOpen,
    names: list[str],
    out: str,
    *,
    max_shard_size: int | str | None,
    metadata: Mapping[str, Any] | None,
    filename_pattern: str,
    fmt: str | None,
    clean: bool,
    fsync: bool,
    max_header_size: int,
    progress: Progress | None,
    source_is_folder: bool = False,
) -> ShardPlan:
    located = src._locate_all(names)
    sizes = {name: located[name][2].nbytes for name in names}
    if clean and max_shard_size is not None and not fsync:
        # The clean-up deletes source files there once the new ones are renamed in: the new
        # ones must be on the disk first, or a power cut soon after could leave neither.
        fsync = _folder_of_source(src, out, {path for path, _, _ in located.values()})
    # Each shard's header metadata, read once (a remote shard's header is a request).
    shard_metas = src.shard_metadata()
    given_format = fmt
    fmt, own = _source_metadata(src, shard_metas, fmt)
    if given_format is None:
        _warn_disagreeing_format(src, shard_metas, fmt)
    meta = dict(own if metadata is None else metadata)
    # What every source file's header holds stays in every output file's header (transformers
    # reads a quantizer's metadata back from each shard's header): not only in the index.
    in_headers: dict[str, Any] = {}
    if metadata is None:
        source_index = src.index_metadata() if is_index_path(src.path) else None
        shared = model_metadata(shard_metas, None) or {}
        in_headers = {
            k: v
            for k, v in shared.items()
            if k != "format" and k not in COMPUTED_KEYS and k not in (source_index or {})
        }
        _warn_disagreeing_keys(src, shard_metas, shared.keys() | (source_index or {}).keys())
    # transformers v5 records total_parameters in its index; recomputed for the tensors
    # actually written, it goes into the output's index, as total_size does. A single output
    # file has no index and gets neither (as a single-file save by transformers): in its header
    # it was a key the source's metadata does not hold, so diff called a merge different.
    indexed = dict(meta)
    if "total_parameters" in (src.index_metadata() or {}) and metadata is None:
        count = 0
        for name in names:
            n = 1
            for d in located[name][2].shape:
                n *= d
            count += n
        indexed = {"total_parameters": count, **meta}
    state = [0, sum(sizes.values())]
    sources = _Sources(src._source_at)

    def write(
        path: str, file_names: list[str], header: Mapping[str, str], group: SaveGroup | None
    ) -> None:
        _write_one(
            path,
            [located[n] for n in file_names],
            header,
            sources,
            fsync=fsync,
            max_header_size=max_header_size,
            progress=progress,
            state=state,
            group=group,
        )

    if max_shard_size is None:
        write(out, names, {"format": fmt, **as_header_metadata(meta)}, None)
        return ShardPlan(
            {"total_size": state[1]},
            {os.path.basename(out): list(names)},
            dict.fromkeys(names, os.path.basename(out)),
        )
    plan = split_into_shards(
        sizes,
        get_storage_size=lambda n: n,
        filename_pattern=filename_pattern,
        max_shard_size=parse_size(max_shard_size),
    )
    if not plan.filename_to_tensors:
        plan = ShardPlan({"total_size": 0}, {filename_pattern.format(suffix=""): []}, {})
    make_folder(out)  # a file where the folder should be is named
    per_file: dict[str, str] = {"format": fmt}
    if not plan.is_sharded:
        per_file.update(as_header_metadata(meta))
    else:
        meta = indexed
        if in_headers:
            per_file.update(as_header_metadata(in_headers))
            meta = {k: v for k, v in meta.items() if k not in in_headers}

    def write_shard(path: str, shard_names: list[str], group: SaveGroup) -> None:
        write(path, shard_names, per_file, group)

    # All files are renamed into place together at the end (see SaveGroup): a reshard that
    # fails or is killed midway, in place above all, leaves the earlier checkpoint whole.
    write_checkpoint(
        out,
        plan,
        meta,
        write_shard,
        filename_pattern=filename_pattern,
        fsync=fsync,
        clean=clean,
    )
    if clean:
        _remove_replaced_source(src, out, plan, filename_pattern, whole_folder=source_is_folder)
    return plan


def _folder_of_source(src: ShardedSafeOpen, out: str, paths: set[str]) -> bool:
    """Whether the folder ``out`` holds the source's index or single file, or one of ``paths``
    (its shards)."""
    if looks_like_url(src.path) or not os.path.isdir(out):
        return False
    folders = {os.path.dirname(p) or "." for p in (src.path, *paths)}
    return any(_same_file(out, folder) for folder in folders)


def _remove_replaced_source(
    src: ShardedSafeOpen, out: str, plan: ShardPlan, filename_pattern: str, *, whole_folder: bool
) -> None:
    """After a checkpoint was resharded into its own folder, delete its files that the new one
    did not replace (another ``filename_pattern``'s index and shards): left there, the folder
    would hold two checkpoints and still open as the old one. The old index goes first, so
    that a crash midway leaves shards that do not open as a checkpoint. A file that another
    index of the folder names stays (two checkpoints may share shards); a single-file source
    goes only when the folder itself was the source (``whole_folder``), not a file named in
    it."""
    if looks_like_url(src.path):
        return
    folder = os.path.dirname(src.path) or "."
    if not _same_file(out, folder):
        return
    if not is_index_path(src.path) and not whole_folder:
        return
    written = set(plan.filename_to_tensors)
    if plan.is_sharded:
        written.add(index_filename(filename_pattern))
    doomed = [src.path, *src.files()] if is_index_path(src.path) else [src.path]
    # By identity, not by name: an index may spell a shard another way than the file just
    # written under it (through a symlink, in another case on a case-insensitive disk).
    new_files = {_identity(os.path.join(folder, name)) for name in written}
    doomed = [p for p in doomed if _identity(p) not in new_files]
    if not doomed:
        return
    # An index too large to read may name any file: none is deleted on its account.
    kept = _named_by_other_indexes(folder, {os.path.basename(src.path), *written}, _EVERY_NAME)
    for path in doomed:
        if os.path.relpath(path, folder) not in kept:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


class _EveryName(frozenset[str]):
    """What an index too large to read names: every file (so none is deleted on its account,
    and a file it may name counts as a shard of it)."""

    def __contains__(self, name: object) -> bool:
        return True


_EVERY_NAME: Final = _EveryName()


def _index_shards(index: str, too_large: frozenset[str] = frozenset()) -> frozenset[str]:
    """The shard names an index lists, normalised; none for a missing or unreadable one
    (this only spares files, never deletes one); ``too_large`` for one over the size an index
    may have, which is not read (read whole, a 300 MB stray index took 13 s and 1.5 GB)."""
    try:
        if os.path.getsize(index) > MAX_INDEX_SIZE:
            return too_large
    except OSError:
        return frozenset()
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        return frozenset(os.path.normpath(v) for v in weight_map.values() if isinstance(v, str))
    except (OSError, ValueError, AttributeError, RecursionError):
        return frozenset()


def _index_names_file(index: str, path: str) -> bool:
    """Whether the index at ``index`` (if any, and readable) names the file ``path``."""
    folder = os.path.dirname(index)
    return any(_same_file(os.path.join(folder, shard), path) for shard in _index_shards(index))


def _named_by_other_indexes(
    folder: str, skip: set[str], too_large: frozenset[str] = frozenset()
) -> frozenset[str]:
    """Shard names that the folder's other ``*.index.json`` files list (unreadable ones name
    nothing: this only spares files, never deletes one)."""
    named: set[str] = set()
    for name in os.listdir(folder):
        if name.endswith(".index.json") and name not in skip:
            shards = _index_shards(os.path.join(folder, name), too_large)
            if shards is _EVERY_NAME:
                return shards
            named |= shards
    return frozenset(named)


def reshard(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    max_shard_size: int | str = MAX_SHARD_SIZE,
    *,
    metadata: Mapping[str, Any] | None = None,
    filename_pattern: str | None = None,
    format: str | None = None,  # noqa: A002 - the metadata key's name
    clean: bool = True,
    fsync: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardPlan:
    """Re-split a checkpoint (folder, index or single file) into shards of a new size.

    Args:
        source: What to read: a model folder, a ``*.index.json`` or a ``.safetensors`` file.
        output: Target folder (created if missing). It may be the source's own folder: every
            source file is opened before anything is written, and each output file replaces
            its namesake atomically.
        max_shard_size: New limit per shard (bytes, or ``"5GB"``-style decimal units).
        metadata: User metadata for the output; by default the source's model metadata (the
            entries every source file agrees on, then the index's) without ``format``,
            ``total_size`` and ``total_parameters`` (computed for a sharded output's index;
            a single output file, which has no index, gets neither).
        filename_pattern: Output file name pattern with a ``{suffix}`` field. By default the
            source's own names when resharding into its folder (a diffusers folder keeps its
            ``diffusion_pytorch_model`` names, which its library looks for), else
            ``model{suffix}.safetensors``.
        format: Value of the ``format`` header key in every output file; by default the
            source's own (``"tf"`` stays ``"tf"``), else ``"pt"``.
        clean: Delete stale files of an earlier save with the same pattern in ``output``;
            resharding a sharded checkpoint into its own folder also deletes its files the
            new one did not replace (its index and shards under another pattern).
        fsync: Make every file durable before returning. Always done when ``output`` is the
            source's folder and ``clean`` is on: the old files are deleted afterwards.
        max_header_size: Largest header accepted, read and written.
        progress: Called as ``progress(bytes_done, bytes_total)`` after each tensor.
        storage_options: For a URL source: options for the remote source of the index and
            every shard (``{"headers": ...}``, ``{"endpoint_url": ...}``), as for ``safe_open``.

    Returns:
        The plan written.

    Raises:
        SafetensorError: The source is invalid.
        ValueError: ``max_shard_size`` does not parse or is not more than 0 bytes.
    """
    out = output_path(output, "output")
    if max_shard_size is None or parse_size(max_shard_size) <= 0:
        # None would write one file named like the folder; 0 one shard per tensor.
        raise ValueError(f"max_shard_size must be more than 0 bytes, got {max_shard_size!r}")
    with ShardedSafeOpen(
        _folder_or_file(source),
        "numpy",
        backend="pread",
        max_header_size=max_header_size,
        storage_options=_options(storage_options),
    ) as src:
        if filename_pattern is None:
            filename_pattern = _in_place_pattern(src, out) or DEFAULT_FILENAME_PATTERN
        _refuse_output_over_source(
            src, out, op="reshard", sharded=True, whole=True, filename_pattern=filename_pattern
        )
        return _rewrite(
            src,
            _source_order(src),
            out,
            max_shard_size=max_shard_size,
            metadata=metadata,
            filename_pattern=filename_pattern,
            fmt=format,
            clean=clean,
            fsync=fsync,
            max_header_size=max_header_size,
            progress=progress,
            source_is_folder=os.path.isdir(input_path(source, "source")),
        )


def _in_place_pattern(src: ShardedSafeOpen, out: str) -> str | None:
    """The source's own file name pattern (``diffusion_pytorch_model{suffix}.safetensors``
    from its index or single file) when ``out`` is the source's folder, else None."""
    if looks_like_url(src.path) or not os.path.isdir(out):
        return None
    folder, name = os.path.split(src.path)
    if not _same_file(out, folder or "."):
        return None
    stem = name.removesuffix(".index.json").removesuffix(".safetensors")
    if stem == name or _SHARD_NAME_TAIL.search(stem):
        return None  # not a checkpoint's single file or index (one shard of several: refused)
    return pattern_for_stem(stem)  # None for a name no pattern can give: the default one


#: A shard's ``-NNNNN-of-NNNNN`` ending.
_SHARD_NAME_TAIL: Final = re.compile(SHARD_SUFFIX + "$")


def _shard_of_many(name: str) -> bool:
    """Whether a file's name is that of one shard of several (``...-00001-of-00003``)."""
    found = _SHARD_NAME_TAIL.search(name.removesuffix(".safetensors"))
    return found is not None and int(found["count"]) > 1


def merge(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    metadata: Mapping[str, Any] | None = None,
    format: str | None = None,  # noqa: A002 - the metadata key's name
    fsync: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Merge a sharded checkpoint into one ``.safetensors`` file.

    The file's metadata is ``{"format": format, **metadata}``, where ``metadata`` defaults to
    the source's model metadata (what every shard agrees on, then the index's; without
    ``total_size`` and ``total_parameters``; values that are not strings become their JSON
    text) and ``format`` to the source's own (else ``"pt"``), so that ``diff`` finds the merge
    equal to its source.
    ``storage_options`` are as for :func:`reshard`.

    Raises:
        SafetensorError: The source is invalid, or ``output`` is one of its files (kind
            ``OutputIsSource``: writing it would leave the index naming tensors that are gone).
    """
    out = output_path(output, "output")
    with ShardedSafeOpen(
        _folder_or_file(source),
        "numpy",
        backend="pread",
        max_header_size=max_header_size,
        storage_options=_options(storage_options),
    ) as src:
        _refuse_output_over_source(src, out, op="merge", sharded=False, whole=True)
        _rewrite(
            src,
            _source_order(src),
            out,
            max_shard_size=None,
            metadata=metadata,
            filename_pattern=DEFAULT_FILENAME_PATTERN,
            fmt=format,
            clean=False,
            fsync=fsync,
            max_header_size=max_header_size,
            progress=progress,
        )


def _pattern_list(patterns: Iterable[str]) -> list[str]:
    # One string is one pattern (iterating it would make every character a pattern, and "*"
    # among them would select everything).
    return [patterns] if isinstance(patterns, str) else list(patterns)


def select_names(
    names: Iterable[str], patterns: Iterable[str], *, regex: bool = False
) -> list[str]:
    """Names matching any pattern, in the given order.

    Args:
        names: Candidate names.
        patterns: Shell globs matched against the whole name (``"model.layers.0.*"``), or, with
            ``regex=True``, regular expressions searched anywhere in it (anchor with ``^``/``$``).
        regex: Read patterns as regular expressions.

    Raises:
        re.error: A regular expression does not compile.
    """
    pats = _pattern_list(patterns)
    if regex:
        compiled = [re.compile(p) for p in pats]
        return [n for n in names if any(c.search(n) for c in compiled)]
    accept = glob_matcher(pats)
    return [n for n in names if accept(n)]


def extract(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    patterns: Iterable[str],
    *,
    regex: bool = False,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, Any] | None = None,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
    format: str | None = None,  # noqa: A002 - the metadata key's name
    fsync: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Copy the tensors whose names match into a new file (or sharded folder).

    Args:
        source: A model folder, index or file.
        output: A ``.safetensors`` file, or a folder when ``max_shard_size`` is given.
        patterns: Globs (or regular expressions with ``regex=True``); see :func:`select_names`.
        regex: Read patterns as regular expressions.
        max_shard_size: Write a sharded folder with this limit instead of one file.
        metadata: User metadata; by default the source's (as for :func:`reshard`).
        filename_pattern: Output pattern when sharded.
        format: Value of the ``format`` header key; by default the source's, else ``"pt"``.
        fsync: Make the output durable.
        max_header_size: Largest header accepted.
        progress: As for :func:`reshard`.
        storage_options: As for :func:`reshard`.

    Returns:
        The names extracted, in source order.

    Raises:
        SafetensorError: No tensor matches (kind ``NoMatch``), the source is invalid, or the
            output would replace part of the source (kind ``OutputIsSource``: one of its
            files, or, sharded, an index's own folder).
    """
    out = output_path(output, "output")
    pats = _pattern_list(patterns)
    with ShardedSafeOpen(
        _folder_or_file(source),
        "numpy",
        backend="pread",
        max_header_size=max_header_size,
        storage_options=_options(storage_options),
    ) as src:
        names = select_names(_source_order(src), pats, regex=regex)
        if not names:
            raise SafetensorError(
                f"no tensor of {shown(src.path)} matches {', '.join(map(repr, pats))}",
                kind="NoMatch",
            )
        _refuse_output_over_source(
            src,
            out,
            op="extract",
            sharded=max_shard_size is not None,
            whole=False,
            filename_pattern=filename_pattern,
        )
        _rewrite(
            src,
            names,
            out,
            max_shard_size=max_shard_size,
            metadata=metadata,
            filename_pattern=filename_pattern,
            fmt=format,
            clean=max_shard_size is not None,
            fsync=fsync,
            max_header_size=max_header_size,
            progress=progress,
        )
        return names


def _options(storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if storage_options is None else dict(storage_options)


def _folder_or_file(source: str | os.PathLike[str]) -> str:
    # ShardedSafeOpen resolves folders and indexes; a plain file is opened as a one-file folder
    # would be, so every source goes through the same code.
    return input_path(source, "source")
