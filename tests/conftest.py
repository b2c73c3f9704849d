"""Shared test helpers: building raw files byte by byte, and the reference implementation.

``raw_file`` builds files with ``struct.pack`` so that malformed headers can be written exactly as
a test needs them (no writer in between to fix them up).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["compact_json", "peak_growth_kib", "raw_file"]


@pytest.fixture(autouse=True)
def default_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts from the library's default strategies, whatever ``PYSAFETENSORS_*``
    variables the environment sets (tests of the defaults would fail under them; the whole
    rest of the suite passes with every strategy switched by them)."""
    from pysafetensors import tuning

    monkeypatch.setattr(tuning, "_current", tuning.Settings())


def compact_json(obj: Any) -> bytes:
    """JSON the way the reference writes it: compact, not ASCII-escaped, UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def raw_file(header: bytes | str | Any, data: bytes = b"", n: int | None = None) -> bytes:
    """Build the bytes of a (possibly malformed) safetensors file.

    Args:
        header: The header region: bytes as they are, a str encoded as UTF-8, or any other
            object serialized with :func:`compact_json`. No padding is added.
        data: The data buffer that follows the header.
        n: The length prefix to write; defaults to the header's real length.

    Returns:
        ``u64 LE n`` + header + data.
    """
    if isinstance(header, str):
        header = header.encode("utf-8")
    elif not isinstance(header, (bytes, bytearray)):
        header = compact_json(header)
    return struct.pack("<Q", len(header) if n is None else n) + bytes(header) + data


@pytest.fixture(name="raw_file")
def raw_file_fixture() -> Any:
    """The :func:`raw_file` builder, for tests that prefer fixtures to imports."""
    return raw_file


@pytest.fixture(name="write_raw")
def write_raw_fixture(tmp_path: Any) -> Any:
    """Write raw bytes to a fresh file under ``tmp_path`` and return its path."""
    counter = iter(range(1_000_000))

    def write(content: bytes) -> Any:
        path = tmp_path / f"raw{next(counter)}.safetensors"
        path.write_bytes(content)
        return path

    return write


@pytest.fixture(name="range_server_class", scope="session")
def range_server_class_fixture() -> Any:
    """The loopback HTTP range server of the remote tests (``tests/remote/rangeserver.py``),
    for tests elsewhere; loaded by path, since ``tests/`` is no package."""
    path = Path(__file__).parent / "remote" / "rangeserver.py"
    spec = importlib.util.spec_from_file_location("_shared_rangeserver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.RangeServer


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    """Python's own SIGINT handler for the test, whatever the runner inherited: a run a shell
    starts in the background has SIGINT ignored, and no KeyboardInterrupt would come."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(params=["whole", "small slabs", "small tiles"])
def slabs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves of arrays copied a slab at a time (non-contiguous, byte-swapped): as configured,
    through slabs of 24 bytes (several per tensor, through the reused buffer, rows cut into
    their rows) with chunks from 8 bytes up counting as large (written before the next is
    asked for), or with transposed blocks copied in tiles of at most 4 elements."""
    import pysafetensors._adapter as adapter

    if request.param == "small slabs":
        import pysafetensors._writer as writer

        monkeypatch.setattr(adapter, "SLAB_BYTES", 24)
        monkeypatch.setattr(adapter, "WRITEV_BYTES", 8)
        monkeypatch.setattr(writer, "WRITEV_BYTES", 8)
    elif request.param == "small tiles":
        monkeypatch.setattr(adapter, "TILE_ELEMENTS", 4)


def peak_growth_kib(setup: str, action: str, *argv: str) -> int:
    """How far a fresh interpreter's peak resident memory rises over ``action``, in KiB.

    Linux only (``/proc/self``). ``setup`` runs first (imports, building the inputs), then the
    peak is reset and ``action`` runs; both are Python source, with ``sys`` imported and
    ``argv`` as ``sys.argv[1:]``.
    """
    script = "\n".join(
        [
            "import sys",
            textwrap.dedent(setup),
            "def rss(key):",
            "    with open('/proc/self/status') as status:",
            "        return next(int(x.split()[1]) for x in status if x.startswith(key))",
            "with open('/proc/self/clear_refs', 'w') as clear:",
            "    clear.write('5')  # the peak starts again from here (VmHWM, KiB)",
            "before = rss('VmRSS:')",
            textwrap.dedent(action),
            "print(rss('VmHWM:') - before)",
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout)
