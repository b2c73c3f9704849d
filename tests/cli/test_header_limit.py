"""``--max-header-size``: the library's ``max_header_size=`` on the command line, for files
whose header is over the reference's fixed 100,000,000 bytes (the commands could not read
them at all) and for a lower limit on untrusted files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors

from pysafetensors import safe_open, serialize_file
from pysafetensors.numpy import save_file

#: Over the default limit (100,000,000) by a few bytes: a metadata value of this size.
BIG = 100_000_100


@pytest.fixture(scope="module")
def big_header(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file whose header is just over the default limit (its metadata), two tensors."""
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    tensors = {
        "a": {"dtype": "float32", "shape": [2, 3], "data": np.arange(6, dtype=np.float32)},
        "b": {"dtype": "int16", "shape": [4], "data": np.ones(4, np.int16)},
    }
    serialize_file(tensors, path, {"notes": "x" * BIG}, max_header_size=200_000_000)
    return path


def test_a_header_over_the_default_limit_is_refused_with_a_hint(cli, big_header: Path) -> None:
    with pytest.raises(safetensors.SafetensorError):  # the reference opens no such file
        safetensors.safe_open(str(big_header), "np")
    for args in (["inspect"], ["hash"], ["metadata", "get"]):
        r = cli(*args, big_header)
        assert r.code == 1 and "header too large" in r.err, (args, r.err)
        assert "--max-header-size" in r.err and r.out == ""
    r = cli("validate", big_header)
    assert r.code == 1 and "HeaderTooLarge" in r.out and "--max-header-size" in r.err


def test_a_raised_limit_reads_and_writes_such_a_file(cli, big_header: Path, tmp_path: Path) -> None:
    limit = ("--max-header-size", "200MB")
    r = cli("inspect", big_header, "--json", *limit)
    assert r.code == 0, r.err
    doc = r.json()
    assert {t["name"] for t in doc["tensors"]} == {"a", "b"}
    assert cli("validate", big_header, *limit).code == 0
    assert cli("hash", big_header, *limit).code == 0
    assert len(cli("metadata", "get", big_header, "notes", *limit).out.strip()) == BIG
    out = tmp_path / "cast.safetensors"
    r = cli("cast", big_header, out, "--to", "F16", *limit)
    assert r.code == 0, r.err
    with safe_open(out, "np", max_header_size=200_000_000) as f:
        assert f.get_tensor("a").dtype == np.float16 and len(f.metadata()["notes"]) == BIG
    assert cli("diff", big_header, big_header, *limit).code == 0
    r = cli("metadata", "set", big_header, "extra=1", *limit)
    assert r.code == 0, r.err
    with safe_open(big_header, "np", max_header_size=200_000_000) as f:
        assert f.metadata()["extra"] == "1" and np.array_equal(
            f.get_tensor("b"), np.ones(4, np.int16)
        )


@pytest.mark.parametrize(
    "args",
    [
        ["inspect"],
        ["validate"],
        ["hash"],
        ["stats"],
        ["metadata", "get"],
        ["metadata", "set", "k=v"],
        ["metadata", "delete", "k", "--missing-ok"],
        ["diff", "SELF"],
        ["cast", "OUT", "--to", "F16"],
        ["reshard", "OUTDIR", "--max-shard-size", "100"],
        ["merge", "OUT"],
        ["extract", "OUT", "a"],
    ],
)
def test_a_lower_limit_refuses_a_file_in_every_command(cli, tmp_path: Path, args) -> None:
    """Each command reads (and writes) headers with the limit given, not the default."""
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(3, np.float32), "b": np.zeros(2, np.int8)}, path, {"k": "v"})
    before = path.read_bytes()
    header = 8 + int.from_bytes(before[:8], "little")
    command, *rest = args
    if command == "metadata":
        command, rest = f"metadata {rest[0]}", rest[1:]
    given = [
        {
            "SELF": str(path),
            "OUT": str(tmp_path / "o.safetensors"),
            "OUTDIR": str(tmp_path / "d"),
        }.get(a, a)
        for a in rest
    ]
    r = cli(*command.split(), path, *given, "--max-header-size", "64")
    assert r.code != 0 and "the limit is 64" in (r.err + r.out), (args, r.out, r.err)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "m.safetensors"
    ]
    r = cli(*command.split(), path, *given, "--max-header-size", str(header + 1000))
    assert r.code == 0, (args, r.out, r.err)


def test_the_limit_takes_bytes_or_a_unit(cli, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(3, np.float32)}, path)
    assert cli("inspect", path, "--max-header-size", "1KB").code == 0
    assert cli("inspect", path, "--max-header-size", "0.05KB").code == 1  # 50 bytes
    for bad in ("-1", "lots", "1e9", "infGB"):
        r = cli("inspect", path, "--max-header-size", bad)
        assert r.code == 2 and "--max-header-size" in r.err, (bad, r.err)
    assert json.loads(cli("inspect", path, "--json").out)["tensors"]
