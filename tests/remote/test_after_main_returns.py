"""A thread still loading after the main thread has returned: the interpreter is shutting
down and ``concurrent.futures`` pools take no more work ("cannot schedule new futures after
interpreter shutdown"), so parallel reads, remote parts and shard opens run in that thread
instead of failing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from pysafetensors.numpy import save_file

from .rangeserver import RangeServer

# The loader waits until the main thread has stopped: by then the interpreter's shutdown has
# run concurrent.futures' exit hook, which refuses new work from then on.
CHILD = """
import sys, threading, time, zlib
from pysafetensors.numpy import load_file

def load():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    for target in sys.argv[1:]:
        tensors = load_file(target, backend="pread") if "://" not in target else load_file(target)
        crc = 0
        for name in sorted(tensors):
            crc = zlib.crc32(tensors[name].tobytes(), crc)
        print(target.rsplit("/", 1)[-1], len(tensors), crc, flush=True)

threading.Thread(target=load).start()
"""


def test_a_thread_loading_after_the_main_thread_returned(tmp_path: Path) -> None:
    import zlib

    rng = np.random.default_rng(3)
    tensors = {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(12)}
    save_file(tensors, str(tmp_path / "model.safetensors"))  # 48 MiB: parallel reads, parts
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].tobytes(), crc)
    server = RangeServer(tmp_path)
    try:
        local = str(tmp_path / "model.safetensors")
        remote = server.url("model.safetensors")
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, local, remote],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == [f"model.safetensors 12 {crc}"] * 2, proc.stdout
