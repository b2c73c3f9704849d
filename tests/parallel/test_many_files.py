"""map_files, validate_files and hash_files with thread and process pools; sharded folders."""

from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import pysafetensors.numpy as pnp
from pysafetensors.parallel import hash_files, load_shard, map_files, validate_files


def _files(folder: Path, n: int = 4) -> list[Path]:
    paths = []
    for i in range(n):
        path = folder / f"f{i}.safetensors"
        pnp.save_file({"w": np.full((8, 8), i, np.float32), "b": np.arange(i + 1)}, path)
        paths.append(path)
    return paths


def _tensor_count(path: Path) -> int:
    # Module level: a process pool must be able to pickle it.
    return len(pnp.load_file(path))


def _fails_on_two(path: Path) -> str:
    if path.name == "f2.safetensors":
        raise RuntimeError("boom")
    return path.name


@pytest.fixture(params=["serial", "threads", "processes"])
def executor(request: pytest.FixtureRequest) -> Iterator[Executor | None]:
    if request.param == "serial":
        yield None
        return
    # spawn, not fork: earlier tests leave jax/TensorFlow threads that a fork would inherit.
    spawn = multiprocessing.get_context("spawn")
    pool: Executor = (
        ThreadPoolExecutor(2)
        if request.param == "threads"
        else ProcessPoolExecutor(2, mp_context=spawn)
    )
    with pool:
        yield pool


def test_map_files_keeps_input_order(tmp_path: Path, executor: Executor | None) -> None:
    paths = _files(tmp_path)
    assert map_files(_tensor_count, reversed(paths), executor) == [2, 2, 2, 2]
    assert map_files(str, paths, executor) == [str(p) for p in paths]


def test_map_files_reraises_with_the_item(tmp_path: Path, executor: Executor | None) -> None:
    paths = _files(tmp_path)
    with pytest.raises(RuntimeError, match="boom") as info:
        map_files(_fails_on_two, paths, executor)
    notes = getattr(info.value, "__notes__", [])
    assert any("f2.safetensors" in note for note in notes)


def test_validate_files(tmp_path: Path, executor: Executor | None) -> None:
    paths = _files(tmp_path)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(paths[0].read_bytes()[:-3])
    missing = tmp_path / "missing.safetensors"
    found = validate_files([*paths, broken, missing], executor)
    assert list(found) == [str(p) for p in [*paths, broken, missing]]
    assert all(found[str(p)] == [] for p in paths)
    assert found[str(broken)] and found[str(broken)][0].severity == "error"
    assert [p.code for p in found[str(missing)]] == ["FileNotReadable"]


def test_hash_files(tmp_path: Path, executor: Executor | None) -> None:
    paths = _files(tmp_path)
    digests = hash_files(paths, executor)
    assert digests == {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    assert hash_files(paths[:1], executor, algorithm="md5")[str(paths[0])] == (
        hashlib.md5(paths[0].read_bytes()).hexdigest()
    )


@pytest.mark.skipif(
    importlib.util.find_spec("pysafetensors._sharded") is None
    or importlib.util.find_spec("pysafetensors._sharding") is None,
    reason="sharded folders are not available in this checkout",
)
def test_load_shard_from_a_sharded_folder(tmp_path: Path) -> None:
    from pysafetensors._sharding import save_sharded

    rng = np.random.default_rng(0)
    tensors = {f"l{i}.weight": rng.standard_normal((16, 6)).astype(np.float32) for i in range(4)}
    tensors["norm"] = np.arange(6, dtype=np.float32)
    save_sharded(tensors, tmp_path / "model", max_shard_size=1000, format="np")
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 1
    parts = [
        load_shard(tmp_path / "model", r, 3, {"*.weight": "columns"}, framework="np")
        for r in range(3)
    ]
    for name, full in tensors.items():
        if name == "norm":
            assert all(np.array_equal(p[name], full) for p in parts)
        else:
            assert np.array_equal(np.concatenate([p[name] for p in parts], axis=1), full)


def test_validate_files_reports_unopenable_targets_instead_of_stopping(tmp_path: Path) -> None:
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import hash_files, validate_files

    ambiguous = tmp_path / "two"
    ambiguous.mkdir()
    save_file({"a": np.ones(2)}, ambiguous / "x.safetensors")
    save_file({"a": np.ones(2)}, ambiguous / "y.safetensors")
    good = tmp_path / "ok.safetensors"
    save_file({"a": np.ones(2)}, good)
    found = validate_files([ambiguous, "bad\0path", good])
    assert found[str(good)] == []
    assert [p.code for p in found[str(ambiguous)]] == ["AmbiguousFolder"]
    assert [p.code for p in found["bad\0path"]] == ["FileNotReadable"]
    with pytest.raises(ValueError, match="no fixed digest size"):
        hash_files([good], algorithm="shake_128")
