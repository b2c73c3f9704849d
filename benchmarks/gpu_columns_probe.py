"""Where the time goes in a column split (rank 0 of 8) loaded to a CUDA device.

A one-off probe (benchmarks/GPU.md, between runs 6 and 7): the reference's ``get_slice`` loop,
``load_shard``, and hand-written alternatives (gather into pinned memory with asynchronous
copies, with 16, 4 or 1 torch threads; gather into pageable memory and ``.to``; whole tensors
to the device, sliced there), each checked against the reference's parts, then timed warm,
median of 5. Runs on the CPU too (tiny file, meaningless times) to check the script.

Usage::

    PYTHONPATH=src python benchmarks/gpu_columns_probe.py [WORK_DIR]
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cache  # noqa: E402
import _files  # noqa: E402
import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402

import pysafetensors  # noqa: E402
from pysafetensors.parallel import load_shard  # noqa: E402

dry = not torch.cuda.is_available()
dev = "cpu" if dry else "cuda:0"
work = (
    sys.argv[1]
    if len(sys.argv) > 1
    else os.path.join(os.path.dirname(os.path.abspath(__file__)), "_work")
)
os.makedirs(work, exist_ok=True)
if dry:
    shapes = _files.llama_shapes(2, 256, 688, 2000)
else:
    layers = max(1, round((2 * 2**30 - 2 * 32000 * 4096 * 2) / (386 * 2**20)))
    shapes = _files.llama_shapes(layers, _files.HIDDEN, _files.INTERMEDIATE, _files.VOCAB)
path = _files.ensure_file(work, f"gpu_llama_{len(shapes)}", shapes)
_cache.warm(path)
TP = 8


def sync():
    if not dry:
        torch.cuda.synchronize()


def rule(name, shape):
    return "columns" if len(shape) >= 2 else "replicate"


def key(shape):
    return (slice(None),) if len(shape) == 1 else (slice(None), slice(0, shape[1] // TP))


with open(path, "rb") as fh:
    n = int.from_bytes(fh.read(8), "little")

with open(path, "rb") as fh:
    header = json.loads(fh.read(8 + n)[8:])
header.pop("__metadata__", None)
base = 8 + n
mm = np.memmap(path, np.uint8, "r")
stream = None if dry else torch.cuda.Stream()


def ref():
    with safetensors.safe_open(path, "pt", device=dev) as f:
        return {k: f.get_slice(k)[key(f.get_slice(k).get_shape())] for k in f.keys()}  # noqa: SIM118 - the reference is not iterable


def ours(backend):
    return lambda: load_shard(path, 0, TP, rule, framework="pt", device=dev, backend=backend)


def ours_cpu():
    return load_shard(path, 0, TP, rule, framework="pt", backend="mmap")


def ref_cpu():
    with safetensors.safe_open(path, "pt") as f:
        return {k: f.get_slice(k)[key(f.get_slice(k).get_shape())] for k in f.keys()}  # noqa: SIM118 - the reference is not iterable


def by_hand(threads, move):
    """Every part cut out of a numpy mapping of the file, moved by ``move(part)``, with
    ``threads`` torch threads."""

    def run():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = {}
            for k, info in header.items():
                b, e = info["data_offsets"]
                shape = info["shape"]
                src = torch.from_numpy(mm[base + b : base + e]).view(torch.bfloat16).reshape(shape)
                out[k] = move(src[key(shape)])
            sync()
            return out
        finally:
            torch.set_num_threads(old)

    return run


def through_pinned(part):
    # Gathered into pinned memory, then an asynchronous copy on a side stream.
    host = torch.empty(part.shape, dtype=part.dtype, pin_memory=not dry)
    host.copy_(part)
    if dry:
        return host
    with torch.cuda.stream(stream):
        d = torch.empty(part.shape, dtype=part.dtype, device=dev)
        d.copy_(host, non_blocking=True)
    return d


def pinned_gather(threads):
    return by_hand(threads, through_pinned)


def pageable_to(threads):
    return by_hand(threads, lambda part: part.contiguous().to(dev))


def whole_then_slice():
    out = {}
    with pysafetensors.safe_open(path, "pt", device=dev) as f:
        for k in f.keys():  # noqa: SIM118
            t = f.get_tensor(k)
            out[k] = t[key(list(t.shape))].contiguous()
            del t
    return out


arms = {
    "reference (device)": ref,
    "ours load_shard mmap (device)": ours("mmap"),
    "ours load_shard pread (device)": ours("pread"),
    "ours load_shard mmap (cpu)": ours_cpu,
    "reference (cpu)": ref_cpu,
    "gather->pinned->async, 16 thr": pinned_gather(16),
    "gather->pinned->async, 4 thr": pinned_gather(4),
    "gather->pinned->async, 1 thr": pinned_gather(1),
    "gather->pageable .to, 16 thr": pageable_to(16),
    "gather->pageable .to, 1 thr": pageable_to(1),
    "whole tensor to device, slice there": whole_then_slice,
}
want = {k: v.cpu() for k, v in ref().items()}
for name, fn in arms.items():
    got = fn()
    sync()
    bad = [
        k
        for k in want
        if not torch.equal(
            got[k].cpu().view(torch.uint8) if got[k].dtype != torch.float32 else got[k].cpu(),
            want[k].view(torch.uint8) if want[k].dtype != torch.float32 else want[k],
        )
    ]
    print(name, "OK" if not bad else f"BAD {bad[:3]}", flush=True)
    del got
times = {k: [] for k in arms}
for _ in range(5):
    for name, fn in arms.items():
        _cache.warm(path)
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        times[name].append(time.perf_counter() - t0)
        del r
        if not dry:
            torch.cuda.empty_cache()
b = statistics.median(times["reference (device)"])
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"| {name} | {m * 1e3:.1f} | {min(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} | {m / b:.2f}x |")
