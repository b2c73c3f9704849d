"""Time ``torch.load_model`` into a model that already holds its memory, against the reference.

Usage: ``python benchmarks/load_model_bench.py [--reps 5] [--cold] [--quick]``.

Each repetition runs every arm in a fresh process, arms interleaved. A worker builds a model
with the benchmark LLaMA file's names, shapes and dtype (its memory written, as a constructed
model's is), reads the file back into the page cache (or drops it, ``--cold``), then times
``load_model`` alone and checks the loaded bytes against the file. Arms: ours with the default
``backend="mmap"`` (views of the mapping, copied by ``load_state_dict``), ours with
``backend="pread"`` (read in place into the parameters), what that did before (``load_file``
with ``backend="pread"`` into fresh memory, then ``load_state_dict``), and the reference's
``load_model``.
Prints a markdown table of medians and ranges.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = ("ours mmap", "ours pread", "load_file pread + copy", "reference")


def _worker(arm: str, path: str, cold: bool) -> None:
    import _cache
    import _files
    import torch

    model = _files.module_like(path)
    if cold:
        _cache.evict(path)
    else:
        _cache.warm(path, refresh=True)
    gc.collect()
    if arm == "reference":
        from safetensors.torch import load_model
    else:
        from pysafetensors.torch import load_model
    kwargs = {"backend": "pread"} if arm == "ours pread" else {}
    start = time.perf_counter()
    if arm == "load_file pread + copy":
        # What load_model did under pread before it read in place: a load into fresh
        # memory, then load_state_dict's copy.
        from pysafetensors.torch import load_file as ours_load_file

        model.load_state_dict(ours_load_file(path, backend="pread"))
    else:
        load_model(model, path, **kwargs)
    elapsed = time.perf_counter() - start
    from safetensors.torch import load_file

    expected = load_file(path)
    state = model.state_dict()
    for name, value in expected.items():
        if not torch.equal(value.view(torch.int16), state[name].view(torch.int16)):
            raise SystemExit(f"{arm}: {name} differs from the file")
    print(json.dumps({"arm": arm, "seconds": elapsed}))


def main() -> None:
    """Run the arms and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="drop the file from the page cache first")
    p.add_argument("--quick", action="store_true", help="the small file of `make bench-quick`")
    p.add_argument("--work", default=os.path.join(HERE, "_work"), help="scratch folder")
    p.add_argument("--worker", nargs=2, metavar=("ARM", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.cold)
        return
    from _files import ensure_file, specs

    work = os.path.join(args.work, "quick") if args.quick else args.work  # as run.py
    path = ensure_file(work, "llama", specs(args.quick)["llama"])
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.reps):
        for arm in ARMS:
            command = [sys.executable, __file__, "--worker", arm, path]
            if args.cold:
                command.append("--cold")
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            times[arm].append(json.loads(done.stdout.splitlines()[-1])["seconds"])
    size = os.path.getsize(path) / (1 << 20)
    cache = "cold" if args.cold else "warm"
    print(f"load_model of a {size:.0f} MiB bf16 file into a model holding its memory ({cache}),")
    print(f"{args.reps} fresh processes per arm, interleaved; medians (range):\n")
    print("| arm | median | range | x reference |")
    print("|---|---|---|---|")
    ref = statistics.median(times["reference"])
    for arm in ARMS:
        median = statistics.median(times[arm])
        low, high = min(times[arm]), max(times[arm])
        print(
            f"| {arm} | {median * 1e3:.0f} ms | {low * 1e3:.0f}-{high * 1e3:.0f} ms "
            f"| {median / ref:.2f}x |"
        )


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
