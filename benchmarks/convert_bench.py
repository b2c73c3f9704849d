"""Checkpoint conversion: pysafetensors.convert vs ``torch.load`` + the reference's ``save_file``.

Writes a LLaMA-shaped bf16 checkpoint with ``torch.save`` (random bytes, ~2 GiB by default),
then converts it in fresh subprocesses, alternating the arms, and reports median wall time
and peak RSS above the process's baseline (``VmHWM`` after imports), every arm starting
from recently used memory and a flushed page cache. The reference path is
timed two ways: ``torch.load`` reading the checkpoint into memory (the usual conversion
script), and ``torch.load(mmap=True)``, whose tensors view the page cache (the fastest way
torch offers). Results go to ``benchmarks/CONVERT.md`` and ``benchmarks/convert.json``.

Usage::

    python benchmarks/convert_bench.py            # ~2 GiB, 3 repetitions
    python benchmarks/convert_bench.py --quick    # ~64 MiB, 1 repetition (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.join(HERE, "_work")

WORKER = r"""
import os, sys, time, resource
def rss():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024
arm, src, dst = sys.argv[1:4]
import torch, numpy
import pysafetensors.convert
import safetensors.torch
# Every arm starts from recently used memory and a clean page cache: on a VM, memory the
# guest has not touched lately is supplied several times slower (see _cache.py), and the
# previous arm's output is still being written back. Memory of 1.25x the checkpoint is
# touched and freed, and dirty pages are flushed, before the timer.
warm = numpy.ones(os.path.getsize(src) * 5 // 4, numpy.uint8)
del warm
os.sync()
# Reset the high-water mark so imports and the warm-up do not count (Linux >= 4.0).
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = rss()[1]
start = time.perf_counter()
if arm == "pysafetensors":
    pysafetensors.convert.convert_file(src, dst)
else:
    state = torch.load(src, map_location="cpu", weights_only=True, mmap=arm.endswith("mmap"))
    safetensors.torch.save_file(state, dst, metadata={"format": "pt"})
elapsed = time.perf_counter() - start
print(elapsed, rss()[0] - base)
"""


def make_checkpoint(path: str, hidden: int, layers: int, vocab: int) -> int:
    """Write a bf16 LLaMA-shaped state dict with torch.save; return its data bytes."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        # Random bit patterns (never zeros), as bf16.
        return torch.randint(-32768, 32767, shape, generator=gen, dtype=torch.int16).view(
            torch.bfloat16
        )

    state = {"model.embed_tokens.weight": weight(vocab, hidden)}
    mlp = hidden * 11 // 4
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{proj}.weight"] = weight(hidden, hidden)
        state[p + "mlp.gate_proj.weight"] = weight(mlp, hidden)
        state[p + "mlp.up_proj.weight"] = weight(mlp, hidden)
        state[p + "mlp.down_proj.weight"] = weight(hidden, mlp)
        state[p + "input_layernorm.weight"] = weight(hidden)
    state["lm_head.weight"] = weight(vocab, hidden)
    torch.save(state, path)
    return sum(t.numel() * t.element_size() for t in state.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    os.makedirs(WORK, exist_ok=True)
    src = os.path.join(WORK, "convert-quick.bin" if args.quick else "convert-llama.bin")
    shape = (1024, 2, 8000) if args.quick else (4096, 4, 32000)
    data = make_checkpoint(src, *shape) if not os.path.exists(src) else os.path.getsize(src)
    results: dict[str, list[tuple[float, int]]] = {
        "pysafetensors": [],
        "torch+reference": [],
        "torch+reference mmap": [],
    }
    for _ in range(reps):
        for arm in results:
            dst = os.path.join(WORK, f"converted-{arm.replace(' ', '-')}.safetensors")
            out = subprocess.run(
                [sys.executable, "-c", WORKER, arm, src, dst],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
            results[arm].append((float(out[0]), int(out[1])))
            os.unlink(dst)
    summary = {
        arm: {
            "seconds": statistics.median(r[0] for r in runs),
            "peak_rss_bytes": statistics.median(r[1] for r in runs),
        }
        for arm, runs in results.items()
    }
    ours, ref = summary["pysafetensors"], summary["torch+reference"]
    ref_mmap = summary["torch+reference mmap"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = [
        "# Checkpoint conversion benchmark",
        "",
        "Generated by `benchmarks/convert_bench.py` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{reps} repetition(s), each in a fresh subprocess, arms alternated, each starting from "
        "recently used memory (1.25x the checkpoint touched and freed) and a flushed page "
        "cache; medians. "
        f"Machine: {machine}. Checkpoint: `torch.save` of a LLaMA-shaped bf16 state dict of "
        f"{data / 2**30:.2f} GiB (page cache warm).",
        "",
        "| arm | time | peak RSS above baseline | x ours |",
        "|---|---|---|---|",
        f"| pysafetensors `convert_file` (no torch, no pickle code run) | {ours['seconds']:.2f} s "
        f"| {ours['peak_rss_bytes'] / 2**20:.0f} MiB | 1.00x |",
        f"| `torch.load(weights_only=True)` + reference `save_file` | {ref['seconds']:.2f} s "
        f"| {ref['peak_rss_bytes'] / 2**20:.0f} MiB | {ref['seconds'] / ours['seconds']:.2f}x |",
        "| `torch.load(weights_only=True, mmap=True)` + reference `save_file` | "
        f"{ref_mmap['seconds']:.2f} s | {ref_mmap['peak_rss_bytes'] / 2**20:.0f} MiB | "
        f"{ref_mmap['seconds'] / ours['seconds']:.2f}x |",
        "",
        f"Time ratio ours / reference path: **{ours['seconds'] / ref['seconds']:.2f}x** "
        f"(**{ours['seconds'] / ref_mmap['seconds']:.2f}x** against its `mmap=True` form); "
        f"peak memory ratio: **{ours['peak_rss_bytes'] / max(1, ref['peak_rss_bytes']):.3f}x** "
        "(target: faster, and under half the memory). Peak RSS counts private and file-backed "
        "pages alike: the `mmap=True` arm's are mostly the checkpoint's mapped page cache.",
        "",
    ]
    suffix = ".quick" if args.quick else ""
    with open(os.path.join(args.out, f"CONVERT{suffix}.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out, f"convert{suffix}.json"), "w") as f:
        json.dump({"data_bytes": data, "reps": reps, "results": summary}, f, indent=2)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
