"""What a process's first calls cost on a CUDA device (benchmarks/GPU.md, "First calls").

Run once per mode in a fresh process, the file already in the page cache::

    PYTHONPATH=src python benchmarks/gpu_first_call_probe.py FILE pin
    PYTHONPATH=src python benchmarks/gpu_first_call_probe.py FILE plain

``pin`` first times torch's pinned allocations (three 16 MiB buffers, the gather ring; 288 MiB,
the load ring) and a first CPU op; both modes then time three TP=8 column splits (rank 0) to
``cuda:0`` with ``load_shard``'s default backend.
"""

import sys
import time

import torch

from pysafetensors.parallel import load_shard


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    dev = "cuda:0"
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    clock = time.perf_counter
    if mode == "pin":
        t0 = clock()
        ring = [torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
        print("3 x 16 MiB pinned", clock() - t0)
        t0 = clock()
        load_ring = torch.empty(288 << 20, dtype=torch.uint8, pin_memory=True)
        print("288 MiB pinned", clock() - t0)
        t0 = clock()
        torch.ones(1 << 22).clone()
        print("first CPU op", clock() - t0)
        del ring, load_ring

    def rule(name: str, shape: tuple[int, ...]) -> str:
        return "columns" if len(shape) >= 2 else "replicate"

    for call in range(3):
        t0 = clock()
        parts = load_shard(path, 0, 8, rule, framework="pt", device=dev)
        torch.cuda.synchronize()
        print("call", call, clock() - t0)
        del parts


if __name__ == "__main__":
    main()
