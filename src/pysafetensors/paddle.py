"""Paddle: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

Tensors are written straight from their memory and read onto any place (``"cpu"``, ``"gpu:0"``;
``"cuda:N"`` is accepted and mapped to ``gpu:N``). bfloat16, F8_E4M3, F8_E5M2, U32 and U64 work in
both directions. Differences from the reference: U16 is refused instead of being loaded as
bfloat16 (``paddle.uint16`` is an alias of ``paddle.bfloat16``), the Paddle version is not
compared as a string, and the same code path serves every Paddle version.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import paddle

from ._adapter import invalid_tensor_error, non_contiguous_error
from ._api import load_bytes_with, load_file_with, save_bytes_with, save_file_with
from ._errors import SerializeError
from ._paddle_adapter import ADAPTER

__all__ = ["load", "load_file", "save", "save_file"]


def _flatten(tensors: Any) -> Mapping[str, Any]:
    """The reference's checks before saving, with its messages."""
    if not isinstance(tensors, dict):
        raise SerializeError(
            f"Expected a dict of [str, paddle.Tensor] but received {type(tensors)}",
            kind="InvalidTensor",
        )
    for name, tensor in tensors.items():
        if not isinstance(tensor, paddle.Tensor):
            raise invalid_tensor_error(name, "paddle.Tensor", tensor, prefix="")
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
    return save_bytes_with(ADAPTER, _flatten(tensors), metadata)


def save_file(
    tensors: dict[str, Any],
    filename: str | os.PathLike[str],
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
    save_file_with(ADAPTER, _flatten(tensors), filename, metadata, fsync=fsync)


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
        filename: What to read.
        device: ``"cpu"``, ``"gpu:0"``, ``"cuda:0"``, ...
        backend: ``"mmap"`` or ``"pread"``.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).

    Returns:
        Name to ``paddle.Tensor``, in file order.
    """
    return load_file_with("paddle", filename, device, backend, storage_options)
