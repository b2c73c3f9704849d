"""numpy: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

BF16, the FP8 types, F4 and F6 come as ml_dtypes arrays (F4/F6 one value per byte, packed on
write). Non-contiguous and big-endian arrays are written correctly, a slab at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._adapter import NumpyAdapter, numpy_dtype
from ._api import (
    TensorSpec,
    deserialize,
    load_bytes_with,
    load_file_with,
    save_bytes_with,
    save_file_with,
    serialize,
    serialize_file,
)
from ._dtypes import BY_CODE, DTYPES, DType
from ._errors import DTypeNotSupportedError, PathArg
from ._reader import safe_open

__all__ = [
    "deserialize",
    "load",
    "load_file",
    "safe_open",
    "save",
    "save_file",
    "serialize",
    "serialize_file",
]

_ADAPTER = NumpyAdapter()


def save(tensor_dict: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize arrays to the bytes of a safetensors file.

    Args:
        tensor_dict: Name to array. Never modified.
        metadata: Optional ``__metadata__`` (str to str), written in the given order.

    Returns:
        The file's bytes.

    Example:
        >>> import numpy as np
        >>> from pysafetensors.numpy import save, load
        >>> load(save({"a": np.arange(3, dtype=np.int32)}))["a"]
        array([0, 1, 2], dtype=int32)
    """
    return save_bytes_with(_ADAPTER, tensor_dict, metadata)


def save_file(
    tensor_dict: Mapping[str, np.ndarray],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write arrays to a safetensors file, atomically, straight from their memory.

    Args:
        tensor_dict: Name to array. Never modified.
        filename: Target path; an existing file is replaced only once the new one is complete.
        metadata: Optional ``__metadata__``.
        fsync: Make the file durable before returning.
    """
    save_file_with(_ADAPTER, tensor_dict, filename, metadata, fsync=fsync)


def load(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Load arrays from the bytes of a safetensors file (file order; arrays own a copy)."""
    return load_bytes_with(_ADAPTER, data, "cpu")


def load_file(
    filename: Any, *, backend: str = "mmap", storage_options: dict[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """Load every array of a file (a path, URL or file object), in file order.

    Args:
        filename: What to read: a file, a model folder, an index file, or their URL
            (a sharded checkpoint is loaded whole).
        backend: ``"mmap"`` or ``"pread"``: numpy arrays are copies either way (as the
            reference's are), made in parallel, out of the mapping or by positioned reads.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).
    """
    return load_file_with("numpy", filename, "cpu", backend, storage_options)


# The reference module's helpers, for code that imports them from ``safetensors.numpy`` (its
# ``safe_open``, ``serialize``, ``serialize_file`` and ``deserialize`` are re-exported above).


def _numpy_type(dtype: DType) -> Any:
    """The numpy scalar type of a format's dtype, or None (F4/F6, or an ml_dtypes without it)."""
    if dtype.packed or dtype.numpy is None:
        return None  # F4/F6 are unpacked one value per byte; their code names no numpy type
    if dtype.code == "BOOL":
        return bool
    try:
        return numpy_dtype(dtype).type
    except DTypeNotSupportedError:
        return None


def _getdtype(dtype_str: str) -> Any:
    """The numpy type of a format code (``"F32"`` -> ``numpy.float32``).

    Only the code asked for is resolved (numpy_dtype keeps what it found): the whole table
    imports ml_dtypes, ~1 s of the module's import on a small host (numpy alone: ~0.1 s),
    which a file of F32 tensors never needs.

    Raises:
        KeyError: Not a code of :data:`_TYPES`.
    """
    dtype = BY_CODE.get(dtype_str)
    found = None if dtype is None else _numpy_type(dtype)
    if found is None:
        raise KeyError(dtype_str)
    return found


def __getattr__(name: str) -> Any:
    # _TYPES, the reference's table of format code to numpy scalar type (plus BF16 and the FP8
    # types through ml_dtypes), is made on first use: see _getdtype.
    if name == "_TYPES":
        table = {d.code: t for d in DTYPES if (t := _numpy_type(d)) is not None}
        globals()["_TYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "_TYPES"})


def _view2np(safeview: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, np.ndarray]:
    """Arrays over ``deserialize``'s ``(name, {"dtype", "shape", "data"})`` items."""
    return {
        k: np.frombuffer(v["data"], dtype=_getdtype(v["dtype"])).reshape(v["shape"])
        for k, v in safeview
    }


def _is_little_endian(tensor: np.ndarray) -> bool:
    """Whether an array's bytes are little-endian (native order on a little-endian host).

    Raises:
        ValueError: An unknown byte-order character.
    """
    byteorder = tensor.dtype.byteorder
    if byteorder == "=":
        return sys.byteorder == "little"
    if byteorder in ("|", "<"):
        return True
    if byteorder == ">":
        return False
    raise ValueError(f"Unexpected byte order {byteorder}")


def _flatten(tensor_dict: Mapping[str, np.ndarray], keep_alive_buffer: list[Any]) -> dict[str, Any]:
    """``{name: TensorSpec}`` over the arrays' memory (big-endian ones byte-swapped into copies
    appended to ``keep_alive_buffer``), as ``serialize`` takes them."""
    flattened: dict[str, Any] = {}
    for k, v in tensor_dict.items():
        tensor = v
        if not _is_little_endian(tensor):
            tensor = tensor.byteswap(inplace=False)
            keep_alive_buffer.append(tensor)
        flattened[k] = TensorSpec(
            dtype=tensor.dtype.name,
            shape=tensor.shape,
            data_ptr=tensor.ctypes.data,
            data_len=tensor.nbytes,
        )
    return flattened
