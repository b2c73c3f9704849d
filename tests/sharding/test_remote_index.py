"""A sharded checkpoint opened through an index URL (loopback HTTP range server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pysafetensors import safe_open, save_sharded


def _range_server_class() -> Any:
    # The loopback server lives with the remote tests; load it by path (tests/ is no package).
    path = Path(__file__).parents[1] / "remote" / "rangeserver.py"
    spec = importlib.util.spec_from_file_location("_sharding_rangeserver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.RangeServer


def test_open_index_over_http(tmp_path: Path) -> None:
    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(6)}
    plan = save_sharded(sd, tmp_path, "9KB", metadata={"k": "v"})
    assert plan.is_sharded
    server = _range_server_class()(tmp_path)
    try:
        url = server.url("model.safetensors.index.json")
        with safe_open(url, "np") as f:
            assert f.keys() == sorted(sd)
            assert (f.metadata() or {})["k"] == "v"
            np.testing.assert_array_equal(f.get_tensor("t4"), sd["t4"])
            # Only the index and t4's shard were fetched.
            touched = {name for name in plan.filename_to_tensors if server.requests(name)}
            assert touched == {plan.tensor_to_filename["t4"]}
    finally:
        server.close()
