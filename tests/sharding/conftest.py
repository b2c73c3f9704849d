"""Helpers for the sharding tests: random state dicts and folder comparison."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
except ImportError:
    # Every sharding test uses torch; without it they are not collected (a skip raised here,
    # in a conftest, would be a collection error instead).
    torch = None
    collect_ignore_glob = ["test_*.py"]


def tree_digest(folder: str | os.PathLike[str]) -> dict[str, str]:
    """File name to sha256 for every file of a folder (temporary files would show up too)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        out[name] = hashlib.sha256(Path(folder, name).read_bytes()).hexdigest()
    return out


def _split_file(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def assert_same_tree(
    a: str | os.PathLike[str], b: str | os.PathLike[str], *, metadata_order: bool = True
) -> None:
    """Both folders hold the same file names with the same bytes.

    With ``metadata_order=False``, files may differ in the order of their ``__metadata__``
    keys only: the reference writes metadata with 2+ keys in a random order (HashMap), so the
    hub's single-file saves with user metadata cannot be compared byte for byte.
    """
    da, db = tree_digest(a), tree_digest(b)
    assert sorted(da) == sorted(db)
    for name in da:
        if da[name] == db[name]:
            continue
        assert not metadata_order, f"{name} differs"
        ha, data_a = _split_file(Path(a, name))
        hb, data_b = _split_file(Path(b, name))
        assert data_a == data_b, f"{name}: data differs"
        assert ha == hb, f"{name}: header differs"
        assert list(ha) == list(hb), f"{name}: tensor order differs"


_DTYPES = (
    (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool)
    if torch is not None
    else ()
)


def random_state_dict(seed: int, n: int = 12, *, max_elems: int = 600) -> dict[str, Any]:
    """Torch tensors of assorted dtypes and shapes (some empty, some scalars), seeded."""
    rng = np.random.default_rng(seed)
    sd: dict[str, Any] = {}
    for i in range(n):
        dtype = _DTYPES[int(rng.integers(len(_DTYPES)))]
        kind = int(rng.integers(10))
        if kind == 0:
            shape: tuple[int, ...] = ()
        elif kind == 1:
            shape = (0, int(rng.integers(1, 4)))
        else:
            rows = int(rng.integers(1, 30))
            shape = (rows, int(rng.integers(1, max(2, max_elems // rows))))
        values = np.asarray(rng.standard_normal(shape) * 10, dtype=np.float32)
        t = torch.from_numpy(values).to(dtype)
        sd[f"layers.{i}.{'weight' if i % 2 else 'bias'}"] = t
    return sd
