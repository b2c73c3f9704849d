"""Crash safety of saves: SIGKILL at random points, stale temporary files, fsync.

A save writes ``.<name>.<hex>.partial`` next to the target and renames it over the target with
``os.replace`` only when complete (``_writer.atomic_output``). So whatever instant a save is
killed at, the target holds either the old file or the complete new one, and the only debris
is a temporary file that a later save removes once it is older than 60 seconds.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pysafetensors
from pysafetensors import _writer
from pysafetensors.numpy import save, save_file

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and rename")

_SAVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pysafetensors.numpy import save_file

    target, seed, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    arr = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent starts its clock, then lets us go
    save_file({"w": arr, "s": np.array([seed], np.int64)}, target)
    print("done", flush=True)
    """
)


def _content(seed: int, size: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    return save({"w": arr, "s": np.array([seed], np.int64)})


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _partials(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f".{name}.*.partial"))


def _launch(script: str, *args: object) -> subprocess.Popen[str]:
    """Start a saver script, wait until it is ready, and let it go (returns it saving)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc


def _kill_after(proc: subprocess.Popen[str], delay: float) -> None:
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _kill_saves(tmp_path: Path, kills: int, size: int) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(_content(0, size))
    rng = random.Random(1234)
    # How long one save takes here: the kill delays are spread over 1.5x that window.
    start = time.perf_counter()
    save_file({"w": np.zeros(size, np.uint8)}, tmp_path / "probe.safetensors")
    window = max(0.02, (time.perf_counter() - start) * 1.5)
    outcomes = {"old": 0, "new": 0}
    for i in range(1, kills + 1):
        new = _sha(_content(i, size))
        before = _sha(target.read_bytes())
        _kill_after(_launch(_SAVER, target, i, size), rng.uniform(0, window))
        after = target.read_bytes()
        digest = _sha(after)
        # Never a partial file under the target's name: the old bytes or the complete new ones.
        assert digest in (before, new), f"kill {i}: torn target"
        outcomes["old" if digest == before else "new"] += 1
        for p in _partials(tmp_path, target.name):
            assert p.stat().st_size <= len(after) + 8 * size  # debris only, bounded
    # A later save cleans up debris older than 60 s (backdate it) and keeps younger files
    # (they may belong to a save still running).
    debris = _partials(tmp_path, target.name)
    young = tmp_path / f".{target.name}.young.partial"
    young.write_bytes(b"in progress")
    old = time.time() - 120
    for p in debris:
        os.utime(p, (old, old))
    save_file({"x": np.arange(3)}, target)
    assert _partials(tmp_path, target.name) == [young]
    assert outcomes["old"] + outcomes["new"] == kills
    print(f"{kills} kills: {outcomes}")


def test_sigkill_during_save_leaves_old_or_new_file(tmp_path: Path) -> None:
    """Five kills at random instants of saving a 16 MB file over an existing one."""
    _kill_saves(tmp_path, kills=5, size=16 << 20)


@pytest.mark.slow
def test_sigkill_during_save_many_times(tmp_path: Path) -> None:
    """Thirty kills at random instants of saving a 64 MB file over an existing one."""
    _kill_saves(tmp_path, kills=30, size=64 << 20)


def test_stale_partials_follow_the_60_second_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "m.safetensors"
    left = tmp_path / ".m.safetensors.0123456789ab.partial"
    left.write_bytes(b"debris")
    other = tmp_path / ".other.safetensors.0123456789ab.partial"
    other.write_bytes(b"another target's debris")
    save_file({"a": np.arange(2)}, target)
    assert left.exists(), "a fresh partial may belong to a running save"
    real_time = time.time
    monkeypatch.setattr(_writer.time, "time", lambda: real_time() + 61)
    save_file({"a": np.arange(2)}, target)
    assert not left.exists()
    assert other.exists(), "only the target's own partials are cleaned"


def test_sharded_saves_clean_every_shard_s_stale_partials_from_one_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded save lists the folder's temporary files once (a glob per shard made a save
    of 20,000 shards quadratic: 111 s) and still removes each shard's and the index's stale
    ones, by the same rules as a single save."""
    from pysafetensors import save_sharded

    names = ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    stale = [tmp_path / f".{name}.0123456789ab.partial" for name in names]
    other = tmp_path / ".notes.txt.0123456789ab.partial"
    for path in (*stale, other):
        path.write_bytes(b"debris")
    searches: list[str] = []
    real_glob = _writer.glob.glob
    monkeypatch.setattr(
        _writer.glob, "glob", lambda pattern: searches.append(pattern) or real_glob(pattern)
    )
    real_time = time.time
    monkeypatch.setattr(_writer.time, "time", lambda: real_time() + 61)
    tensors = {f"w{i}": np.full(64, i, np.float32) for i in range(8)}
    save_sharded(tensors, tmp_path, max_shard_size=1200)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not any(path.exists() for path in stale)
    assert other.exists(), "only the targets' own partials are cleaned"
    assert searches == [], "a folder search per file"


def test_failed_save_leaves_target_and_no_debris(tmp_path: Path) -> None:
    target = tmp_path / "m.safetensors"
    save_file({"a": np.arange(4)}, target)
    before = target.read_bytes()

    def chunks() -> Iterator[Any]:
        yield np.zeros(8, np.uint8)
        raise RuntimeError("disk on fire")

    from pysafetensors._dtypes import dtype_from_code

    bad = _writer.TensorData("a", dtype_from_code("U8"), (16,), chunks)
    with pytest.raises(RuntimeError, match="disk on fire"):
        _writer.write_file(target, [bad])
    assert target.read_bytes() == before
    assert _partials(tmp_path, target.name) == []


class _FsyncSpy:
    """Records what kind of file each ``os.fsync`` call was for, then really syncs it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._real = os.fsync

    def __call__(self, fd: int) -> None:
        mode = os.fstat(fd).st_mode
        kind = "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
        self.calls.append(("fsync", kind))
        self._real(fd)


def test_fsync_true_syncs_the_file_then_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _FsyncSpy()
    real_replace = os.replace
    monkeypatch.setattr(os, "fsync", spy)
    monkeypatch.setattr(
        os, "replace", lambda a, b: (spy.calls.append(("replace", "")), real_replace(a, b))[1]
    )
    target = tmp_path / "durable.safetensors"
    save_file({"a": np.arange(10)}, target, fsync=True)
    # The data reaches the disk before the rename makes it visible; the folder after.
    assert spy.calls == [("fsync", "file"), ("replace", ""), ("fsync", "dir")]
    assert target.read_bytes() == save({"a": np.arange(10)})


def test_fsync_false_does_not_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _FsyncSpy()
    monkeypatch.setattr(os, "fsync", spy)
    save_file({"a": np.arange(10)}, tmp_path / "fast.safetensors")
    assert spy.calls == []


# ------------------------------------------------------------------------ sharded checkpoints

_SHARDED_SAVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from pysafetensors import save_sharded

    folder, seed, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = np.random.default_rng(seed)
    state = {}
    for i in range(4):  # four shards: each a big tensor and its save's seed
        state[f"w{i}"] = rng.integers(0, 256, size=size, dtype=np.uint8)
        state[f"s{i}"] = np.array([seed], np.int64)
    print("ready", flush=True)
    sys.stdin.readline()
    save_sharded(state, folder, max_shard_size=size + 64)
    print("done", flush=True)
    """
)


def _seeds_in(folder: Path) -> set[int]:
    """The seeds of the saves the folder's checkpoint comes from; empty if it does not open."""
    from pysafetensors.numpy import load_file

    try:
        loaded = load_file(folder)
    except pysafetensors.SafetensorError as exc:
        # Killed while renaming: no index, so the folder refuses to open as a whole.
        assert "but no index" in str(exc), exc
        assert not (folder / "model.safetensors.index.json").exists()
        return set()
    return {int(loaded[f"s{i}"][0]) for i in range(4)}


def test_sigkill_during_sharded_save_never_mixes_checkpoints(tmp_path: Path) -> None:
    """Eight kills at random instants of saving a 4-shard checkpoint over an earlier one.

    The folder always loads as one checkpoint, the old or the new, never shards of both; a kill
    during the few milliseconds of renames leaves it without an index, refusing to open.
    """
    folder, size = tmp_path / "ckpt", 4 << 20

    def save_whole(target: Path, seed: int) -> float:
        """Run a save to its end; its duration from "go" to "done"."""
        proc = _launch(_SHARDED_SAVER, target, seed, size)
        start = time.perf_counter()
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        elapsed = time.perf_counter() - start
        proc.wait(timeout=30)
        return elapsed

    save_whole(folder, 0)
    window = save_whole(tmp_path / "probe", 1) * 1.2
    rng = random.Random(99)
    outcomes: dict[str, int] = {"old": 0, "new": 0, "refuses to open": 0}
    for i in range(1, 9):
        before = _seeds_in(folder)
        if not before:  # the previous kill hit the renames: start again from a whole save
            save_whole(folder, 0)
            before = {0}
        _kill_after(_launch(_SHARDED_SAVER, folder, i, size), rng.uniform(0, window))
        seeds = _seeds_in(folder)
        assert len(seeds) <= 1, f"kill {i}: shards of several saves {seeds}"
        assert seeds in (before, {i}, set())
        outcomes["refuses to open" if not seeds else "old" if seeds == before else "new"] += 1
    print(f"8 kills: {outcomes}")


def test_failed_sharded_save_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors import save_sharded

    folder = tmp_path / "ckpt"
    old = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    save_sharded(old, folder, max_shard_size=1100)
    snapshot = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert len(snapshot) == 5  # four shards and the index
    new = {f"w{i}": torch.full((256,), 10.0 + i) for i in range(4)}
    new["w3"] = torch.arange(512.0).reshape(256, 2)[:, 0]  # not contiguous: the last shard fails
    with pytest.raises(pysafetensors.SerializeError):
        save_sharded(new, folder, max_shard_size=1100, force_contiguous=False)
    # Earlier shards were written, but none replaced its file: no mix of two checkpoints.
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == snapshot


_EDITOR = textwrap.dedent(
    """
    import os, sys
    from pysafetensors import edit_metadata

    target, value, in_place = sys.argv[1], sys.argv[2] * int(sys.argv[3]), sys.argv[4]
    real_pwrite, real_write = os.pwrite, os.write

    def announced_pwrite(fd, data, offset):
        # The parent kills us the moment it reads this: in the middle of the write.
        print("writing", flush=True)
        return real_pwrite(fd, data, offset)

    def announced_write(fd, data):
        print("writing", flush=True)
        return real_write(fd, data)

    os.pwrite, os.write = announced_pwrite, announced_write
    print("ready", flush=True)
    sys.stdin.readline()
    edit_metadata(target, set={"k": value}, **({} if in_place == "auto" else {"in_place": True}))
    print("done", flush=True)
    """
)


def _kill_edits(tmp_path: Path, old: str, new: str, rounds: int) -> dict[str, int]:
    """Kill a metadata edit the moment it starts writing; the file must read as old or new.

    ``new`` is one character repeated (it travels on the child's command line as both).
    """
    target = tmp_path / "model.safetensors"
    tensors = {"w": np.arange(1000, dtype=np.float32)}
    outcomes = {"old": 0, "new": 0, "not started": 0}
    for _ in range(rounds):
        save_file(tensors, target, metadata={"k": old})
        proc = _launch(_EDITOR, target, new[0], len(new), "auto")
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # "writing", or "done" when no pwrite was needed
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with pysafetensors.safe_open(target, "np") as f:  # a torn header fails right here
            value = (f.metadata() or {})["k"]
            np.testing.assert_array_equal(f.get_tensor("w"), tensors["w"])
        assert value in (old, new), f"torn metadata: {value[:20]!r}... ({len(value)} chars)"
        outcomes["old" if value == old else "new"] += 1
        outcomes["not started"] += line != "writing"
    return outcomes


def test_sigkill_during_metadata_edit_leaves_old_or_new_header(tmp_path: Path) -> None:
    # A change spanning many pages was one in-place pwrite, which the kernel stops between
    # pages when the process is killed: 18 of 40 such kills left a header mixing old and new
    # bytes, or unreadable JSON. Such a change is now a rewrite (atomic); a change within one
    # page stays in place (the kernel copies a page whole).
    big = _kill_edits(tmp_path, "a" * 8_000_000, "b" * 4_000_000, rounds=8)
    small = _kill_edits(tmp_path, "a" * 100, "b" * 50, rounds=4)
    # Every kill came as the edit began to write (else the check above tested nothing).
    assert big["not started"] == small["not started"] == 0, (big, small)


def test_only_the_target_s_own_partials_are_cleaned(tmp_path: Path) -> None:
    old = time.time() - 3600
    notes = tmp_path / ".m.safetensors.my notes.partial"  # a user's file, not a save's
    longer = tmp_path / ".m.safetensors.0123456789ab.partial"  # a crashed save of m.safetensors
    own = tmp_path / ".m.0123456789ab.partial"  # a crashed save of m
    for path in (notes, longer, own):
        path.write_bytes(b"x")
        os.utime(path, (old, old))
    save_file({"a": np.arange(2)}, tmp_path / "m")
    assert notes.exists() and longer.exists() and not own.exists()
    save_file({"a": np.arange(2)}, tmp_path / "m.safetensors")
    assert notes.exists() and not longer.exists()


def test_a_crashed_save_to_a_long_name_is_cleaned_too(tmp_path: Path) -> None:
    name = "w" * 243 + ".safetensors"  # 255 bytes: the longest name, and a valid target
    stem = _writer.partial_stem(name)
    assert len(f".{stem}.0123456789ab.partial".encode()) <= 255
    left = tmp_path / f".{stem}.0123456789ab.partial"
    left.write_bytes(b"debris")
    old = time.time() - 3600
    os.utime(left, (old, old))
    save_file({"a": np.arange(2)}, tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == [name]
    # Two long names sharing their beginning have stems of their own.
    assert _writer.partial_stem(name) != _writer.partial_stem("w" * 243 + ".safetensorz")
