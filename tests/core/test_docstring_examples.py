"""The examples in docstrings run and print what they show (``doctest``).

Examples that need a model file, a process group or a network are marked ``+SKIP`` in place;
modules whose framework is not installed are skipped.
"""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys
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


#: Frameworks that start threads at import (jax, tensorflow, paddle, mlx) are imported in a
#: child process, so that this test process stays safe to fork in later tests.
_IN_CHILD = """
import doctest, importlib, sys, tempfile
tempfile.tempdir = sys.argv[2]
result = doctest.testmod(importlib.import_module(sys.argv[1]), optionflags=doctest.ELLIPSIS)
print(result.failed, result.attempted)
"""


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    monkeypatch.chdir(tmp_path)  # examples that write relative paths write here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and tempfile.mkdtemp() here
    if name in NEEDS and name != "pysafetensors.torch":
        run = subprocess.run(
            [sys.executable, "-c", _IN_CHILD, name, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        failed, attempted = map(int, run.stdout.split()[-2:])
        assert failed == 0, f"{failed} of {attempted} examples failed in {name}:\n{run.stdout}"
        return
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
