"""Write a file whose tensors arrive piece by piece, in any order, with bounded memory.

The header must be known before any data, so every tensor's name, dtype and shape is declared
up front; the layout (and so each tensor's place in the file) is then fixed, and each write goes
straight to its computed offset with ``pwrite``. Nothing is buffered: the data in memory is
whatever the caller passes to one :meth:`StreamingWriter.write` call. The record of the ranges
written (:class:`~pysafetensors._coverage.Coverage`) grows with the number of separate ranges,
not with bytes: touching writes merge into one.

The writer keeps, per tensor, the byte ranges written so far. It refuses writes outside a
tensor, writes that overlap earlier ones, and committing while any byte is still unwritten.
The output goes to a temporary file that replaces the target only on a successful
:meth:`~StreamingWriter.close`; an exception inside a ``with`` block discards it. The result is
byte-identical to saving the same tensors in one call.

:class:`ShardedStreamingWriter` does the same for a sharded checkpoint: shards are planned up
front with the hub's splitter, one writer per shard, and the index is written last.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import operator
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import numpy as np

from ._adapter import get_adapter
from ._coverage import Coverage
from ._dtypes import DType, checked_nbits, dtype_from_code, dtype_from_name
from ._errors import (
    ClosedFileError,
    PathArg,
    SafetensorError,
    SerializeError,
    add_note,
    make_folder,
    output_path,
    write_error,
)
from ._format import MAX_HEADER_SIZE, SERIALIZE_PREFIX, TensorInfo, gc_paused
from ._interrupts import ClosedWhenDropped
from ._layout import Layout, build_layout, check_metadata
from ._representable import MAX_NDIM
from ._sharding import (
    DEFAULT_FILENAME_PATTERN,
    MAX_SHARD_SIZE,
    ShardPlan,
    adapter_for,
    checkpoint_group,
    index_json,
    is_torch,
    split_into_shards,
    torch_storage_id,
    write_checkpoint,
)
from ._writer import (
    CommitReceipt,
    SaveGroup,
    Writeback,
    allow_descriptors,
    atomic_output,
    pwrite_all,
    reserve_space,
)

__all__ = ["ShardedStreamingWriter", "StreamingWriter", "TensorDecl", "as_dtype"]

TensorDecl = tuple[str, DType, tuple[int, ...]]


class _Discard(Exception):
    """Thrown into the output context to make it delete the temporary file."""


def as_dtype(value: Any) -> DType:
    """Read a dtype given as a code (``"F32"``), a name (``"float32"``), a numpy dtype or type,
    or a torch dtype.

    Raises:
        SerializeError: Not a dtype safetensors can store.
    """
    if isinstance(value, DType):
        return value
    if value is None:
        # np.dtype(None) is float64: a missing dtype must not become one.
        raise SerializeError(f"{SERIALIZE_PREFIX}None is not a dtype", kind="UnknownDtype")
    if isinstance(value, str):
        try:  # (not contextlib.suppress: a context manager per declaration cost ~0.4 us)
            return dtype_from_code(value)
        except Exception:  # noqa: BLE001, S110 - not a code: read as a name below
            pass
        return dtype_from_name(value.removeprefix("torch."))
    text = str(value)
    if text.startswith("torch."):
        return dtype_from_name(text.removeprefix("torch."))
    try:
        name = np.dtype(value).name
    except TypeError:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}{value!r} is not a dtype", kind="UnknownDtype"
        ) from None
    return dtype_from_name(name)


def _declare(name: Any, value: Any) -> TensorDecl:
    if type(value) is tuple and len(value) == 2:
        # The common form first: the tests below took ~2 us of each of 100,000 declarations.
        return _declare_pair(name, value[0], value[1])
    torch_value = is_torch(value)
    if torch_value and value.is_meta:
        # Only the dtype and shape are wanted: a meta tensor has no data to convert. Its shape
        # is the file's by the torch adapter's rule (float4_e2m1fn_x2 packs two values).
        from ._torch_adapter import logical_shape

        dtype = _declared_dtype(name, value.dtype)
        return str(name), dtype, logical_shape(dtype, _dims(name, value.shape))
    if torch_value or isinstance(value, np.ndarray):
        data = adapter_for(value).to_data(str(name), value)
        return str(name), data.dtype, data.shape
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # TensorMeta, SafeSlice
        return str(name), _declared_dtype(name, value.dtype), _dims(name, value.shape)
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor `{name}` is declared as {type(value).__name__} "
            f"{value!r:.60}: expected (dtype, shape), an array or a tensor",
            kind="TensorInvalidInfo",
            tensor=str(name),
        )
    dtype, shape = value
    return _declare_pair(name, dtype, shape)


def _declare_pair(name: Any, dtype: Any, shape: Any) -> TensorDecl:
    """A ``(dtype, shape)`` declaration."""
    declared = _declared_dtype(name, dtype)
    if type(dtype).__module__ == "torch":
        # torch's shape, as a meta tensor's above: a (3, 4) float4_e2m1fn_x2 is F4 [3, 8].
        from ._torch_adapter import logical_shape

        return str(name), declared, logical_shape(declared, _dims(name, shape))
    return str(name), declared, _dims(name, shape)


def _declared_dtype(name: Any, value: Any) -> DType:
    """A declaration's dtype; one that is none names its tensor (among thousands of
    declarations, ``Unknown dtype "F99"`` did not say which was wrong)."""
    try:
        return as_dtype(value)
    except SerializeError as exc:
        raise SerializeError(f"{exc} (tensor `{name}`)", kind=exc.kind, tensor=str(name)) from None


def _dims(name: Any, shape: Any) -> tuple[int, ...]:
    """A declared shape as non-negative ints (2.5 was taken as 2, True as 1, -1 failed only
    at close)."""
    dims = []
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor `{name}` is declared with shape {shape!r:.60}: expected "
            "a sequence of non-negative integers",
            kind="TensorInvalidInfo",
            tensor=str(name),
        )
    try:
        shape = list(shape)  # once: a generator's values are gone after one pass
    except TypeError:
        # Iterable by its type only: a 0-d numpy array raised numpy's own TypeError.
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor `{name}` is declared with shape {shape!r:.60}: expected "
            "a sequence of non-negative integers",
            kind="TensorInvalidInfo",
            tensor=str(name),
        ) from None
    for d in shape:
        try:
            value = -1 if isinstance(d, (bool, np.bool_)) else operator.index(d)
        except TypeError:
            value = -1
        if value < 0:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is declared with shape {shape}: "
                "dimensions must be non-negative integers",
                kind="TensorInvalidInfo",
                tensor=str(name),
            )
        dims.append(value)
    if len(dims) > MAX_NDIM:
        # A file no framework could load (numpy and torch hold at most 64): not written.
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor `{name}` is declared with {len(dims)} dimensions; "
            f"frameworks hold at most {MAX_NDIM}",
            kind="TooManyDimensions",
            tensor=str(name),
        )
    return tuple(dims)


def _check_name(name: Any, where: str) -> None:
    """Refuse a declared name that is not a str (``where`` says which declaration)."""
    if not isinstance(name, str):
        raise SerializeError(
            f"{SERIALIZE_PREFIX}{where} with a name of type {type(name).__name__} "
            f"({name!r:.60}): tensor names are str",
            kind="TensorInvalidInfo",
        )


def _declarations(tensors: Any) -> list[TensorDecl]:
    """Normalise ``{name: (dtype, shape)}``, ``{name: array_or_meta}`` or ``[(name, dtype,
    shape)]``."""
    if isinstance(tensors, Mapping):
        for name in tensors:
            _check_name(name, "a tensor is declared")
        return [_declare(k, v) for k, v in tensors.items()]
    if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__"):
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensors are declared as {type(tensors).__name__}: expected "
            "{name: (dtype, shape)}, {name: array} or [(name, dtype, shape), ...]",
            kind="TensorInvalidInfo",
        )
    out = []
    seen: set[str] = set()
    for index, item in enumerate(tensors):
        if isinstance(item, (str, bytes)) or not isinstance(item, (tuple, list)) or len(item) != 3:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}declaration {index} is {item!r:.60}: expected "
                "(name, dtype, shape)",
                kind="TensorInvalidInfo",
            )
        name, dtype, shape = item
        _check_name(name, f"declaration {index} is given")
        if name in seen:
            # Checked here for every writer: the sharded one plans shards by name, and a
            # repeated declaration would silently replace the first.
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor name `{name}` appears twice",
                kind="DuplicateName",
                tensor=name,
            )
        seen.add(name)
        out.append(_declare(name, (dtype, shape)))
    return out


def _payload(name: str, info: TensorInfo, data: Any) -> tuple[int, Iterator[memoryview]]:
    """Byte length and byte chunks of what a caller passed to ``write``."""
    torch_data = is_torch(data)
    if torch_data or isinstance(data, np.ndarray):
        td = get_adapter("pt" if torch_data else "numpy").to_data(name, data)
        if td.dtype is not info.dtype:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` was declared {info.dtype.code} but data of "
                f"dtype {td.dtype.code} was written to it",
                kind="DtypeMismatch",
                tensor=name,
            )
        if td.whole is not None:
            # One flat buffer already (whole bytes, in file order): no generator, no cast.
            return td.whole.nbytes, iter((td.whole,))
        nbits = checked_nbits(td.shape, td.dtype) or 0
        if nbits % 8:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}a write to `{name}` of shape {list(td.shape)} is not a whole "
                "number of bytes",
                kind="MisalignedSlice",
                tensor=name,
            )

        def chunks() -> Iterator[memoryview]:
            for chunk in td.chunks():
                view = memoryview(chunk)
                yield view.cast("B") if view.format != "B" or view.ndim != 1 else view

        return nbits // 8, chunks()
    try:
        view = memoryview(data)
    except TypeError:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}a write to `{name}` got a {type(data).__name__}; expected bytes, "
            "a buffer, a numpy array or a torch tensor",
            kind="InvalidTensor",
            tensor=name,
        ) from None
    if not view.c_contiguous:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}a write to `{name}` got a non-contiguous buffer", tensor=name
        )
    if not view.nbytes:
        # memoryview cannot cast a view with a 0 in its shape (an empty 2-D buffer raised
        # TypeError); there is nothing to write either way.
        return 0, iter(())
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return view.nbytes, iter((view,))


#: Writers neither closed nor aborted. Those still open when the interpreter exits are aborted
#: then, while modules still work (a finalizer during teardown could not remove the temporary
#: file, and printed errors): a writer left open is an abandoned one. Sharded writers too: the
#: shards they finished wait in their group, which no shard writer's abort reaches.
_OPEN_WRITERS: Final[weakref.WeakSet[StreamingWriter | ShardedStreamingWriter]] = weakref.WeakSet()
_OPEN_WRITERS_LOCK = threading.Lock()


@atexit.register
def _abort_open_writers() -> None:
    with _OPEN_WRITERS_LOCK:
        writers = list(_OPEN_WRITERS)
    for writer in writers:
        with contextlib.suppress(Exception):
            writer.abort()


def _disown_writers() -> None:
    # A forked child must not abort (delete the temporary files of) its parent's writers when
    # it exits: they are the parent's.
    global _OPEN_WRITERS_LOCK
    _OPEN_WRITERS_LOCK = threading.Lock()
    _OPEN_WRITERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_writers)


def _check_whole(info: TensorInfo, length: int) -> None:
    """Refuse data for ``write_tensor`` that is not the whole tensor."""
    if length != info.nbytes:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}write_tensor of `{info.name}`: the data holds {length} bytes but "
            f"{info.dtype.code} {list(info.shape)} needs {info.nbytes} (write parts with write() "
            "or write_chunk())",
            kind="TensorInvalidInfo",
            tensor=info.name,
        )


def _check_element_offset(info: TensorInfo, offset: int, data: Any) -> None:
    """Refuse an array written at a byte offset inside one of the tensor's elements.

    Its elements would straddle the tensor's, every value garbled: the usual sign of an offset
    given in elements rather than bytes. Raw bytes may be cut anywhere.
    """
    width = info.dtype.bits // 8
    if width <= 1 or not offset % width or not 0 <= offset < info.nbytes:
        return  # (a write outside the tensor is refused as such when its range is reserved)
    if isinstance(data, np.ndarray) or is_torch(data):
        raise SerializeError(
            f"{SERIALIZE_PREFIX}an array written to `{info.name}` at byte offset {offset}, "
            f"which is not a multiple of its {width}-byte {info.dtype.code} elements (offsets "
            "are in bytes: element i of the data starts at byte i * itemsize)",
            kind="MisalignedSlice",
            tensor=info.name,
        )


def _offset(name: str, offset: Any) -> int:
    """A write's offset as an int: any integer, numpy's too (offsets from ``np.cumsum`` are
    ``np.int64``); a float or a bool is refused."""
    try:
        if isinstance(offset, (bool, np.bool_)):
            raise TypeError
        return operator.index(offset)
    except TypeError:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}the offset of a write to `{name}` must be an int, got "
            f"{type(offset).__name__}",
            kind="OutOfRange",
            tensor=name,
        ) from None


class StreamingWriter(ClosedWhenDropped):
    """Write one safetensors file tensor by tensor, chunk by chunk, in any order.

    Args:
        filename: Target path; replaced only when :meth:`close` succeeds.
        tensors: Declarations: ``{name: (dtype, shape)}``, ``{name: array}`` (its dtype and
            shape; no data is read), ``{name: TensorMeta}``, or ``[(name, dtype, shape)]``.
            A dtype may be a code (``"BF16"``), a name (``"bfloat16"``), a numpy or a torch dtype.
            With a torch dtype the shape is torch's, as a tensor's (``float4_e2m1fn_x2`` of
            shape ``(3, 4)`` is F4 ``[3, 8]``); with a code or name, it is the file's.
        metadata: ``__metadata__`` (str to str) or None.
        fsync: Make the file durable on close.
        max_header_size: Largest header accepted.
        group: Leave the finished file to this :class:`~pysafetensors._writer.SaveGroup` on
            ``close``, to be renamed into place with the group's other files.

    Raises:
        SerializeError: A declaration is invalid (as for any save).

    Example:
        >>> import numpy as np, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "big.safetensors")
        >>> with StreamingWriter(path, {"w": ("F32", (4, 2))}) as w:
        ...     w.write("w", np.ones((2, 2), np.float32))              # rows 0-1
        ...     w.write("w", np.zeros((2, 2), np.float32), offset=16)  # rows 2-3
        16
        16
    """

    def __init__(
        self,
        filename: PathArg,
        tensors: Any,
        metadata: Mapping[str, str] | None = None,
        *,
        fsync: bool = False,
        max_header_size: int = MAX_HEADER_SIZE,
        group: SaveGroup | None = None,
    ) -> None:
        self._fd = -1
        self._writeback: Writeback | None = None
        self._cm: contextlib.AbstractContextManager[int] | None = None
        decls = _declarations(tensors)
        layout = build_layout(decls, metadata, max_header_size=max_header_size)
        self._open(filename, layout, fsync=fsync, group=group)

    @classmethod
    def _planned(
        cls, filename: str, layout: Layout, *, fsync: bool, group: SaveGroup | None
    ) -> StreamingWriter:
        """A writer of a file laid out already: a sharded writer's shard, whose declarations
        were checked and whose file was laid out when the sharded writer was opened (doing it
        again per shard was a fifth of the cost of streaming 100,000 small tensors)."""
        self = cls.__new__(cls)
        self._fd = -1
        self._writeback = None
        self._cm = None
        self._open(filename, layout, fsync=fsync, group=group)
        return self

    def _open(
        self, filename: PathArg, layout: Layout, *, fsync: bool, group: SaveGroup | None
    ) -> None:
        """Begin the temporary file of ``layout`` (the rest of ``__init__``)."""
        self.layout: Layout = layout
        """The planned file: header bytes and every tensor's offsets."""
        self._infos = {t.name: t for t in self.layout.tensors}
        self._data_start = len(self.layout.header)
        self._written: dict[str, Coverage] = {name: Coverage() for name in self._infos}
        # Bytes not yet reserved by a write: 0 once every byte is written or being written.
        self._left = sum(info.nbytes for info in self._infos.values())
        self._cursor: dict[str, int] = dict.fromkeys(self._infos, 0)
        self._lock = threading.Lock()
        # Writes between reserving their range and finishing it: close() and abort() wait for
        # them (a close that did not committed a file whose reserved bytes were never written,
        # and the write then went to whatever file reused the closed descriptor).
        # One token per write, with the thread writing: not a count, so that an interrupt
        # (Ctrl-C) at any point of a write leaves it right (a count raised just before the
        # write's `try` stayed raised, and close() then waited for ever). close() and abort()
        # wait only for other threads' writes: one of their own thread can only be one that
        # an interrupt cut short, even inside its `finally`.
        self._inflight: dict[object, int] = {}
        self._idle = threading.Condition(self._lock)
        self._stopping = False
        # What became of the file once no longer open for writes: "closing" while a close()
        # commits it (outside the lock: an fsync can take long), then "committed", "aborted"
        # or "failed". A second close() waits for the first's outcome and reports it: it
        # returned at once, before the file existed (or after the commit had failed), and a
        # sharded close then committed its index without that shard.
        self._state = "open"
        self._failure: BaseException | None = None
        # The thread (and process) committing: a wait for the commit made on that thread
        # (an interrupt's handler, __exit__ after an interrupted close) or in a forked child
        # would never end.
        self._closer: tuple[int, int] | None = None
        self.filename = output_path(filename, file=True)
        self._receipt = CommitReceipt()
        cm = atomic_output(self.filename, fsync=fsync, group=group, receipt=self._receipt)
        fd = cm.__enter__()
        try:
            # A sparse file of the final size: writes may land anywhere, in any order.
            try:
                os.ftruncate(fd, self.layout.file_size)
            except OverflowError:
                # Past the largest file offset (2^63-1): the file system's own refusal.
                raise write_error(
                    OSError(errno.EFBIG, os.strerror(errno.EFBIG)), self.filename
                ) from None
            reserve_space(fd, self.layout.file_size)  # tuning's preallocate: fail at once
            pwrite_all(fd, self.layout.header, 0)
        except BaseException as exc:
            cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._cm = cm
        self._fd = fd
        self._pid = os.getpid()  # a forked child's copy is not the writer: see __del__
        with _OPEN_WRITERS_LOCK:
            _OPEN_WRITERS.add(self)
        # Durable writers start the disk on each ~16 MiB written, so closing waits less.
        self._writeback = Writeback(fd) if fsync else None

    # ------------------------------------------------------------------------------ writing

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except (KeyError, TypeError):
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` was not declared when the writer was opened",
                kind="UnknownTensor",
                tensor=str(name),
            ) from None

    def _reserve(self, info: TensorInfo, start: int, length: int) -> None:
        """Record ``[start, start+length)`` as written, refusing overlaps and out-of-range."""
        name = info.name
        if start < 0 or start + length > info.nbytes:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}write of {length} bytes at offset {start} is outside tensor "
                f"`{name}` ({info.dtype.code} {list(info.shape)} holds {info.nbytes} bytes)",
                kind="OutOfRange",
                tensor=name,
            )
        if not length:
            return
        end = start + length
        other = self._written[name].add(start, end)
        if other is not None:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}write of bytes [{start}, {end}) of tensor `{name}` overlaps "
                f"bytes [{other[0]}, {other[1]}) written earlier",
                kind="Overlap",
                tensor=name,
            )
        self._left -= length

    def write(self, name: str, data: Any, offset: int = 0) -> int:
        """Write bytes of tensor ``name`` starting ``offset`` bytes into its data.

        Args:
            name: A declared tensor.
            data: Raw bytes (any contiguous buffer: ``bytes``, ``memoryview``, ...), or a numpy
                array / torch tensor of the declared dtype (its C-order little-endian bytes;
                any shape, e.g. a block of rows).
            offset: Byte offset within the tensor (rows ``r:`` of a 2-D tensor start at
                ``r * row_bytes``): an integer, numpy's too (a float or bool is refused).

        Returns:
            The number of bytes written.

        Raises:
            SerializeError: Unknown tensor, wrong dtype, out of range, or overlapping an earlier
                write (nothing is written then).
            ClosedFileError: The writer was closed.
        """
        self._live(name)
        info = self._info(name)
        at = _offset(name, offset)
        length, chunks = _payload(name, info, data)
        _check_element_offset(info, at, data)
        return self._write_payload(info, at, length, chunks)

    def _write_payload(
        self, info: TensorInfo, offset: int, length: int, chunks: Iterable[memoryview]
    ) -> int:
        """Write ``length`` bytes of ``chunks`` at ``offset`` into ``info``'s data."""
        name = info.name
        token = object()
        reserved = False
        got = 0
        try:
            with self._lock:
                if self._cm is None or self._stopping:
                    raise self._closed_error(name)
                fd = self._fd
                cursor = self._cursor[name]
                self._reserve(info, offset, length)
                reserved = True
                self._cursor[name] = offset + length
                self._inflight[token] = threading.get_ident()
            pos = self._data_start + info.begin + offset
            for view in chunks:
                if self._stopping:
                    raise ClosedFileError(
                        f"the streaming writer was aborted during a write to `{name}`",
                        kind="FileClosed",
                    )
                if got + view.nbytes > length:
                    raise SerializeError(f"{SERIALIZE_PREFIX}internal error: chunk overrun")
                pwrite_all(fd, view, pos + got)
                got += view.nbytes
            if got != length:
                # Counted as written whole once this returns: a short producer would leave
                # a hole that close() commits.
                raise SerializeError(
                    f"{SERIALIZE_PREFIX}internal error: {got} of {length} bytes of tensor "
                    f"`{name}` were produced",
                    tensor=name,
                )
            if self._writeback is not None:
                # Still counted in flight: close() cannot have closed the descriptor yet.
                self._writeback.wrote(pos, got)
        except BaseException as exc:
            # Nothing of a failed write counts as written (a full disk, a file size limit, a
            # failing producer): the range may be written again, and close() will not commit
            # a file with a hole in it.
            if reserved:
                with self._lock:
                    self._release(info, offset, offset + length)
                    if self._cursor[name] == offset + length:
                        self._cursor[name] = cursor
            if isinstance(exc, OSError) and not isinstance(exc, SafetensorError):
                error = write_error(exc, self.filename)
                error.tensor = name
                add_note(
                    error,
                    f"while writing bytes [{offset}, {offset + length}) of tensor `{name}` "
                    f"(file offset {self._data_start + info.begin + offset})",
                )
                raise error from exc
            raise
        finally:
            with self._lock:
                self._inflight.pop(token, None)
                if not self._inflight:
                    self._idle.notify_all()
        return got

    def _writes_elsewhere(self) -> bool:
        """Whether writes of other threads are in flight (called with the lock held)."""
        me = threading.get_ident()
        return any(thread != me for thread in self._inflight.values())

    def _release(self, info: TensorInfo, start: int, end: int) -> None:
        """Forget ``[start, end)`` of ``info``'s written ranges (a write that failed)."""
        self._written[info.name].discard(start, end)
        self._left += end - start

    def write_chunk(self, name: str, data: Any) -> int:
        """Append to tensor ``name`` right after the last write to it (0 at first).

        Returns:
            The number of bytes written.
        """
        self._live(name)
        return self.write(name, data, self._cursor[self._info(name).name])

    def write_tensor(self, name: str, data: Any) -> int:
        """Write a whole tensor at once: ``write(name, data, 0)`` of data that must hold all
        of its bytes (a part is refused here, not at :meth:`close` as a missing range)."""
        self._live(name)
        info = self._info(name)
        length, chunks = _payload(name, info, data)
        _check_whole(info, length)
        return self._write_payload(info, 0, length, chunks)

    # ------------------------------------------------------------------------------ status

    def missing(self) -> dict[str, int]:
        """Tensors with unwritten bytes, and how many bytes each still lacks (bytes of writes
        in progress count as written)."""
        with self._lock:
            return self._missing()

    def _missing(self) -> dict[str, int]:
        out = {}
        for name, info in self._infos.items():
            done = self._written[name].covered
            if done != info.nbytes:
                out[name] = info.nbytes - done
        return out

    @property
    def complete(self) -> bool:
        """True when every byte is written (or being written by another thread)."""
        return self._left == 0

    @property
    def closed(self) -> bool:
        """True once committed or discarded."""
        return self._cm is None

    def _live(self, name: Any) -> int:
        if self._cm is None:
            raise self._closed_error(name)
        return self._fd

    def _closed_error(self, name: Any) -> ClosedFileError:
        """The error for a write to tensor ``name`` after close() or abort()."""
        return _closed_error(self.filename, self._state, name)

    # ------------------------------------------------------------------------ commit/discard

    def close(self) -> None:
        """Commit: check every byte was written, then atomically replace the target.

        A second ``close()`` after a commit does nothing; one made while another thread's
        close is committing waits for it, and reports what it reports.

        Raises:
            SerializeError: Some bytes were never written (kind ``Incomplete``); the writer
                stays open so they can still be written, or :meth:`abort` can discard it.
            ClosedFileError: The writer was aborted, or an earlier close failed to commit the
                file: nothing was committed (kind ``FileClosed``).
        """
        # Everything from the state's change on is inside the try: an interrupt (Ctrl-C) at
        # any point settles the state (a close left "closing" made every later close() and
        # abort(), the with block's and atexit's among them, wait for ever), and a temporary
        # file not yet handed to its commit is discarded rather than left behind.
        mine = False
        cm: contextlib.AbstractContextManager[int] | None = None
        exited = False
        outcome, failure = "failed", None
        try:
            with self._lock:
                while True:
                    if self._cm is None:
                        self._wait_settled()
                        return
                    # Writes in progress in other threads finish first (or fail, and then
                    # their bytes count as missing).
                    if not self._writes_elsewhere():
                        break
                    self._idle.wait()
                missing = self._missing()
                if missing:
                    listed = ", ".join(f"`{k}` ({v} bytes)" for k, v in list(missing.items())[:10])
                    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
                    raise SerializeError(
                        f"{SERIALIZE_PREFIX}cannot finish {self.filename!r}: unwritten bytes "
                        f"in {listed}{more}",
                        kind="Incomplete",
                        tensor=next(iter(missing)),
                    )
                mine = True
                self._closer = (threading.get_ident(), os.getpid())
                self._state = "closing"
                cm, self._cm = self._cm, None
            exited = True
            cm.__exit__(None, None, None)
            outcome = "committed"
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if mine:
                try:
                    if cm is not None and not exited:
                        with contextlib.suppress(_Discard):
                            cm.__exit__(_Discard, _Discard(), None)
                    if self._state == "closing":
                        if self._receipt.passed:
                            # In place: a Ctrl-C held over the rename, or a failed sync of its
                            # folder, came after the file was committed.
                            outcome = "committed"
                        _settle(self, self._idle, outcome, failure)
                finally:
                    with _OPEN_WRITERS_LOCK:
                        _OPEN_WRITERS.discard(self)

    def _wait_settled(self) -> None:
        """Wait (lock held) for a commit in progress, then return if it committed; else raise
        ClosedFileError saying why nothing was."""
        _wait_settled(self, self._idle, self.filename, "nothing was written in its place")

    @property
    def committed(self) -> bool:
        """True once :meth:`close` has put the file in place (for a writer of a group,
        handed it to the group)."""
        return self._state == "committed"

    def abort(self) -> None:
        """Discard: delete the temporary file; the target is left as it was. Writes in progress
        in other threads stop at their next chunk (with ``ClosedFileError``) and are waited
        for, so that none writes after the file is gone. A writer already closed is left as
        it is (a commit in progress goes on: it is not undone)."""
        with self._lock:
            # A commit in progress is not waited for: abort() is what __exit__, atexit and
            # finalizers call after an interrupt, which may have left a close unsettled.
            if self._cm is None:
                return
            self._stopping = True
            while self._writes_elsewhere():
                self._idle.wait()
            if self._cm is None:
                return  # another close() or abort() finished it while this one waited
            cm, self._cm = self._cm, None
            self._state = "aborted"
        with _OPEN_WRITERS_LOCK:
            _OPEN_WRITERS.discard(self)
        exc = _Discard()
        with contextlib.suppress(_Discard):
            cm.__exit__(_Discard, exc, None)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            return
        if self._state == "aborted":
            return  # discarded on purpose inside the block: nothing to commit
        try:
            self.close()
        except BaseException:
            self.abort()
            raise

    def _on_drop(self) -> None:
        # Never commit from a finalizer: an unclosed writer is an abandoned one (abort() may
        # run twice). A forked child's copy leaves the parent's temporary file alone.
        if getattr(self, "_pid", None) == os.getpid():
            self.abort()


def _closed_error(where: str, state: str, name: Any) -> ClosedFileError:
    """A write after the writer of ``where`` was committed or discarded (``state``), to
    tensor ``name`` if known."""
    what = state if state in ("committed", "aborted") else "closed"
    to = "" if name is None else f": cannot write to tensor `{name}`"
    return ClosedFileError(
        f"the streaming writer of {where!r} is {what}{to}",
        kind="FileClosed",
        tensor=None if name is None else str(name),
    )


def _settle(
    owner: StreamingWriter | ShardedStreamingWriter,
    settled: threading.Condition,
    state: str,
    failure: BaseException | None,
) -> None:
    """Record what became of ``owner``'s output, and wake the closes waiting for it."""
    # Set before taking the lock: an interrupt while it is taken leaves the outcome set.
    owner._state = state
    owner._failure = failure
    # The lock's own context manager, not the condition's: those are Python functions, and a
    # Ctrl-C landing in their first instructions left the lock held for good (every later
    # abort(), the with block's and atexit's among them, waited for ever).
    with owner._lock:
        settled.notify_all()


def _wait_settled(
    owner: StreamingWriter | ShardedStreamingWriter,
    settled: threading.Condition,
    where: str,
    after_failure: str,
) -> None:
    """Wait (``settled``'s lock held) while another thread commits ``owner``, then return if
    it committed; else raise ClosedFileError saying why nothing was (``where`` names the
    output; ``after_failure`` what is left after a failed commit).

    A commit of this thread's own (an interrupt's handler) or of a parent process (a forked
    child) is not waited for, which would never end: it is refused.
    """
    while owner._state == "closing":
        closer = owner._closer
        if closer is not None and (closer[1] != os.getpid() or closer[0] == threading.get_ident()):
            raise ClosedFileError(
                f"cannot finish {where!r}: its commit by this thread (or a parent process) "
                "has not ended",
                kind="FileClosed",
            )
        settled.wait()
    if owner._state == "committed":
        return
    if owner._state == "failed":
        failure = owner._failure
        raise ClosedFileError(
            f"cannot finish {where!r}: committing it failed earlier "
            f"({type(failure).__name__}: {failure}); {after_failure}",
            kind="FileClosed",
        ) from failure
    raise ClosedFileError(
        f"cannot finish {where!r}: the streaming writer was aborted", kind="FileClosed"
    )


def _empty_storages(tensors: Any) -> dict[str, Any]:
    """The hub's storage id of each tensor declared by a torch tensor without storage.

    The hub's splitter (and ``save_sharded``) gives every such tensor the same id (pointer 0,
    size 0, per device), so all of them go to the shard of the first: a streaming split that
    placed each by itself wrote other shards than ``save_sharded`` of the same tensors.
    """
    if not isinstance(tensors, Mapping):
        return {}
    found = {}
    for name, value in tensors.items():
        storage = torch_storage_id(value) if is_torch(value) else None  # None: a meta tensor
        if storage is not None and storage[1:] == (0, 0):
            found[name] = storage
    return found


#: ``ShardedStreamingWriter._write``'s offset for ``write_tensor``.
_WHOLE: Final = object()


def _missing_folders(folder: str) -> list[str]:
    """``folder`` and those of its parents that do not exist, the deepest first: what
    ``os.makedirs(folder)`` would create."""
    missing: list[str] = []
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


class ShardedStreamingWriter(ClosedWhenDropped):
    """Stream a sharded checkpoint: shards planned up front, one writer each, index last.

    The split is the hub's (greedy in declaration order; see :mod:`pysafetensors._sharding`),
    so the result is byte-identical to :func:`~pysafetensors.save_sharded` of the same tensors
    (empty torch tensors all go to the shard of the first, as there), except for torch
    tensors that share memory: ``save_sharded`` writes such a group once
    (recording the dropped names in the metadata), while every declared tensor is written here.
    Each shard's temporary file is created on the first write to it; nothing replaces an
    existing file until :meth:`close` has checked that every byte of every shard was written.

    Args:
        folder: Target folder (created if missing).
        tensors: Declarations, as for :class:`StreamingWriter`.
        max_shard_size: Limit per shard (bytes or ``"5GB"``-style decimal units).
        metadata: User metadata: in the header of a single file, else in the index.
        filename_pattern: File name pattern with a ``{suffix}`` field.
        format: Value of the ``format`` header key written in every shard.
        clean: After committing, delete files of an earlier save with the same pattern (a
            single file replacing a sharded checkpoint removes its index either way).
        fsync: Make every file durable on close.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        tensors: Any,
        max_shard_size: int | str = MAX_SHARD_SIZE,
        *,
        metadata: Mapping[str, str] | None = None,
        filename_pattern: str = DEFAULT_FILENAME_PATTERN,
        format: str = "pt",  # noqa: A002 - the metadata key's name
        clean: bool = True,
        fsync: bool = False,
    ) -> None:
        self._writers: dict[str, StreamingWriter] = {}
        # No more writes (closing, closed or aborted); set with the lock held, which a shard's
        # opening checks, so that no shard writer is begun after an abort collected them.
        self._closed = False
        self._discarded = False  # set once abort() has run to its end
        # As StreamingWriter's: "open", "closing", "committed", "aborted" or "failed".
        self._state = "open"
        self._failure: BaseException | None = None
        self._closer: tuple[int, int] | None = None  # (thread, process) of the commit
        # A shard whose commit failed when its last byte was written (its temporary file is
        # gone, its bytes cannot be written again): the checkpoint cannot be committed.
        self._failed_shard: tuple[str, BaseException] | None = None
        with gc_paused():  # a few records per tensor, all kept
            self._plan_shards(folder, tensors, max_shard_size, metadata, filename_pattern, format)
        self._pattern = filename_pattern
        self._clean = clean
        self._fsync = fsync
        # Every shard joins it when opened, and close() renames them with the index.
        self._group = checkpoint_group(self.folder, self.plan, filename_pattern, fsync=fsync)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        # The folders this writer makes (the output's missing parents too) are removed again
        # by abort(), if nothing else came in.
        self._made_folders = _missing_folders(self.folder)
        make_folder(self.folder)  # a file where the folder should be is named
        self._pid = os.getpid()  # a forked child's copy is not the writer: see __del__
        with _OPEN_WRITERS_LOCK:
            _OPEN_WRITERS.add(self)

    def _plan_shards(
        self,
        folder: str | os.PathLike[str],
        tensors: Any,
        max_shard_size: int | str,
        metadata: Mapping[str, str] | None,
        filename_pattern: str,
        format: str,  # noqa: A002 - the metadata key's name
    ) -> None:
        """Check the declarations, split them into shards and lay out every shard's file
        (the first part of ``__init__``)."""
        decls = _declarations(tensors)
        by_name = {d[0]: d for d in decls}
        # The checks a single-file writer makes (sizes that overflow, among others), before any
        # shard is planned: an overflowing size counted as 0 went unnoticed until another
        # tensor's shard was opened. Only each shard's header is held to the limit (below):
        # a checkpoint whose shards all fit was refused when their headers together did not.
        everything = build_layout(decls, None, max_header_size=sys.maxsize)
        checked = {info.name: info.nbytes for info in everything.tensors}
        del everything
        self._sizes = {name: checked[name] for name, _, _ in decls}  # in declaration order
        empties = _empty_storages(tensors)
        plan = split_into_shards(
            # (name, size) pairs: the hub's splitter skips values that are strings.
            {name: (name, size) for name, size in self._sizes.items()},
            get_storage_size=lambda item: item[1],
            get_storage_id=lambda item: empties.get(item[0]),
            filename_pattern=filename_pattern,
            max_shard_size=max_shard_size,
        )
        if not plan.filename_to_tensors:
            plan = ShardPlan({"total_size": 0}, {filename_pattern.format(suffix=""): []}, {})
        self.plan: ShardPlan = plan
        """The split: file names, and which tensor goes where."""
        self.folder = output_path(folder, "folder")
        self._meta = dict(metadata) if metadata is not None else {}
        per_file = {"format": format}
        if not plan.is_sharded:
            per_file.update(self._meta)
        # Metadata the commit could not write is refused now, not once every byte is streamed:
        # an index's keys that are not str failed at close (and the whole save was lost), a
        # single file's values that are not str at the first write.
        if plan.is_sharded:
            # The metadata's part of the index (its weight map holds only str): encoding the
            # whole index took ~0.2 s for 100,000 tensors, and close() encodes it again.
            index_json(dataclasses.replace(plan, tensor_to_filename={}), self._meta)
        else:
            check_metadata(per_file)
        # Each shard's file laid out now, and kept for its writer: a header too large was
        # refused only at the first write to its shard (at close() for a shard of empty
        # tensors), after the rest was streamed.
        self._layouts: dict[str, Layout] = {}
        for fname, names in plan.filename_to_tensors.items():
            try:
                self._layouts[fname] = build_layout([by_name[n] for n in names], per_file)
            except SerializeError as exc:
                add_note(exc, f"in shard {fname}")
                raise

    def _writer(self, name: str) -> StreamingWriter:
        if self._closed:
            raise _closed_error(self.folder, self._state, name)
        try:
            fname = self.plan.tensor_to_filename[name]
        except (KeyError, TypeError):
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` was not declared when the writer was opened",
                kind="UnknownTensor",
                tensor=str(name),
            ) from None
        return self._shard_writer(fname)

    def _write_finished(
        self, writer: StreamingWriter, name: str, data: Any, offset: int | None | object
    ) -> int:
        """A write to a shard handed over complete (:meth:`_finish_if_complete`): every byte
        is written, so only an empty write passes; the others get the errors they got before
        (an out-of-range offset, a wrong dtype, an overlap, a part for ``write_tensor``). A
        shard whose commit failed takes no write: its error is raised again."""
        if not writer.committed:
            with writer._lock:
                writer._wait_settled()  # raises unless a commit in progress succeeds
        info = writer._info(name)
        at: Any = offset
        if offset is None:
            with writer._lock:
                at = writer._cursor[name]
        elif offset is _WHOLE:
            at = 0
        at = _offset(name, at)
        length, _ = _payload(name, info, data)
        if offset is _WHOLE:
            _check_whole(info, length)
        with writer._lock:
            writer._reserve(info, at, length)  # raises unless the write is empty
            writer._cursor[name] = at + length  # as a write moves it
        return 0

    def _finish_if_complete(self, writer: StreamingWriter, name: str) -> None:
        """Hand a shard whose every byte is written to the group now, not at close: it then
        holds its descriptor only while the group's budget allows (a writer of many shards
        written one after another held one per shard until close, and ran out under a low
        limit on open files). ``name``: the tensor whose write finished the shard."""
        if not writer.complete:
            return
        try:
            writer.close()
        except SerializeError as exc:
            if exc.kind != "Incomplete":
                if writer._state == "failed":
                    self._shard_failed(writer, exc)
                if self._closed:
                    # An abort() on another thread finished the group before the shard was
                    # handed to it: the write is told so, as every write after an abort is
                    # (the group's own error said only that it was finished).
                    raise _closed_error(self.folder, self._state, name) from exc
                raise
            # Another thread's write to it failed meanwhile: its bytes are missing again, and
            # the shard stays open for them.
        except BaseException as exc:
            # Only a commit that failed loses the shard: an interrupt while its close waited
            # for other writes left it open, every byte still there for the next close().
            if writer._state == "failed":
                self._shard_failed(writer, exc)
            raise

    def _shard_failed(self, writer: StreamingWriter, exc: BaseException) -> None:
        """Remember that ``writer``'s shard could not be committed (an I/O error as its last
        byte was written): close() refuses the checkpoint (it was committed without the shard,
        or with an earlier save's file of its name), and abort() discards the rest."""
        with self._lock:
            if self._failed_shard is None:
                self._failed_shard = (os.path.basename(writer.filename), exc)

    def _check_no_failed_shard(self) -> None:
        """Raise (lock held) if a shard's commit failed."""
        if self._failed_shard is not None:
            fname, exc = self._failed_shard
            raise ClosedFileError(
                f"cannot finish {self.folder!r}: shard {fname} could not be committed when its "
                f"last byte was written ({type(exc).__name__}: {exc}); its bytes are lost: "
                "abort() the writer and write the checkpoint again",
                kind="FileClosed",
            ) from exc

    def _shard_writer(self, fname: str) -> StreamingWriter:
        writer = self._writers.get(fname)
        if writer is not None:
            # Begun already (the lock is for beginning one): an abort since is the writer's
            # own refusal of the write.
            return writer
        with self._lock:
            writer = self._writers.get(fname)
            if writer is None:
                if self._closed:
                    raise _closed_error(self.folder, self._state, None)
                if len(self._writers) % 128 == 127:
                    # Each shard begun stays open until close (writes come in any order):
                    # thousands of shards need that many descriptors.
                    allow_descriptors(len(self._writers) + 384)
                writer = StreamingWriter._planned(
                    os.path.join(self.folder, fname),
                    self._layouts[fname],
                    fsync=self._fsync,
                    group=self._group,
                )
                self._writers[fname] = writer
            return writer

    def write(self, name: str, data: Any, offset: int = 0) -> int:
        """Write bytes of tensor ``name`` at ``offset`` (see :meth:`StreamingWriter.write`)."""
        return self._write(name, data, offset)

    def write_chunk(self, name: str, data: Any) -> int:
        """Append to tensor ``name`` after the last write to it."""
        return self._write(name, data, None)

    def _write(self, name: str, data: Any, offset: int | None | object) -> int:
        """A write at ``offset``, after the last write to the tensor (``None``), or of the
        whole tensor (``_WHOLE``)."""
        writer = self._writer(name)
        if not writer.closed:
            try:
                if offset is None:
                    got = writer.write_chunk(name, data)
                elif offset is _WHOLE:
                    got = writer.write_tensor(name, data)
                else:
                    got = writer.write(name, data, offset)  # type: ignore[arg-type]
            except ClosedFileError:
                if self._closed:
                    raise  # aborted or closed meanwhile
                # Another thread's write finished the shard meanwhile: as below.
            else:
                self._finish_if_complete(writer, name)
                return got
        return self._write_finished(writer, name, data, offset)

    def write_tensor(self, name: str, data: Any) -> int:
        """Write a whole tensor at once (see :meth:`StreamingWriter.write_tensor`)."""
        return self._write(name, data, _WHOLE)

    def missing(self) -> dict[str, int]:
        """Tensors with unwritten bytes, and how many bytes each still lacks."""
        out: dict[str, int] = {}
        for fname, names in self.plan.filename_to_tensors.items():
            writer = self._writers.get(fname)
            if writer is not None:
                out.update(writer.missing())
                continue
            for name in names:
                if self._sizes[name]:
                    out[name] = self._sizes[name]
        return out

    def close(self) -> None:
        """Commit every shard, then the index (the index is the last file to appear).

        A second ``close()`` after a commit does nothing; one made while another is committing
        waits for it, and reports what it reports.

        Raises:
            SerializeError: Bytes are missing (kind ``Incomplete``); nothing was committed and
                the writer stays open.
            ClosedFileError: A shard's commit failed earlier (when its last byte was written),
                the writer was aborted, or an earlier close failed: nothing was committed.
        """
        with self._lock:
            if self._state != "open":
                self._wait_settled()
                return
            self._check_no_failed_shard()
        missing = self.missing()
        if missing:
            listed = ", ".join(f"`{k}` ({v} bytes)" for k, v in list(missing.items())[:10])
            raise SerializeError(
                f"{SERIALIZE_PREFIX}cannot finish {self.folder!r}: unwritten bytes in {listed}",
                kind="Incomplete",
                tensor=next(iter(missing)),
            )
        for fname in self._layouts:
            self._shard_writer(fname)  # shards holding only empty tensors
        with self._lock:
            if self._state != "open":  # aborted, or closed by another thread, meanwhile
                self._wait_settled()
                return
            self._check_no_failed_shard()
            self._closed = True
            self._closer = (threading.get_ident(), os.getpid())
            self._state = "closing"
            writers = {os.path.join(self.folder, f): w for f, w in self._writers.items()}

        def finish(path: str, names: list[str], group: SaveGroup) -> None:
            # Complete; renamed with the rest of the group. A shard another thread is
            # committing is waited for, and one whose commit failed fails the checkpoint.
            writers[path].close()

        outcome, failure = "failed", None
        try:
            write_checkpoint(
                self.folder,
                self.plan,
                self._meta,
                finish,
                filename_pattern=self._pattern,
                fsync=self._fsync,
                clean=self._clean,
                group=self._group,
            )
            outcome = "committed"
        except BaseException as exc:
            failure = exc
            raise
        finally:
            try:
                # Whatever happens (see StreamingWriter.close); committed once every file is
                # renamed, even if a Ctrl-C or the clean-up of older files failed after.
                _settle(
                    self, self._settled, "committed" if self._group.committed else outcome, failure
                )
            finally:
                with _OPEN_WRITERS_LOCK:
                    _OPEN_WRITERS.discard(self)

    def _wait_settled(self) -> None:
        """As :meth:`StreamingWriter._wait_settled` (lock held)."""
        _wait_settled(self, self._settled, self.folder, "abort() discards what is left")

    @property
    def committed(self) -> bool:
        """True once :meth:`close` has put every shard and the index in place (also when a
        Ctrl-C, or the clean-up of an earlier save's files, came after that)."""
        return self._state == "committed"

    def abort(self) -> None:
        """Discard every shard not yet committed (nothing, once :meth:`close` committed the
        checkpoint or while it commits)."""
        with self._lock:
            if self._state in ("closing", "committed"):
                return  # not undone; not waited for either (see StreamingWriter.abort)
            self._closed = True
            if self._state == "open":
                self._state = "aborted"
            writers = list(self._writers.values())
        with _OPEN_WRITERS_LOCK:
            _OPEN_WRITERS.discard(self)
        failures: list[Exception] = []
        try:
            for writer in writers:
                try:
                    writer.abort()
                except Exception as exc:  # noqa: BLE001 - the other shards are still discarded
                    failures.append(exc)
        finally:
            # Shards already handed over wait in the group: discarded whatever happened above.
            self._group.discard()
            for folder in self._made_folders:  # the deepest first
                try:
                    os.rmdir(folder)  # only if empty: what this writer made
                except OSError:
                    break
            self._discarded = True
        if failures:
            raise failures[0]

    def _on_drop(self) -> None:
        # As StreamingWriter's: an unclosed writer is an abandoned one. Its finished shards
        # wait in the group as temporary files (a shard's own writer is closed once its last
        # byte is written), which only this abort deletes.
        # Also one whose close() failed (its message says to abort) and an abort() cut short
        # by a Ctrl-C (``_closed`` set, the group not yet discarded): every step of an abort
        # may run twice; a commit in progress or done is left alone (abort() returns).
        if (
            getattr(self, "_pid", None) == os.getpid()
            and not self._discarded
            and self._state not in ("closing", "committed")
        ):
            self.abort()

    def __enter__(self) -> ShardedStreamingWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            return
        if self._state == "aborted":
            return  # discarded on purpose inside the block: nothing to commit
        try:
            self.close()
        except BaseException:
            self.abort()
            raise
