"""Small inconsistencies of the command line: a size with a sign, the exit code for a folder
holding several checkpoints, what ``scan`` escapes, and singular counts."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from pysafetensors.numpy import save_file

from .conftest import write_sharded


def test_size_with_a_plus_sign_is_bytes(cli_proc, example: Path, tmp_path: Path) -> None:
    # argparse took "+5" and the library refused it later (exit 1); it is 5 bytes, as "5" is.
    plus = cli_proc("reshard", example, tmp_path / "plus", "-s", "+5")
    plain = cli_proc("reshard", example, tmp_path / "plain", "-s", "5")
    assert plus.code == plain.code == 0, plus
    assert sorted(os.listdir(tmp_path / "plus")) == sorted(os.listdir(tmp_path / "plain"))
    r = cli_proc("extract", example, tmp_path / "x", "-s", "+5", "*")
    assert r.code == 0, r
    r = cli_proc("reshard", example, tmp_path / "neg", "-s", "-5")
    assert r.code == 2 and "more than 0" in r.err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{two}"],
        ["hash", "{two}"],
        ["stats", "{two}"],
        ["metadata", "get", "{two}"],
        ["validate", "{two}"],
        ["diff", "{two}", "{two}"],
        ["cast", "{two}", "{out}", "--to", "F16"],
        ["reshard", "{two}", "{out}"],
        ["merge", "{two}", "{out}/m.safetensors"],
        ["extract", "{two}", "{out}/x.safetensors", "*"],
    ],
    ids=" ".join,
)
def test_a_folder_of_several_checkpoints_is_a_usage_error(
    cli_proc, tmp_path: Path, argv: list[str]
) -> None:
    two = tmp_path / "two"
    two.mkdir()
    save_file({"a": np.zeros(2, np.float32)}, str(two / "a.safetensors"))
    save_file({"b": np.zeros(2, np.float32)}, str(two / "b.safetensors"))
    r = cli_proc(*(a.format(two=two, out=tmp_path / "out") for a in argv))
    assert r.code == 2, r  # as for an empty folder: name the file (docs: usage error)
    assert "several checkpoints" in r.err


def test_scan_escapes_only_unsafe_characters(cli_proc, tmp_path: Path) -> None:
    data = pickle.dumps({"w": [1, 2, 3]}, protocol=2)
    cyrillic = tmp_path / "модель.pkl"
    cyrillic.write_bytes(data)
    bidi = tmp_path / "a\u202eb.pkl"
    bidi.write_bytes(data)
    r = cli_proc("scan", cyrillic, bidi)
    assert r.code == 0, r
    assert f"{cyrillic}: safe" in r.out  # non-ASCII text as it is
    assert "a\\u202eb.pkl: safe" in r.out and "\u202e" not in r.out


@pytest.mark.skipif(sys.platform == "darwin", reason="APFS refuses undecodable names")
def test_scan_escapes_undecodable_path_bytes(cli_proc, tmp_path: Path) -> None:
    name = os.fsencode(tmp_path) + b"/bad\xffname.pkl"
    with open(name, "wb") as fh:
        fh.write(pickle.dumps(1))
    r = cli_proc("scan", os.fsdecode(name))
    assert r.code == 0 and "bad\\udcffname.pkl: safe" in r.out, r


def test_counts_of_one_are_singular(cli_proc, tmp_path: Path) -> None:
    one = tmp_path / "one.safetensors"
    save_file({"x": np.zeros((), np.float32)}, str(one))
    r = cli_proc("inspect", one)
    assert "Total: 1 tensor, 1 parameter (1)," in r.out, r
    r = cli_proc("reshard", one, tmp_path / "rs", "-s", "1KB")
    assert r.code == 0 and r.err.startswith("wrote 1 tensor (") and " in 1 file to " in r.err, r
    r = cli_proc("cast", one, tmp_path / "c.safetensors", "--to", "F16")
    assert r.code == 0 and "cast 1 of 1 tensor to F16" in r.out, r
    folder = write_sharded(tmp_path / "m", {"x": np.zeros(2, np.float32)}, [["x"]])
    r = cli_proc("validate", folder)
    assert r.code == 0 and "OK (1 file valid)" in r.out, r
    r = cli_proc("inspect", folder)
    assert r.code == 0 and "(1 file, " in r.out, r
    assert json.loads(cli_proc("inspect", "--json", folder).out)["sharded"] is True


def test_the_documented_validate_example_is_what_validate_prints(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/cli.md shows validate on a hand-made file and gives its header: the example had
    # drifted from the output (offsets of another file). It is rebuilt here from the doc.
    import re
    import struct

    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    header = re.search(r"\(header\n`(\{.*?\})`,\npadded to (\d+) bytes", doc, re.S)
    assert header is not None
    raw = header.group(1).encode()
    raw += b" " * (int(header.group(2)) - len(raw))
    path = tmp_path / "broken.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(40))
    monkeypatch.chdir(tmp_path)
    r = cli("validate", "broken.safetensors")
    assert r.code == 1
    for line in r.out.splitlines():
        assert line in doc, line
