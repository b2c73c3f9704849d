"""Paddle: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

Tensors are written straight from their memory and read onto any place (``"cpu"``, ``"gpu:0"``;
``"cuda:N"`` is accepted and mapped to ``gpu:N``). bfloat16, F8_E4M3, F8_E5M2, U32 and U64 work in
both directions, and so does U16, as ``paddle.uint16``. Differences from the reference: U16 is
``paddle.uint16`` (the reference loads it as bfloat16 and cannot save ``paddle.uint16``, whose
``str`` says ``paddle.bfloat16``), place objects and ``"gpu:N"`` are taken wherever a device is,
the Paddle version is not compared as a string, and the same code path serves every Paddle
version.

The module also has the reference's re-exports and helpers (``safe_open``, ``numpy``,
``serialize``, ``serialize_file``, ``deserialize``, ``TensorSpec``, ``_TYPES``, ``_SIZE``,
``NPDTYPES``, ``_getdtype``, ``_view2paddle``, ``_to_ndarray``, ``_np2paddle``,
``_paddle2np``), so code that imports them from ``safetensors.paddle`` keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import paddle

from . import numpy
from ._adapter import invalid_tensor_error, non_contiguous_error, numpy_dtype
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
from ._dtypes import DType, dtype_from_code
from ._errors import PathArg, SerializeError
from ._paddle_adapter import ADAPTER, to_paddle
from ._reader import safe_open

__all__ = [
    "TensorSpec",
    "deserialize",
    "load",
    "load_file",
    "numpy",
    "safe_open",
    "save",
    "save_file",
    "serialize",
    "serialize_file",
]


def _checked(tensors: Any) -> Mapping[str, Any]:
    """``tensors``, after the reference's checks before saving, with its messages."""
    if not isinstance(tensors, dict):
        raise SerializeError(
            f"Expected a dict of [str, paddle.Tensor] but received {type(tensors)}",
            kind="InvalidTensor",
        )
    # Every value's type first, then contiguity: the reference's order, so the same dict gets
    # the same error.
    for name, tensor in tensors.items():
        if not isinstance(tensor, paddle.Tensor):
            raise invalid_tensor_error(name, "paddle.Tensor", tensor, prefix="")
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise non_contiguous_error(name)
    return tensors


def save(tensors: dict[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize Paddle tensors to the bytes of a safetensors file.

    Args:
        tensors: Name to contiguous ``paddle.Tensor``. Never modified.
        metadata: Optional ``__metadata__`` (str to str).

    Returns:
        The file's bytes, identical to the reference's for the same tensors.

    Raises:
        SerializeError: Not a dict, a value is not a tensor, a tensor is not contiguous, or its
            dtype cannot be stored.

    Example:
        >>> import paddle
        >>> from pysafetensors.paddle import load, save
        >>> str(load(save({"a": paddle.ones([2], dtype="bfloat16")}))["a"].dtype)
        'paddle.bfloat16'
    """
    return save_bytes_with(ADAPTER, _checked(tensors), metadata)


def save_file(
    tensors: dict[str, Any],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write Paddle tensors to a safetensors file, atomically, straight from their memory.

    Args:
        tensors: As for :func:`save`. Never modified.
        filename: Target path; an existing file is replaced only once the new one is complete.
        metadata: Optional ``__metadata__``.
        fsync: Make the file durable before returning.
    """
    save_file_with(ADAPTER, _checked(tensors), filename, metadata, fsync=fsync)


def load(data: bytes | bytearray | memoryview, device: Any = "cpu") -> dict[str, Any]:
    """Load Paddle tensors from the bytes of a safetensors file, in file order.

    Args:
        data: The file's bytes.
        device: ``"cpu"``, ``"gpu:0"``, ``"cuda:0"``, ...

    Returns:
        Name to ``paddle.Tensor``.
    """
    return load_bytes_with(ADAPTER, data, device)


def load_file(
    filename: Any,
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load every tensor of a file (a path, URL or file object) as Paddle tensors.

    Args:
        filename: What to read: a file, a model folder, an index file, or their URL
            (a sharded checkpoint is loaded whole).
        device: ``"cpu"``, ``"gpu:0"``, ``"cuda:0"``, ...
        backend: ``"mmap"`` or ``"pread"``.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).

    Returns:
        Name to ``paddle.Tensor``, in file order.
    """
    return load_file_with("paddle", filename, device, backend, storage_options)


# The reference's module-level names, for code that imports them from safetensors.paddle.
_TYPES: dict[str, Any] = dict(to_paddle())
"""Format code to Paddle dtype, for every dtype this Paddle can hold."""

_SIZE: dict[Any, int] = {t: dtype_from_code(c).bits // 8 for c, t in _TYPES.items()}
"""Paddle dtype to its width in bytes."""

NPDTYPES: dict[Any, Any] = {
    t: numpy_dtype(dtype_from_code(c)) if c != "BF16" else np.float16 for c, t in _TYPES.items()
}
"""Paddle dtype to a numpy type of the same width (bfloat16 as float16, as the reference)."""


def _getdtype(dtype_str: str) -> Any:
    """The Paddle dtype of a format code (``"F32"`` -> ``paddle.float32``).

    Raises:
        KeyError: Not a code of :data:`_TYPES`.
    """
    return _TYPES[dtype_str]


def _view2paddle(safeview: Iterable[tuple[str, Mapping[str, Any]]], device: Any) -> dict[str, Any]:
    """Tensors from :func:`deserialize`'s ``(name, {"dtype", "shape", "data"})`` entries."""
    dev = ADAPTER.check_device(device)
    return {
        name: ADAPTER.from_bytes(
            np.frombuffer(bytearray(view["data"]), np.uint8),
            dtype_from_code(view["dtype"]),
            tuple(view["shape"]),
            dev,
        )
        for name, view in safeview
    }


def _to_ndarray(tensor: Any, name: str) -> tuple[np.ndarray, Any]:
    """A tensor's bytes as a uint8 array (a copy, little-endian) and the tensor, as the
    reference's helper returns them.

    Raises:
        SerializeError: The tensor is not contiguous, or its dtype cannot be stored.
    """
    _checked({name: tensor})
    return _bytes_of(name, tensor)[0], tensor


def _bytes_of(name: str, tensor: Any) -> tuple[np.ndarray, DType]:
    """A checked tensor's bytes (a little-endian copy, uint8) and its dtype."""
    data = ADAPTER.to_data(name, tensor)
    raw = b"".join(bytes(chunk) for chunk in data.chunks())
    return np.frombuffer(bytearray(raw), np.uint8), data.dtype


def _flatten(tensors: Any, keep_alive_buffer: list[Any]) -> dict[str, TensorSpec]:
    """The reference's helper: ``{name: TensorSpec}`` over a little-endian copy of each
    tensor's bytes (appended with its tensor to ``keep_alive_buffer``), as ``serialize`` takes
    them.

    Raises:
        SerializeError: Not a dict, a value is not a tensor, a tensor is not contiguous, or its
            dtype cannot be stored.
    """
    flattened = {}
    for name, tensor in _checked(tensors).items():
        arr, dtype = _bytes_of(name, tensor)
        keep_alive_buffer.append((arr, tensor))
        flattened[name] = TensorSpec(
            dtype=dtype.name,
            shape=[int(d) for d in tensor.shape],
            data_ptr=arr.ctypes.data,
            data_len=arr.nbytes,
        )
    return flattened


def _np2paddle(numpy_dict: dict[str, Any], device: Any = "cpu") -> dict[str, Any]:
    """The reference's helper: each array replaced by a Paddle tensor on ``device``, in place."""
    for k, v in numpy_dict.items():
        numpy_dict[k] = paddle.to_tensor(v, place=device)
    return numpy_dict


def _paddle2np(paddle_dict: dict[str, Any]) -> dict[str, Any]:
    """The reference's helper: each tensor replaced by a numpy array, in place."""
    for k, v in paddle_dict.items():
        paddle_dict[k] = v.detach().cpu().numpy()
    return paddle_dict
