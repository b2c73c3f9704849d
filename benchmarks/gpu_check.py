"""GPU check for the pinned-buffer staging loader (run on a machine with a CUDA GPU).

Not run by ``make bench``: no GPU was available where RESULTS.md was produced. The script

1. writes (or reuses) a random bf16 LLaMA-shaped file (``--gib`` GiB, default 2);
2. checks correctness: every tensor loaded with ``device="cuda:N"`` by pysafetensors (both
   backends, ``get_tensors`` and ``get_tensor``) equals the CPU load, byte for byte;
3. measures GB/s, warm page cache, median of ``--reps`` in this process, each timed up to
   ``torch.cuda.synchronize()``:
   * pysafetensors ``load_file(..., device=dev, backend="pread")`` and ``backend="mmap"``;
   * the reference ``safetensors.torch.load_file(..., device=dev)`` (mmap and pread backends);
   * a plain pinned copy: the whole data region from one pinned host buffer to the device in
     one ``copy_`` (the PCIe ceiling) and ``pread`` into a pinned buffer + copy (no overlap);
4. prints a markdown table and writes ``gpu_results.json`` next to this script.

Usage::

    python benchmarks/gpu_check.py [--device cuda:0] [--gib 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--work", default=os.path.join(HERE, "_work"))
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    import _cache
    import _files
    import safetensors.torch as ref

    import pysafetensors
    import pysafetensors.torch as ours

    layers = max(1, round((args.gib * 2**30 - 2 * 32000 * 4096 * 2) / (386 * 2**20)))
    shapes = _files.llama_shapes(layers, _files.HIDDEN, _files.INTERMEDIATE, _files.VOCAB)
    path = _files.ensure_file(args.work, f"gpu_llama_{layers}", shapes)
    size = os.path.getsize(path)
    dev = args.device
    _cache.warm(path)

    # ---------------------------------------------------------------- correctness
    cpu = ours.load_file(path, backend="pread")
    failures = []
    for backend in ("pread", "mmap"):
        got = ours.load_file(path, device=dev, backend=backend)
        with pysafetensors.safe_open(path, "pt", device=dev, backend=backend) as f:
            single = {name: f.get_tensor(name) for name in list(f.keys())[:5]}
        for name, t in cpu.items():
            g = got[name]
            if g.device != torch.device(dev) or g.dtype != t.dtype or g.shape != t.shape:
                failures.append(f"{backend}:{name}: {g.device} {g.dtype} {tuple(g.shape)}")
            elif not torch.equal(g.cpu().view(torch.int16), t.view(torch.int16)):
                failures.append(f"{backend}:{name}: bytes differ")
        for name, g in single.items():
            if not torch.equal(g.cpu().view(torch.int16), cpu[name].view(torch.int16)):
                failures.append(f"{backend}:get_tensor:{name}: bytes differ")
        del got, single
    ref_gpu = ref.load_file(path, device=dev)
    for name, t in ref_gpu.items():
        if not torch.equal(t.cpu().view(torch.int16), cpu[name].view(torch.int16)):
            failures.append(f"reference disagrees on {name}")
    del ref_gpu

    # ---------------------------------------------------------------- throughput
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
    data_start, data_size = 8 + n, size - 8 - n
    pinned = torch.empty(data_size, dtype=torch.uint8, pin_memory=True)
    device_buf = torch.empty(data_size, dtype=torch.uint8, device=dev)

    def pinned_copy() -> Any:
        device_buf.copy_(pinned, non_blocking=True)

    def pread_then_copy() -> Any:
        view = memoryview(pinned.numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < data_size:
                done += os.preadv(fd, [view[done:]], data_start + done)
        finally:
            os.close(fd)
        device_buf.copy_(pinned, non_blocking=True)

    arms: dict[str, Callable[[], Any]] = {
        "pysafetensors pread": lambda: ours.load_file(path, device=dev, backend="pread"),
        "pysafetensors mmap": lambda: ours.load_file(path, device=dev, backend="mmap"),
        "reference mmap": lambda: ref.load_file(path, device=dev),
        "reference pread": lambda: ref.load_file(path, device=dev, backend="pread"),
        "ceiling: one pinned copy_": pinned_copy,
        "pread into pinned, then copy_ (no overlap)": pread_then_copy,
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.reps):
        for name, fn in arms.items():
            _cache.warm(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            del result
            torch.cuda.empty_cache()

    props = torch.cuda.get_device_properties(torch.device(dev))
    lines = [
        f"GPU: {props.name}, torch {torch.__version__}, file {size / 2**30:.2f} GiB, warm cache, "
        f"median of {args.reps}",
        "",
        "| arm | median s | GB/s | x reference (mmap) |",
        "|---|---|---|---|",
    ]
    ref_med = statistics.median(times["reference mmap"])
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med:.3f} | {data_size / med / 1e9:.2f} | {med / ref_med:.2f}x |")
    lines.append("")
    lines.append("correctness: " + ("OK" if not failures else f"{len(failures)} FAILURES"))
    lines += failures[:20]
    print("\n".join(lines))
    with open(os.path.join(HERE, "gpu_results.json"), "w") as f:
        json.dump({"gpu": props.name, "times": times, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
