"""Plans and loads of checkpoints whose tensors repeat a few shapes (a mixture of experts).

``plan_shard``/``load_shard`` work out a part once per (split, shape) and how to read it once
per (shape, dtype, part), and copy the column parts of consecutive same-shaped small tensors
in one strided copy. These tests hold them to what a tensor-by-tensor plan and ``get_slice``
give, with the shapes interleaved, the errors naming the first tensor concerned, and inputs
that only look alike (numpy integers, bools) treated as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import safe_open
from pysafetensors.numpy import save_file
from pysafetensors.parallel import ShardSpec, load_shard, plan_shard, shard_range


def _expected_spec(
    name: str, shape: tuple[int, ...], dim: int | None, rank: int, world: int
) -> ShardSpec:
    if dim is None:
        return ShardSpec(name, shape, None, 0, shape[0] if shape else 0)
    dim %= len(shape)
    start, stop = shard_range(shape[dim], rank, world)
    return ShardSpec(name, shape, dim, start, stop)


def test_plan_of_shared_shape_objects_equals_tensor_by_tensor() -> None:
    rng = np.random.default_rng(1)
    pool = [(8, 16), (16, 8), (3, 5, 7), (10,), (0, 4)]
    shared = [tuple(s) for s in pool]  # one object per shape, as a parsed header has
    shapes: dict[str, Any] = {}
    for i in range(3000):
        k = int(rng.integers(len(pool)))
        # Shared objects, fresh equal tuples and lists, mixed.
        shapes[f"t{i}"] = (shared[k], tuple(pool[k]), list(pool[k]))[i % 3]

    def rule(name: str, shape: tuple[int, ...]) -> Any:
        # Per name, not per shape: tensors of one shape get different splits.
        split = ("rows", "columns", "replicate", -1)[int(name[1:]) % 4]
        return "rows" if split == "columns" and len(shape) < 2 else split

    for rank, world in ((0, 1), (1, 4), (7, 8)):
        plan = plan_shard(shapes, rank, world, rule)
        assert list(plan) == list(shapes)
        for name, spec in plan.items():
            shape = tuple(shapes[name])
            dim = {"rows": 0, "columns": 1, "replicate": None, -1: -1}[rule(name, shape)]
            assert spec == _expected_spec(name, shape, dim, rank, world), name


def test_lookalike_shapes_are_checked_each() -> None:
    """Numpy integers are converted, bools refused, whatever equal shape came before them."""
    base = (4, 6)
    plan = plan_shard({"a": base, "b": (np.int64(4), np.int64(6)), "c": base}, 1, 2, {"*": 1})
    assert all(type(d) is int for d in plan["b"].shape)
    assert plan["a"] == ShardSpec("a", (4, 6), 1, 3, 6)
    assert plan["b"] == ShardSpec("b", (4, 6), 1, 3, 6)
    one = (1, 6)
    with pytest.raises(TypeError, match="tensor 'b': a dimension"):
        plan_shard({"a": one, "b": (True, 6)}, 0, 2, {"*": 1})


def test_a_bad_split_of_a_shared_shape_names_the_first_tensor() -> None:
    shape = (8, 16)
    shapes = {"ok": (3,), "first": shape, "second": shape}
    with pytest.raises(ValueError, match="tensor 'first' of shape \\[8, 16\\] has no dimension 2"):
        plan_shard(shapes, 0, 2, {"ok": 0, "*": 2})
    with pytest.raises(ValueError, match="tensor 'first' of shape \\[8, 16\\], dim 1"):
        plan_shard(shapes, 0, 3, {"ok": 0, "*": 1}, uneven="error")


def _moe(path: Path) -> dict[str, np.ndarray]:
    """Runs of same-shaped small tensors, broken by other shapes, dtypes and a large tensor."""
    rng = np.random.default_rng(9)
    tensors: dict[str, np.ndarray] = {}
    layout = [((8, 16), np.uint16)] * 50 + [((6, 10), np.float32)] * 3 + [((8, 16), np.uint16)] * 40
    layout += (
        [((2, 3, 8), np.int8)] * 30 + [((300, 100), np.float32)] + [((8, 16), np.float32)] * 20
    )
    for i, (shape, dtype) in enumerate(layout):
        tensors[f"experts.{i:03d}.w"] = rng.integers(0, 100, shape).astype(dtype)
    save_file(tensors, path)
    return tensors


@pytest.mark.parametrize("split", ["rows", "columns", 1])
@pytest.mark.parametrize("backend", ["auto", "pread", "mmap"])
def test_load_shard_of_repeated_shapes_equals_get_slice(
    tmp_path: Path, split: Any, backend: str
) -> None:
    path = tmp_path / "moe.safetensors"
    tensors = _moe(path)
    for rank, world in ((0, 8), (3, 8), (2, 3)):
        plan = plan_shard({k: v.shape for k, v in tensors.items()}, rank, world, {"*": split})
        got = load_shard(path, rank, world, {"*": split}, framework="np", backend=backend)
        with safe_open(path, "np") as f:
            for name, spec in plan.items():
                want = f.get_slice(name)[spec.index]
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
                np.testing.assert_array_equal(got[name], want, err_msg=name)
                np.testing.assert_array_equal(got[name], tensors[name][spec.index])


def test_selections_copied_in_strided_groups_equal_one_by_one() -> None:
    """``copy_selections`` on random layouts: runs of one selection at constant strides (a
    group), broken by another selection, a stride change in the source or in the destination."""
    from pysafetensors._slice_gather import copy_selections, part_selection
    from pysafetensors._slicing import Part

    rng = np.random.default_rng(3)
    for _ in range(200):
        kinds = [((4, 6), 2, Part(1, 1, 4)), ((4, 6), 2, Part(1, 0, 3)), ((3, 5), 4, Part(1, 2, 5))]
        parts: list[Any] = []
        starts: list[int] = []
        offsets: list[int] = []
        src_at = dest_at = 0
        for i in range(int(rng.integers(1, 30))):
            shape, width, part = (
                kinds[int(rng.integers(len(kinds)))] if rng.random() < 0.3 else kinds[0]
            )
            selected = part_selection(shape, width, part)
            assert selected is not None
            info_nbytes = int(np.prod(shape)) * width

            class Info:
                nbytes = info_nbytes

            parts.append((f"t{i}", Info, *selected))
            src_at += int(rng.choice([0, 0, 0, 8]))
            dest_at += int(rng.choice([0, 0, 64]))
            starts.append(src_at)
            offsets.append(dest_at)
            src_at += info_nbytes
            dest_at += selected[1]
        scratch = rng.integers(0, 256, src_at, dtype=np.uint8)
        dest = np.zeros(dest_at, np.uint8)
        copy_selections(parts, scratch, starts, dest, offsets)
        want = np.zeros(dest_at, np.uint8)
        for (_, info, _, nbytes, src_shape, index, dest_shape), start, at in zip(
            parts, starts, offsets, strict=True
        ):
            whole = scratch[start : start + info.nbytes].reshape(src_shape)
            want[at : at + nbytes].reshape(dest_shape)[...] = whole[index]
        np.testing.assert_array_equal(dest, want)


def test_shapes_made_as_they_are_asked_for_are_each_planned() -> None:
    """A mapping whose shape tuples are made on access (and freed after): their ids can pass
    to the next one, which must not be taken for a shape already checked."""
    from collections.abc import Iterator, Mapping

    class Made(Mapping[str, Any]):
        def __init__(self, count: int) -> None:
            self.count = count

        def __getitem__(self, name: str) -> Any:
            i = int(name[1:])
            return (np.int64(i % 5 + 1), 4)  # made anew; numpy dims are converted

        def __iter__(self) -> Iterator[str]:
            return (f"t{i}" for i in range(self.count))

        def __len__(self) -> int:
            return self.count

    plan = plan_shard(Made(500), 0, 2, {"*": "rows"})
    for i in range(500):
        rows = i % 5 + 1
        assert plan[f"t{i}"] == ShardSpec(f"t{i}", (rows, 4), 0, *shard_range(rows, 0, 2))
