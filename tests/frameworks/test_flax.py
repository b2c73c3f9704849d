"""pysafetensors.flax against jax and the reference's safetensors.flax."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("safetensors.flax")

import pysafetensors.flax as pflax  # noqa: E402
import pysafetensors.numpy as pnp  # noqa: E402
from pysafetensors import SerializeError  # noqa: E402

from .cases import same_bits, sample  # noqa: E402
from .suite import FrameworkSuite  # noqa: E402

_CODES = (
    "BOOL F4 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 "
    "C64 F64 I64 U64"
)
_REF_READS = "BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    """64-bit types on, as a model with int64 ids or float64 buffers needs (restored after)."""
    before = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


class TestFlax(FrameworkSuite):
    module = "flax"
    aliases = ("flax", "jax")
    supported = frozenset(_CODES.split())
    ref_load_file = frozenset(_REF_READS.split())
    ref_load = frozenset(_REF_READS.split()) - {"BF16"}
    # Everything but F4: the reference's TensorSpec has no name for ml_dtypes' float4_e2m1fn.
    ref_save = supported - {"F4"}

    def to_fw(self, arr: np.ndarray) -> Any:
        return jnp.asarray(arr)

    def to_np(self, tensor: Any) -> np.ndarray:
        assert isinstance(tensor, jax.Array)
        return np.asarray(tensor)


def test_x64_off_narrows_with_a_warning() -> None:
    jax.config.update("jax_enable_x64", False)
    data = pnp.save({"i": np.arange(3, dtype=np.int64)})
    with pytest.warns(UserWarning, match="jax_enable_x64"):
        got = pflax.load(data)["i"]
    assert got.dtype == jnp.int32
    assert np.asarray(got).tolist() == [0, 1, 2]


def test_f6_refused_with_a_pointer_to_numpy() -> None:
    data = pnp.save({"x": sample("F6_E2M3", (2, 4))})
    with pytest.raises(TypeError, match="framework='numpy'"):
        pflax.load(data)


def test_reference_mutates_the_dict_and_we_do_not() -> None:
    import safetensors.flax as ref

    tensors = {"a": jnp.ones(3)}
    pflax.save(tensors)
    assert isinstance(tensors["a"], jax.Array)
    ref.save(tensors)
    assert isinstance(tensors["a"], np.ndarray)  # the reference's documented quirk


def test_bf16_and_fp8_values() -> None:
    tensors = {
        "bf": jnp.array([1.5, -2.0, 3.25], jnp.bfloat16),
        "e4": jnp.array([0.5, -448.0], jnp.float8_e4m3fn),
        "e5": jnp.array([2.0, 57344.0], jnp.float8_e5m2),
    }
    loaded = pflax.load(pflax.save(tensors))
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype
        assert same_bits(np.asarray(loaded[name]), np.asarray(value))


def test_save_takes_whatever_np_asarray_takes_as_the_reference() -> None:
    import safetensors.flax as ref
    from flax import nnx

    torch = pytest.importorskip("torch")
    values = {
        "param": lambda: nnx.Param(jnp.ones(2)),  # flax NNX state values
        "torch": lambda: torch.arange(3, dtype=torch.float32),
        "range": lambda: range(3),
        "view": lambda: memoryview(b"ab"),
        "float": lambda: 1.5,
    }
    for name, make in values.items():
        # Fresh dicts: the reference replaces the values of the one it is given.
        assert pflax.save({name: make()}) == ref.save({name: make()}), name
    # What numpy turns into an array of objects or strings: the reference's text.
    with pytest.raises(SerializeError, match='Unknown dtype "object"'):
        pflax.save({"a": None})
    with pytest.raises(SerializeError, match='Unknown dtype "str96"'):
        pflax.save({"a": "abc"})


def test_the_reference_modules_names() -> None:
    import pysafetensors
    from pysafetensors.flax import _jnp2np, _np2jnp, numpy, safe_open

    assert safe_open is pysafetensors.safe_open and numpy is pnp
    arrays = _np2jnp({"a": np.ones(2, np.float32)})
    assert isinstance(arrays["a"], jax.Array)
    assert isinstance(_jnp2np(arrays)["a"], np.ndarray)


def test_x64_warning_points_at_the_callers_line(tmp_path: Any) -> None:
    from pysafetensors import safe_open

    jax.config.update("jax_enable_x64", False)
    path = tmp_path / "i.safetensors"
    pnp.save_file({"i": np.arange(3, dtype=np.int64)}, path)
    with pytest.warns(UserWarning, match="jax_enable_x64") as caught:
        pflax.load(pnp.save({"i": np.arange(3, dtype=np.int64)}))
        pflax.load_file(path)
        with safe_open(path, "flax") as f:
            f.get_tensor("i")
            f.get_slice("i")[:2]
    assert {w.filename for w in caught} == {__file__}


def test_loaded_arrays_do_not_read_the_file_afterwards(tmp_path: Any) -> None:
    """jnp.asarray copies asynchronously: the copy out of the memory map ran after the load
    had returned, so a file truncated right after killed the process (SIGBUS) and one
    rewritten put its new bytes into arrays already returned. Run in a child, which such a
    crash kills instead of the test run."""
    import subprocess
    import sys

    path = tmp_path / "t.safetensors"
    script = f"""
import os, numpy as np, jax
import pysafetensors, pysafetensors.flax, pysafetensors.numpy
path = {str(path)!r}
sums = []
for load in ("get_tensor", "load_file"):
    pysafetensors.numpy.save_file({{"a": np.ones(1 << 20, np.float32)}}, path)
    if load == "get_tensor":
        with pysafetensors.safe_open(path, "flax") as f:
            t = f.get_tensor("a")
    else:
        t = pysafetensors.flax.load_file(path)["a"]
    os.truncate(path, 100)
    sums.append(float(t.sum()))
print(sums)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == str([float(1 << 20)] * 2)
