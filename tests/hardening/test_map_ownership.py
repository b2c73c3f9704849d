"""Memory maps of files: no descriptor kept, never left mapped, placed for 2 MiB faults.

Maps are made as an anonymous ``mmap`` that libc's ``mmap`` replaces with the file in place,
so the ``mmap`` object owns the memory from the first instant: an exception raised by a signal
handler (a Ctrl-C) anywhere in between, or while the last view is dropped, must leave nothing
mapped. Made by libc's ``mmap`` with a Python finalizer, a storm of such exceptions left
thousands of maps behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pysafetensors._fresh_memory import address_of
from pysafetensors._sources import map_file

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc/self/maps and setitimer"
)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 6 << 20, np.uint8).tobytes())
    return path


@pytest.mark.parametrize("offset", [0, 4096, 3 << 20])
@pytest.mark.parametrize("length", [8192, 3 << 20])
def test_maps_hold_the_file_s_bytes_privately(data: Path, offset: int, length: int) -> None:
    fd = os.open(data, os.O_RDONLY)
    try:
        owner, at = map_file(fd, length, offset=offset)
    finally:
        os.close(fd)  # the map keeps no descriptor of its own
    view = memoryview(owner)[at : at + length]
    expected = data.read_bytes()[offset : offset + length]
    assert bytes(view) == expected
    if length >= 2 << 20 and sys.version_info < (3, 13):
        # Placed where the file's 2 MiB boundaries fall on the address's (2 MiB faults).
        assert (address_of(owner) + at) % (2 << 20) == offset % (2 << 20)
    view[0] ^= 0xFF  # copy-on-write: the file is untouched
    assert data.read_bytes()[offset : offset + length] == expected
    fd = os.open(data, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="greater than file size"):
            map_file(fd, 7 << 20)
    finally:
        os.close(fd)


def test_interrupts_leave_no_map_behind(data: Path) -> None:
    """A signal handler raising every 50 us while maps are made, viewed and dropped."""
    code = textwrap.dedent(
        f"""
        import gc, os, signal
        import numpy as np
        from pysafetensors._sources import map_file

        path = {str(data)!r}
        def maps():
            with open("/proc/self/maps") as f:
                return sum(path in line for line in f)
        class Interrupted(Exception):
            pass
        armed = False
        def handler(*_):
            global armed
            if armed:
                armed = False  # once: 3.10 runs handlers between any bytecodes, except too
                raise Interrupted
        signal.signal(signal.SIGALRM, handler)
        fd = os.open(path, os.O_RDONLY)
        hits = 0
        signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00005)
        for _ in range(20000):
            try:
                armed = True
                owner, at = map_file(fd, 3 << 20, offset=4096)
                view = np.frombuffer(owner, np.uint8)[at:]
                del owner, view
                armed = False
            except Interrupted:
                armed = False
                hits += 1
            except SystemError as e:
                # 3.10: a handler that raised inside os.fstat (whose timestamp arithmetic
                # runs handlers) leaves its exception set while fstat goes on; the next
                # signal's handler then returns with it set, which 3.10 (not 3.11+) turns
                # into "_PyEval_EvalFrameDefault returned a result with an exception set".
                if not isinstance(e.__cause__, Interrupted):
                    raise
                armed = False
                hits += 1
            if hits >= 1000:
                break
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        # The interrupt that made the last hit may have landed after the assignment: the
        # names still hold that map (the test's own reference, not a leak).
        owner = view = None
        gc.collect()
        print(hits, maps())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    hits, left = map(int, proc.stdout.split())
    assert hits > 100  # the handler did land inside
    assert left == 0
