"""``pysafetensors.tuning``: the process-wide strategy switches, their checks, their
environment variables, and that each one changes what the readers and the writer do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import _fresh_memory, _reader_pool, _sources, safe_open, tuning
from pysafetensors.numpy import load_file, save_file


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    before = tuning.settings()
    yield
    tuning.configure(**before.as_dict())


def test_defaults_are_the_measured_fastest() -> None:
    assert tuning.Settings() == tuning.Settings(
        hugepage_destinations="auto",
        direct_reads=True,
        prefetch=True,
        read_threads=0,
        preallocate=False,
    )


def test_configure_changes_only_what_is_given_and_returns_the_previous() -> None:
    start = tuning.settings()
    previous = tuning.configure(direct_reads=False)
    assert previous == start
    now = tuning.settings()
    assert now.direct_reads is False
    assert now.hugepage_destinations == start.hugepage_destinations
    assert now.preallocate == start.preallocate
    tuning.configure(**previous.as_dict())
    assert tuning.settings() == start


def test_configured_restores_after_the_block_even_on_error() -> None:
    start = tuning.settings()
    with (
        pytest.raises(RuntimeError, match="inside"),
        tuning.configured(hugepage_destinations=False, preallocate=True) as inside,
    ):
        assert inside == tuning.settings()
        assert inside.hugepage_destinations is False and inside.preallocate is True
        raise RuntimeError("inside")
    assert tuning.settings() == start


def test_configured_restores_only_what_it_set_and_what_was_not_changed_since() -> None:
    start = tuning.settings()
    with tuning.configured(prefetch=not start.prefetch):
        tuning.configure(read_threads=4)  # another setting, changed meanwhile: stays
    assert tuning.settings() == tuning.Settings(**{**start.as_dict(), "read_threads": 4})
    with tuning.configured(read_threads=2):
        tuning.configure(read_threads=7)  # the same setting, changed again meanwhile: stays
    assert tuning.settings().read_threads == 7
    with tuning.configured(direct_reads=False):  # nested: each restores its own
        with tuning.configured(direct_reads=True, preallocate=not start.preallocate):
            assert tuning.settings().direct_reads is True
        assert tuning.settings().direct_reads is False
        assert tuning.settings().preallocate == start.preallocate
    assert tuning.settings().direct_reads == start.direct_reads


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("direct_reads", "yes"),
        ("direct_reads", 1),  # an int is not a bool here, though 1 == True
        ("preallocate", 0),
        ("preallocate", "auto"),
        ("prefetch", "false"),  # a string, not a bool
        ("hugepage_destinations", "always"),
        ("hugepage_destinations", 1.0),
        ("read_threads", -1),
        ("read_threads", 65),  # above MAX_READ_THREADS
        ("read_threads", True),  # a bool is not a count
        ("read_threads", "4"),
        ("read_threads", 2.0),
    ],
)
def test_values_outside_the_choices_are_refused_and_nothing_changes(
    name: str, value: object
) -> None:
    start = tuning.settings()
    pattern = f"tuning: {name} must be .* \\(got {re.escape(repr(value))}\\)"
    with pytest.raises(ValueError, match=pattern):
        # A valid change of another setting in the same call is not made either.
        other = "preallocate" if name != "preallocate" else "direct_reads"
        changes: dict[str, Any] = {other: not getattr(start, other), name: value}
        if name == "read_threads":
            changes["direct_reads"] = not start.direct_reads
        tuning.configure(**changes)
    assert tuning.settings() == start


def test_environment_variables_are_parsed() -> None:
    parse = tuning._from_environment
    assert parse({}) == tuning.Settings()
    assert parse(
        {
            "PYSAFETENSORS_HUGEPAGES": "Off",
            "PYSAFETENSORS_DIRECT_READS": " 0 ",
            "PYSAFETENSORS_PREFETCH": "no",
            "PYSAFETENSORS_READ_THREADS": "12",
            "PYSAFETENSORS_PREALLOCATE": "TRUE",
        }
    ) == tuning.Settings(
        hugepage_destinations=False,
        direct_reads=False,
        prefetch=False,
        read_threads=12,
        preallocate=True,
    )
    assert parse({"PYSAFETENSORS_HUGEPAGES": "auto"}).hugepage_destinations == "auto"
    assert parse({"PYSAFETENSORS_HUGEPAGES": "1"}).hugepage_destinations is True
    assert parse({"PYSAFETENSORS_DIRECT_READS": ""}) == tuning.Settings()  # set but empty
    with pytest.raises(ValueError, match="PYSAFETENSORS_DIRECT_READS='auto'"):
        parse({"PYSAFETENSORS_DIRECT_READS": "auto"})
    with pytest.raises(ValueError, match="PYSAFETENSORS_HUGEPAGES='2'.*auto"):
        parse({"PYSAFETENSORS_HUGEPAGES": "2"})
    for bad in ("-1", "65", "four", "1.5", "²", "٣"):  # digits int() refuses or reads
        with pytest.raises(ValueError, match=f"PYSAFETENSORS_READ_THREADS='{bad}'.* 0 to 64"):
            parse({"PYSAFETENSORS_READ_THREADS": bad})


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PYSAFETENSORS_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**full, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_process_starts_with_the_environments_choices() -> None:
    code = "import pysafetensors.numpy; from pysafetensors import tuning; print(tuning.settings())"
    done = _python(code, PYSAFETENSORS_DIRECT_READS="off", PYSAFETENSORS_PREALLOCATE="1")
    assert done.returncode == 0, done.stderr
    assert "direct_reads=False" in done.stdout and "preallocate=True" in done.stdout
    assert "hugepage_destinations='auto'" in done.stdout


def test_a_mistyped_environment_variable_stops_the_import_with_its_name() -> None:
    done = _python("import pysafetensors", PYSAFETENSORS_PREALLOCATE="maybe")
    assert done.returncode != 0
    assert "PYSAFETENSORS_PREALLOCATE='maybe'" in done.stderr


def test_preallocate_reserves_the_files_size_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("needs posix_fallocate")
    reserved: list[tuple[int, int]] = []
    real = os.posix_fallocate

    def spy(fd: int, offset: int, length: int) -> None:
        reserved.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", spy)
    data = {"w": np.random.default_rng(0).standard_normal((512, 1024), dtype=np.float32)}
    plain, reserving = tmp_path / "plain.safetensors", tmp_path / "reserved.safetensors"
    save_file(data, str(plain))
    assert reserved == []  # off by default
    with tuning.configured(preallocate=True):
        save_file(data, str(reserving))
    assert reserved == [(0, os.path.getsize(reserving))]
    assert reserving.read_bytes() == plain.read_bytes()


def test_hugepage_destinations_off_never_asks_for_huge_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []
    real = _fresh_memory.numpy_empty

    def spy(nbytes: int, hugepages: bool) -> np.ndarray:
        asked.append(hugepages)
        return real(nbytes, hugepages)

    def no_region(nbytes: int) -> None:
        raise AssertionError("a huge-page region was made")

    monkeypatch.setattr(_fresh_memory, "numpy_empty", spy)
    monkeypatch.setattr(_fresh_memory._HugeRegion, "create", staticmethod(no_region))
    data = {"w": np.random.default_rng(1).integers(0, 255, (80 << 20,), np.uint8)}
    save_file(data, str(tmp_path / "big.safetensors"))
    with tuning.configured(hugepage_destinations=False):
        got = load_file(str(tmp_path / "big.safetensors"), backend="pread")
        assert _fresh_memory.empty_bytes(64 << 20).nbytes == 64 << 20
    assert np.array_equal(got["w"], data["w"])
    assert asked and not any(asked)


def test_read_threads_apply_to_reads_that_do_not_choose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    real = _sources.run_parallel

    def recording(fn: Any, items: Any, threads: int) -> None:
        asked.append(threads)
        real(fn, items, threads)

    monkeypatch.setattr(_sources, "run_parallel", recording)  # PreadSource's parallel reads
    data = {"w": np.random.default_rng(2).integers(0, 255, (40 << 20,), np.uint8)}
    path = str(tmp_path / "m.safetensors")
    save_file(data, path)
    with tuning.configured(read_threads=3, direct_reads=False):
        got = load_file(path, backend="pread")
        assert asked and set(asked) == {3}
        asked.clear()
        with safe_open(path, "np", backend="pread", threads=5) as f:  # the call's own choice
            assert np.array_equal(f.get_tensor("w"), data["w"])
        assert asked and set(asked) == {5}
        assert _reader_pool.worker_count(object()) == 3
    assert np.array_equal(got["w"], data["w"])
    assert _reader_pool.worker_count(object()) == _reader_pool.READ_THREADS


def test_concurrent_configures_lose_no_change() -> None:
    import threading

    start = threading.Barrier(2)

    def flip(name: str) -> None:
        start.wait()
        for i in range(2000):
            tuning.configure(**{name: bool(i % 2)})

    threads = [threading.Thread(target=flip, args=(n,)) for n in ("direct_reads", "prefetch")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each thread's last write (True: 1999 is odd) survived the other's.
    assert tuning.settings().direct_reads is True and tuning.settings().prefetch is True
