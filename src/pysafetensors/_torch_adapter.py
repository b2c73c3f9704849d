"""The torch adapter: tensors over our buffers, and tensors described for the writer."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from typing import Any, Final

import numpy as np
import torch

from ._devices import Device, parse_device
from ._dtypes import DTYPES, DType
from ._errors import DTypeNotSupportedError, SafetensorError, SerializeError
from ._format import SERIALIZE_PREFIX
from ._writer import TensorData

__all__ = ["ADAPTER", "TorchAdapter", "torch_dtype"]

# Resolved once from the shared table; dtypes this torch build lacks are simply absent.
_TO_TORCH: Final[dict[str, Any]] = {
    d.code: getattr(torch, d.torch) for d in DTYPES if d.torch and hasattr(torch, d.torch)
}
_FROM_TORCH: Final[dict[Any, DType]] = {
    getattr(torch, d.torch): d for d in DTYPES if d.torch and hasattr(torch, d.torch)
}


def torch_dtype(dtype: DType) -> Any:
    """The torch dtype for a safetensors dtype.

    Raises:
        DTypeNotSupportedError: torch has no such dtype (F6, or an old torch).
    """
    try:
        return _TO_TORCH[dtype.code]
    except KeyError:
        raise DTypeNotSupportedError(
            f"Dtype not understood: {dtype.code} (torch {torch.__version__} has no such dtype; "
            "load it with framework='numpy' instead)",
            kind="DtypeNotUnderstood",
        ) from None


def _storage_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's shape for a logical shape: F4 is stored as packed pairs along the last dim."""
    if dtype.bits != 4:
        return shape
    if not shape or shape[-1] % 2:
        raise DTypeNotSupportedError(
            f"F4 tensor of shape {list(shape)} cannot be held by torch.float4_e2m1fn_x2, whose "
            "last dimension packs two values (it must be even); use framework='numpy'",
            kind="DtypeNotUnderstood",
        )
    return (*shape[:-1], shape[-1] // 2)


class TorchAdapter:
    """torch tensors, CPU or any device torch knows."""

    framework = "pt"

    def check_device(self, device: Any) -> Device:
        dev = parse_device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise SafetensorError(
                f"device {dev} was requested but torch {torch.__version__} sees no CUDA device "
                "(CPU-only build or no GPU); use device='cpu'",
                kind="InvalidDevice",
            )
        if dev.type == "mps" and not (
            hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
        ):
            raise SafetensorError(
                f"device {dev} was requested but MPS is not available", kind="InvalidDevice"
            )
        return dev

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        tdtype = torch_dtype(dtype)
        storage_shape = _storage_shape(dtype, shape)
        if not buf.flags.writeable:
            buf = buf.copy()
        if buf.size == 0:
            # from_numpy gives an empty buffer stride 0, which .view(dtype) refuses.
            tensor = torch.empty(storage_shape, dtype=tdtype)
        else:
            tensor = torch.from_numpy(buf)
            if tdtype is not torch.uint8:
                tensor = tensor.view(tdtype)
            tensor = tensor.reshape(storage_shape)
        if device.type != "cpu":
            tensor = tensor.to(device.torch_spec)
        return tensor

    def from_bytes_many(
        self,
        buf: np.ndarray,
        items: Iterable[tuple[str, DType, tuple[int, ...], int, int]],
        device: Device,
    ) -> dict[str, Any]:
        """Build many CPU tensors viewing one buffer: ``(name, dtype, shape, begin, end)``.

        One ``torch.from_numpy`` and one typed view per dtype, then a single ``as_strided`` per
        tensor: about half the per-tensor cost of :meth:`from_bytes`, which matters for files of
        thousands of small tensors (LoRA, MoE). Tensors whose offset is not a multiple of their
        element size (legal, if unusual) take the general path.
        """
        if not buf.flags.writeable:
            buf = buf.copy()
        base = torch.from_numpy(buf)
        typed: dict[Any, Any] = {}
        out: dict[str, Any] = {}
        for name, dtype, shape, begin, end in items:
            size = dtype.bits // 8 if dtype.bits % 8 == 0 else 0
            if device.type != "cpu" or size == 0 or begin % size or dtype.code not in _TO_TORCH:
                out[name] = self.from_bytes(buf[begin:end], dtype, shape, device)
                continue
            tdtype = _TO_TORCH[dtype.code]
            view = typed.get(tdtype)
            if view is None:
                usable = base[: base.numel() - base.numel() % size]
                if usable.numel() == 0:
                    # from_numpy gives an empty buffer stride 0, which .view(dtype) refuses.
                    usable = torch.empty(0, dtype=torch.uint8)
                view = typed[tdtype] = usable if size == 1 else usable.view(tdtype)
                if size == 1 and tdtype is not torch.uint8:
                    view = typed[tdtype] = usable.view(tdtype)
            strides = []
            acc = 1
            for dim in reversed(shape):
                strides.append(acc)
                acc *= dim
            out[name] = torch.as_strided(view, shape, tuple(reversed(strides)), begin // size)
        return out

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if not isinstance(tensor, torch.Tensor):
            raise SerializeError(
                f"{SERIALIZE_PREFIX}Key `{name}` is invalid, expected torch.Tensor but received "
                f"{type(tensor)}",
                kind="InvalidTensor",
                tensor=name,
            )
        try:
            dtype = _FROM_TORCH[tensor.dtype]
        except KeyError:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` has dtype {tensor.dtype}, which safetensors "
                "cannot store",
                kind="UnknownDtype",
                tensor=name,
            ) from None
        shape = tuple(tensor.shape)
        if dtype.bits == 4:
            # float4_e2m1fn_x2 holds two values per element: the logical last dim doubles.
            shape = (*shape[:-1], shape[-1] * 2) if shape else shape
        source = tensor

        def chunks() -> Iterator[Any]:
            t = source
            if t.device.type != "cpu":
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                return
            # Straight from the tensor's memory: no per-tensor copy in user space.
            yield (ctypes.c_char * nbytes).from_address(t.data_ptr())
            # Keep `t` alive until the consumer has written the bytes.
            del t

        return TensorData(name, dtype, shape, chunks, keepalive=tensor)


ADAPTER: Final = TorchAdapter()
