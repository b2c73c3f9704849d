"""The buffers ``safe_open.read_into`` fills: checked against their tensors and seen as bytes.

numpy arrays, torch tensors (on the CPU or a CUDA device), bytearrays and memoryviews are
taken as they are, in place; anything that cannot take a tensor's bytes in place (read-only,
not C-contiguous, another size, a lazy torch view) is refused before any read, with an error
that names the tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._format import TensorInfo

__all__ = ["check_targets", "device_bytes", "tensor_bytes", "writable_bytes"]


def check_targets(targets: Any) -> None:
    """Refuse a ``read_into`` argument that is no mapping of names to buffers (a list of
    pairs raised ``AttributeError: 'list' object has no attribute 'items'``).

    Raises:
        TypeError: ``targets`` is not a mapping.
    """
    if not isinstance(targets, Mapping):
        raise TypeError(
            f"read_into() takes a mapping of tensor names to buffers, not {type(targets).__name__}"
        )


def _unfit(info: TensorInfo, why: str) -> ValueError:
    """The error for a :meth:`safe_open.read_into` buffer that cannot take ``info``'s bytes."""
    return ValueError(f"the buffer for tensor {info.name!r} {why}")


def _check_size(info: TensorInfo, nbytes: int) -> None:
    """Refuse a buffer of ``nbytes`` for ``info``'s data of another size."""
    if nbytes != info.nbytes:
        raise _unfit(
            info,
            f"holds {nbytes} bytes; the tensor's data is {info.nbytes} bytes "
            f"({info.dtype.code} {list(info.shape)})",
        )


def tensor_bytes(target: Any, info: TensorInfo) -> Any:
    """A torch tensor's memory as 1-D uint8 (whatever its dtype: numpy lacks bfloat16 and the
    float8 types), checked to be fillable in place.

    Raises:
        ValueError: Not on the CPU or a CUDA device, not contiguous, a lazy conjugate or
            negation view, or not ``info``'s size.
    """
    if target.device.type not in ("cpu", "cuda"):
        raise _unfit(info, f"is on {target.device}; read_into fills CPU memory and CUDA tensors")
    if not target.is_contiguous():
        raise _unfit(info, "is not C-contiguous")
    if target.is_conj() or target.is_neg():
        raise _unfit(info, "is a lazy conjugate or negation view")
    flat = target.detach().reshape(-1).view(sys.modules["torch"].uint8)
    _check_size(info, flat.numel())
    return flat


def device_bytes(target: Any, info: TensorInfo) -> Any:
    """A CUDA torch tensor's memory as 1-D uint8 (see :func:`tensor_bytes`), or None for
    anything else (host memory, for :func:`writable_bytes`)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(target, torch.Tensor) or target.device.type != "cuda":
        return None
    return tensor_bytes(target, info)


def writable_bytes(target: Any, info: TensorInfo) -> memoryview:
    """``target`` as writable bytes for :meth:`safe_open.read_into`, checked against ``info``.

    Raises:
        ValueError: ``target`` is read-only, not C-contiguous, or not ``info``'s size.
    """
    torch = sys.modules.get("torch")  # never imported here: a tensor means it is loaded
    if torch is not None and isinstance(target, torch.Tensor):
        target = tensor_bytes(target, info).numpy()
    if isinstance(target, np.ndarray):
        # As bytes first: arrays of the dtypes numpy lacks (bfloat16, float8: ml_dtypes)
        # cannot export a buffer of their own type. Checked before the reshape, which would
        # copy a non-contiguous array (and the bytes would land in the copy).
        if not target.flags.writeable:
            raise _unfit(info, "is read-only")
        if not target.flags.c_contiguous:
            raise _unfit(info, "is not C-contiguous")
        if target.dtype.hasobject:  # numpy's own TypeError named no tensor
            raise _unfit(info, f"holds Python objects ({target.dtype}), not raw memory")
        target = target.reshape(-1).view(np.uint8)
    try:
        view = memoryview(target)
    except TypeError:
        raise _unfit(
            info,
            f"is of type {type(target).__name__}, which does not expose its memory (expected "
            "a numpy array, CPU torch tensor, bytearray or memoryview)",
        ) from None
    if view.readonly:
        raise _unfit(info, "is read-only")
    if not view.c_contiguous:
        raise _unfit(info, "is not C-contiguous")
    _check_size(info, view.nbytes)
    return view  # read_pieces_into reads it as bytes
