"""Sharded folders (written by hand) and URLs served by a loopback Range server."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from pysafetensors.numpy import load_file, save_file

from .conftest import example_tensors, write_sharded
from .rangehttp import RangeHTTPServer


def test_sharded_inspect_validate(cli, cli_proc, sharded: Path) -> None:
    r = cli_proc("inspect", sharded)
    assert r.code == 0, r.err
    assert "2 files" in r.out and "model-00001-of-00002.safetensors" in r.out
    assert "Total: 5 tensors, 3.14K parameters (3,137)" in r.out
    doc = cli("inspect", sharded / "model.safetensors.index.json", "--json").json()
    assert doc["sharded"] is True and len(doc["files"]) == 2
    assert doc["index_metadata"]["total_size"] == doc["totals"]["bytes"]
    assert doc["metadata"] == {"format": "pt"}
    assert {t["file"] for t in doc["tensors"]} == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    r = cli("validate", sharded)
    assert r.code == 0 and "OK (2 files valid)" in r.out


def test_sharded_validate_index_problems(cli, sharded: Path) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"  # not in that shard
    del index["weight_map"]["step"]  # in a shard but not listed
    index["weight_map"]["evil"] = "../../etc/passwd.safetensors"
    index["metadata"]["total_size"] = 1
    index_path.write_text(json.dumps(index))
    doc = cli("validate", sharded, "--json").json()
    codes = {(p["code"], p["tensor"]) for p in doc["problems"]}
    assert ("IndexTensorMissing", "ghost") in codes
    assert ("IndexTensorUnlisted", "step") in codes
    assert ("UnsafeShardName", "evil") in codes
    assert cli("validate", sharded).code == 1
    # A --strict warning (such a checkpoint loads), as the reader's validate() refuses it.
    assert ("IndexTotalSize", None) not in codes
    doc = cli("validate", sharded, "--json", "--strict").json()
    assert ("warning", "IndexTotalSize", None) in {
        (p["severity"], p["code"], p["tensor"]) for p in doc["problems"]
    }


def test_a_total_size_that_counts_a_bool_as_an_eighth_of_a_byte(cli, sharded: Path) -> None:
    """Older transformers releases wrote such totals (a float, below the bytes held): the
    checkpoint loads everywhere, so only --strict fails it."""
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] = index["metadata"]["total_size"] - 7 / 8
    index_path.write_text(json.dumps(index))
    assert cli("validate", sharded).code == 0
    r = cli("validate", sharded, "--strict")
    assert r.code == 1 and "IndexTotalSize" in r.out + r.err


def test_sharded_validate_broken_shard(cli, sharded: Path) -> None:
    shard = sharded / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(bytes(data[:-3]))  # truncated
    doc = cli("validate", sharded, "--json").json()
    files = {p["file"] for p in doc["problems"] if p["code"] == "MetadataIncompleteBuffer"}
    assert files == {"model-00002-of-00002.safetensors"}
    (sharded / "model-00001-of-00002.safetensors").unlink()
    doc = cli("validate", sharded, "--json").json()
    assert "ShardMissing" in {p["code"] for p in doc["problems"]}


def test_file_and_shards_compare_equal(cli, example: Path, sharded: Path, tmp_path: Path) -> None:
    r = cli("diff", example, sharded)
    assert r.code == 1  # metadata differs ("source"), tensors do not
    doc = cli("diff", example, sharded, "--json").json()
    assert doc["summary"]["identical"] == 5 and doc["metadata"]["removed"] == {"source": "example"}
    # Other sharding, same tensors: same model digest as the single file.
    names = sorted(example_tensors())
    other = write_sharded(tmp_path / "three", example_tensors(), [names[:1], names[1:3], names[3:]])
    digests = {cli("hash", t, "--json").json()["model"] for t in (example, sharded, other)}
    assert len(digests) == 1
    doc = cli("hash", sharded, "--json").json()
    assert len(doc["files"]) == 2
    for f in doc["files"]:
        assert f["file"] == hashlib.sha256((sharded / f["path"]).read_bytes()).hexdigest()


def test_sharded_stats_and_cast(cli, sharded: Path, tmp_path: Path) -> None:
    doc = cli("stats", sharded, "--json").json()
    assert len(doc["tensors"]) == 5
    out = tmp_path / "bf16"
    r = cli("cast", sharded, out, "--to", "BF16")
    assert r.code == 0, r.err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values()))
    total = sum(t.nbytes for s in shards for t in load_file(str(out / s)).values())
    assert index["metadata"]["total_size"] == total
    assert cli("validate", out).code == 0
    cast = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    assert cast["model.embed.weight"].dtype == ml_dtypes.bfloat16
    assert cast["step"].dtype == np.int64


# ------------------------------------------------------------------------------------ remote


def test_remote_inspect_reads_only_the_header(
    cli_proc, http_server: RangeHTTPServer, http_root: Path
) -> None:
    url = f"{http_server.url}/big.safetensors"
    before = http_server.bytes_sent("big.safetensors")
    r = cli_proc("inspect", url, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    size = (http_root / "big.safetensors").stat().st_size
    assert doc["files"][0]["size"] == size and doc["tensors"][0]["shape"] == [262144]
    sent = http_server.bytes_sent("big.safetensors") - before
    assert 0 < sent <= 64 * 1024 < size  # one ranged read at open, never the 1 MiB of data


def test_remote_validate_hash_diff(cli, http_server: RangeHTTPServer, http_root: Path) -> None:
    url = f"{http_server.url}/model.safetensors"
    assert cli("validate", "--strict", url).code == 0
    remote = cli("hash", url, "--json").json()
    local = cli("hash", http_root / "model.safetensors", "--json").json()
    assert (
        remote["model"] == local["model"]
        and remote["files"][0]["file"] == local["files"][0]["file"]
    )
    assert cli("diff", url, http_root / "model.safetensors").code == 0
    stats = cli("stats", url, "--json").json()
    assert {t["name"] for t in stats["tensors"]} == set(example_tensors())


def test_remote_sharded_index(cli, http_server: RangeHTTPServer, http_root: Path) -> None:
    url = f"{http_server.url}/sharded/model.safetensors.index.json"
    doc = cli("inspect", url, "--json").json()
    assert doc["sharded"] and len(doc["files"]) == 2 and doc["totals"]["parameters"] == 3137
    assert cli("validate", url).code == 0
    local = cli("hash", http_root / "sharded", "--json").json()["model"]
    assert cli("hash", url, "--json").json()["model"] == local


def test_remote_index_query_is_not_passed_to_shards(
    cli, http_server: RangeHTTPServer, http_root: Path
) -> None:
    """A query string (a signature, ``?download=true``) belongs to the index's URL alone, as
    ``safe_open`` treats it; ``inspect``/``validate``/``hash`` sent it to every shard."""
    url = f"{http_server.url}/sharded/model.safetensors.index.json?download=true&sig=SECRET"
    before = len(http_server.log)
    assert cli("validate", url).code == 0
    assert cli("inspect", url, "--json").json()["sharded"]
    assert cli("hash", url, "--json").code == 0
    shard_paths = [
        p for p, _, _ in http_server.log[before:] if p.endswith(".safetensors") or "-of-" in p
    ]
    assert shard_paths, http_server.log[before:]
    assert all("SECRET" not in p and "?" not in p for p in shard_paths), shard_paths


def test_deeply_nested_index_is_one_error(cli, sharded: Path) -> None:
    index = sharded / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}, "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for command in ("inspect", "validate", "hash", "stats"):
        r = cli(command, sharded)
        assert r.code in (1, 2), (command, r.code)
        assert r.err.startswith("error:") or "IndexInvalid" in r.out + r.err, (command, r.err)
        assert "Traceback" not in r.err and "nested too deeply" in r.out + r.err, (command, r.err)


def test_remote_missing_is_exit_2(cli, http_server: RangeHTTPServer) -> None:
    r = cli("validate", f"{http_server.url}/nope.safetensors")
    assert r.code == 2 and r.err.startswith("error:")


def test_cast_from_url(cli, http_server: RangeHTTPServer, tmp_path: Path) -> None:
    out = tmp_path / "f16.safetensors"
    assert cli("cast", f"{http_server.url}/model.safetensors", out, "--to", "F16").code == 0
    assert load_file(str(out))["model.embed.weight"].dtype == np.float16
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "x.safetensors"))
