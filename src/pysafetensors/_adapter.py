"""Framework adapters: the two conversions each framework needs, and nothing else.

An adapter turns raw little-endian bytes plus a header entry into a framework tensor
(``from_bytes``), and a framework tensor into a :class:`~pysafetensors._writer.TensorData` whose
bytes come straight from the tensor's memory (``to_data``). The reader, the writer and the
per-framework ``save``/``load`` functions are built once on top of these; dtypes are resolved by
name from the one table in ``_dtypes``.

Frameworks are imported lazily, only when their adapter is first used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

import numpy as np

from ._devices import Device, parse_device
from ._dtypes import DType, dtype_from_name
from ._errors import (
    DTypeNotSupportedError,
    SafetensorError,
    SerializeError,
    add_note,
    not_an_instance,
)
from ._format import SERIALIZE_PREFIX
from ._writer import WRITEV_BYTES, TensorData

__all__ = [
    "Adapter",
    "NumpyAdapter",
    "as_array",
    "check_cpu_device",
    "chunk_values",
    "chunk_values_widened",
    "copied_slabs",
    "copy_in_tiles",
    "get_adapter",
    "invalid_tensor_error",
    "non_contiguous_error",
    "numpy_dtype",
    "pack_subbyte",
    "slabs_reused",
    "unpack_subbyte",
    "widened_bf16",
]

#: Non-contiguous or byte-swapped arrays are made contiguous this many bytes at a time, so a
#: save never holds more than one slab of extra memory.
SLAB_BYTES: Final = 16 << 20

#: Elements in one tile of a copy of a transposed block (see :func:`copy_in_tiles`).
TILE_ELEMENTS: Final = 1 << 16


class Adapter(Protocol):
    """What the reader and writer need from a framework."""

    framework: str

    def check_device(self, device: Any) -> Device:
        """Validate a ``device=`` argument for this framework."""
        ...

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        """Build a tensor over ``buf`` (uint8, 1-D, packed little-endian bytes)."""
        ...

    def to_data(self, name: str, tensor: Any) -> TensorData:
        """Describe a tensor for the writer without copying its bytes."""
        ...


#: An adapter's answer to ``fresh_kind(dtype)``, for ``get_tensor``'s short path on the CPU:
#: the numpy dtype of a C-contiguous array of the tensor's shape to read the tensor's bytes
#: into, and what makes the framework's tensor of that array, sharing its memory (None: the
#: array itself). An adapter without ``fresh_kind`` takes ``from_bytes``'s way.
FreshKind = tuple[np.dtype[Any], Callable[[np.ndarray], Any] | None]


# ------------------------------------------------------------------------------------ numpy side


#: numpy_dtype's answers by dtype code: working one out took ~1.3 us (a module attribute
#: lookup that misses, an import statement), paid for every numpy tensor built.
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {}


def numpy_dtype(dtype: DType) -> np.dtype[Any]:
    """The numpy dtype of one element (ml_dtypes for BF16, FP8, F4 and F6), little-endian.

    Raises:
        DTypeNotSupportedError: ml_dtypes lacks the type.
    """
    known = _NUMPY_DTYPES.get(dtype.code)
    if known is None:
        known = _NUMPY_DTYPES[dtype.code] = _find_numpy_dtype(dtype)
    return known


def _find_numpy_dtype(dtype: DType) -> np.dtype[Any]:
    name = dtype.numpy
    assert name is not None
    if hasattr(np, name) and name not in ("bfloat16",):
        native: np.dtype[Any] = np.dtype(name)
        little: np.dtype[Any] = native.newbyteorder("<")
        return little
    import ml_dtypes

    try:
        extra: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        little_extra: np.dtype[Any] = extra.newbyteorder("<")
        return little_extra
    except AttributeError:
        raise DTypeNotSupportedError(
            f"dtype {dtype.code} needs ml_dtypes.{name}, which this ml_dtypes "
            f"({ml_dtypes.__version__}) does not have",
            kind="DtypeNotUnderstood",
        ) from None


def widened_bf16(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 bytes as float32 values, in fresh memory or ``out`` (uint32, one per element): a
    BF16 is the upper half of a float32's bits, so this is exact, and needs no ml_dtypes
    (importing ml_dtypes 0.7 takes over a second)."""
    if out is None:
        out = raw.view("<u2").astype(np.uint32)
    else:
        np.copyto(out, raw.view("<u2"))
    wide: np.ndarray = np.left_shift(out, 16, out=out)
    return wide.view(np.float32)


def chunk_values(dtype: DType, raw: np.ndarray) -> np.ndarray:
    """A chunk of raw little-endian bytes as numpy values (ml_dtypes for BF16, FP8, F4, F6;
    F4/F6 unpacked to one value a byte)."""
    if dtype.bits % 8:
        count = raw.size * 8 // dtype.bits
        return unpack_subbyte(raw, dtype, count).view(numpy_dtype(dtype))
    return raw.view(numpy_dtype(dtype))


def chunk_values_widened(dtype: DType, raw: np.ndarray) -> np.ndarray:
    """As :func:`chunk_values`, but BF16 widened to float32 by its bits (the same values, NaN
    where NaN) without importing ml_dtypes (over a second in 0.7)."""
    return widened_bf16(raw) if dtype.code == "BF16" else chunk_values(dtype, raw)


def unpack_subbyte(buf: np.ndarray, dtype: DType, count: int) -> np.ndarray:
    """Unpack F4/F6 bytes to one element per byte (codes in the low bits).

    Bit order: element ``i`` occupies bits ``[i*bits, (i+1)*bits)`` of the little-endian bit
    stream, so for F4 the first element is the low nibble of byte 0 (the layout of torch's
    ``float4_e2m1fn_x2`` and of the OCP MX formats).
    """
    if dtype.bits == 4:
        out = np.empty(count, np.uint8)
        out[0::2] = buf & 0x0F
        out[1::2] = buf >> 4
        return out
    # F6: four elements in three bytes.
    groups = buf.reshape(-1, 3).astype(np.uint32)
    word = groups[:, 0] | (groups[:, 1] << 8) | (groups[:, 2] << 16)
    out = np.empty((len(word), 4), np.uint8)
    for i in range(4):
        out[:, i] = (word >> (6 * i)) & 0x3F
    return out.reshape(-1)[:count]


def pack_subbyte(codes: np.ndarray, dtype: DType) -> np.ndarray:
    """Inverse of :func:`unpack_subbyte`: pack one-per-byte codes into F4/F6 bytes."""
    flat = codes.reshape(-1).view(np.uint8)
    if dtype.bits == 4:
        return ((flat[0::2] & 0x0F) | ((flat[1::2] & 0x0F) << 4)).astype(np.uint8)
    quads = (flat.reshape(-1, 4) & 0x3F).astype(np.uint32)
    word = quads[:, 0] | (quads[:, 1] << 6) | (quads[:, 2] << 12) | (quads[:, 3] << 18)
    out = np.empty((len(word), 3), np.uint8)
    for i in range(3):
        out[:, i] = (word >> (8 * i)) & 0xFF
    return out.reshape(-1)


#: numpy dtype -> format dtype, filled as dtypes are met: ``np.dtype.name`` is computed on
#: every access (~4 us, a third of the per-tensor cost of saving 20,000 small arrays).
_FROM_NUMPY: dict[np.dtype[Any], DType] = {}


def _numpy_to_dtype(npdt: np.dtype[Any]) -> DType:
    dtype = _FROM_NUMPY.get(npdt)
    if dtype is None:
        dtype = _FROM_NUMPY[npdt] = dtype_from_name(npdt.name)
    return dtype


def _whole_bytes(arr: np.ndarray) -> memoryview | None:
    """``arr``'s bytes as one flat buffer where its memory holds them in file order
    (C-contiguous, little-endian), else None."""
    byteorder = arr.dtype.byteorder
    if not arr.flags.c_contiguous or byteorder == ">" or (byteorder == "=" and _BIG_ENDIAN):
        return None
    return arr.reshape(-1).view(np.uint8).data


_BIG_ENDIAN: Final = sys.byteorder == "big"


def _packed_blocks(arr: np.ndarray, dtype: DType) -> Iterator[np.ndarray]:
    """An F4/F6 array's file bytes (one code a byte in memory, packed in the file), packed
    ``SLAB_BYTES`` codes at a time: packing makes several temporaries of its input's size,
    which for the whole array at once added three times the file's size to the save's peak
    memory. The block's size is a multiple of every packing's group (2 or 4 codes), so blocks
    pack on their own; ``arr.flat`` copies a block of a non-contiguous array in C order."""
    flat = arr.reshape(-1) if arr.flags.c_contiguous else arr.flat
    for start in range(0, arr.size, SLAB_BYTES):
        yield pack_subbyte(np.asarray(flat[start : start + SLAB_BYTES]), dtype)


def _array_slabs(arr: np.ndarray) -> Callable[[], Iterator[Any]]:
    """Bytes of ``arr`` in row-major little-endian order, copied a slab at a time: for the
    arrays whose memory does not hold them so (:func:`_whole_bytes` gives the others' as
    they lie)."""
    return lambda: copied_slabs(arr, reuse_all=slabs_reused(arr.nbytes))


def slabs_reused(nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` copied a slab at a time hands every slab over through
    the one buffer (:attr:`TensorData.reused`): large ones, whose last slab in memory of its
    own added a slab to the save's peak (32 MiB for a save of large transposed arrays, 16
    MiB with the last one through the buffer too). A small one is one small slab, kept in
    memory of its own, which the writer then gathers without copying it again."""
    return nbytes >= WRITEV_BYTES


def _numpy_copy(out: np.ndarray, piece: np.ndarray) -> None:
    if not copy_in_tiles(out, piece):
        np.copyto(out, piece, casting="equiv")


def copy_in_tiles(out: np.ndarray, piece: np.ndarray) -> bool:
    """Copy ``piece`` into ``out`` (C-contiguous, same shape) a tile at a time where ``piece``
    is a large block of a transposed matrix (2-D, its columns closer in memory than its
    rows); return whether it was such a block and was copied.

    A slab of a ``.t()`` weight copied in one call walks the source across its lines for
    every row written, and the output across its lines for every column read: 180-250 ms
    for a 64 MiB F32 slab (numpy's or torch's copy), 4x what torch's ``.contiguous()`` of the
    whole weight takes, whose blocked transpose only whole matrices qualify for. Tiles of all
    the slab's rows and a few columns (at most :data:`TILE_ELEMENTS` elements) keep the lines
    of both in cache: 22-28 ms. numpy copies each tile: torch splits a copy of more than
    32,768 elements over its threads, which for these shapes was 30-50x slower.
    """
    if piece.ndim != 2 or piece.size <= TILE_ELEMENTS:
        return False
    rows, cols = piece.shape
    row_step, col_step = piece.strides
    if rows < 2 or cols < 2 or abs(row_step) >= abs(col_step):
        return False
    tile_cols = min(cols, max(16, TILE_ELEMENTS // rows))
    tile_rows = min(rows, max(1, TILE_ELEMENTS // tile_cols))
    for top in range(0, rows, tile_rows):
        bottom = top + tile_rows
        for left in range(0, cols, tile_cols):
            right = left + tile_cols
            np.copyto(out[top:bottom, left:right], piece[top:bottom, left:right], casting="equiv")
    return True


def copied_slabs(
    arr: np.ndarray,
    copy: Callable[[np.ndarray, np.ndarray], None] = _numpy_copy,
    *,
    reuse_all: bool = False,
    copy_all: bool = False,
) -> Iterator[np.ndarray]:
    """The bytes of ``arr`` in row-major little-endian order, as flat ``uint8`` arrays of at
    most about ``SLAB_BYTES`` each, copied only where its memory does not hold them so (with
    ``copy_all``, every slab is copied: ``copy`` changes the values on the way).

    Copies go through one buffer, reused for the next copy once the next chunk is asked for
    (as :attr:`TensorData.chunks` allows), except for the last chunk and small ones, which a
    consumer may keep: those get memory of their own (with ``reuse_all``, for a tensor whose
    ``TensorData.reused`` says so, they go through the buffer too). A fresh array per slab
    made the process's memory grow by several slabs (freed blocks the allocator kept). Each
    chunk is an array that owns a reference to its memory, so a chunk kept keeps that memory
    alive.

    Args:
        arr: Any array; framework tensors come as numpy views of their memory (same strides).
        copy: Copies ``piece`` into ``out``, an array of the same shape whose dtype is
            ``piece``'s in little-endian order (torch passes its own, with its threads, for
            strided pieces other than transposed blocks, which both copy in tiles).
    """
    target = arr.dtype.newbyteorder("<")
    buffer: np.ndarray | None = None
    pieces = _row_blocks(arr, whole=not copy_all)
    piece = next(pieces, None)
    while piece is not None:
        following = next(pieces, None)
        if not copy_all and _whole_bytes(piece) is not None:
            yield piece.reshape(-1).view(np.uint8)
        else:
            nbytes = piece.nbytes
            if not reuse_all and (following is None or nbytes < WRITEV_BYTES):
                out = np.empty(nbytes, np.uint8)
            else:
                if buffer is None or buffer.nbytes < nbytes:
                    buffer = np.empty(nbytes, np.uint8)
                out = buffer[:nbytes]
            copy(out.view(target).reshape(piece.shape), piece)
            yield out
        piece = following


def _row_blocks(arr: np.ndarray, *, whole: bool = True) -> Iterator[np.ndarray]:
    """``arr`` cut into blocks of rows of at most about ``SLAB_BYTES`` (rows larger than that
    cut into their own rows), in order; views, not copies. With ``whole``, an array whose
    memory holds its bytes in file order is one block: nothing to copy."""
    if not arr.size:
        return
    if arr.ndim == 0 or (whole and _whole_bytes(arr) is not None):
        yield arr
        return
    rows = arr.shape[0]
    row_bytes = arr.nbytes // rows
    if row_bytes > SLAB_BYTES and arr.ndim > 1:
        for row in range(rows):
            yield from _row_blocks(arr[row], whole=whole)
        return
    step = max(1, SLAB_BYTES // row_bytes)
    for start in range(0, rows, step):
        yield arr[start : start + step]


def _type_name(value: object) -> str:
    """A value's type as messages name it: ``list``, ``torch.Tensor``, ``jaxlib...ArrayImpl``."""
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def invalid_tensor_error(
    name: object, expected: str, value: object, prefix: str = SERIALIZE_PREFIX
) -> SerializeError:
    """The reference's error for a dict value of the wrong type (``Key `x` is invalid, ...``)."""
    return SerializeError(
        f"{prefix}Key `{name}` is invalid, expected {expected} but received {type(value)}",
        kind="InvalidTensor",
        tensor=str(name),
    )


def as_array(name: str, value: Any, expected: str) -> np.ndarray:
    """``np.asarray(value)``, as the reference's flax and mlx ``save`` convert every value.

    Anything numpy converts is taken (Python numbers and lists, other frameworks' tensors,
    flax ``nnx.Param``, memoryviews); what it turns into an array of a dtype safetensors cannot
    store (``object``, strings) is refused later with the reference's "Unknown dtype" text, and
    what numpy refuses outright raises numpy's (or the value's own ``__array__``'s) exception,
    as in the reference, with a note naming the tensor.
    """
    try:
        return np.asarray(value)
    except Exception as exc:
        # The reference lets it through: ``except RuntimeError`` around a save of a torch
        # tensor that requires grad must keep working. The note says which tensor it was.
        add_note(exc, f"while converting tensor `{name}` with numpy.asarray")
        raise


def non_contiguous_error(name: object) -> SerializeError:
    """The reference's error for a tensor that is not contiguous (torch and paddle refuse)."""
    return SerializeError(
        f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. "
        "It either means you are trying to save tensors which are reference of each "
        "other in which case it's recommended to save only the full tensors, and reslice "
        "at load time, or simply call `.contiguous()` on your tensor to pack it before "
        "saving.",
        kind="NonContiguous",
        tensor=str(name),
    )


def check_cpu_device(device: Any, framework: str, hint: str = "") -> Device:
    """Parse ``device=`` for a framework whose loads always land on the CPU.

    Args:
        device: The caller's ``device=`` argument.
        framework: The framework's name, for the message.
        hint: Text appended to the message (how that framework places arrays instead).

    Raises:
        SafetensorError: Any device but the CPU (the reference's message, plus ``hint``).
    """
    dev = parse_device(device)
    if dev.type != "cpu":
        raise SafetensorError(
            f"Device {dev} is not supported for framework {framework}{hint}",
            kind="InvalidDevice",
        )
    return dev


class NumpyAdapter:
    """numpy arrays; BF16, FP8, F4 and F6 through ml_dtypes."""

    framework = "numpy"
    #: Under the mmap backend every call gets bytes of its own, copies (in parallel for
    #: ``get_tensors``). The reference copies each numpy array it hands out,
    #: so an edit to one never shows in a later read, and a file rewritten or truncated
    #: afterwards leaves them as they were. (torch tensors share the handle's mapping, as the
    #: reference's do.)
    private_per_call = True

    def check_device(self, device: Any) -> Device:
        return check_cpu_device(device, self.framework)

    def fresh_kind(self, dtype: DType) -> FreshKind:
        """How ``get_tensor`` builds a small whole-byte tensor by reading into a fresh array
        (see :data:`FreshKind`): an array of the tensor's own dtype, returned as it is."""
        return numpy_dtype(dtype), None

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> np.ndarray:
        npdt = numpy_dtype(dtype)
        if dtype.packed:
            count = 1
            for d in shape:
                count *= d
            return unpack_subbyte(buf, dtype, count).view(npdt).reshape(shape)
        arr = buf.view(npdt).reshape(shape)
        if sys.byteorder == "big":  # pragma: no cover - no big-endian CI host
            arr = arr.astype(npdt.newbyteorder("="))
        return arr

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if not isinstance(tensor, np.ndarray):
            if isinstance(tensor, np.generic):
                tensor = np.asarray(tensor)
            else:
                raise SerializeError(
                    f"{SERIALIZE_PREFIX}tensor `{name}` is of type {_type_name(tensor)}, "
                    "expected a numpy.ndarray",
                    kind="InvalidTensor",
                    tensor=name,
                )
        if type(tensor) is not np.ndarray:
            # Subclasses (masked arrays, np.matrix, np.memmap) are saved as their plain data,
            # as the reference does; their own reshape/view rules would get in the way.
            tensor = tensor.view(np.ndarray)
        try:
            dtype = _numpy_to_dtype(tensor.dtype)
        except SerializeError as exc:
            # The reference's text (by numpy's dtype name: "object", "str96"), and the tensor.
            raise SerializeError(f"{exc} (tensor `{name}`)", kind=exc.kind, tensor=name) from None
        shape = tuple(tensor.shape)
        if dtype.packed:
            arr = tensor
            return TensorData(name, dtype, shape, lambda: _packed_blocks(arr, dtype), tensor)
        whole = _whole_bytes(tensor)
        if whole is not None:
            return TensorData(name, dtype, shape, (whole,).__iter__, tensor, whole)
        return TensorData(
            name,
            dtype,
            shape,
            _array_slabs(tensor),
            keepalive=tensor,
            reused=slabs_reused(tensor.nbytes),
        )


_ADAPTER_MODULES: Final = {
    "pt": "pysafetensors._torch_adapter",
    "torch": "pysafetensors._torch_adapter",
    "pytorch": "pysafetensors._torch_adapter",
    "np": None,
    "numpy": None,
    "jax": "pysafetensors._jax_adapter",
    "flax": "pysafetensors._jax_adapter",
    "tf": "pysafetensors._tf_adapter",
    "tensorflow": "pysafetensors._tf_adapter",
    "mlx": "pysafetensors._mlx_adapter",
    "paddle": "pysafetensors._paddle_adapter",
}

_NUMPY: Final = NumpyAdapter()


class LazyModule:
    """A module imported at the first use of one of its attributes.

    The framework adapters hold their framework this way: opening a file with
    ``framework="tf"`` to read its metadata does not import TensorFlow (3 s here), as the
    reference does not until a tensor is made.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        name = self.__dict__.get("_name")
        if name is None:
            # Copying or unpickling looks attributes up on an instance whose __dict__ is not
            # filled yet (reading self._name here recursed).
            raise AttributeError(attribute)
        module = importlib.import_module(name)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported at first use>"


def get_adapter(framework: str) -> Adapter:
    """Return the adapter for a framework name as ``safe_open`` accepts it.

    Raises:
        TypeError: ``framework`` is not a ``str`` (the reference's argument error).
        SafetensorError: The name is unknown.
        ModuleNotFoundError: The framework is not installed.
    """
    if not isinstance(framework, str):
        raise not_an_instance("framework", framework)
    if framework not in _ADAPTER_MODULES:
        raise SafetensorError(f"framework {framework} is invalid", kind="InvalidFramework")
    module_name = _ADAPTER_MODULES[framework]
    if module_name is None:
        return _NUMPY
    module = importlib.import_module(module_name)
    adapter: Adapter = module.ADAPTER
    return adapter
