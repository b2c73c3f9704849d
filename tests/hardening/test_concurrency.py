"""Concurrency: one handle shared by many threads; saves overlapping in time."""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import safe_open
from pysafetensors.numpy import load_file, save, save_file


@pytest.fixture(scope="module")
def shared_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    tensors = {
        # Over 32 MiB, so pread splits it across its own reader threads too.
        "big": rng.standard_normal((2304, 4096)).astype(np.float32),
        "mid": rng.integers(-1000, 1000, size=(300, 301), dtype=np.int32),
        "small": np.arange(17, dtype=np.float16),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 5), np.uint8),
    }
    path = tmp_path_factory.mktemp("conc") / "shared.safetensors"
    save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_one_handle_eight_threads(
    shared_file: tuple[Path, dict[str, np.ndarray]], backend: str
) -> None:
    path, tensors = shared_file
    names = list(tensors)

    def work(seed: int) -> int:
        rng = np.random.default_rng(seed)
        done = 0
        for _ in range(25):
            name = names[int(rng.integers(len(names)))]
            want = tensors[name]
            if rng.random() < 0.4 or want.ndim == 0:
                np.testing.assert_array_equal(f.get_tensor(name), want)
            else:
                lo = int(rng.integers(0, max(1, want.shape[0])))
                hi = int(rng.integers(lo, want.shape[0] + 1))
                np.testing.assert_array_equal(f.get_slice(name)[lo:hi], want[lo:hi])
                if want.ndim == 2 and want.shape[1] > 3:
                    # Strided columns: pread fetches each element run separately, so keep the
                    # row count small.
                    top = min(hi, lo + 8)
                    np.testing.assert_array_equal(
                        f.get_slice(name)[lo:top, 1::3], want[lo:top, 1::3]
                    )
            done += 1
        return done

    with safe_open(path, "np", backend=backend) as f, ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(work, range(8))) == 8 * 25


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_saves_in_several_threads(tmp_path: Path) -> None:
    """Four threads save different files at once; every file is complete and correct."""
    arrays = [np.full((1024, 4096), i, np.float32) for i in range(4)]  # 16 MiB each

    def work(i: int) -> None:
        save_file({"w": arrays[i], "i": np.array([i])}, tmp_path / f"f{i}.safetensors")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    for i in range(4):
        got = load_file(tmp_path / f"f{i}.safetensors")
        np.testing.assert_array_equal(got["w"], arrays[i])
        assert int(got["i"][0]) == i


def test_saves_to_the_same_target_in_several_threads(tmp_path: Path) -> None:
    """Racing saves of one target: the winner's complete file, and no temporary files left."""
    target = tmp_path / "same.safetensors"
    versions = {i: {"w": np.full((512, 1024), i, np.float32)} for i in range(6)}
    expected = {hashlib.sha256(save(v)).hexdigest() for v in versions.values()}
    barrier = threading.Barrier(6)

    def work(i: int) -> None:
        barrier.wait()
        save_file(versions[i], target)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(work, range(6)))
    assert _digest(target) in expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.safetensors"]


def test_a_large_save_releases_the_gil(tmp_path: Path) -> None:
    """A thread keeps running while another writes 256 MiB: the write does not hold the GIL."""
    arr = np.ones(64 << 20, np.float32)  # 256 MiB
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        save_file({"w": arr}, tmp_path / "big.safetensors")
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    during = [t for t in ticks if start <= t <= end]
    gaps = np.diff([start, *during, end])
    # With the GIL held through the write, the ticker would stall for the whole save.
    assert len(during) >= 5, (len(during), end - start)
    assert gaps.max() < max(0.05, 0.5 * (end - start)), (gaps.max(), end - start)


def test_metadata_edits_at_once_are_all_kept(tmp_path: Path) -> None:
    # Each edit reads the header, then writes it in place or rewrites the file. Two at once
    # read the same header, and the later write dropped the earlier's key; a rewrite also left
    # the other editor writing into the replaced file. Edits now take turns (a lock on the
    # file, taken again if the file was replaced meanwhile).
    from pysafetensors import edit_metadata

    path = tmp_path / "m.safetensors"
    save_file({"w": np.arange(1000, dtype=np.float32)}, str(path), metadata={"format": "pt"})

    def edits(worker: int) -> None:
        for j in range(20):
            # Rewrites (growing metadata, some with room to spare) and in-place edits mixed.
            edit_metadata(
                path, {f"k{worker}-{j}": "v" * (j % 3)}, reserve=64 * (j % 2), fsync=False
            )

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(edits, range(4)))
    with safe_open(path, "np") as f:
        meta = f.metadata()
        assert np.array_equal(f.get_tensor("w"), np.arange(1000, dtype=np.float32))
    assert {f"k{w}-{j}" for w in range(4) for j in range(20)} <= set(meta)


@pytest.mark.skipif(sys.platform == "win32", reason="edits take turns by flock")
def test_an_edit_waits_for_a_lock_at_most_lock_timeout(tmp_path: Path) -> None:
    """Any flock on the file holds an edit back (a backup tool's shared lock too): the edit
    waited for ever without a word; lock_timeout bounds the wait, and nothing is changed."""
    import fcntl
    import os

    from pysafetensors import edit_metadata
    from pysafetensors._metadata_edit import LockTimeoutError

    path = tmp_path / "m.safetensors"
    save_file({"w": np.arange(10, dtype=np.float32)}, str(path), metadata={"format": "pt"})
    before = path.read_bytes()
    for bad, error in ((-1, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match="lock_timeout"):
            edit_metadata(path, {"k": "v"}, lock_timeout=bad)  # type: ignore[arg-type]
    holder = os.open(path, os.O_RDONLY)  # another open file: its lock is another holder's
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)
        for timeout in (0, 0.3):
            start = time.monotonic()
            with pytest.raises(LockTimeoutError, match="another process holds a lock") as info:
                edit_metadata(path, {"k": "v"}, lock_timeout=timeout)
            assert isinstance(info.value, TimeoutError)
            assert timeout <= time.monotonic() - start < timeout + 5
            assert str(path) in str(info.value) and info.value.__context__ is None
        assert path.read_bytes() == before
        # The lock let go while the edit waits: the edit goes on.
        threading.Timer(0.3, fcntl.flock, (holder, fcntl.LOCK_UN)).start()
        assert edit_metadata(path, {"k": "v"}, lock_timeout=30, fsync=False) is False
    finally:
        os.close(holder)
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
