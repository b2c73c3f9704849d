"""The bounded fuzz run of the default suite: the fuzz targets' checks on hypothesis inputs.

Each test feeds one family of generated inputs through the same invariant checks the atheris
targets use (``fuzz/_harness.py``): a ``SafetensorError`` or correct results, never another
exception. A few thousand inputs in all, in well under a minute; the long campaigns (a million
inputs per target) are run with ``fuzz/run_long.sh`` and recorded in ``fuzz/RESULTS.md``.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import tracemalloc

import _harness  # noqa: E402, I001 - lives in fuzz/, put on sys.path by conftest
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pysafetensors
from pysafetensors import safe_open

from .conftest import FUZZ_DIR
from .strategies import DTYPE_CODES, any_files, hostile_files, near_valid_files, valid_files

_BASE = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def quick(n: int) -> settings:
    """Bounded settings: ``n`` inputs, no deadline (the first input pays for imports)."""
    return settings(_BASE, max_examples=n)


@quick(300)
@given(any_files)
def test_header_parser_only_raises_safetensor_errors(data: bytes) -> None:
    _harness.check_header(data)


@quick(300)
@given(st.one_of(any_files, valid_files(), near_valid_files()))
def test_validate_agrees_with_the_reader(data: bytes) -> None:
    _harness.check_validate(data)


@quick(250)
@given(st.one_of(valid_files(), near_valid_files()), st.randoms(use_true_random=False))
def test_safe_open_accessors_are_correct_or_refuse(data: bytes, rng: random.Random) -> None:
    _harness.check_file(data, seed=rng.randrange(2**32))


@quick(60)
@given(st.one_of(valid_files(), hostile_files()))
def test_torch_framework_agrees_with_numpy(data: bytes) -> None:
    pytest.importorskip("torch")
    _harness.check_file(data, frameworks=("np", "pt"))


@quick(200)
@given(hostile_files())
def test_hostile_files_are_refused_cleanly(data: bytes) -> None:
    _harness.check_file(data)


@quick(600)
@given(
    st.sampled_from(DTYPE_CODES),
    st.lists(st.integers(0, 6), max_size=4),
    st.randoms(use_true_random=False),
)
def test_plan_slice_matches_numpy(dtype: str, shape: list[int], rng: random.Random) -> None:
    index = _harness.random_index(rng, len(shape), tuple(shape))
    _harness.check_plan(dtype, tuple(shape), index)


@quick(300)
@given(any_files)
def test_differential_against_the_reference(data: bytes) -> None:
    pytest.importorskip("safetensors")
    found = _harness.differential(data)
    assert found is None or _harness.known_difference(*found), found


@quick(150)
@given(st.binary(min_size=2, max_size=48))
def test_streaming_writer_invariants(data: bytes) -> None:
    if _harness.streaming_module() is None:
        pytest.skip("no streaming writer")
    _harness.check_streaming(data)


def _pickle_seeds() -> list[bytes]:
    spec = importlib.util.spec_from_file_location("fuzz_seeds", FUZZ_DIR / "seeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.pickle_files().values())


@quick(100)
@given(st.data())
def test_pickle_reader_mutations(data: st.DataObject) -> None:
    pytest.importorskip("torch")
    seeds = _pickle_seeds_cached()
    seed = bytearray(data.draw(st.sampled_from(seeds)))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(seed) - 1))
        seed[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        seed = seed[: data.draw(st.integers(0, len(seed)))]
    _harness.check_pickle(bytes(seed))


_SEEDS: list[bytes] = []


def _pickle_seeds_cached() -> list[bytes]:
    if not _SEEDS:
        _SEEDS.extend(_pickle_seeds())
    return _SEEDS


@quick(120)
@given(st.one_of(valid_files(), hostile_files()))
def test_memory_stays_within_file_size(data: bytes) -> None:
    """Reading allocates at most the file's size plus a small constant (tracemalloc).

    numpy reports its buffers to tracemalloc, so this counts the tensors' memory too. The
    constant covers the parsed header's Python objects for these small headers.
    """
    path = _harness.write_temp(data, _harness.scratch_dir())
    tracemalloc.start()
    try:
        try:
            with safe_open(path, "np", backend="pread") as f:
                everything = f.get_tensors()
                del everything
                for name in f:
                    f.get_tensor(name)
        except pysafetensors.SafetensorError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= len(data) + (512 << 10), (peak, len(data))


def test_atheris_smoke_run(tmp_path: object) -> None:
    """Each atheris target starts and survives a short run (skipped without atheris)."""
    pytest.importorskip("atheris")
    import resource

    # libFuzzer reads the peak RSS of its process, which Linux carries over from this one
    # across fork and exec: a test process that had grown to 2.8 GB made the first input
    # "out of memory" under a 2 GB limit. The limit counts from this process's peak; single
    # allocations stay capped at 2 GB.
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    for target, runs in (("fuzz_header.py", 2000), ("fuzz_slicing.py", 500)):
        proc = subprocess.run(
            [sys.executable, str(FUZZ_DIR / target), f"-runs={runs}", "-max_len=4096",
             "-timeout=20", f"-rss_limit_mb={peak_mb + 2048}", "-malloc_limit_mb=2048",
             str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(tmp_path),
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"Done {runs} runs" in proc.stderr


def test_known_differences_are_documented() -> None:
    """Every tolerated disagreement with the reference has a section in docs/differences.md."""
    doc = FUZZ_DIR.parent / "docs" / "differences.md"
    if not _harness.KNOWN_DIFFERENCES:
        return
    text = doc.read_text(encoding="utf-8")
    assert "Found by differential fuzzing" in text


def test_harness_detects_a_foreign_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks are not vacuous: a reader that leaks ValueError is caught."""
    from pysafetensors import _format

    def broken(*args: object, **kwargs: object) -> object:
        raise ValueError("boom")

    monkeypatch.setattr(_format, "parse_header", broken)
    with pytest.raises(_harness.Violation):
        _harness.check_header(_harness.frame(b"{}"))
    arr = np.arange(6, dtype=np.float32)
    with pytest.raises(_harness.Violation):
        _harness.check_slice_result(arr, 1, False, lambda: arr[2:3])
