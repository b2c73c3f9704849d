"""The MLX adapter (``framework="mlx"``): ``mx.array`` values built over the raw bits.

MLX cannot take ml_dtypes arrays (``mx.array`` of a bfloat16 numpy array fails, and a float64
one is silently narrowed to float32), so tensors cross the boundary as unsigned integers of the
same width and are reinterpreted with ``mx.view``. That keeps every value bit-exact, F64
included (the reference's MLX loader turns F64 into float32). MLX has no float8, float6 or
float4 dtypes; those tensors are refused with a pointer to ``framework="numpy"``.

MLX dtypes are resolved by name from the one table in ``_dtypes`` (``mx.bool_`` for BOOL).
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np

from ._adapter import LazyModule, NumpyAdapter, as_array, check_cpu_device, numpy_dtype
from ._devices import Device
from ._dtypes import DTYPES, DType
from ._errors import DTypeNotSupportedError, UnstorableDTypeError
from ._format import SERIALIZE_PREFIX
from ._writer import TensorData

# Imported at first use: opening a file to read its header does not import the framework.
mx: Any = LazyModule("mlx.core")

__all__ = ["ADAPTER", "MlxAdapter"]

_NUMPY: Final = NumpyAdapter()


def _mx_attr(name: str) -> Any:
    """``mx.<name>``, or ``mx.<name>_`` where the plain name is a Python builtin (``bool_``)."""
    return getattr(mx, name, None) or getattr(mx, name + "_", None)


@functools.cache
def _tables() -> tuple[dict[str, Any], dict[Any, DType], dict[int, tuple[Any, Any]]]:
    """``(code -> mx dtype, mx dtype -> DType, byte width -> (numpy, mx) unsigned carrier)``,
    resolved once, at first use (building them imports MLX), from the shared table; types this
    MLX lacks (float8, float6, float4) are absent. The carriers take the bits across numpy <->
    MLX unchanged."""
    to_mx = {
        d.code: _mx_attr(d.numpy)
        for d in DTYPES
        if d.numpy and not d.packed and isinstance(_mx_attr(d.numpy), mx.Dtype)
    }
    from_mx = {to_mx[d.code]: d for d in DTYPES if d.code in to_mx}
    carriers = {
        1: (np.uint8, mx.uint8),
        2: (np.uint16, mx.uint16),
        4: (np.uint32, mx.uint32),
        8: (np.uint64, mx.uint64),
    }
    return to_mx, from_mx, carriers


def _refuse(dtype: DType) -> DTypeNotSupportedError:
    return DTypeNotSupportedError(
        f"Dtype not understood: {dtype.code} (MLX has no such dtype; load it with "
        "framework='numpy' instead)",
        kind="DtypeNotUnderstood",
    )


class MlxAdapter:
    """``mx.array`` values in unified memory."""

    framework = "mlx"

    def check_device(self, device: Any) -> Device:
        # Unified memory: an MLX array has no device; the stream chooses where ops run.
        return check_cpu_device(device, self.framework)

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        target = _tables()[0].get(dtype.code)
        if target is None:
            raise _refuse(dtype)
        np_carrier, mx_carrier = _tables()[2][dtype.bits // 8]
        # mx.array copies, so views of a memory map are not kept alive.
        bits = mx.array(_NUMPY.from_bytes(buf, dtype, shape, device).view(np_carrier))
        return bits if target == mx_carrier else bits.view(target)

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if isinstance(tensor, (np.ndarray, np.generic)):
            return _NUMPY.to_data(name, tensor)
        if not isinstance(tensor, mx.array):
            # As the reference: anything np.asarray takes (Python numbers, nested lists).
            return _NUMPY.to_data(name, as_array(name, tensor, "mlx.core.array or numpy.ndarray"))
        try:
            dtype = _tables()[1][tensor.dtype]
        except KeyError:
            raise UnstorableDTypeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` has dtype {tensor.dtype}, which safetensors "
                "cannot store",
                kind="UnknownDtype",
                tensor=name,
            ) from None
        np_carrier, mx_carrier = _tables()[2][dtype.bits // 8]
        bits = tensor if tensor.dtype == mx_carrier else tensor.view(mx_carrier)
        # np.asarray reads the MLX buffer without a copy (it evaluates lazy arrays first).
        return _NUMPY.to_data(name, np.asarray(bits).view(numpy_dtype(dtype)))


ADAPTER: Final = MlxAdapter()
