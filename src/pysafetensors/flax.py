"""jax / flax: ``save``, ``save_file``, ``load``, ``load_file`` with the reference's signatures.

Arrays come back as ``jax.Array`` on jax's default device. bfloat16, the float8 family
(including F8_E8M0 and the FNUZ types) and F4 (``float4_e2m1fn``, one value per element) work
in both directions; F6 has no XLA type on CPU and is refused. Unlike the reference, ``save``
never replaces the values of the caller's dict with numpy arrays. 64-bit tensors follow
``jax_enable_x64`` (narrowed to 32 bits, with a warning, when it is off).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import numpy
from ._api import load_bytes_with, load_file_with, save_bytes_with, save_file_with
from ._errors import PathArg
from ._jax_adapter import ADAPTER
from ._reader import safe_open

__all__ = ["load", "load_file", "numpy", "safe_open", "save", "save_file"]


def save(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize jax arrays to the bytes of a safetensors file.

    Args:
        tensors: Name to ``jax.Array`` (numpy arrays are accepted too). Never modified.
        metadata: Optional ``__metadata__`` (str to str).

    Returns:
        The file's bytes, identical to the reference's for the same arrays.

    Raises:
        SerializeError: A value is not an array, or has a dtype safetensors cannot store.

    Example:
        >>> import jax.numpy as jnp
        >>> from pysafetensors.flax import load, save
        >>> load(save({"a": jnp.ones(2, jnp.bfloat16)}))["a"].dtype
        dtype(bfloat16)
    """
    return save_bytes_with(ADAPTER, tensors, metadata)


def save_file(
    tensors: Mapping[str, Any],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write jax arrays to a safetensors file, atomically.

    Args:
        tensors: As for :func:`save`. Never modified.
        filename: Target path; an existing file is replaced only once the new one is complete.
        metadata: Optional ``__metadata__``.
        fsync: Make the file durable before returning.
    """
    save_file_with(ADAPTER, tensors, filename, metadata, fsync=fsync)


def load(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Load jax arrays from the bytes of a safetensors file, in file order.

    Args:
        data: The file's bytes.

    Returns:
        Name to ``jax.Array``.
    """
    return load_bytes_with(ADAPTER, data, "cpu")


def load_file(
    filename: Any, *, backend: str = "mmap", storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load every tensor of a file (a path, URL or file object) as jax arrays, in file order.

    Args:
        filename: What to read: a file, a model folder, an index file, or their URL
            (a sharded checkpoint is loaded whole).
        backend: ``"mmap"`` or ``"pread"``.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).

    Returns:
        Name to ``jax.Array``.
    """
    return load_file_with("flax", filename, "cpu", backend, storage_options)


# The reference's helpers, for code that imports them from safetensors.flax.
def _np2jnp(numpy_dict: dict[str, Any]) -> dict[str, Any]:
    """The reference's helper: each array replaced by a jax array, in place."""
    for k, v in numpy_dict.items():
        numpy_dict[k] = jnp.array(v)
    return numpy_dict


def _jnp2np(jnp_dict: dict[str, Any]) -> dict[str, Any]:
    """The reference's helper: each value replaced by a numpy array, in place."""
    for k, v in jnp_dict.items():
        jnp_dict[k] = np.asarray(v)
    return jnp_dict
