"""The benchmark harness runs end to end in quick mode and writes a well-formed table and JSON.

No timing is asserted: this only guards the harness against bit rot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "run.py"

pytest.importorskip("torch")
pytest.importorskip("safetensors")


def test_quick_benchmark_writes_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["quick"] is True
    assert {"cpu", "cores", "kernel", "python", "numpy", "torch"} <= set(data["meta"]["machine"])
    assert set(data["meta"]["strategies"]) == {
        "hugepage_destinations",
        "direct_reads",
        "prefetch",
        "read_threads",
        "preallocate",
    }
    summary = data["summary"]
    # Every cell ran and produced a positive median, with the memory fields present.
    failed = {k: v for k, v in summary.items() if v.get("n", 0) == 0}
    assert not failed, failed
    for key, cell in summary.items():
        assert cell["seconds"] > 0, key
        for field in ("peak_rss_delta", "anon_delta", "file_delta", "read_bytes"):
            assert field in cell, (key, field)
    # The cold cells were cold and the warm ones warm: the worker refuses to time a
    # repetition that is not.
    for key, cell in summary.items():
        if key.split("|")[2] == "cold":
            assert cell["residency_before"] < 0.01, key
        elif key.split("|")[2].startswith("warm"):
            assert cell["residency_before"] >= 0.99, key
    # The warm load is timed without the memory warm-up too, for ours and the reference.
    plain = {k.split("|")[3] for k in summary if k.split("|")[2] == "warm, no memory warm-up"}
    assert plain == {"pysafetensors", "ref_mmap", "ref_pread"}, plain
    # The cells run as the full run runs them (a fresh worker each) have their peaks of each
    # kind sampled between the worker's signals (at least once, and never below the change
    # the worker measured itself at the end).
    sampled = {k: v for k, v in summary.items() if v.get("peak_anon_delta") is not None}
    assert {k.split("|")[3] for k in sampled} == {"pysafetensors", "ref_mmap"}, sampled
    for key, cell in sampled.items():
        assert cell["peak_anon_delta"] >= cell["anon_delta"], (key, cell)
        assert cell["peak_file_delta"] >= cell["file_delta"], (key, cell)
        assert all(run["peak_samples"] >= 1 for run in data["raw"][key]), key
    ops = {key.split("|")[1] for key in summary}
    assert {"load", "lazy", "open", "tp_rows", "tp_cols", "save", "save_durable"} <= ops
    arms = {key.split("|")[3] for key in summary}
    assert {"pysafetensors", "ref_mmap", "ref_pread", "torch", "ceiling_pread"} <= arms

    table = (out / "RESULTS.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| file | operation"))
    columns = header.count("|")
    rows = [line for line in table.splitlines() if line.startswith("| llama |")]
    assert rows, table
    assert all(line.count("|") == columns for line in rows[:8])
    assert "x ref" in header
    assert "Machine:" in table
    assert "Strategies in force (`pysafetensors.tuning`" in table
    assert "| peak anon | peak file |" in table
    assert "peak extra memory <= 64 MiB" in table


def test_quick_remote_benchmark_writes_table_and_json(tmp_path: Path) -> None:
    """The remote benchmark's harness: its throttled server, both arms, every case."""
    out = tmp_path / "out"
    script = ROOT / "benchmarks" / "remote_bench.py"
    proc = subprocess.run(
        # Latency lowered from 10 ms: the 1,000-request arm of the LoRA loop alone took 10 s.
        [sys.executable, str(script), "--quick", "--latency", "0.001"]
        + ["--out", str(out), "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "remote.json").read_text())
    assert data["meta"]["quick"] is True
    summary = data["summary"]
    assert {key.split("|")[0] for key in summary} == {
        "load",
        "tp_rows",
        "tp_cols",
        "slice",
        "lora_loop",
        "lora_loop_off",
        "lora_loop_work",
    }
    for key, cell in summary.items():
        assert cell["n"] == 1 and cell["seconds"] > 0, key
        assert cell["requests"] > 0 and cell["fetched"] > 0, key
    size = data["meta"]["file_bytes"]
    # The download arm fetches the whole file; a rank's rows fetch less of it.
    assert summary["tp_rows|download+ref"]["fetched"] == size
    assert summary["tp_rows|pysafetensors"]["fetched"] < size
    # The get_tensor loop in file order is read ahead: far fewer requests than tensors, and
    # the same bytes as one request per tensor.
    loop, off = summary["lora_loop|pysafetensors"], summary["lora_loop_off|pysafetensors"]
    assert loop["requests"] < 50 < 1000 <= off["requests"]
    assert loop["fetched"] == off["fetched"] == data["meta"]["lora_file_bytes"]
    # With work between the reads (windows then fetched in the background): the same bytes.
    worked = summary["lora_loop_work|pysafetensors"]
    assert worked["requests"] < 50 and worked["fetched"] == loop["fetched"]
    table = (out / "REMOTE.md").read_text()
    assert table.count("| load_shard rank 0 of 8") == 2 and "Machine:" in table


def test_gpu_check_dry_run_passes(tmp_path: Path) -> None:
    """The GPU check (run by hand on a machine with a GPU) runs its whole code on the CPU
    (``--dry-run``: CPU copies instead of a device's) and finds nothing wrong: its stand-in of
    the device runtime still matches the staging pipeline's interface, every section runs."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--dry-run",
            "--reps",
            "1",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads((out / "gpu_results.json").read_text())
    assert data["errors"] == []
    sections = data["sections"]
    assert sections["verdict"] == {"failures": [], "errors": 0}
    for name in ("dtypes", "llama correctness", "warm", "tensor-parallel", "small tensors"):
        assert name in sections, name
    assert sections["dtypes"]["checked"] > 500
    assert "| pysafetensors pread |" in (out / "gpu_results.md").read_text()
