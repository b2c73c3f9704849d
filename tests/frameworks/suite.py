"""One test suite, run once per framework by the ``test_<framework>.py`` modules.

Each module subclasses :class:`FrameworkSuite` and fills in how to convert to and from numpy,
which dtypes the framework holds, and which of them the reference (``safetensors`` 0.8.0) can
read and write for that framework (measured, not assumed; see the module of each framework).
Tests marked ``@pytest.mark.codes(attr)`` run once per dtype code in that class attribute
(``conftest.py`` does the parametrizing), so nothing is collected only to be skipped.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import numpy as np
import pytest

import pysafetensors.numpy as pnp
from pysafetensors import DTypeNotSupportedError, SafetensorError, SerializeError, safe_open

from .cases import BY_CODE, same_bits, sample, snapshot

ALL_CODES = list(BY_CODE)


def codes_for(cls: type, which: str) -> list[str]:
    """The dtype codes a ``@pytest.mark.codes(which)`` test runs over, in table order."""
    if which == "unsupported":
        return [c for c in ALL_CODES if c not in cls.supported]  # type: ignore[attr-defined]
    chosen = getattr(cls, which)
    return [c for c in ALL_CODES if c in chosen]


class FrameworkSuite:
    """Tests shared by every framework (not collected itself: no ``Test`` prefix)."""

    #: Public module name under ``pysafetensors`` and ``safetensors``.
    module: ClassVar[str]
    #: Names ``safe_open(framework=...)`` accepts for it.
    aliases: ClassVar[tuple[str, ...]]
    #: dtype codes the framework holds.
    supported: ClassVar[frozenset[str]]
    #: Codes whose files the reference's ``load_file`` / ``load`` read into this framework with
    #: the same bits, and codes whose tensors the reference's ``save`` can write.
    ref_load_file: ClassVar[frozenset[str]]
    ref_load: ClassVar[frozenset[str]]
    ref_save: ClassVar[frozenset[str]]

    def to_fw(self, arr: np.ndarray) -> Any:
        """A framework tensor holding ``arr``'s values (built without our adapter)."""
        raise NotImplementedError

    def to_np(self, tensor: Any) -> np.ndarray:
        """The values of a framework tensor as numpy (built without our adapter)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ helpers

    @property
    def ours(self) -> Any:
        return importlib.import_module(f"pysafetensors.{self.module}")

    @property
    def ref(self) -> Any:
        return importlib.import_module(f"safetensors.{self.module}")

    # -------------------------------------------------------------------------------- tests

    @pytest.mark.codes("supported")
    def test_round_trip_bytes(self, code: str) -> None:
        arr = sample(code)
        data = self.ours.save({"x": self.to_fw(arr)}, metadata={"format": self.module})
        # Byte-identical to the numpy writer, which is byte-identical to the reference.
        assert data == pnp.save({"x": arr}, metadata={"format": self.module})
        assert same_bits(self.to_np(self.ours.load(data)["x"]), arr)

    @pytest.mark.parametrize("backend", ["mmap", "pread"])
    @pytest.mark.codes("supported")
    def test_round_trip_file(self, tmp_path: Any, code: str, backend: str) -> None:
        arr = sample(code)
        path = tmp_path / "t.safetensors"
        self.ours.save_file({"x": self.to_fw(arr), "y": self.to_fw(arr[:1])}, path)
        loaded = self.ours.load_file(path, backend=backend)
        assert list(loaded) == ["x", "y"]
        assert same_bits(self.to_np(loaded["x"]), arr)
        assert same_bits(self.to_np(loaded["y"]), arr[:1])

    @pytest.mark.codes("unsupported")
    def test_unsupported_dtype_refused(self, code: str) -> None:
        with pytest.raises(DTypeNotSupportedError, match=code):
            self.ours.load(pnp.save({"x": sample(code)}))

    def test_caller_dict_not_mutated(self, tmp_path: Any) -> None:
        tensors = {"a": self.to_fw(sample("F32")), "b": self.to_fw(sample("I32", (5,)))}
        before = snapshot(tensors)
        self.ours.save(tensors)
        self.ours.save_file(tensors, tmp_path / "t.safetensors")
        assert snapshot(tensors) == before
        # The reference does replace the values (flax, tensorflow); ours must not.

    def test_scalar_and_empty(self) -> None:
        tensors = {
            "scalar": self.to_fw(np.array(3.5, np.float32)),
            "empty": self.to_fw(np.zeros((0, 3), np.float32)),
        }
        loaded = self.ours.load(self.ours.save(tensors))
        assert self.to_np(loaded["scalar"]).shape == ()
        assert float(self.to_np(loaded["scalar"])) == 3.5
        assert self.to_np(loaded["empty"]).shape == (0, 3)

    @pytest.mark.codes("ref_load_file")
    def test_reference_load_file_reads_ours(self, tmp_path: Any, code: str) -> None:
        arr = sample(code)
        path = tmp_path / "ours.safetensors"
        self.ours.save_file({"x": self.to_fw(arr)}, path)
        assert same_bits(self.to_np(self.ref.load_file(str(path))["x"]), arr)

    @pytest.mark.codes("ref_load")
    def test_reference_load_reads_ours(self, code: str) -> None:
        arr = sample(code)
        data = self.ours.save({"x": self.to_fw(arr)})
        assert same_bits(self.to_np(self.ref.load(data)["x"]), arr)

    @pytest.mark.codes("ref_save")
    def test_reference_save_is_byte_identical(self, tmp_path: Any, code: str) -> None:
        arr = sample(code)
        tensors = {"x": self.to_fw(arr), "b": self.to_fw(sample("F32", (2,)))}
        ours = self.ours.save(tensors, metadata={"k": "v"})
        # The reference may replace the values of the dict it is given: hand it a copy.
        theirs = self.ref.save(dict(tensors), metadata={"k": "v"})
        assert ours == theirs
        assert same_bits(self.to_np(self.ours.load(theirs)["x"]), arr)
        self.ref.save_file(dict(tensors), str(tmp_path / "ref.safetensors"))
        self.ours.save_file(tensors, tmp_path / "ours.safetensors")
        assert (tmp_path / "ref.safetensors").read_bytes() == (
            tmp_path / "ours.safetensors"
        ).read_bytes()

    def test_safe_open_aliases_and_slices(self, tmp_path: Any) -> None:
        arr = sample("F32", (6, 4))
        bf = sample("BF16", (6, 4))
        path = tmp_path / "t.safetensors"
        pnp.save_file({"w": arr, "h": bf}, path)
        for alias in self.aliases:
            for backend in ("mmap", "pread"):
                with safe_open(path, alias, backend=backend) as f:
                    assert f.keys() == ["h", "w"]
                    assert same_bits(self.to_np(f.get_tensor("w")), arr)
                    assert same_bits(self.to_np(f.get_slice("w")[1:4, 2:]), arr[1:4, 2:])
                    assert same_bits(self.to_np(f.get_slice("h")[:, 1]), bf[:, 1])
                    got = f.get_tensors()
                    assert list(got) == ["w", "h"]

    def test_reference_safe_open_reads_ours(self, tmp_path: Any) -> None:
        import safetensors

        arr = sample("F32", (6, 4))
        path = tmp_path / "t.safetensors"
        self.ours.save_file({"w": self.to_fw(arr)}, path)
        with safetensors.safe_open(str(path), self.aliases[0]) as f:
            assert same_bits(self.to_np(f.get_tensor("w")), arr)
            assert same_bits(self.to_np(f.get_slice("w")[1:3]), arr[1:3])

    def test_non_cpu_device_refused(self, tmp_path: Any) -> None:
        path = tmp_path / "t.safetensors"
        pnp.save_file({"x": sample("F32")}, path)
        # No accelerator here: every framework must refuse a CUDA device with a clear error.
        with pytest.raises(SafetensorError, match="cuda"):
            safe_open(path, self.aliases[0], device="cuda:0")

    def test_wrong_value_type_refused(self) -> None:
        with pytest.raises(SerializeError):
            self.ours.save({"x": "not a tensor"})
