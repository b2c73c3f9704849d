"""One rank of the tensor-parallel test, run as its own process (as torchrun would start it).

Usage: ``python tp_worker.py RANK WORLD_SIZE STORE_FILE MODEL_PATH RESULT_DIR``

The rank joins a gloo process group through a FileStore, loads its shard with
:func:`pysafetensors.parallel.load_shard` while counting every byte ``os.preadv`` returns,
all-gathers the shards, checks that they concatenate to the full tensors, and writes what it
read to ``RESULT_DIR/rank-N.json`` for the parent test to check.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from pysafetensors import safe_open
from pysafetensors.parallel import load_shard

#: The rules the test model is split by (must match test_tensor_parallel.py).
RULES: dict[str, Any] = {
    "*.q.weight": "rows",
    "*.o.weight": "columns",
    "*.conv.weight": -1,
    "*.norm.weight": "replicate",
}


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    store_file, model, result_dir = sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    with safe_open(model, "pt") as f:
        data_start = f.header.data_start
        full = {name: f.get_tensor(name) for name in f.offset_keys()}

    # Count every byte the positioned-read system calls return (the pread backend uses them).
    reads: list[tuple[int, int]] = []
    real_preadv, real_pread = os.preadv, os.pread

    def counting_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        n = real_preadv(fd, buffers, offset, *args)
        reads.append((offset, n))
        return n

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        got = real_pread(fd, length, offset)
        reads.append((offset, len(got)))
        return got

    os.preadv, os.pread = counting_preadv, counting_pread  # type: ignore[assignment]
    try:
        # "exact": every rank must read exactly its own bytes (the default coalesces column
        # splits into whole-row reads, which the parent's byte accounting would count).
        shard = load_shard(
            model, rank, world, RULES, framework="pt", uneven="chunk", slice_reads="exact"
        )
    finally:
        os.preadv, os.pread = real_preadv, real_pread  # type: ignore[assignment]
    assert reads, "no positioned reads were seen: the byte accounting below would be empty"

    # Real collectives: every rank gets every rank's shard and rebuilds the full tensors.
    for name, tensor in full.items():
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, shard[name])
        rule = next(r for p, r in RULES.items() if name.endswith(p.lstrip("*")))
        if rule == "replicate":
            for part in parts:
                assert torch.equal(part, tensor), name
            continue
        dim = {"rows": 0, "columns": 1}.get(rule, rule)
        rebuilt = torch.cat(parts, dim=dim)
        assert rebuilt.dtype == tensor.dtype and torch.equal(rebuilt, tensor), name
        # Each rank's part is torch.chunk's part (empty when torch.chunk has fewer chunks).
        chunks = torch.chunk(tensor, world, dim=dim)
        expected = chunks[rank] if rank < len(chunks) else tensor.narrow(dim, 0, 0)
        assert torch.equal(shard[name], expected), name

    # A tensor-collective check too, on an evenly split tensor.
    q = shard["layer.q.weight"].float().contiguous()
    gathered = [torch.empty_like(q) for _ in range(world)]
    dist.all_gather(gathered, q)
    assert torch.equal(torch.cat(gathered), full["layer.q.weight"].float())

    # Bytes read inside each tensor's data range, against the bytes of this rank's part.
    per_tensor: dict[str, dict[str, int]] = {}
    with safe_open(model, "pt") as f:
        for name in f.offset_keys():
            begin, end = f.get_tensor_meta(name).data_offsets
            lo, hi = data_start + begin, data_start + end
            got = sum(max(0, min(o + n, hi) - max(o, lo)) for o, n in reads if o >= data_start)
            per_tensor[name] = {
                "read": got,
                "shard": shard[name].numel() * shard[name].element_size(),
                "full": end - begin,
            }
    header_read = sum(n for off, n in reads if off < data_start)
    with open(os.path.join(result_dir, f"rank-{rank}.json"), "w") as out:
        json.dump({"tensors": per_tensor, "header_read": header_read}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
