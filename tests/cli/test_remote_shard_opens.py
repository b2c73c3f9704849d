"""The shards of a remote index are opened a few at once (a round trip each), in order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from .conftest import write_sharded
from .rangehttp import RangeHTTPServer

N_SHARDS = 16


@pytest.fixture
def distant(tmp_path: Path) -> Iterator[tuple[RangeHTTPServer, Path]]:
    pytest.importorskip("pysafetensors._remote")
    rng = np.random.default_rng(5)
    tensors = {f"t{i:02d}": rng.standard_normal(64).astype(np.float32) for i in range(N_SHARDS)}
    names = list(tensors)
    folder = write_sharded(tmp_path / "model", tensors, [[n] for n in names])
    server = RangeHTTPServer(tmp_path)
    server.delay = 0.05
    yield server, folder
    server.close()


def test_inspect_and_validate_open_shards_in_parallel(
    cli, distant: tuple[RangeHTTPServer, Path]
) -> None:
    server, folder = distant
    index = f"{server.url}/model/model.safetensors.index.json"
    remote = cli("inspect", index, "--json")
    assert remote.code == 0, remote.err
    local = cli("inspect", folder, "--json").json()
    assert [t["name"] for t in remote.json()["tensors"]] == [t["name"] for t in local["tensors"]]
    assert [f["path"] for f in remote.json()["files"]] == [f["path"] for f in local["files"]]
    assert server.most_in_flight >= 4  # one at a time before
    server.most_in_flight = 0
    r = cli("validate", "--strict", index, "--json")
    assert r.json()["problems"] == cli("validate", "--strict", folder, "--json").json()["problems"]
    assert server.most_in_flight >= 4


def test_a_missing_shard_is_reported_in_its_place(
    cli, distant: tuple[RangeHTTPServer, Path]
) -> None:
    server, folder = distant
    for n in (5, 11):
        (folder / f"model-{n:05d}-of-{N_SHARDS:05d}.safetensors").unlink()
    index = f"{server.url}/model/model.safetensors.index.json"
    r = cli("validate", index, "--json")
    missing = [p["file"] for p in r.json()["problems"] if p["code"] == "ShardMissing"]
    assert missing == [f"model-{n:05d}-of-{N_SHARDS:05d}.safetensors" for n in (5, 11)]
    # A command that needs every shard names the first missing one, as before.
    r = cli("inspect", index)
    assert r.code == 2 and f"model-00005-of-{N_SHARDS:05d}.safetensors" in r.err, r.err


def test_library_validate_opens_shards_in_parallel(distant: tuple[RangeHTTPServer, Path]) -> None:
    import json

    from pysafetensors import ShardIndexError, safe_open
    from pysafetensors.numpy import save_file

    server, folder = distant
    index = f"{server.url}/model/model.safetensors.index.json"
    with safe_open(index, "np") as f:
        f.validate()
    assert server.most_in_flight >= 4
    # The same verdicts as a local copy: a tensor in two shards (seen in the unchecked
    # headers first), then one the index places elsewhere.
    twice = folder / f"model-00009-of-{N_SHARDS:05d}.safetensors"
    save_file({"t08": np.zeros(64, np.float32), "t03": np.zeros(64, np.float32)}, str(twice))
    for target in (index, folder):
        with safe_open(target, "np") as f, pytest.raises(ShardIndexError) as info:
            f.validate()
        assert info.value.kind == "TensorInTwoShards" and info.value.tensor == "t03"
    save_file({"t08": np.zeros(64, np.float32)}, str(twice))  # the tensors the index lists
    meta = json.loads((folder / "model.safetensors.index.json").read_text())
    meta["weight_map"]["t12"] = f"model-00002-of-{N_SHARDS:05d}.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(meta))
    kinds = set()
    for target in (index, folder):
        with safe_open(target, "np") as f, pytest.raises(ShardIndexError) as info:
            f.validate()
        kinds.add((info.value.kind, info.value.tensor))
    assert len(kinds) == 1, kinds
