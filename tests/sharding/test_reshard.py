"""Reshard, merge and extract: byte-identical to direct saves, copy fallbacks, bounded memory."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import (
    MissingShardError,
    SafetensorError,
    edit_metadata,
    extract,
    merge,
    reshard,
    safe_open,
    save_sharded,
)
from pysafetensors import _reshard as reshard_mod
from pysafetensors._cli import main
from pysafetensors.numpy import load_file, save_file

from .conftest import assert_same_tree


def model(seed: int, n: int = 25) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i in range(n):
        dt = [np.float32, np.float16, np.int32, np.int8][i % 4]
        rows = int(rng.integers(0, 12))
        out[f"model.layers.{i}.{['q', 'k', 'v', 'o'][i % 4]}"] = (
            rng.standard_normal((rows, 9)) * 20
        ).astype(dt)
    return out


def _index_order(folder: Path, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return sd
    return {k: sd[k] for k in json.loads(index.read_text())["weight_map"]}


@pytest.mark.parametrize("seed", range(12))
def test_reshard_is_byte_identical_to_direct_save(tmp_path: Path, seed: int) -> None:
    sd = model(seed)
    rng = np.random.default_rng(seed)
    first, second = (int(x) for x in rng.integers(100, 3000, size=2))
    save_sharded(sd, tmp_path / "src", first, metadata={"origin": "test"})
    reshard(tmp_path / "src", tmp_path / "out", second)
    # Resharding keeps the source index's order, which is the original order unless a tensor
    # larger than the old limit was moved ahead by the hub's splitter.
    save_sharded(
        _index_order(tmp_path / "src", sd), tmp_path / "direct", second, metadata={"origin": "test"}
    )
    assert_same_tree(tmp_path / "direct", tmp_path / "out")


def test_reshard_keeps_state_dict_order_when_nothing_is_oversized(tmp_path: Path) -> None:
    sd = {f"t{i}": np.full(50, i, np.float32) for i in range(20)}  # 200 bytes each
    save_sharded(sd, tmp_path / "src", "1KB")
    reshard(tmp_path / "src", tmp_path / "out", "3KB")
    save_sharded(sd, tmp_path / "direct", "3KB")
    assert_same_tree(tmp_path / "direct", tmp_path / "out")


def test_reshard_in_place_and_back_to_one_file(tmp_path: Path) -> None:
    sd = model(3)
    save_sharded(sd, tmp_path / "m", 500)
    save_sharded(_index_order(tmp_path / "m", sd), tmp_path / "direct", 1500)
    reshard(tmp_path / "m", tmp_path / "m", 1500)
    assert_same_tree(tmp_path / "direct", tmp_path / "m")
    reshard(tmp_path / "m", tmp_path / "m", "1GB")
    assert os.listdir(tmp_path / "m") == ["model.safetensors"]
    with safe_open(tmp_path / "m", "np") as f:
        assert f.metadata() == {"format": "pt"}
        for k, v in sd.items():
            np.testing.assert_array_equal(f.get_tensor(k), v)


def test_merge_is_byte_identical_to_save_file(tmp_path: Path) -> None:
    sd = model(5)
    save_sharded(sd, tmp_path / "src", 700, metadata={"a": "b"})
    merge(tmp_path / "src", tmp_path / "merged.safetensors")
    save_file(sd, tmp_path / "direct.safetensors", metadata={"format": "pt", "a": "b"})
    assert (tmp_path / "merged.safetensors").read_bytes() == (
        tmp_path / "direct.safetensors"
    ).read_bytes()
    # The reference reads it.
    st = pytest.importorskip("safetensors.numpy")
    loaded = st.load_file(str(tmp_path / "merged.safetensors"))
    for k, v in sd.items():
        np.testing.assert_array_equal(loaded[k], v)


def test_extract_glob_and_regex(tmp_path: Path) -> None:
    sd = model(7)
    save_sharded(sd, tmp_path / "src", 600)
    names = extract(tmp_path / "src", tmp_path / "q.safetensors", ["model.layers.*.q"])
    assert names and all(n.endswith(".q") for n in names)
    save_file({k: sd[k] for k in names}, tmp_path / "direct.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "q.safetensors").read_bytes() == (
        tmp_path / "direct.safetensors"
    ).read_bytes()

    names = extract(
        tmp_path / "src", tmp_path / "r", [r"layers\.1\d\."], regex=True, max_shard_size=300
    )
    assert sorted(names) == sorted(k for k in sd if k.startswith("model.layers.1") and len(k) > 16)
    save_sharded({k: sd[k] for k in names}, tmp_path / "r-direct", 300)
    assert_same_tree(tmp_path / "r-direct", tmp_path / "r")

    with pytest.raises(SafetensorError, match="matches") as info:
        extract(tmp_path / "src", tmp_path / "none.safetensors", ["nothing*"])
    assert info.value.kind == "NoMatch"


@pytest.mark.parametrize("broken", ["copy_file_range", "sendfile", "both"])
def test_copy_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    def refuse(*args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    if broken in ("copy_file_range", "both"):
        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    if broken in ("sendfile", "both"):
        monkeypatch.setattr(os, "sendfile", refuse, raising=False)
    monkeypatch.setattr(reshard_mod, "COPY_CHUNK", 64)  # many small steps
    sd = model(9)
    save_sharded(sd, tmp_path / "src", 800)
    merge(tmp_path / "src", tmp_path / "m.safetensors")
    save_file(sd, tmp_path / "d.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "d.safetensors").read_bytes()


def test_copy_range_reports_truncated_source(tmp_path: Path) -> None:
    src = tmp_path / "s"
    src.write_bytes(b"x" * 10)
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(tmp_path / "d", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(SafetensorError, match="ended early"):
            reshard_mod.copy_range(fd_in, 0, fd_out, 0, 20)
    finally:
        os.close(fd_in)
        os.close(fd_out)


_MEASURE = textwrap.dedent(
    """
    import sys
    from pysafetensors import merge, reshard
    def peak():
        # This process's own peak (VmHWM, KiB, new at exec): ru_maxrss carries the parent's
        # over fork and exec, and a test process larger than this one hid any growth.
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    before = peak()
    if sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3])
    else:
        reshard(sys.argv[2], sys.argv[3], "40MB")
    after = peak()
    print(before, after)
    """
)


@pytest.mark.parametrize("op", ["merge", "reshard"])
def test_peak_memory_is_bounded(tmp_path: Path, op: str) -> None:
    # 192 MiB of tensors; the copy must not grow the process by more than a few chunks.
    sd = {f"t{i}": np.full((4 << 20,), i, np.float32) for i in range(12)}
    save_sharded(sd, tmp_path / "src", "70MB")
    del sd
    out = tmp_path / ("m.safetensors" if op == "merge" else "out")
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, op, str(tmp_path / "src"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = (int(x) for x in proc.stdout.split())
    assert after - before < 32 * 1024, f"grew by {after - before} KiB"  # VmHWM is in KiB
    with safe_open(out, "np") as f:
        assert float(f.get_tensor("t11")[-1]) == 11.0


def test_cli_reshard_merge_extract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = model(11)
    save_sharded(sd, tmp_path / "src", 500)
    assert main(["-q", "reshard", str(tmp_path / "src"), str(tmp_path / "out"), "-s", "2KB"]) == 0
    save_sharded(_index_order(tmp_path / "src", sd), tmp_path / "direct", "2KB")
    assert_same_tree(tmp_path / "direct", tmp_path / "out")

    assert main(["-q", "merge", str(tmp_path / "out"), str(tmp_path / "m.safetensors")]) == 0
    with safe_open(tmp_path / "m.safetensors", "np") as f:
        assert f.keys() == sorted(sd)

    capsys.readouterr()
    code = main(
        [
            "-q",
            "extract",
            str(tmp_path / "src"),
            str(tmp_path / "e.safetensors"),
            "model.layers.1?.*",
            "--list",
        ]
    )
    assert code == 0
    listed = capsys.readouterr().out.split()
    assert listed == [
        k
        for k in _index_order(tmp_path / "src", sd)
        if k.startswith("model.layers.1") and len(k) > 16
    ]
    assert (
        main(["-q", "extract", str(tmp_path / "src"), str(tmp_path / "x.safetensors"), "zz*"]) == 1
    )
    assert "matches" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse: a usage error
        main(["-q", "reshard", str(tmp_path / "src"), str(tmp_path / "bad"), "-s", "5GiB"])
    assert usage.value.code == 2
    assert not (tmp_path / "bad").exists()


def _cli_code(*args: str | os.PathLike[str]) -> int:
    try:
        return main([str(a) for a in args])
    except SystemExit as exc:  # argparse usage errors
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("x.safetensors", "overwrite each other"),
        ("../x{suffix}.safetensors", "plain file names"),
        ("/tmp/x{suffix}.safetensors", "plain file names"),
        ("sub/x{suffix}.safetensors", "plain file names"),
        ("C:x{suffix}.safetensors", "plain file names"),
        ("{bad}{suffix}.safetensors", "unknown field {bad}"),
        ("x{suffix}.bin", "end in .safetensors"),
        ("x{suffix", "invalid filename pattern"),
        ("x{suffix!r}.safetensors", "no conversion or format spec"),
        ("x{suffix:>30}.safetensors", "no conversion or format spec"),
        # Names the clean-up and the source checks would not recognise as the family's.
        ("m{{v}}{suffix}.safetensors", "literal braces"),
        ("m}}{suffix}.safetensors", "literal braces"),
        ("x{suffix}{suffix}.safetensors", "may appear only once"),
    ],
)
def test_cli_refuses_filename_patterns_that_lose_or_misplace_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pattern: str, why: str
) -> None:
    sd = {f"t{i}": np.full(100, i, np.float32) for i in range(6)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    out = tmp_path / "deep" / "out"
    for cmd in (["reshard"], ["extract", "t*"]):
        target = [str(tmp_path / "m.safetensors"), str(out)]
        args = [cmd[0], *target, *cmd[1:], "-s", "1KB", "--filename-pattern", pattern]
        assert _cli_code(*args) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err
    # Nothing written anywhere: not in the output folder, not beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_library_refuses_a_pattern_without_suffix_only_when_sharded(tmp_path: Path) -> None:
    sd = {f"t{i}": np.full(100, i, np.float32) for i in range(6)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.raises(SafetensorError, match="overwrite each other") as exc:
        reshard(
            tmp_path / "m.safetensors", tmp_path / "out", 1000, filename_pattern="x.safetensors"
        )
    assert isinstance(exc.value, ValueError) and exc.value.kind == "InvalidPattern"
    assert not (tmp_path / "out").exists()
    with pytest.raises(SafetensorError, match="overwrite each other"):
        save_sharded(sd, tmp_path / "direct", 1000, filename_pattern="x.safetensors")
    # One file results: a fixed name is fine.
    reshard(tmp_path / "m.safetensors", tmp_path / "one", "1MB", filename_pattern="x.safetensors")
    assert sorted(os.listdir(tmp_path / "one")) == ["x.safetensors"]
    with safe_open(tmp_path / "one" / "x.safetensors", "np") as f:
        assert sorted(f.keys()) == sorted(sd)


@pytest.mark.parametrize(
    "size", ["0", "-5", "-1KB", "0.0001KB", "5GiB", "abc", "infGB", "1e400KB", "nanGB"]
)
def test_cli_refuses_shard_sizes(tmp_path: Path, size: str) -> None:
    save_file({"t": np.zeros(4, np.float32)}, str(tmp_path / "m.safetensors"))
    src = str(tmp_path / "m.safetensors")
    assert _cli_code("-q", "reshard", src, tmp_path / "o", f"-s={size}") == 2
    assert _cli_code("-q", "extract", src, tmp_path / "e", "t", f"--max-shard-size={size}") == 2
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()


@pytest.mark.parametrize("size", ["inf", "1e400", "12.5", "5XB"])
def test_cli_says_what_a_shard_size_may_be(
    tmp_path: Path, size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The library's text is the hub's ("Unit 'NF' not supported" for "inf"); the CLI's names
    # the forms a size takes.
    save_file({"t": np.zeros(4, np.float32)}, str(tmp_path / "m.safetensors"))
    assert _cli_code("reshard", tmp_path / "m.safetensors", tmp_path / "o", f"-s={size}") == 2
    err = capsys.readouterr().err
    assert f"not a whole number of bytes or a size in TB, GB, MB or KB: {size!r}" in err


def test_in_place_reshard_failing_midway_leaves_the_checkpoint(tmp_path: Path) -> None:
    """Every new file is renamed into place only once all are written (SaveGroup): an in-place
    reshard that stops after its first shard used to leave a folder that no longer opened, with
    a tensor stored nowhere."""

    state = {k: np.full(1000, i, np.float32) for i, k in enumerate(("a", "b", "c"))}
    save_sharded(state, tmp_path, max_shard_size=9000)  # [a, b] and [c]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def fail_after_first_shard(done: int, total: int) -> None:
        if done > 4000:  # the first new shard ([a], 4000 bytes) is complete: in the second
            raise KeyboardInterrupt  # as Ctrl-C mid-copy

    with pytest.raises(KeyboardInterrupt):
        reshard(tmp_path, tmp_path, max_shard_size=7000, progress=fail_after_first_shard)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    loaded = load_file(tmp_path)
    assert all(np.array_equal(loaded[k], v) for k, v in state.items())


def test_python_api_argument_checks(tmp_path: Path) -> None:
    save_sharded({"layers.0.w": np.ones(4), "layers.1.w": np.zeros(4)}, tmp_path / "m", 40)
    # One string is one pattern, not one pattern per character ("*" would match everything).
    names = extract(tmp_path / "m", tmp_path / "x.safetensors", "layers.0.*")
    assert names == ["layers.0.w"]
    for size in (None, 0, "0KB", -1):
        with pytest.raises(ValueError, match="more than 0 bytes"):
            reshard(tmp_path / "m", tmp_path / "r", max_shard_size=size)  # type: ignore[arg-type]
    assert not (tmp_path / "r").exists()


def test_outputs_that_would_replace_part_of_the_source_are_refused(tmp_path: Path) -> None:
    """A single output file renamed over a shard left an index naming tensors that were gone
    (extract lost them for good); a sharded extract into the index's own folder would replace
    the checkpoint with part of it."""
    sd = {f"layers.{i}.weight": np.full((64, 64), i, np.float32) for i in range(4)}
    save_sharded(sd, tmp_path / "ck", "20KB")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    shard = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(".safetensors"))[
        1
    ]
    attempts = [
        lambda: extract(tmp_path / "ck", tmp_path / "ck" / shard, "layers.0*"),
        lambda: merge(tmp_path / "ck", tmp_path / "ck" / shard),
        lambda: merge(tmp_path / "ck", tmp_path / "ck" / "model.safetensors.index.json"),
        lambda: extract(tmp_path / "ck", tmp_path / "ck", "layers.0*", max_shard_size="20KB"),
    ]
    for attempt in attempts:
        with pytest.raises(SafetensorError) as info:
            attempt()
        assert info.value.kind == "OutputIsSource"
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before
    # The same through the command line: one line, exit 2 (an output that cannot be
    # written), nothing written.
    assert _cli_code("-q", "merge", tmp_path / "ck", tmp_path / "ck" / shard) == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before
    # Outputs beside the source, or a merge of one file onto itself (which loses nothing).
    merge(tmp_path / "ck", tmp_path / "ck" / "merged.safetensors")
    extract(tmp_path / "ck", tmp_path / "ck" / "part.safetensors", "layers.0*")
    save_file(sd, str(tmp_path / "one.safetensors"))
    merge(tmp_path / "one.safetensors", tmp_path / "one.safetensors")
    with pytest.raises(SafetensorError, match="would destroy"):
        extract(tmp_path / "one.safetensors", tmp_path / "one.safetensors", "layers.0*")
    with safe_open(tmp_path / "ck", "np") as f:
        f.validate()
    with safe_open(tmp_path / "one.safetensors", "np") as f:
        assert sorted(f.keys()) == sorted(sd)


def test_sharded_outputs_over_a_file_source_in_their_folder_are_refused(tmp_path: Path) -> None:
    """A sharded extract from a folder's single file, or from one shard, into that folder
    (the CLI's ``extract D D 'x*' -s 1MB``) deleted the source once the new checkpoint was in
    place; resharding one shard into its folder replaced the whole checkpoint with that
    shard's tensors. Resharding the folder's single file, or the whole checkpoint, in place
    still works."""
    sd = {f"layers.{i}.weight": np.full((64, 64), i, np.float32) for i in range(4)}
    single = tmp_path / "single"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"))
    ck = tmp_path / "ck"
    save_sharded(sd, ck, "20KB")
    shard = ck / "model-00001-of-00004.safetensors"
    assert shard.exists()

    def tree(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    before = {single: tree(single), ck: tree(ck)}
    attempts = [
        lambda: extract(single, single, "layers.0*", max_shard_size="20KB"),
        lambda: extract(single / "model.safetensors", single, "layers.0*", max_shard_size="20KB"),
        lambda: extract(shard, ck, "layers.0*", max_shard_size="20KB"),
        lambda: reshard(shard, ck, "5KB"),
    ]
    # The same files reached through a symlink or a hard link elsewhere.
    (tmp_path / "link.safetensors").symlink_to(shard)
    os.link(shard, tmp_path / "hard.safetensors")
    (tmp_path / "single-link.safetensors").symlink_to(single / "model.safetensors")
    attempts += [
        lambda: reshard(tmp_path / "link.safetensors", ck, "5KB"),
        lambda: reshard(tmp_path / "hard.safetensors", ck, "5GB"),
        lambda: extract(
            tmp_path / "single-link.safetensors", single, "layers.0*", max_shard_size="20KB"
        ),
    ]
    for attempt in attempts:
        with pytest.raises(SafetensorError, match="Write to another folder") as info:
            attempt()
        assert info.value.kind == "OutputIsSource"
    assert {single: tree(single), ck: tree(ck)} == before
    # The command line says so in one line, exit 2.
    assert _cli_code("-q", "extract", single, single, "layers.0*", "-s", "20KB") == 2
    assert tree(single) == before[single]
    # A file outside the pattern's names stays, and is read from.
    save_file(sd, str(single / "other.safetensors"))
    extract(single / "other.safetensors", single, "layers.1*", max_shard_size="20KB")
    assert sorted(load_file(single)) == ["layers.1.weight"]
    assert (single / "other.safetensors").exists()
    # In place: the folder's single file into shards, and a sharded checkpoint resharded.
    save_file(sd, str(single / "model.safetensors"))
    reshard(single / "model.safetensors", single, "20KB")
    reshard(ck, ck, "40KB")
    for folder in (single, ck):
        loaded = load_file(folder)
        assert sorted(loaded) == sorted(sd)
        assert all(np.array_equal(loaded[k], v) for k, v in sd.items())


def test_resharding_one_shard_named_any_way_into_its_folder_is_refused(tmp_path: Path) -> None:
    # The source was looked for among the output pattern's names only: a shard the index
    # names otherwise (part_a.safetensors, sub/...) was resharded into the folder, and the new
    # index replaced the old one, losing the other shards' tensors.
    for layout in (
        {"a": "part_a.safetensors", "b": "part_b.safetensors"},
        {"a": "sub/x-a.safetensors", "b": "sub/x-b.safetensors"},
    ):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        for name, shard in layout.items():
            (folder / shard).parent.mkdir(parents=True, exist_ok=True)
            save_file({name: np.full(4, 1.0, np.float32)}, str(folder / shard))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 32}, "weight_map": layout})
        )
        with pytest.raises(SafetensorError, match="one shard of the checkpoint") as info:
            reshard(folder / layout["a"], folder, "1KB")
        assert info.value.kind == "OutputIsSource"
        assert sorted(load_file(folder)) == ["a", "b"]


def test_a_file_s_own_total_size_key_does_not_replace_the_index_s(tmp_path: Path) -> None:
    sd = {"a": np.ones((64, 64), np.float32), "b": np.zeros((64, 64), np.float16)}
    meta = {"format": "pt", "x": "1", "total_size": "5", "total_parameters": "9"}
    save_file(sd, str(tmp_path / "m.safetensors"), metadata=meta)
    reshard(tmp_path / "m.safetensors", tmp_path / "out", "10KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 24576, "total_parameters": 8192}
    with safe_open(tmp_path / "out", "np") as f:
        f.validate()
        # The file's own key stays in every shard's header, where it was.
        assert all(m == {"format": "pt", "x": "1"} for m in f.shard_metadata())


@pytest.mark.parametrize("stem", ["model", "diffusion_pytorch_model"])
def test_a_single_file_is_not_written_where_loaders_look_before_the_index(
    tmp_path: Path, stem: str
) -> None:
    """``model.safetensors`` beside ``model.safetensors.index.json``: the hub's tools and
    transformers open it first, and would load an extract of the checkpoint as the model."""
    sd = {f"layers.{i}.w": np.full(250, i, np.float32) for i in range(4)}
    save_sharded(sd, tmp_path, 2000, filename_pattern=stem + "{suffix}.safetensors")
    index = tmp_path / f"{stem}.safetensors.index.json"
    assert index.exists()
    shadow = tmp_path / f"{stem}.safetensors"
    before = sorted(p.name for p in tmp_path.iterdir())
    for attempt in (
        lambda: extract(tmp_path, shadow, ["layers.1.*"]),
        lambda: extract(index, shadow, ["layers.1.*"]),
        lambda: merge(tmp_path, shadow),
    ):
        with pytest.raises(SafetensorError, match="loaders open before any index") as info:
            attempt()
        assert info.value.kind == "OutputIsSource"
    assert main(["-q", "extract", str(tmp_path), str(shadow), "layers.1.*"]) != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # Any other name beside the index is fine, and so is that name in another folder.
    extract(tmp_path, tmp_path / "part.safetensors", ["layers.1.*"])
    other = tmp_path / "other"
    other.mkdir()
    merge(tmp_path, other / f"{stem}.safetensors")
    assert sorted(load_file(other / f"{stem}.safetensors")) == sorted(sd)


@pytest.mark.parametrize("stem", ["diffusion_pytorch_model", "adapter_model", "m"])
@pytest.mark.parametrize("sharded", [True, False])
def test_a_reshard_into_its_folder_keeps_the_source_s_names(
    tmp_path: Path, stem: str, sharded: bool
) -> None:
    """A diffusers (or PEFT, or any) folder resharded in place kept no name its library
    looks for: the default pattern was model{suffix}, and the old files were deleted."""
    sd = {f"l{i}": np.full(250, i, np.float32) for i in range(6)}
    if sharded:
        save_sharded(sd, tmp_path, 2000, filename_pattern=stem + "{suffix}.safetensors")
    else:
        save_file(sd, str(tmp_path / f"{stem}.safetensors"))
    assert main(["-q", "reshard", str(tmp_path), str(tmp_path), "-s", "4KB"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        f"{stem}-00001-of-00002.safetensors",
        f"{stem}-00002-of-00002.safetensors",
        f"{stem}.safetensors.index.json",
    ]
    assert sorted(load_file(tmp_path)) == sorted(sd)
    # Into another folder, or with a pattern given, the pattern is as asked.
    other = tmp_path / "other"
    reshard(tmp_path, other, "4KB")
    assert (other / "model.safetensors.index.json").exists()
    reshard(tmp_path, tmp_path, "100KB", filename_pattern="model{suffix}.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["model.safetensors"]


def test_a_reshard_keeps_the_shards_header_metadata_in_every_shard(tmp_path: Path) -> None:
    """transformers reads a quantizer's metadata back from each shard's header: a reshard
    moved it into the index alone."""
    sd = {f"l{i}": np.full(250, i, np.float32) for i in range(6)}
    src = tmp_path / "src"
    save_sharded(sd, src, 2000)
    for shard in src.glob("model-*.safetensors"):
        edit_metadata(shard, {"quant_method": "torchao", "per_shard": shard.name})
    with pytest.warns(UserWarning, match="disagree on metadata 'per_shard'"):
        reshard(src, tmp_path / "out", 3000)
    with safe_open(tmp_path / "out", "np") as f:
        assert len(f.shard_metadata()) > 1
        assert all(m == {"format": "pt", "quant_method": "torchao"} for m in f.shard_metadata())
        assert f.index_metadata() == {"total_size": 6000}  # keys that differ are not kept


def test_shards_disagreeing_on_format_are_warned_of(tmp_path: Path) -> None:
    """The other keys the shards disagree on are dropped with a warning; a ``format`` of
    ``pt`` in one shard and ``np`` in another became ``pt`` without a word."""
    import warnings

    from pysafetensors import merge

    sd = {f"l{i}": np.full(250, i, np.float32) for i in range(4)}
    src = tmp_path / "src"
    save_sharded(sd, src, 2000)
    shards = sorted(src.glob("model-*.safetensors"))
    edit_metadata(shards[-1], {"format": "np"})
    for run in (
        lambda: reshard(src, tmp_path / "out", 3000),
        lambda: merge(src, tmp_path / "merged.safetensors"),
    ):
        with pytest.warns(
            UserWarning, match="disagree on metadata 'format': 'np', 'pt'; the output's is 'pt'"
        ):
            run()
    with safe_open(tmp_path / "merged.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
    # Asked for, or agreed on: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merge(src, tmp_path / "asked.safetensors", format="np")
        edit_metadata(shards[-1], {"format": "pt"})
        merge(src, tmp_path / "agreed.safetensors")
    with safe_open(tmp_path / "asked.safetensors", "np") as f:
        assert f.metadata() == {"format": "np"}
    # Shards of np and shards without a format: the output's pt replaces np.
    for shard in shards:
        edit_metadata(shard, {"format": "np"})
    edit_metadata(shards[0], delete=["format"])
    with pytest.warns(UserWarning, match=r"'format': 'np' \(and some shards have none\)"):
        merge(src, tmp_path / "half.safetensors")


def test_an_index_too_large_to_be_one_is_not_read(tmp_path: Path, monkeypatch: Any) -> None:
    """A stray ``*.index.json`` over the size an index may have is not parsed (a 300 MB one
    took 13 s and 1.5 GB during an in-place reshard's clean-up): for the clean-up it names
    every file (none deleted on its account), for the checks that refuse an output it names
    none."""
    import json

    from pysafetensors import _reshard

    stray = tmp_path / "zz.safetensors.index.json"
    stray.write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}) + " " * 300)
    assert _reshard._index_shards(str(stray)) == {"a.safetensors"}
    monkeypatch.setattr(_reshard, "MAX_INDEX_SIZE", 100)
    loads: list[Any] = []
    monkeypatch.setattr(_reshard.json, "load", lambda *a, **k: loads.append(a))
    assert _reshard._index_shards(str(stray)) == frozenset()
    assert not _reshard._index_names_file(str(stray), str(tmp_path / "a.safetensors"))
    everything = _reshard._named_by_other_indexes(str(tmp_path), set(), _reshard._EVERY_NAME)
    assert "anything.safetensors" in everything
    assert "a.safetensors" not in _reshard._named_by_other_indexes(str(tmp_path), set())
    assert loads == []


def test_a_source_that_is_not_there_is_the_os_error_safe_open_raises(tmp_path: Path) -> None:
    # It was reported as a shard "removed since the checkpoint was opened".
    missing = tmp_path / "nope.safetensors"
    calls = [
        lambda: reshard(missing, tmp_path / "o1", "1KB"),
        lambda: merge(missing, tmp_path / "o2.safetensors"),
        lambda: extract(missing, tmp_path / "o3.safetensors", ["a"]),
    ]
    for call in calls:
        with pytest.raises(FileNotFoundError, match="No such file or directory") as info:
            call()
        assert info.value.filename == str(missing)
        assert not isinstance(info.value, MissingShardError)
    assert os.listdir(tmp_path) == []


def test_resharding_one_shard_of_a_folder_without_index_is_refused(tmp_path: Path) -> None:
    # Shards whose index is gone (a save killed in its commit, shards fetched without it):
    # resharding one into the folder deleted the others in its clean-up.
    sd = {f"t{i}": np.arange(100 + i, dtype=np.float32) for i in range(4)}
    folder = tmp_path / "m"
    save_sharded(sd, folder, max_shard_size=900)
    (folder / "model.safetensors.index.json").unlink()
    shards = sorted(p.name for p in folder.iterdir())
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with pytest.raises(SafetensorError, match="one shard of the checkpoint") as info:
        reshard(folder / shards[0], folder, "10GB")
    assert info.value.kind == "OutputIsSource"
    assert _cli_code("reshard", folder / shards[0], folder) == 2
    assert sorted(p.name for p in folder.iterdir()) == shards
    with safe_open(folder / shards[1], "numpy") as f:
        assert sorted(f.keys()) == ["t2", "t3"]
    # A file named as the one shard of one is a whole checkpoint: resharded in place.
    single = tmp_path / "one"
    save_file(sd, str(tmp_path / "x.safetensors"))
    single.mkdir()
    os.replace(tmp_path / "x.safetensors", single / "model-00001-of-00001.safetensors")
    reshard(single / "model-00001-of-00001.safetensors", single, "1KB")
    assert sorted(load_file(single)) == sorted(sd)


def test_a_reshard_into_the_source_s_folder_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old files are deleted once the new ones are renamed in: the new ones must be flushed
    # first, whatever fsync= says.
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sd = model(3)
    save_sharded(sd, tmp_path / "src", 800)
    reshard(tmp_path / "src", tmp_path / "elsewhere", 1200)
    assert synced == []  # not in place: as asked
    files = len(list((tmp_path / "elsewhere").glob("*.safetensors")))
    reshard(tmp_path / "src", tmp_path / "src", 1200)
    assert len(synced) > files  # every new file, then the folder
    assert_same_tree(tmp_path / "src", tmp_path / "elsewhere")
    synced.clear()
    for command in (
        ("reshard", tmp_path / "src", tmp_path / "cli", "-s", "1200", "--fsync"),
        ("merge", tmp_path / "src", tmp_path / "merged.safetensors", "--fsync"),
        ("extract", tmp_path / "src", tmp_path / "part.safetensors", "*.q", "--fsync"),
    ):
        assert _cli_code(*command) == 0
        assert synced, command
        synced.clear()


@pytest.mark.parametrize("failure", ["short", "eio"])
def test_a_failed_copy_names_the_shard_and_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    save_sharded(sd, tmp_path / "src", max_shard_size=8000)

    def copy_file_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> int:
        if failure == "short":
            return 0  # the source ended: truncated while being copied
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "copy_file_range", copy_file_range, raising=False)
    out = tmp_path / "merged.safetensors"
    with pytest.raises(SafetensorError) as info:
        merge(tmp_path / "src", out)
    text = str(info.value)
    assert "model-00001-of-00002.safetensors" in text and "'t0'" in text
    if failure == "short":
        assert info.value.kind == "ShortRead" and "ended early" in text
    else:
        assert info.value.kind == "IoError" and info.value.errno == errno.EIO
        assert str(out) in text and "copying 4000 bytes from offset" in text
    assert not out.exists()


def _index_with_shards_in(folder: Path, sub: str, max_size: int = 8_000) -> dict[str, np.ndarray]:
    """A checkpoint whose index sits in ``folder`` and names its shards in ``folder/sub``
    (``"sub/model-00001-of-00003.safetensors"``), as the hub allows."""
    sd = {f"t{i}": np.full((1000,), i, np.float32) for i in range(6)}
    save_sharded(sd, folder / sub, max_size)
    index = json.loads((folder / sub / "model.safetensors.index.json").read_text())
    (folder / sub / "model.safetensors.index.json").unlink()
    index["weight_map"] = {k: f"{sub}/{v}" for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sd


@pytest.mark.parametrize("op", ["extract", "reshard"])
def test_an_output_into_the_folder_of_the_source_s_shards_is_refused(
    tmp_path: Path, op: str
) -> None:
    # The shards' folder is not the index's: an extract there deleted every source shard it
    # did not write (the rest of the model), a reshard left the source index naming none.
    sd = _index_with_shards_in(tmp_path, "sub")
    before = sorted(os.listdir(tmp_path / "sub"))
    with pytest.raises(SafetensorError, match="shard .*sub/model-00001-of-00003") as info:
        if op == "extract":
            extract(tmp_path, tmp_path / "sub", ["t0"], max_shard_size="8KB")
        else:
            reshard(tmp_path, tmp_path / "sub", "16KB")
    assert info.value.kind == "OutputIsSource"
    assert sorted(os.listdir(tmp_path / "sub")) == before
    loaded = load_file(tmp_path)
    assert sorted(loaded) == sorted(sd)
    # Into the index's own folder a reshard rewrites the checkpoint whole, as before.
    reshard(tmp_path, tmp_path, "16KB")
    assert sorted(load_file(tmp_path)) == sorted(sd)


def test_an_in_place_reshard_keeps_shards_its_index_spelled_another_way(tmp_path: Path) -> None:
    # The index names its shards through a link to the folder itself ("same/model-..."): the
    # new shards, written under the same names, were taken for old ones and deleted.
    sd = _index_with_shards_in(tmp_path, "real", max_size=16_000)
    for name in os.listdir(tmp_path / "real"):
        os.rename(tmp_path / "real" / name, tmp_path / name)
    (tmp_path / "real").rmdir()
    (tmp_path / "real").symlink_to(".")
    reshard(tmp_path, tmp_path, "16KB")  # a new split under the same two names
    loaded = load_file(tmp_path)
    assert sorted(loaded) == sorted(sd)
    for name, array in sd.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_an_index_with_total_parameters_keeps_it_first(tmp_path: Path) -> None:
    # transformers v5 writes {"total_parameters": N, "total_size": M}; a reshard wrote the
    # keys the other way round, so its index was not the one transformers writes.
    save_sharded(model(0), tmp_path / "src", 1000)
    index_path = tmp_path / "src" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"] = {"total_parameters": 1, **index["metadata"]}
    index_path.write_text(json.dumps(index, indent=2))
    reshard(tmp_path / "src", tmp_path / "out", 2000)
    written = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert list(written["metadata"]) == ["total_parameters", "total_size"]


def test_tensors_next_to_each_other_are_copied_in_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's tensors written one after another are one copy (a copy per tensor was most
    of merging 100,000 small tensors), and the output holds every tensor's bytes."""
    sd = {f"t{i:03d}": np.full(100 + i, i, np.float32) for i in range(300)}
    save_sharded(sd, tmp_path / "src", max_shard_size=60_000)
    shards = len(list((tmp_path / "src").glob("*.safetensors")))
    assert shards >= 3
    copies: list[int] = []
    real = reshard_mod._Sources.copy

    def counted(
        self: Any, path: str, name: str, src_off: int, fd: int, dst: int, n: int, out: str
    ) -> None:
        copies.append(n)
        real(self, path, name, src_off, fd, dst, n, out)

    monkeypatch.setattr(reshard_mod._Sources, "copy", counted)
    merge(tmp_path / "src", tmp_path / "merged.safetensors")
    assert len(copies) == shards  # one run per source shard, in name order
    loaded = load_file(tmp_path / "merged.safetensors")
    assert all(np.array_equal(loaded[k], v) for k, v in sd.items())
    copies.clear()
    reshard(tmp_path / "src", tmp_path / "re", max_shard_size=25_000)
    assert shards < len(copies) < 20  # runs cut where the output's shards end
    loaded = load_file(tmp_path / "re")
    assert all(np.array_equal(loaded[k], v) for k, v in sd.items())


def test_a_copy_failing_within_a_run_names_that_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's copy that fails is done again tensor by tensor: the error is about the tensor
    whose bytes could not be read (t2), not the run's first."""
    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    save_file(sd, str(tmp_path / "one.safetensors"))
    with safe_open(str(tmp_path / "one.safetensors"), "np") as f:
        bad = f.header.data_start + f.header.tensors["t2"].begin
    real = os.copy_file_range

    def copy_file_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> int:
        if src_off <= bad < src_off + n:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst, min(n, bad - src_off) if src_off < bad else n, src_off, dst_off)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range, raising=False)
    out = tmp_path / "merged.safetensors"
    with pytest.raises(SafetensorError) as info:
        merge(tmp_path / "one.safetensors", out)
    text = str(info.value)
    assert "'t2'" in text and "copying 4000 bytes from offset" in text, text
    assert info.value.kind == "IoError" and not out.exists()
