"""Output folders: ``cast`` of a model whose index names shards in a subfolder writes them there
(it failed with "No such file or directory"), and a writing command that fails removes the
folders it created for its output instead of leaving them behind, empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pysafetensors.numpy import load_file, save_file

from .conftest import _env, example_tensors, write_sharded


@pytest.fixture
def subfolder_model(tmp_path: Path) -> Path:
    """A sharded model whose index lists its shards as ``sub/model-0000N-of-00002...``."""
    names = list(example_tensors())
    folder = write_sharded(tmp_path / "src", example_tensors(), [names[:2], names[2:]])
    (folder / "sub").mkdir()
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in set(index["weight_map"].values()):
        (folder / shard).rename(folder / "sub" / shard)
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return folder


def test_cast_writes_shards_in_subfolders(cli_proc, subfolder_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli_proc("cast", subfolder_model, out, "--to", "F16")
    assert r.code == 0, r
    assert sorted(p.name for p in (out / "sub").iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "sub/model-00001-of-00002.safetensors",
        "sub/model-00002-of-00002.safetensors",
    }
    assert cli_proc("validate", out).code == 0
    shard = load_file(str(out / "sub" / "model-00001-of-00002.safetensors"))
    assert shard["model.embed.weight"].dtype == np.float16


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_cast_refuses_a_link_out_of_the_output_folder(
    cli_proc, subfolder_model: Path, tmp_path: Path
) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    r = cli_proc("cast", subfolder_model, out, "--to", "F16")
    assert r.code == 2 and "outside" in r.err, r
    assert list(elsewhere.iterdir()) == []


def test_a_sharded_cast_to_a_file_says_the_output_must_be_a_folder(
    cli, subfolder_model: Path, tmp_path: Path
) -> None:
    # It said only "[Errno 17] File exists", as if the file were in the way of a file.
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"untouched")
    r = cli("cast", subfolder_model, out, "--to", "F16")
    assert r.code == 2 and "is a file; a sharded model is cast into a folder" in r.err, r
    assert out.read_bytes() == b"untouched"


@pytest.mark.parametrize(
    ("command", "output"),
    [
        (["merge"], "blocker/x.safetensors"),
        (["extract"], "blocker/deep/x.safetensors"),
        (["cast", "--to", "F16"], "blocker/x.safetensors"),
        (["reshard"], "blocker/sub"),
        (["convert"], "blocker/sub"),
    ],
)
def test_a_file_in_the_way_of_the_output_folder_is_named(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], output: str
) -> None:
    """makedirs said "[Errno 17] File exists" of the file in the way (or "Not a directory"
    of a folder below it), naming neither the output nor the file."""
    monkeypatch.chdir(tmp_path)
    save_file({"a": np.zeros(3, np.float32)}, "m.safetensors")
    Path("blocker").write_bytes(b"untouched")
    args = [command[0], "m.safetensors", output, *command[1:]]
    if command[0] == "extract":
        args.append("a")
    r = cli(*args)
    assert r.code == 2, r
    assert r.err.splitlines() == [
        "error: Error while serializing: I/O error: Not a directory (os error 20) at path "
        f"\"{output}\" ('blocker' is a file, not a folder)"
    ]
    assert Path("blocker").read_bytes() == b"untouched"
    assert sorted(os.listdir()) == ["blocker", "m.safetensors"]


def test_library_saves_name_the_file_in_the_way_of_their_folder(tmp_path: Path) -> None:
    from pysafetensors import ShardedStreamingWriter, WriteError, save_sharded

    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"untouched")
    for folder in (blocker, blocker / "sub"):
        with pytest.raises(WriteError, match="is a file, not a folder") as info:
            save_sharded({"a": np.zeros(3, np.float32)}, folder)
        assert isinstance(info.value, NotADirectoryError)
        assert f"({str(blocker)!r} is a file" in str(info.value)
        with pytest.raises(WriteError, match="is a file, not a folder"):
            ShardedStreamingWriter(folder, {"a": ("F32", [3])})
    assert blocker.read_bytes() == b"untouched"
    assert sorted(os.listdir(tmp_path)) == ["blocker"]
    if hasattr(os, "symlink"):  # a broken link in the way: not called a file
        (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
        with pytest.raises(WriteError, match="is not a folder") as info:
            save_sharded({"a": np.zeros(3, np.float32)}, tmp_path / "dangling" / "sub")
        assert "is a file" not in str(info.value)


def _limit_file_size() -> None:
    import resource

    # Python ignores SIGXFSZ: a write past the limit fails with EFBIG, as on a full disk.
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def _run_with_small_files(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pysafetensors", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(),
        preexec_fn=_limit_file_size,  # noqa: PLW1509 - no threads in this test process matter
    )


@pytest.mark.skipif(sys.platform == "win32", reason="needs RLIMIT_FSIZE")
@pytest.mark.parametrize(
    "argv",
    [
        ["cast", "{file}", "{new}/c.safetensors", "--to", "F16"],
        ["cast", "{sharded}", "{new}/c", "--to", "F16"],
        ["cast", "{subfolders}", "{new}/c", "--to", "F16"],
        ["reshard", "{sharded}", "{new}/rs", "-s", "4KB"],
        ["merge", "{sharded}", "{new}/m.safetensors"],
        ["extract", "{sharded}", "{new}/x.safetensors", "*"],
        ["extract", "{sharded}", "{new}/x", "-s", "4KB", "*"],
        ["convert", "{pt_folder}", "{new}/cv"],
    ],
    ids=" ".join,
)
def test_a_failed_write_leaves_no_new_folders(
    tmp_path: Path, example: Path, subfolder_model: Path, argv: list[str]
) -> None:
    names = list(example_tensors())
    sharded = write_sharded(tmp_path / "sharded", example_tensors(), [names[:2], names[2:]])
    pt_folder = tmp_path / "pt"
    pt_folder.mkdir()
    torch = pytest.importorskip("torch") if argv[0] == "convert" else None
    if torch is not None:
        torch.save({"w": torch.ones(4096)}, pt_folder / "pytorch_model.bin")
    keep = tmp_path / "keep"
    keep.mkdir()
    paths = {
        "file": example,
        "sharded": sharded,
        "subfolders": subfolder_model,
        "pt_folder": pt_folder,
        "new": keep / "new" / "deeper",
    }
    r = _run_with_small_files(*(a.format(**paths) for a in argv))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r
    assert list(keep.iterdir()) == []  # the folders it created are gone; `keep` stays


def test_a_failed_read_leaves_no_new_folders(cli_proc, tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    save_file({"x": np.zeros(8, np.float32)}, str(bad))
    bad.write_bytes(bad.read_bytes()[:-4])  # truncated: refused before anything is written
    keep = tmp_path / "keep"
    keep.mkdir()
    for argv in (
        ["extract", bad, keep / "new" / "x.safetensors", "*"],
        ["cast", bad, keep / "new" / "c.safetensors", "--to", "F16"],
        ["convert", tmp_path / "missing.bin", keep / "new" / "cv.safetensors"],
    ):
        r = cli_proc(*argv)
        assert r.code in (1, 2) and r.err.startswith("error:"), (argv, r)
        assert list(keep.iterdir()) == [], argv


def test_an_output_that_would_overwrite_the_source_is_exit_2(cli, tmp_path: Path) -> None:
    """An output that cannot be written exits 2; refusing to overwrite the source exited 1,
    which means a negative answer or a malformed file."""
    from pysafetensors import save_sharded

    folder = tmp_path / "a"
    save_sharded({"x": np.zeros(1000, np.float32), "y": np.ones(1000, np.float32)}, folder, 4500)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for out in ("model-00001-of-00002.safetensors", "model.safetensors"):
        r = cli("merge", folder, folder / out)
        assert r.code == 2 and "Write to another path" in r.err, r
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
