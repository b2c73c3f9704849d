"""numpy: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

BF16, the FP8 types, F4 and F6 come as ml_dtypes arrays (F4/F6 one value per byte, packed on
write). Non-contiguous and big-endian arrays are written correctly, a slab at a time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._adapter import NumpyAdapter
from ._api import load_bytes_with, load_file_with, save_bytes_with, save_file_with

__all__ = ["load", "load_file", "save", "save_file"]

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
    filename: str | os.PathLike[str],
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
        filename: What to read.
        backend: ``"mmap"`` (zero-copy copy-on-write views) or ``"pread"`` (fresh memory).
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).
    """
    return load_file_with("numpy", filename, "cpu", backend, storage_options)
