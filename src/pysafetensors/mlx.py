"""MLX: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

Arrays come back as ``mlx.core.array``. bfloat16 and float64 round-trip bit-exactly (the
reference's MLX loader narrows F64 to float32); MLX has no float8, float6 or float4 dtypes, so
files holding them must be read with ``framework="numpy"``. Files written here are ordinary
safetensors files, readable by ``mx.load`` as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from . import numpy
from ._api import load_bytes_with, load_file_with, save_bytes_with, save_file_with
from ._errors import PathArg
from ._mlx_adapter import ADAPTER
from ._reader import safe_open

__all__ = ["load", "load_file", "numpy", "safe_open", "save", "save_file"]


def save(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize MLX arrays to the bytes of a safetensors file.

    Args:
        tensors: Name to ``mx.array`` (numpy arrays too). Never modified.
        metadata: Optional ``__metadata__`` (str to str).

    Returns:
        The file's bytes, identical to the reference's for the same arrays.

    Raises:
        SerializeError: A value is not an array, or has a dtype safetensors cannot store.

    Example:
        >>> import mlx.core as mx
        >>> from pysafetensors.mlx import load, save
        >>> load(save({"a": mx.ones((2,), dtype=mx.bfloat16)}))["a"].dtype
        mlx.core.bfloat16
    """
    return save_bytes_with(ADAPTER, tensors, metadata)


def save_file(
    tensors: Mapping[str, Any],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write MLX arrays to a safetensors file, atomically.

    Args:
        tensors: As for :func:`save`. Never modified.
        filename: Target path; an existing file is replaced only once the new one is complete.
        metadata: Optional ``__metadata__``.
        fsync: Make the file durable before returning.
    """
    save_file_with(ADAPTER, tensors, filename, metadata, fsync=fsync)


def load(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Load MLX arrays from the bytes of a safetensors file, in file order.

    Args:
        data: The file's bytes.

    Returns:
        Name to ``mx.array``.
    """
    return load_bytes_with(ADAPTER, data, "cpu")


def load_file(
    filename: Any, *, backend: str = "mmap", storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load every tensor of a file (a path, URL or file object) as MLX arrays, in file order.

    Args:
        filename: What to read: a file, a model folder, an index file, or their URL
            (a sharded checkpoint is loaded whole).
        backend: ``"mmap"`` or ``"pread"``.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).

    Returns:
        Name to ``mx.array``.
    """
    return load_file_with("mlx", filename, "cpu", backend, storage_options)


# The reference's helpers, for code that imports them from safetensors.mlx.
def _np2mx(numpy_dict: dict[str, Any]) -> dict[str, Any]:
    """The reference's helper: each array replaced by an MLX array, in place."""
    for k, v in numpy_dict.items():
        numpy_dict[k] = mx.array(v)
    return numpy_dict


def _mx2np(mx_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's helper: a new dict of numpy arrays."""
    return {k: np.asarray(v) for k, v in mx_dict.items()}
