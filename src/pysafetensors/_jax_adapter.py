"""The jax adapter (``framework="jax"`` or ``"flax"``): jax arrays through numpy and ml_dtypes.

jax's own dtypes *are* ml_dtypes' (``jnp.bfloat16 is ml_dtypes.bfloat16``), so a tensor is read
into numpy by :class:`~pysafetensors._adapter.NumpyAdapter` and handed to ``jnp.asarray``; saving
goes the other way through ``np.asarray``. Which dtypes work is decided by this jax build (F6 has a
name in ``jax.numpy`` but no XLA type on CPU), not by a table kept here.

64-bit tensors (F64, I64, U64) become 32-bit when ``jax_enable_x64`` is off, as they do in the
reference; unlike the reference we say so with a :class:`UserWarning`.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from types import FrameType
from typing import Any, Final

import numpy as np

from ._adapter import LazyModule, NumpyAdapter, as_array, check_cpu_device, numpy_dtype
from ._devices import Device
from ._dtypes import DType
from ._errors import DTypeNotSupportedError
from ._writer import TensorData

# Imported at first use: opening a file to read its header does not import the framework.
jax: Any = LazyModule("jax")
jnp: Any = LazyModule("jax.numpy")

__all__ = ["ADAPTER", "JaxAdapter"]

_NUMPY: Final = NumpyAdapter()
_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package, so that a warning points at
    the user's line whichever API (``load``, ``load_file``, ``get_tensor``...) led here."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    return level


@functools.cache
def _supported(dtype: DType) -> bool:
    """Whether this jax build can hold ``dtype`` (probed once with a one-element array)."""
    try:
        jnp.asarray(np.zeros(1, numpy_dtype(dtype)))
    except Exception:  # noqa: BLE001 - XLA reports unsupported types with its own error class
        return False
    return True


def _x64_enabled() -> bool:
    """Whether jax keeps 64-bit types (``jax_enable_x64``), asked through a public API."""
    return bool(jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64))


class JaxAdapter:
    """jax arrays on jax's default device (CPU here; ``jax.device_put`` moves them)."""

    framework = "flax"

    def check_device(self, device: Any) -> Device:
        # The reference refuses too; placement is jax's job (jax.device_put / sharding).
        return check_cpu_device(
            device,
            self.framework,
            "; load on the CPU and move the arrays with jax.device_put",
        )

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        if not _supported(dtype):
            raise DTypeNotSupportedError(
                f"Dtype not understood: {dtype.code} (jax {jax.__version__} cannot hold it; "
                "load it with framework='numpy' instead)",
                kind="DtypeNotUnderstood",
            )
        if dtype.bits == 64 and dtype.code != "C64" and not _x64_enabled():
            warnings.warn(
                f"jax_enable_x64 is off, so {dtype.code} tensors are loaded as 32-bit arrays "
                "(values may lose precision or wrap); set jax.config.update('jax_enable_x64', "
                "True) to keep them 64-bit",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )
        # jnp.asarray copies into a jax buffer, but asynchronously: ``buf`` may view a memory
        # map, which the copy read after the load had returned (a file truncated meanwhile
        # killed the process with SIGBUS; one rewritten put its new bytes into the array).
        # Waited for here, the array holds the file's bytes as they were and maps nothing.
        array = jnp.asarray(_NUMPY.from_bytes(buf, dtype, shape, device))
        return array.block_until_ready()

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if isinstance(tensor, jax.Array):
            # np.asarray of a CPU array is a read-only zero-copy view; sharded or accelerator
            # arrays are gathered to host memory here.
            return _NUMPY.to_data(name, np.asarray(tensor))
        if isinstance(tensor, (np.ndarray, np.generic)):
            return _NUMPY.to_data(name, tensor)
        # The reference passes every value through np.asarray: Python numbers and nested lists
        # are saved too (a float as an F64 scalar).
        return _NUMPY.to_data(name, as_array(name, tensor, "jax.Array or numpy.ndarray"))


ADAPTER: Final = JaxAdapter()
