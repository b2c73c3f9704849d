"""Checkpoints at the edges of what torch.save writes: no CRCs, scheduler state, odd keys, tied
names that clash with metadata, tensors with Python attributes, expanded and strided views,
compressed members, and pickles that would build containers without end."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pysafetensors import CheckpointError, safe_open  # noqa: E402
from pysafetensors._pickle_vm import Limits, Machine  # noqa: E402
from pysafetensors._torch_pickle import load_checkpoint  # noqa: E402
from pysafetensors._torch_policy import ValuePolicy  # noqa: E402
from pysafetensors.convert import convert_file, to_torch_bin  # noqa: E402
from pysafetensors.scan import scan_file  # noqa: E402

from .corpus import cli  # noqa: E402


def _loaded(path: Path) -> dict[str, Any]:
    with safe_open(path, "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_a_checkpoint_saved_without_crcs_converts(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    src = tmp_path / "nocrc.pt"
    config.save.compute_crc32 = False
    try:
        torch.save({"w": torch.arange(12.0).reshape(3, 4)}, src)
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(src) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    convert_file(src, tmp_path / "out.safetensors", verify=True)
    assert torch.equal(_loaded(tmp_path / "out.safetensors")["w"], torch.arange(12.0).reshape(3, 4))


def test_a_wrong_crc_is_still_caught(tmp_path: Path) -> None:
    src = tmp_path / "ok.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    raw = bytearray(src.read_bytes())
    data = bytes(torch.arange(4.0).numpy().tobytes())
    at = raw.index(data)
    raw[at] ^= 1
    src.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        convert_file(src, tmp_path / "out.safetensors")


@pytest.mark.parametrize("where", [0, 3 << 20, (5 << 20) - 1])
def test_a_wrong_crc_of_a_large_member_is_caught(tmp_path: Path, where: int) -> None:
    """Members of several MiB have the CRC of each piece computed on a reader thread while the
    piece is written: a flipped byte in any piece still fails the check, and no file is left."""
    values = torch.arange((5 << 20) // 4, dtype=torch.int32)
    src = tmp_path / "large.pt"
    torch.save({"w": values, "b": torch.arange(3.0)}, src)
    converted = tmp_path / "fine.safetensors"
    convert_file(src, converted)
    assert torch.equal(_loaded(converted)["w"], values)
    raw = bytearray(src.read_bytes())
    at = raw.index(values[:64].numpy().tobytes()) + where
    raw[at] ^= 0x40
    src.write_bytes(bytes(raw))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        convert_file(src, out)
    assert not out.exists()


def test_scheduler_state_with_a_counter_converts(tmp_path: Path) -> None:
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10, 20])
    src = tmp_path / "train.pt"
    torch.save({"model": lin.state_dict(), "scheduler": sched.state_dict()}, src)
    report = convert_file(src, tmp_path / "out.safetensors", keep_non_tensors=True)
    assert report.tensors == ["model.weight", "model.bias"]
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        meta = f.metadata()
    # Counter pickles as Counter(dict): flattened as the dict it holds.
    assert meta["scheduler.milestones.10"] == meta["scheduler.milestones.20"] == "1"
    assert scan_file(src).grade == "safe"


def test_keys_that_cannot_name_a_tensor_are_fine_elsewhere(tmp_path: Path) -> None:
    src = tmp_path / "keys.pt"
    torch.save({"model": {"w": torch.ones(2)}, "cfg": {0.5: "half", (0, 1): "pair"}}, src)
    report = convert_file(src, tmp_path / "out.safetensors")
    assert report.tensors == ["model.w"]
    assert set(report.non_tensors) == {"cfg.0.5", "cfg.(0, 1)"}
    bad = tmp_path / "bad.pt"
    torch.save({"model": {0.5: torch.ones(2)}}, bad)
    with pytest.raises(CheckpointError, match="key of type float cannot name a tensor"):
        convert_file(bad, tmp_path / "bad.safetensors")


@pytest.mark.parametrize("clash", ["format", "license"])
def test_a_tied_name_that_is_a_metadata_key_is_kept(tmp_path: Path, clash: str) -> None:
    m = torch.arange(6.0).reshape(2, 3)
    src = tmp_path / "tied.pt"
    torch.save({"a": m, clash: m}, src)
    out = tmp_path / "out.safetensors"
    report = convert_file(src, out, metadata={"license": "mit"}, verify=True)
    assert report.dropped == {}
    loaded = _loaded(out)
    assert torch.equal(loaded["a"], m) and torch.equal(loaded[clash], m)
    back = tmp_path / "back.pt"
    to_torch_bin(out, back, restore_shared=True)
    assert set(torch.load(back, weights_only=True)) == {"a", clash}


def test_lone_surrogates_in_kept_values_are_escaped(tmp_path: Path) -> None:
    src = tmp_path / "s.pt"
    torch.save({"w": torch.ones(1), "note\ud800": "bad \ud801 text"}, src)
    report = convert_file(src, tmp_path / "out.safetensors", keep_non_tensors=True)
    assert report.kept_non_tensors == ["note\\ud800"]
    with safe_open(tmp_path / "out.safetensors", "np") as f:
        assert json.loads(f.metadata()["note\\ud800"]) == "bad \ud801 text"


def test_tensors_with_python_attributes_convert(tmp_path: Path) -> None:
    t = torch.arange(3.0)
    t.tag = "x"
    p = torch.nn.Parameter(torch.ones(3))
    p.tag = "y"
    src = tmp_path / "attrs.pt"
    torch.save({"t": t, "p": p}, src)
    convert_file(src, tmp_path / "out.safetensors", verify=True)
    loaded = _loaded(tmp_path / "out.safetensors")
    assert torch.equal(loaded["t"], t.detach()) and torch.equal(loaded["p"], p.detach())


@pytest.mark.parametrize("key", [b"data", b"real"])
def test_a_state_that_swaps_a_parameters_data_is_refused(tmp_path: Path, key: bytes) -> None:
    """torch.save writes a Parameter's ``__dict__`` as the state torch.load applies with
    setattr. Renamed in the file to ``data``, the attribute replaces the Parameter torch
    loads (float64 ones of shape [2, 5] here; ``real`` writes them into it): the converter
    wrote the pickled zeros, and the scanner graded the file safe."""
    from pysafetensors import UnsafePickleError

    p = torch.nn.Parameter(torch.zeros(2, 5, dtype=torch.float64), requires_grad=False)
    setattr(p, "x" * len(key), torch.ones(2, 5, dtype=torch.float64))
    torch.save({"w": p}, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as zin, zipfile.ZipFile(tmp_path / "e.pt", "w") as zo:
        for info in zin.infolist():
            raw = zin.read(info)
            if info.filename.endswith("data.pkl"):
                raw = raw.replace(b"x" * len(key), key)
            zo.writestr(info, raw)
    assert torch.equal(
        torch.load(tmp_path / "e.pt", weights_only=True)["w"], torch.ones(2, 5, dtype=torch.float64)
    )
    assert scan_file(tmp_path / "e.pt").grade == "dangerous"
    with pytest.raises(UnsafePickleError, match=f"tensor state sets '{key.decode()}'"):
        convert_file(tmp_path / "e.pt", tmp_path / "e.safetensors")
    assert not (tmp_path / "e.safetensors").exists()


def test_the_refused_state_names_cover_this_torch() -> None:
    """Every name setattr on a Parameter hands to torch instead of its ``__dict__``."""
    from pysafetensors._torch_policy import TENSOR_SETTERS

    setters = {
        name
        for cls in torch.nn.Parameter.__mro__
        for name, value in vars(cls).items()
        if hasattr(type(value), "__set__")
    }
    assert setters <= TENSOR_SETTERS, sorted(setters - TENSOR_SETTERS)


def test_expanded_views_together_are_bounded(tmp_path: Path) -> None:
    base = torch.ones(1)
    src = tmp_path / "expand.pt"
    # Each is under the per-tensor floor (256 MiB); eight of them write 2 GiB from 4 bytes.
    torch.save({f"e{i}": base.expand(1 << 20, 60) for i in range(8)}, src)
    assert src.stat().st_size < 4096
    with pytest.raises(CheckpointError, match="expanded tensors .* would write"):
        convert_file(src, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_an_expanded_view_is_written_in_bounded_memory(tmp_path: Path) -> None:
    import tracemalloc

    src = tmp_path / "expand1.pt"
    # 240 MiB written out from 4 KiB stored: the writer must not hold it whole.
    torch.save({"e": torch.arange(1024.0).expand(61440, 1024)}, src)
    tracemalloc.start()
    try:
        convert_file(src, tmp_path / "out.safetensors")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, f"{peak >> 20} MiB traced while writing 240 MiB"
    with safe_open(tmp_path / "out.safetensors", "np") as f:
        e = f.get_slice("e")
        assert e.get_shape() == [61440, 1024]
        np.testing.assert_array_equal(e[61439], np.arange(1024.0, dtype=np.float32))


def _deflated_copy(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def test_compressed_storages_are_inflated_once(tmp_path: Path) -> None:
    storage = torch.arange(1 << 16, dtype=torch.float32)
    state = {f"v{i}": storage[i * 7 : i * 7 + 3] for i in range(200)}
    state["t"] = storage.reshape(256, 256).t()  # strided, spans the whole storage
    plain = tmp_path / "plain.pt"
    torch.save(state, plain)
    src = tmp_path / "deflated.pt"
    _deflated_copy(plain, src)
    with load_checkpoint(src) as ck:
        for rec in ck.tensors.values():
            b"".join(bytes(np.asarray(c)) for c in ck.tensor_chunks(rec))
        assert len(ck._spilled) == 1  # one storage, inflated once for all 201 tensors
    convert_file(src, tmp_path / "out.safetensors", verify=True)
    loaded = _loaded(tmp_path / "out.safetensors")
    expected = torch.load(plain, weights_only=True)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


def test_strided_views_of_every_kind_match_torch(tmp_path: Path) -> None:
    m = torch.randn(8, 6, 5)
    c = torch.randn(4, 3, dtype=torch.complex64)
    state = {
        "t": m.transpose(0, 2),
        "step": m[::2, 1::3],
        "exp": torch.randn(1, 5).expand(7, 5),
        "neg": torch.randn(3, 4)._neg_view(),
        "conj": c.conj(),
        "big_rows": torch.randn(3, 1 << 20).t(),  # blocks cut inside the first axis
    }
    src = tmp_path / "views.pt"
    torch.save(state, src)
    convert_file(src, tmp_path / "out.safetensors", verify=True)
    loaded = _loaded(tmp_path / "out.safetensors")
    for name, value in state.items():
        assert torch.equal(loaded[name], value.resolve_conj().resolve_neg()), name


def _count_limit_pickle(n: int) -> bytes:
    # A list that gains n empty sets: the stack stays short, the containers pile up.
    return b"\x80\x02]" + b"(" + b"\x8f" * n + b"e" + b"."


def test_the_pickle_machine_caps_the_containers_it_builds() -> None:
    data = _count_limit_pickle(1000)
    assert len(Machine(data, ValuePolicy(), Limits()).run(0).value) == 1000
    with pytest.raises(CheckpointError, match="over 500 containers"):
        Machine(data, ValuePolicy(), Limits(max_containers=500)).run(0)
    with pytest.raises(CheckpointError, match="over 500 items"):
        Machine(data, ValuePolicy(), Limits(max_items=500)).run(0)


def test_kept_values_that_read_as_tensor_names_are_not_taken_for_ties(tmp_path: Path) -> None:
    # Tied names are recorded as {dropped: kept} metadata, and keep_non_tensors wrote
    # {"epoch": "1"} beside a tensor named "1": to_torch_bin(restore_shared=True) turned the
    # epoch into a copy of that tensor. Such a value is now left out (and reported).
    m = torch.arange(4.0)
    src = tmp_path / "r.pt"
    torch.save({0: torch.zeros(2), 1: torch.ones(2), "a": m, "b": m, "epoch": 1, "step": 7}, src)
    out = tmp_path / "r.safetensors"
    report = convert_file(src, out, keep_non_tensors=True)
    assert report.kept_non_tensors == ["step"]
    assert report.skipped_non_tensors == ["epoch"]
    assert report.dropped == {"b": "a"}
    with safe_open(out, "np") as f:
        meta = f.metadata()
    assert "epoch" not in meta and json.loads(meta["step"]) == 7
    back = tmp_path / "r2.bin"
    to_torch_bin(out, back, restore_shared=True)
    loaded = torch.load(back, weights_only=True)
    assert set(loaded) == {"0", "1", "a", "b"}
    assert torch.equal(loaded["b"], m)
    # The command line says why the value was not kept.
    res = cli("convert", str(src), str(tmp_path / "cli.safetensors"), "--keep-non-tensors")
    assert res.returncode == 0, res.stderr
    assert "skipped non-tensor values (their values are tensor names): epoch" in res.stdout
