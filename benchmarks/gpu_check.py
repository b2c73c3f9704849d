"""GPU check for the pinned-buffer staging loader (run on a machine with a CUDA GPU).

Not run by ``make bench``. The script, each section recorded even when a later one fails:

1. **dtypes**: a small file of every dtype torch holds (scalars and empty tensors too), written
   by pysafetensors, loaded to the device with ``load_file``, ``get_tensor`` and ``get_slice``
   (both backends, device given as ``"cuda:N"``, ``"cuda"`` and ``N``), and ``load_shard``
   parts on the device, must equal the CPU load byte for byte;
2. **llama**: a random bf16 LLaMA-shaped file (``--gib`` GiB, default 2), every tensor loaded to
   the device by pysafetensors (both backends, ``get_tensors`` and ``get_tensor``) and by the
   reference must equal the CPU load, each of ours in a storage of its own bytes, one kept
   alone holding no more device memory than its own; then, three times, a tensor loaded into
   device memory just freed while a write into it was still queued on the current stream
   (behind a GPU sleep) must come back intact (the staging copies wait for that work:
   **stream order**);
3. **warm**: GB/s with the file in the page cache, median of ``--reps``, each run timed up to
   ``torch.cuda.synchronize()``, peak device memory per arm: pysafetensors (pread and mmap),
   the reference (mmap and pread), and two ceilings: the whole data region in one pinned
   ``copy_`` (the host-to-device link), and ``pread`` into pinned memory followed by that copy
   (disk cache and link one after the other, no overlap);
4. **tensor-parallel**: rank 0 of 8, rows and columns, ``load_shard`` to the device with each
   backend (``auto``, ``pread``, ``mmap``) against the reference's ``get_slice`` loop on the
   device: parts equal, then timed warm, and the first call of a fresh process (which pays for
   pinning its buffers) of the column split and of a whole-file ``load_file``;
5. **small tensors**: files of 1,000 (LoRA-shaped) and 20,000 (MoE-shaped) small tensors
   loaded to the device by both libraries (``load_file``; the LoRA file also by ``get_tensor``
   loops): every tensor equal to the CPU load and in a storage of its own, then timed warm;
6. **saves**: the 2 GiB of device tensors saved by both libraries, to the page cache and
   durable, files compared by SHA-256, peak host memory added;
7. **sweep**: the staging pipeline alone (``stage_to_device`` over a pread source) for worker
   counts and chunk sizes around the defaults;
8. **cold**: pysafetensors (pread) and the reference (mmap) with the file dropped from the page
   cache before each run (``posix_fadvise(DONTNEED)``, residency checked), when eviction works.

Between 2 and 3 (part of the correctness sections): **load_model**, the llama file loaded into
a model already on the device by both libraries, three times each: equal bytes, time and the
device memory each adds (ours reads into the parameters in place).

It prints markdown tables and writes ``gpu_results.json`` and ``gpu_results.md`` into ``--out``
(default: next to this script) after every section. ``--dry-run`` runs the same code on the
CPU with a small file (the copies are CPU copies), to check the script itself without a GPU;
``--correctness-only`` stops after the correctness sections; ``--skip warm,sweep,...`` leaves
out timed sections (to fit a short lease). Each section's report says how long the run has
taken so far.

Usage::

    python benchmarks/gpu_check.py [--device cuda:0] [--gib 2] [--reps 5] [--out DIR]
        [--skip warm,tp,first-calls,small,saves,sweep,cold]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIB = 1 << 20


class CpuOps:
    """The staging pipeline's device runtime on the CPU, for ``--dry-run``."""

    def alloc_device(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_host(self, nbytes: int) -> tuple[Any, memoryview]:
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, memoryview(buf.numpy()).cast("B")

    def new_stream(self) -> Any:
        return None

    def copy_async(self, host: Any, pieces: Any, stream: Any) -> Any:
        for dst, at, begin, nbytes in pieces:
            dst[at : at + nbytes].copy_(host[begin : begin + nbytes])
        return None

    def producer_event(self) -> Any:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def wait_for_producer(self, stream: Any) -> None:
        pass

    def wait(self, event: Any) -> None:
        pass

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self, streams: Any) -> None:
        pass


class NonBlockingMoves:
    """A prototype for a later decision, timed next to the library's way: the direct move of
    one small tensor (``_torch_adapter._move_small``) without its per-call synchronisation.
    Each call fills the next of a ring of kept pinned slots (waiting for that slot's previous
    copy first), queues a non-blocking copy on the current stream and records an event; the
    tensor is returned with its copy only ordered on that stream (the library's returns it
    landed, as the reference's ``.to`` does). Tensors over one slot take the library's way.
    """

    SLOT = 1 << 20

    def __init__(self, torch: Any, torch_adapter: Any, slots: int = 4) -> None:
        self.torch = torch
        self.adapter = torch_adapter
        self.real = torch_adapter._move_small
        self.slots: list[list[Any]] = []
        for _ in range(slots):
            buf = torch.empty(self.SLOT, dtype=torch.uint8, pin_memory=True)
            self.slots.append([buf, buf.numpy().data.cast("B"), None])
        self.turn = 0

    def move(self, fill: Any, nbytes: int, dtype: Any, shape: Any, target: Any) -> Any:
        if nbytes == 0 or nbytes > self.SLOT:
            return self.real(fill, nbytes, dtype, shape, target)
        torch, adapter = self.torch, self.adapter
        slot = self.slots[self.turn % len(self.slots)]
        self.turn += 1
        if slot[2] is not None:
            slot[2].synchronize()
        view = slot[1][:nbytes]
        fill(view)
        flat = torch.frombuffer(view, dtype=adapter.torch_dtype(dtype))
        out = adapter._shaped(flat, adapter._storage_shape(dtype, shape)).to(
            target, non_blocking=True
        )
        event = torch.cuda.Event()
        event.record()
        slot[2] = event
        return out

    def __enter__(self) -> NonBlockingMoves:
        self.adapter._move_small = self.move
        return self

    def __exit__(self, *exc: object) -> None:
        self.adapter._move_small = self.real
        for slot in self.slots:
            if slot[2] is not None:
                slot[2].synchronize()


class Report:
    """Results by section, written out after each one."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.data: dict[str, Any] = {"sections": {}, "errors": []}
        self.lines: list[str] = []

    def add(self, section: str, value: Any, lines: list[str]) -> None:
        lines = [*lines, "", f"({time.perf_counter() - STARTED:.0f} s since the start)"]
        self.data["sections"][section] = value
        self.lines += [f"## {section}", "", *lines, ""]
        print("\n".join([f"## {section}", "", *lines, ""]), flush=True)
        self.save()

    def error(self, section: str) -> None:
        if isinstance(sys.exc_info()[1], SectionSkipped):
            self.add(section, "skipped", ["skipped (--skip)"])
            return
        text = traceback.format_exc()
        self.data["errors"].append({"section": section, "traceback": text})
        self.lines += [f"## {section}: FAILED", "", "```", text, "```", ""]
        print(f"## {section}: FAILED\n{text}", flush=True)
        self.save()

    def save(self) -> None:
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "gpu_results.json"), "w") as f:
            json.dump(self.data, f, indent=1)
        with open(os.path.join(self.out, "gpu_results.md"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


class SectionSkipped(Exception):
    """Raised at the start of a section that ``--skip`` names."""


#: When the script started (each section's report says how long the run has taken so far).
STARTED = time.perf_counter()

#: The timed sections ``--skip`` can leave out.
SECTIONS = ("warm", "tp", "first-calls", "small", "saves", "sweep", "cold")


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes (compared on the CPU)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--work", default=os.path.join(HERE, "_work"))
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--dry-run", action="store_true", help="CPU only, to test the script")
    ap.add_argument("--correctness-only", action="store_true", help="skip the timings")
    ap.add_argument(
        "--skip",
        default="",
        help=f"timed sections to leave out, comma-separated: {','.join(SECTIONS)}",
    )
    args = ap.parse_args()
    skip = {name for name in args.skip.split(",") if name}
    if skip - set(SECTIONS):
        ap.error(f"--skip: unknown sections {sorted(skip - set(SECTIONS))}")

    def start(section: str) -> None:
        if section in skip:
            raise SectionSkipped(section)

    import numpy as np
    import torch

    dry = args.dry_run
    if dry:
        dev = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    else:
        dev = args.device
    import _cache
    import _files
    import safetensors
    import safetensors.torch as ref

    import pysafetensors
    import pysafetensors._cuda_staging as loader_defaults
    import pysafetensors._torch_adapter as torch_adapter
    import pysafetensors.torch as ours
    from pysafetensors._cuda_staging import (
        CHUNK_BYTES,
        SPARE_BUFFERS,
        WORKERS,
        TorchCudaOps,
        stage_to_device,
    )
    from pysafetensors._sources import PreadSource

    def sync() -> None:
        if not dry:
            torch.cuda.synchronize()

    report = Report(args.out)
    failures: list[str] = []
    default_direct = torch_adapter.DIRECT_BYTES
    default_scratch = loader_defaults.SCRATCH_PIECES

    def verdict() -> int:
        """Record the outcome; the exit status (1 on any failure or failed section)."""
        errors = len(report.data["errors"])
        report.add(
            "verdict",
            {"failures": failures, "errors": errors},
            [
                "correctness: " + ("OK" if not failures else f"{len(failures)} FAILURES"),
                f"sections that failed: {errors}",
            ],
        )
        return 1 if failures or errors else 0

    env = {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "cpus": os.cpu_count(),
        "device": dev,
        "gpu": "dry run (CPU)" if dry else torch.cuda.get_device_name(torch.device(dev)),
        "staging defaults": {
            "workers": WORKERS,
            "chunk_mib": CHUNK_BYTES // MIB,
            "min_chunk_mib": loader_defaults.MIN_CHUNK_BYTES // MIB,
            "buffers": WORKERS + SPARE_BUFFERS,
        },
    }
    report.add("environment", env, [f"- {k}: {v}" for k, v in env.items()])

    # ------------------------------------------------------------------ dtypes
    try:
        path = os.path.join(args.work, "gpu_dtypes.safetensors")
        os.makedirs(args.work, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        tensors: dict[str, Any] = {}
        for dt in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
        ):
            size = dt.itemsize
            raw = torch.randint(0, 256, (37 * 53 * size,), dtype=torch.uint8, generator=g)
            t = raw.view(dt).reshape(37, 53) if dt != torch.bool else raw.reshape(37, 53 * size) & 1
            if dt == torch.bool:
                t = t.bool()
            name = str(dt).split(".")[-1]
            tensors[name] = t
            tensors[name + ".scalar"] = t.reshape(-1)[0].clone()
            tensors[name + ".empty"] = t[:0]
        ours.save_file(tensors, path)
        cpu = ours.load_file(path)
        checked = 0
        index = dev.split(":")[-1] if ":" in dev else "0"
        spellings: list[Any] = [dev] if dry else [dev, "cuda", int(index)]
        for backend in ("pread", "mmap"):
            for spelling in spellings:
                got = ours.load_file(path, device=spelling, backend=backend)
                for name, t in cpu.items():
                    checked += 1
                    if got[name].device.type != torch.device(dev).type or not same_bytes(
                        got[name], t
                    ):
                        failures.append(f"dtypes {backend} {spelling!r} load_file {name}")
            # Small tensors and slices go the direct way by default (read, then one .to);
            # staged too, with the threshold lowered, so the pipeline is checked on them.
            for direct in (torch_adapter.DIRECT_BYTES, -1):
                torch_adapter.DIRECT_BYTES = direct
                try:
                    with pysafetensors.safe_open(path, "pt", device=dev, backend=backend) as f:
                        for name, t in cpu.items():
                            how = f"dtypes {backend} direct<={direct}"
                            checked += 3
                            if not same_bytes(f.get_tensor(name), t):
                                failures.append(f"{how} get_tensor {name}")
                            if t.dim() != 2:
                                continue
                            if not same_bytes(f.get_slice(name)[3:20, 5:40], t[3:20, 5:40]):
                                failures.append(f"{how} get_slice {name}")
                            rows = f.get_slice(name)[3:20]  # one byte run
                            own = rows.numel() * rows.element_size()
                            nbytes = rows.untyped_storage().nbytes()
                            if not same_bytes(rows, t[3:20]) or nbytes != own:
                                failures.append(f"{how} get_slice rows {name}")
                finally:
                    torch_adapter.DIRECT_BYTES = default_direct
        # Tensor-parallel parts on the device (rows, columns, whole tensors) equal the CPU's.
        from pysafetensors.parallel import load_shard

        def rule(name: str, shape: tuple[int, ...]) -> str:
            if len(shape) < 2:
                return "replicate"
            return "rows" if name.startswith(("f", "b")) else "columns"

        for backend in ("auto", "pread", "mmap"):
            for rank in range(3):
                on_dev = load_shard(
                    path, rank, 3, rule, framework="pt", device=dev, backend=backend
                )
                on_cpu = load_shard(path, rank, 3, rule, framework="pt", backend=backend)
                for name, t in on_cpu.items():
                    checked += 1
                    got = on_dev[name]
                    if got.device.type != torch.device(dev).type or not same_bytes(got, t):
                        failures.append(f"dtypes {backend} load_shard rank {rank} {name}")
        # A read that fails half way (the file shrank after it was opened) must raise a clear
        # error after every copy already issued has landed, not hang or crash.
        import shutil

        shrunk = path + ".shrunk"
        shutil.copyfile(path, shrunk)
        with pysafetensors.safe_open(shrunk, "pt", device=dev, backend="pread") as f:
            os.truncate(shrunk, os.path.getsize(shrunk) // 2)
            try:
                f.get_tensors()
                failures.append("dtypes: a file that shrank after open loaded without error")
            except pysafetensors.SafetensorError as exc:
                print(f"shrunk file: {exc}")
        checked += 1
        bad = [x for x in failures if x.startswith("dtypes")]
        report.add(
            "dtypes",
            {"checked": checked, "failures": bad},
            [f"{checked} loads compared with the CPU load: " + ("OK" if not bad else f"{bad}")],
        )
    except Exception:
        report.error("dtypes")

    # ------------------------------------------------------------------ llama file
    gib = 0.05 if dry else args.gib
    layers = max(1, round((gib * 2**30 - 2 * 32000 * 4096 * 2) / (386 * 2**20)))
    if dry:
        shapes = _files.llama_shapes(2, 256, 688, 2000)
    else:
        shapes = _files.llama_shapes(layers, _files.HIDDEN, _files.INTERMEDIATE, _files.VOCAB)
    t0 = time.perf_counter()
    path = _files.ensure_file(args.work, f"gpu_llama_{len(shapes)}", shapes)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
    data_start, data_size = 8 + n, size - 8 - n
    print(f"file: {size / 2**30:.2f} GiB, {len(shapes)} tensors ({time.perf_counter() - t0:.1f} s)")
    _cache.warm(path)

    try:
        cpu = ours.load_file(path, backend="pread")
        bad = []
        for backend in ("pread", "mmap"):
            got = ours.load_file(path, device=dev, backend=backend)
            with pysafetensors.safe_open(path, "pt", device=dev, backend=backend) as f:
                single = {name: f.get_tensor(name) for name in list(f.keys())[:5]}
            for name, t in cpu.items():
                if got[name].device != torch.device(dev) or not same_bytes(got[name], t):
                    bad.append(f"llama {backend} load_file {name}")
            for name, t in single.items():
                if not same_bytes(t, cpu[name]):
                    bad.append(f"llama {backend} get_tensor {name}")
            del got, single
        ref_dev = ref.load_file(path, device=dev)
        for name, t in ref_dev.items():
            if not same_bytes(t, cpu[name]):
                bad.append(f"llama: the reference disagrees on {name}")
        # Each loaded tensor has a device allocation of its own, as the reference's: storages
        # of exactly the tensor's bytes, none shared, and one tensor kept alone keeps no other.
        own = ours.load_file(path, device=dev)
        for name, t in own.items():
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                bad.append(f"llama storage of {name}: {t.untyped_storage().nbytes()} bytes")
        if len({t.untyped_storage().data_ptr() for t in own.values()}) != len(own):
            bad.append("llama: loaded tensors share a storage")
        sizes = {k: v.numel() for k, v in own.items()}
        kept_name = min(sizes, key=sizes.__getitem__)
        kept = own[kept_name]
        del own, name, t
        if not dry:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            held_bytes = torch.cuda.memory_allocated() - sum(
                x.numel() * x.element_size() for x in ref_dev.values()
            )
            if held_bytes > kept.numel() * kept.element_size() + (2 << 20):
                bad.append(f"llama: {held_bytes} device bytes held for one tensor ({kept_name})")
        del kept
        # (a loop variable would keep the last tensor, and with it a mapping, alive)
        del ref_dev, cpu
        failures += bad
        report.add(
            "llama correctness",
            {"tensors": len(shapes), "bytes": data_size, "failures": bad},
            [
                f"{len(shapes)} tensors, {data_size / 2**30:.2f} GiB, both backends and the "
                "reference against the CPU load: " + ("OK" if not bad else f"{bad[:20]}")
            ],
        )
    except Exception:
        report.error("llama correctness")

    if not dry:
        try:
            # A load into memory that kernels queued earlier on the current stream still write:
            # the allocator hands a freed block straight back to its stream, so the staging
            # copies (on side streams) must be ordered after that work, or it lands over them.
            bad = []
            with pysafetensors.safe_open(path, "pt") as f_cpu:
                name = f_cpu.keys()[0]
                expected = f_cpu.get_tensor(name)
            nbytes = expected.numel() * expected.element_size()
            with pysafetensors.safe_open(path, "pt", device=dev) as f:
                for attempt in range(3):
                    scratch = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                    torch.cuda._sleep(200_000_000)  # the GPU busy for a while on this stream
                    scratch.fill_(7)  # queued after the sleep, into the block freed next
                    del scratch
                    got = f.get_tensor(name)
                    torch.cuda.synchronize()
                    if not same_bytes(got, expected):
                        bad.append(f"stream order: attempt {attempt} of {name}")
                    del got
            failures += bad
            report.add(
                "stream order",
                {"failures": bad},
                [
                    "loads after pending writes into freed memory: "
                    + ("OK" if not bad else f"{bad}")
                ],
            )
        except Exception:
            report.error("stream order")

    def timed(fn: Callable[[], Any], prepare: Callable[[], Any]) -> tuple[float, int]:
        prepare()
        sync()
        base = 0
        if not dry:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        result = fn()
        sync()
        elapsed = time.perf_counter() - t0
        peak = 0 if dry else torch.cuda.max_memory_allocated() - base
        del result
        if not dry:
            torch.cuda.empty_cache()
        return elapsed, peak

    # ------------------------------------------------------------------ load_model in place
    try:
        # A model already on the device: ours reads the file into its parameters through the
        # staging pipeline (no second copy of the weights on the device), the reference loads
        # the file to the device and copies. Equal bytes; time and device memory added.
        reference = ours.load_file(path, backend="pread")
        model_times: dict[str, list[float]] = {"pysafetensors": [], "reference": []}
        model_peaks: dict[str, int] = {}
        bad = []
        for rep in range(3):
            for arm, loader in (("pysafetensors", ours.load_model), ("reference", ref.load_model)):
                models = [_files.module_like(path, dev)]
                elapsed, model_peaks[arm] = timed(
                    lambda: loader(models[0], path, device=dev),  # noqa: B023 - called here
                    sync,
                )
                model_times[arm].append(elapsed)
                model = models.pop()
                if rep == 0:
                    state = model.state_dict()
                    bad += [
                        f"load_model {arm} {name}"
                        for name, t in reference.items()
                        if not same_bytes(state[name], t)
                    ]
                    del state
                del model
                if not dry:
                    torch.cuda.empty_cache()
        del reference
        failures += bad
        lines = ["| arm | median s | min s | device GiB added |", "|---|---|---|---|"]
        for arm, ts in model_times.items():
            lines.append(
                f"| {arm} | {statistics.median(ts):.3f} | {min(ts):.3f} | "
                f"{model_peaks.get(arm, 0) / 2**30:.2f} |"
            )
        report.add(
            "load_model",
            {"times": model_times, "peaks": model_peaks, "failures": bad},
            [
                "load_model into a model on the device (3 runs each, warm): "
                + ("OK" if not bad else f"{bad[:20]}"),
                "",
                *lines,
            ],
        )
    except Exception:
        report.error("load_model")

    if args.correctness_only:
        return verdict()

    # ------------------------------------------------------------------ warm throughput
    def table(times: dict[str, list[float]], peaks: dict[str, int], base: str) -> list[str]:
        lines = [
            "| arm | median s | min s | GB/s | x reference | device GiB allocated |",
            "|---|---|---|---|---|---|",
        ]
        base_med = statistics.median(times[base])
        for name, ts in times.items():
            med = statistics.median(ts)
            lines.append(
                f"| {name} | {med:.3f} | {min(ts):.3f} | {data_size / med / 1e9:.2f} | "
                f"{med / base_med:.2f}x | {peaks.get(name, 0) / 2**30:.2f} |"
            )
        return lines

    try:
        start("warm")
        bufs = {
            "pinned": torch.empty(data_size, dtype=torch.uint8, pin_memory=not dry),
            "device": torch.empty(data_size, dtype=torch.uint8, device=dev),
        }
        bufs["pinned"].numpy()[:] = 1

        def pinned_copy() -> Any:
            bufs["device"].copy_(bufs["pinned"], non_blocking=True)

        def pread_then_copy() -> Any:
            view = memoryview(bufs["pinned"].numpy())
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < data_size:
                    done += os.preadv(fd, [view[done:]], data_start + done)
            finally:
                os.close(fd)
            bufs["device"].copy_(bufs["pinned"], non_blocking=True)

        import pysafetensors._cuda_staging as loader

        def each_tensor(module: Any, backend: str, min_chunk: int = 0) -> Callable[[], Any]:
            # The loop model loaders run: one get_tensor per name.
            def run() -> Any:
                default = loader.MIN_CHUNK_BYTES
                loader.MIN_CHUNK_BYTES = min_chunk or default  # type: ignore[misc]
                try:
                    with module.safe_open(path, "pt", device=dev, backend=backend) as f:
                        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
                finally:
                    loader.MIN_CHUNK_BYTES = default  # type: ignore[misc]

            return run

        arms: dict[str, Callable[[], Any]] = {
            "pysafetensors pread": lambda: ours.load_file(path, device=dev, backend="pread"),
            "pysafetensors mmap": lambda: ours.load_file(path, device=dev, backend="mmap"),
            "reference mmap": lambda: ref.load_file(path, device=dev),
            "reference pread": lambda: ref.load_file(path, device=dev, backend="pread"),
            "pysafetensors get_tensor loop (pread)": each_tensor(pysafetensors, "pread"),
            "pysafetensors get_tensor loop, chunks >= 2 MiB": each_tensor(
                pysafetensors, "pread", 2 * MIB
            ),
            "pysafetensors get_tensor loop, chunks >= 16 MiB": each_tensor(
                pysafetensors, "pread", 16 * MIB
            ),
            "reference get_tensor loop (mmap)": each_tensor(safetensors, "mmap"),
            "ceiling: one pinned copy_": pinned_copy,
            "pread into pinned, then copy_ (no overlap)": pread_then_copy,
        }
        for fn in arms.values():  # warm-up: CUDA context, allocator and pinned caches
            timed(fn, lambda: _cache.warm(path))
        times: dict[str, list[float]] = {k: [] for k in arms}
        peaks: dict[str, int] = {}
        for _ in range(args.reps):
            for name, fn in arms.items():
                elapsed, peak = timed(fn, lambda: _cache.warm(path))
                times[name].append(elapsed)
                peaks[name] = max(peaks.get(name, 0), peak)
        report.add(
            "warm",
            {"times": times, "peak_device_bytes": peaks, "data_bytes": data_size},
            [
                f"warm page cache, median of {args.reps}, x the reference's mmap arm",
                "",
                *table(times, peaks, "reference mmap"),
            ],
        )
        bufs.clear()
    except Exception:
        report.error("warm")

    # ------------------------------------------------------------------ tensor-parallel parts
    try:
        start("tp")
        from pysafetensors.parallel import load_shard

        tp = 8

        def tp_rule(along: str) -> Callable[[str, tuple[int, ...]], str]:
            def rule(name: str, shape: tuple[int, ...]) -> str:
                # 1-D tensors (norms) are replicated in a column split, as in make bench.
                if along == "rows":
                    return "rows"
                return "columns" if len(shape) >= 2 else "replicate"

            return rule

        def tp_key(shape: list[int], along: str) -> tuple[slice, ...]:
            if along == "rows" or len(shape) == 1:
                if along == "columns":
                    return (slice(None),)
                return (slice(0, -(-shape[0] // tp)),)
            return (slice(None), slice(0, -(-shape[1] // tp)))

        def ref_parts(along: str) -> Callable[[], Any]:
            def run() -> Any:
                with safetensors.safe_open(path, "pt", device=dev) as f:
                    return {
                        name: f.get_slice(name)[tp_key(f.get_slice(name).get_shape(), along)]
                        for name in f.keys()  # noqa: SIM118
                    }

            return run

        tp_arms: dict[str, Callable[[], Any]] = {}
        for along in ("rows", "columns"):
            # "auto" (the default) reads rows as "pread" does, columns as "mmap" does.
            for backend in ("auto", "pread", "mmap") if along == "columns" else ("pread", "mmap"):
                tp_arms[f"{along}: pysafetensors load_shard ({backend})"] = (
                    lambda a=along, b=backend: load_shard(
                        path, 0, tp, tp_rule(a), framework="pt", device=dev, backend=b
                    )
                )
            tp_arms[f"{along}: reference get_slice loop"] = ref_parts(along)
        # Correctness first: every arm's parts equal, byte for byte.
        tp_bytes: dict[str, int] = {}
        tp_bad: list[str] = []
        for along in ("rows", "columns"):
            want = ref_parts(along)()
            tp_bytes[along] = sum(t.numel() * t.element_size() for t in want.values())
            for backend in ("auto", "pread", "mmap"):
                got = load_shard(
                    path, 0, tp, tp_rule(along), framework="pt", device=dev, backend=backend
                )
                for name, t in want.items():
                    if not same_bytes(got[name], t):
                        tp_bad.append(f"tp {along} {backend} {name}")
            del want, got
        failures += tp_bad
        for fn in tp_arms.values():
            timed(fn, lambda: _cache.warm(path))
        tp_times: dict[str, list[float]] = {k: [] for k in tp_arms}
        for _ in range(args.reps):
            for name, fn in tp_arms.items():
                elapsed, _peak = timed(fn, lambda: _cache.warm(path))
                tp_times[name].append(elapsed)
        lines = [
            "| arm | median s | min s | GiB on the device | x reference |",
            "|---|---|---|---|---|",
        ]
        for name, ts in tp_times.items():
            along = name.split(":")[0]
            med = statistics.median(ts)
            base = statistics.median(tp_times[f"{along}: reference get_slice loop"])
            lines.append(
                f"| {name} | {med:.3f} | {min(ts):.3f} | {tp_bytes[along] / 2**30:.3f} | "
                f"{med / base:.2f}x |"
            )
        # The first call of a process also pays for its pinned buffers (torch caches them
        # afterwards): the column split and a whole-file load once per fresh process, CUDA
        # already initialised.
        first_call = (
            "import sys, time, torch\n"
            "sys.path.insert(0, 'src')\n"
            "import safetensors, safetensors.torch\n"
            "import pysafetensors.torch\n"
            "from pysafetensors.parallel import load_shard\n"
            "path, dev, op, arm = sys.argv[1:5]\n"
            "torch.zeros(1, device=dev); torch.cuda.synchronize()\n"
            "rule = lambda n, s: 'columns' if len(s) >= 2 else 'replicate'\n"
            "key = lambda s: ((slice(None),) if len(s) == 1\n"
            "                 else (slice(None), slice(0, s[1] // 8)))\n"
            "t0 = time.perf_counter()\n"
            "if op == 'load' and arm == 'reference':\n"
            "    r = safetensors.torch.load_file(path, device=dev)\n"
            "elif op == 'load':\n"
            "    r = pysafetensors.torch.load_file(path, device=dev, backend=arm)\n"
            "elif arm == 'reference':\n"
            "    with safetensors.safe_open(path, 'pt', device=dev) as f:\n"
            "        r = {k: f.get_slice(k)[key(f.get_slice(k).get_shape())] for k in f.keys()}\n"
            "else:\n"
            "    r = load_shard(path, 0, 8, rule, framework='pt', device=dev, backend=arm)\n"
            "torch.cuda.synchronize()\n"
            "print(time.perf_counter() - t0)\n"
        )
        fresh_times: dict[str, dict[str, list[float]]] = {}
        if not dry and "first-calls" not in skip:
            import subprocess

            root = os.path.dirname(HERE)
            fresh_arms = {
                "columns": ("auto", "pread", "reference"),
                "load": ("pread", "mmap", "reference"),
            }
            for _ in range(3):
                for op, op_arms in fresh_arms.items():
                    for arm in op_arms:
                        _cache.warm(path)
                        done = subprocess.run(
                            [sys.executable, "-c", first_call, path, dev, op, arm],
                            cwd=root,
                            capture_output=True,
                            text=True,
                            check=True,
                        )
                        fresh_times.setdefault(op, {}).setdefault(arm, []).append(
                            float(done.stdout.split()[-1])
                        )
            for op, what in (("columns", "columns"), ("load", "whole-file load_file")):
                base = statistics.median(fresh_times[op]["reference"])
                lines += [
                    "",
                    f"{what}, first call of a fresh process (median of 3):",
                    "",
                    "| arm | median s | x reference |",
                    "|---|---|---|",
                    *(
                        f"| {arm} | {statistics.median(ts):.3f} | "
                        f"{statistics.median(ts) / base:.2f}x |"
                        for arm, ts in fresh_times[op].items()
                    ),
                ]
        report.add(
            "tensor-parallel",
            {"times": tp_times, "bytes": tp_bytes, "failures": tp_bad, "first_call": fresh_times},
            [
                f"rank 0 of {tp} to the device, warm, median of {args.reps}; parts equal to "
                "the reference's: " + ("OK" if not tp_bad else f"{tp_bad[:10]}"),
                "",
                *lines,
            ],
        )
    except Exception:
        report.error("tensor-parallel")

    # ------------------------------------------------------------------ many small tensors
    try:
        start("small")
        lora, moe = (100, 2000) if dry else (1000, 20000)
        # The non-blocking prototype's arms run only where one trial move through it works
        # (it has never run on a GPU before; its failure must not cost the section).
        prototype_note = "not run (dry run)"
        if not dry:
            try:
                probe = torch.arange(64, dtype=torch.uint8)
                with NonBlockingMoves(torch, torch_adapter) as moves:
                    moved = moves.move(
                        lambda view: view.__setitem__(slice(None), probe.numpy().tobytes()),
                        64,
                        torch_adapter._FROM_TORCH[torch.uint8],
                        (64,),
                        torch.device(dev),
                    )
                prototype_note = "ok" if torch.equal(moved.cpu(), probe) else "wrong bytes"
            except Exception as exc:  # noqa: BLE001 - reported, the arms left out
                prototype_note = f"failed: {exc!r}"
        with_nonblocking = prototype_note == "ok"
        small_files = {
            f"LoRA ({lora:,} tensors of 8 KiB)": _files.ensure_file(
                args.work, "gpu_lora", _files.lora_shapes(lora)
            ),
            f"MoE ({moe:,} tensors of 256 bytes)": _files.ensure_file(
                args.work, "gpu_moe", _files.moe_shapes(moe)
            ),
        }
        small_bad: list[str] = []
        small_times: dict[str, dict[str, list[float]]] = {}
        lines = []
        for what, small_path in small_files.items():
            small_arms: dict[str, Callable[[], Any]] = {
                "pysafetensors pread": lambda p=small_path: ours.load_file(
                    p, device=dev, backend="pread"
                ),
                "pysafetensors mmap": lambda p=small_path: ours.load_file(
                    p, device=dev, backend="mmap"
                ),
                "reference mmap": lambda p=small_path: ref.load_file(p, device=dev),
            }

            def from_host(run: Callable[[], Any]) -> Callable[[], Any]:
                # A chunk's pieces copied from the pinned buffer one by one (as before the
                # scratch allocation), for the comparison in one run.
                def forced() -> Any:
                    loader_defaults.SCRATCH_PIECES = 1 << 62
                    try:
                        return run()
                    finally:
                        loader_defaults.SCRATCH_PIECES = default_scratch

                return forced

            small_arms["pysafetensors pread, pieces copied from host"] = from_host(
                small_arms["pysafetensors pread"]
            )
            if "LoRA" in what:
                # One call per tensor, as model loaders make them: each of ours is a staging
                # run of its own (workers, a pinned buffer, an event), each of the
                # reference's one blocking copy.
                def loop(module: Any, backend: str, p: str = small_path) -> Callable[[], Any]:
                    def run() -> Any:
                        with module.safe_open(p, "pt", device=dev, backend=backend) as f:
                            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118

                    return run

                def staged(run: Callable[[], Any]) -> Callable[[], Any]:
                    def forced() -> Any:
                        torch_adapter.DIRECT_BYTES = -1  # every call through the pipeline
                        try:
                            return run()
                        finally:
                            torch_adapter.DIRECT_BYTES = default_direct

                    return forced

                small_arms["pysafetensors get_tensor loop (pread)"] = loop(pysafetensors, "pread")
                small_arms["pysafetensors get_tensor loop, staged (pread)"] = staged(
                    loop(pysafetensors, "pread")
                )
                small_arms["reference get_tensor loop (mmap)"] = loop(safetensors, "mmap")
                if with_nonblocking:
                    prototype = loop(pysafetensors, "pread")

                    def with_prototype(run: Callable[[], Any] = prototype) -> Any:
                        with NonBlockingMoves(torch, torch_adapter):
                            return run()

                    small_arms["pysafetensors get_tensor loop, non-blocking prototype (pread)"] = (
                        with_prototype
                    )
            want = ours.load_file(small_path)
            for arm, fn in small_arms.items():
                got = fn()
                for name, t in want.items():
                    if not same_bytes(got[name], t):
                        small_bad.append(f"small {what} {arm} {name}")
                        break
                if arm.startswith("pysafetensors") and any(
                    t.untyped_storage().nbytes() != t.numel() * t.element_size()
                    for t in got.values()
                ):
                    small_bad.append(f"small {what} {arm}: a storage that is not the tensor's")
                del got
            del want
            times = small_times[what] = {k: [] for k in small_arms}
            for _ in range(args.reps):
                for arm, fn in small_arms.items():
                    elapsed, _peak = timed(fn, lambda p=small_path: _cache.warm(p))
                    times[arm].append(elapsed)
            base = statistics.median(times["reference mmap"])
            lines += [
                f"{what} to the device, warm, median of {args.reps}:",
                "",
                "| arm | median s | min s | x reference |",
                "|---|---|---|---|",
                *(
                    f"| {arm} | {statistics.median(ts):.4f} | {min(ts):.4f} | "
                    f"{statistics.median(ts) / base:.2f}x |"
                    for arm, ts in times.items()
                ),
                "",
            ]
        # Where one tensor is better staged than moved directly (DIRECT_BYTES), and what the
        # pinned memory of the direct way gains: a get_tensor loop over tensors of one size.
        sizes = [64 << 10, 256 << 10] if dry else [64 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20]
        per_call: dict[str, dict[str, list[float]]] = {}
        size_lines = [
            "| tensor size | tensors | direct (pinned) us/call | non-blocking (prototype) "
            "us/call | direct (pageable) us/call | staged us/call | reference us/call | "
            "pinned / non-blocking / pageable / staged vs reference |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for size in sizes:
            count = max(8, min(256, (64 << 20) // size))
            size_path = _files.ensure_file(
                args.work, f"gpu_size_{size}", [(f"t{i}", [size // 2]) for i in range(count)]
            )

            def size_loop(
                module: Any, direct: int, pageable: bool = False, p: str = size_path
            ) -> Callable[[], Any]:
                def run() -> Any:
                    torch_adapter.DIRECT_BYTES = direct
                    if pageable:  # no pinned memory: the pageable .to, the reference's way
                        torch_adapter._PINNED_OK[0] = False
                        torch_adapter._PINNED.__dict__.pop("kept", None)
                    try:
                        with module.safe_open(p, "pt", device=dev) as f:
                            return [f.get_tensor(name) for name in f.keys()]  # noqa: SIM118
                    finally:
                        torch_adapter.DIRECT_BYTES = default_direct
                        torch_adapter._PINNED_OK[0] = True

                return run

            def nonblocking(run: Callable[[], Any]) -> Callable[[], Any]:
                def with_prototype() -> Any:
                    with NonBlockingMoves(torch, torch_adapter):
                        return run()

                return with_prototype

            size_arms = {
                "direct": size_loop(pysafetensors, 1 << 62),
                "pageable": size_loop(pysafetensors, 1 << 62, pageable=True),
                "staged": size_loop(pysafetensors, -1),
                "reference": size_loop(safetensors, default_direct),
            }
            if with_nonblocking and size <= NonBlockingMoves.SLOT:
                size_arms["non-blocking"] = nonblocking(size_loop(pysafetensors, 1 << 62))
            want_list = list(ours.load_file(size_path).values())
            for arm, fn in size_arms.items():
                if not all(same_bytes(g, w) for g, w in zip(fn(), want_list, strict=True)):
                    small_bad.append(f"size {size} {arm}")
            key = f"{size // 1024} KiB"
            per_call[key] = {arm: [] for arm in size_arms}
            for _ in range(args.reps):
                for arm, fn in size_arms.items():
                    elapsed, _peak = timed(fn, lambda p=size_path: _cache.warm(p))
                    per_call[key][arm].append(elapsed / count * 1e6)
            med = {arm: statistics.median(v) for arm, v in per_call[key].items()}
            size_order = ("direct", "non-blocking", "pageable", "staged")
            size_lines.append(
                f"| {key} | {count} | "
                + " | ".join(f"{med[arm]:.0f}" if arm in med else "-" for arm in size_order)
                + f" | {med['reference']:.0f} | "
                + " / ".join(
                    f"{med[arm] / med['reference']:.2f}x" if arm in med else "-"
                    for arm in size_order
                )
                + " |"
            )
        lines += [
            f"get_tensor loop, one size per file, warm, median of {args.reps} "
            f"(DIRECT_BYTES is {default_direct >> 10} KiB):",
            "",
            *size_lines,
            "",
        ]
        failures += small_bad
        foreach = loader_defaults._FOREACH_COPY[0]
        report.add(
            "small tensors",
            {
                "times": small_times,
                "per_call_us": per_call,
                "failures": small_bad,
                "foreach_copy": foreach,
                "nonblocking_prototype": prototype_note,
            },
            [
                "every tensor equal to the CPU load, each in a storage of its own: "
                + ("OK" if not small_bad else f"{small_bad[:10]}"),
                f"a chunk's pieces copied by torch._foreach_copy_: {foreach}",
                f"non-blocking prototype: {prototype_note}",
                "",
                *lines,
            ],
        )
    except Exception:
        report.error("small tensors")

    # ------------------------------------------------------------------ saves from the device
    def host_peak_reset() -> int:
        # Resets VmHWM to the current RSS (Linux); returns the RSS then, in bytes.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return -1
        return status_kib("VmRSS") * 1024

    def status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0

    try:
        start("saves")
        import hashlib

        held = {"device": ours.load_file(path, device=dev)}
        on_host = {k: v.cpu() for k, v in held["device"].items()}
        out_ours = os.path.join(args.work, "save_ours.safetensors")
        out_ref = os.path.join(args.work, "save_ref.safetensors")
        out_host = os.path.join(args.work, "save_host.safetensors")

        def digest(p: str) -> str:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while block := f.read(64 << 20):
                    h.update(block)
            return h.hexdigest()

        ours.save_file(held["device"], out_ours)
        ref.save_file(held["device"], out_ref)
        ours.save_file(on_host, out_host)
        same = digest(out_ours) == digest(out_ref) == digest(out_host) == digest(path)
        if not same:
            failures.append("save: files from device tensors differ from the reference's")
        del on_host
        save_arms: dict[str, Callable[[], Any]] = {
            "pysafetensors save_file": lambda: ours.save_file(held["device"], out_ours),
            "reference save_file": lambda: ref.save_file(held["device"], out_ref),
            "pysafetensors save_file (durable)": lambda: ours.save_file(
                held["device"], out_ours, fsync=True
            ),
            "reference save_file + fsync": lambda: (
                ref.save_file(held["device"], out_ref),
                os.fsync(fd := os.open(out_ref, os.O_RDONLY)),
                os.close(fd),
            ),
        }

        def fresh() -> None:
            for p in (out_ours, out_ref):
                if os.path.exists(p):
                    os.unlink(p)
            os.sync()

        save_times: dict[str, list[float]] = {k: [] for k in save_arms}
        host_extra: dict[str, int] = {}
        for rep in range(args.reps):
            for name, fn in save_arms.items():
                if ("durable" in name or "fsync" in name) and rep >= 3:
                    continue
                fresh()
                before = host_peak_reset()
                elapsed, _peak = timed(fn, lambda: None)
                save_times[name].append(elapsed)
                if before >= 0:
                    extra = status_kib("VmHWM") * 1024 - before
                    host_extra[name] = max(host_extra.get(name, 0), extra)
        lines = [
            "| arm | median s | min s | GB/s | x reference | peak host memory added, MiB |",
            "|---|---|---|---|---|---|",
        ]
        for name, ts in save_times.items():
            base = (
                "reference save_file + fsync"
                if "durable" in name or "fsync" in name
                else ("reference save_file")
            )
            med = statistics.median(ts)
            lines.append(
                f"| {name} | {med:.3f} | {min(ts):.3f} | {data_size / med / 1e9:.2f} | "
                f"{med / statistics.median(save_times[base]):.2f}x | "
                f"{host_extra.get(name, -1) / MIB:.0f} |"
            )
        report.add(
            "save from the device",
            {"times": save_times, "host_extra_bytes": host_extra, "identical_files": same},
            [
                f"{len(held['device'])} CUDA tensors, {data_size / 2**30:.2f} GiB, to the page "
                f"cache (durable: median of 3); files identical to the reference's and to a "
                f"save of the CPU copies: {same}",
                "",
                *lines,
            ],
        )
        held.clear()
        fresh()
    except Exception:
        report.error("save from the device")

    # ------------------------------------------------------------------ sweep
    try:
        start("sweep")
        ops: Any = CpuOps() if dry else TorchCudaOps(dev)
        fd = os.open(path, os.O_RDONLY)
        source = PreadSource(fd, path)
        try:
            sweep: dict[str, list[float]] = {}
            configs = [(w, c, 2) for w in (4, 8, 12, 16) for c in (8, 16, 32)]
            configs += [(16, 16, 16), (16, 32, 16)]  # two buffers per worker, for comparison
            for workers, chunk, spare in configs:
                key = f"{workers} workers x {chunk} MiB, {workers + spare} buffers"
                sweep[key] = []
                for _ in range(max(3, args.reps - 2)):
                    elapsed, _peak = timed(
                        lambda w=workers, c=chunk, sp=spare: stage_to_device(
                            source.readinto,
                            data_start,
                            data_size,
                            ops,
                            chunk_bytes=c * MIB,
                            workers=w,
                            spare_buffers=sp,
                        ),
                        lambda: None,
                    )
                    sweep[key].append(elapsed)
        finally:
            source.close()
        lines = ["| pipeline | median s | min s | GB/s |", "|---|---|---|---|"]
        for key, ts in sweep.items():
            med = statistics.median(ts)
            lines.append(f"| {key} | {med:.3f} | {min(ts):.3f} | {data_size / med / 1e9:.2f} |")
        report.add("sweep", sweep, ["stage_to_device over a pread source, warm", "", *lines])
    except Exception:
        report.error("sweep")

    # ------------------------------------------------------------------ cold
    try:
        start("cold")
        residency = _cache.evict(path)
        if residency > 0.01:
            report.add("cold", {"skipped": residency}, [f"eviction failed ({residency:.2f})"])
        else:
            cold_arms = {
                "pysafetensors pread": arms["pysafetensors pread"],
                "pysafetensors mmap": arms["pysafetensors mmap"],
                "reference mmap": arms["reference mmap"],
                "reference pread": arms["reference pread"],
            }
            cold: dict[str, list[float]] = {k: [] for k in cold_arms}
            cold_peaks: dict[str, int] = {}
            resid: list[float] = []
            for _ in range(3):
                for name, fn in cold_arms.items():
                    elapsed, peak = timed(fn, lambda: resid.append(_cache.evict(path)))
                    cold[name].append(elapsed)
                    cold_peaks[name] = max(cold_peaks.get(name, 0), peak)
            report.add(
                "cold",
                {"times": cold, "residency_before": resid},
                [
                    f"file dropped from the page cache before each run (residency at most "
                    f"{max(resid):.3f}), median of 3",
                    "",
                    *table(cold, cold_peaks, "reference mmap"),
                ],
            )
    except Exception:
        report.error("cold")

    return verdict()


if __name__ == "__main__":
    sys.exit(main())
