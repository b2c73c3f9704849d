"""The API surface (spec §4): handles, messages, devices, torch refusals, save_model/load_model,
and errors that survive pickling."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import pysafetensors
from pysafetensors import (
    ClosedFileError,
    HeaderSizeError,
    OffsetError,
    SafetensorError,
    TensorNotFoundError,
    safe_open,
)
from pysafetensors.numpy import save_file


@pytest.fixture()
def path(tmp_path: Path) -> Path:
    p = tmp_path / "m.safetensors"
    save_file(
        {
            "zeta": np.arange(4, dtype=np.int64),
            "alpha": np.ones((2, 2), np.float32),
            "mid": np.zeros(3, np.uint8),
            "Beta": np.zeros(1, np.float64),
        },
        p,
        metadata={"format": "np"},
    )
    return p


def test_keys_sorted_offset_keys_file_order(path: Path) -> None:
    with safe_open(path, "np") as f:
        assert f.keys() == ["Beta", "alpha", "mid", "zeta"]
        # File order: I64, F64, F32, U8 (dtype rank).
        assert f.offset_keys() == ["zeta", "Beta", "alpha", "mid"]
        assert list(f.get_tensors()) == f.offset_keys()
        assert f.metadata() == {"format": "np"}


def test_context_manager_and_closed(path: Path) -> None:
    with safe_open(path, "np") as f:
        t = f.get_tensor("zeta")
        s = f.get_slice("zeta")
    np.testing.assert_array_equal(t, np.arange(4))  # tensors outlive the handle
    for call in (f.keys, f.offset_keys, f.metadata, f.get_tensors):
        with pytest.raises(ClosedFileError, match="^File is closed$"):
            call()
    with pytest.raises(ClosedFileError, match="File is closed"):
        f.get_tensor("zeta")
    # Slices keep the file open, as with the reference (its slices hold the storage).
    np.testing.assert_array_equal(s[1:3], np.arange(1, 3))
    with pytest.raises(ClosedFileError, match="File is closed"):
        f.get_slice("zeta")
    g = safe_open(path, "np")  # usable without `with`
    assert g.keys()
    g.close()
    g.close()  # idempotent


def test_missing_tensor(path: Path) -> None:
    with safe_open(path, "np") as f:
        for call in (f.get_tensor, f.get_slice):
            with pytest.raises(TensorNotFoundError) as info:
                call("nope")
            assert str(info.value) == "File does not contain tensor nope"
            assert isinstance(info.value, KeyError)


def test_a_missing_name_that_is_not_valid_unicode_is_escaped_in_the_message(
    path: Path, tmp_path: Path
) -> None:
    """A lone surrogate looked up: its message printed (or logged to a UTF-8 stream) raised
    UnicodeEncodeError; the escape keeps it printable, the exception keeps the name."""
    from pysafetensors.numpy import save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": np.zeros(1, np.float32)}, folder / "model.safetensors")
    for target in (path, folder):
        with safe_open(target, "np") as f:
            for call in (f.get_tensor, f.get_slice):
                with pytest.raises(TensorNotFoundError) as info:
                    call("x\ud800")
                assert str(info.value) == "File does not contain tensor x\\ud800"
                assert str(info.value).encode("utf-8") and info.value.tensor == "x\ud800"


@pytest.mark.parametrize("framework", ["numpyy", "PT", "", "jnp"])
def test_invalid_framework(path: Path, framework: str) -> None:
    with pytest.raises(SafetensorError, match=f"^framework {framework} is invalid$"):
        safe_open(path, framework)


def test_invalid_backend(path: Path) -> None:
    with pytest.raises(SafetensorError) as info:
        safe_open(path, "np", backend="x")
    assert str(info.value) == 'backend "x" is invalid (expected one of: "mmap", "pread")'


@pytest.mark.parametrize("device", ["foo", "gpu", "cuda0"])
def test_invalid_device(path: Path, device: str) -> None:
    with pytest.raises(SafetensorError, match=f"^device {device} is invalid$"):
        safe_open(path, "pt", device=device)


def test_device_bad_index(path: Path) -> None:
    with pytest.raises(ValueError, match="invalid digit found in string"):
        safe_open(path, "pt", device="cuda:x")


def test_numpy_refuses_gpu(path: Path) -> None:
    with pytest.raises(SafetensorError, match="^Device cuda:0 is not supported for framework"):
        safe_open(path, "np", device="cuda:0")


def test_cuda_on_cpu_only_machine(path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SafetensorError) as info:
        safe_open(path, "pt", device="cuda")
    assert "cuda:0" in str(info.value) and "no CUDA device" in str(info.value)
    assert info.value.kind == "InvalidDevice"


def test_a_torch_cuda_device_without_an_index_is_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process per GPU sets its device (torch.cuda.set_device(local_rank)) and loads with
    # device=torch.device("cuda"): every rank's weights went to GPU 0. The string "cuda" stays
    # cuda:0, as in the reference.
    torch = pytest.importorskip("torch")
    from pysafetensors._devices import Device, parse_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert parse_device(torch.device("cuda")) == Device("cuda", 3)
    assert parse_device(torch.device("cuda", 1)) == Device("cuda", 1)
    assert parse_device("cuda") == Device("cuda", 0)
    assert parse_device(torch.device("cpu")) == Device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_device(torch.device("cuda")) == Device("cuda", 0)  # refused later, as "cuda"


def test_open_errors_keep_oserror_subclass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        safe_open(tmp_path / "missing.safetensors", "np")
    sub = tmp_path / "sub"
    sub.mkdir()
    with pytest.raises(OSError):
        safe_open(sub, "np")  # a directory (not a sharded folder: no index, no shards)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(HeaderSizeError, match="header too small"):
        safe_open(empty, "np")


def test_errors_pickle_round_trip() -> None:
    errors = [
        OffsetError("invalid offset for tensor `t`", kind="InvalidOffset", tensor="t", offset=9),
        TensorNotFoundError("File does not contain tensor x", kind="TensorNotFound", tensor="x"),
        ClosedFileError("File is closed", kind="FileClosed"),
        pysafetensors.UnsafePickleError("no", global_name="os.system", kind="UnsafePickle"),
    ]
    for exc in errors:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc)
        assert str(back) == str(exc)
        assert (back.kind, back.tensor, back.offset) == (exc.kind, exc.tensor, exc.offset)
    assert pickle.loads(pickle.dumps(errors[-1])).global_name == "os.system"


def test_real_error_pickles(tmp_path: Path) -> None:
    with pytest.raises(SafetensorError) as info:
        pysafetensors.deserialize(b"\x10" + bytes(7) + b"{}")
    back = pickle.loads(pickle.dumps(info.value))
    assert back.kind == info.value.kind == "InvalidHeaderLength"


def test_public_names_module() -> None:
    assert pysafetensors.SafetensorError.__module__ == "pysafetensors"
    assert issubclass(pysafetensors.HeaderError, ValueError)


# --------------------------------------------------------------------------------------- torch

torch = pytest.importorskip("torch")
import pysafetensors.torch as st_torch  # noqa: E402 - only when torch is installed


def test_torch_refuses_non_dict() -> None:
    with pytest.raises(ValueError, match="Expected a dict of \\[str, torch.Tensor\\] but received"):
        st_torch.save("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Key `test` is invalid, expected torch.Tensor"):
        st_torch.save({"test": {}})  # type: ignore[dict-item]


def test_torch_refuses_sparse() -> None:
    sparse = torch.zeros(3, 3).to_sparse()
    with pytest.raises(ValueError, match="You are trying to save a sparse tensors: `\\['s'\\]`"):
        st_torch.save({"s": sparse})


def test_torch_refuses_non_contiguous() -> None:
    with pytest.raises(ValueError, match="You are trying to save a non contiguous tensor: `t`"):
        st_torch.save({"t": torch.zeros(3, 4).T})


def test_torch_refuses_shared_memory() -> None:
    base = torch.zeros(4)
    with pytest.raises(RuntimeError, match="Some tensors share memory") as info:
        st_torch.save({"a": base, "b": base})
    assert "save_model" in str(info.value)
    assert isinstance(info.value, SafetensorError)


class Tied(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(4)


def test_save_model_tied_weights_like_reference(tmp_path: Path) -> None:
    ref = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = Tied()
    ours_path, ref_path = tmp_path / "ours.st", tmp_path / "ref.st"
    st_torch.save_model(model, ours_path, metadata={"user": "x"})
    ref.save_model(model, str(ref_path), metadata={"user": "x"})
    with safe_open(ours_path, "pt") as a, safe_open(ref_path, "pt") as b:
        assert a.metadata() == b.metadata() == {"user": "x", "head.weight": "embed.weight"}
        assert a.keys() == b.keys()
        for name in a.offset_keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name))
    # One metadata key besides the user's: the bytes are those of the reference except for
    # metadata order, which the reference randomises; compare the tensors' region.
    ours_bytes, ref_bytes = ours_path.read_bytes(), ref_path.read_bytes()
    assert len(ours_bytes) == len(ref_bytes)
    for loader in (st_torch.load_model, ref.load_model):
        for file in (ours_path, ref_path):
            fresh = Tied()
            missing, unexpected = loader(fresh, str(file))
            assert (list(missing), list(unexpected)) == ([], [])
            assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()
            for name, value in model.state_dict().items():
                assert torch.equal(fresh.state_dict()[name], value)


def test_load_model_strict_message(tmp_path: Path) -> None:
    path = tmp_path / "m.st"
    st_torch.save_file({"other": torch.zeros(1)}, path)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict for Tied") as info:
        st_torch.load_model(Tied(), path)
    assert "Missing key(s)" in str(info.value) and "Unexpected key(s)" in str(info.value)
    missing, unexpected = st_torch.load_model(Tied(), path, strict=False)
    assert "embed.weight" in missing and unexpected == ["other"]
    # The reference's types: a set of missing keys, a list of unexpected ones.
    ref = pytest.importorskip("safetensors.torch")
    assert (missing, unexpected) == ref.load_model(Tied(), str(path), strict=False)
    assert isinstance(missing, set) and isinstance(unexpected, list)


def test_torch_metadata_argument_untouched(tmp_path: Path) -> None:
    meta = {"a": "b"}
    st_torch.save_model(Tied(), tmp_path / "m.st", metadata=meta)
    assert meta == {"a": "b"}
