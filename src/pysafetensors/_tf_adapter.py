"""The TensorFlow adapter (``framework="tf"`` or ``"tensorflow"``): tensors through numpy.

TensorFlow registers ml_dtypes' types as its own (bfloat16, the float8 family, float4_e2m1fn), so
a tensor is read into numpy by :class:`~pysafetensors._adapter.NumpyAdapter` and handed to
``tf.convert_to_tensor``; saving goes the other way through ``.numpy()``. Which dtypes work is
asked of ``tf.as_dtype`` (TensorFlow 2.21 has no F6 and no F8_E8M0), not kept in a table here.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np

from ._adapter import LazyModule, NumpyAdapter, check_cpu_device, invalid_tensor_error, numpy_dtype
from ._devices import Device
from ._dtypes import DType
from ._errors import DTypeNotSupportedError, SerializeError, add_note
from ._format import SERIALIZE_PREFIX
from ._writer import TensorData

# Imported at first use: opening a file to read its header does not import the framework.
tf: Any = LazyModule("tensorflow")

__all__ = ["ADAPTER", "TensorFlowAdapter"]

_NUMPY: Final = NumpyAdapter()


@functools.cache
def _supported(dtype: DType) -> bool:
    """Whether this TensorFlow build has ``dtype`` (probed once with a one-element array)."""
    try:
        tf.convert_to_tensor(np.zeros(1, numpy_dtype(dtype)))
    except Exception:  # noqa: BLE001 - TF raises ValueError or TypeError depending on the path
        return False
    return True


class TensorFlowAdapter:
    """``tf.Tensor`` values, created on TensorFlow's default device."""

    framework = "tensorflow"

    def check_device(self, device: Any) -> Device:
        # As in the reference: placement is TensorFlow's job (`with tf.device(...)`).
        return check_cpu_device(
            device,
            self.framework,
            "; load inside `with tf.device(...)` to place the tensors",
        )

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        if not _supported(dtype):
            raise DTypeNotSupportedError(
                f"Dtype not understood: {dtype.code} (TensorFlow {tf.__version__} has no such "
                "dtype; load it with framework='numpy' instead)",
                kind="DtypeNotUnderstood",
            )
        # convert_to_tensor copies, so views of a memory map are not kept alive.
        return tf.convert_to_tensor(_NUMPY.from_bytes(buf, dtype, shape, device))

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if isinstance(tensor, tf.SparseTensor):
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is sparse; convert it with "
                "tf.sparse.to_dense first",
                kind="SparseTensor",
                tensor=name,
            )
        if isinstance(tensor, (np.ndarray, np.generic)):
            return _NUMPY.to_data(name, tensor)
        expected = "tf.Tensor, tf.Variable or numpy.ndarray"
        if isinstance(tensor, tf.RaggedTensor):
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is ragged (rows of different lengths); "
                "convert it with .to_tensor() first",
                kind="RaggedTensor",
                tensor=name,
            )
        # The reference calls .numpy() on every value, so anything with one is saved: tf.Tensor
        # and tf.Variable (a copy in host memory is what gets written), and Keras 3 variables,
        # which are neither.
        to_numpy = getattr(tensor, "numpy", None)
        if callable(to_numpy):
            try:
                array = to_numpy()
            except Exception as exc:
                # The reference lets the value's own exception through (torch's "requires
                # grad ... use detach()"); the note says which tensor it was.
                add_note(exc, f"while converting tensor `{name}` with .numpy()")
                raise
            if isinstance(array, (np.ndarray, np.generic)):
                return _NUMPY.to_data(name, array)
            if isinstance(array, bytes):
                # A 0-d tf.string: refused as a string tensor of any other shape is, whose
                # .numpy() is an object array ("Unknown dtype").
                return _NUMPY.to_data(name, np.asarray(array, dtype=object))
        elif isinstance(tensor, tf.Tensor):
            # A graph tensor (inside tf.function, or tf.compat.v1 graph mode) is a tf.Tensor
            # with no values yet: "expected tf.Tensor ... but received SymbolicTensor" would
            # say the opposite of what is wrong.
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is a symbolic (graph) tensor, which has no "
                "values to save; save eager tensors, outside tf.function",
                kind="InvalidTensor",
                tensor=name,
            )
        raise invalid_tensor_error(name, expected, tensor)


ADAPTER: Final = TensorFlowAdapter()
