"""Conversion streams storage bytes through one reused buffer: the same files whatever the
chunk size, each chunk valid until the next is asked for, and memory near one chunk."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pysafetensors._torch_archive as archive  # noqa: E402
import pysafetensors._torch_pickle as torch_pickle  # noqa: E402
import pysafetensors._writer as writer  # noqa: E402
from conftest import peak_growth_kib  # noqa: E402
from pysafetensors._torch_pickle import load_checkpoint  # noqa: E402
from pysafetensors.convert import convert_file  # noqa: E402

from .corpus import big_endian_copy  # noqa: E402


def _state() -> dict[str, Any]:
    """Tensors of every path through the reader: contiguous (several chunks, a tail shorter
    than one), strided, expanded, conjugate, negative, small."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=g)
    return {
        "w": w,
        "w_t": w.t(),
        "row": w[3],
        "strided": torch.arange(40, dtype=torch.int64).reshape(5, 8)[::2, 1::3],
        "expanded": torch.arange(3, dtype=torch.float32).expand(4, 3),
        "conj": torch.complex(torch.randn(7, generator=g), torch.randn(7, generator=g)).conj(),
        "neg": torch.randn(5, 3, generator=g)._neg_view(),
        "bf16_t": torch.randn(9, 4, generator=g).bfloat16().t(),
        "odd": torch.arange(37, dtype=torch.int16),
        "u8": torch.arange(11, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
    }


def _deflated(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def _checkpoint(tmp_path: Path, kind: str) -> Path:
    src = tmp_path / "plain.pt"
    torch.save(_state(), src, _use_new_zipfile_serialization=kind != "legacy")
    if kind == "big-endian":
        big_endian_copy(src, tmp_path / "big.pt")
        return tmp_path / "big.pt"
    if kind == "deflated":
        _deflated(src, tmp_path / "deflated.pt")
        return tmp_path / "deflated.pt"
    return src


@pytest.mark.parametrize("kind", ["zip", "legacy", "big-endian", "deflated"])
def test_small_chunks_write_the_same_file(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _checkpoint(tmp_path, kind)
    convert_file(src, tmp_path / "default.safetensors")
    # Chunks of 24 bytes (tensors of many chunks through the one buffer, tails shorter than
    # a chunk, elements split across reads), every strided span mapped, and chunks from 8
    # bytes up counting as large (written before the next is asked for).
    monkeypatch.setattr(archive, "CHUNK", 24)
    monkeypatch.setattr(torch_pickle, "CHUNK", 24)
    monkeypatch.setattr(torch_pickle, "_SPAN_READ_MAX", 0)
    monkeypatch.setattr(writer, "WRITEV_BYTES", 8)
    report = convert_file(src, tmp_path / "small.safetensors", verify=True)
    assert report.verified in ("torch", "reader")
    small = (tmp_path / "small.safetensors").read_bytes()
    assert small == (tmp_path / "default.safetensors").read_bytes()


def test_reused_chunks_share_one_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "CHUNK", 16)
    monkeypatch.setattr(torch_pickle, "CHUNK", 16)
    monkeypatch.setattr(torch_pickle, "_SPAN_READ_MAX", 0)
    src = _checkpoint(tmp_path, "zip")
    with load_checkpoint(src) as ck:
        for name in ("w", "w_t", "neg"):
            rec = ck.tensors[name]
            kept = [np.frombuffer(c, np.uint8).copy() for c in ck.tensor_chunks(rec)]
            # Each piece used before the next is asked for: the same bytes.
            used = [np.frombuffer(c, np.uint8).copy() for c in ck.tensor_chunks(rec, reuse=True)]
            assert b"".join(map(bytes, used)) == b"".join(map(bytes, kept)) != b""
            views = [np.frombuffer(c, np.uint8) for c in ck.tensor_chunks(rec, reuse=True)]
            assert len(views) > 2 and all(np.shares_memory(views[0], v) for v in views)
        # Tensors after one another take the same buffer, not one each.
        first = np.frombuffer(next(ck.tensor_chunks(ck.tensors["w"], reuse=True)), np.uint8)
        second = np.frombuffer(next(ck.tensor_chunks(ck.tensors["odd"], reuse=True)), np.uint8)
        assert np.shares_memory(first, second)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_conversion_peak_is_one_chunk(tmp_path: Path) -> None:
    src = tmp_path / "ckpt.bin"
    # 128 MiB: tensors of several 16 MiB chunks and a tail, and small ones.
    state = {f"w{i}": torch.ones(4096, 2048 + i) for i in range(4)}
    state.update({f"b{i}": torch.ones(100 + i) for i in range(50)})
    torch.save(state, src)
    setup = "from pysafetensors.convert import convert_file"
    action = "convert_file(sys.argv[1], sys.argv[2])"
    grew = peak_growth_kib(setup, action, str(src), str(tmp_path / "out.safetensors"))
    # One 16 MiB buffer: 15.8 MiB measured. A fresh buffer per chunk (the previous one still
    # held) and a copy of each made it 47.8 MiB.
    assert grew < 28 * 1024, f"grew by {grew} KiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_verification_lets_go_of_what_it_has_read(tmp_path: Path) -> None:
    src, out = tmp_path / "ckpt.bin", tmp_path / "out.safetensors"
    # 136 MiB, and a transposed tensor hashed through copies of blocks of its rows.
    state = {f"w{i}": torch.ones(4096, 2048 + i) for i in range(4)}
    state["t"] = torch.ones(512, 4096).t()
    torch.save(state, src)
    convert_file(src, out)
    setup = "import torch\nfrom pysafetensors.convert import verify_conversion"
    action = "assert verify_conversion(sys.argv[1], sys.argv[2]) == 'torch'"
    grew = peak_growth_kib(setup, action, str(src), str(out))
    # 27 MiB measured: one tensor's 4 MiB pieces of the checkpoint mapped, the transposed
    # one's 8 MiB span, buffers. Pages read stayed mapped, and blocks were fresh copies: 144 MiB.
    assert grew < 64 * 1024, f"grew by {grew} KiB"
