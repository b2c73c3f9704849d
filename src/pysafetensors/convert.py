"""Convert PyTorch checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) to safetensors, safely.

Nothing from the pickle is run and torch is not needed: the checkpoint is read by
:mod:`pysafetensors._torch_pickle`, which interprets an allow-list of rebuild functions itself
(:mod:`pysafetensors._torch_policy`) and refuses every other global with
:class:`~pysafetensors.UnsafePickleError`. Storage bytes are streamed from the checkpoint into
the output, so memory stays near one tensor (a non-contiguous view needs its storage span plus
the copy).

Example::

    from pysafetensors.convert import convert_file, convert_folder

    convert_file("pytorch_model.bin", "model.safetensors", verify=True)
    convert_folder("checkpoint-dir", "out-dir")   # sharded .bin + index too

Tied weights (one tensor under several names) are written once: the lexicographically first
name whose tensor covers the whole storage is kept, as the reference ``save_model`` picks it,
and the other names of the very same view (dtype, shape, stride, offset) are dropped and
recorded as ``{dropped_name: kept_name}`` in ``__metadata__``. Other views of the storage (a row,
a transpose) are written as copies (see :func:`~pysafetensors._torch_pickle.plan_shared`).
Every file is written with ``{"format": "pt"}`` metadata, as the hub and transformers expect.

A checkpoint that pickles objects of classes the converter does not know (a script's
``__main__.Config``, an ``argparse.Namespace``, an optimizer object) is refused by default;
``unknown="skip"`` converts its tensors anyway, with each such object replaced by an inert
placeholder that nothing calls (:attr:`ConversionReport.skipped_objects` says where they were).
A whole pickled model (``torch.save(model)``, as the checkpoint or as a value in it) is then
converted as ``model.state_dict()`` names its tensors, read from the attributes pickled for
each module (:attr:`ConversionReport.modules`). Globals the scanner grades dangerous
(``os.system``, ``builtins.eval``...) are refused either way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from ._errors import (
    CheckpointError,
    SafetensorError,
    SerializeError,
    UnsafePickleError,
    WriteError,
    add_note,
    first_five,
    input_path,
    local_path_refused,
    looks_like_url,
    make_folder,
    output_path,
    write_error,
)
from ._format import N_LEN, parse_header, parse_header_length
from ._interrupts import interrupts_deferred
from ._mapped_pages import drop_mapped_pages, file_mappings
from ._sharding import remove_stale_files
from ._sources import check_regular, open_regular_file
from ._torch_pickle import SKIPPED_WHOLE, Checkpoint, TensorRecord, load_checkpoint, plan_shared
from ._writer import TensorData, write_file

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "ConversionReport",
    "FolderReport",
    "convert_file",
    "convert_folder",
    "safetensors_name",
    "to_torch_bin",
    "verify_conversion",
]

#: File name endings treated as PyTorch checkpoints by :func:`convert_folder`.
CHECKPOINT_SUFFIXES: Final = (".bin", ".pt", ".pth", ".ckpt")
_INDEX_IN: Final = "pytorch_model.bin.index.json"
_INDEX_OUT: Final = "model.safetensors.index.json"
#: The hub's names of a safetensors checkpoint, the outputs' of a sharded folder.
_OUTPUT_PATTERN: Final = "model{suffix}.safetensors"
_MAX_INDEX_BYTES: Final = 100_000_000

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as tensor bytes are written."""


@dataclass
class ConversionReport:
    """What :func:`convert_file` did."""

    src: str
    """The checkpoint read."""
    dst: str
    """The safetensors file written."""
    format: str
    """Checkpoint format: ``"zip"``, ``"legacy"`` or ``"tar"``."""
    tensors: list[str] = field(default_factory=list)
    """Names written, in checkpoint order."""
    total_size: int = 0
    """Bytes of tensor data written (the index's ``total_size``)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Shared tensors not written: ``{dropped_name: kept_name}`` (also in the metadata)."""
    non_tensors: dict[str, Any] = field(default_factory=dict)
    """Non-tensor leaves (``epoch``, hyper-parameters...), JSON-ready (numpy arrays as nested
    lists, abbreviated)."""
    kept_non_tensors: list[str] = field(default_factory=list)
    """Non-tensor leaves stored as metadata strings (``keep_non_tensors=True``)."""
    skipped_non_tensors: list[str] = field(default_factory=list)
    """Non-tensor leaves not stored: all of them without ``keep_non_tensors``; with it, those
    whose name is already a metadata key (``format``, a ``metadata=`` key, a tied name), and
    those whose JSON text is a tensor name of the file (it would read as a tied name)."""
    verified: str | None = None
    """``"torch"`` (compared with ``torch.load(weights_only=True)``), ``"reader"`` (compared with
    our own reading of the checkpoint), or None when not verified."""
    skipped_objects: dict[str, str] = field(default_factory=dict)
    """``unknown="skip"``: where each unknown object sat, ``{dotted name: global}``, e.g.
    ``{"args": "argparse.Namespace"}`` (an object inside a set, used as a dict key, or nested
    over 16 levels deep is listed under its container's name). They are among
    :attr:`non_tensors` too, as ``"<skipped argparse.Namespace>"``."""
    unknown_globals: list[str] = field(default_factory=list)
    """``unknown="skip"``: every global skipped, sorted, also those only inside other skipped
    objects' state."""
    skipped_tensors: int = 0
    """``unknown="skip"``: tensors inside skipped objects' state (no state dict name reaches
    them), not converted."""
    modules: dict[str, str] = field(default_factory=dict)
    """``unknown="skip"``: the ``nn.Module`` objects of a whole pickled model
    (``torch.save(model)``) whose tensors were converted as ``module.state_dict()`` names them,
    ``{dotted prefix: class}`` in state dict order, ``""`` for the model itself. Nothing of
    theirs ran: a class's own ``state_dict`` hooks, ``_save_to_state_dict`` or
    ``get_extra_state`` are not honoured (check the classes listed if yours has any)."""


@dataclass
class FolderReport:
    """What :func:`convert_folder` did."""

    files: list[ConversionReport] = field(default_factory=list)
    """One report per converted checkpoint."""
    index: str | None = None
    """The ``model.safetensors.index.json`` written, if the source was sharded."""
    left_out: dict[str, str] = field(default_factory=dict)
    """``unknown="skip"``: checkpoints not converted because each is one object of an unknown
    class as a whole (a Trainer's ``training_args.bin``, a whole optimizer), ``{path: why}``.
    Never a shard of the index or a ``pytorch_model*`` file: those are the model."""


Unknown = Literal["error", "skip"]
"""What :func:`convert_file` does with a global outside its allow-list."""


def _check_unknown(unknown: Any) -> None:
    if unknown not in ("error", "skip"):
        raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")


def _under(names: dict[str, Any], subtree: str | None, *, itself: bool = False) -> dict[str, Any]:
    """The entries under ``subtree``, named without its prefix (all of them without one);
    with ``itself``, the entry named ``subtree`` too, as ``""``."""
    if not subtree:
        return dict(names)
    pre = subtree + "."
    return {
        ("" if k == subtree else k[len(pre) :]): v
        for k, v in names.items()
        if k.startswith(pre) or (itself and k == subtree)
    }


def _select(tensors: dict[str, TensorRecord], leaves: dict[str, Any], subtree: str | None) -> Any:
    if not subtree:
        return tensors, leaves
    t = _under(tensors, subtree)
    if not t:
        raise CheckpointError(f"no tensors under {subtree!r} in the checkpoint")
    return t, _under(leaves, subtree)


def _chunks_with_progress(
    ck: Checkpoint, rec: TensorRecord, tick: Callable[[int], None] | None
) -> Iterator[Any]:
    for chunk in ck.tensor_chunks(rec, reuse=True):
        if tick is not None:
            tick(memoryview(chunk).nbytes)
        yield chunk


def convert_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    keep_non_tensors: bool = False,
    verify: bool = False,
    progress: Progress | None = None,
    subtree: str | None = None,
    fsync: bool = False,
    unknown: Unknown = "error",
) -> ConversionReport:
    """Convert one PyTorch checkpoint to a safetensors file.

    Args:
        src: A ``torch.save`` file (zip format, the legacy format or the 0.1.1 tar format).
        dst: The safetensors file to write (atomically: nothing appears on failure).
        metadata: Extra ``__metadata__`` entries; they win over the ones the converter adds.
        keep_non_tensors: Store non-tensor leaves (``epoch``, config values...) as JSON
            strings in the metadata, under their dotted names. Only JSON values survive as they
            are: bytes become ``"<N bytes>"``, other objects ``"<TypeName>"``, NaN and
            infinities strings, and lists or dicts over 1,000 items are cut short with
            ``"..."`` (a record of what was there, not a way to restore it). A value is left
            out (listed in :attr:`ConversionReport.skipped_non_tensors`) when its name is
            already a metadata key, or when its JSON text is the name of a tensor of the file
            (``1`` beside a tensor ``"1"``), which would read as a tied name
            ``{dropped: kept}``.
        verify: Reload the result and compare every tensor, with
            ``torch.load(weights_only=True)`` when torch is importable and can read the file,
            otherwise with our own reading of the checkpoint. A mismatch removes ``dst``.
        progress: Called as ``progress(done_bytes, total_bytes)`` while data is written.
        subtree: Convert only the tensors under this dotted prefix, with the prefix removed
            (``"state_dict"`` for Lightning checkpoints).
        fsync: Make the result durable before returning.
        unknown: What to do with a global outside the allow-list. ``"error"`` (the default)
            refuses the checkpoint; ``"skip"`` replaces each object of such a global by an
            inert placeholder (its arguments and state are dropped, nothing is called: tensors
            inside it are not converted) and converts the rest, unless the scanner grades the
            global dangerous (:func:`pysafetensors.scan.grade_pickled_global`), which is
            refused in both modes. An ``nn.Module`` object (a whole pickled model) is the
            exception: its tensors are converted under the names ``module.state_dict()``
            gives them by default (:attr:`ConversionReport.modules`). numpy scalars, dtypes and
            arrays of bool, integer, float and complex dtypes are decoded in both modes (arrays
            are non-tensor values).

    Returns:
        A :class:`ConversionReport`.

    Raises:
        UnsafePickleError: The checkpoint references a global outside the allow-list (nothing
            was run, nothing was written). Its ``skippable`` says whether ``unknown="skip"``
            would have skipped it.
        CheckpointError: The checkpoint is broken or holds tensors safetensors cannot store.
        SafetensorError: Other problems with the output (e.g. invalid metadata).
        OSError: A file cannot be read or written.
    """
    src_s, dst_s = input_path(src, "src"), output_path(dst, "dst", file=True)
    _check_unknown(unknown)
    _refuse_url(src_s)
    # The checkpoint reader opens the path itself, blocking: a FIFO would wait for a writer.
    _refuse_special(src_s)
    if os.path.exists(dst_s) and os.path.samefile(src_s, dst_s):
        raise CheckpointError(
            f"{src_s}: source and destination are the same file", kind="OutputIsSource"
        )
    try:
        return _convert_file(
            src_s,
            dst_s,
            metadata=metadata,
            keep_non_tensors=keep_non_tensors,
            verify=verify,
            progress=progress,
            subtree=subtree,
            fsync=fsync,
            unknown=unknown,
        )
    except (CheckpointError, UnsafePickleError, SerializeError) as exc:
        # SerializeError: a tensor the pickle declares and the writer refuses (a shape whose
        # product overflows 64 bits before its 0). I/O errors keep their own arguments.
        if isinstance(exc, UnsafePickleError) and exc.skippable:
            add_note(
                exc,
                'unknown="skip" converts the tensors without this object (nothing of it is '
                "called or kept)",
            )
        # The reader's messages say what and where in the pickle or zip, not which file: in a
        # folder of checkpoints (rng_state.pth next to the model) that is the first question.
        raise _naming(exc, src_s) from None


def _refuse_url(path: str) -> None:
    """Refuse a URL as a source, naming it without credentials or query string (a password
    or a signed URL's signature must not reach messages): checkpoints are read locally."""
    if looks_like_url(path):
        raise local_path_refused(
            path, "URLs are not supported; download the checkpoint and convert the local file"
        )


def _refuse_special(path: str) -> None:
    """Refuse a FIFO, socket or device (a folder is left to the reader's own error).

    Opening a FIFO for reading waits for a writer, for ever when none comes: the type is
    checked without opening it (``stat``; a path swapped for a FIFO between this check and the
    reader's open is not covered).
    """
    with contextlib.suppress(FileNotFoundError):  # the reader's error names the file
        mode = os.stat(path).st_mode
        if not stat.S_ISDIR(mode):
            check_regular(path, mode)


def _naming(exc: SafetensorError, path: str) -> SafetensorError:
    """The same exception (type, kind, offset...) with ``path`` in front of its message."""
    text = str(exc)
    if not text.startswith(path):
        exc.args = (f"{path}: {text}",)
    return exc


def _utf8_or_escaped(text: str) -> str:
    """``text``, or where it holds lone surrogates (no UTF-8 for them), with them escaped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def kept_text(value: Any) -> str:
    """How ``keep_non_tensors`` stores a non-tensor value (as rendered in
    :attr:`ConversionReport.non_tensors`): its JSON, ASCII-escaped only where it holds lone
    surrogates (no UTF-8 for them; the escapes read back the same)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if _utf8_or_escaped(text) == text else json.dumps(value)


def _convert_file(
    src_s: str,
    dst_s: str,
    *,
    metadata: Mapping[str, str] | None,
    keep_non_tensors: bool,
    verify: bool,
    progress: Progress | None,
    subtree: str | None,
    fsync: bool,
    unknown: Unknown,
) -> ConversionReport:
    with load_checkpoint(src_s, unknown=unknown) as ck:
        tensors, leaves = _select(ck.tensors, ck.non_tensors, subtree)
        meta: dict[str, str] = {"format": "pt"}
        meta.update(metadata or {})
        # A tied name that is also a metadata key ("format", or one the caller gave) cannot be
        # recorded as {dropped: kept}: it is written as a tensor of its own instead of lost.
        dropped = {n: k for n, k in plan_shared(tensors).items() if n not in meta}
        meta.update(dropped)
        report = ConversionReport(
            src_s,
            dst_s,
            ck.format,
            dropped=dropped,
            non_tensors=leaves,
            skipped_objects=_under(ck.skipped.objects, subtree),
            unknown_globals=list(ck.skipped.globals),
            skipped_tensors=ck.skipped.tensors,
            modules=_under(ck.skipped.modules, subtree, itself=True),
        )
        kept = {n: r for n, r in tensors.items() if n not in dropped}
        for name, value in leaves.items():
            # A pickle may hold lone surrogates, which no header can: such names are written
            # with their escapes, such values as ASCII JSON (which reads back the same).
            key = _utf8_or_escaped(name)
            text = kept_text(value)
            # A value whose JSON names a tensor of the file ({"epoch": "1"} beside a tensor
            # "1") reads as a tie {dropped: kept}: to_torch_bin(restore_shared=True) made the
            # epoch a copy of that tensor. Left out, so that every such entry is a tie.
            if not keep_non_tensors or key in meta or text in kept:
                report.skipped_non_tensors.append(name)
                continue
            meta[key] = text
            report.kept_non_tensors.append(key)
        total = sum(r.nbytes for r in kept.values())
        done = 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        data = [
            TensorData(
                name,
                rec.dtype,
                rec.shape,
                lambda rec=rec: _chunks_with_progress(ck, rec, tick),  # type: ignore[misc]
                # One buffer for every chunk read: memory holds one chunk at a time.
                reused=True,
            )
            for name, rec in kept.items()
        ]
        write_file(dst_s, data, meta, fsync=fsync)
        report.tensors = list(kept)
        report.total_size = total
        if verify:
            try:
                report.verified = _verify_open(ck, tensors, dropped, dst_s, subtree)
            except BaseException:
                os.unlink(dst_s)
                raise
    return report


def _read_output(path: str) -> tuple[Any, int]:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        n = parse_header_length(fh.read(N_LEN), size)
        header = parse_header(fh.read(n), size - N_LEN - n)
    return header, header.data_start


def _output_chunks(path: str, start: int, length: int) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        fh.seek(start)
        left = length
        while left:
            piece = fh.read(min(left, 16 << 20))
            if not piece:
                raise CheckpointError(f"{path} is shorter than its header says")
            left -= len(piece)
            yield piece


#: Bytes of the output read at a time while verifying (through one buffer).
_VERIFY_READ: Final = 4 << 20


def _output_digest(fd: int, path: str, start: int, length: int, buffer: memoryview) -> str:
    """SHA-256 of ``length`` bytes of the output at ``start``, read through ``buffer``:
    a fresh 16 MiB ``bytes`` per read, with the previous still alive, held twice that."""
    h = hashlib.sha256()
    done = 0
    while done < length:
        piece = buffer[: min(buffer.nbytes, length - done)]
        got = os.preadv(fd, [piece], start + done)
        if not got:
            raise CheckpointError(f"{path} is shorter than its header says")
        h.update(piece[:got])
        done += got
    return h.hexdigest()


def _digest(chunks: Iterator[Any]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(memoryview(c).cast("B"))
    return h.hexdigest()


def verify_conversion(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    subtree: str | None = None,
    unknown: Unknown = "error",
) -> str:
    """Check that a safetensors file holds exactly the tensors of a checkpoint.

    ``unknown`` is :func:`convert_file`'s: ``"skip"`` to check a file converted with it.

    Returns:
        ``"torch"`` or ``"reader"``: what the output was compared with (see
        :func:`convert_file`).

    Raises:
        CheckpointError: A tensor is missing, extra, or differs.
    """
    _check_unknown(unknown)
    with load_checkpoint(input_path(src, "src"), unknown=unknown) as ck:
        tensors, _ = _select(ck.tensors, ck.non_tensors, subtree)
        return _verify_open(ck, tensors, plan_shared(tensors), os.fspath(dst), subtree)


#: Types ``torch.load`` does not byte-swap when reading a big-endian checkpoint (torch 2.x:
#: their values come out with swapped bytes, 1 as 256 for uint16).
_TORCH_SKIPS_SWAP: Final = frozenset({"uint16", "uint32", "uint64"})


def _mismatch(message: str, name: str | None = None) -> CheckpointError:
    return CheckpointError(f"verification failed: {message}", kind="VerifyFailed", tensor=name)


def _verify_open(
    ck: Checkpoint,
    tensors: dict[str, TensorRecord],
    dropped: dict[str, str],
    dst: str,
    subtree: str | None,
) -> str:
    header, data_start = _read_output(dst)
    expected = {n for n in tensors if n not in dropped}
    if set(header.tensors) != expected:
        extra = first_five([repr(n) for n in sorted(set(header.tensors) - expected)])
        missing = first_five([repr(n) for n in sorted(expected - set(header.tensors))])
        raise _mismatch(f"names differ (extra: {extra or 'none'}; missing: {missing or 'none'})")
    # Every requested name is checked, a dropped one against the tensor it is stored as: a
    # dropped name whose values differ from its kept tensor's would otherwise pass unseen.
    stored = {name: dropped.get(name, name) for name in tensors}
    for name, rec in tensors.items():
        info = header.tensors[stored[name]]
        if info.dtype != rec.dtype or info.shape != rec.shape:
            raise _mismatch(
                f"{_as_stored(name, stored)}: {info.dtype.code}{list(info.shape)}", name
            )
    with open(dst, "rb") as out:
        return _compare(ck, tensors, stored, header, data_start, out.fileno(), dst, subtree)


def _compare(
    ck: Checkpoint,
    tensors: dict[str, TensorRecord],
    stored: dict[str, str],
    header: Any,
    data_start: int,
    fd: int,
    dst: str,
    subtree: str | None,
) -> str:
    """Compare every tensor of the output (open as ``fd``) with torch.load's or the
    checkpoint's, one chunk in memory at a time."""
    digests: dict[str, str] = {}
    buffer = memoryview(bytearray(_VERIFY_READ))

    def ours(name: str) -> str:
        key = stored[name]
        if key not in digests:
            info = header.tensors[key]
            digests[key] = _output_digest(fd, dst, data_start + info.begin, info.nbytes, buffer)
        return digests[key]

    reference = _torch_reference(
        ck.path, subtree, mappable=ck.mappable, drop_pages=ck.byteorder == "little"
    )
    if reference is not None:
        if set(reference) != set(tensors):
            raise _mismatch("torch.load sees other tensor names than the converter")
        for name, rec in tensors.items():
            if ck.byteorder == "big" and rec.torch_dtype in _TORCH_SKIPS_SWAP:
                # torch.load leaves these big-endian; the converter swaps them as it swaps every
                # other type (the values torch.save was given), so check against the reader.
                if _digest(ck.tensor_chunks(rec, reuse=True)) != ours(name):
                    raise _mismatch(f"{_as_stored(name, stored)} differs from the checkpoint", name)
            elif reference[name] != ours(name):
                raise _mismatch(f"{_as_stored(name, stored)} differs from torch.load's", name)
        return "torch"
    for name, rec in tensors.items():
        if _digest(ck.tensor_chunks(rec, reuse=True)) != ours(name):
            raise _mismatch(f"{_as_stored(name, stored)} differs from the checkpoint", name)
    return "reader"


def _as_stored(name: str, stored: dict[str, str]) -> str:
    return name if stored[name] == name else f"{name} (stored as {stored[name]})"


def _torch_reference(
    path: str, subtree: str | None, *, mappable: bool, drop_pages: bool = False
) -> dict[str, str] | None:
    """The SHA-256 of every tensor of ``path`` as torch's own safe loader sees it, or None
    without torch.

    Zip checkpoints of STORED members (``mappable``: what torch.save writes) are loaded with
    ``mmap=True`` (storages stay in the page cache, not in private memory) and each tensor is
    hashed where it lies: verifying a 1.25 GiB checkpoint held ~2.6 GiB when every tensor was
    loaded and copied to bytes first. Others are loaded into memory: torch maps a compressed
    member's bytes as they lie, so every tensor of a deflated zip differed from its values.

    With ``drop_pages`` (storages torch leaves as they lie in the file: little-endian), each
    storage's pages are unmapped from this process once hashed (they stay in the page cache,
    and come back if a later view reads them): the mapping otherwise kept every page it had
    touched resident, the whole checkpoint by the end (a 0.98 GB one: +943 MiB).
    Non-contiguous tensors are hashed in row-major pieces of about 16 MiB, not copied whole.
    """
    try:
        import torch
    except ImportError:
        return None
    obj = None
    mapped = False
    for options in ({"mmap": True}, {}) if mappable else ({},):  # mmap: STORED zips only
        try:
            with warnings.catch_warnings(), _numpy_arrays_allowed(torch):
                warnings.simplefilter("ignore")  # torch warns about protocol-4 pickles
                obj = torch.load(path, map_location="cpu", weights_only=True, **options)
            mapped = bool(options)
            break
        except Exception:  # noqa: S112 - the next way, then our own reading (below)
            continue
    if obj is None:
        # e.g. protocol-4 pickles, which torch's weights_only unpickler does not support:
        # fall back to comparing with our own reading of the checkpoint.
        return None
    maps = file_mappings(path) if mapped and drop_pages else []
    out: dict[str, str] = {}
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        prefix, value = todo.pop()
        if isinstance(value, torch.Tensor):
            h = hashlib.sha256()
            for piece in _torch_pieces(value.detach()):
                flat = piece.reshape(-1)
                if flat.stride() != (1,):
                    # A one-element view keeps any stride on its size-1 dimension (2 for
                    # x[:, ::2][:, :1]): contiguous() leaves it, and view(uint8) refuses it.
                    flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
                h.update(flat.view(torch.uint8).numpy().data)
                if maps:  # a view of the mapping (a copy lies elsewhere: nothing dropped)
                    drop_mapped_pages(piece.data_ptr(), piece.numel() * piece.element_size(), maps)
            out[prefix] = h.hexdigest()
            if maps:  # what a strided view's copies read
                storage = value.untyped_storage()
                drop_mapped_pages(storage.data_ptr(), storage.nbytes(), maps)
        elif isinstance(value, dict):
            todo.extend((f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            todo.extend((f"{prefix}.{i}" if prefix else str(i), v) for i, v in enumerate(value))
    if subtree:
        pre = subtree + "."
        out = {k[len(pre) :]: v for k, v in out.items() if k.startswith(pre)}
    return out


def _numpy_arrays_allowed(torch: Any) -> contextlib.AbstractContextManager[Any]:
    """Let torch's ``weights_only`` loader build the numpy arrays the converter decodes (a
    Trainer's ``rng_state.pth`` holds one), so their checkpoints are verified against torch
    too: numpy's ``_reconstruct``, ``ndarray`` and the dtypes of the decoded codes, as
    ``torch.serialization.add_safe_globals`` is documented to take them. The file was parsed by
    the converter first, so it holds no array of another dtype. Without that API (torch before
    2.6, or one that refuses the names), nothing is added."""
    import numpy as np

    from ._torch_policy import NUMPY_CODES

    try:
        core = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
        reconstruct = core.multiarray._reconstruct
        allowed: list[Any] = [
            reconstruct,
            np.ndarray,
            np.dtype,
            *sorted({type(np.dtype(code)) for code in NUMPY_CODES}, key=str),
        ]
        own = f"{reconstruct.__module__}.{reconstruct.__name__}"
        if torch.__version__ >= "2.6":  # (object, name) entries: pickles of the other numpy
            other = {"numpy.core": "numpy._core", "numpy._core": "numpy.core"}
            module = own.rsplit(".", 2)[0]
            allowed.append((reconstruct, own.replace(module, other.get(module, module), 1)))
        return torch.serialization.safe_globals(allowed)  # type: ignore[no-any-return]
    except (AttributeError, TypeError):
        return contextlib.nullcontext()


#: Tensors are hashed in contiguous pieces of about this many bytes.
_PIECE_BYTES: Final = 4 << 20


def _torch_pieces(t: Any, scratch: list[Any] | None = None) -> Iterator[Any]:
    """A tensor's values in row-major order as contiguous tensors of about
    :data:`_PIECE_BYTES` each, views resolved (conjugate, negative), each valid until the
    next is asked for: slices of it where it is contiguous (views of its memory), else blocks
    of rows copied into one reused buffer (rows larger than that cut into their own rows; a
    fresh copy per block made the allocator keep ~30 MiB)."""
    import torch

    if t.dim() == 0:
        yield t.resolve_conj().resolve_neg().contiguous()
        return
    if t.is_contiguous():
        flat = t.reshape(-1)
        step = max(1, _PIECE_BYTES // t.element_size())
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step].resolve_conj().resolve_neg()
        return
    if not t.numel():
        return
    scratch = [] if scratch is None else scratch
    row_bytes = t[0].numel() * t.element_size()
    if row_bytes > _PIECE_BYTES and t.dim() > 1:
        for row in t:
            yield from _torch_pieces(row, scratch)
        return
    step = max(1, _PIECE_BYTES // max(1, row_bytes))
    for start in range(0, t.shape[0], step):
        block = t[start : start + step]
        if block.is_conj() or block.is_neg():
            yield block.resolve_conj().resolve_neg().contiguous()  # lazy views: small, rare
            continue
        if not scratch:
            scratch.append(torch.empty(_PIECE_BYTES + row_bytes, dtype=torch.uint8))
        size = block.numel() * block.element_size()
        out = scratch[0][:size].view(block.dtype).view(block.shape)
        out.copy_(block)
        yield out


# --------------------------------------------------------------------------------------------
# Folders and shards.
# --------------------------------------------------------------------------------------------

_SHARD: Final = re.compile(r"^[A-Za-z0-9_.\-]+$")


def safetensors_name(name: str) -> str:
    """The safetensors file name for a checkpoint name, as the hub's converter renames it.

    ``pytorch_model.bin`` -> ``model.safetensors``;
    ``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``;
    any other ``stem.ext`` -> ``stem.safetensors``.
    """
    stem, _ = os.path.splitext(name)
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model") :]
    return stem + ".safetensors"


def _check_shard_name(name: Any) -> str:
    # Index entries are untrusted: plain file names in the same folder only.
    if (
        type(name) is not str
        or not _SHARD.match(name)
        or name in (".", "..")
        or not name.endswith(CHECKPOINT_SUFFIXES)
    ):
        raise CheckpointError(f"index names an invalid shard file {name!r}")
    return name


def convert_folder(
    src_dir: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    *,
    executor: Executor | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    **kwargs: Any,
) -> FolderReport:
    """Convert the checkpoints of a folder, including a sharded ``pytorch_model`` with index.

    With ``pytorch_model.bin.index.json``, each listed shard becomes
    ``model-0000x-of-0000y.safetensors`` and ``model.safetensors.index.json`` is written in the
    hub's format (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``, other
    metadata keys of the source index kept); an index that lists a tensor in another shard
    than the one holding it, or in none, is refused, and files of the hub's names the new
    index does not name (a ``model.safetensors``, which transformers opens first; shards of
    another count) are deleted once the index is in place. Otherwise ``pytorch_model.bin`` becomes
    ``model.safetensors`` and every other ``*.bin/*.pt/*.pth/*.ckpt`` becomes
    ``<stem>.safetensors``. Other files are not copied.

    All or nothing: every input is checked to exist and open first, the outputs are written to
    a temporary folder inside ``dst_dir`` and moved into place (the index last) only once every
    file converted. On failure ``dst_dir`` keeps what it held (and is removed again if this
    call created it), and the error names the checkpoint that failed. With ``unknown="skip"``,
    a checkpoint beside the model that is one object of an unknown class as a whole (a
    Trainer's ``training_args.bin``, a whole optimizer) is left out instead
    (:attr:`FolderReport.left_out`); an index shard or ``pytorch_model*`` file never is.

    Args:
        src_dir: Folder holding the checkpoints.
        dst_dir: Folder for the results (created; may be ``src_dir``).
        executor: Any ``concurrent.futures.Executor`` (thread or process pool, Ray's or Dask's)
            to convert files in parallel; each task is one :func:`convert_file` call.
        progress: ``progress(file_name, done_files, total_files)`` after each file.
        **kwargs: Passed to :func:`convert_file` (``verify``, ``keep_non_tensors``,
            ``unknown="skip"``...).

    Returns:
        A :class:`FolderReport`.

    Raises:
        UnsafePickleError: A checkpoint imports a global outside the allow-list (the message
            starts with its path).
        CheckpointError: An input is missing (kind ``"MissingCheckpoint"``), broken or
            unsupported, the index is invalid or disagrees with its shards (``"IndexMismatch"``),
            or the folder holds nothing to convert (``"NothingToConvert"``).
        OSError: A file cannot be read or written.
    """
    src_s, dst_s = input_path(src_dir, "src_dir"), output_path(dst_dir, "dst_dir")
    _check_unknown(kwargs.get("unknown", "error"))
    _refuse_url(src_s)
    index_path = os.path.join(src_s, _INDEX_IN)
    index: dict[str, Any] | None = None
    if os.path.exists(index_path):
        if os.path.getsize(index_path) > _MAX_INDEX_BYTES:
            raise CheckpointError(f"{index_path} is larger than {_MAX_INDEX_BYTES} bytes")
        with open(open_regular_file(index_path), encoding="utf-8") as fh:
            try:
                index = json.load(fh)
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"{index_path} is not valid JSON ({exc})") from None
        if type(index) is not dict or type(index.get("weight_map")) is not dict:
            raise CheckpointError(f"{index_path} has no weight_map object")
        names = sorted({_check_shard_name(v) for v in index["weight_map"].values()})
    else:
        names = sorted(
            n
            for n in os.listdir(src_s)
            if n.endswith(CHECKPOINT_SUFFIXES) and os.path.isfile(os.path.join(src_s, n))
        )
    if not names:
        # An empty result would look like success for a mistyped folder.
        raise CheckpointError(
            f"{src_s}: nothing to convert (no {_INDEX_IN} and no "
            f"{', '.join('*' + s for s in CHECKPOINT_SUFFIXES)} files)",
            kind="NothingToConvert",
        )
    _check_inputs(src_s, names, index_path if index is not None else None)
    outs = [safetensors_name(n) for n in names]
    if len(set(outs)) != len(outs):
        raise CheckpointError("two checkpoints would be written to the same safetensors file")
    created = not os.path.isdir(dst_s)
    make_folder(dst_s)  # a file where the folder should be is named
    # Everything is written to a private folder inside dst and moved into place only when
    # every file converted: a failure midway leaves dst as it was, never a half model that
    # looks valid (an index with missing shards, or only some of the files).
    try:
        work = tempfile.mkdtemp(prefix=".pysafetensors-convert-", dir=dst_s)
    except OSError as exc:
        # Named as the folder the caller gave, not the private one that could not be made.
        raise write_error(exc, dst_s) from exc
    ok = False
    try:
        jobs = [
            (os.path.join(src_s, n), os.path.join(work, o))
            for n, o in zip(names, outs, strict=True)
        ]
        # With unknown="skip", a file beside the model that pickles one object as a whole (a
        # Trainer folder always holds training_args.bin) is left out rather than failing the
        # folder; the model's own files must convert.
        leavable = {
            s
            for (s, _), n in zip(jobs, names, strict=True)
            if kwargs.get("unknown") == "skip"
            and index is None
            and not n.startswith("pytorch_model")
        }
        done = _run_jobs(jobs, executor, progress, kwargs, dst_s, leavable)
        results = [r for r in done if isinstance(r, ConversionReport)]
        report = FolderReport(files=results)
        report.left_out = {
            s: str(r) for (s, _), r in zip(jobs, done, strict=True) if type(r) is str
        }
        if not results:
            raise CheckpointError(
                f"{src_s}: nothing converted: every checkpoint is one object of an unknown "
                f"class as a whole ({', '.join(sorted(map(os.path.basename, report.left_out)))})"
            )
        index_tmp: str | None = None
        if index is not None:
            _check_index_agrees(index["weight_map"], results, index_path, kwargs)
            index_tmp = _write_index(index, results, work)
        for r in results:
            final = os.path.join(dst_s, os.path.basename(r.dst))
            _move(r.dst, final)
            r.dst = final
        if index_tmp is not None:
            # Last, so a reader never sees an index naming shards not yet in place.
            report.index = os.path.join(dst_s, _INDEX_OUT)
            _move(index_tmp, report.index)
            # Files of an earlier save of the hub's names that the new index does not name,
            # as a sharded save removes them: shards of another count, and a single-file
            # conversion's model.safetensors, which transformers opens before any index (it
            # loaded the old weights).
            written = [os.path.basename(r.dst) for r in results]
            remove_stale_files(dst_s, _OUTPUT_PATTERN, [*written, _INDEX_OUT])
        ok = True
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not ok and created:
            with contextlib.suppress(OSError):
                os.rmdir(dst_s)  # only if empty: what we created, nothing else


def _check_inputs(src_dir: str, names: list[str], index_path: str | None) -> None:
    """Every checkpoint to convert exists and opens, before anything is written."""
    missing = [n for n in names if not os.path.isfile(os.path.join(src_dir, n))]
    if missing:
        where = f"listed in {index_path}" if index_path else "in the folder"
        raise CheckpointError(
            f"{len(missing)} checkpoint file(s) {where} missing or not files: "
            + first_five([repr(os.path.join(src_dir, n)) for n in missing]),
            kind="MissingCheckpoint",
        )
    for n in names:
        # PermissionError names the file; a FIFO put in place since is refused, not waited on.
        os.close(open_regular_file(os.path.join(src_dir, n)))


def _move(work_path: str, final: str) -> None:
    """Rename a finished output from the private folder into place."""
    try:
        os.replace(work_path, final)
    except OSError as exc:
        raise write_error(exc, final) from exc


def _user_facing(exc: WriteError, src: str, dst_dir: str) -> WriteError:
    """``exc`` (a write to the private folder failed) naming the file the caller will look
    for in ``dst_dir``, and the checkpoint being converted."""
    final = os.path.join(dst_dir, os.path.basename(exc.filename or ""))
    named = write_error(exc, final)
    add_note(named, f"while converting {src}")
    return named


def _run_jobs(
    jobs: list[tuple[str, str]],
    executor: Executor | None,
    progress: Callable[[str, int, int], None] | None,
    kwargs: dict[str, Any],
    dst_dir: str,
    leavable: set[str],
) -> list[ConversionReport | str]:
    """Each job's report, or for a checkpoint of ``leavable`` that is one skipped object as a
    whole, why it was left out."""
    results: list[ConversionReport | str] = []
    if executor is None:
        for i, (s, d) in enumerate(jobs):
            try:
                results.append(
                    _left_out_or_raise(functools.partial(convert_file, s, d, **kwargs), s, leavable)
                )
            except WriteError as exc:
                raise _user_facing(exc, s, dst_dir) from exc
            if progress is not None:
                progress(os.path.basename(s), i + 1, len(jobs))
        return results
    futures: list[Future[ConversionReport]] = []
    try:
        # A Ctrl-C inside submit could leave its lock held for good: held until the jobs are
        # handed over, then raised here, inside the try, so that they are cancelled and waited
        # for as any other failure's.
        with interrupts_deferred():
            futures.extend(executor.submit(convert_file, s, d, **kwargs) for s, d in jobs)
        for i, fut in enumerate(futures):
            try:
                results.append(_left_out_or_raise(fut.result, jobs[i][0], leavable))
            except WriteError as exc:
                raise _user_facing(exc, jobs[i][0], dst_dir) from exc
            if progress is not None:
                progress(os.path.basename(jobs[i][0]), i + 1, len(jobs))
    except BaseException:
        # Let running conversions finish before the caller removes their folder.
        for fut in futures:
            fut.cancel()
        wait(futures)
        raise
    return results


def _left_out_or_raise(
    call: Callable[[], ConversionReport], src: str, leavable: set[str]
) -> ConversionReport | str:
    """``call()``'s report, or where ``src`` is ``leavable`` and is one skipped object as a
    whole, why it was left out."""
    try:
        return call()
    except CheckpointError as exc:
        if src not in leavable or exc.kind != SKIPPED_WHOLE:
            raise
        text = str(exc)
        return text[len(src) + 2 :] if text.startswith(f"{src}: ") else text


def _check_index_agrees(
    weight_map: dict[str, Any],
    results: list[ConversionReport],
    index_path: str,
    kwargs: dict[str, Any],
) -> None:
    """Refuse a source index that lists a tensor in another shard than the one holding it, or
    one that no shard holds (the output's index, built from the shards, would drop it without
    a word). Tensors of skipped objects and a ``subtree``'s renamed ones cannot be matched."""
    held: dict[str, str] = {}
    for r in results:
        for name in (*r.tensors, *r.dropped):
            held[name] = os.path.basename(r.src)
    lenient = kwargs.get("subtree") is not None or any(
        r.skipped_tensors or r.skipped_objects for r in results
    )
    misplaced = [
        f"{name!r} (listed in {shard}, held by {held[name]})"
        for name, shard in weight_map.items()
        if name in held and shard != held[name]
    ]
    absent = [] if lenient else [repr(name) for name in weight_map if name not in held]
    for problems, what in ((misplaced, "in another shard"), (absent, "in no shard")):
        if problems:
            raise CheckpointError(
                f"{index_path} lists {len(problems)} tensor(s) {what}: {first_five(problems)}",
                kind="IndexMismatch",
            )


def _write_index(index: dict[str, Any], results: list[ConversionReport], folder: str) -> str:
    weight_map: dict[str, str] = {}
    for r in results:
        for name in r.tensors:
            if name in weight_map:
                raise CheckpointError(
                    f"tensor {name!r} appears in two shards ({weight_map[name]} and "
                    f"{os.path.basename(r.src)})"
                )
            weight_map[name] = os.path.basename(r.dst)
    old_meta = index.get("metadata")
    index_meta: dict[str, Any] = dict(old_meta) if type(old_meta) is dict else {}
    index_meta["total_size"] = sum(r.total_size for r in results)
    out_index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
    path = os.path.join(folder, _INDEX_OUT)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out_index, fh, indent=2, sort_keys=False)
        fh.write("\n")
    return path


# --------------------------------------------------------------------------------------------
# Back to torch.
# --------------------------------------------------------------------------------------------


def to_torch_bin(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, restore_shared: bool = False
) -> list[str]:
    """Write a safetensors file as a ``torch.save`` checkpoint (needs torch).

    Args:
        src: The safetensors file.
        dst: The ``.bin``/``.pt`` file to write (atomically).
        restore_shared: For metadata entries ``{dropped: kept}`` naming a tensor of the file
            (as :func:`convert_file` and ``save_model`` write them), add ``dropped`` back as the
            same tensor. Any entry whose value is a tensor name counts (``"format"`` excepted),
            so use it on files those functions wrote. :func:`convert_file` never keeps a
            non-tensor value whose JSON text is a tensor name; one written by an earlier
            version with ``keep_non_tensors`` (``{"epoch": "1"}`` beside a tensor ``"1"``)
            cannot be told from a tie, and comes back as that tensor.

    Returns:
        The tensor names written.

    Raises:
        SafetensorError: The safetensors file is invalid.
        ImportError: torch is not installed.
    """
    import torch

    src_s, dst_s = input_path(src, "src"), output_path(dst, "dst", file=True)
    header, data_start = _read_output(src_s)
    state: dict[str, Any] = {}
    for name, info in header.tensors.items():
        tname = info.dtype.torch
        if tname is None or not hasattr(torch, tname):
            raise SafetensorError(f"torch cannot hold {info.dtype.code} (tensor {name!r})")
        raw = bytearray(b"".join(_output_chunks(src_s, data_start + info.begin, info.nbytes)))
        shape = list(info.shape)
        if info.dtype.code == "F4":
            shape[-1] //= 2
        dtype = getattr(torch, tname)
        if raw:
            t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        state[name] = t
    if restore_shared and header.metadata:
        for dropped, kept in header.metadata.items():
            if dropped != "format" and dropped not in state and kept in state:
                state[dropped] = state[kept]
    tmp = f"{dst_s}.partial"
    try:
        torch.save(state, tmp)
        os.replace(tmp, dst_s)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return list(state)
