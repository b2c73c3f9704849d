"""Opening a sharded checkpoint as one file: round trips, laziness, folder rules, validation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import (
    ClosedFileError,
    MissingShardError,
    SafetensorError,
    ShardedSafeOpen,
    ShardIndexError,
    TensorNotFoundError,
    safe_open,
    save_sharded,
)
from pysafetensors._validate import locate_model, validate
from pysafetensors.numpy import load_file, save_file


def random_arrays(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float16, np.int64, np.uint8, np.float64]
    out = {}
    for i in range(n):
        shape = tuple(int(d) for d in rng.integers(0, 9, size=int(rng.integers(0, 4))))
        dt = dtypes[int(rng.integers(len(dtypes)))]
        out[f"block.{i}.w"] = np.asarray(rng.standard_normal(shape) * 50).astype(dt)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_round_trip_random_models(tmp_path: Path, seed: int) -> None:
    sd = random_arrays(seed, int(np.random.default_rng(seed).integers(1, 30)))
    limit = int(np.random.default_rng(seed + 7).integers(1, 2000))
    plan = save_sharded(sd, tmp_path, limit, metadata={"seed": str(seed)})
    for target in (tmp_path, tmp_path / "model.safetensors.index.json"):
        if not plan.is_sharded and str(target).endswith(".json"):
            continue
        loaded = load_file(target, backend="pread" if seed % 2 else "mmap")
        assert list(loaded) == list(safe_open(target, "np").offset_keys())
        assert set(loaded) == set(sd)
        for k, v in sd.items():
            np.testing.assert_array_equal(loaded[k], v)
            assert loaded[k].dtype == v.dtype
    with safe_open(tmp_path, "np") as f:
        assert f.keys() == sorted(sd)
        assert len(f) == len(sd)
        assert (f.metadata() or {})["seed"] == str(seed)
        f.validate()
        for k, v in sd.items():
            meta = f.get_tensor_meta(k)
            assert meta.shape == list(v.shape)
            if v.ndim and v.shape[0] > 1:
                np.testing.assert_array_equal(f.get_slice(k)[1:], v[1:])
        if plan.is_sharded:
            assert f.metadata() == {"total_size": str(plan.total_size), "seed": str(seed)}


def test_torch_load_file_and_load_model_from_folder(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors.torch import load_file as torch_load_file
    from pysafetensors.torch import load_model, save_model_sharded

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    save_model_sharded(model, tmp_path, "10KB")
    loaded = torch_load_file(tmp_path / "model.safetensors.index.json")
    assert set(loaded) == set(model.state_dict())
    fresh = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    assert load_model(fresh, tmp_path) == (set(), [])
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_load_model_leaves_out_index_entries_their_shards_do_not_hold(
    tmp_path: Path, backend: str
) -> None:
    # transformers loads such checkpoints from the hub (an entry left from an earlier save);
    # load_model does too, with a warning, and the model's own key that only the stale entry
    # offered is missing, as strict= decides.
    torch = pytest.importorskip("torch")
    from pysafetensors.torch import load_model
    from pysafetensors.torch import save_file as torch_save_file

    source = torch.nn.Linear(4, 3)
    torch_save_file({"weight": source.weight.detach()}, str(tmp_path / "s1.safetensors"))
    torch_save_file({"bias": source.bias.detach()}, str(tmp_path / "s2.safetensors"))
    _write_index(
        tmp_path,
        {"weight": "s1.safetensors", "bias": "s2.safetensors", "old.weight": "s1.safetensors"},
    )
    model = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) .*'old.weight' \(in 's1.safetensors'\)"):
        assert load_model(model, tmp_path, backend=backend) == (set(), [])
    assert torch.equal(model.weight, source.weight) and torch.equal(model.bias, source.bias)

    _write_index(tmp_path, {"weight": "s1.safetensors", "bias": "s1.safetensors"})
    fresh = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="'bias'"), pytest.raises(RuntimeError, match='"bias"'):
        load_model(fresh, tmp_path, backend=backend)
    with pytest.warns(UserWarning, match="'bias'"):
        assert load_model(fresh, tmp_path, strict=False, backend=backend) == ({"bias"}, [])
    assert torch.equal(fresh.weight, source.weight)


def test_load_model_names_the_first_five_stale_entries(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors.torch import load_model
    from pysafetensors.torch import save_file as torch_save_file

    torch_save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "s1.safetensors"))
    _write_index(
        tmp_path, {"weight": "s1.safetensors", **{f"g{i}": "s1.safetensors" for i in range(7)}}
    )
    with pytest.warns(UserWarning) as caught:
        load_model(torch.nn.Linear(2, 2, bias=False), tmp_path)
    message = str(caught[0].message)
    assert "7 tensor(s)" in message and "'g4'" in message and "'g5'" not in message
    assert message.endswith("and 2 more") and caught[0].filename == __file__


def test_context_manager_and_close(tmp_path: Path) -> None:
    sd = random_arrays(1, 10)
    save_sharded(sd, tmp_path, 100)
    with safe_open(tmp_path, "np") as f:
        assert isinstance(f, ShardedSafeOpen)
        name = f.keys()[0]
        kept = f.get_tensor(name)
        assert name in f and "nope" not in f
        with pytest.raises(TensorNotFoundError, match="nope"):
            f.get_tensor("nope")
        assert f.shard_of(name) in f.files()
    for call in (f.keys, f.metadata, f.get_tensors, lambda: f.get_tensor(name)):
        with pytest.raises(ClosedFileError):
            call()
    np.testing.assert_array_equal(kept, sd[name])


class _ReadLog:
    """Records every os.preadv: (path, offset, length)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int, int]] = []
        real = os.preadv

        def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            n = real(fd, buffers, offset, *args)
            self.reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
            return n

        monkeypatch.setattr(os, "preadv", preadv)

    def bytes_from(self, path: Path) -> int:
        real = os.path.realpath(path)
        return sum(n for p, _, n in self.reads if p == real)

    def clear(self) -> None:
        self.reads.clear()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to map fds to paths")
def test_opening_a_folder_reads_only_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tensors of 256 KiB: a header read (at most 64 KiB per shard) is far below one tensor.
    sd = {f"t{i}": np.full(65536, i, np.float32) for i in range(12)}
    plan = save_sharded(sd, tmp_path, "600KB")
    assert len(plan.filename_to_tensors) == 6
    shards = [tmp_path / f for f in plan.filename_to_tensors]
    log = _ReadLog(monkeypatch)

    f = safe_open(tmp_path, "np", backend="pread")
    assert f.keys() == sorted(sd)
    # Only the index was read to list names; no shard was touched.
    assert all(log.bytes_from(s) == 0 for s in shards)

    order = f.offset_keys()  # needs every header
    assert sorted(order) == sorted(sd)
    for s in shards:
        assert 0 < log.bytes_from(s) <= 64 * 1024
        assert all(off < 1024 for p, off, _ in log.reads if p == os.path.realpath(s))
    log.clear()

    value = f.get_tensor("t7")
    np.testing.assert_array_equal(value, sd["t7"])
    target = tmp_path / plan.tensor_to_filename["t7"]
    # Exactly that tensor's bytes, from its shard only.
    assert log.bytes_from(target) == sd["t7"].nbytes
    assert sum(n for _, _, n in log.reads) == sd["t7"].nbytes
    f.close()


def _write_shards(folder: Path, shards: dict[str, dict[str, np.ndarray]]) -> None:
    for name, tensors in shards.items():
        save_file(tensors, folder / name, metadata={"format": "pt"})


def _write_index(folder: Path, weight_map: dict[str, str], **meta: Any) -> Path:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": meta, "weight_map": weight_map}))
    return path


A = np.arange(4, dtype=np.float32)
B = np.arange(6, dtype=np.int64)


def test_missing_shard(tmp_path: Path) -> None:
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(MissingShardError, match="s2.safetensors") as info:
        safe_open(tmp_path, "np")
    assert info.value.tensor == "b"
    assert isinstance(info.value, FileNotFoundError)


def test_tensor_not_where_index_says(tmp_path: Path) -> None:
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}, "s2.safetensors": {"c": B}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"})
    with safe_open(tmp_path, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("a"), A)
        with pytest.raises(ShardIndexError, match="'b'") as info:
            f.get_tensor("b")
        assert info.value.kind == "TensorNotInShard"


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}, "s2.safetensors": {"a": B, "b": B}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with safe_open(tmp_path, "np") as f:
        with pytest.raises(ShardIndexError, match="two shards") as info:
            f.validate()
        assert info.value.kind == "TensorInTwoShards" and info.value.tensor == "a"
        # Reads take each tensor from the shard the index places it in.
        loaded = f.get_tensors()
        assert list(f.offset_keys()) == ["a", "b"] == list(loaded)
        np.testing.assert_array_equal(loaded["a"], A)
        np.testing.assert_array_equal(f.get_tensor("b"), B)


def test_unindexed_tensor(tmp_path: Path) -> None:
    # A tensor the index does not list is no part of the checkpoint read (the index is what
    # a loader reads by), and leaves the shard's other tensors readable; validate names it.
    _write_shards(tmp_path, {"s1.safetensors": {"a": A, "extra": B}})
    _write_index(tmp_path, {"a": "s1.safetensors"})
    with safe_open(tmp_path, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("a"), A)
        assert f.offset_keys() == ["a"] == list(f.get_tensors())
        with pytest.raises(TensorNotFoundError):
            f.get_tensor("extra")
        with pytest.raises(ShardIndexError, match="extra") as info:
            f.validate()
    assert info.value.kind == "UnindexedTensor"


def test_an_index_entry_left_from_another_save_fails_only_its_own_reads(tmp_path: Path) -> None:
    # As on the hub: an index still lists a tensor its shard no longer holds (a layer dropped
    # from a later save). Every other tensor of that shard reads; the lost one, and the reads
    # of the whole checkpoint, name it.
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}, "s2.safetensors": {"b": B}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors", "gone": "s2.safetensors"})
    with safe_open(tmp_path, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("b"), B)
        assert f.get_slice("b")[:2].tolist() == B[:2].tolist()
        assert f.get_tensor_meta("b").shape == list(B.shape)
        for read in (
            lambda: f.get_tensor("gone"),
            lambda: f.get_slice("gone"),
            lambda: f.read_into({"b": np.empty_like(B), "gone": bytearray(0)}),
            f.get_tensors,
            f.offset_keys,
            f.validate,
        ):
            with pytest.raises(ShardIndexError, match="'gone' in shard 's2.safetensors'") as info:
                read()
            assert info.value.kind == "TensorNotInShard" and info.value.tensor == "gone"


def test_stale_index_entries_can_be_dropped_from_the_handle(tmp_path: Path) -> None:
    # What load_model does with such an index: the entries whose shard does not hold them
    # are left out, and the handle then reads as if the index never listed them.
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}, "s2.safetensors": {"b": B}})
    _write_index(
        tmp_path,
        {
            "gone": "s1.safetensors",
            "a": "s1.safetensors",
            "b": "s2.safetensors",
            "lost": "s2.safetensors",
        },
    )
    with safe_open(tmp_path, "np") as f:
        assert f.drop_stale_entries() == {"gone": "s1.safetensors", "lost": "s2.safetensors"}
        assert f.drop_stale_entries() == {}
        assert f.keys() == ["a", "b"] == f.offset_keys() and len(f) == 2 and "gone" not in f
        assert f.weight_map() == {"a": "s1.safetensors", "b": "s2.safetensors"}
        loaded = f.get_tensors()
        assert list(loaded) == ["a", "b"]
        np.testing.assert_array_equal(loaded["b"], B)
        with pytest.raises(TensorNotFoundError):
            f.get_tensor("gone")
    with safe_open(tmp_path, "np") as f:  # a new handle sees the index as it is
        with pytest.raises(ShardIndexError, match="'gone'"):
            f.get_tensors()
        f.get_tensor("a")  # a shard opened before the drop is checked again by it
        assert list(f.drop_stale_entries()) == ["gone", "lost"]


def test_a_drop_meanwhile_is_not_undone_by_a_read_building_the_tensors_per_shard(
    tmp_path: Path,
) -> None:
    # A read that began to group the index's tensors by shard before the drop published its
    # grouping after it: the dropped names were back, and the shard's reads refused.
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}, "s2.safetensors": {"b": B}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors", "gone": "s2.safetensors"})
    with safe_open(tmp_path, "np") as f:
        dropped: list[dict[str, str]] = []
        started: list[bool] = []

        class DropsMidway(dict):  # type: ignore[type-arg]
            def items(self) -> Any:
                if not started:
                    started.append(True)
                    dropped.append(f.drop_stale_entries())  # another thread's, meanwhile
                return super().items()

        f._weight_map = DropsMidway(f._weight_map)
        f._by_shard = None
        f._placed("s2.safetensors")  # the read's grouping, begun over the old map
        assert dropped == [{"gone": "s2.safetensors"}]
        assert list(f.get_tensors()) == ["a", "b"]


def test_total_size_mismatch(tmp_path: Path) -> None:
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}, "s2.safetensors": {"b": B}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}, total_size=7)
    with safe_open(tmp_path, "np") as f:
        with pytest.raises(ShardIndexError, match="total_size") as info:
            f.validate()
        assert info.value.kind == "TotalSizeMismatch"
    # 1e400 reads as an infinite float: a mismatch, not an OverflowError.
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size": 7', '"total_size": 1e400'))
    assert "1e400" in index.read_text()
    with safe_open(tmp_path, "np") as f:
        with pytest.raises(ShardIndexError, match="total_size") as info:
            f.validate()
        assert info.value.kind == "TotalSizeMismatch"
    _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}, total_size=64)
    with safe_open(tmp_path, "np") as f:
        f.validate()
    # One rule with the command line's validate: an integer, or an integral float or digits;
    # a fraction (int() made 64.5 into 64) or other text is no total size.
    for total, ok in (
        (64.0, True),
        ("64", True),
        (64.5, False),
        ("64 bytes", False),
        (True, False),
        ("1" * 5000, False),  # int() refuses it with a ValueError, which escaped both
    ):
        text = index.read_text().replace('"total_size": 64', f'"total_size": {json.dumps(total)}')
        index.write_text(text)
        with safe_open(tmp_path, "np") as f:
            if ok:
                f.validate()
            else:
                with pytest.raises(ShardIndexError, match="total_size"):
                    f.validate()
        problems = validate(str(tmp_path), strict=True)
        codes = [p.code for p in problems if p.severity == "warning"]
        assert codes == ([] if ok else ["IndexTotalSize"]), (total, codes)
        _write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}, total_size=64)


@pytest.mark.parametrize(
    "bad",
    [
        "../x.safetensors",
        "/abs.safetensors",
        "C:evil.safetensors",
        "a\\..\\..\\x.safetensors",
        "model.bin",
        "",
    ],
)
def test_unsafe_shard_names(tmp_path: Path, bad: str) -> None:
    _write_index(tmp_path, {"a": bad})
    with pytest.raises(ShardIndexError) as info:
        safe_open(tmp_path, "np")
    assert info.value.kind == "UnsafeShardName"
    assert info.value.tensor == "a"
    assert f"names shard {bad!r} for tensor 'a', which is refused (" in str(info.value)
    # The command line's validate refuses the same names by the same rule.
    codes = [p.code for p in validate(str(tmp_path)) if p.severity == "error"]
    assert "UnsafeShardName" in codes


@pytest.mark.parametrize("entry", ["../x.safetensors", 7, None])
def test_a_refused_index_entry_is_its_only_problem(tmp_path: Path, entry: Any) -> None:
    """A tensor listed with a shard name the index cannot have was then counted as unlisted
    (its shard holds it) and left out of the total's bounds: two false errors beside the one
    about its name."""
    _write_shards(tmp_path, {"s1.safetensors": {"a": A, "b": B}})
    _write_index(tmp_path, {"a": "s1.safetensors", "b": entry}, total_size=64)
    problems = [p for p in validate(str(tmp_path)) if p.severity == "error"]
    assert [(p.code, p.tensor) for p in problems] == [
        ("UnsafeShardName" if isinstance(entry, str) else "IndexInvalid", "b")
    ]


def test_an_index_without_a_weight_map_is_its_only_problem(tmp_path: Path) -> None:
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 16}, "weight_map": []}))
    codes = [p.code for p in validate(str(tmp_path)) if p.severity == "error"]
    assert codes == ["IndexInvalid"]  # and no IndexTotalSize against no tensors


def test_an_index_over_the_size_limit_is_a_problem_of_the_model(tmp_path: Path) -> None:
    """It raised, which the command line reports as a failure to run (exit 2, no JSON)."""
    _write_shards(tmp_path, {"s1.safetensors": {"a": A}})
    _write_index(tmp_path, {"a": "s1.safetensors"}, note="x" * 200)
    model = locate_model(tmp_path, max_index_size=100)
    assert [(p.code, p.message) for p in model.problems] == [
        ("IndexInvalid", "index is over the limit of 100 bytes")
    ]


def test_shard_names_with_nul_are_refused_by_the_reader_too(tmp_path: Path) -> None:
    _write_index(tmp_path, {"a": "s\x00.safetensors"})
    with pytest.raises(ShardIndexError, match=r"refused \(NUL in name\)"):
        safe_open(tmp_path, "np")


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"metadata": {}}',
        '{"weight_map": {"a": 3}}',
        '{"weight_map": {}, "metadata": []}',
        '{"weight_map": {}, "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}",
    ],
)
def test_malformed_index(tmp_path: Path, text: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ShardIndexError) as info:
        safe_open(tmp_path / "model.safetensors.index.json", "np")
    assert info.value.kind == "InvalidIndex"


def test_folder_resolution(tmp_path: Path) -> None:
    with pytest.raises(MissingShardError, match="no safetensors checkpoint"):
        safe_open(tmp_path, "np")
    # A single file of any name.
    save_file({"a": A}, tmp_path / "weights.safetensors")
    with safe_open(tmp_path, "np") as f:
        assert f.keys() == ["a"] and f.metadata() is None
    # Two files and no index: ambiguous.
    save_file({"b": B}, tmp_path / "other.safetensors")
    with pytest.raises(ShardIndexError, match="other.safetensors") as info:
        safe_open(tmp_path, "np")
    assert info.value.kind == "AmbiguousFolder"
    # model.safetensors wins over other files.
    save_file({"m": B}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with safe_open(tmp_path, "np") as f:
        assert f.keys() == ["m"] and f.metadata() == {"format": "pt"}
    # The hub's index wins over everything.
    _write_index(tmp_path, {"a": "weights.safetensors", "b": "other.safetensors"})
    with safe_open(tmp_path, "np") as f:
        assert f.keys() == ["a", "b"]


def test_diffusers_style_index(tmp_path: Path) -> None:
    sd = random_arrays(4, 12)
    save_sharded(sd, tmp_path, 200, filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").exists()
    loaded = load_file(tmp_path)
    assert set(loaded) == set(sd)


def test_index_with_sorted_keys_and_extra_metadata(tmp_path: Path) -> None:
    # accelerate writes sort_keys=True; transformers v5 adds total_parameters.
    sd = random_arrays(9, 10)
    plan = save_sharded(sd, tmp_path, 150)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_parameters"] = 123
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    with safe_open(tmp_path, "np") as f:
        f.validate()
        assert f.metadata() == {"total_parameters": "123", "total_size": str(plan.total_size)}
        assert f.index_metadata() == {"total_parameters": 123, "total_size": plan.total_size}


def test_a_broken_shard_is_named_in_the_error(tmp_path: Path) -> None:
    from pysafetensors import OffsetError, save_sharded
    from pysafetensors.numpy import load_file as np_load_file

    save_sharded({f"w{i}": np.zeros(300, np.float32) for i in range(3)}, tmp_path, 1300)
    shard = tmp_path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])  # a truncated download
    with pytest.raises(OffsetError) as info:
        np_load_file(tmp_path)
    assert str(info.value).startswith(f"shard {str(shard)!r}: Error while deserializing header")
    assert info.value.kind == "MetadataIncompleteBuffer"


def test_a_checkpoint_saved_again_while_open_is_not_read_as_a_mix(tmp_path: Path) -> None:
    # Shards open as their tensors are first read: after a re-save with the same names and
    # layout (a trainer's periodic save), the handle read the new save's later shards beside
    # the old save's earlier ones, with no error.
    def state(gen: int) -> dict[str, np.ndarray]:
        return {f"layer.{i}.w": np.full(1000, gen, np.int32) for i in range(6)}

    save_sharded(state(1), tmp_path, max_shard_size="9KB")
    with safe_open(tmp_path, "np") as f:
        assert f.get_tensor("layer.0.w")[0] == 1
        save_sharded(state(2), tmp_path, max_shard_size="9KB")
        assert f.get_tensor("layer.1.w")[0] == 1  # a shard already open stays its version
        with pytest.raises(ShardIndexError, match="saved again") as info:
            f.get_tensor("layer.5.w")
        assert info.value.kind == "CheckpointChanged"
    with safe_open(tmp_path, "np") as f:
        assert {int(f.get_tensor(k)[0]) for k in f} == {2}


@pytest.mark.parametrize("resave", ["other shard count", "hub layout", "reshard in place"])
def test_a_save_that_removed_the_shard_about_to_be_opened_is_a_changed_checkpoint(
    tmp_path: Path, resave: str
) -> None:
    # A re-save with other shard names (another size limit, a reshard in place, the hub's
    # save, which removes the old files first) took the old shard away: the open failed with
    # a bare FileNotFoundError before the index was looked at, which `except
    # SafetensorError` did not catch.
    from pysafetensors import reshard

    def state(gen: int) -> dict[str, np.ndarray]:
        return {f"l{i}": np.full(1000, gen, np.float32) for i in range(4)}

    save_sharded(state(1), tmp_path, max_shard_size=8000)  # two shards
    with safe_open(tmp_path, "np") as f:
        assert f.get_tensor("l0")[0] == 1  # the first shard only
        if resave == "other shard count":
            save_sharded(state(2), tmp_path, max_shard_size=4000)
        elif resave == "reshard in place":
            reshard(tmp_path, tmp_path, max_shard_size=4000)
        else:
            for old in tmp_path.iterdir():
                old.unlink()  # what huggingface_hub's save does before it writes
            save_sharded(state(2), tmp_path, max_shard_size=4000)
        with pytest.raises(ShardIndexError, match="saved again") as info:
            f.get_tensor("l3")
        assert info.value.kind == "CheckpointChanged"


def test_a_shard_removed_while_the_index_stays_is_a_missing_shard(tmp_path: Path) -> None:
    save_sharded({f"l{i}": np.full(1000, i, np.float32) for i in range(4)}, tmp_path, 8000)
    with safe_open(tmp_path, "np") as f:
        f.get_tensor("l0")
        (tmp_path / "model-00002-of-00002.safetensors").unlink()
        with pytest.raises(MissingShardError, match="model-00002-of-00002") as info:
            f.get_tensor("l3")
        assert info.value.kind == "MissingShard"
        assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("odd", ["directory", "fifo"])
def test_a_shard_that_is_not_a_file_is_called_so(tmp_path: Path, odd: str) -> None:
    save_sharded({f"l{i}": np.full(1000, i, np.float32) for i in range(4)}, tmp_path, 8000)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.unlink()
    if odd == "directory":
        shard.mkdir()
    else:
        os.mkfifo(shard)
    with pytest.raises(MissingShardError, match="is not a regular file") as info:
        safe_open(tmp_path, "np")
    assert "does not exist" not in str(info.value)
    assert info.value.kind == "MissingShard"


def test_one_shard_under_two_spellings_is_one_shard(tmp_path: Path) -> None:
    # "x" and "./x" name one file (transformers and the hub load it); the tensors were
    # refused as being in two shards.
    save_file({"a": A, "b": B}, tmp_path / "x.safetensors")
    _write_index(tmp_path, {"a": "x.safetensors", "b": "./x.safetensors"})
    loaded = load_file(tmp_path)
    assert sorted(loaded) == ["a", "b"]
    with safe_open(tmp_path, "np") as f:
        assert f.files() == [str(tmp_path / "x.safetensors")]


def _three_shards(folder: Path) -> None:
    _write_shards(folder, {f"s{i}.safetensors": {f"t{i}": A + i} for i in range(3)})
    _write_index(folder, {f"t{i}": f"s{i}.safetensors" for i in range(3)}, total_size=48)


def test_a_shard_rewritten_in_place_before_its_first_read_is_a_changed_checkpoint(
    tmp_path: Path,
) -> None:
    """transformers and accelerate write shards under their names and the index last: the
    index unchanged, a handle read one tensor of the old save and the next of the new."""
    _three_shards(tmp_path)
    with safe_open(tmp_path, "np") as f:
        assert f.get_tensor("t0").tolist() == A.tolist()
        save_file({"t1": A + 100}, tmp_path / "s1.safetensors", metadata={"format": "pt"})
        with pytest.raises(ShardIndexError, match="changed since the checkpoint was opened") as e:
            f.get_tensor("t1")
        assert e.value.kind == "CheckpointChanged"


def test_validate_after_a_save_over_the_shards_is_a_changed_checkpoint(tmp_path: Path) -> None:
    # It compared the new shards' bytes with the old index: a wrong total_size.
    _three_shards(tmp_path)
    with safe_open(tmp_path, "np") as f:
        f.get_tensor("t0")
        save_file({"t2": np.arange(9, dtype=np.float32)}, tmp_path / "s2.safetensors")
        with pytest.raises(ShardIndexError) as e:
            f.validate()
        assert e.value.kind == "CheckpointChanged"


def test_a_relative_path_is_the_folder_it_named_when_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards open as first read: relative to the working folder of that moment, the index
    looked up there read as saved again (and validate() read another folder's shards)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "elsewhere").mkdir()
    _three_shards(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    for target in ("ckpt", "ckpt/model.safetensors.index.json"):
        with safe_open(target, "np") as f:
            monkeypatch.chdir(tmp_path / "elsewhere")
            assert f.get_tensor("t2").tolist() == (A + 2).tolist()
            f.validate()
            monkeypatch.chdir(tmp_path)


def test_a_chmod_of_the_index_is_no_new_save(tmp_path: Path) -> None:
    save_sharded({f"t{i}": np.full(16, i, np.float32) for i in range(4)}, tmp_path, 64)
    with safe_open(tmp_path, "np") as f:
        assert len(f.get_tensors()) == 4  # shards read, then closed
        os.chmod(tmp_path / "model.safetensors.index.json", 0o600)
        assert f.get_tensor("t3")[0] == 3  # reopened: the same save


def test_a_safetensors_file_named_like_an_index_opens_as_a_file(tmp_path: Path) -> None:
    """The reference opens any path as a file; only a real index (JSON) is one here."""
    odd = tmp_path / "weights.index.json"
    save_file({"x": np.arange(3, dtype=np.float32)}, odd)
    with safe_open(odd, "np") as f:
        assert not isinstance(f, ShardedSafeOpen)
        assert f.get_tensor("x").tolist() == [0.0, 1.0, 2.0]
    assert load_file(odd)["x"].tolist() == [0.0, 1.0, 2.0]
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_sharded({"y": np.ones(2, np.float32), "z": np.ones(2, np.float32)}, folder, 8)
    (index,) = folder.glob("*.index.json")
    with safe_open(index, "np") as f:
        assert isinstance(f, ShardedSafeOpen) and f.keys() == ["y", "z"]


@pytest.mark.parametrize(
    ("option", "kind"),
    [
        ({"threads": 0}, "InvalidThreads"),
        ({"threads": True}, "InvalidThreads"),
        ({"slice_reads": "bogus"}, "InvalidSliceReads"),
    ],
)
def test_a_checkpoints_reader_options_are_checked_at_open(
    tmp_path: Path, option: dict[str, Any], kind: str
) -> None:
    """A folder opened with them, and its keys() listed; the first tensor read failed."""
    save_sharded({"a": np.ones(4), "b": np.zeros(4)}, tmp_path, max_shard_size=40)
    with pytest.raises(SafetensorError) as info:
        safe_open(tmp_path, "np", **option)
    assert info.value.kind == kind
