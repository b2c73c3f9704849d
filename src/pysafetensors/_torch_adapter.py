"""The torch adapter: tensors over our buffers, and tensors described for the writer."""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import torch

from ._adapter import (
    FreshKind,
    copied_slabs,
    copy_in_tiles,
    invalid_tensor_error,
    numpy_dtype,
    slabs_reused,
)
from ._devices import Device, parse_device
from ._dtypes import DTYPES, DType
from ._errors import (
    DeviceError,
    DTypeNotSupportedError,
    MetaTensorError,
    NestedTensorError,
    SerializeError,
    SliceError,
    UnstorableDTypeError,
)
from ._format import SERIALIZE_PREFIX, gc_paused
from ._writer import TensorData

__all__ = [
    "ADAPTER",
    "TO_TORCH",
    "TorchAdapter",
    "cuda_target",
    "end_ptr",
    "torch_dtype",
]

# Resolved once from the shared table; dtypes this torch build lacks are simply absent.
TO_TORCH: Final[dict[str, Any]] = {
    d.code: getattr(torch, d.torch) for d in DTYPES if d.torch and hasattr(torch, d.torch)
}
_FROM_TORCH: Final[dict[Any, DType]] = {
    getattr(torch, d.torch): d for d in DTYPES if d.torch and hasattr(torch, d.torch)
}

#: One tensor (or slice) of at most this many bytes goes to a CUDA device without the staging
#: pipeline: read on the calling thread into pinned host memory kept for the purpose, then one
#: blocking copy (:func:`_move_small`). Up to ``_cuda_staging.MIN_CHUNK_BYTES`` a pipeline run
#: is one chunk, so it has nothing to overlap, and it costs a fixed ~150 us a call on an H200
#: (threads, events; a get_tensor loop over 1,000 tensors of 8 KiB took 186 ms staged against
#: 41 ms moved by ``.to`` from fresh pageable memory and 30 ms for the reference). Several
#: tensors at once (``get_tensors``, ``load_shard``) are staged whatever their size.
DIRECT_BYTES = 8 << 20

#: Pinned host memory each thread keeps for :func:`_move_small`; a larger tensor takes a buffer
#: from torch's pinned-memory cache for the call.
_KEPT_PINNED: Final = 1 << 20
_PINNED = threading.local()
#: Cleared where page-locked memory cannot be had (the pageable ``.to`` is used instead).
_PINNED_OK: list[bool] = [True]

#: Tensors loaded to a CUDA device at most this far apart in the file are read as one run (the
#: bytes between them read and dropped): cheaper than another chunk for the pipeline, and a
#: load of every tensor (no gaps) reads the data region in chunks that ignore tensor bounds.
_DEVICE_READ_GAP: Final = 64 << 10

_SEQUENCE_AS_TUPLE: Final = (
    "Using a non-tuple sequence for multidimensional indexing is deprecated and will be changed "
    "in pytorch 2.9; use x[tuple(seq)] instead of x[seq]. In pytorch 2.9 this will be "
    "interpreted as tensor index, x[torch.tensor(seq)], which will result either in an error or "
    "a different result"
)


#: torch's words for a byte tensor used as an index, which it reads as a boolean mask.
_BYTE_MASK: Final = (
    "indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead."
)
#: Integer tensors torch takes as index values; its other integer tensors it refuses.
_INDEX_DTYPES: Final = (torch.int64, torch.int32, torch.uint8, torch.bool)


def _torch_index_item(item: Any) -> Any:
    """One item of a ``get_slice`` index as torch reads it: a ``uint8`` tensor or array (0-d
    included) is a boolean mask, as torch takes it (with its deprecation warning), not the
    integers numpy sees; integer tensors of other widths are refused, as torch refuses them.

    Raises:
        SliceError: A tensor of an integer type torch does not index with.
    """
    if isinstance(item, torch.Tensor):
        if item.dtype == torch.uint8:
            if item.ndim:  # torch warns of masks, not of a 0-d one (an axis of 1 or 0)
                warnings.warn(_BYTE_MASK, UserWarning, stacklevel=5)
            return np.asarray(item.numpy(force=True) != 0)  # 0-d stays an array, not np.bool_
        if item.ndim and item.dtype not in _INDEX_DTYPES and not item.is_floating_point():
            raise SliceError(
                "tensors used as indices must be long, int, byte or bool tensors (got "
                f"{item.dtype})",
                kind="InvalidSlice",
            )
    elif isinstance(item, np.ndarray) and item.dtype == np.uint8:
        if item.ndim:
            warnings.warn(_BYTE_MASK, UserWarning, stacklevel=5)
        return np.asarray(item != 0)
    return item


def _tuple_like(item: Any) -> bool:
    """Whether a list item makes torch read the list as a tuple (its treatSequenceAsTuple)."""
    return (
        item is None
        or item is Ellipsis
        or isinstance(item, (slice, Sequence, np.ndarray, torch.Tensor))
    )


def torch_dtype(dtype: DType) -> Any:
    """The torch dtype for a safetensors dtype.

    Raises:
        DTypeNotSupportedError: torch has no such dtype (F6, or an old torch).
    """
    try:
        return TO_TORCH[dtype.code]
    except KeyError:
        raise DTypeNotSupportedError(
            f"Dtype not understood: {dtype.code} (torch {torch.__version__} has no such dtype; "
            "load it with framework='numpy' instead)",
            kind="DtypeNotUnderstood",
        ) from None


def logical_shape(dtype: DType, torch_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The file's shape for a torch tensor's (the inverse of :func:`_storage_shape`):
    ``float4_e2m1fn_x2`` holds two values per element, so the last dimension doubles."""
    if dtype.bits == 4 and torch_shape:
        return (*torch_shape[:-1], torch_shape[-1] * 2)
    return torch_shape


def _storage_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's shape for a logical shape: F4 is stored as packed pairs along the last dim."""
    if dtype.bits != 4:
        return shape
    if not shape or shape[-1] % 2:
        raise DTypeNotSupportedError(
            # The reference's words first (code matching on them keeps working).
            "f4_x2 dtype requires that the last dim be divisible by 2 in torch: got "
            f"{list(shape)} (torch.float4_e2m1fn_x2 packs two values per element; "
            "use framework='numpy' for this F4 tensor)",
            kind="DtypeNotUnderstood",
        )
    return (*shape[:-1], shape[-1] // 2)


def _shaped(flat: Any, shape: tuple[int, ...]) -> Any:
    """``flat`` (1-D, as ``torch.frombuffer`` makes it) viewed as ``shape``, which must hold
    as many elements (torch raises otherwise). ``view(*shape)`` parses faster than
    ``view(shape)`` (~1.3 against ~1.9 us: a tenth of a small tensor's load)."""
    return flat.view(*shape) if shape else flat.view(())


# A tensor to cut from a buffer: (name, dtype, shape, begin, end), byte offsets.
Item = tuple[str, DType, tuple[int, ...], int, int]


def _carve_items(
    items: Iterable[Item],
    cut_bytes: Callable[[int, int], Any],
    cut_typed: Callable[[Any, int, int, int, tuple[int, ...]], Any],
) -> dict[str, Any]:
    """The per-tensor cases both carvers share, over ``(name, dtype, shape, begin, end)``.

    A tensor whose dtype packs several values per byte (F4), or whose offset is not a multiple
    of its element size (legal, if unusual), is cut as bytes (``cut_bytes(begin, end)``, a
    uint8 tensor) and viewed on its own; a misaligned one is copied first, since a typed view
    needs aligned memory. Every other tensor is ``cut_typed(tdtype, size, begin, end, shape)``.
    """
    out: dict[str, Any] = {}
    for name, dtype, shape, begin, end in items:
        tdtype = torch_dtype(dtype)
        storage_shape = _storage_shape(dtype, shape)
        size = dtype.bits // 8 if dtype.bits % 8 == 0 else 0
        if size == 0 or begin % size:
            raw = cut_bytes(begin, end)
            if size:
                raw = raw.clone()
            out[name] = (raw if tdtype is torch.uint8 else raw.view(tdtype)).reshape(storage_shape)
        else:
            out[name] = cut_typed(tdtype, size, begin, end, storage_shape)
    return out


def carve_host(buf: np.ndarray, items: Iterable[Item]) -> dict[str, Any]:
    """Tensors over byte ranges of one writable host buffer, each with a storage of its own
    bytes (``torch.frombuffer``), none copied.

    As the reference's: a tensor's storage is the tensor. Views of one storage are shared
    tensors to ``save_model``, the hub's
    ``save_torch_state_dict`` and its shard sizing, and ``torch.save`` of one of them writes
    the whole buffer. The buffer lives as long as any of its tensors.
    """
    memory = buf.data  # the buffer protocol over buf, as torch.frombuffer takes it

    # torch.frombuffer refuses zero bytes, so empty tensors are made, not cut.
    def cut_bytes(begin: int, end: int) -> Any:
        if end == begin:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(memory, dtype=torch.uint8, count=end - begin, offset=begin)

    def cut_typed(tdtype: Any, size: int, begin: int, end: int, shape: tuple[int, ...]) -> Any:
        if end == begin:
            return torch.empty(shape, dtype=tdtype)
        count = (end - begin) // size
        flat = torch.frombuffer(memory, dtype=tdtype, count=count, offset=begin)
        # A 1-D tensor needs no view: its count is its shape (the entry's checked byte range).
        return flat if len(shape) == 1 else _shaped(flat, shape)

    return _carve_items(items, cut_bytes, cut_typed)


#: Dtypes whose numpy type ``torch.from_numpy`` takes as it is (the others are ml_dtypes types).
_FROM_NUMPY: Final = frozenset(
    ("BOOL", "U8", "I8", "I16", "U16", "F16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
)


class TorchAdapter:
    """torch tensors, CPU or any device torch knows."""

    framework = "pt"

    @property
    def direct_bytes(self) -> int:
        """Size up to which one tensor goes to a device by :meth:`move_small` rather than the
        staging pipeline (:data:`DIRECT_BYTES`), read at each open."""
        return DIRECT_BYTES

    def move_small(
        self,
        read: Callable[[int, memoryview], None],
        offset: int,
        dtype: DType,
        shape: tuple[int, ...],
        nbytes: int,
        device: Device,
    ) -> Any:
        """One tensor of at most :attr:`direct_bytes` (``nbytes`` at ``offset`` of a source
        read by ``read(offset, view)``) moved to ``device`` through pinned memory
        (:func:`_move_small`); None where that does not apply (not CUDA, pinning failed)."""
        target = _direct_target(device, None, nbytes)
        if target is None:
            return None
        return _move_small(lambda view: read(offset, view), nbytes, dtype, shape, target)

    def check_device(self, device: Any) -> Device:
        dev = parse_device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(
                f"device {dev} was requested but torch {torch.__version__} sees no CUDA device "
                "(CPU-only build or no GPU); use device='cpu'",
                kind="InvalidDevice",
            )
        if dev.type == "mps" and not (
            hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
        ):
            raise DeviceError(
                f"device {dev} was requested but MPS is not available", kind="InvalidDevice"
            )
        return dev

    def fresh_kind(self, dtype: DType) -> FreshKind:
        """How ``get_tensor`` builds a small whole-byte tensor by reading into a fresh array
        (see :data:`FreshKind`): ``torch.from_numpy`` of the array, viewed as the dtype where
        numpy has no such type (BF16, FP8: read as unsigned integers of their width). ~0.8 us
        a tensor, where :meth:`from_bytes`'s ``frombuffer`` and shaping ``view`` took ~1.4."""
        tdtype = torch_dtype(dtype)
        if dtype.code in _FROM_NUMPY:
            return numpy_dtype(dtype), torch.from_numpy
        width = np.dtype(f"<u{dtype.bits // 8}")

        def as_dtype(arr: np.ndarray) -> Any:
            return torch.from_numpy(arr).view(tdtype)

        return width, as_dtype

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        tdtype = torch_dtype(dtype)
        storage_shape = _storage_shape(dtype, shape)
        if not buf.flags.writeable:
            buf = buf.copy()
        if buf.size == 0:
            # torch.frombuffer refuses zero bytes.
            tensor = torch.empty(storage_shape, dtype=tdtype)
        else:
            # One call where from_numpy, view(dtype) took two (~0.5 us a tensor).
            tensor = _shaped(torch.frombuffer(buf, dtype=tdtype), storage_shape)
        if device.type != "cpu":
            tensor = tensor.to(device.torch_spec)
        return tensor

    def slice_index(self, index: Any) -> Any:
        """``index`` as torch reads it: a short list holding a sequence, slice, tensor, ``None``
        or ``...`` means the tuple of its items (``t[[[0, 1], [1, 0]]]`` is ``t[[0, 1], [1, 0]]``).

        The reference's torch slices index a torch tensor, which reads a list so (numpy's
        pre-1.23 rule); torch warns that the rule is deprecated, and so do we, in its words.
        """
        if isinstance(index, list) and len(index) < 32 and any(map(_tuple_like, index)):
            warnings.warn(_SEQUENCE_AS_TUPLE, UserWarning, stacklevel=4)
            index = tuple(index)
        if isinstance(index, tuple):
            return tuple(map(_torch_index_item, index))
        return _torch_index_item(index)

    def pick_cells(self, cells: np.ndarray, pick: tuple[Any, ...]) -> np.ndarray:
        """``cells[pick]`` by torch's indexing rules (used by advanced ``get_slice`` indices).

        ``cells`` holds the elements as integers of their width, so the result is the
        selected elements' bits whatever the dtype.
        """
        index = tuple(
            torch.from_numpy(item) if isinstance(item, np.ndarray) else item for item in pick
        )
        picked: np.ndarray = torch.from_numpy(cells)[index].numpy()
        return picked

    def copy_array(self, dest: np.ndarray, src: np.ndarray) -> None:
        """``dest[...] = src`` with torch's copy kernel, on torch's own threads.

        Used for slices copied out of a mapping: a TP=8 column split of a 2 GiB file (warm)
        copied in 56-74 ms this way against 91-106 ms with numpy split across the reader
        threads (numpy's strided byte copy ran at ~2/3 of torch's speed even without page
        faults).
        """
        if not dest.size:
            return
        if not src.flags.writeable:
            # torch warns about (and cannot mark) read-only arrays, e.g. a read-only buffer
            # handed to safe_open; numpy copies those.
            np.copyto(dest, src)
            return
        torch.from_numpy(dest).copy_(torch.from_numpy(src))

    def from_bytes_many(
        self,
        buf: np.ndarray,
        items: Iterable[Item],
        device: Device,
    ) -> dict[str, Any]:
        """Build many tensors viewing one buffer: ``(name, dtype, shape, begin, end)``.

        On the CPU each tensor is one ``torch.frombuffer`` over its bytes (:func:`carve_host`):
        about half the per-tensor cost of :meth:`from_bytes`, which matters for files of
        thousands of small tensors (LoRA, MoE).
        """
        if device.type != "cpu":
            return {
                name: self.from_bytes(buf[begin:end], dtype, shape, device)
                for name, dtype, shape, begin, end in items
            }
        if not buf.flags.writeable:
            buf = buf.copy()
        return carve_host(buf, items)

    def to_device_many(
        self,
        read: Any,
        offset: int,
        items: list[Item],
        device: Device,
        *,
        ops: Any = None,
        threads: int | None = None,
    ) -> dict[str, Any] | None:
        """Load tensors straight into a CUDA device through reused pinned staging buffers.

        Args:
            read: ``read(offset, view)`` for the source (a byte source's ``readinto``).
            offset: Absolute offset of the data region (item offsets are relative to it).
            items: ``(name, dtype, shape, begin, end)`` of the tensors to load.
            device: The target device.
            ops: The device runtime (tests pass a CPU stand-in); CUDA by default.
            threads: The caller's reader threads (a handle's ``threads=``); None for the
                default (``_cuda_staging.staging_workers``).

        Returns:
            The tensors, or None when this path does not apply (not CUDA) and the caller should
            use :meth:`from_bytes`.
        """
        if len(items) == 1:
            name, dtype, shape, begin, end = items[0]
            target = _direct_target(device, ops, end - begin)
            if target is not None:
                moved = _move_small(
                    lambda view: read(offset + begin, view), end - begin, dtype, shape, target
                )
                return None if moved is None else {name: moved}
        ops = _staging_ops(device, ops)
        if ops is None:
            return None
        from ._cuda_staging import stage_items_to_device, staging_workers

        if not items:
            return {}
        with gc_paused():
            _refuse_unholdable(items)
            spans = [(offset + begin, end - begin) for _, _, _, begin, end in items]
        buffers, _ = stage_items_to_device(
            read, spans, ops, max_gap=_DEVICE_READ_GAP, workers=staging_workers(threads)
        )
        return _carve_each(buffers, items)

    def read_into_device(
        self,
        read: Any,
        pieces: list[tuple[int, Any]],
        *,
        ops: Any = None,
        threads: int | None = None,
    ) -> None:
        """Read ``(offset, bytes)`` pieces of a source straight into device memory the caller
        has (1-D uint8 views of CUDA tensors: a model's parameters), through the pinned staging
        pipeline, device by device; returns once every copy has landed.

        Args:
            read: ``read(offset, view)`` for the source (a byte source's ``readinto``).
            pieces: Absolute offset and destination of each piece.
            ops: The device runtime (tests pass a CPU stand-in); CUDA's by default.
            threads: The caller's reader threads; None for the default.
        """
        from ._cuda_staging import stage_items_to_device, staging_workers

        by_device: dict[Any, list[tuple[int, Any]]] = {}
        for offset, flat in pieces:
            by_device.setdefault(flat.device, []).append((offset, flat))
        for device, group in by_device.items():
            stage_items_to_device(
                read,
                [(offset, flat.numel()) for offset, flat in group],
                ops if ops is not None else _device_ops(device),
                max_gap=_DEVICE_READ_GAP,
                workers=staging_workers(threads),
                buffers=[flat for _, flat in group],
            )

    def to_device_runs(
        self,
        read: Any,
        items: list[Item],
        device: Device,
        *,
        ops: Any = None,
        threads: int | None = None,
    ) -> dict[str, Any] | None:
        """Load byte runs (parts of tensors) into a CUDA device through one staging pipeline.

        Args:
            read: ``read(offset, view)`` for the source (a byte source's ``readinto``).
            items: ``(name, dtype, shape, offset, nbytes)``: each result's dtype and shape,
                and the absolute offset and length of its bytes in the source.
            device: The target device.
            ops: The device runtime (tests pass a CPU stand-in); CUDA by default.
            threads: The caller's reader threads; None for the default.

        Returns:
            The tensors, or None when this path does not apply (not CUDA).
        """
        if len(items) == 1:
            name, dtype, shape, offset, nbytes = items[0]
            target = _direct_target(device, ops, nbytes)
            if target is not None:
                moved = _move_small(lambda view: read(offset, view), nbytes, dtype, shape, target)
                return None if moved is None else {name: moved}
        ops = _staging_ops(device, ops)
        if ops is None:
            return None
        from ._cuda_staging import stage_items_to_device, staging_workers

        with gc_paused():
            _refuse_unholdable(items)
            spans = [(offset, nbytes) for _, _, _, offset, nbytes in items]
        # Only the runs' own bytes are read (a row split leaves the other ranks' rows alone).
        buffers, _ = stage_items_to_device(read, spans, ops, workers=staging_workers(threads))
        return _carve_each(buffers, items)

    def gather_to_device(
        self,
        parts: list[tuple[str, Any, int, int, DType, tuple[int, ...]]],
        device: Device,
        *,
        ops: Any = None,
        chunk_bytes: int | None = None,
    ) -> dict[str, Any] | None:
        """Gather fragmented selections (column splits) into a CUDA device, block of rows by
        block through reused pinned buffers (see ``_cuda_staging.gather_to_device``).

        Args:
            parts: ``(name, fill, rows, row_bytes, dtype, shape)`` of each part, where
                ``fill(first, end, view)`` writes rows ``[first, end)`` into ``view``.
            device: The target device.
            ops: The device runtime (tests pass a CPU stand-in); CUDA by default.
            chunk_bytes: Bytes per block (default ``_cuda_staging.CHUNK_BYTES``).

        Returns:
            The parts by name, or None when this path does not apply (not CUDA).
        """
        if len(parts) == 1:
            name, fill, rows, row_bytes, dtype, shape = parts[0]
            target = _direct_target(device, ops, rows * row_bytes)
            if target is not None:
                moved = _move_small(
                    lambda view: fill(0, rows, view), rows * row_bytes, dtype, shape, target
                )
                return None if moved is None else {name: moved}
        ops = _staging_ops(device, ops)
        if ops is None:
            return None
        from ._cuda_staging import CHUNK_BYTES, gather_to_device

        items = [
            (name, dtype, shape, 0, rows * row_bytes)
            for name, _, rows, row_bytes, dtype, shape in parts
        ]
        _refuse_unholdable(items)
        buffers, _ = gather_to_device(
            [(fill, rows, row_bytes) for _, fill, rows, row_bytes, _, _ in parts],
            ops,
            chunk_bytes=chunk_bytes or CHUNK_BYTES,
        )
        return _carve_each(buffers, items)

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if not isinstance(tensor, torch.Tensor):
            raise invalid_tensor_error(name, "torch.Tensor", tensor)
        try:
            dtype = _FROM_TORCH[tensor.dtype]
        except KeyError:
            raise UnstorableDTypeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` has dtype {tensor.dtype}, which safetensors "
                "cannot store",
                kind="UnknownDtype",
                tensor=name,
            ) from None
        # Attribute checks chosen for their cost (a save of 20,000 tiny tensors pays them all):
        # ``is_meta`` is ~6x cheaper than ``device.type``.
        if tensor.layout is not torch.strided:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is a {tensor.layout} tensor; make it dense "
                "with `.to_dense()` before saving",
                kind="SparseTensor",
                tensor=name,
            )
        if tensor.is_meta:
            raise MetaTensorError(
                f"Cannot copy out of meta tensor `{name}`; it has no data",
                kind="MetaTensor",
                tensor=name,
            )
        if tensor.is_nested:
            # A strided nested tensor has the strided layout but no shape (torch raises
            # "NestedTensorImpl doesn't support sizes" as soon as one is asked for).
            raise NestedTensorError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is a nested tensor, which safetensors "
                "cannot store; save its components (tensor.unbind()) instead",
                kind="NestedTensor",
                tensor=name,
            )
        if tensor.numel():
            _check_memory(name, tensor)
        shape = logical_shape(dtype, tuple(tensor.shape))
        source = tensor
        # A lazy conjugate or negative view: its memory holds the values before the
        # conjugation/negation, which is what writing that memory would save (the reference
        # does: silently wrong values). On the CPU the values are resolved a slab at a time
        # (a copy of the whole tensor added its size to the save's peak); elsewhere the
        # device makes the copy, in its own memory.
        lazy = tensor.is_conj() or tensor.is_neg()
        if lazy and tensor.device.type != "cpu":
            source, lazy = tensor.resolve_conj().resolve_neg(), False

        def chunks() -> Iterator[Any]:
            t = source
            ops = _device_ops(t.device)
            if ops is not None:
                # Through reused pinned buffers, piece by piece, overlapping the writes.
                from ._cuda_staging import chunks_from_device

                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                yield from chunks_from_device(flat, flat.numel(), ops)
                return
            if t.device.type != "cpu":
                t = t.to("cpu")
            if lazy:
                yield from _resolved_slabs(t, reuse_all=reused)
                return
            if not t.is_contiguous():
                # A slab of rows at a time (as numpy's non-contiguous arrays are written): a
                # copy of the whole tensor added its size to the save's peak memory. Each slab
                # is yielded as an array that owns a reference to it, so that a consumer that
                # keeps a chunk (small ones are gathered) keeps its memory alive.
                yield from _slabs(t.detach(), reuse_all=reused)
                return
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                return
            # Straight from the tensor's memory: no per-tensor copy in user space.
            yield (ctypes.c_char * nbytes).from_address(t.data_ptr())
            # Keep `t` alive until the consumer has written the bytes.
            del t

        # Set before any chunk is made: a CPU tensor whose memory is not in file order is
        # copied a slab at a time, every slab through one buffer where it is large.
        reused = (
            tensor.device.type == "cpu"
            and (lazy or not source.is_contiguous())
            and slabs_reused(tensor.numel() * tensor.element_size())
        )
        return TensorData(name, dtype, shape, chunks, keepalive=tensor, reused=reused)


def _slabs(tensor: torch.Tensor, *, reuse_all: bool = False) -> Iterator[np.ndarray]:
    """The bytes of a CPU tensor in row-major order, a slab at a time (see
    :func:`copied_slabs`), copied by torch through a numpy view of its bits."""
    return copied_slabs(_bits_of(tensor), _torch_copy, reuse_all=reuse_all)


def _bits_of(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory, as integers of the element's size: any dtype's
    bits (float8, float4 pairs, bool) as a numpy dtype; complex128, the one 16-byte type,
    numpy has as it is."""
    bits = _BITS_BY_SIZE.get(tensor.element_size())
    return (tensor if bits is None else tensor.view(bits)).numpy()


def _resolved_slabs(tensor: torch.Tensor, *, reuse_all: bool) -> Iterator[np.ndarray]:
    """The values of a lazy conjugate or negative CPU tensor, a slab at a time: its memory
    (a plain tensor over the same storage, which torch lets numpy see) copied into each slab
    and conjugated or negated there."""
    memory = torch.empty(0, dtype=tensor.dtype).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )
    conj, neg = tensor.is_conj(), tensor.is_neg()

    def copy(out: np.ndarray, piece: np.ndarray) -> None:
        _torch_copy(out, piece)
        values = torch.from_numpy(out).view(tensor.dtype)
        if conj:
            values.conj_physical_()
        if neg:
            values.neg_()

    return copied_slabs(_bits_of(memory.detach()), copy, reuse_all=reuse_all, copy_all=True)


#: Integer types by element size: copies of raw bits (any dtype, float4 and float8 included,
#: whose copies torch may not implement).
_BITS_BY_SIZE: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _torch_copy(out: np.ndarray, piece: np.ndarray) -> None:
    """``out[...] = piece``: a block of a transposed weight in tiles (see
    :func:`copy_in_tiles`), anything else by torch, with its threads."""
    if not copy_in_tiles(out, piece):
        torch.from_numpy(out).copy_(torch.from_numpy(piece))


def _check_memory(name: str, tensor: Any) -> None:
    """Refuse a tensor whose storage does not hold the elements it spans.

    Such tensors exist: FSDP frees parameters' storage with ``untyped_storage().resize_(0)``
    (the pointer becomes null), a FakeTensor has none, a storage can be shrunk under a view.
    Writing their bytes would read address 0 (the interpreter dies) or memory past the storage
    (the reference writes whatever is there).

    Raises:
        SerializeError: The storage is missing or too small.
    """
    # ~0.5 us a tensor (a LoRA save of 1,000 tensors pays it 1,000 times): the span of a
    # contiguous tensor is its element count, without walking its strides.
    if tensor.is_contiguous():
        span = tensor.numel()
    else:
        sizes_and_steps = zip(tensor.shape, tensor.stride(), strict=True)
        span = 1 + sum((size - 1) * step for size, step in sizes_and_steps)
    needed = (tensor.storage_offset() + span) * tensor.element_size()
    held = tensor.untyped_storage().nbytes() if tensor.data_ptr() else 0
    if held < needed:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}invalid shape, data type, or offset for tensor `{name}` (its "
            f"storage holds {held} bytes but it spans {needed}: was the storage freed or "
            "resized, as FSDP does to sharded parameters?)",
            kind="TensorInvalidInfo",
            tensor=name,
        )


def _carve_each(buffers: list[Any], items: list[Item]) -> dict[str, Any]:
    """Tensors each over a device buffer of its own (from the staging pipeline): item ``i``
    (``(name, dtype, shape, _, _)``) is ``buffers[i]``, all of whose bytes it holds."""
    out: dict[str, Any] = {}
    with gc_paused():  # a tensor or two per item (a mixture of experts has thousands)
        for buf, (name, dtype, shape, _, _) in zip(buffers, items, strict=True):
            tdtype = torch_dtype(dtype)
            storage_shape = _storage_shape(dtype, shape)  # F4: packed pairs
            if buf.numel() == 0:
                # torch refuses to retype a 0-byte tensor.
                out[name] = torch.empty(storage_shape, dtype=tdtype, device=buf.device)
            else:
                typed = buf if tdtype is torch.uint8 else buf.view(tdtype)
                out[name] = typed.view(storage_shape)
    return out


def end_ptr(tensor: torch.Tensor) -> int:
    """One past the last byte a tensor's elements occupy (the shared-tensor checks of saves,
    and the overlaps ``load_model`` reads in place around).

    Computed from the strides (torch's are never negative, so the last element is the furthest
    one), not as the reference does by ``tensor.view(-1)``, which raises torch's ``view size is
    not compatible`` for a transposed or expanded tensor sharing its storage with another, so
    that neither the shared-tensor error nor ``save_model`` is reached.
    """
    if tensor.nelement():
        sizes_strides = zip(tensor.shape, tensor.stride(), strict=True)
        span = sum((size - 1) * stride for size, stride in sizes_strides)
        return int(tensor.data_ptr()) + (span + 1) * tensor.element_size()
    return int(tensor.data_ptr())


@functools.cache
def cuda_target(device: Device) -> Any:
    """The torch device of a CUDA ``device`` (a bare integer is CUDA's when there is CUDA);
    None for any other. Cached: asked once per small tensor moved (~1 us a ``torch.device``)."""
    if device.type == "anonymous" and torch.cuda.is_available():
        return torch.device("cuda", device.index or 0)
    if device.type == "cuda":
        return torch.device(device.torch_spec)
    return None


def _direct_target(device: Device, ops: Any, nbytes: int) -> Any:
    """Where one tensor (or slice) of ``nbytes`` goes by :func:`_move_small`: the CUDA device,
    when it is at most :data:`DIRECT_BYTES` and no runtime was given (tests pass a CPU stand-in
    for the staging pipeline); else None."""
    if ops is not None or nbytes > DIRECT_BYTES:
        return None
    return cuda_target(device)


def _staging_ops(device: Device, ops: Any) -> Any:
    """The runtime a load to ``device`` stages through: ``ops`` when given (tests pass a CPU
    stand-in), else CUDA's for a CUDA device; None where staging does not apply (another
    device: the caller reads into host memory and moves the result with ``.to``)."""
    if ops is not None:
        return ops
    target = cuda_target(device)
    return None if target is None else _device_ops(target)


def _move_small(
    fill: Callable[[memoryview], None],
    nbytes: int,
    dtype: DType,
    shape: tuple[int, ...],
    target: Any,
) -> Any:
    """One tensor of ``nbytes`` moved to ``target``: ``fill(view)`` writes its bytes into pinned
    host memory, one blocking copy takes them to the device (it returns once they landed, so
    the memory is free again). A ``.to`` from pageable memory costs the driver a copy into its
    own pinned buffers (and fresh memory the page faults of a first touch): on an H200 a
    ``get_tensor`` of 64 KiB took 46 us this way, 50 read into fresh memory and moved by
    ``.to``, the reference 35; of 4 MiB 786, 1,078 and 737 us. None where page-locked memory
    cannot be had (the caller's pageable path)."""
    tdtype = torch_dtype(dtype)
    storage_shape = _storage_shape(dtype, shape)  # F4: packed pairs
    if nbytes == 0:
        return torch.empty(storage_shape, dtype=tdtype, device=target)
    host = _pinned_host(nbytes)
    if host is None:
        return None
    view = host[1][:nbytes]
    fill(view)
    flat = torch.frombuffer(view, dtype=tdtype)  # one call where slice + view(dtype) took two
    # copy=True: a new allocation also where target is the host (CPU tests of this path).
    return _shaped(flat, storage_shape).to(target, copy=True)


def _pinned_host(nbytes: int) -> tuple[Any, memoryview] | None:
    """Pinned host memory of at least ``nbytes`` for :func:`_move_small`: the calling thread's
    kept buffer (``_KEPT_PINNED``), or one from torch's pinned-memory cache for a larger
    tensor; None where page-locked memory cannot be had (remembered)."""
    if nbytes <= _KEPT_PINNED:
        kept: tuple[Any, memoryview] | None = getattr(_PINNED, "kept", None)
        if kept is not None:
            return kept
    if not _PINNED_OK[0]:
        return None
    try:
        buf = torch.empty(max(nbytes, _KEPT_PINNED), dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        # Scarce page-locked memory (WSL2, a low RLIMIT_MEMLOCK): plain .to copies instead.
        _PINNED_OK[0] = False
        return None
    host = (buf, buf.numpy().data.cast("B"))
    if nbytes <= _KEPT_PINNED:
        _PINNED.kept = host
    return host


def _refuse_unholdable(items: Iterable[Item]) -> None:
    """Raise for a dtype or shape torch cannot hold, before any byte is moved."""
    for _, dtype, shape, _, _ in items:
        torch_dtype(dtype)
        _storage_shape(dtype, shape)


def _device_ops(device: torch.device) -> Any:
    """The staging runtime for ``device`` (CUDA), used by saves to copy tensors to the host and
    by loads to copy bytes to the device; None where neither stages (a plain ``.to``)."""
    if device.type == "cuda":
        from ._cuda_staging import TorchCudaOps

        return TorchCudaOps(device)
    return None


ADAPTER: Final = TorchAdapter()
