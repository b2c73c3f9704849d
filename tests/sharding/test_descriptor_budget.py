"""A checkpoint of more shards than the process may hold descriptors for.

Each open shard holds one or two descriptors. With a hard limit of 128 (common limits are
1,024 and 4,096, against checkpoints of thousands of shards), every way of reading a 300-shard
folder (the handle, ``load_shard``, the command line) must work: shards not in use are closed
past a budget and opened again when read, and one opened again must be the file first read.
The limits are set in child processes, so the test run keeps its own.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import SafetensorError
from pysafetensors._file_pool import FilePool, PooledFile
from pysafetensors._sharding import save_sharded
from pysafetensors._sources import PreadSource, open_regular_file
from pysafetensors.numpy import load_file, save_file

SHARDS = 300
LIMIT = 128  # descriptors, soft and hard, in the child processes


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"layer.{i}.w": rng.standard_normal((8, 4)).astype(np.float32) for i in range(SHARDS)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("many") / "model"
    save_sharded(_tensors(), out, max_shard_size=128, format="np")
    assert len(list(out.glob("*.safetensors"))) == SHARDS
    return out


# Sets the limit, then becomes the command: rlimits survive exec (a preexec_fn would make
# subprocess fork a process that has JAX's threads, which warns).
_LIMIT_THEN_EXEC = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


def _run(
    args: list[str], *, limited: bool = False, limit: int = LIMIT
) -> subprocess.CompletedProcess[str]:
    if limited:
        args = [sys.executable, "-c", _LIMIT_THEN_EXEC, str(limit), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, check=False)


def _child(code: str, limited: bool = True, limit: int = LIMIT) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-c", textwrap.dedent(code)], limited=limited, limit=limit)


def test_handle_reads_every_shard_under_a_low_limit(folder: Path) -> None:
    proc = _child(
        f"""
        import random, threading
        import numpy as np
        from pysafetensors import safe_open, parallel
        from pysafetensors.numpy import load_file
        path = {str(folder)!r}
        rng = np.random.default_rng(7)
        ref = {{f"layer.{{i}}.w": rng.standard_normal((8, 4)).astype(np.float32)
                for i in range({SHARDS})}}
        for backend in ("mmap", "pread"):
            with safe_open(path, "np", backend=backend) as f:
                for name in f.keys():  # every shard opened in turn
                    assert (f.get_tensor(name) == ref[name]).all(), name
                # Slices keep their shard open; the budget closes the others round them.
                held = [(name, f.get_slice(name)) for name in list(f.keys())[:20]]
                for name in f.keys():
                    assert f.get_tensor_meta(name).shape == [8, 4]
                for name, piece in held:
                    assert (piece[2:5] == ref[name][2:5]).all(), name
                assert len(f.offset_keys()) == {SHARDS}
                assert len(f.shard_metadata()) == {SHARDS}
                f.validate()
                got = f.get_tensors()
                assert all((got[k] == ref[k]).all() for k in ref)
                errors = []
                names = list(f.keys())
                def reader(seed):
                    pick = random.Random(seed)
                    try:
                        for _ in range(1500):
                            name = pick.choice(names)
                            assert (f.get_tensor(name) == ref[name]).all(), name
                    except BaseException as exc:
                        errors.append(exc)
                threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert not errors, errors[0]
        for backend in ("auto", "pread", "mmap"):
            rows = parallel.load_shard(path, 1, 2, {{"layer.*": "rows"}}, "np", backend=backend)
            assert all((rows[k] == ref[k][4:]).all() for k in ref)
            cols = parallel.load_shard(path, 0, 2, {{"layer.*": "columns"}}, "np", backend=backend)
            assert all((cols[k] == ref[k][:, :2]).all() for k in ref)
        loaded = load_file(path)
        assert all((loaded[k] == ref[k]).all() for k in ref)
        print("all read")
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "all read"


def test_validate_under_a_very_low_limit_closes_idle_shards(folder: Path) -> None:
    """validate() opened every shard's header outside the budget: at 16 descriptors it ran
    out where every other read of the handle went on."""
    code = f"""
        from pysafetensors import safe_open
        with safe_open({str(folder)!r}, "np", backend="pread") as f:
            f.get_tensor(f.keys()[0])
            f.validate()
        print("valid")
        """
    proc = _child(code, limit=16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "valid"


def test_handles_of_one_process_share_the_budget(folder: Path) -> None:
    """Each handle counted the whole limit for itself: a second one grew until the process
    ran out, and nothing was left for the rest of it (the 128 descriptors kept for it)."""
    code = f"""
        from pysafetensors import safe_open
        handles = [safe_open({str(folder)!r}, "np", backend="pread") for _ in range(3)]
        for f in handles:
            for name in f.keys():
                f.get_tensor(name)
        spare = [open("/dev/null") for _ in range(50)]  # of the 128 kept, less 2 handles at 8
        print("opened", len(spare))
        """
    proc = _child(code, limit=512)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "opened 50"


def test_shard_replaced_while_closed_for_the_budget_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    code = f"""
        import os, shutil
        from pysafetensors import safe_open, SafetensorError
        path = {str(model)!r}
        with safe_open(path, "np") as f:
            names = f.keys()
            first = f.shard_of(names[0])
            before = f.get_tensor(names[0])
            # The same bytes under a new inode, the index untouched: another version of the
            # file as far as anything can tell.
            shutil.copyfile(first, first + ".new")
            os.replace(first + ".new", first)
            for name in names[1:]:
                f.get_tensor(name)
            try:
                again = f.get_tensor(names[0])
            except SafetensorError as exc:
                said = "changed since the checkpoint was opened" in str(exc)
                print(type(exc).__name__, exc.kind, said)
            else:
                print("read", (again == before).all())
        """
    limited = _child(code)
    assert limited.returncode == 0, limited.stderr[-3000:]
    assert limited.stdout.split() == ["ShardIndexError", "CheckpointChanged", "True"]
    # Without a limit the shard stays open, and its first version is read again.
    shutil.rmtree(model)
    shutil.copytree(folder, model)
    unlimited = _child(code, limited=False)
    assert unlimited.returncode == 0, unlimited.stderr[-3000:]
    assert unlimited.stdout.split() == ["read", "True"]


@pytest.mark.parametrize("command", ["inspect", "hash", "stats", "validate"])
def test_cli_reads_every_shard_under_a_low_limit(folder: Path, command: str) -> None:
    args = [sys.executable, "-m", "pysafetensors", command, str(folder)]
    limited = _run(args, limited=True)
    free = _run(args)
    assert free.returncode == 0, free.stderr
    assert limited.returncode == 0, limited.stderr[-3000:]
    assert limited.stdout == free.stdout


def test_cli_rewrites_every_shard_under_a_low_limit(folder: Path, tmp_path: Path) -> None:
    ref = _tensors()
    cli = [sys.executable, "-m", "pysafetensors", "-q"]
    merged, resharded, extracted = tmp_path / "one.safetensors", tmp_path / "re", tmp_path / "x"
    for args in (
        ["merge", str(folder), str(merged)],
        ["reshard", str(folder), str(resharded), "--max-shard-size", "256"],
        ["extract", str(folder), str(extracted), "layer.1*"],
        ["diff", str(folder), str(resharded)],
    ):
        proc = _run(cli + args, limited=True)
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
    assert len(list(resharded.glob("*.safetensors"))) == SHARDS // 2
    for path in (merged, resharded):
        got = load_file(path)
        assert got.keys() == ref.keys()
        assert all((got[k] == ref[k]).all() for k in ref)
    got = load_file(extracted)
    assert sorted(got) == sorted(k for k in ref if k.startswith("layer.1"))


def _pooled_files(
    tmp_path: Path, arrays: dict[int, np.ndarray], pool: FilePool
) -> tuple[list[Path], list[PooledFile], int]:
    """Each array saved as tensor ``"a"`` of a file of its own, the files adopted by ``pool``;
    and where ``"a"``'s bytes start (the same in every file)."""
    paths = []
    for i, arr in arrays.items():
        paths.append(tmp_path / f"{i}.safetensors")
        save_file({"a": arr}, paths[-1])
    files = [pool.adopt(str(p), PreadSource(open_regular_file(str(p)), str(p))) for p in paths]
    return paths, files, 8 + int.from_bytes(paths[0].read_bytes()[:8], "little")


def test_pool_reopens_closed_files_and_refuses_replaced_ones(tmp_path: Path) -> None:
    arrays = {i: np.arange(16, dtype=np.uint8) + i for i in range(5)}
    paths, files, start = _pooled_files(tmp_path, arrays, FilePool(capacity=2))
    for _ in range(2):  # every file read more than once, two open at a time
        for i, pooled in enumerate(files):
            buf = bytearray(16)
            pooled.readinto(start, memoryview(buf))
            assert bytes(buf) == arrays[i].tobytes()
            open_now = sum(p._source is not None for p in files)
            assert open_now <= 2
    # File 0 was closed for the budget: replaced meanwhile, it is refused, not read.
    shutil.copyfile(paths[0], tmp_path / "copy")
    os.replace(tmp_path / "copy", paths[0])
    with pytest.raises(SafetensorError, match="changed since its header was read") as info:
        files[0].readinto(start, memoryview(bytearray(16)))
    assert info.value.kind == "FileChanged"
    files[1].close()
    with pytest.raises(SafetensorError, match="File is closed"):
        files[1].readinto(start, memoryview(bytearray(16)))


def test_pool_out_of_descriptors_gives_up_its_idle_files(tmp_path: Path) -> None:
    """The process's other files take every descriptor: reopening a pooled file closes the
    pool's idle ones and goes on. With 8 or fewer open, halving the pool freed nothing (its
    floor is 8), and the retry failed while the pool held 8 idle descriptors."""
    arrays = {i: np.arange(16, dtype=np.uint8) + i for i in range(20)}
    paths, _, start = _pooled_files(tmp_path, arrays, FilePool(capacity=1))
    proc = _child(
        f"""
        import os
        from pysafetensors._file_pool import FilePool
        from pysafetensors._sources import PreadSource, open_regular_file
        paths = {[str(p) for p in paths]!r}
        pool = FilePool()
        files = [pool.adopt(p, PreadSource(open_regular_file(p), p)) for p in paths]
        assert len(pool._open) == 8, len(pool._open)  # the budget under this low limit
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for i, pooled in enumerate(files):  # closed ones among them: reopened
            buf = bytearray(16)
            pooled.readinto({start}, memoryview(buf))
            assert buf == bytes(range(i, i + 16)), i
        for fd in hog:
            os.close(fd)
        print("read", len(files))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["read", "20"]


def test_pool_out_of_descriptors_with_none_idle_says_so(tmp_path: Path) -> None:
    arrays = {i: np.arange(16, dtype=np.uint8) for i in range(2)}
    paths, _, _ = _pooled_files(tmp_path, arrays, FilePool(capacity=1))
    proc = _child(
        f"""
        import os
        from pysafetensors._file_pool import FilePool
        from pysafetensors._sources import PreadSource, open_regular_file
        paths = {[str(p) for p in paths]!r}
        pool = FilePool(capacity=1)
        files = [pool.adopt(p, PreadSource(open_regular_file(p), p)) for p in paths]
        assert files[0]._source is None  # closed for the capacity of 1
        files[1]._reading += 1  # being read: nothing idle is left to give up
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            files[0].readinto(0, memoryview(bytearray(4)))
        except OSError as exc:
            print(exc.errno, exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    code, message = proc.stdout.split(" ", 1)
    assert int(code) == errno.EMFILE
    assert "out of file descriptors reopening" in message and "ulimit -n" in message


def test_pool_is_shared_by_threads(tmp_path: Path) -> None:
    """Threads reading files of one pool: none meets a file closed under its read, and the
    bytes are each file's."""
    arrays = {i: (np.arange(4096, dtype=np.uint32) * (i + 1)).astype(np.uint32) for i in range(8)}
    _, files, start = _pooled_files(tmp_path, arrays, FilePool(capacity=2))
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        pick = np.random.default_rng(seed)
        try:
            for _ in range(400):
                i = int(pick.integers(len(files)))
                buf = bytearray(arrays[i].nbytes)
                files[i].readinto(start, memoryview(buf))
                assert bytes(buf) == arrays[i].tobytes(), i
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert sum(p._source is not None for p in files) <= 2


def test_maps_keep_no_descriptor(folder: Path, tmp_path: Path) -> None:
    """Loaded tensors view maps of their files (torch's, and numpy's of 1 MiB and more), which
    keep no descriptor of them: Python's ``mmap`` kept one a map until the tensors went, so
    tensors kept from 300 shards held 300 descriptors (the reference's maps hold none)."""
    large = tmp_path / "large"
    rng = np.random.default_rng(5)
    save_sharded(
        {f"w{i}": rng.standard_normal((300, 1024)).astype(np.float32) for i in range(6)},
        large,
        max_shard_size=2_000_000,
        format="np",
    )
    proc = _child(
        f"""
        import os
        from pysafetensors import safe_open
        from pysafetensors.numpy import load_file
        before = len(os.listdir("/proc/self/fd"))
        with safe_open({str(folder)!r}, "pt") as f:
            kept = [f.get_tensor(name) for name in f.keys()]
        arrays = load_file({str(large)!r})
        held = len(os.listdir("/proc/self/fd")) - before
        print(held, len(kept), sum(a.base is not None for a in arrays.values()))
        """,
        limited=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    held, kept, mapped = map(int, proc.stdout.split())
    assert kept == SHARDS and mapped == 6  # numpy's arrays are views of maps too
    assert held == 0
