"""TensorFlow: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

Tensors come back as ``tf.Tensor`` on TensorFlow's default device. bfloat16, F8_E4M3, F8_E5M2,
the FNUZ float8s and F4 (``float4_e2m1fn``, one value per element) work in both directions;
F8_E8M0 and F6 have no TensorFlow dtype and are refused. ``tf.Variable`` values are saved by
their current value. Unlike the reference, ``save`` never replaces the values of the caller's
dict with numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np  # noqa: F401 - the reference's module has ``np`` (code reaches for it)
import tensorflow as tf

from . import numpy
from ._api import load_bytes_with, load_file_with, save_bytes_with, save_file_with
from ._errors import PathArg
from ._reader import safe_open
from ._tf_adapter import ADAPTER

__all__ = ["load", "load_file", "numpy", "safe_open", "save", "save_file"]


def save(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize TensorFlow tensors to the bytes of a safetensors file.

    Args:
        tensors: Name to ``tf.Tensor`` or ``tf.Variable`` (numpy arrays too). Never modified.
        metadata: Optional ``__metadata__`` (str to str).

    Returns:
        The file's bytes, identical to the reference's for the same tensors.

    Raises:
        SerializeError: A value is not a tensor, is sparse, or has a dtype safetensors cannot
            store.

    Example:
        >>> import tensorflow as tf
        >>> from pysafetensors.tensorflow import load, save
        >>> load(save({"a": tf.ones((2,), tf.bfloat16)}))["a"].dtype
        tf.bfloat16
    """
    return save_bytes_with(ADAPTER, tensors, metadata)


def save_file(
    tensors: Mapping[str, Any],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write TensorFlow tensors to a safetensors file, atomically.

    Args:
        tensors: As for :func:`save`. Never modified.
        filename: Target path; an existing file is replaced only once the new one is complete.
        metadata: Optional ``__metadata__``.
        fsync: Make the file durable before returning.
    """
    save_file_with(ADAPTER, tensors, filename, metadata, fsync=fsync)


def load(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Load TensorFlow tensors from the bytes of a safetensors file, in file order.

    Args:
        data: The file's bytes.

    Returns:
        Name to ``tf.Tensor``.
    """
    return load_bytes_with(ADAPTER, data, "cpu")


def load_file(
    filename: Any, *, backend: str = "mmap", storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load every tensor of a file (a path, URL or file object) as ``tf.Tensor``, in file order.

    Args:
        filename: What to read: a file, a model folder, an index file, or their URL
            (a sharded checkpoint is loaded whole).
        backend: ``"mmap"`` or ``"pread"``.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).

    Returns:
        Name to ``tf.Tensor``.
    """
    return load_file_with("tf", filename, "cpu", backend, storage_options)


# The reference's helpers, for code that imports them from safetensors.tensorflow.
def _np2tf(numpy_dict: dict[str, Any]) -> dict[str, Any]:
    """The reference's helper: each array replaced by a TensorFlow tensor, in place."""
    for k, v in numpy_dict.items():
        numpy_dict[k] = tf.convert_to_tensor(v)
    return numpy_dict


def _tf2np(tf_dict: dict[str, Any]) -> dict[str, Any]:
    """The reference's helper: each value replaced by a numpy array, in place."""
    for k, v in tf_dict.items():
        tf_dict[k] = v.numpy()
    return tf_dict
