"""A FIFO (or another special file) where a file is expected is refused at once, never waited on.

``open(2)`` of a FIFO for reading blocks until a writer comes: before, every command on a FIFO
with no writer (or on a model folder holding one as a shard, or ``scan *`` over a folder holding
one) hung for ever.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pysafetensors._sources import NotRegularFileError, open_regular_file
from pysafetensors._validate import validate
from pysafetensors.convert import convert_file
from pysafetensors.scan import scan_file, scan_files

from .conftest import example_tensors, write_sharded

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")

#: Seconds a command may take before it counts as hung (each refusal takes well under one).
LIMIT = 30


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _unblock(fifo: Path) -> None:
    # A reader blocked in open() on the FIFO returns once a writer opens it (then sees EOF).
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _returns(fn: Callable[[], Any], fifo: Path) -> Any:
    """``fn()``'s result or exception, failing (instead of hanging) if it blocks on ``fifo``."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(LIMIT)
    if thread.is_alive():
        _unblock(fifo)
        thread.join(LIMIT)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{f}"],
        ["inspect", "--json", "{f}"],
        ["validate", "{f}"],
        ["validate", "--json", "{f}"],
        ["metadata", "get", "{f}"],
        ["metadata", "set", "{f}", "k=v"],
        ["metadata", "delete", "{f}", "k"],
        ["stats", "{f}"],
        ["hash", "{f}"],
        ["diff", "{f}", "{example}"],
        ["diff", "{example}", "{f}"],
        ["cast", "{f}", "{out}/c.safetensors", "--to", "F16"],
        ["extract", "{f}", "{out}/e.safetensors", "*"],
        ["reshard", "{f}", "{out}/rs", "-s", "1MB"],
        ["convert", "{f}", "{out}/cv.safetensors"],
    ],
    ids=" ".join,
)
def test_commands_refuse_a_fifo(cli_proc, tmp_path: Path, example: Path, argv: list[str]) -> None:
    fifo = _fifo(tmp_path / "pipe.safetensors")
    names = {"f": str(fifo), "example": str(example), "out": str(tmp_path / "out")}
    r = cli_proc(*(a.format(**names) for a in argv), timeout=LIMIT)
    assert r.code == 2, r
    assert "FIFO" in r.err and "pipe.safetensors" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "out").exists()  # no output folder left behind


def test_scan_reports_a_fifo_and_goes_on(cli_proc, tmp_path: Path, example: Path) -> None:
    fifo = _fifo(tmp_path / "a_pipe.bin")
    r = cli_proc("scan", "--json", fifo, example, timeout=LIMIT)
    assert r.code == 1, r
    files = json.loads(r.out)["files"]
    assert [f["path"] for f in files] == [str(fifo), str(example)]
    assert files[0]["format"] == "error" and files[0]["grade"] == "suspicious"
    assert "FIFO" in files[0]["findings"][0]["message"]
    assert files[1]["format"] == "safetensors"


@pytest.fixture
def fifo_shard(tmp_path: Path) -> Path:
    """A sharded model whose second shard is a FIFO."""
    names = list(example_tensors())
    folder = write_sharded(tmp_path / "m", example_tensors(), [names[:2], names[2:]])
    shard = folder / "model-00002-of-00002.safetensors"
    shard.unlink()
    _fifo(shard)
    return folder


def test_sharded_model_with_a_fifo_shard(cli_proc, fifo_shard: Path, tmp_path: Path) -> None:
    r = cli_proc("validate", "--json", fifo_shard, timeout=LIMIT)
    assert r.code == 1, r
    (problem,) = json.loads(r.out)["problems"]
    assert problem["code"] == "ShardMissing"
    assert problem["file"] == "model-00002-of-00002.safetensors"
    assert "FIFO" in problem["message"]
    out = tmp_path / "out"
    for argv in (
        ["inspect", fifo_shard],
        ["hash", fifo_shard],
        ["merge", fifo_shard, out / "m.safetensors"],
        ["reshard", fifo_shard, out / "rs", "-s", "1MB"],
        ["cast", fifo_shard, out / "c", "--to", "F16"],
    ):
        r = cli_proc(*argv, timeout=LIMIT)
        assert r.code == 2 and "FIFO" in r.err, (argv, r)
    assert not out.exists()


def test_library_refuses_a_fifo(tmp_path: Path, fifo_shard: Path) -> None:
    fifo = _fifo(tmp_path / "p.safetensors")
    with pytest.raises(NotRegularFileError, match="FIFO"):
        _returns(lambda: open_regular_file(str(fifo)), fifo)
    with pytest.raises(NotRegularFileError, match="FIFO"):
        _returns(lambda: validate(fifo), fifo)
    with pytest.raises(NotRegularFileError, match="FIFO"):
        _returns(lambda: scan_file(fifo), fifo)
    with pytest.raises(NotRegularFileError, match="FIFO"):
        _returns(lambda: convert_file(fifo, tmp_path / "o.safetensors"), fifo)
    (report,) = _returns(lambda: scan_files([fifo]), fifo)
    assert report.format == "error" and report.grade == "suspicious"
    shard = fifo_shard / "model-00002-of-00002.safetensors"
    problems = _returns(lambda: validate(fifo_shard), shard)
    assert [(p.code, p.file) for p in problems] == [("ShardMissing", shard.name)]


def test_open_regular_file(tmp_path: Path, example: Path) -> None:
    fd = open_regular_file(str(example))
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK is cleared again
        assert os.read(fd, 8) == example.read_bytes()[:8]
    finally:
        os.close(fd)
    with pytest.raises(IsADirectoryError):
        open_regular_file(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        open_regular_file(str(tmp_path / "missing"))
    if os.path.exists("/dev/zero"):
        with pytest.raises(NotRegularFileError, match="character device"):
            open_regular_file("/dev/zero")
