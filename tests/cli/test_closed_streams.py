"""The command line run with stdout or stderr closed (``>&-``, ``2>&-``): what would be printed
there is discarded, the exit status is the command's, and nothing else changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pysafetensors.numpy import load_file

from .conftest import example_tensors, write_sharded

pytestmark = pytest.mark.skipif(os.name != "posix", reason="closes descriptors with sh")


def _run(close: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m pysafetensors ARGS`` with descriptor ``close`` (``>&-`` or ``2>&-``) closed."""
    return subprocess.run(
        ["sh", "-c", f'exec "$@" {close}', "sh", sys.executable, "-m", "pysafetensors", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )


def test_validate_with_stdout_closed(example: Path, tmp_path: Path) -> None:
    r = _run(">&-", "validate", example)
    assert (r.returncode, r.stderr) == (0, "")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(example.read_bytes()[:-4])
    r = _run(">&-", "validate", bad)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_writing_commands_with_stdout_closed(example: Path, tmp_path: Path) -> None:
    out = tmp_path / "f16.safetensors"
    r = _run(">&-", "cast", example, out, "--to", "F16")
    assert (r.returncode, r.stderr) == (0, "")
    assert load_file(str(out))["model.embed.weight"].dtype == np.float16
    r = _run(">&-", "reshard", example, tmp_path / "rs", "-s", "4KB")
    assert r.returncode == 0 and r.stderr.startswith("wrote ")  # a note: on stderr
    assert (tmp_path / "rs" / "model.safetensors.index.json").is_file()
    r = _run(">&-", "inspect", "--json", example)
    assert (r.returncode, r.stderr) == (0, "")


def test_warnings_with_stderr_closed_stay_out_of_stdout(tmp_path: Path) -> None:
    names = list(example_tensors())
    folder = write_sharded(tmp_path / "m", example_tensors(), [names[:2], names[2:]])
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"  # the wrong shard
    index_path.write_text(json.dumps(index))
    r = _run("2>&-", "inspect", "--json", folder)
    assert r.returncode == 1  # the index disagrees with the shards: warned about, exit 1
    assert not r.stdout.startswith("warning:")
    assert {t["name"] for t in json.loads(r.stdout)["tensors"]} == set(names)
