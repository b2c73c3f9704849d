"""torch saves and ``load_model`` keep nothing of the caller's tensors once they return: no
cache holds a tensor (which would keep a model's weights alive after the model is gone), and a
tensor whose memory changed in place (``set_``) is checked as it is now, not as it was."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ref = pytest.importorskip("safetensors.torch")

import pysafetensors.torch as st_torch  # noqa: E402
from pysafetensors import SafetensorError  # noqa: E402


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 64)
        self.head = torch.nn.Linear(64, 256, bias=False)
        self.head.weight = self.emb.weight


def _dies(make_and_use: object) -> bool:
    """Whether the parameter ``make_and_use()`` returns a weak reference to is freed."""
    ref_to_param = make_and_use()  # type: ignore[operator]
    gc.collect()
    return bool(ref_to_param() is None)


def _tensors_over(ptr: int, nbytes: int) -> int:
    """Live tensors (as the collector sees them) whose storage is the one at ``ptr``."""
    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if issubclass(type(o), torch.Tensor)
        and o.untyped_storage().data_ptr() == ptr
        and o.untyped_storage().nbytes() == nbytes
    )


@pytest.mark.parametrize("lib", [st_torch, ref], ids=["ours", "reference"])
def test_save_model_keeps_no_view_of_a_tied_weight(tmp_path: Path, lib: object) -> None:
    # save_model checks state_dict()'s views (new ones every call) for shared memory.
    model = Tied()
    storage = model.emb.weight.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    del storage
    lib.save_model(model, str(tmp_path / "tied.safetensors"))  # type: ignore[attr-defined]
    assert _tensors_over(ptr, nbytes) >= 1  # the model's own parameter
    del model
    assert _tensors_over(ptr, nbytes) == 0


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_load_model_keeps_no_parameter_alive(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "tied.safetensors"
    st_torch.save_model(Tied(), path)

    def use() -> weakref.ref[torch.nn.Parameter]:
        model = Tied()
        assert st_torch.load_model(model, path, backend=backend) == (set(), [])
        return weakref.ref(model.emb.weight)

    assert _dies(use)


@pytest.mark.parametrize("lib", [st_torch, ref], ids=["ours", "reference"])
def test_a_tensor_moved_in_place_is_checked_as_it_is_now(lib: object) -> None:
    base = torch.zeros(10)
    x, y = base[:5], base[5:]
    lib.save({"x": x, "y": y})  # type: ignore[attr-defined]  # apart: accepted
    with torch.no_grad():
        x.set_(base.untyped_storage(), 0, (8,))  # now elements 0-7: overlaps y
    with pytest.raises(RuntimeError, match="Some tensors share memory") as caught:
        lib.save({"x": x, "y": y})  # type: ignore[attr-defined]
    if lib is st_torch:
        assert isinstance(caught.value, SafetensorError)
