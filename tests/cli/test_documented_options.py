"""Options and problem codes docs/cli.md documents, each checked for what it changes: every one
of them could be switched off before without a test failing."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import raw_file
from pysafetensors import safe_open
from pysafetensors.numpy import save_file


def _problems(cli, target: Path, *args: str) -> list[tuple[str, str, str | None]]:
    doc = cli("validate", target, "--strict", "--json", *args).json()
    return [(p["severity"], p["code"], p["tensor"]) for p in doc["problems"]]


def test_validate_warns_of_an_unknown_format(cli, tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": np.ones(2, np.float32)}, path, metadata={"format": "weird"})
    assert _problems(cli, path) == [("warning", "UnknownFormat", None)]
    assert cli("validate", path).code == 0 and cli("validate", path, "--strict").code == 1


def test_validate_warns_of_a_repeated_name_and_leading_whitespace(cli, tmp_path: Path) -> None:
    entry = '{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    header = ' {"__metadata__":{"format":"pt"},"a":' + entry + ',"a":' + entry + "}"
    header += " " * (-len(header) % 8)
    path = tmp_path / "dup.safetensors"
    path.write_bytes(raw_file(header.encode(), b"\x07"))
    with safe_open(path, "np") as f:  # read as the reference reads it: the last entry
        assert f.keys() == ["a"]
    doc = cli("validate", path, "--strict", "--json").json()
    found = {(p["code"], p["tensor"], p["offset"]) for p in doc["problems"]}
    assert found == {
        ("DuplicateTensorName", "a", 8 + header.index('"a"')),
        ("LeadingWhitespace", None, 8),
    }


def test_validate_warns_of_a_header_over_the_hub_s_limit(cli, tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    save_file({"a": np.ones(1, np.uint8)}, path, metadata={"format": "pt", "pad": "x" * (25 << 20)})
    assert ("warning", "HeaderOverHubLimit", None) in _problems(cli, path)


def _sharded(folder: Path, index: dict[str, object]) -> None:
    folder.mkdir()
    save_file({"a": np.ones(2, np.float32)}, folder / "s1.safetensors", metadata={"format": "pt"})
    save_file({"b": np.ones(2, np.float32)}, folder / "s2.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_validate_warns_of_no_total_size_and_a_stray_shard(cli, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    _sharded(folder, {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    save_file({"c": np.ones(1, np.float32)}, folder / "old.safetensors", metadata={"format": "pt"})
    assert sorted(_problems(cli, folder)) == [
        ("warning", "IndexNoTotalSize", None),
        ("warning", "StrayShard", None),
    ]


def test_validate_reports_a_tensor_stored_in_two_shards(cli, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    index = {"metadata": {"total_size": 16}, "weight_map": {"a": "s1.safetensors"}}
    _sharded(folder, {**index, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    save_file({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, folder / "s2.safetensors")
    errors = [p for p in _problems(cli, folder) if p[0] == "error"]
    assert ("error", "DuplicateTensor", "a") in errors


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """Three tensors whose file order (by dtype, then name: a, c, b), name order and size
    order (b, c, a: 64, 16 and 8 bytes) all differ."""
    path = tmp_path / "three.safetensors"
    tensors = {"b": np.ones(64, np.uint8), "a": np.ones(1), "c": np.ones(4, np.float32)}
    save_file(tensors, path)
    with safe_open(path, "np") as f:
        assert f.offset_keys() == ["a", "c", "b"]
    return path


@pytest.mark.parametrize(
    ("order", "names"),
    [
        (None, ["a", "c", "b"]),
        ("offset", ["a", "c", "b"]),
        ("name", ["a", "b", "c"]),
        ("size", ["b", "c", "a"]),
    ],
)
def test_inspect_sorts_as_asked(cli, three: Path, order: str | None, names: list[str]) -> None:
    args = () if order is None else ("--sort", order)
    doc = cli("inspect", three, "--json", *args).json()
    assert [t["name"] for t in doc["tensors"]] == names


def test_inspect_sorts_equal_sizes_by_name(cli, tmp_path: Path) -> None:
    path = tmp_path / "ties.safetensors"
    save_file({"b": np.ones(2, np.float32), "c": np.ones(1), "a": np.ones(8, np.uint8)}, path)
    doc = cli("inspect", path, "--json", "--sort", "size").json()
    assert [t["name"] for t in doc["tensors"]] == ["a", "b", "c"]  # 8 bytes each


def test_hash_lists_every_tensor_and_the_documented_model_digest(cli, three: Path) -> None:
    doc = cli("hash", three, "--json").json()
    with safe_open(three, "np") as f:
        raw = {name: f.get_tensor(name).tobytes() for name in f.keys()}  # noqa: SIM118
        meta = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
        lines = ""
        for name in sorted(raw):
            shape = json.dumps(meta[name].get_shape(), separators=(",", ":"))
            digest = hashlib.sha256(raw[name]).hexdigest()
            quoted = json.dumps(name, ensure_ascii=False)
            lines += f"{quoted}\0{meta[name].get_dtype()}\0{shape}\0{digest}\n"
    assert {t["name"]: t["digest"] for t in doc["tensors"]} == {
        name: hashlib.sha256(data).hexdigest() for name, data in raw.items()
    }
    assert doc["model"] == hashlib.sha256(lines.encode()).hexdigest()
    short = cli("hash", three, "--json", "--no-tensors").json()
    assert "tensors" not in short and short["model"] == doc["model"]
    text = cli("hash", three, "--no-tensors").out
    assert doc["model"] in text and not any(t["digest"] in text for t in doc["tensors"])


def test_diff_without_values_leaves_values_unchecked(cli, tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.zeros(4, np.float32)}, a)
    save_file({"w": np.ones(4, np.float32)}, b)
    assert cli("diff", a, b).code == 1  # the values differ
    r = cli("diff", a, b, "--no-values", "--json")
    (tensor,) = r.json()["tensors"]
    assert (tensor["status"], tensor["values"]) == ("unchecked", None)
    assert r.code == 0 and r.json()["equal"] is True  # headers alike: nothing found to differ


def test_metadata_set_replace_drops_the_other_keys(cli, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(2, np.float32)}, path, metadata={"format": "pt", "old": "1"})
    assert cli("metadata", "set", path, "new=2").code == 0
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "pt", "old": "1", "new": "2"}
    assert cli("metadata", "set", path, "--replace", "only=3").code == 0
    with safe_open(path, "np") as f:
        assert f.metadata() == {"only": "3"}


def _checkpoint(path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"model": {"w": torch.arange(3.0)}, "step": 7}, path)


def test_scan_verbose_lists_the_safe_globals(cli, tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    _checkpoint(path)
    quiet, verbose = cli("scan", path), cli("scan", path, "-v")
    assert quiet.code == verbose.code == 0
    assert "_rebuild_tensor_v2" not in quiet.out
    assert "safe       torch._utils._rebuild_tensor_v2" in verbose.out


def test_convert_subtree_and_workers(cli, tmp_path: Path) -> None:
    src = tmp_path / "ck.pt"
    _checkpoint(src)
    out = tmp_path / "w.safetensors"
    assert cli("convert", "--subtree", "model", src, out).code == 0
    with safe_open(out, "np") as f:
        assert f.keys() == ["w"] and f.get_tensor("w").tolist() == [0.0, 1.0, 2.0]
    # A folder N files at a time: the same files as one at a time.
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(4):
        shutil.copy(src, folder / f"part{i}.pt")
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert cli("convert", "--subtree", "model", folder, serial).code == 0
    assert cli("convert", "--subtree", "model", "--workers", "3", folder, parallel).code == 0
    made = sorted(p.name for p in serial.iterdir())
    assert made == sorted(p.name for p in parallel.iterdir()) and len(made) == 4
    assert all((serial / n).read_bytes() == (parallel / n).read_bytes() for n in made)


def test_version(cli) -> None:
    import pysafetensors

    r = cli("--version")
    assert r.code == 0 and r.out.strip() == f"pysafetensors {pysafetensors.__version__}"


@pytest.mark.parametrize("command", ["inspect", "hash", "stats"])
def test_an_unusable_index_is_named_with_its_model_and_tensor(
    cli, tmp_path: Path, command: str
) -> None:
    # "model.safetensors.index.json: ..." alone: with diff's two models, which one?
    folder = tmp_path / "broken"
    folder.mkdir()
    save_file({"a": np.ones(2, np.float32)}, folder / "s1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 7}}))
    r = cli(command, folder)
    assert r.code == 1
    assert f"{folder}: model.safetensors.index.json: weight_map value is int" in r.err
    assert "(tensor 'a')" in r.err


@pytest.mark.skipif(sys.platform == "win32", reason="edits take turns by flock")
def test_metadata_edits_say_they_wait_for_a_lock_and_give_up_at_lock_timeout(
    cli_proc, tmp_path: Path
) -> None:
    """A lock held by another process (a backup tool's shared one) made the edit wait for
    ever with no output. It now says so after a second, and --lock-timeout gives up."""
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(2, np.float32)}, path, metadata={"format": "pt"})
    before = path.read_bytes()
    hold = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_SH)\n"
        "print('held', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
    )

    def holding(seconds: float) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", hold, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        return proc

    holder = holding(30)
    try:
        r = cli_proc("metadata", "set", path, "k=v", "--lock-timeout", "2")
        assert r.code == 2 and r.out == "", r
        lines = r.err.splitlines()
        assert len(lines) == 2, r
        assert "another process holds a lock on the file" in lines[0]
        assert "waiting for it, at most 1 s more" in lines[0]
        assert lines[1].startswith("error: ") and "gave up waiting" in lines[1]
        r = cli_proc("metadata", "delete", path, "format", "--lock-timeout", "0")
        assert r.code == 2 and r.err.count("\n") == 1 and "gave up waiting" in r.err, r
        # A fraction of a second (a usage error before, "not a whole number of seconds").
        r = cli_proc("metadata", "delete", path, "format", "--lock-timeout", "0.3")
        assert r.code == 2 and r.err.count("\n") == 1 and "gave up waiting" in r.err, r
        assert path.read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    holder = holding(2)  # let go while the edit waits: the edit goes on
    try:
        r = cli_proc("metadata", "set", path, "k=v")
    finally:
        holder.wait()
    assert r.code == 0 and "waiting for it (Ctrl-C to stop)" in r.err, r
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
