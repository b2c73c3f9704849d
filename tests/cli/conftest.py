"""Fixtures for the command-line tests: the real console script, example files, a model folder
written by hand, malformed files built byte by byte, and a loopback HTTP server with Range."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from pysafetensors._cli import main
from pysafetensors.numpy import save_file

from .rangehttp import RangeHTTPServer


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("FORCE_COLOR", None)
    env["PYTHONIOENCODING"] = "utf-8"
    return env


@pytest.fixture(scope="session")
def cli() -> Callable[..., Result]:
    """Run ``main(ARGS)`` in this process, capturing stdout/stderr (fast: no interpreter start).

    It is the same code path as the console script; the ``cli_proc`` fixture runs the real one.
    """

    def run(*args: str | os.PathLike[str]) -> Result:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse usage errors and --help
                code = exc.code if isinstance(exc.code, int) else 2
        return Result(code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture(scope="session")
def cli_proc() -> Callable[..., Result]:
    """Run ``python -m pysafetensors ARGS`` in a subprocess, as a user would."""

    def run(*args: str | os.PathLike[str], timeout: float = 60) -> Result:
        proc = subprocess.run(
            [sys.executable, "-m", "pysafetensors", *map(str, args)],
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=timeout,
            env=_env(),
            check=False,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture(scope="session")
def console_script() -> str:
    """The installed ``pysafetensors`` entry point next to this interpreter."""
    found = shutil.which("pysafetensors", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("the pysafetensors console script is not installed in this environment")
    return found


def example_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "model.embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "model.layers.0.attn.q.weight": rng.standard_normal((32, 32)).astype(ml_dtypes.bfloat16),
        "model.layers.0.attn.q.bias": np.linspace(-1, 1, 32).astype(np.float16),
        "model.layers.0.norm.weight": np.ones(32, np.float32),
        "step": np.array(1000, np.int64),
    }


@pytest.fixture
def example(tmp_path: Path) -> Path:
    """A small model-shaped file with ``format`` metadata."""
    path = tmp_path / "model.safetensors"
    save_file(example_tensors(), str(path), metadata={"format": "pt", "source": "example"})
    return path


def write_sharded(folder: Path, tensors: dict[str, np.ndarray], split: list[list[str]]) -> Path:
    """Write shards and a hub-style ``model.safetensors.index.json`` by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    n = len(split)
    for i, names in enumerate(split, 1):
        shard = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(folder / shard), metadata={"format": "pt"})
        for k in names:
            weight_map[k] = shard
            total += tensors[k].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """The example tensors split over two shards, with an index."""
    names = list(example_tensors())
    return write_sharded(tmp_path / "sharded", example_tensors(), [names[:2], names[2:]])


def raw_file(header: dict[str, Any] | bytes, data: bytes, *, pad: bool = True) -> bytes:
    """A file built byte by byte (so it can break every rule)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture(scope="session")
def http_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("http")
    save_file(example_tensors(), str(root / "model.safetensors"), metadata={"format": "pt"})
    # A file much larger than the bytes `inspect` needs (1 MiB of data, a small header).
    big = {"big": np.arange(256 * 1024, dtype=np.float32)}
    save_file(big, str(root / "big.safetensors"), metadata={"format": "pt"})
    names = list(example_tensors())
    write_sharded(root / "sharded", example_tensors(), [names[:3], names[3:]])
    return root


@pytest.fixture(scope="session")
def http_server(http_root: Path) -> Iterator[RangeHTTPServer]:
    pytest.importorskip("pysafetensors._remote", reason="remote opening is not available yet")
    server = RangeHTTPServer(http_root)
    yield server
    server.close()
