"""Saves that write copies of non-contiguous torch tensors (``force_contiguous``): the bytes of
the reference and the hub, and memory that does not grow with the model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import peak_growth_kib
from pysafetensors import save_sharded
from pysafetensors.torch import save_model, save_model_sharded

from .conftest import assert_same_tree, torch

reference = pytest.importorskip("safetensors.torch")
serialization = pytest.importorskip("huggingface_hub.serialization")


def _model() -> Any:
    """Parameters and buffers of every kind of non-contiguous layout, with a tied weight."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.t = torch.nn.Parameter(torch.randn(30, 20, generator=gen).t())
    model.p = torch.nn.Parameter(torch.randn(5, 3, 4, generator=gen).permute(2, 0, 1))
    model.lin = torch.nn.Linear(3, 3)
    model.tied = torch.nn.Linear(3, 3)
    model.tied.weight = model.lin.weight
    model.register_buffer("bf16", torch.randn(7, 9, generator=gen).to(torch.bfloat16).t())
    model.register_buffer("fp8", torch.randn(6, 4, generator=gen).to(torch.float8_e4m3fn).t())
    model.register_buffer("c64", torch.randn(3, 5, dtype=torch.complex64, generator=gen).t())
    u8 = torch.arange(60, dtype=torch.uint8).reshape(3, 4, 5)
    model.register_buffer("u8", u8.transpose(0, 2))
    model.register_buffer("flag", (torch.arange(12) % 3 == 0).reshape(3, 4).t())
    return model


@pytest.mark.usefixtures("slabs")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # inside the reference
def test_save_model_writes_the_reference_s_bytes(tmp_path: Path) -> None:
    model = _model()
    reference.save_model(model, str(tmp_path / "r.safetensors"))
    save_model(model, tmp_path / "s.safetensors")
    assert (tmp_path / "r.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()
    # The model itself is left as it was (nothing made contiguous in place).
    assert not model.t.is_contiguous() and not model.bf16.is_contiguous()


@pytest.mark.usefixtures("slabs")
@pytest.mark.parametrize("limit", [200, "1KB", "5GB"])
def test_sharded_saves_write_the_hub_s_shards(tmp_path: Path, limit: int | str) -> None:
    model = _model()
    for name in ("hub_model", "hub_dict"):
        (tmp_path / name).mkdir()
    serialization.save_torch_model(model, str(tmp_path / "hub_model"), max_shard_size=limit)
    save_model_sharded(model, tmp_path / "ours_model", limit)
    # One file holds the tied name and the format in its metadata: in a random order there.
    assert_same_tree(tmp_path / "hub_model", tmp_path / "ours_model", metadata_order=False)
    state = {k: v for k, v in model.state_dict().items() if k != "tied.weight"}
    serialization.save_torch_state_dict(state, str(tmp_path / "hub_dict"), max_shard_size=limit)
    save_sharded(state, tmp_path / "ours_dict", limit)
    assert_same_tree(tmp_path / "hub_dict", tmp_path / "ours_dict")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize("how", ["file", "sharded"])
def test_copies_do_not_add_the_model_s_size_to_the_peak(tmp_path: Path, how: str) -> None:
    # Each tensor was made contiguous up front: 192 MiB of copies held at once.
    setup = """
        import torch
        from pysafetensors.torch import save_model, save_model_sharded
        model = torch.nn.Module()
        for i in range(4):  # 4 x 48 MiB of transposed weights
            weight = torch.ones(1024, 12 * 1024).t()
            model.register_parameter(f"w{i}", torch.nn.Parameter(weight))
    """
    action = """
        if sys.argv[1] == "file":
            save_model(model, sys.argv[2])
        else:
            save_model_sharded(model, sys.argv[2], "100MB")
    """
    grew = peak_growth_kib(setup, action, how, str(tmp_path / "out"))
    # One 16 MiB slab buffer: ~18 MiB measured; 34 MiB while each tensor's last slab had
    # memory of its own and the previous tensor's buffer was still held.
    assert grew < 26 * 1024, f"grew by {grew} KiB"
