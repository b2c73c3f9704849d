"""Resource limits: hostile headers cost bounded time and memory.

Each case runs in a child process whose address space is capped with ``RLIMIT_AS`` a little
above what it already uses after imports, so an allocation sized by an untrusted number fails
the test (as MemoryError or a crash) instead of passing quietly on a big machine. Files are
written by the parent, so the child's budget covers reading only.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux-specific"
)

_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    import numpy as np
    import pysafetensors
    from pysafetensors import safe_open

    def vm_bytes():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    path, budget, action = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # Warm the code paths once (imports, lazy modules) on a trivial file before the cap.
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + budget, resource.RLIM_INFINITY))
    out = {"outcome": None}
    start = time.perf_counter()
    try:
        with safe_open(path, "np", backend=action) as f:
            out["outcome"] = "accepted"
            out["count"] = len(f.keys())
            for name in f.offset_keys()[:50]:
                try:
                    t = f.get_tensor(name)
                    out.setdefault("shapes", []).append(list(t.shape))
                    f.get_slice(name)[...]
                except pysafetensors.SafetensorError as exc:
                    out.setdefault("tensor_errors", []).append(exc.kind)
            try:
                f.get_tensors()
            except pysafetensors.SafetensorError as exc:
                out.setdefault("tensor_errors", []).append(exc.kind)
    except pysafetensors.SafetensorError as exc:
        out["outcome"] = "rejected"
        out["kind"] = exc.kind
    out["seconds"] = time.perf_counter() - start
    print(json.dumps(out))
    """
)

MiB = 1 << 20


def _frame(header: bytes | str, body: bytes = b"", n: int | None = None) -> bytes:
    if isinstance(header, str):
        header = header.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if n is None else n) + header + body


def _run(path: Path, budget: int, backend: str = "mmap", timeout: float = 60) -> dict[str, Any]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(budget), backend],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("n", "kind"),
    [
        (2**64 - 1, "HeaderTooLarge"),
        (2**63, "HeaderTooLarge"),
        (100_000_001, "HeaderTooLarge"),
        (100_000_000, "InvalidHeaderLength"),
        (99_999_999, "InvalidHeaderLength"),
    ],
)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_huge_length_prefix_allocates_nothing(
    tmp_path: Path, n: int, kind: str, backend: str
) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame("{}", n=n))
    out = _run(path, 16 * MiB, backend)
    assert (out["outcome"], out["kind"]) == ("rejected", kind)
    assert out["seconds"] < 2


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        (_entry("F32", [2**62], 0, 16), "ValidationOverflow"),
        (_entry("U8", [2**40], 0, 2**40), "MetadataIncompleteBuffer"),
        (_entry("F32", [4194305, 4194305, 211106198978564], 0, 16), "ValidationOverflow"),
        (_entry("U8", [2**32, 2**32], 0, 16), "TensorInvalidInfo"),
        (_entry("U64", [2**63, 2, 0], 0, 0), "ValidationOverflow"),
        (_entry("U8", [16], 0, 2**64 - 1), "TensorInvalidInfo"),
    ],
)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_huge_declared_sizes_are_refused_without_allocating(
    tmp_path: Path, entry: dict[str, Any], kind: str, backend: str
) -> None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(json.dumps({"t": entry}), bytes(16)))
    out = _run(path, 16 * MiB, backend)
    assert out["outcome"] == "rejected"
    assert out["kind"] in (kind, "InvalidOffset", "TensorInvalidInfo", "ValidationOverflow")
    assert out["seconds"] < 2


@pytest.mark.parametrize(
    "shape",
    [
        [0, 2**64 - 1],
        [2**64 - 1, 0],
        [0, 2**62],
        [0, 2**40, 2**20],
        [0] * 64,
        [0] + [2**63 - 1] * 3,
        [1] * 64 + [0],
    ],
)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_enormous_zero_size_shapes_cost_nothing(
    tmp_path: Path, shape: list[int], backend: str
) -> None:
    """Legal (0 bytes) tensors with absurd dimensions: an empty array or a clean refusal."""
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(json.dumps({"t": _entry("F32", shape, 0, 0)})))
    out = _run(path, 16 * MiB, backend)
    assert out["outcome"] == "accepted"
    errors = out.get("tensor_errors", [])
    assert set(errors) <= {"ShapeTooLarge", "TooManyDimensions"}
    if not errors:
        assert out["shapes"] == [shape]
    assert out["seconds"] < 2


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_tensor_past_the_end_of_the_file(tmp_path: Path, backend: str) -> None:
    header = {"a": _entry("U8", [16], 0, 16), "b": _entry("F32", [2**30], 16, 16 + 2**32)}
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(json.dumps(header), bytes(32)))
    out = _run(path, 16 * MiB, backend)
    assert (out["outcome"], out["kind"]) == ("rejected", "MetadataIncompleteBuffer")


def test_deep_json_nesting_is_refused_quickly(tmp_path: Path) -> None:
    """50 MB of ``[``: refused as JSON (recursion caught), in well under a second of parsing."""
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(b"[" * 50_000_000))
    # Reading the header holds its bytes, a copy, and its decoded text: about 3x its size.
    out = _run(path, 4 * 50_000_000 + 64 * MiB, "pread")
    assert (out["outcome"], out["kind"]) == ("rejected", "InvalidHeaderDeserialization")
    assert out["seconds"] < 5


def test_deep_nesting_inside_an_unknown_field(tmp_path: Path) -> None:
    inner = "[" * 5000 + "]" * 5000
    header = '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + inner + "}}"
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(header, b"x"))
    out = _run(path, 32 * MiB, "mmap")
    assert (out["outcome"], out["kind"]) == ("rejected", "InvalidHeaderDeserialization")


def test_millions_of_numbers_in_an_unknown_field(tmp_path: Path) -> None:
    """The reference skips an unknown field; we hold it decoded while checking it as serde
    parses it. Held as floats (24 bytes a number) and walked with an iterator per container,
    not an item per element: 2,000,000 numbers in 18 MB took ~28x the header's size (a
    wrapper and the literal's text per number, a tuple each to walk them), now ~8x."""
    values = ",".join(f"0.{i:06d}" for i in range(2_000_000))
    header = '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[' + values + "]}}"
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(header, b"x"))
    out = _run(path, 12 * len(header), "pread")
    assert out["outcome"] == "accepted", out
    assert out["shapes"] == [[1]]


def test_millions_of_negative_zeros_in_an_unknown_field(tmp_path: Path) -> None:
    """serde reads ``-0`` as a float, so the parser wraps it: one wrapper (~100 bytes with its
    text) per ``-0`` made a 99 MB header of them take 4 GB. One shared wrapper now."""
    header = '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[' + "-0," * 2_000_000
    header += '0]},"__metadata__":{"k":"v"}}'
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(header, b"x"))
    out = _run(path, 12 * len(header), "pread")
    assert out["outcome"] == "accepted", out
    assert out["shapes"] == [[1]]


def _many(n: int, begin_end: tuple[int, int], shape: list[int]) -> bytes:
    b, e = begin_end
    parts = ",".join(
        f'"t{i}":{{"dtype":"F32","shape":{json.dumps(shape)},"data_offsets":[{b},{e}]}}'
        for i in range(n)
    )
    return ("{" + parts + "}").encode()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_many_aliased_tensors_are_refused(tmp_path: Path, backend: str) -> None:
    """attempt 2 of the reference's attacks/, scaled to 100,000 entries on one 16-byte range."""
    header = _many(100_000, (0, 16), [4])
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(header, bytes(16)))
    out = _run(path, 40 * len(header) + 64 * MiB, backend)
    assert (out["outcome"], out["kind"]) == ("rejected", "InvalidOffset")
    assert out["seconds"] < 10


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_a_million_tensors(tmp_path: Path, shared: bool) -> None:
    """One million entries (a 59 MB header): aliased ones refused, zero-size ones accepted.

    Memory is bounded by the header size times a constant (the parsed JSON objects; measured
    ~16x, see SECURITY.md), and so by ``max_header_size``; time by a few seconds per million.
    """
    header = _many(1_000_000, (0, 16) if shared else (0, 0), [4] if shared else [0])
    path = tmp_path / "f.safetensors"
    path.write_bytes(_frame(header, bytes(16) if shared else b""))
    out = _run(path, 24 * len(header) + 128 * MiB, "mmap", timeout=300)
    if shared:
        assert (out["outcome"], out["kind"]) == ("rejected", "InvalidOffset")
    else:
        assert (out["outcome"], out["count"]) == ("accepted", 1_000_000)
    assert out["seconds"] < 60
