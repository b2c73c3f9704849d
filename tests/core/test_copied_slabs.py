"""Saves of numpy arrays whose memory does not hold their bytes in file order (strided,
transposed, broadcast, big-endian): copied a slab at a time, bytes as the reference writes for
the same values laid out in row-major little-endian order (given the arrays themselves, it
writes their raw memory: wrong values, docs/differences.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import pysafetensors._adapter as adapter
from conftest import peak_growth_kib
from pysafetensors.numpy import load, save, save_file

reference = pytest.importorskip("safetensors.numpy")


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((12, 10)).astype(np.float32)
    return {
        "transposed": base.T,
        "strided": base[::3, 1::2],
        "reversed": base[::-1, ::-2],
        "permuted": rng.integers(0, 255, (3, 4, 5), dtype=np.uint8).transpose(2, 0, 1),
        "broadcast": np.broadcast_to(np.arange(7, dtype=np.int16), (5, 7)),
        "big_endian": base.astype(">f8"),
        "big_endian_t": base.astype(">i4").T,
        "big_scalar": np.array(3.5, dtype=">f4"),
        "bf16_t": base.astype(ml_dtypes.bfloat16).T,
        "c64_t": (base + 1j * base).astype(np.complex64).T,
        "flags_t": (base > 0).T,
        "empty_t": np.zeros((0, 4), np.float32).T,
        "empty_big_endian": np.zeros((3, 0), ">f4"),
        "one": base[2:3, 4:5],
    }


def _in_file_order(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(v.dtype.newbyteorder("<"), order="C") for k, v in arrays.items()}


@pytest.mark.usefixtures("slabs")
@pytest.mark.parametrize("name", list(_arrays()))
def test_each_layout_writes_the_reference_s_bytes(name: str) -> None:
    arrays = {name: _arrays()[name]}
    assert save(arrays) == reference.save(_in_file_order(arrays))


@pytest.mark.usefixtures("slabs")
def test_a_file_of_every_layout_is_the_reference_s(tmp_path: Path) -> None:
    arrays = _arrays()
    save_file(arrays, tmp_path / "ours.safetensors", metadata={"k": "v"})
    ref_path = str(tmp_path / "ref.safetensors")
    reference.save_file(_in_file_order(arrays), ref_path, metadata={"k": "v"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()


def test_slabs_are_bounded_and_kept_chunks_own_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "SLAB_BYTES", 64)
    monkeypatch.setattr(adapter, "WRITEV_BYTES", 32)
    arr = np.arange(40 * 30, dtype=np.float32).reshape(40, 30).T  # rows of 160 bytes
    # Consumed as a writer does (each chunk used before the next is asked for): the values.
    joined = b"".join(bytes(c) for c in adapter.copied_slabs(arr))
    assert joined == arr.astype("<f4").tobytes()
    chunks = list(adapter.copied_slabs(arr))
    # Rows over the slab size are cut into their own rows (elements here), never more.
    assert max(c.nbytes for c in chunks) <= 64
    # Large chunks share one buffer; the last and small ones, which a consumer may keep,
    # share memory with no other.
    large = [c for c in chunks[:-1] if c.nbytes >= 32]
    assert len(large) > 1 and all(np.shares_memory(large[0], c) for c in large)
    kept = [c for c in chunks if c.nbytes < 32] + [chunks[-1]]
    assert kept[-1].nbytes and not any(
        np.shares_memory(k, c) for k in kept for c in chunks if c is not k
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_copies_do_not_add_the_arrays_size_to_the_peak(tmp_path: Path) -> None:
    setup = """
        import numpy as np
        from pysafetensors.numpy import save_file
        # Transposed and byte-swapped arrays (48 MiB each), and one of two 64-MiB rows (each
        # row was copied whole: 127 MiB of growth).
        arrays = {f"w{i}": np.ones((1024, 12 * 1024), np.float32).T for i in range(2)}
        arrays["b"] = np.ones((1024, 12 * 1024), ">f4")
        arrays["p"] = np.ones((4096, 4096, 2), np.float32).transpose(2, 0, 1)
    """
    grew = peak_growth_kib(setup, "save_file(arrays, sys.argv[1])", str(tmp_path / "o"))
    assert grew < 64 * 1024, f"grew by {grew} KiB"


def test_large_tensors_hand_every_slab_over_through_the_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adapter, "SLAB_BYTES", 64)
    monkeypatch.setattr(adapter, "WRITEV_BYTES", 32)
    arr = np.arange(40 * 30, dtype=np.float32).reshape(40, 30).T
    assert adapter.slabs_reused(arr.nbytes) and not adapter.slabs_reused(16)
    chunks = list(adapter.copied_slabs(arr, reuse_all=True))
    # The last one too: a consumer told so (TensorData.reused) copies what it keeps.
    assert len(chunks) > 2 and all(np.shares_memory(chunks[0], c) for c in chunks)
    joined = b"".join(bytes(c) for c in adapter.copied_slabs(arr, reuse_all=True))
    assert joined == arr.astype("<f4").tobytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize("layout", ["transposed", "big-endian"])
def test_a_save_holds_one_slab_at_a_time(tmp_path: Path, layout: str) -> None:
    setup = f"""
        import numpy as np
        from pysafetensors.numpy import save_file
        # 256 MiB in four 64 MiB arrays, each copied in four 16 MiB slabs.
        if {layout!r} == "transposed":
            arrays = {{f"w{{i}}": np.ones((2048, 8192), np.float32).T for i in range(4)}}
        else:
            arrays = {{f"w{{i}}": np.ones((2048, 8192), ">f4") for i in range(4)}}
    """
    grew = peak_growth_kib(setup, "save_file(arrays, sys.argv[1])", str(tmp_path / "o"))
    # One 16 MiB buffer: 15.8 MiB measured. The last slab of each array in memory of its own,
    # and the previous array's buffer still held when the next one's was made: 31.8 MiB.
    assert grew < 24 * 1024, f"grew by {grew} KiB"


@pytest.mark.parametrize("dtype", [ml_dtypes.float4_e2m1fn, ml_dtypes.float6_e3m2fn])
def test_sub_byte_arrays_are_packed_a_block_at_a_time(
    monkeypatch: pytest.MonkeyPatch, dtype: type
) -> None:
    # Blocks of 8 codes: a 6x10 array packs in 8 blocks, transposed too.
    monkeypatch.setattr(adapter, "SLAB_BYTES", 8)
    codes = np.random.default_rng(1).integers(0, 16, (6, 10), dtype=np.uint8).view(dtype)
    for arr in (codes, codes.T, codes[::-1]):
        monkeypatch.setattr(adapter, "SLAB_BYTES", 8)
        blocked = save({"x": arr})
        monkeypatch.setattr(adapter, "SLAB_BYTES", 1 << 20)
        assert blocked == save({"x": np.ascontiguousarray(arr)})
        assert np.array_equal(load(blocked)["x"].view(np.uint8), arr.view(np.uint8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_sub_byte_save_holds_one_block_at_a_time(tmp_path: Path) -> None:
    setup = """
        import ml_dtypes, numpy as np
        from pysafetensors.numpy import save_file
        # 256 MiB of codes (128 MiB in the file), packed whole: 384 MiB of temporaries.
        codes = np.ones((16384, 16384), np.uint8).view(ml_dtypes.float4_e2m1fn)
        arrays = {"c": codes, "t": codes[:4096].T}
    """
    grew = peak_growth_kib(setup, "save_file(arrays, sys.argv[1])", str(tmp_path / "o"))
    assert grew < 64 * 1024, f"grew by {grew} KiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_lazy_conjugate_is_resolved_a_slab_at_a_time(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    setup = """
        import torch
        from pysafetensors.torch import save_file
        # 256 MiB, conjugated lazily: resolved whole, a copy of its size.
        tensors = {"c": torch.ones((4096, 8192), dtype=torch.complex64).conj()}
    """
    grew = peak_growth_kib(setup, "save_file(tensors, sys.argv[1])", str(tmp_path / "o"))
    assert grew < 64 * 1024, f"grew by {grew} KiB"


def test_lazy_conjugates_and_negatives_keep_their_values_across_slabs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors._torch_adapter import ADAPTER

    monkeypatch.setattr(adapter, "SLAB_BYTES", 64)
    monkeypatch.setattr(adapter, "WRITEV_BYTES", 32)
    base = torch.randn(12, 7, dtype=torch.complex64)
    views = {
        "conj": base.conj(),
        "conj_t": base.conj().T,
        "neg": base._neg_view(),
        "both_strided": base._neg_view().conj()[::2, 1::3],
        "neg_real_t": base.conj().imag.T,
    }
    for name, view in views.items():
        data = ADAPTER.to_data(name, view)
        written = b"".join(bytes(chunk) for chunk in data.chunks())
        assert written == view.resolve_conj().resolve_neg().contiguous().numpy().tobytes(), name


def _transposed_blocks() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    base = rng.standard_normal((37, 53)).astype(np.float32)
    return {
        "transposed": base.T,
        "reversed": base.T[::-1, ::-1],
        "stepped": base[::2].T,
        "big_endian": base.astype(">f4").T,
        "bf16": base.astype(ml_dtypes.bfloat16).T,
        "bytes": rng.integers(0, 255, (37, 53), dtype=np.uint8).T,
    }


@pytest.mark.parametrize("name", list(_transposed_blocks()))
def test_transposed_blocks_are_copied_in_tiles(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # Tiles of at most 64 elements: many tiles over each row and column, ragged at both ends.
    monkeypatch.setattr(adapter, "TILE_ELEMENTS", 64)
    piece = _transposed_blocks()[name]
    out = np.empty(piece.shape, piece.dtype.newbyteorder("<"))
    assert adapter.copy_in_tiles(out, piece)
    assert out.tobytes() == piece.astype(out.dtype, order="C").tobytes()


@pytest.mark.parametrize(
    "piece",
    [
        np.ones((40, 40), np.float32),  # rows in order: one copy
        np.ones((80, 80), np.float32)[::2, ::2],  # rows farther apart than columns
        np.ones((4, 5, 6), np.float32).transpose(2, 1, 0),  # not 2-D
        np.ones((1, 500), np.float32).T,  # one column
        np.ones((8, 8), np.float32).T,  # no more than one tile
    ],
    ids=["contiguous", "stepped", "3-d", "one-column", "small"],
)
def test_other_layouts_are_left_to_one_copy(
    monkeypatch: pytest.MonkeyPatch, piece: np.ndarray
) -> None:
    monkeypatch.setattr(adapter, "TILE_ELEMENTS", 64)
    assert not adapter.copy_in_tiles(np.empty(piece.shape, piece.dtype), piece)


@pytest.mark.usefixtures("slabs")
def test_saves_in_tiles_write_the_reference_s_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(adapter, "TILE_ELEMENTS", 64)
    arrays = _transposed_blocks()
    assert save(arrays) == reference.save(_in_file_order(arrays))
    save_file(arrays, tmp_path / "ours.safetensors")
    assert load(save(arrays)).keys() == arrays.keys()
    reference.save_file(_in_file_order(arrays), str(tmp_path / "ref.safetensors"))
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()
