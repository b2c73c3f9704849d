"""Our splitter, index and shard files against huggingface_hub's, and hub loaders on our output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import SerializeError, safe_open, save_sharded
from pysafetensors._sharding import (
    _data_size,
    parse_size,
    split_into_shards,
    torch_storage_id,
    torch_storage_size,
)

from .conftest import assert_same_tree, random_state_dict, torch

hub = pytest.importorskip("huggingface_hub")
serialization = pytest.importorskip("huggingface_hub.serialization")
reference = pytest.importorskip("safetensors.torch")


def _split(sd: dict, limit: int | str) -> object:
    return split_into_shards(
        sd,
        get_storage_size=torch_storage_size,
        get_storage_id=torch_storage_id,
        max_shard_size=limit,
    )


@pytest.mark.parametrize(
    "text",
    [
        "5GB",
        "1.5GB",
        "500MB",
        "10kb",
        " 3 MB ",
        "0.1KB",
        "1.1GB",
        "2TB",
        "7",
        "5GiB",
        "500M",
        "xGB",
    ],
)
def test_parse_size_matches_hub(text: str) -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        expected = parse_size_to_int(text)
    except ValueError:
        with pytest.raises(ValueError):
            parse_size(text)
        return
    assert parse_size(text) == expected
    assert parse_size(1234) == 1234


def test_hub_docstring_example() -> None:
    # [6, 6, 2, 6, 2, 2] GB with a 10 GB limit -> [6] [6+2] [6+2+2].
    sizes = dict(zip("abcdef", [6, 6, 2, 6, 2, 2], strict=True))
    plan = split_into_shards(sizes, get_storage_size=lambda s: s * 10**9, max_shard_size="10GB")
    assert list(plan.filename_to_tensors.values()) == [["a"], ["b", "c"], ["d", "e", "f"]]
    assert plan.total_size == 24 * 10**9


@pytest.mark.parametrize("seed", range(25))
def test_split_matches_hub(seed: int) -> None:
    sd = random_state_dict(seed, n=int(np.random.default_rng(seed).integers(1, 40)))
    rng = np.random.default_rng(seed + 1000)
    # Tied weights (same storage), a view of a larger storage, and a bitsandbytes-style string.
    names = list(sd)
    if len(names) > 3:
        sd["tied"] = sd[names[1]]
        base = torch.zeros(300)
        sd["view"] = base[10:20]
        sd["view2"] = base[50:60]
        sd["bnb"] = "some-string"  # type: ignore[assignment]
    limit = int(rng.integers(1, 4000))
    ours = _split(sd, limit)
    theirs = serialization.split_torch_state_dict_into_shards(sd, max_shard_size=limit)
    assert ours.filename_to_tensors == theirs.filename_to_tensors
    assert list(ours.tensor_to_filename.items()) == list(theirs.tensor_to_filename.items())
    assert ours.metadata == theirs.metadata
    assert ours.is_sharded == theirs.is_sharded


def test_oversized_tensor_gets_own_shard_out_of_key_order() -> None:
    sd = {"a": torch.zeros(10), "big": torch.zeros(1000), "c": torch.zeros(10)}
    ours = _split(sd, 100)
    theirs = serialization.split_torch_state_dict_into_shards(sd, max_shard_size=100)
    assert ours.filename_to_tensors == theirs.filename_to_tensors
    assert ours.filename_to_tensors == {
        "model-00001-of-00002.safetensors": ["big"],
        "model-00002-of-00002.safetensors": ["a", "c"],
    }


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("limit", ["1KB", "3KB", "1GB"])
def test_save_sharded_byte_identical_to_hub(tmp_path: Path, seed: int, limit: str) -> None:
    sd = random_state_dict(seed, n=20)
    meta = {"producer": "test"} if seed % 2 else None
    hub_dir, our_dir = tmp_path / "hub", tmp_path / "ours"
    hub_dir.mkdir()
    serialization.save_torch_state_dict(sd, hub_dir, max_shard_size=limit, metadata=meta)
    plan = save_sharded(sd, our_dir, limit, metadata=meta)
    # A single file with user metadata has 2 metadata keys, which the reference orders randomly.
    assert_same_tree(hub_dir, our_dir, metadata_order=plan.is_sharded or meta is None)
    if plan.is_sharded:
        index = json.loads((our_dir / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == plan.total_size
        assert all(f.startswith("model-0") for f in plan.filename_to_tensors)
    else:
        assert os.listdir(our_dir) == ["model.safetensors"]
    for shard in plan.filename_to_tensors:
        with safe_open(str(our_dir / shard), "pt") as f:
            assert (f.metadata() or {})["format"] == "pt"


def test_numpy_input_matches_hub_on_same_values(tmp_path: Path) -> None:
    sd = random_state_dict(3, n=15)
    sd = {k: v for k, v in sd.items() if v.dtype != torch.bfloat16}
    as_numpy = {k: v.numpy() for k, v in sd.items()}
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    serialization.save_torch_state_dict(sd, hub_dir, max_shard_size="1KB")
    save_sharded(as_numpy, tmp_path / "np", "1KB")
    assert_same_tree(hub_dir, tmp_path / "np")


def test_numpy_arrays_are_sized_as_the_file_stores_them(tmp_path: Path) -> None:
    # The split sizes numpy's own dtypes by nbytes, without the adapter's conversion: every
    # byte order and layout must give the size the written file holds, and the packed
    # sub-byte floats (one code a byte in memory) their packed size.
    import ml_dtypes

    from pysafetensors.numpy import save_file

    base = np.arange(24).reshape(4, 6)
    arrays = {
        f"{np.dtype(t).str}_{layout}": (a if layout == "c" else a.T)
        for t in ("?", "i1", "u1", "<i2", ">u2", "<i4", ">i4", "<u8", "<f2", ">f4", "<f8", ">f8")
        for layout in ("c", "t")
        for a in [base.astype(t)]
    }
    arrays["bf16"] = base.astype(ml_dtypes.bfloat16)
    arrays["f4"] = base.astype(ml_dtypes.float4_e2m1fn)
    arrays["f6"] = base.astype(ml_dtypes.float6_e3m2fn)
    for name, array in arrays.items():
        save_file({name: array}, tmp_path / "one.safetensors")
        raw = (tmp_path / "one.safetensors").read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        begin, end = header[name]["data_offsets"]
        assert _data_size(name, array) == end - begin, name
    # A numpy float no file holds is still refused at sizing, naming its tensor.
    with pytest.raises(SerializeError, match="`wide`"):
        _data_size("wide", np.zeros(2, np.longdouble))


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_save_model_sharded_with_tied_weights_matches_hub(tmp_path: Path) -> None:
    from pysafetensors.torch import save_model_sharded

    torch.manual_seed(0)
    model = _Tied()
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    serialization.save_torch_model(model, hub_dir, max_shard_size="2KB", metadata={"a": "b"})
    plan = save_model_sharded(model, tmp_path / "ours", "2KB", metadata={"a": "b"})
    assert plan.is_sharded
    assert_same_tree(hub_dir, tmp_path / "ours")
    index = json.loads((hub_dir / "model.safetensors.index.json").read_text())
    assert index["metadata"]["head.weight"] == "embed.weight"

    # Discarding the other name of the tie, as transformers passes _tied_weights_keys.
    hub_dir2 = tmp_path / "hub2"
    hub_dir2.mkdir()
    serialization.save_torch_model(
        model, hub_dir2, max_shard_size="2KB", shared_tensors_to_discard=["embed.weight"]
    )
    save_model_sharded(model, tmp_path / "ours2", "2KB", shared_tensors_to_discard=["embed.weight"])
    assert_same_tree(hub_dir2, tmp_path / "ours2")


def test_a_model_of_partial_views_is_refused_in_the_hub_s_words(tmp_path: Path) -> None:
    # Parameters that are parts of one flat storage (as FSDP makes them): no name can stand
    # for the storage. The hub's text has a space after "storage."; the reference's
    # save_model (whose helper this shares) has none.
    from pysafetensors import SharedTensorsError
    from pysafetensors.torch import save_model_sharded

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.zeros(10)
            self.a = torch.nn.Parameter(flat[:5])
            self.b = torch.nn.Parameter(flat[5:])

    with pytest.raises(RuntimeError) as theirs:
        serialization.save_torch_model(Flat(), tmp_path)
    with pytest.raises(SharedTensorsError) as ours:
        save_model_sharded(Flat(), tmp_path / "ours")
    assert str(ours.value) == str(theirs.value)
    assert not (tmp_path / "ours").exists() or not os.listdir(tmp_path / "ours")


def test_hub_loaders_read_our_output(tmp_path: Path) -> None:
    from pysafetensors.torch import load_model, save_model_sharded

    torch.manual_seed(1)
    model = _Tied()
    save_model_sharded(model, tmp_path / "m", "2KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()

    # huggingface_hub's own loader (reference safetensors reading each shard + the index).
    fresh = _Tied()
    # strict=False: the hub's loader does not restore ties, so the dropped name is "missing".
    result = serialization.load_torch_model(fresh, tmp_path / "m", strict=False)
    assert result.missing_keys == ["head.weight"] and not result.unexpected_keys
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)

    # The hub's local metadata parser.
    info = hub.get_local_safetensors_metadata(tmp_path / "m")
    assert info.sharded
    assert set(info.weight_map) == set(model.state_dict()) - {"head.weight"}

    # The reference reading every shard, following the index.
    import safetensors

    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        with safetensors.safe_open(str(tmp_path / "m" / shard), "pt") as f:
            assert torch.equal(f.get_tensor(name), model.state_dict()[name])

    # And our load_model from the folder restores the tie.
    ours = _Tied()
    missing, unexpected = load_model(ours, tmp_path / "m")
    assert missing == set() and unexpected == []
    assert ours.head.weight.data_ptr() == ours.embed.weight.data_ptr()


def test_we_read_hub_output(tmp_path: Path) -> None:
    sd = random_state_dict(11, n=25)
    serialization.save_torch_state_dict(sd, tmp_path, max_shard_size="1KB", metadata={"k": "v"})
    from pysafetensors.torch import load_file

    loaded = load_file(tmp_path)
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v)
    with safe_open(tmp_path / "model.safetensors.index.json", "pt") as f:
        f.validate()
        assert f.metadata() == {"total_size": str(sum(v.nbytes for v in sd.values())), "k": "v"}


def test_stale_shards_removed_on_resave(tmp_path: Path) -> None:
    sd = random_state_dict(5, n=20)
    save_sharded(sd, tmp_path, "500KB")
    assert os.listdir(tmp_path) == ["model.safetensors"]
    save_sharded(sd, tmp_path, "1KB")
    assert "model.safetensors" not in os.listdir(tmp_path)
    (tmp_path / "model.safetensors.backup").write_bytes(b"keep me")
    save_sharded(sd, tmp_path, "2KB")
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors.backup" in files
    count = len(files) - 2
    assert all(f"-of-{count:05d}" in f for f in files if f.startswith("model-"))
    save_sharded(sd, tmp_path, "500KB")
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "model.safetensors.backup"]


def test_six_digit_shard_names_are_recognised(tmp_path: Path) -> None:
    """Past 99,999 shards the hub's ``{idx:05d}`` pattern writes six digits: such files left
    from an earlier save are cleaned up, and a folder of them without an index is refused as
    incomplete, like five-digit ones."""
    from pysafetensors import SafetensorError

    stale = tmp_path / "model-100000-of-100001.safetensors"
    stale.write_bytes(b"old")
    sd = random_state_dict(5, n=4)
    save_sharded(sd, tmp_path, "1KB")
    assert not stale.exists()
    assert (tmp_path / "model.safetensors.index.json").exists()

    lone = tmp_path / "lone"
    lone.mkdir()
    save_sharded(sd, lone, "500KB")
    (lone / "model.safetensors").rename(lone / "model-000001-of-100000.safetensors")
    with pytest.raises(SafetensorError, match="holds shards of a checkpoint .* but no index"):
        safe_open(lone, "np")


def test_index_files_are_strict_json_even_with_non_finite_metadata(tmp_path: Path) -> None:
    """The hub writes ``json.dumps(index, indent=2)``: an infinite or NaN metadata value comes
    out as ``Infinity``/``NaN``, which strict parsers refuse. Ours: ``1e400`` (read back by
    Python as the same infinity) and ``null``; finite indexes keep the hub's bytes."""
    from pysafetensors._sharding import index_text

    finite = {"metadata": {"total_size": 8, "x": 1.5}, "weight_map": {"a": "m.safetensors"}}
    assert index_text(finite) == json.dumps(finite, indent=2)
    tensors = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
    save_sharded(
        tensors,
        tmp_path,
        max_shard_size=8,
        metadata={"inf": float("inf"), "neg": [float("-inf")], "nan": float("nan")},
    )

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    text = (tmp_path / "model.safetensors.index.json").read_text()
    meta = json.loads(text, parse_constant=refuse)["metadata"]
    assert meta["inf"] == float("inf") and meta["neg"] == [float("-inf")] and meta["nan"] is None
