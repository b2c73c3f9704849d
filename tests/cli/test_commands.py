"""Every subcommand through the real command line, on real files; output, JSON and exit codes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from pysafetensors import safe_open
from pysafetensors.numpy import load_file, save_file

from .conftest import example_tensors, raw_file, write_sharded


def test_console_script_runs(console_script: str, example: Path) -> None:
    proc = subprocess.run(
        [console_script, "inspect", str(example)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "model.embed.weight" in proc.stdout
    help_text = subprocess.run([console_script, "--help"], capture_output=True, text=True).stdout
    for name in ("inspect", "validate", "diff", "stats", "hash", "cast", "metadata"):
        assert name in help_text


@pytest.mark.parametrize("command", ["merge", "cast"])
def test_an_output_that_cannot_be_written_exits_2_and_leaves_nothing(
    console_script: str, example: Path, tmp_path: Path, command: str
) -> None:
    # As docs/cli.md says: 2 is also for an output that cannot be written (here the file size
    # limit), in one line naming it, and the output does not appear.
    import resource

    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "out.safetensors"
    args = [str(example), str(out)] + (["--to", "F16"] if command == "cast" else [])
    proc = subprocess.run(
        [console_script, command, *args],
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY)
        ),
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: Error while serializing: I/O error: File too large")
    assert str(out) in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------- inspect


def test_inspect_table(cli, example: Path) -> None:
    r = cli("inspect", example)
    assert r.code == 0, r.err
    assert "header" in r.out and "format" in r.out and "example" in r.out
    lines = {line.split()[0]: line for line in r.out.splitlines() if line.strip()}
    assert "F32" in lines["model.embed.weight"] and "[64, 32]" in lines["model.embed.weight"]
    assert "2,048" in lines["model.embed.weight"]
    assert "Total: 5 tensors, 3.14K parameters (3,137)" in r.out
    assert "Totals by dtype:" in r.out


def test_inspect_json_schema(cli, example: Path) -> None:
    doc = cli("inspect", example, "--json").json()
    assert doc["schema"] == "pysafetensors.inspect/1"
    assert doc["metadata"] == {"format": "pt", "source": "example"}
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert set(by_name) == set(example_tensors())
    t = by_name["model.layers.0.attn.q.weight"]
    assert (t["dtype"], t["shape"], t["parameters"], t["bytes"]) == ("BF16", [32, 32], 1024, 2048)
    data_start = doc["files"][0]["data_start"]
    assert t["file_offsets"] == [
        data_start + t["data_offsets"][0],
        data_start + t["data_offsets"][1],
    ]
    assert doc["totals"]["parameters"] == 3137
    assert doc["totals"]["by_dtype"]["F32"] == {"tensors": 2, "parameters": 2080, "bytes": 8320}
    assert doc["files"][0]["size"] == example.stat().st_size


def test_inspect_filter(cli, example: Path) -> None:
    doc = cli("inspect", example, "--json", "--filter", "model.layers.*").json()
    assert [t["name"] for t in doc["tensors"]] == [
        "model.layers.0.norm.weight",
        "model.layers.0.attn.q.weight",
        "model.layers.0.attn.q.bias",
    ]
    doc = cli("inspect", example, "--json", "--regex", r"bias$").json()
    assert [t["name"] for t in doc["tensors"]] == ["model.layers.0.attn.q.bias"]


def test_hostile_names_are_escaped(cli, cli_proc, tmp_path: Path) -> None:
    evil = "\x1b]0;pwned\x07\x1b[31mred[bold]x[/bold]\u202e"
    path = tmp_path / "evil.safetensors"
    save_file({evil: np.zeros(2, np.float32)}, str(path), metadata={"k\x1b[2J": "v\x9b1m"})
    for args in (("inspect", path), ("stats", path), ("hash", path), ("metadata", "get", path)):
        r = (cli_proc if args[0] == "inspect" else cli)(*args)
        assert r.code == 0, r.err
        assert "\x1b" not in r.out and "\x07" not in r.out and "\x9b" not in r.out
        assert "\u202e" not in r.out
    out = cli("inspect", path).out
    assert "\\x1b]0;pwned\\x07\\x1b[31mred[bold]x[/bold]\\u202e" in out
    assert "k\\x1b[2J" in out and "v\\x9b1m" in out
    # JSON escapes everything non-ASCII and stays exact.
    doc = cli("inspect", path, "--json").json()
    assert doc["tensors"][0]["name"] == evil


# --------------------------------------------------------------------------------- validate


def _malformed(tmp_path: Path) -> Path:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [16, 24]},  # hole + wrong size
        "c": {"dtype": "X99", "shape": [1], "data_offsets": [24, 28]},  # unknown dtype
        "d": {"dtype": "I64", "shape": [1], "data_offsets": [24, 32]},
    }
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_file(header, bytes(40)))  # 8 trailing bytes
    return path


def test_validate_ok(cli, example: Path) -> None:
    r = cli("validate", example)
    assert r.code == 0 and "OK" in r.out


def test_validate_reports_every_problem_with_offsets(cli, cli_proc, tmp_path: Path) -> None:
    bad = _malformed(tmp_path)
    r = cli_proc("validate", bad)
    assert r.code == 1
    assert "5 errors" in r.out
    doc = cli("validate", bad, "--json").json()
    assert doc["schema"] == "pysafetensors.validate/1" and doc["valid"] is False
    found = {(p["code"], p["tensor"]) for p in doc["problems"]}
    # c's unknown dtype does not hide its bytes: d overlaps them (a problem of its own).
    assert found == {
        ("InvalidHeaderDeserialization", "c"),
        ("InvalidOffset", "b"),
        ("TensorInvalidInfo", "b"),
        ("InvalidOffset", "d"),
        ("MetadataIncompleteBuffer", None),
    }
    n = int.from_bytes(bad.read_bytes()[:8], "little")
    offsets = {p["code"]: p["offset"] for p in doc["problems"] if p["tensor"] != "d"}
    assert offsets["InvalidOffset"] == 8 + n + 8  # the hole starts after tensor a
    assert offsets["TensorInvalidInfo"] == 8 + n + 16
    assert offsets["MetadataIncompleteBuffer"] == 8 + n + 32
    header = bad.read_bytes()[8 : 8 + n]
    assert header[offsets["InvalidHeaderDeserialization"] - 8 :].startswith(b'"c"')


def test_validate_length_prefix_problems(cli, tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    doc = cli("validate", short, "--json").json()
    assert [p["code"] for p in doc["problems"]] == ["HeaderTooSmall"]
    past = tmp_path / "past.safetensors"
    past.write_bytes((1000).to_bytes(8, "little") + b"{}")
    r = cli("validate", past)
    assert r.code == 1 and "InvalidHeaderLength" in r.out


def test_validate_strict_warnings(cli, tmp_path: Path) -> None:
    values = np.array([1.0, np.nan, np.inf, 2.0], np.float32)
    path = tmp_path / "nan.safetensors"
    save_file({"w": values, "mask": np.array([True, False])}, str(path))
    assert cli("validate", path).code == 0
    r = cli("validate", "--strict", path, "--json")
    assert r.code == 1
    codes = {p["code"]: p for p in r.json()["problems"]}
    assert set(codes) == {"NonFinite", "MissingFormat"}
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert codes["NonFinite"]["tensor"] == "w"
    assert codes["NonFinite"]["offset"] == 8 + n + 4  # the NaN is element 1
    assert "1 NaN and 1 Inf" in codes["NonFinite"]["message"]


def test_validate_strict_unaligned(cli, tmp_path: Path) -> None:
    # Header of 9 bytes is legal, but the F32 data then starts at file offset 17.
    header = (
        json.dumps(
            {
                "__metadata__": {"format": "pt"},
                "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            }
        ).encode()
        + b" "
    )
    header += b" " * ((-len(header) % 8) + 1)
    path = tmp_path / "unaligned.safetensors"
    path.write_bytes(raw_file(header, bytes(4), pad=False))
    assert cli("validate", path).code == 0
    codes = [p["code"] for p in cli("validate", "--strict", path, "--json").json()["problems"]]
    assert "Unaligned" in codes and "UnalignedDataBuffer" in codes


@pytest.mark.parametrize("strict", [False, True])
def test_validate_truncated_file_reports_the_format_problem(
    cli, example: Path, sharded: Path, strict: bool
) -> None:
    flag = ["--strict"] if strict else []
    size = example.stat().st_size
    os.truncate(example, size - 1000)
    r = cli("validate", example, *flag, "--json")
    assert r.code == 1, r.err
    codes = [p["code"] for p in r.json()["problems"] if p["severity"] == "error"]
    assert codes == ["MetadataIncompleteBuffer"]
    # A sharded model with a truncated shard: the same problem, named with the shard.
    shard = sharded / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    r = cli("validate", sharded, *flag, "--json")
    assert r.code == 1, r.err
    errors = [p for p in r.json()["problems"] if p["severity"] == "error"]
    assert [(p["code"], p["file"]) for p in errors] == [("MetadataIncompleteBuffer", shard.name)]


@pytest.mark.parametrize("strict", [False, True])
def test_validate_shard_path_that_is_a_folder_is_a_problem(
    cli, sharded: Path, strict: bool
) -> None:
    shard = sharded / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.mkdir()
    r = cli("validate", sharded, *(["--strict"] if strict else []))
    assert r.code == 1, r.err
    assert "model-00002-of-00002.safetensors: error [ShardMissing]: shard path is a folder" in r.out
    assert r.err == ""


def test_exit_codes_for_usage_and_unreadable(cli, cli_proc, tmp_path: Path) -> None:
    r = cli_proc("validate", tmp_path / "missing.safetensors")
    assert r.code == 2 and r.err.startswith("error:") and "Traceback" not in r.err
    assert cli("validate").code == 2  # argparse usage error
    assert cli("nosuchcommand").code == 2
    bad = _malformed(tmp_path)
    r = cli("inspect", bad)
    assert r.code == 1 and len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    r = cli_proc("--debug", "inspect", bad)
    assert r.code == 1 and "Traceback" in r.err
    # --debug adds the traceback, never another exit code (it re-raised: 1 for every failure,
    # where validate and diff promise that 1 means problems found).
    missing = tmp_path / "missing.safetensors"
    for command in (["validate", missing], ["diff", bad, missing], ["inspect", missing]):
        r = cli("--debug", *command)
        assert (
            r.code == 2
            and "Traceback" in r.err
            and r.err.rstrip().splitlines()[-1].startswith("error: ")
        )


def test_an_unforeseen_failure_has_the_exit_code_of_a_failure_to_run(
    cli, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bug (an exception no handler names): a traceback to report, escaped as every message
    # is, and for validate the 2 of a failure to run, not the 1 of "problems found".
    import pysafetensors._cli._cmd_validate as cmd

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom \x1b[31m")

    monkeypatch.setattr(cmd, "validate", broken)
    r = cli("validate", example)
    assert r.code == 2 and "Traceback" in r.err and "RuntimeError: boom \\x1b[31m" in r.err
    assert "\x1b" not in r.err


# ------------------------------------------------------------------------------------- diff


def test_diff(cli, cli_proc, example: Path, tmp_path: Path) -> None:
    tensors = load_file(str(example))
    tensors["model.embed.weight"][0, 0] += np.float32(0.001)
    del tensors["step"]
    tensors["new"] = np.zeros(3, np.int8)
    tensors["model.layers.0.attn.q.bias"] = np.zeros(16, np.float16)
    other = tmp_path / "other.safetensors"
    save_file(tensors, str(other), metadata={"format": "np"})

    assert cli("diff", example, example).code == 0
    r = cli_proc("diff", example, other)
    assert r.code == 1
    assert "+ new  I8 [3]" in r.out and "- step  I64 []" in r.out
    assert "~ model.layers.0.attn.q.bias  shape [32] -> [16]" in r.out
    assert "~ metadata format: pt -> np" in r.out and "- metadata source: example" in r.out

    doc = cli("diff", example, other, "--json").json()
    assert doc["schema"] == "pysafetensors.diff/1" and doc["equal"] is False
    rows = {t["name"]: t for t in doc["tensors"]}
    embed = rows["model.embed.weight"]
    assert embed["status"] == "changed" and embed["values"]["differing"] == 1
    assert embed["values"]["max_abs"] == pytest.approx(0.001, rel=1e-3)
    assert rows["model.layers.0.norm.weight"]["status"] == "identical"
    assert doc["summary"] == {
        "added": 1,
        "removed": 1,
        "changed": 2,
        "close": 0,
        "identical": 2,
        "unchecked": 0,
    }

    # Within tolerance, and limited to the tensors that only differ in value.
    r = cli("diff", example, other, "--atol", "0.01", "--filter", "model.embed.*", "--json")
    assert r.json()["tensors"][0]["status"] == "close"


def test_diff_non_finite_values_compare_exactly_in_both_orders(cli, tmp_path: Path) -> None:
    inf, nan = np.inf, np.nan
    # Pairs (a, b) and whether they are equal; each tensor holds one pair and a finite 1.0.
    pairs = {
        "pinf_ninf": (inf, -inf, False),
        "five_inf": (5.0, inf, False),
        "inf_nan": (inf, nan, False),
        "nan_five": (nan, 5.0, False),
        "inf_inf": (inf, inf, True),
        "ninf_ninf": (-inf, -inf, True),
        "nan_nan": (nan, nan, True),
    }
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({k: np.array([a, 1.0], np.float32) for k, (a, _, _) in pairs.items()}, str(fa))
    save_file({k: np.array([b, 1.0], np.float32) for k, (_, b, _) in pairs.items()}, str(fb))
    for first, second in ((fa, fb), (fb, fa)):
        # Huge tolerances cannot make a non-finite difference pass.
        for tol in ((), ("--atol", "1e300", "--rtol", "1e300")):
            r = cli("diff", first, second, "--json", *tol)
            assert r.code == 1, (first.name, tol)
            rows = {t["name"]: t for t in r.json()["tensors"]}
            for name, (_, _, equal) in pairs.items():
                assert rows[name]["status"] == ("identical" if equal else "changed"), (name, tol)
                if not equal:
                    assert rows[name]["values"]["outside_tolerance"] == 1
                    assert rows[name]["values"]["max_abs"] is None  # infinite difference
    # A NaN with another payload is still NaN: equal, not a difference.
    bits = np.array([0x7FC00001, 0x3F800000], np.uint32).view(np.float32)
    save_file({"nan_nan": bits}, str(tmp_path / "c.safetensors"))
    r = cli("diff", fa, tmp_path / "c.safetensors", "--json", "--filter", "nan_nan")
    assert r.code == 0 and r.json()["tensors"][0]["values"]["differing"] == 0


@pytest.mark.parametrize(
    ("a", "b", "tolerance", "within"),
    [
        (1.2e308, -1.2e308, ("--rtol", "1.5"), False),  # 2.4e308 > 1.8e308
        (1.7e308, -1.7e308, ("--atol", "1.7e308", "--rtol", "0.1"), False),
        (1.7e308, -1e308, ("--atol", "1e308", "--rtol", "1"), False),
        (1.2e308, -1.2e308, ("--rtol", "2.5"), True),  # 2.4e308 <= 3e308
        (-1e308, 1.7e308, ("--atol", "1e308", "--rtol", "1"), True),  # 2.7e308 <= 2.7e308
    ],
)
def test_diff_finite_values_whose_difference_overflows(
    cli, tmp_path: Path, a: float, b: float, tolerance: tuple[str, ...], within: bool
) -> None:
    # |a-b| overflowed to inf, and so did atol + rtol*|b|: inf > inf let any such pair pass as
    # "within tolerance".
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": np.array([a, 1.0])}, str(fa))
    save_file({"x": np.array([b, 1.0])}, str(fb))
    r = cli("diff", fa, fb, "--json", *tolerance)
    row = r.json()["tensors"][0]
    assert row["status"] == ("close" if within else "changed"), row
    assert row["values"]["outside_tolerance"] == (0 if within else 1)
    assert r.code == (0 if within else 1)


@pytest.mark.parametrize("value", ["nan", "-1", "-0.5", "abc", "inf", "-inf"])
@pytest.mark.parametrize("option", ["--atol", "--rtol"])
def test_diff_refuses_bad_tolerances(cli, example: Path, option: str, value: str) -> None:
    r = cli("diff", example, example, f"{option}={value}")
    assert r.code == 2 and option in r.err and "Traceback" not in r.err


# ------------------------------------------------------------------------------------ stats


def test_stats_json_matches_numpy(cli, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal(10_000).astype(np.float32)
    w[:3] = [np.nan, np.inf, 0.0]
    path = tmp_path / "s.safetensors"
    save_file({"w": w, "i": np.arange(-5, 5, dtype=np.int32)}, str(path))
    doc = cli("stats", path, "--json", "--histogram", "7").json()
    assert doc["schema"] == "pysafetensors.stats/1"
    rows = {t["name"]: t for t in doc["tensors"]}
    finite = w[np.isfinite(w)].astype(np.float64)
    s = rows["w"]
    assert (s["nan"], s["inf"], s["count"]) == (1, 1, 10_000)
    assert s["zeros"] == int((w == 0).sum())
    assert s["mean"] == pytest.approx(finite.mean(), rel=1e-9)
    assert s["std"] == pytest.approx(finite.std(), rel=1e-9)
    assert (s["min"], s["max"]) == (finite.min(), finite.max())
    assert sum(s["histogram"]["counts"]) == finite.size and len(s["histogram"]["counts"]) == 7
    # The counts are numpy's for the edges shown (values on an edge go right, the last bin
    # is closed), whichever way they are computed.
    edges = np.array(s["histogram"]["edges"])
    assert s["histogram"]["counts"] == np.histogram(finite, bins=edges)[0].tolist()
    ints = np.arange(-5, 5, dtype=np.float64)
    assert (
        rows["i"]["histogram"]["counts"]
        == np.histogram(ints, bins=np.linspace(-5, 4, 8))[0].tolist()
    )
    assert rows["i"]["min"] == -5 and rows["i"]["max"] == 4 and rows["i"]["zeros"] == 1
    many = cli("stats", path, "--json", "--histogram", "20000").json()["tensors"]
    (wide,) = [t["histogram"] for t in many if t["name"] == "w"]
    assert wide["counts"] == np.histogram(finite, bins=np.array(wide["edges"]))[0].tolist()

    r = cli("stats", path)
    assert r.code == 0 and "NAME" in r.out and "MEAN" in r.out


# ------------------------------------------------------------------------------------- hash


def test_hash_digests(cli, example: Path, tmp_path: Path) -> None:
    doc = cli("hash", example, "--json").json()
    assert doc["schema"] == "pysafetensors.hash/2"
    data = example.read_bytes()
    assert doc["files"][0]["file"] == hashlib.sha256(data).hexdigest()
    n = int.from_bytes(data[:8], "little")
    assert doc["files"][0]["header"] == hashlib.sha256(data[: 8 + n]).hexdigest()
    meta = {t["name"]: t for t in cli("inspect", example, "--json").json()["tensors"]}
    assert sorted(row["name"] for row in doc["tensors"]) == sorted(meta)  # every one, once
    for row in doc["tensors"]:
        b, e = meta[row["name"]]["file_offsets"]
        assert row["digest"] == hashlib.sha256(data[b:e]).hexdigest()

    # Same tensors, other metadata, other writer order: same model digest, other file digest.
    tensors = load_file(str(example))
    other = tmp_path / "other.safetensors"
    save_file(dict(reversed(list(tensors.items()))), str(other), metadata={"x": "y"})
    doc2 = cli("hash", other, "--json").json()
    assert doc2["model"] == doc["model"] and doc2["files"][0]["file"] != doc["files"][0]["file"]
    tensors["step"] = np.array(1001, np.int64)
    save_file(tensors, str(other))
    assert cli("hash", other, "--json").json()["model"] != doc["model"]
    assert "model   sha256:" + doc["model"] in cli("hash", example).out


def test_hash_of_large_tensors_across_chunks(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 1 MiB or more feed the file's and the tensor's hashers on two threads, from
    one reused buffer: the digests are still those of the bytes, for every algorithm."""
    import pysafetensors
    import pysafetensors._cli._cmd_hash as cmd_hash

    monkeypatch.setattr(cmd_hash, "CHUNK_BYTES", (3 << 19) // 24 * 24)  # ~1.5 MiB chunks
    rng = np.random.default_rng(4)
    path = tmp_path / "big.safetensors"
    save_file(
        {
            "a": rng.integers(0, 255, (5 << 20) + 48, dtype=np.uint8),  # 4 chunks, a short last
            "b": rng.standard_normal(1000).astype(np.float32),  # one small chunk
            "c": rng.integers(0, 255, 3 << 20, dtype=np.uint8),
        },
        str(path),
    )
    data = path.read_bytes()
    for algorithm in ("sha256", "blake2b", "md5"):
        doc = cli("hash", path, "--json", "-a", algorithm).json()
        assert doc["files"][0]["file"] == hashlib.new(algorithm, data).hexdigest()
        with pysafetensors.safe_open(str(path), "np") as f:
            start = f.header.data_start
            assert sorted(row["name"] for row in doc["tensors"]) == ["a", "b", "c"]
            for row in doc["tensors"]:
                info = f.header.tensors[row["name"]]
                want = hashlib.new(algorithm, data[start + info.begin : start + info.end])
                assert row["digest"] == want.hexdigest(), (algorithm, row["name"])


@pytest.mark.parametrize("chunk", [24, 48, 1008, 24 << 20])
def test_hash_reads_the_data_in_chunks_and_hashes_each_tensor_from_them(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Each tensor's digest comes from the slices of the chunks it covers (small tensors
    several to a chunk, others across chunks, empty ones anywhere), read in one pass: a read
    per chunk, not per tensor."""
    import pysafetensors._cli._cmd_hash as cmd_hash

    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {"empty.first": np.zeros((0, 3), np.float32)}
    for i in range(60):
        tensors[f"t{i:02d}"] = rng.standard_normal(int(rng.integers(1, 40))).astype(np.float32)
        if i % 17 == 0:
            tensors[f"t{i:02d}.empty"] = np.zeros(0, np.int64)
    tensors["z.empty.last"] = np.zeros(0, np.uint8)
    path = tmp_path / "small.safetensors"
    save_file(tensors, str(path))
    monkeypatch.setattr(cmd_hash, "CHUNK_BYTES", chunk)
    chunks = 0
    real = cmd_hash.iter_tensor_chunks

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal chunks
        for item in real(*args, **kwargs):
            chunks += 1
            yield item

    monkeypatch.setattr(cmd_hash, "iter_tensor_chunks", counted)
    doc = cli("hash", path, "--json").json()
    data = path.read_bytes()
    with safe_open(str(path), "np") as f:
        start, size = f.header.data_start, f.header.data_size
        assert chunks == -(-start // chunk) + -(-size // chunk)  # the header's, then the data's
        assert sorted(row["name"] for row in doc["tensors"]) == sorted(tensors)
        for row in doc["tensors"]:
            info = f.header.tensors[row["name"]]
            want = hashlib.sha256(data[start + info.begin : start + info.end]).hexdigest()
            assert row["digest"] == want, row["name"]
    assert doc["files"][0]["file"] == hashlib.sha256(data).hexdigest()
    # Filtered: the same digests, for the tensors chosen only (every byte still read).
    some = cli("hash", path, "--json", "-f", "t1*").json()
    chosen = {row["name"]: row["digest"] for row in some["tensors"]}
    assert chosen == {r["name"]: r["digest"] for r in doc["tensors"] if r["name"][:2] == "t1"}
    assert some["files"] == doc["files"]


def test_hash_of_a_file_of_empty_tensors_only(cli, tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    save_file({"a": np.zeros(0, np.float32), "b": np.zeros((2, 0), np.int8)}, str(path))
    doc = cli("hash", path, "--json").json()
    empty = hashlib.sha256(b"").hexdigest()
    assert {row["name"]: row["digest"] for row in doc["tensors"]} == {"a": empty, "b": empty}
    assert doc["files"][0]["file"] == hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------- cast


def test_cast_f32_to_bf16(cli, example: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16.safetensors"
    r = cli("cast", example, out, "--to", "bf16")
    assert r.code == 0, r.err
    assert "cast 3 of 5 tensors to BF16" in r.out
    src, dst = load_file(str(example)), load_file(str(out))
    assert dst["step"].dtype == np.int64 and dst["step"] == 1000
    for name in ("model.embed.weight", "model.layers.0.norm.weight", "model.layers.0.attn.q.bias"):
        assert dst[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(dst[name], src[name].astype(ml_dtypes.bfloat16))
    assert cli("metadata", "get", out, "format").out.strip() == "pt"
    assert cli("validate", out).code == 0
    # The reference reads it.
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(out), "np") as f:
        assert f.get_tensor("model.embed.weight").dtype == ml_dtypes.bfloat16


def test_cast_reports_overflow_and_filter(cli, tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    save_file({"a": np.array([1e6, 1.0], np.float32), "b": np.ones(2, np.float32)}, str(path))
    out = tmp_path / "f16.safetensors"
    r = cli("cast", path, out, "--to", "F16", "--filter", "a")
    assert r.code == 0 and "1 finite value of a became Inf/NaN in F16" in r.err
    dst = load_file(str(out))
    assert dst["a"].dtype == np.float16 and np.isinf(dst["a"][0]) and dst["b"].dtype == np.float32
    # A filter that matches nothing casts nothing: said, not a silent copy.
    r = cli("cast", path, out, "--to", "F16", "--filter", "nothing.*")
    assert r.code == 0
    assert "warning: --filter/--regex matched no tensor: the output is a copy" in r.err
    assert "matched no tensor" not in cli("cast", path, out, "--to", "F16", "--regex", "^b").err


def test_cast_reports_values_flushed_to_zero_and_infinities_lost(cli, tmp_path: Path) -> None:
    # Below the target's smallest subnormal a value becomes 0, and an infinity becomes NaN
    # in an FP8 type without one: a whole tensor came out as zeros with no word said.
    path = tmp_path / "small.safetensors"
    x = np.array([1.0, 7e4, -1e300, np.nan, np.inf, 1e-50, 0.0, -0.0], np.float64)
    save_file({"w": np.array([1e-4, -3e-4, 2e-5, 9e-4], np.float32), "x": x}, str(path))
    r = cli("cast", path, tmp_path / "f8.safetensors", "--to", "F8_E4M3")
    assert r.code == 0
    assert r.err.splitlines() == [
        "warning: 4 nonzero values of w became 0 in F8_E4M3 (below its smallest subnormal)",
        "warning: 2 finite values of x became Inf/NaN in F8_E4M3",
        "warning: 1 nonzero value of x became 0 in F8_E4M3 (below its smallest subnormal)",
        "warning: 1 infinity of x became NaN in F8_E4M3, which has no infinity",
    ]
    assert not load_file(str(tmp_path / "f8.safetensors"))["w"].astype(np.float32).any()
    # F16 has infinities, and holds w.
    r = cli("cast", path, tmp_path / "f16.safetensors", "--to", "F16")
    assert r.err.splitlines() == [
        "warning: 2 finite values of x became Inf/NaN in F16",
        "warning: 1 nonzero value of x became 0 in F16 (below its smallest subnormal)",
    ]


# --------------------------------------------------------------------------------- metadata


def test_metadata_answers_with_quiet_and_says_when_nothing_changed(cli, tmp_path: Path) -> None:
    # -q dropped the answer "no metadata" (docs: -q never drops answers); a set that changed
    # nothing said "metadata updated in place".
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path))
    r = cli("-q", "metadata", "get", path)
    assert (r.code, r.out, r.err.strip()) == (0, "", "no metadata")
    assert "metadata updated" in cli("metadata", "set", path, "k=v").out
    before = path.read_bytes()
    r = cli("metadata", "set", path, "k=v")
    assert r.code == 0 and "metadata unchanged" in r.out and path.read_bytes() == before


def test_metadata_set_of_an_argument_that_is_not_utf8_is_a_usage_error(
    cli_proc, tmp_path: Path
) -> None:
    # Python keeps such bytes as lone surrogates; the edit refused them as a malformed file
    # would be (exit 1).
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path))
    before = path.read_bytes()
    r = cli_proc("metadata", "set", path, os.fsdecode(b"k\xff=v"))
    assert r.code == 2 and "must be UTF-8 text" in r.err
    assert path.read_bytes() == before


def test_metadata_get_set_delete(cli, example: Path) -> None:
    size = example.stat().st_size
    assert cli("metadata", "get", example).out.split() == ["format", "pt", "source", "example"]
    doc = cli("metadata", "get", example, "--json").json()
    assert doc == {
        "schema": "pysafetensors.metadata/1",
        "target": str(example),
        "metadata": {"format": "pt", "source": "example"},
    }

    # Deleting shrinks the JSON: always in place, the file keeps its size and offsets.
    r = cli("metadata", "delete", example, "source")
    assert r.code == 0 and "in place" in r.out and example.stat().st_size == size
    # A short value fits in the space freed.
    r = cli("metadata", "set", example, "lr=1e-4")
    assert "in place" in r.out and example.stat().st_size == size
    # A long one does not: the file is rewritten, tensors unchanged.
    os.chmod(example, 0o640)
    r = cli("metadata", "set", example, "notes=" + "x" * 500)
    assert r.code == 0 and "rewriting" in r.out and example.stat().st_size > size
    assert stat.S_IMODE(example.stat().st_mode) == 0o640
    assert cli("metadata", "get", example, "lr").out == "1e-4\n"
    tensors = load_file(str(example))
    for name, value in example_tensors().items():
        np.testing.assert_array_equal(tensors[name], value)
    assert cli("validate", example).code == 0

    r = cli("metadata", "delete", example, "nope")
    assert r.code == 1 and "no key 'nope'" in r.err
    assert cli("metadata", "delete", example, "nope", "--missing-ok").code == 0
    # A missing key reads as `delete` says it: exit 1 (a negative answer), the same words.
    r = cli("metadata", "get", example, "nope")
    assert r.code == 1 and r.err == f"error: {example}: metadata has no key 'nope'\n"
    assert cli("metadata", "set", example, "novalue").code == 2

    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(example), "np") as f:
        assert f.metadata() == {"format": "pt", "lr": "1e-4", "notes": "x" * 500}


def test_metadata_refuses_folders_and_urls(cli, sharded: Path) -> None:
    assert cli("metadata", "set", sharded, "a=b").code == 2
    assert cli("metadata", "set", "http://127.0.0.1:9/x.safetensors", "a=b").code == 2


@pytest.mark.parametrize("reserve", ["-5", "-1", "abc", "1.5"])
def test_metadata_set_refuses_bad_reserve(cli, example: Path, reserve: str) -> None:
    before = example.read_bytes()
    r = cli("metadata", "set", example, "notes=" + "x" * 500, f"--reserve={reserve}")
    assert r.code == 2 and "--reserve" in r.err
    assert example.read_bytes() == before


def test_metadata_set_through_a_symlink_edits_the_target_both_ways(cli, example: Path) -> None:
    link = example.parent / "link.safetensors"
    link.symlink_to(example.name)
    size = example.stat().st_size
    # In place (fits the padding), then a rewrite (grows the header): the link stays a link
    # and both edits land in the file it points to.
    r = cli("metadata", "delete", link, "source")
    assert r.code == 0 and "in place" in r.out
    r = cli("metadata", "set", link, "a=1")
    assert r.code == 0 and "in place" in r.out
    r = cli("metadata", "set", link, "notes=" + "y" * 2000)
    assert r.code == 0 and "rewriting" in r.out
    assert link.is_symlink() and os.readlink(link) == example.name
    assert example.stat().st_size > size
    assert cli("metadata", "get", example, "a").out == "1\n"
    assert cli("metadata", "get", link, "notes").out == "y" * 2000 + "\n"
    assert sorted(p.name for p in example.parent.iterdir()) == sorted([example.name, link.name])
    assert cli("validate", example).code == 0


def test_metadata_set_on_a_malformed_file_names_it(cli, tmp_path: Path) -> None:
    bad = _malformed(tmp_path)
    before = bad.read_bytes()
    r = cli("metadata", "set", bad, "a=b")
    assert r.code == 1 and r.err.startswith(f"error: {bad}: ")
    assert bad.read_bytes() == before


# ------------------------------------------------------------------- consistency across commands


def test_extract_bad_regex_is_a_usage_error(cli, example: Path, tmp_path: Path) -> None:
    r = cli("extract", example, tmp_path / "out.safetensors", "-E", "(")
    assert r.code == 2 and r.err.startswith("error: invalid --regex '('")
    assert "Traceback" not in r.err and not (tmp_path / "out.safetensors").exists()


def test_extract_patterns_as_documented(cli, example: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    names = list(example_tensors())
    # Globs match whole names (case-sensitive); a regex is searched anywhere in a name.
    glob_part = names[0][1:-1]
    assert cli("extract", example, out, glob_part).code == 1 and not out.exists()
    r = cli("extract", example, out, "-E", glob_part, "--list")
    assert r.code == 0 and r.out.splitlines() == [names[0]]
    # Any pattern matching is enough; a pattern that matches nothing beside it is no error.
    r = cli("extract", example, out, names[0], "no-such-*", "--list")
    assert r.code == 0 and r.out.splitlines() == [names[0]]
    out.unlink()
    r = cli("extract", example, out, "no-such-*", names[0].upper())
    assert r.code == 1 and "matches" in r.err and not out.exists()


@pytest.mark.parametrize("bins", ["0", "-3", "1000001", "10000000000"])
def test_stats_histogram_bins_are_bounded(cli, example: Path, bins: str) -> None:
    r = cli("stats", example, f"--histogram={bins}")
    assert r.code == 2 and "--histogram takes 1 to 1,000,000 bins" in r.err


def test_stats_keeps_no_histogram_arrays_until_the_table_is_printed(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table comes first, so every tensor's histogram waited for it: as arrays on the
    heap, ~25 MB a tensor at a million bins (1 GB for 40 tensors). Each now waits in a
    temporary file, its arrays let go, and the output is the same."""
    import gc
    import weakref

    from pysafetensors._cli import _cmd_stats, _histogram_spool

    rng = np.random.default_rng(5)
    tensors = {f"t{i}": rng.standard_normal(300).astype(np.float32) for i in range(6)}
    tensors["flat"] = np.zeros(4, np.float32)
    tensors["nan"] = np.full(3, np.nan, np.float32)  # no finite value: no histogram
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    doc = cli("stats", path, "--json", "--histogram", "20").json()["tensors"]
    alive: list[weakref.ref[Any]] = []
    real = _cmd_stats.all_stats

    def watched(*args: Any, **kwargs: Any) -> Any:
        for ref, summary in real(*args, **kwargs):
            gc.collect()
            assert all(w() is None for w in alive), "an earlier tensor's histogram is kept"
            if summary.counts is not None:
                alive.extend(weakref.ref(a) for a in (summary.counts, summary.edges))
            yield ref, summary

    monkeypatch.setattr(_cmd_stats, "all_stats", watched)
    monkeypatch.setattr(_cmd_stats, "_BLOCK_LINES", 7)  # blocks end mid-histogram
    monkeypatch.setattr(_histogram_spool, "MEMORY_BYTES", 100)  # kept in a temporary file
    r = cli("stats", path, "--histogram", "20")
    assert r.code == 0 and len(alive) == 14
    sections = r.out.split("\n\n")[1:]
    drawn = [entry for entry in doc if entry["histogram"]]
    assert [s.splitlines()[0] for s in sections] == [f"{e['name']}:" for e in drawn]
    assert len(drawn) == 7  # all but "nan"
    for section, entry in zip(sections, drawn, strict=True):
        lines = section.splitlines()[1:]
        assert len(lines) == 20 and lines[-1].split("]")[0].count("[") == 1
        counts = [int(re.split(r"[)\]]", line)[1].split()[0].replace(",", "")) for line in lines]
        assert counts == entry["histogram"]["counts"]


def test_stats_runs_where_no_temporary_file_can_be_written(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The histograms' temporary file is a help, not a need: with the temporary folder gone
    (or full), they wait on the heap as before, and the output is the same."""
    import tempfile

    from pysafetensors._cli import _histogram_spool

    rng = np.random.default_rng(6)
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": rng.standard_normal(200).astype(np.float32) for i in range(5)}, path)
    expected = cli("stats", path, "--histogram", "300")
    assert expected.code == 0 and expected.out.count(")  ") == 5 * 299
    monkeypatch.setattr(_histogram_spool, "MEMORY_BYTES", 10_000)  # two histograms, then disk
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    r = cli("stats", path, "--histogram", "300")
    assert (r.code, r.out, r.err) == (0, expected.out, expected.err)


_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from pysafetensors._cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file size limits")
@pytest.mark.parametrize("limit", [300_000, 1_000_000, 2_000_000])
def test_stats_histograms_survive_a_temporary_file_that_fills_up(
    tmp_path: Path, limit: int
) -> None:
    """Histograms (3.2 MB here) move from memory to a temporary file past 1 MiB, then the
    file fills up (a file size limit, as a full disk): the move, a write half done, or a
    buffered write failing at the close printed cut histograms or failed the command."""
    rng = np.random.default_rng(7)
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": rng.standard_normal(500).astype(np.float32) for i in range(40)}, path)
    args = ["stats", str(path), "--histogram", "5000"]

    def run(*prefix: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *prefix, *args], capture_output=True, text=True, timeout=120
        )

    expected = run("-m", "pysafetensors")
    assert expected.returncode == 0 and expected.stdout.count(")  ") == 40 * 4999
    limited = run("-c", _UNDER_A_FILE_SIZE_LIMIT, str(limit))
    assert (limited.returncode, limited.stderr) == (0, "")
    assert limited.stdout == expected.stdout


def _labels_all_at_once(edges: list[float]) -> list[str]:
    """Edge labels by the rule, every label at once: the fewest digits from four at which
    no two labels are the same, else 17."""
    for digits in range(4, 18):
        labels = [f"{e:.{digits}g}" for e in edges]
        if len(set(labels)) == len(labels):
            break
    return labels


@pytest.mark.parametrize(
    "edges",
    [
        [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0],  # four digits tell them apart
        [1000 + i / 10 for i in range(11)],  # [1000, 1000) at four digits
        [1.0, 1.1, 1.23441, 1.23442, 2.0, 3.0, 4.0],  # alike at 4-5 digits, inside a block
        [1.0, 1.23441, 1.23442, 1.5, 2.0, 3.0, 4.0],  # the same, across a block's end
        [1.0, 1.0, 1.0 + 2**-52, 1.0 + 2**-52],  # equal edges: 17 digits
        [-5.0, -1e-300, 0.0, 5e-324, 1e300],
    ],
)
def test_stats_histogram_labels_are_chosen_block_by_block(
    edges: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Labels are checked and drawn a block of lines at a time; the digits are those that
    tell every edge apart, as if all labels were made at once, blocks' ends included."""
    from pysafetensors._cli import _cmd_stats

    monkeypatch.setattr(_cmd_stats, "_BLOCK_LINES", 2)
    counts = np.arange(len(edges) - 1, dtype=np.int64)
    lines = "\n".join(_cmd_stats._histogram_blocks(np.array(edges), counts)).splitlines()
    labels = _labels_all_at_once(edges)
    assert [re.findall(r"[^ \[,)\]]+", line)[:2] for line in lines] == [
        [labels[i], labels[i + 1]] for i in range(len(edges) - 1)
    ]


def test_stats_histogram_is_drawn_in_little_memory() -> None:
    """Drawing a histogram keeps a block of lines' labels and counts as Python objects, not
    the whole histogram's: its edges as floats, their labels and a set of them held 18 MB at
    100,000 bins (~120 MB at a million)."""
    import tracemalloc

    from pysafetensors._cli import _cmd_stats

    bins = 100_000
    edges = np.linspace(-5.123, 4.987, bins + 1)
    counts = np.random.default_rng(8).integers(0, 1000, bins)
    tracemalloc.start()
    try:
        drawn = 0
        for block in _cmd_stats._histogram_blocks(edges, counts):
            drawn += block.count("\n") + 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert drawn == bins
    assert peak < 10 * 2**20, f"{peak / 2**20:.1f} MiB"  # 5.3 MiB


def _inconsistent_models(root: Path) -> dict[str, Path]:
    """Sharded models whose index disagrees with the shards, one way each."""
    names = list(example_tensors())
    out = {}
    for kind in ("wrong_shard", "listed_not_held", "held_not_listed"):
        folder = write_sharded(root / kind, example_tensors(), [names[:2], names[2:]])
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        wm = index["weight_map"]
        if kind == "wrong_shard":
            wm[names[0]] = "model-00002-of-00002.safetensors"
        elif kind == "listed_not_held":
            wm["ghost"] = "model-00001-of-00002.safetensors"
        else:
            del wm[names[-1]]
        index_path.write_text(json.dumps(index))
        out[kind] = folder
    return out


def test_inconsistent_index_warns_and_fails_every_command(cli, tmp_path: Path) -> None:
    codes = {
        "wrong_shard": "IndexWrongShard",
        "listed_not_held": "IndexTensorMissing",
        "held_not_listed": "IndexTensorUnlisted",
    }
    for kind, folder in _inconsistent_models(tmp_path).items():
        code = codes[kind]
        # Read-only commands still answer, but warn and exit 1 (diff: 2, its "cannot tell").
        read_only = [["inspect"], ["inspect", "--json"], ["hash"], ["stats"], ["metadata", "get"]]
        for cmd in read_only:
            r = cli(*cmd, folder) if cmd[0] == "metadata" else cli(cmd[0], folder, *cmd[1:])
            assert r.code == 1, (kind, cmd, r.err)
            assert r.out and f"warning: {folder}: " in r.err and f"[{code}]" in r.err
        r = cli("diff", folder, folder)
        assert r.code == 2 and f"[{code}]" in r.err
        # Commands that write a model refuse it, naming the problem, and write nothing.
        for cmd in (
            ["reshard", folder, tmp_path / "o1"],
            ["merge", folder, tmp_path / "o2.safetensors"],
            ["extract", folder, tmp_path / "o3.safetensors", "*"],
            ["cast", folder, tmp_path / "o4", "--to", "bf16"],
        ):
            r = cli(*cmd)
            assert r.code == 1 and r.err.startswith("error:"), (kind, cmd, r.err)
            assert not Path(cmd[2]).exists()
        assert cli("validate", folder).code == 1


def test_truncated_shard_errors_name_the_shard(cli, sharded: Path, tmp_path: Path) -> None:
    shard = sharded / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 10)
    for cmd in (
        ["reshard", sharded, tmp_path / "o1"],
        ["merge", sharded, tmp_path / "o2.safetensors"],
        ["extract", sharded, tmp_path / "o3.safetensors", "*"],
        ["inspect", sharded],
        ["cast", sharded, tmp_path / "o4", "--to", "bf16"],
    ):
        r = cli(*cmd)
        assert r.code == 1 and r.err.startswith(f"error: {shard.name}: incomplete metadata"), (
            cmd,
            r.err,
        )


def test_output_folders_are_created_by_every_command(cli, example: Path, sharded: Path) -> None:
    base = example.parent / "new" / "deeper"
    runs = {
        "cast.safetensors": ["cast", example, None, "--to", "bf16"],
        "merge.safetensors": ["merge", sharded, None],
        "extract.safetensors": ["extract", sharded, None, "step"],
        "reshard": ["reshard", sharded, None],
        "extract-s": ["extract", sharded, None, "*", "-s", "1MB"],
        "cast-sharded": ["cast", sharded, None, "--to", "bf16"],
    }
    for name, cmd in runs.items():
        out = base / name
        r = cli(*[out if a is None else a for a in cmd])
        assert r.code == 0, (name, r.err)
        assert out.exists(), name


def test_every_option_is_documented() -> None:
    """Each option of each subcommand appears in docs/cli.md or the README."""
    import argparse

    from pysafetensors._cli import build_parser

    root = Path(__file__).resolve().parents[2]
    docs = (root / "docs" / "cli.md").read_text(encoding="utf-8")
    docs += (root / "README.md").read_text(encoding="utf-8")
    parser = build_parser()
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for opt in sub._actions:
                    longs = [s for s in opt.option_strings if s.startswith("--") and s != "--help"]
                    if longs and not any(s in docs for s in longs):
                        missing.append(f"{name} {longs[0]}")
    assert missing == []


def test_extract_pattern_needs_shards(cli, example: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    r = cli("extract", example, out, "model.*", "--filename-pattern", "x{suffix}.safetensors")
    assert r.code == 2 and "needs -s" in r.err
    assert not out.exists()


def test_metadata_delete_of_absent_keys(cli, example: Path) -> None:
    before = example.read_bytes()
    r = cli("metadata", "delete", example, "nope")
    assert r.code == 1 and "metadata has no key 'nope'" in r.err
    r = cli("metadata", "delete", example, "nope", "--missing-ok")
    assert r.code == 0 and "metadata unchanged (no such keys)" in r.out + r.err
    assert example.read_bytes() == before  # nothing written


def test_running_out_of_memory_is_one_line(
    cli, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine running out (a process memory limit) is reported like every failure."""
    from pysafetensors._cli import _cmd_hash

    def exhausted(args: object) -> int:
        raise MemoryError

    monkeypatch.setattr(_cmd_hash, "run", exhausted)
    r = cli("hash", example)
    assert r.code == 1 and r.err == "error: out of memory\n" and "Traceback" not in r.err


def test_diff_compares_integers_exactly(cli, tmp_path: Path) -> None:
    """float64 holds integers exactly only up to 2**53: 2**53 and 2**53 + 1 compared as floats
    were 'identical' (exit 0) although the files differ."""
    save_file({"x": np.array([2**53, 5], np.int64)}, str(tmp_path / "a.safetensors"))
    save_file({"x": np.array([2**53 + 1, 5], np.int64)}, str(tmp_path / "b.safetensors"))
    save_file({"x": np.array([2**64 - 1], np.uint64)}, str(tmp_path / "u.safetensors"))
    save_file({"x": np.array([-1], np.int64)}, str(tmp_path / "i.safetensors"))
    r = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--json")
    assert r.code == 1
    (tensor,) = r.json()["tensors"]
    assert tensor["values"]["differing"] == 1 and tensor["values"]["max_abs"] == 1.0
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert cli("diff", a, b, "--atol", "1").code == 0
    assert cli("diff", tmp_path / "u.safetensors", tmp_path / "i.safetensors").code == 1


def _exact_differences(
    ia: np.ndarray, ib: np.ndarray, atol: float, rtol: float
) -> tuple[int, float, float, int]:
    """The integer measures of ``diff`` in Python's exact integers, element by element."""
    pairs = [(int(x), int(y)) for x, y in zip(ia.tolist(), ib.tolist(), strict=True) if x != y]
    if not pairs:
        return 0, 0.0, 0.0, 0
    diffs = [abs(x - y) for x, y in pairs]
    rel = max((d / abs(y) if y else float("inf")) for d, (_, y) in zip(diffs, pairs, strict=True))
    out = sum(1 for d, (_, y) in zip(diffs, pairs, strict=True) if d > atol + rtol * abs(y))
    return len(pairs), float(max(diffs)), rel, out


@pytest.mark.parametrize(
    ("dta", "dtb"),
    [
        ("int8", "int8"),
        ("uint8", "int16"),
        ("int32", "int32"),
        ("uint32", "int64"),
        ("int64", "int64"),
        ("uint64", "int64"),
        ("int64", "uint64"),
        ("uint64", "uint64"),
    ],
)
def test_integer_differences_are_exact_and_vectorized(dta: str, dtb: str) -> None:
    """``diff`` measures integer tensors with numpy where that is exact and with Python's
    integers where values reach 2**52: both give what exact arithmetic gives (a Python loop
    over every differing element made a 64 MiB int8 diff take ~10x a float32 one's time)."""
    from pysafetensors._cli._cmd_diff import _integer_differences

    rng = np.random.default_rng(7)
    for wide in (False, True):
        ia = rng.integers(np.iinfo(dta).min, np.iinfo(dta).max, 5000, dtype=dta, endpoint=True)
        ib = rng.integers(np.iinfo(dtb).min, np.iinfo(dtb).max, 5000, dtype=dtb, endpoint=True)
        if not wide:
            ia = (ia % 100).astype(dta)
            ib = (ib % 100).astype(dtb)
        ib[::3] = ia[::3].astype(dtb) if np.can_cast(dta, dtb) else ib[::3]  # some equal
        for atol, rtol in ((0.0, 0.0), (3.0, 0.01), (1e15, 1e-3)):
            want = _exact_differences(ia, ib, atol, rtol)
            assert _integer_differences(ia, ib, atol, rtol) == want, (wide, atol, rtol)
    assert _integer_differences(np.array([5], "int8"), np.array([0], "int8"), 0, 0) == (
        1,
        5.0,
        float("inf"),
        1,
    )


def test_stats_of_values_near_the_float64_maximum(cli, tmp_path: Path) -> None:
    save_file({"x": np.array([1.7e308, 1.7e308])}, str(tmp_path / "big.safetensors"))
    save_file({"x": np.array([-1.7e308, 1.7e308])}, str(tmp_path / "wide.safetensors"))
    save_file({"x": np.array([1e200, -1e200, 3.0])}, str(tmp_path / "sq.safetensors"))
    (big,) = cli("stats", tmp_path / "big.safetensors", "--json").json()["tensors"]
    assert (big["mean"], big["std"]) == (1.7e308, 0.0)
    (sq,) = cli("stats", tmp_path / "sq.safetensors", "--json").json()["tensors"]
    assert sq["std"] == pytest.approx(np.std(np.array([1e200, -1e200, 3.0]) / 1e200) * 1e200)
    r = cli("stats", tmp_path / "wide.safetensors", "--histogram", "4", "--json")
    assert r.code == 0
    (wide,) = r.json()["tensors"]
    assert wide["histogram"]["counts"] == [1, 0, 0, 1]
    assert wide["histogram"]["edges"][0] == -1.7e308 and wide["histogram"]["edges"][-1] == 1.7e308


def test_stats_of_complex_values_are_their_magnitudes_in_double_precision(
    cli, tmp_path: Path
) -> None:
    # abs() of a complex64 is a float32: 3e38+3e38j (finite) counted as Inf, and subnormal
    # magnitudes lost their digits.
    values = {
        "big": np.array([3e38 + 3e38j, 1 + 1j], np.complex64),
        "tiny": np.array([1e-45 + 1e-45j, 3e-45 + 4e-45j], np.complex64),
    }
    save_file(values, str(tmp_path / "c.safetensors"))
    got = {
        t["name"]: t for t in cli("stats", tmp_path / "c.safetensors", "--json").json()["tensors"]
    }
    for name, array in values.items():
        magnitudes = np.abs(array.astype(np.complex128))
        assert got[name]["inf"] == 0
        assert got[name]["max"] == magnitudes.max() and got[name]["min"] == magnitudes.min()
        assert got[name]["mean"] == pytest.approx(magnitudes.mean(), rel=1e-12)


@pytest.mark.parametrize("bins", ["10000", "10001"])
def test_stats_histogram_of_a_range_of_a_few_ulps(cli, tmp_path: Path, bins: str) -> None:
    # Past 10,000 bins numpy's count-and-range path refused a range too narrow for distinct
    # edges ("Too many bins for data range"), failing the command where 10,000 bins ran.
    save_file(
        {"x": np.array([1.0, 1.0 + 2**-52]), "y": np.full(3, 1e17, np.float32)},
        str(tmp_path / "h.safetensors"),
    )
    r = cli("stats", tmp_path / "h.safetensors", "--json", "--histogram", bins)
    assert r.code == 0, r.err
    counts = {t["name"]: sum(t["histogram"]["counts"]) for t in r.json()["tensors"]}
    assert counts == {"x": 2, "y": 3}


def test_validate_counts_non_finite_complex_values_per_element(cli, tmp_path: Path) -> None:
    # Counted per float32 half: one value with both parts NaN read "2 NaN".
    nan = float("nan")
    save_file(
        {"c": np.array([complex(nan, nan), complex(np.inf, 0), 1j], np.complex64)},
        str(tmp_path / "c.safetensors"),
    )
    r = cli("validate", "--strict", "--json", tmp_path / "c.safetensors")
    (problem,) = [p for p in r.json()["problems"] if p["code"] == "NonFinite"]
    assert "holds 1 NaN and 1 Inf values" in problem["message"]


def test_a_sharded_cast_that_fails_midway_leaves_the_checkpoint(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cast shard used to be renamed into place as soon as it was written: a failure in a
    later shard (a full disk) left a checkpoint of mixed dtypes that validated and loaded."""
    from pysafetensors import save_sharded
    from pysafetensors._cli import _cmd_cast

    save_sharded({f"t{i}": np.full(1000, i, np.float32) for i in range(3)}, tmp_path / "ck", 5000)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    real = _cmd_cast.write_file
    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(_cmd_cast, "write_file", failing)
    assert cli("cast", tmp_path / "ck", tmp_path / "ck", "--to", "F64").code == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before
    monkeypatch.setattr(_cmd_cast, "write_file", real)
    assert cli("cast", tmp_path / "ck", tmp_path / "ck", "--to", "F64").code == 0
    assert all(v.dtype == np.float64 for v in load_file(str(tmp_path / "ck")).values())


def test_a_sharded_cast_replaces_the_output_folder_s_checkpoint(cli, tmp_path: Path) -> None:
    """A sharded cast into a folder holding another checkpoint left its files there: shards of
    another count beside the new index (stray shards), and a single ``model.safetensors``,
    which transformers opens before any index, so the folder still loaded the old weights."""
    from pysafetensors import save_sharded

    tensors = {f"t{i}": np.full(1000, i, np.float32) for i in range(3)}
    save_sharded(tensors, tmp_path / "ck", 5000)
    out = tmp_path / "out"
    save_sharded(tensors, out, 10000)  # an earlier checkpoint of two shards
    (out / "other.safetensors").write_bytes(b"kept: not of the checkpoint's name pattern")
    save_file({"old": np.zeros(1, np.float32)}, str(out / "model.safetensors"))
    assert cli("cast", tmp_path / "ck", out, "--to", "F64").code == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "other.safetensors",
    ]
    (out / "other.safetensors").unlink()
    r = cli("validate", "--strict", out)  # no stray shard left
    assert r.code == 0, r
    assert {k: v.dtype for k, v in load_file(str(out)).items()} == dict.fromkeys(
        tensors, np.float64
    )


def test_metadata_reserve_is_checked_before_it_is_allocated(cli, example: Path) -> None:
    r = cli("metadata", "set", example, "k=" + "v" * 2000, "--reserve", str(1 << 62))
    assert r.code == 1 and "header too large" in r.err and "memory" not in r.err


def test_metadata_in_place_choices(cli, example: Path) -> None:
    inode = example.stat().st_ino
    r = cli("metadata", "set", example, "source=x", "--in-place", "never")
    assert r.code == 0 and "by rewriting the file" in r.out
    assert example.stat().st_ino != inode
    inode = example.stat().st_ino
    # A shorter value fits the metadata's place, within one page: in place by default.
    r = cli("metadata", "delete", example, "source")
    assert r.code == 0 and "in place" in r.out and example.stat().st_ino == inode
    # Fits the room the deletion left: in place.
    r = cli("metadata", "set", example, "k=v", "--in-place", "always")
    assert r.code == 0 and "in place" in r.out and example.stat().st_ino == inode
    r = cli("metadata", "set", example, "k=v", "--in-place", "sometimes")
    assert r.code == 2
    assert cli("metadata", "get", example, "--json").json()["metadata"] == {
        "format": "pt",
        "k": "v",
    }


def test_metadata_rewrite_keeps_the_tensor_bytes_in_their_order(cli, tmp_path: Path) -> None:
    # docs/cli.md: a rewrite is the reference's save of the same tensors and metadata for a
    # file laid out as the reference lays out its saves; another layout keeps its order (the
    # data is copied as one range), and is not reordered into the reference's.
    st = pytest.importorskip("safetensors.numpy")
    tensors = {
        "a": np.arange(4, dtype=np.int8),
        "b": np.arange(3, dtype=np.float64),
        "c": np.arange(2, dtype=np.float16),
    }
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(ours), metadata={"format": "pt"})
    assert cli("metadata", "set", ours, "format=tf", "--in-place", "never").code == 0
    st.save_file(tensors, str(theirs), metadata={"format": "tf"})
    assert ours.read_bytes() == theirs.read_bytes()
    header = {
        name: {"dtype": code, "shape": list(tensors[name].shape), "data_offsets": offsets}
        for name, code, offsets in (
            ("a", "I8", [0, 4]),
            ("b", "F64", [4, 28]),
            ("c", "F16", [28, 32]),
        )
    }
    data = b"".join(v.tobytes() for v in tensors.values())
    by_name = tmp_path / "by-name.safetensors"
    by_name.write_bytes(raw_file(header, data))
    assert cli("metadata", "set", by_name, "format=tf", "--in-place", "never").code == 0
    with safe_open(by_name, "np") as f:
        assert f.metadata() == {"format": "tf"}
        assert [f.get_slice(n).get_shape() for n in f.offset_keys()] == [[4], [3], [2]]
    assert by_name.read_bytes().endswith(data)


def test_diff_values_are_null_for_tensors_whose_shapes_differ(cli, tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(a))
    save_file({"x": np.arange(6, dtype=np.float32).reshape(3, 2)}, str(b))
    r = cli("diff", a, b, "--json")
    assert r.code == 1
    (row,) = r.json()["tensors"]
    assert row["status"] == "changed" and row["values"] is None
    assert row["shape"] == [[2, 3], [3, 2]]


def test_diff_compares_complex_values_not_their_magnitudes(cli, tmp_path: Path) -> None:
    """Values of equal magnitude (a sign, a conjugate, a rotation) were 'identical', exit 0."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"c": np.array([1, 3 + 4j, 1j], np.complex64)}, str(a))
    save_file({"c": np.array([-1, 4 + 3j, -1j], np.complex64)}, str(b))
    r = cli("diff", a, b, "--json")
    assert r.code == 1
    (tensor,) = r.json()["tensors"]
    assert tensor["status"] == "changed" and tensor["values"]["differing"] == 3
    assert tensor["values"]["max_abs"] == pytest.approx(2.0)
    real = tmp_path / "r.safetensors"
    save_file({"c": np.array([1, 5, 1], np.float32)}, str(real))  # |values| of a
    r = cli("diff", a, real, "--json")
    (tensor,) = r.json()["tensors"]
    assert tensor["values"]["differing"] == 2  # 3+4j is not 5, 1j is not 1


def test_diff_compares_a_complex_nan_part_by_part(cli, tmp_path: Path) -> None:
    """numpy's isnan of a complex value is true where either part is NaN: 1+nanj against
    2+nanj (and nan+1j against nan+5j) counted as NaN against NaN, identical, exit 0."""
    nan = float("nan")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"z": np.array([complex(1, nan), complex(nan, 1), complex(nan, nan)], "c8")}, str(a))
    save_file({"z": np.array([complex(2, nan), complex(nan, 5), complex(nan, nan)], "c8")}, str(b))
    r = cli("diff", a, b, "--json")
    assert r.code == 1
    (tensor,) = r.json()["tensors"]
    assert tensor["status"] == "changed" and tensor["values"]["differing"] == 2
    z = np.array([complex(1, nan), complex(nan, 1), complex(nan, nan)], "c8")
    bits = z.view(np.uint32)
    bits[np.isnan(z.view(np.float32))] |= 1  # other NaN payloads: compared as values, not bytes
    other = tmp_path / "payloads.safetensors"
    save_file({"z": z}, str(other))
    r = cli("diff", a, other, "--json")
    assert r.code == 0 and r.json()["tensors"][0]["values"]["identical"] is False


def test_stats_gives_exact_extremes_of_wide_integers(cli, tmp_path: Path) -> None:
    """float64 rounded them: the max of 2**63 - 1 showed as 2**63, outside I64."""
    path = tmp_path / "i.safetensors"
    save_file(
        {
            "i": np.array([2**53 + 1, 2**63 - 1], np.int64),
            "u": np.array([2**64 - 1], np.uint64),
            "f": np.array([0.5, 2.5], np.float32),
        },
        str(path),
    )
    rows = {t["name"]: t for t in cli("stats", path, "--json").json()["tensors"]}
    assert (rows["i"]["min"], rows["i"]["max"]) == (2**53 + 1, 2**63 - 1)
    assert rows["u"]["max"] == 2**64 - 1
    assert (rows["f"]["min"], rows["f"]["max"]) == (0.5, 2.5)
    assert "9223372036854775807" in cli("stats", path).out


def test_a_file_name_that_is_not_utf8_is_printed_escaped(cli_proc, tmp_path: Path) -> None:
    """Its byte became a lone surrogate, which a strict UTF-8 stdout refused: most commands
    failed, metadata set and cast after writing (exit 1)."""
    raw = os.path.join(os.fsencode(str(tmp_path)), b"r_\xff.safetensors")
    save_file({"x": np.zeros(2, np.float32)}, os.fsdecode(raw))
    name = os.fsdecode(raw)
    for args in (
        ["validate", name],
        ["inspect", name],
        ["diff", name, name],
        ["hash", name],
        ["metadata", "set", name, "k=v"],
        ["cast", name, os.fsdecode(raw.replace(b"r_", b"c_")), "--to", "F16"],
    ):
        r = cli_proc(*args)
        assert r.code == 0, (args, r.err)
        assert "\\udcff" in r.out + r.err and "Traceback" not in r.err, args


def test_inspect_json_of_an_index_with_non_finite_numbers(cli, tmp_path: Path) -> None:
    """Python's json reads NaN and 1e400 in an index; inspect --json failed to write them."""
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones(3, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {"total_size": 20, "lr": NaN, "x": 1e400, "ok": [1.5, -Infinity]}, '
        '"weight_map": {"a": "model-00001-of-00002.safetensors", '
        '"b": "model-00002-of-00002.safetensors"}}'
    )
    r = cli("inspect", tmp_path, "--json")
    assert r.code == 0, r.err
    expected = {"total_size": 20, "lr": None, "x": None, "ok": [1.5, None]}
    assert r.json()["index_metadata"] == expected
    without = cli("inspect", tmp_path, "--json", "--no-tensors").json()
    assert "tensors" not in without and without["totals"]["tensors"] == 2


def test_convert_of_a_folder_with_nothing_to_convert_is_exit_2(cli, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = cli("convert", tmp_path / "empty", tmp_path / "out")
    assert r.code == 2 and r.err.startswith("error: ") and "nothing to convert" in r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "mark", ["\u200f", "\u200e", "\u061c", "\u200b", "\u2060", "\ufeff", "\u00ad"]
)
def test_bidirectional_marks_in_names_are_escaped_and_warned_about(
    cli, tmp_path: Path, mark: str
) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"a{mark}b": np.zeros(1, np.float32)}, str(path))
    shown = f"\\x{ord(mark):02x}" if ord(mark) < 0x100 else f"\\u{ord(mark):04x}"
    assert shown in cli("inspect", path).out
    r = cli("validate", "--strict", path)
    assert r.code == 1 and "SuspiciousName" in r.out + r.err


def test_diff_shows_changed_metadata_escaped_once(cli, tmp_path: Path) -> None:
    # The changed-value lines went through repr() after escaping: backslashes came out
    # doubled ('C:\\models'), unlike the added and removed lines and every other command.
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    t = {"x": np.zeros(2, np.float32)}
    save_file(t, str(a), metadata={"path": "C:\\models", "note": "one\ntwo", "gone": "a\x1bb"})
    save_file(t, str(b), metadata={"path": "D:\\models", "note": "other", "new": "x\ny"})
    out = cli("diff", a, b).out
    assert "~ metadata path: C:\\models -> D:\\models" in out
    assert '~ metadata note: "one\\x0atwo" -> other' in out
    assert '- metadata gone: "a\\x1bb"' in out and '+ metadata new: "x\\x0ay"' in out
    assert "\\\\" not in out and "\x1b" not in out


def test_text_holding_an_escape_prints_unlike_the_escaped_character(cli, tmp_path: Path) -> None:
    # Escaping alone printed a name holding ESC and one holding the four characters \x1b
    # alike (a\x1b), in every command's human output: text with something escaped is now
    # quoted, its backslashes and quotes escaped too; plain text (C:\models) is left as is.
    path = tmp_path / "m.safetensors"
    names = ["a\x1b", "a\\x1b", '"a\\x1b"', "C:\\w", "a\\\x1b"]
    save_file(
        {n: np.full(2, i, np.float32) for i, n in enumerate(names)},
        str(path),
        metadata={"esc": "v\x1b", "text": "v\\x1b", '"q"': "C:\\models"},
    )
    shown = ['"a\\x1b"', "a\\x1b", '"\\"a\\\\x1b\\""', "C:\\w", '"a\\\\\\x1b"']
    for command in ("inspect", "hash", "stats"):
        r = cli(command, path)
        assert r.code == 0, r.err
        for name in shown:
            assert re.search(rf"(^|\s){re.escape(name)}(\s|:?$)", r.out, re.M), (command, name)
        assert "\x1b" not in r.out
    out = cli("metadata", "get", path).out.splitlines()
    assert sorted(line.split()[0] for line in out) == ['"\\"q\\""', "esc", "text"]
    assert sorted(line.split()[1] for line in out) == sorted(["C:\\models", '"v\\x1b"', "v\\x1b"])
    assert cli("metadata", "get", path, "esc").out == '"v\\x1b"\n'
    assert cli("metadata", "get", path, "esc", "--raw").out == "v\x1b\n"
    listed = cli("extract", path, tmp_path / "x.safetensors", "*", "--list").out.splitlines()
    assert sorted(listed) == sorted(shown)


def test_names_differing_only_by_spaces_print_unlike(cli, tmp_path: Path) -> None:
    # "w", "w " and "w" + no-break space all printed as w in a padded table column.
    path = tmp_path / "m.safetensors"
    names = ["w", "w ", "w\u00a0", " w", "w\u3000", ""]
    save_file({n: np.full(1, i, np.float32) for i, n in enumerate(names)}, str(path))
    shown = {"w", '"w "', r'"w\xa0"', '" w"', r'"w\u3000"', '""'}
    for command in ("inspect", "stats"):
        r = cli(command, path)
        assert r.code == 0, r.err
        rows = [line for line in r.out.splitlines() if " F32 " in line]
        assert {row[: row.index(" F32")].rstrip() for row in rows} == shown, rows
    listed = cli("extract", path, tmp_path / "x.safetensors", "*", "--list").out.splitlines()
    assert set(listed) == shown


def test_cast_from_may_be_repeated(cli, tmp_path: Path) -> None:
    # A second --from replaced the first: only the last one's dtypes were cast, silently.
    path, out = tmp_path / "m.safetensors", tmp_path / "out.safetensors"
    save_file(
        {
            "a": np.ones(4, ml_dtypes.float8_e4m3fn),
            "b": np.ones(4, ml_dtypes.float8_e5m2),
            "c": np.ones(4, np.float32),
        },
        str(path),
    )
    r = cli("cast", path, out, "--to", "F16", "--from", "F8_E4M3", "--from", "F8_E5M2")
    assert r.code == 0, r.err
    with safe_open(out, "np") as f:
        assert {k: f.get_slice(k).get_dtype() for k in f} == {
            "a": "F16",
            "b": "F16",
            "c": "F32",  # not named: copied
        }
    assert cli("cast", path, out, "--to", "F16", "--from", ",").code == 2


def test_cast_refuses_an_uncastable_from_whatever_the_file_holds(cli, tmp_path: Path) -> None:
    # The refusal came only for a selected tensor of that dtype: the same command exited 0
    # (a plain copy, "cast 0 of 2 tensors") where the file had none or -f left it out.
    path, out = tmp_path / "m.safetensors", tmp_path / "out.safetensors"
    save_file({"w": np.ones(4, np.float32), "n": np.ones(4, np.int32)}, str(path))
    for extra in ([], ["-f", "w"]):
        for codes in ("I32", "U8", "F32,BOOL", "C64"):
            r = cli("cast", path, out, "--to", "F16", "--from", codes, *extra)
            assert r.code == 2 and "cannot cast" in r.err, (codes, extra, r)
            assert not out.exists()


def test_a_sharded_cast_writes_a_strict_json_index(cli, tmp_path: Path) -> None:
    # 1e400 in the source index reads as infinity and was written back as Infinity (and NaN
    # as NaN), which strict JSON parsers refuse.
    src = write_sharded(
        tmp_path / "src",
        {"a": np.ones(4, np.float32), "b": np.zeros(4, np.float32)},
        [["a"], ["b"]],
    )
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"].update(big=1e400, small=-1e400, nothing=float("nan"), fine=1.5)
    index.write_text(json.dumps(doc, indent=2))
    out = tmp_path / "out"
    assert cli("cast", src, out, "--to", "BF16").code == 0

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    written = json.loads((out / "model.safetensors.index.json").read_text(), parse_constant=refuse)
    meta = written["metadata"]
    assert meta["big"] == float("inf") and meta["small"] == float("-inf")
    assert meta["nothing"] is None and meta["fine"] == 1.5


def test_stats_histogram_before_the_target_says_how_to_write_it(cli, example: Path) -> None:
    r = cli("stats", "--histogram", example)
    assert r.code == 2 and "put --histogram after TARGET" in r.err
    assert cli("stats", example, "--histogram").code == 0
    assert cli("stats", "--histogram", "3", example).code == 0


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (999, "999"),
        (1000, "1K"),
        (12_500, "12.5K"),
        (999_499, "999K"),
        (999_950, "1M"),  # was 1e+03K
        (999_999_999, "1B"),  # was 1e+03M
        (7_240_000_000, "7.24B"),
        (999_999_999_999_999, "1000T"),
    ],
)
def test_parameter_counts_round_before_choosing_the_unit(count: int, shown: str) -> None:
    from pysafetensors._cli._common import human_count

    assert human_count(count) == shown


@pytest.mark.parametrize(
    ("size", "shown"),
    [(999, "999 B"), (999_949, "999.9 kB"), (999_960, "1.0 MB"), (4_900_000_000, "4.9 GB")],
)
def test_byte_sizes_round_before_choosing_the_unit(size: int, shown: str) -> None:
    from pysafetensors._cli._common import human_bytes

    assert human_bytes(size) == shown


def test_hash_model_digests_of_different_models_differ_whatever_the_names(
    cli, tmp_path: Path
) -> None:
    # Written bare, a name holding NUL and newline spelled a whole other tensor's line: a
    # one-tensor file had the model digest of this two-tensor one.
    a, b = np.zeros(1, np.float32), np.ones(1, np.float32)
    two, one = tmp_path / "two.safetensors", tmp_path / "one.safetensors"
    save_file({"a": a, "b": b}, str(two))
    line_a = f"a\0F32\0[1]\0{hashlib.sha256(a.tobytes()).hexdigest()}\nb"
    save_file({line_a: b}, str(one))
    digests = {cli("hash", p, "--json").json()["model"] for p in (two, one)}
    assert len(digests) == 2


@pytest.mark.parametrize("command", [["metadata", "get"], ["inspect"], ["stats"], ["hash"]])
def test_output_a_stdout_encoding_cannot_hold_is_escaped(
    tmp_path: Path, command: list[str]
) -> None:
    """Under PYTHONIOENCODING=ascii (a Windows code page, a legacy locale's redirect), a name
    or value outside the encoding stopped the output halfway: `error: 'ascii' codec can't
    encode characters in position 0-3`, exit 1."""
    path = tmp_path / "odd.safetensors"
    save_file({"wéight": np.ones(2, np.float32)}, path, metadata={"format": "pt", "by": "Zoë"})
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = subprocess.run(
        [sys.executable, "-m", "pysafetensors", *command, str(path)],
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert (r.returncode, r.stderr) == (0, b""), r
    out = r.stdout.decode("ascii")
    assert ("Zo\\xeb" if command[0] == "metadata" else "w\\xe9ight") in out


def test_stats_histogram_lines_fit_the_terminal(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines were 82 characters whatever the terminal: on 80 columns every bar wrapped onto a
    line of its own. Piped output keeps 40-character bars."""
    from pysafetensors._cli import _common

    path = tmp_path / "h.safetensors"
    save_file({"b": np.random.default_rng(9).standard_normal(1000).astype(np.float32)}, path)
    piped = cli("stats", path, "--histogram", "4").out.splitlines()[-4:]
    assert max(line.count("#") for line in piped) == 40 and max(map(len, piped)) == 82
    for columns, longest in ((80, 79), (60, 59), (20, 50), (200, 82)):
        monkeypatch.setattr(_common.Ui, "columns", staticmethod(lambda c=columns: c))
        lines = cli("stats", path, "--histogram", "4").out.splitlines()[-4:]
        assert max(map(len, lines)) == longest, (columns, lines)


def test_names_a_stdout_encoding_cannot_hold_are_quoted_so_none_print_alike(
    tmp_path: Path,
) -> None:
    """Under PYTHONIOENCODING=ascii, "wé" and the text "w\\xe9" printed alike once the
    stream escaped the first; and --raw printed a changed value with exit 0."""
    path = tmp_path / "two.safetensors"
    save_file(
        {"wé": np.ones(3, np.float32), "w\\xe9": np.ones(2, np.float32)},
        path,
        metadata={"by": "Zoë"},
    )

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        env = {**os.environ, "PYTHONIOENCODING": "ascii"}
        return subprocess.run(
            [sys.executable, "-m", "pysafetensors", *args], capture_output=True, env=env, timeout=60
        )

    r = run("inspect", str(path))
    assert r.returncode == 0, r
    lines = r.stdout.decode("ascii").splitlines()
    rows = [line.split()[0] for line in lines if "F32  " in line and line[0] in 'w"']
    assert sorted(rows) == sorted(['"w\\xe9"', "w\\xe9"])  # the escaped one quoted
    raw = run("metadata", "get", str(path), "by", "--raw")
    assert (raw.returncode, raw.stdout) == (0, "Zoë\n".encode())  # exact: UTF-8 bytes


@pytest.mark.parametrize("command", ["diff", "hash", "stats", "inspect"])
@pytest.mark.parametrize("option", [("--filter", "modle.*"), ("--regex", "^modle")])
def test_a_filter_matching_no_tensor_is_an_error(
    cli, tmp_path: Path, command: str, option: tuple[str, str]
) -> None:
    # A typo in a filter: diff said the models were equal (exit 0), hash printed the digest of
    # nothing, stats and inspect an empty table.
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"model.w": np.ones(4, np.float32)}, str(fa))
    save_file({"model.w": np.full(4, 2, np.float32)}, str(fb))
    targets = (fa, fb) if command == "diff" else (fa,)
    r = cli(command, *targets, *option, "--json")
    assert r.code == 2, (r.out, r.err)
    assert f"{option[0]} {option[1]!r} matched none of the" in r.err
    assert not r.out
    # A filter that matches something still works.
    r = cli(command, *targets, option[0], "model.*" if option[0] == "--filter" else "^model")
    assert r.code == (1 if command == "diff" else 0), r.err
