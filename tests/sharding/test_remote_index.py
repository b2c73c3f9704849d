"""A sharded checkpoint opened through an index URL (loopback HTTP range server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from pysafetensors import reshard, safe_open, save_sharded


def test_open_index_over_http(tmp_path: Path, range_server_class: Any) -> None:
    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(6)}
    plan = save_sharded(sd, tmp_path, "9KB", metadata={"k": "v"})
    assert plan.is_sharded
    server = range_server_class(tmp_path)
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


def _sharded(tmp_path: Path) -> tuple[dict[str, np.ndarray], Any]:
    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(6)}
    plan = save_sharded(sd, tmp_path, "9KB", metadata={"k": "v"})
    assert plan.is_sharded
    return sd, plan


def test_index_behind_auth_gets_the_storage_options(
    tmp_path: Path, range_server_class: Any
) -> None:
    # The server's /auth/<name> serves <name>, with 401 unless the token is sent: the index and
    # every shard (found next to the index, so under /auth/ too) need the storage options.
    sd, plan = _sharded(tmp_path)
    server = range_server_class(tmp_path)
    opts = {"headers": {"Authorization": "Bearer letmein"}}
    try:
        url = server.url("auth/model.safetensors.index.json")
        with safe_open(url, "np", storage_options=opts) as f:
            np.testing.assert_array_equal(f.get_tensor("t4"), sd["t4"])
            f.validate()  # reads every shard's header, with the same options
        assert all(r.status != 401 for r in server.records())
        shards = {r.path.rsplit("/", 1)[-1] for r in server.records()}
        assert shards == {"model.safetensors.index.json", *plan.filename_to_tensors}
    finally:
        server.close()


def test_reshard_a_remote_index_behind_auth(tmp_path: Path, range_server_class: Any) -> None:
    sd, _ = _sharded(tmp_path)
    server = range_server_class(tmp_path)
    try:
        reshard(
            server.url("auth/model.safetensors.index.json"),
            tmp_path / "out",
            "1MB",
            storage_options={"headers": {"Authorization": "Bearer letmein"}},
        )
    finally:
        server.close()
    with safe_open(tmp_path / "out", "np") as f:
        assert f.keys() == sorted(sd)
        np.testing.assert_array_equal(f.get_tensor("t5"), sd["t5"])
        assert (f.metadata() or {})["k"] == "v"


def test_index_url_with_a_query_string(tmp_path: Path, range_server_class: Any) -> None:
    # The hub's "?download=true": still an index, and its query belongs to it alone.
    sd, plan = _sharded(tmp_path)
    server = range_server_class(tmp_path)
    try:
        url = server.url("auth/model.safetensors.index.json?download=true")
        opts = {"headers": {"Authorization": "Bearer letmein"}}
        with safe_open(url, "np", storage_options=opts) as f:
            assert f.keys() == sorted(sd)
            np.testing.assert_array_equal(f.get_tensor("t1"), sd["t1"])
            assert f.shard_of("t1") == server.url("auth/" + plan.tensor_to_filename["t1"])
        paths = [r.path for r in server.records()]
        assert paths[0] == "/auth/model.safetensors.index.json?download=true"
        assert all("?" not in p for p in paths[1:])
    finally:
        server.close()


def test_shard_names_are_encoded_in_urls(tmp_path: Path, range_server_class: Any) -> None:
    sd = {"a": np.arange(4, dtype=np.float32), "b": np.arange(6, dtype=np.float32)}
    folder = tmp_path / "m"
    plan = save_sharded(sd, folder, 30, filename_pattern="mod èle#{suffix}.safetensors")
    assert plan.is_sharded
    index = next(p.name for p in folder.iterdir() if p.name.endswith(".index.json"))
    server = range_server_class(tmp_path)
    try:
        # The index URL is written encoded ('#' would start a fragment); the shard names inside
        # it are plain file names, encoded when joined to the URL.
        with safe_open(server.url("m/" + quote(index)), "np") as f:
            np.testing.assert_array_equal(f.get_tensor("a"), sd["a"])
            np.testing.assert_array_equal(f.get_tensor("b"), sd["b"])
        assert {r.status for r in server.records()} == {206}
    finally:
        server.close()
