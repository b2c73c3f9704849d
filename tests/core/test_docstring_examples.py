"""The examples in docstrings run and print what they show (``doctest``).

Examples that need a model file, a process group or a network are marked ``+SKIP`` in place;
modules whose framework is not installed are skipped.
"""

from __future__ import annotations

import doctest
import importlib
import tempfile
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "pysafetensors"
MODULES = sorted(
    f"pysafetensors.{path.stem}" if path.stem != "__init__" else "pysafetensors"
    for path in SRC.glob("*.py")
    if ">>> " in path.read_text(encoding="utf-8")
)
NEEDS = {
    "pysafetensors.flax": "jax",
    "pysafetensors.mlx": "mlx.core",
    "pysafetensors.paddle": "paddle",
    "pysafetensors.tensorflow": "tensorflow",
    "pysafetensors.torch": "torch",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    monkeypatch.chdir(tmp_path)  # examples that write relative paths write here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and tempfile.mkdtemp() here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
