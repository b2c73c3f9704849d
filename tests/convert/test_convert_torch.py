"""Checkpoints written by the real ``torch.save`` convert to files equal to ``torch.load``'s."""

from __future__ import annotations

import argparse
import errno
import json
import re
import subprocess
import sys
import textwrap
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

from pysafetensors import CheckpointError  # noqa: E402
from pysafetensors._torch_pickle import load_checkpoint  # noqa: E402
from pysafetensors.convert import (  # noqa: E402
    convert_file,
    convert_folder,
    to_torch_bin,
    verify_conversion,
)

from .corpus import big_endian_copy  # noqa: E402


def _bytes(t: Any) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy().tobytes())


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _all_dtypes() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    sd: dict[str, Any] = {
        "f32": base,
        "f64": base.double(),
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.arange(-7, 8).reshape(3, 5),
        "i32": torch.arange(15, dtype=torch.int32),
        "i16": torch.arange(-3, 3, dtype=torch.int16),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.complex(base, -base),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    return sd


def _new_dtypes() -> dict[str, Any]:
    """dtypes without a legacy storage class (saved with ``_rebuild_tensor_v3``)."""
    base = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    sd: dict[str, Any] = {
        "u16": torch.tensor([0, 1, 65535], dtype=torch.int32).to(torch.uint16),
        "u32": torch.tensor([0, 7, 2**32 - 1], dtype=torch.int64).to(torch.uint32),
        "u64": torch.tensor([0, 9, 2**40], dtype=torch.int64).to(torch.uint64),
        "f8e4m3": base.to(torch.float8_e4m3fn),
        "f8e5m2": base.to(torch.float8_e5m2),
    }
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if hasattr(torch, name):
            sd[name] = base.abs().to(getattr(torch, name))
    if hasattr(torch, "float4_e2m1fn_x2"):
        sd["f4"] = torch.arange(8, dtype=torch.uint8).reshape(2, 4).view(torch.float4_e2m1fn_x2)
    return sd


def _views(sd: dict[str, Any]) -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd["w"] = w
    sd["w_tied"] = w  # same tensor twice: dropped
    sd["w_t"] = w.t()  # another view of the same storage: copied (the reference drops it)
    sd["w_row"] = w[2]  # a row: copied
    other = torch.arange(30, dtype=torch.float32)
    sd["slice_offset"] = other[7:19].reshape(3, 4)  # offset view, storage not covered: kept
    sd["strided"] = torch.arange(40, dtype=torch.int64).reshape(5, 8)[::2, 1::3]
    sd["expanded"] = torch.arange(3, dtype=torch.float32).expand(4, 3)  # stride 0
    sd["conj"] = torch.complex(torch.ones(2), torch.ones(2)).conj()
    sd["neg"] = torch.ones(3)._neg_view()


def _check(src: Path, dst: Path, expected: dict[str, Any]) -> dict[str, str]:
    with safe_open(str(dst), "pt") as f:
        meta = f.metadata()
        names = set(f.keys())
    assert meta["format"] == "pt"
    loaded = st_torch.load_file(str(dst))
    for name, ref in expected.items():
        # A dropped name must come back as its kept tensor, with its own values.
        got = loaded[meta[name]] if name in meta and name not in names else loaded[name]
        assert _bytes(got) == _bytes(ref), name
        if ref.dtype != getattr(torch, "float4_e2m1fn_x2", None):
            assert got.dtype == ref.dtype, name
            assert tuple(got.shape) == tuple(ref.shape), name
    assert names <= set(expected)
    return meta


@pytest.mark.parametrize(
    "layout",
    ["zip-p2", "zip-p4", "legacy-p2", "legacy-p4"],
)
def test_real_torch_save(layout: str, tmp_path: Path) -> None:
    sd = _all_dtypes()
    _views(sd)
    if layout.startswith("zip"):
        sd.update(_new_dtypes())
    proto = int(layout[-1])
    src = tmp_path / "model.pt"
    torch.save(
        sd,
        src,
        pickle_protocol=proto,
        _use_new_zipfile_serialization=layout.startswith("zip"),
    )
    # torch's weights_only unpickler refuses protocol 4 ("Unsupported operand"); this file is
    # our own, so the full unpickler is fine as the reference there.
    ref = torch.load(src, weights_only=proto == 2)
    dst = tmp_path / "model.safetensors"
    report = convert_file(src, dst, verify=True)
    assert report.verified == ("torch" if proto == 2 else "reader")
    assert report.dropped == {"w_tied": "w"}
    meta = _check(src, dst, _flat(ref))
    assert meta["w_tied"] == "w" and "w_t" not in meta
    assert {"w_t", "w_row"} <= set(report.tensors)
    assert "slice_offset" in report.tensors and "strided" in report.tensors


def test_same_choice_as_reference_save_model(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    convert_file(tmp_path / "pytorch_model.bin", tmp_path / "ours.safetensors")
    st_torch.save_model(model, str(tmp_path / "ref.safetensors"))
    ours_path, ref_path = str(tmp_path / "ours.safetensors"), str(tmp_path / "ref.safetensors")
    with safe_open(ours_path, "pt") as a, safe_open(ref_path, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        ours = {k: v for k, v in a.metadata().items() if k != "format"}
        theirs = {k: v for k, v in (b.metadata() or {}).items() if k != "format"}
        assert ours == theirs
        for k in a.keys():  # noqa: SIM118 - safe_open is not a mapping
            assert torch.equal(a.get_tensor(k), b.get_tensor(k))


def test_views_that_are_not_the_same_tensor_are_copied(tmp_path: Path) -> None:
    m = torch.randn(6, 6)
    sd = {"full": m, "row": m[2], "col": m[:, 1], "T": m.t(), "tied": m}
    torch.save(sd, tmp_path / "v.pt")
    report = convert_file(tmp_path / "v.pt", tmp_path / "v.safetensors", verify=True)
    # The reference's save_model would keep "T" alone; only the identical view goes here.
    assert report.dropped == {"tied": "full"}
    assert sorted(report.tensors) == ["T", "col", "full", "row"]
    loaded = st_torch.load_file(str(tmp_path / "v.safetensors"))
    with safe_open(str(tmp_path / "v.safetensors"), "pt") as f:
        meta = f.metadata()
    for name, ref in sd.items():
        got = loaded[name] if name in loaded else loaded[meta[name]]
        assert torch.equal(got, ref), name


def test_verify_checks_dropped_names_against_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pysafetensors import CheckpointError
    from pysafetensors import convert as convert_mod

    m = torch.randn(6, 6)
    torch.save({"full": m, "row": m[2], "T": m.t()}, tmp_path / "v.pt")

    def reference_rule(tensors: dict[str, Any]) -> dict[str, str]:
        # safetensors.torch._remove_duplicate_names: the whole group goes to "T".
        return {"full": "T", "row": "T"}

    # Fault injection: the old, data-losing choice. --verify must catch it and remove the file.
    monkeypatch.setattr(convert_mod, "plan_shared", reference_rule)
    for torch_available in (True, False):
        if not torch_available:
            monkeypatch.setattr(convert_mod, "_torch_reference", lambda path, subtree: None)
        with pytest.raises(CheckpointError, match=r"full \(stored as T\)|row \(stored as T\)"):
            convert_file(tmp_path / "v.pt", tmp_path / "v.safetensors", verify=True)
        assert not (tmp_path / "v.safetensors").exists()


def test_big_endian_byteorder(tmp_path: Path) -> None:
    sd = {
        "f32": torch.randn(3, 4),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(5).bfloat16(),
        "c64": torch.complex(torch.randn(3), torch.randn(3)),
        "i64": torch.arange(6),
        "u8": torch.arange(4, dtype=torch.uint8),
        "u16": torch.tensor([1, 2, 65535], dtype=torch.uint16),
        "u32": torch.tensor([1, 2, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([5, 7], dtype=torch.uint64),
        "t": None,
    }
    sd["t"] = sd["f32"].t()
    little = tmp_path / "little.pt"
    torch.save(sd, little)
    big = tmp_path / "big.pt"
    big_endian_copy(little, big)
    ref = torch.load(big, weights_only=True)  # torch byteswaps on load...
    for k in sd:
        if k not in ("u16", "u32", "u64"):  # ... but not these (torch 2.x): 1 comes back as 256
            assert torch.equal(ref[k], sd[k])
    dst = tmp_path / "big.safetensors"
    # The converter swaps every type, so its values are the ones torch.save was given; verify
    # checks the three torch gets wrong against the checkpoint itself instead of torch.load.
    assert convert_file(big, dst, verify=True).verified == "torch"
    _check(big, dst, sd)


def test_lightning_nested(tmp_path: Path) -> None:
    ckpt = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {"model.layer.weight": torch.ones(2, 2), "model.layer.bias": torch.zeros(2)},
        "hyper_parameters": {"lr": 0.1, "layers": [1, 2]},
        "loops": {},
    }
    src = tmp_path / "last.ckpt"
    torch.save(ckpt, src)
    dst = tmp_path / "all.safetensors"
    report = convert_file(src, dst, keep_non_tensors=True, verify=True)
    assert report.tensors == ["state_dict.model.layer.weight", "state_dict.model.layer.bias"]
    assert report.non_tensors["epoch"] == 3
    assert report.non_tensors["hyper_parameters.lr"] == 0.1
    with safe_open(str(dst), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["hyper_parameters.layers"]) == [1, 2]
    assert meta["pytorch-lightning_version"] == '"2.4.0"'
    only = tmp_path / "sd.safetensors"
    report = convert_file(src, only, subtree="state_dict", verify=True)
    assert report.tensors == ["model.layer.weight", "model.layer.bias"]
    assert report.verified == "torch"


def test_sharded_folder_with_index(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {
            "a.weight": torch.randn(4, 4),
            "a.bias": torch.ones(4),
        },
        "pytorch_model-00002-of-00002.bin": {"b.weight": torch.randn(2, 4).bfloat16()},
    }
    weight_map = {}
    for fname, part in shards.items():
        torch.save(part, src / fname)
        weight_map.update({k: fname for k in part})
    (src / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": 999}, "weight_map": weight_map})
    )
    for executor in (None, ThreadPoolExecutor(2)):
        dst = tmp_path / f"dst-{executor is None}"
        report = convert_folder(src, dst, executor=executor, verify=True)
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {
            "a.bias": "model-00001-of-00002.safetensors",
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
        }
        assert index["metadata"]["total_size"] == 4 * 16 + 4 * 4 + 2 * 8
        assert [r.verified for r in report.files] == ["torch", "torch"]
        for fname, part in shards.items():
            out = dst / fname.replace("pytorch_model", "model").replace(".bin", ".safetensors")
            loaded = st_torch.load_file(str(out))
            for k, v in part.items():
                assert torch.equal(loaded[k], v)


def _sharded_bin(folder: Path, weight_map: dict[str, str] | None = None) -> None:
    """Two .bin shards (``a`` in the first, ``b`` in the second) and their index."""
    folder.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {"a": torch.ones(4)},
        "pytorch_model-00002-of-00002.bin": {"b": torch.zeros(4)},
    }
    listed = {}
    for fname, part in shards.items():
        torch.save(part, folder / fname)
        listed.update({k: fname for k in part})
    index = {"metadata": {}, "weight_map": weight_map if weight_map is not None else listed}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def test_a_sharded_conversion_retires_an_earlier_single_file(tmp_path: Path) -> None:
    """An earlier conversion's model.safetensors stayed beside the new shards and index:
    transformers opens it before any index, and loaded the old weights. Shards of another
    count stayed too, as a sharded save removes them."""
    src = tmp_path / "m"
    _sharded_bin(src)
    st_torch.save_file({"old": torch.ones(1)}, str(src / "model.safetensors"))
    stale = src / "model-00003-of-00003.safetensors"  # an earlier save of another count
    st_torch.save_file({"old": torch.ones(1)}, str(stale))
    (src / "notes.safetensors").write_bytes(b"kept")  # not of the hub's names: left alone
    convert_folder(src, src)
    assert not (src / "model.safetensors").exists() and not stale.exists()
    assert (src / "notes.safetensors").read_bytes() == b"kept"
    assert sorted(p.name for p in src.glob("model*")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        (
            {
                "a": "pytorch_model-00002-of-00002.bin",
                "b": "pytorch_model-00001-of-00002.bin",
            },
            r"lists 2 tensor\(s\) in another shard: 'a' \(listed in pytorch_model-00002",
        ),
        (
            {
                "a": "pytorch_model-00001-of-00002.bin",
                "b": "pytorch_model-00002-of-00002.bin",
                "lm_head.weight": "pytorch_model-00002-of-00002.bin",
            },
            r"lists 1 tensor\(s\) in no shard: 'lm_head.weight'",
        ),
    ],
)
def test_an_index_that_disagrees_with_its_shards_is_refused(
    tmp_path: Path, weight_map: dict[str, str], message: str
) -> None:
    """The output index was built from the shards alone: a tensor the source index listed
    and no shard held was dropped without a word."""
    src = tmp_path / "m"
    _sharded_bin(src, weight_map)
    with pytest.raises(CheckpointError, match=message) as info:
        convert_folder(src, tmp_path / "out")
    assert info.value.kind == "IndexMismatch"
    assert not (tmp_path / "out").exists()


def _sharded_src(src: Path) -> dict[str, dict[str, Any]]:
    src.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {"a.weight": torch.randn(40, 40)},
        "pytorch_model-00002-of-00002.bin": {"b.weight": torch.randn(2, 4)},
    }
    weight_map = {}
    for fname, part in shards.items():
        torch.save(part, src / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return shards


@pytest.mark.parametrize("workers", [None, 2])
def test_folder_failing_midway_leaves_no_half_model(tmp_path: Path, workers: int | None) -> None:
    from pysafetensors import CheckpointError

    src = tmp_path / "src"
    _sharded_src(src)
    bad = src / "pytorch_model-00002-of-00002.bin"
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated: its zip directory is gone
    executor = ThreadPoolExecutor(workers) if workers else None
    dst = tmp_path / "dst"
    with pytest.raises(CheckpointError) as exc:
        convert_folder(src, dst, executor=executor)
    assert str(exc.value).startswith(f"{bad}: ")
    assert not dst.exists()  # created by the call, removed again: nothing half-written
    # An existing output folder keeps what it held, and gets nothing new.
    dst.mkdir()
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"old")
    with pytest.raises(CheckpointError):
        convert_folder(src, dst, executor=executor)
    assert sorted(p.name for p in dst.iterdir()) == ["model-00001-of-00002.safetensors"]
    assert (dst / "model-00001-of-00002.safetensors").read_bytes() == b"old"


@pytest.mark.parametrize("workers", [None, 2])
def test_folder_write_errors_name_the_output_and_the_checkpoint(
    tmp_path: Path, workers: int | None
) -> None:
    # A write that failed (here: past the file size limit) named the private folder the
    # outputs are written to first (dst/.pysafetensors-convert-XXXX/model-...), a name the
    # caller never sees; it names the output in dst and, in a note, the checkpoint.
    src = tmp_path / "src"
    _sharded_src(src)
    script = textwrap.dedent(
        f"""
        import resource, sys
        from concurrent.futures import ThreadPoolExecutor
        from pysafetensors import WriteError
        from pysafetensors.convert import convert_folder

        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
        executor = ThreadPoolExecutor({workers}) if {workers!r} else None
        try:
            convert_folder({str(src)!r}, {str(tmp_path / "dst")!r}, executor=executor)
        except WriteError as exc:
            print(type(exc).__name__, exc.filename, exc.errno)
            print(exc)
            print(exc.__notes__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    first, message, notes = done.stdout.splitlines()[:3]
    shard = tmp_path / "dst" / "model-00001-of-00002.safetensors"
    assert first == f"WriteError {shard} {errno.EFBIG}"
    assert f'at path "{shard}"' in message and ".pysafetensors-convert-" not in message
    assert str(src / "pytorch_model-00001-of-00002.bin") in notes
    assert not (tmp_path / "dst").exists()


def test_folder_output_that_cannot_be_made_is_a_write_error(tmp_path: Path) -> None:
    from pysafetensors import WriteError

    src = tmp_path / "src"
    _sharded_src(src)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(WriteError, match="Not a directory") as info:
        convert_folder(src, tmp_path / "file" / "dst")
    assert info.value.filename == str(tmp_path / "file" / "dst")
    assert isinstance(info.value, NotADirectoryError)


def test_folder_checks_every_listed_shard_before_writing(tmp_path: Path) -> None:
    from pysafetensors import CheckpointError

    src = tmp_path / "src"
    _sharded_src(src)
    (src / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match=r"missing.*pytorch_model-00002-of-00002\.bin"):
        convert_folder(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_folder_error_names_the_failing_file(tmp_path: Path) -> None:
    from pysafetensors import UnsafePickleError

    # A checkpoint folder with a file that pickles an object of a class the converter does
    # not know (refused without unknown="skip").
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    torch.save({"step": 1, "args": argparse.Namespace(lr=0.1)}, tmp_path / "state.pth")
    with pytest.raises(UnsafePickleError) as exc:
        convert_folder(tmp_path, tmp_path / "out")
    assert str(exc.value).startswith(f"{tmp_path / 'state.pth'}: global argparse.Namespace")
    assert exc.value.global_name == "argparse.Namespace"
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "model.safetensors").exists()


def test_single_folder_and_back_to_torch(tmp_path: Path) -> None:
    sd = {"x": torch.randn(3, 3), "y": torch.arange(4)}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    convert_folder(tmp_path, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert verify_conversion(tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors")
    names = to_torch_bin(tmp_path / "model.safetensors", tmp_path / "back.bin")
    back = torch.load(tmp_path / "back.bin", weights_only=True)
    assert sorted(names) == ["x", "y"]
    for k, v in sd.items():
        assert torch.equal(back[k], v)


def test_progress_and_parameters(tmp_path: Path) -> None:
    lin = torch.nn.Linear(8, 4)
    torch.save(
        {"model": lin.state_dict(), "param": torch.nn.Parameter(torch.ones(2))}, tmp_path / "m.pth"
    )
    seen: list[tuple[int, int]] = []
    report = convert_file(
        tmp_path / "m.pth", tmp_path / "m.safetensors", progress=lambda d, t: seen.append((d, t))
    )
    assert seen and seen[-1][0] == seen[-1][1] == report.total_size
    assert set(report.tensors) == {"model.weight", "model.bias", "param"}


@pytest.mark.parametrize("zip_format", [True, False])
def test_conversion_memory_stays_near_one_chunk(tmp_path: Path, zip_format: bool) -> None:
    """Storage bytes stream through; the legacy format's leading pickles are read through a
    small growing window (it read up to 1 GiB of the file up front, twice over)."""
    import tracemalloc

    state = {f"w{i}": torch.randn(1024, 2048) for i in range(8)}  # 64 MiB
    src = tmp_path / "ckpt.bin"
    torch.save(state, src, _use_new_zipfile_serialization=zip_format)
    out = tmp_path / "out.safetensors"
    tracemalloc.start()
    try:
        convert_file(src, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One 8 MiB chunk at a time (8 MiB traced; 24 MiB with a fresh buffer per chunk).
    assert peak < 16 << 20, f"{peak >> 20} MiB traced"
    with safe_open(str(out), "pt") as f:
        for name, value in state.items():
            assert torch.equal(f.get_tensor(name), value)


def test_a_leaf_that_shares_its_lists_renders_bounded(tmp_path: Path) -> None:
    """{"info": L} where L = [prev] * 1000 five times over: 10**15 values if rendered in full
    (the report and metadata rendering of non-tensor leaves ran out of memory)."""
    from .corpus import make_zip

    pkl = b"\x80\x02]q\x000"
    for _ in range(5):
        pkl += b"](" + b"h\x00" * 1000 + b"eq\x000"
    pkl += b"}X\x04\x00\x00\x00infoh\x00s."
    make_zip(tmp_path / "m.pt", pkl)
    with load_checkpoint(tmp_path / "m.pt") as ck:
        info = ck.non_tensors["info"]
    text = json.dumps(info)
    assert "..." in text and len(text) < 1_000_000


# ------------------------------------------- zip records as torch's reader finds them


def _rewrite(
    src: Path, dst: Path, *, rename: Any = None, replace: Any = None, add: Any = ()
) -> Path:
    """A copy of a ``torch.save`` zip with members renamed, replaced or added."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if replace is not None and name.endswith(replace[0]):
                data = replace[1]
            zout.writestr(rename(name) if rename else name, data)
        for name, data in add:
            zout.writestr(name, data)
    return dst


def _torch_outcome(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)["w"].tolist()
    except RuntimeError:
        return "refused"


def _our_outcome(path: Path) -> Any:
    out = path.with_suffix(".safetensors")
    try:
        convert_file(path, out)
    except CheckpointError:
        assert not out.exists()
        return "refused"
    return st_torch.load_file(out)["w"].tolist()


@pytest.mark.parametrize(
    "change",
    [
        # Records are found ignoring ASCII case, as torch's zip reader (miniz) finds them.
        {"rename": lambda n: n.replace("byteorder", "BYTEORDER"), "replace": ("byteorder", b"big")},
        {"rename": lambda n: n.replace("data.pkl", "Data.PKL")},
        {"rename": lambda n: n.replace("/data/", "/DATA/")},
        # Archive versions torch's reader refuses, and one it reads.
        {"replace": ("/version", b"99\n")},
        {"replace": ("/version", b"0\n")},
        {"replace": ("/version", b"x\n")},
        {"replace": ("/version", b"-1\n")},
        {"replace": ("/version", b" \t3 trailing")},
        {"add": [("ck/.data/version", b"11\n")]},
    ],
)
def test_zip_records_are_read_as_torch_reads_them(tmp_path: Path, change: dict[str, Any]) -> None:
    src = tmp_path / "ck.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, src)
    assert zipfile.ZipFile(src).namelist()[0].startswith("ck/")
    changed = _rewrite(src, tmp_path / "changed.pt", **change)
    assert _our_outcome(changed) == _torch_outcome(changed)


@pytest.mark.parametrize(
    ("name", "data"),
    [("ck/DATA/0", np.full(4, 666, np.float32).tobytes()), ("ck/Data.pkl", b"\x80\x02}q\x00.")],
)
@pytest.mark.parametrize("at", [2, None])
def test_records_torch_cannot_tell_apart_are_refused(
    tmp_path: Path, name: str, data: bytes, at: int | None
) -> None:
    """torch's reader finds records ignoring case: of two such records it reads the one its
    lookup meets (here the added one, placed third), so neither can be trusted."""
    from pysafetensors.scan import scan_file

    src = tmp_path / "ck.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, src)
    changed = tmp_path / "changed.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(changed, "w") as zout:
        items = [(member, zin.read(member)) for member in zin.namelist()]
        items.insert(len(items) if at is None else at, (name, data))
        for member, content in items:
            zout.writestr(member, content)
    if at is not None and name.endswith("/0"):
        assert _torch_outcome(changed) == [666.0] * 4  # torch read the added record
    with pytest.raises(CheckpointError, match="differ only in case"):
        convert_file(changed, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    report = scan_file(changed)
    assert "zip member names that differ only in case" in [f.message for f in report.findings]
    assert report.grade != "safe"


@pytest.mark.parametrize(
    ("value", "flag"),
    [(torch.arange(1, 5, dtype=torch.float32), "neg"), (torch.tensor([1 + 2j, 3 - 4j]), "conj")],
)
def test_a_view_flag_counts_when_it_is_there_whatever_its_value(
    tmp_path: Path, value: torch.Tensor, flag: str
) -> None:
    """torch sets a tensor's neg or conj bit when the rebuild's metadata has the key, also as
    False (torch.save writes only True): the converter read the value, and wrote the
    unnegated (unconjugated) values, which only --verify caught."""
    src = tmp_path / "ck.pt"
    view = value._neg_view() if flag == "neg" else value.conj()
    torch.save({"w": view}, src)
    pickled = zipfile.ZipFile(src).read("ck/data.pkl")
    # The key (memoized: BINPUT n) and NEWTRUE, as pickle writes {"neg": True}: NEWFALSE.
    key = re.escape(b"X" + len(flag).to_bytes(4, "little") + flag.encode())
    pickled, found = re.subn(key + rb"(q.)\x88", lambda m: m.group()[:-1] + b"\x89", pickled)
    assert found == 1
    changed = _rewrite(src, tmp_path / "f.pt", replace=("data.pkl", pickled))
    expected = (value.neg() if flag == "neg" else value.conj().resolve_conj()).tolist()
    assert (
        torch.load(changed, weights_only=True)["w"].resolve_neg().resolve_conj().tolist()
        == expected
    )
    out = tmp_path / "out.safetensors"
    convert_file(changed, out, verify=True)
    assert st_torch.load_file(out)["w"].tolist() == expected


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e8m0fnu,
    ],
)
def test_a_negative_view_torch_cannot_negate_is_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    """bool failed with numpy's TypeError, the others with torch's NotImplementedError under
    verify=True (float8_e8m0fnu's sign bit flipped into NaN without it)."""
    src = tmp_path / "ck.pt"
    torch.save({"w": torch.zeros(2, dtype=dtype)._neg_view()}, src)
    out = tmp_path / "out.safetensors"
    for verify in (False, True):
        with pytest.raises(CheckpointError, match="cannot negate") as info:
            convert_file(src, out, verify=verify)
        assert info.value.kind == "DtypeNotSupported" and info.value.tensor == "w"
        assert not out.exists()


def _unconvertibles() -> dict[str, Any]:
    dense = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    made: dict[str, Any] = {
        "sparse tensors": dense.to_sparse(),
        "quantized tensors": torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
        "nested tensors": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "meta tensors": torch.empty(3, device="meta"),
    }
    csr = dense.to_sparse_csr()
    made["sparse tensors (CSR)"] = csr
    param = torch.nn.Parameter(dense.to_sparse(), requires_grad=False)
    made["sparse tensors (a Parameter)"] = param
    tagged = dense.to_sparse()
    tagged.tag = "x"  # pickled through _rebuild_from_type_v2 with its __dict__
    made["sparse tensors (with attributes)"] = tagged
    return made


_UNCONVERTIBLE_KINDS = [
    "sparse tensors",
    "quantized tensors",
    "nested tensors",
    "meta tensors",
    "sparse tensors (CSR)",
    "sparse tensors (a Parameter)",
    "sparse tensors (with attributes)",
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's warnings about sparse/nested saves
@pytest.mark.parametrize("what", _UNCONVERTIBLE_KINDS)
def test_a_tensor_safetensors_cannot_hold_is_refused_by_its_name(tmp_path: Path, what: str) -> None:
    src = tmp_path / "ck.pt"
    torch.save(
        {"model": {"a": torch.ones(2), "layer17": {"mask": _unconvertibles()[what]}}, "step": 3},
        src,
    )
    for subtree in (None, "model"):
        out = tmp_path / "out.safetensors"
        with pytest.raises(CheckpointError) as info:
            convert_file(src, out, subtree=subtree)
        name = "model.layer17.mask"  # its path in the checkpoint, whatever the subtree
        assert info.value.tensor == name, str(info.value)
        assert f"{name!r} is one of the {what.split(' (')[0]}" in str(info.value)
        assert "built at byte" in str(info.value) and info.value.offset
        assert not out.exists()


def test_verify_with_torch_reads_one_element_views_of_any_stride(tmp_path: Path) -> None:
    # torch keeps a size-1 dimension's stride (2 here) through contiguous(): hashing the
    # tensor through view(uint8) raised RuntimeError instead of verifying.
    t = torch.arange(4).reshape(1, 4)[:, ::2][:, :1]
    assert t.contiguous().reshape(-1).stride() == (2,)
    torch.save({"x": t, "y": t.double()}, tmp_path / "s.pt")
    report = convert_file(tmp_path / "s.pt", tmp_path / "s.safetensors", verify=True)
    assert report.verified == "torch"
    assert st_torch.load_file(tmp_path / "s.safetensors")["x"].tolist() == [[0]]
