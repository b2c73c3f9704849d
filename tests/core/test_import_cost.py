"""What importing the package and its numpy module brings in: only what a call needs.

ml_dtypes takes ~1 s to import on a small host (numpy ~0.1 s); the numpy module's table of
format code to numpy type imported it for every user, though only BF16, the FP8 types, F4 and
F6 need it. Each check runs in a fresh interpreter, where ``sys.modules`` says what was loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from pysafetensors.numpy import save_file

_PROBE = r"""
import json, sys
path_f32, path_bf16 = sys.argv[1:3]
seen = {}
from pysafetensors.numpy import load_file, _getdtype
seen["import"] = "ml_dtypes" in sys.modules
assert load_file(path_f32)["w"].dtype.name == "float32"
assert _getdtype("F32").__name__ == "float32" and _getdtype("BOOL") is bool
seen["f32"] = "ml_dtypes" in sys.modules
assert load_file(path_bf16)["w"].dtype.name == "bfloat16"
seen["bf16"] = "ml_dtypes" in sys.modules
print(json.dumps(seen))
"""


def test_numpy_module_imports_ml_dtypes_only_for_the_types_that_need_it(tmp_path: Path) -> None:
    f32, bf16 = tmp_path / "f32.safetensors", tmp_path / "bf16.safetensors"
    save_file({"w": np.arange(4, dtype=np.float32)}, f32)
    save_file({"w": np.arange(4).astype(ml_dtypes.bfloat16)}, bf16)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(f32), str(bf16)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(proc.stdout) == {"import": False, "f32": False, "bf16": True}


def test_the_reference_table_is_still_there_in_full() -> None:
    # _TYPES is made on first use, with every code the reference's table has, and listed.
    import safetensors.numpy as theirs

    import pysafetensors.numpy as ours

    assert "_TYPES" in dir(ours)
    assert all(ours._TYPES[code] is t for code, t in theirs._TYPES.items())
    assert ours._TYPES["BF16"] is ml_dtypes.bfloat16 and "F4" not in ours._TYPES
    assert all(ours._getdtype(code) is t for code, t in ours._TYPES.items())
