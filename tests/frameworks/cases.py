"""Shared helpers for the framework tests: sample arrays of every dtype, and dict snapshots."""

from __future__ import annotations

from typing import Any

import numpy as np

from pysafetensors._adapter import numpy_dtype
from pysafetensors._dtypes import DTYPES, DType

__all__ = ["BY_CODE", "sample", "snapshot"]

BY_CODE = {d.code: d for d in DTYPES}


def sample(dtype: DType | str, shape: tuple[int, ...] = (3, 4), seed: int = 0) -> np.ndarray:
    """A numpy array of ``dtype`` with varied, exactly representable values.

    Random bit patterns are used for every dtype (NaN payloads included), so a conversion that
    goes through floating-point values instead of bits shows up as a mismatch.
    """
    dt = BY_CODE[dtype] if isinstance(dtype, str) else dtype
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    npdt = numpy_dtype(dt)
    if dt.code == "BOOL":
        return rng.integers(0, 2, count).astype(bool).reshape(shape)
    if dt.packed:
        # One code per byte in the low bits.
        codes = rng.integers(0, 1 << dt.bits, count, dtype=np.uint8)
        return codes.view(npdt).reshape(shape)
    raw = rng.integers(0, 256, count * npdt.itemsize, dtype=np.uint8)
    return raw.view(npdt).reshape(shape)


def snapshot(d: dict[str, Any]) -> list[tuple[str, int]]:
    """Keys and value identities, to prove a dict was not modified."""
    return [(k, id(v)) for k, v in d.items()]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
