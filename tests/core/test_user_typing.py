"""Users' typed code: what the README shows passes ``mypy --strict``, and mistakes the types
can see are caught (the package ships ``py.typed``, so its annotations are the users' checks).

Each case is a small program checked by a real mypy run against this checkout's sources. The
programs with mistakes prove the check is not vacuous: were the package's types unreadable
(everything ``Any``), the correct programs would pass too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mypy")

SRC = Path(__file__).resolve().parents[2] / "src"

#: numpy programs need no framework's types: the frameworks are skipped (fast: a few seconds).
_SKIP_FRAMEWORKS = """
[mypy-torch.*,jax.*,jaxlib.*,flax.*,tensorflow.*,paddle.*,mlx.*,fsspec.*,boto3.*,botocore.*,rich.*,tqdm.*]
follow_imports = skip
ignore_missing_imports = True
"""

_NUMPY_GOOD = """
import re
from typing import Any

import numpy as np

from pysafetensors import ShardedSafeOpen, safe_open
from pysafetensors.numpy import load_file, save_file
from pysafetensors.parallel import Rules, load_shard

save_file({"a": np.zeros(2)}, b"x.safetensors")  # bytes paths are taken at run time
save_file({"a": np.zeros(2)}, "x.safetensors", metadata={"k": "v"})
arrays: dict[str, np.ndarray[Any, Any]] = load_file("x.safetensors")  # numpy < 2.3: no defaults
# The README's rules, assigned to a variable first: typed dict[str, str].
rules = {"*.q_proj.weight": "rows", "*.o_proj.weight": "columns", "*norm*": "replicate"}
part = load_shard("x.safetensors", rank=0, world_size=8, rules=rules, framework="np")
by_regex = {re.compile(r".*\\.weight"): 0}
load_shard("x.safetensors", rank=0, world_size=8, rules=by_regex, framework="np")
pairs = [("*.weight", "rows"), ("*", "replicate")]
load_shard("x.safetensors", rank=0, world_size=8, rules=pairs, framework="np")
typed: Rules = {"*": 1}
with safe_open("x.safetensors", framework="np") as f:
    names: list[str] = f.keys()
with ShardedSafeOpen("ckpt", framework="np") as g:
    where: str = g.shard_of("a")
"""

_NUMPY_BAD = """
import numpy as np

from pysafetensors.numpy import save_file
from pysafetensors.parallel import load_shard

save_file({"a": np.zeros(2)}, 3)  # E: not a path
save_file({"a": np.zeros(2)}, "x.safetensors", metadata={"k": 1})  # E: metadata values are str
load_shard("x.safetensors", rank=0, world_size=8, rules={"*": 1.5})  # E: a split is no float
"""

_TORCH_GOOD = """
import torch

from pysafetensors.torch import load_file, save, save_file

params: dict[str, torch.nn.Parameter] = {"w": torch.nn.Parameter(torch.zeros(2))}
save_file(params, "p.safetensors")
data: bytes = save(params)
tensors: dict[str, torch.Tensor] = load_file("p.safetensors")
"""

_TORCH_BAD = """
from pysafetensors.torch import save_file

save_file({"w": [1.0, 2.0]}, "p.safetensors")  # E: not tensors
"""


#: Whether errors in the package itself fail the test: it is typed against numpy 2.3's stubs
#: and later (ndarray's default type arguments, narrower shapes). The package is read from
#: source here, where mypy reports its own errors; installed, mypy keeps them to itself, so
#: users' code is checked the same with older numpy.
_PACKAGE_CHECKED = np.lib.NumpyVersion(np.__version__) >= "2.3.0"


def _mypy(tmp_path: Path, programs: dict[str, str], config: str) -> dict[str, list[int]]:
    """Run mypy --strict on ``programs`` (module name to source); the lines with errors, per
    program."""
    for name, text in programs.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    (tmp_path / "mypy.ini").write_text("[mypy]\nstrict = True\n" + config)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            str(tmp_path / "cache"),
            *(f"{name}.py" for name in programs),
        ],
        cwd=tmp_path,
        env={"MYPYPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors: dict[str, list[int]] = {name: [] for name in programs}
    for line in done.stdout.splitlines():
        found = re.match(r"([\w]+)\.py:(\d+): error:", line)
        if found:
            errors[found[1]].append(int(found[2]))
        elif _PACKAGE_CHECKED:
            assert not re.match(r".*: error:", line), done.stdout  # e.g. in the package itself
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return errors


def _marked(text: str) -> list[int]:
    """The lines of ``text`` (as written to disk) marked ``# E:``."""
    lines = textwrap.dedent(text).lstrip().splitlines()
    return [i for i, line in enumerate(lines, 1) if "# E:" in line]


def test_readme_style_numpy_code_type_checks_and_mistakes_are_caught(tmp_path: Path) -> None:
    errors = _mypy(tmp_path, {"good": _NUMPY_GOOD, "bad": _NUMPY_BAD}, _SKIP_FRAMEWORKS)
    assert errors["good"] == []
    assert errors["bad"] == _marked(_NUMPY_BAD)


@pytest.mark.slow  # mypy reads torch's own annotations: ~45 s
def test_torch_saves_take_dicts_of_any_tensor_type(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    errors = _mypy(tmp_path, {"good": _TORCH_GOOD, "bad": _TORCH_BAD}, "")
    assert errors["good"] == []
    assert errors["bad"] == _marked(_TORCH_BAD)
