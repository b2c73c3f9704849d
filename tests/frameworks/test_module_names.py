"""Every name of the reference's framework modules is there in ours (users import private
helpers too: ``_flatten``, ``_tf2np``, ``_view2torch``...), and its functions take the
reference's parameter names (keyword calls of them must keep working)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("safetensors")

#: typing names and modules the reference's modules import for themselves.
_IMPORTED_THERE = {"Array", "Dict", "List", "Optional", "Set", "Tuple", "Union", "os", "sys"}

_SCRIPT = """
import importlib, inspect, json
missing, differ = {}, {}
# Paddle first: importing it after TensorFlow crashes the interpreter.
for name in ("paddle", "numpy", "torch", "flax", "tensorflow", "mlx"):
    try:
        theirs = importlib.import_module("safetensors." + name)
    except ImportError:
        continue  # the framework is not installed
    ours = importlib.import_module("pysafetensors." + name)
    missing[name] = sorted(
        n for n in dir(theirs) if not n.startswith("__") and not hasattr(ours, n)
    )
    for attr in dir(theirs):
        their_fn, our_fn = getattr(theirs, attr), getattr(ours, attr, None)
        if not inspect.isfunction(their_fn) or our_fn is None:
            continue
        their_names = list(inspect.signature(their_fn).parameters)
        our_names = list(inspect.signature(our_fn).parameters)
        # Ours may add optional keyword parameters after the reference's.
        if our_names[: len(their_names)] != their_names:
            differ[name + "." + attr] = [their_names, our_names]
print(json.dumps({"missing": missing, "differ": differ}))
"""


@pytest.fixture(scope="module")
def compared() -> dict[str, Any]:
    # One fresh interpreter for both tests (importing every framework takes ~10 s): the
    # frameworks' import order matters (see the script).
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_framework_modules_have_every_name_the_reference_s_have(compared: dict[str, Any]) -> None:
    missing = compared["missing"]
    assert "numpy" in missing and "torch" in missing
    for name, names in missing.items():
        assert set(names) <= _IMPORTED_THERE, (name, sorted(set(names) - _IMPORTED_THERE))


def test_functions_take_the_reference_s_parameter_names(compared: dict[str, Any]) -> None:
    assert compared["differ"] == {}
