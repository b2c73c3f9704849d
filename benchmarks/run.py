"""Side-by-side benchmark: pysafetensors vs the reference (Rust), torch, and raw ceilings.

Every measurement runs in a fresh subprocess (``_worker.py``), the cells in a new random order
every repetition (seeded), and medians are reported. Writes ``benchmarks/RESULTS.md`` and
``benchmarks/results.json`` (``--quick`` writes ``RESULTS.quick.md``/``results.quick.json`` under
``benchmarks/_work/`` unless ``--out`` says otherwise).

Usage::

    python benchmarks/run.py            # full run (~27 minutes on a 2-core VM)
    python benchmarks/run.py --quick    # tiny files, 1 repetition, < 60 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _cache  # noqa: E402
import _files  # noqa: E402

# (file, op, states, arms). "ceiling_*" arms are the raw limits measured in the same run.
LOAD_ARMS = ["pysafetensors", "ref_mmap", "ref_pread", "torch", "ceiling_pread"]
PLAN: list[tuple[str, str, tuple[str, ...], list[str]]] = [
    ("llama", "load", ("warm", "cold"), LOAD_ARMS),
    ("llama", "load", ("warm",), ["ceiling_memcpy"]),
    ("llama", "load", (_cache.WARM_CACHE_ONLY,), ["pysafetensors", "ref_mmap", "ref_pread"]),
    ("llama", "lazy", ("warm", "cold"), ["pysafetensors", "ref_mmap", "torch", "ceiling_mmap"]),
    ("llama", "tp_rows", ("warm", "cold"), ["pysafetensors", "ref_mmap", "ref_pread"]),
    ("llama", "tp_cols", ("warm", "cold"), ["pysafetensors", "ref_mmap", "ref_pread"]),
    ("llama", "tp_rows", ("warm", "cold"), ["torch"]),
    ("llama", "tp_cols", ("warm", "cold"), ["torch"]),
    ("llama", "save", ("-",), ["pysafetensors", "ref", "torch", "ceiling_write"]),
    ("llama", "save_durable", ("-",), ["pysafetensors", "ref", "torch", "ceiling_write"]),
    ("lora", "load", ("warm",), LOAD_ARMS),
    ("lora", "save", ("-",), ["pysafetensors", "ref", "torch", "ceiling_write"]),
    ("lora", "save_durable", ("-",), ["pysafetensors", "ref", "torch", "ceiling_write"]),
    ("lora", "open", ("warm",), ["pysafetensors", "ref_mmap", "ref_pread", "torch"]),
    ("moe", "open", ("warm", "cold"), ["pysafetensors", "ref_mmap", "ref_pread", "torch"]),
    ("moe", "lazy", ("warm",), ["pysafetensors", "ref_mmap", "torch"]),
]

OP_TITLES = {
    "load": "load + materialize every byte into private memory",
    "lazy": "lazy load (mmap) + touch every page",
    "open": "open (header only)",
    "tp_rows": "TP rank 0/8, split along rows",
    "tp_cols": "TP rank 0/8, split along columns",
    "save": "save_file to page cache",
    "save_durable": "save_file durable (fsync in timer)",
}

# Targets: (file, op, state) -> max ratio to the reference; extra ceiling targets separately.
TARGETS: dict[tuple[str, str, str], float] = {
    ("llama", "load", "warm"): 0.6,
    ("llama", "load", _cache.WARM_CACHE_ONLY): 0.6,
    ("lora", "load", "warm"): 1.2,
    ("llama", "load", "cold"): 0.8,
    ("llama", "save", "-"): 1.0,
    ("llama", "save_durable", "-"): 1.0,
    ("lora", "save", "-"): 1.2,
    ("lora", "save_durable", "-"): 1.2,
    ("llama", "tp_rows", "warm"): 0.3,
    ("llama", "tp_rows", "cold"): 0.3,
    ("llama", "tp_cols", "warm"): 0.5,
    ("llama", "tp_cols", "cold"): 0.7,
    ("moe", "open", "warm"): 1.5,
    ("moe", "open", "cold"): 1.5,
    ("llama", "lazy", "warm"): 1.0,
    ("llama", "lazy", "cold"): 1.0,
    ("moe", "lazy", "warm"): 1.0,
}
CEILING_TARGETS: dict[tuple[str, str, str], tuple[str, float]] = {
    ("llama", "load", "warm"): ("ceiling_pread", 1.5),
    ("llama", "save", "-"): ("ceiling_write", 1.15),
    ("llama", "save_durable", "-"): ("ceiling_write", 1.15),
}
# Peak extra memory of ours (VmHWM during the operation minus RSS before it), in bytes.
MEMORY_TARGETS: dict[tuple[str, str, str], int] = {
    ("llama", "save", "-"): 64 << 20,
    ("llama", "save_durable", "-"): 64 << 20,
}
# How often the parent samples a worker's RssAnon/RssFile during the timed operation.
SAMPLE_S = 0.002


def machine() -> dict[str, Any]:
    """Describe the machine the numbers come from."""
    import numpy
    import safetensors
    import torch

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "?"

    cpu = "?"
    for line in read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = 0
    for line in read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal"):
            mem_kb = int(line.split()[1])
    dev = os.stat(HERE).st_dev
    disk = "?"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                major, minor = (int(x) for x in parts[2].split(":"))
                if os.makedev(major, minor) == dev:
                    fs = parts[parts.index("-") + 1]
                    src = parts[parts.index("-") + 2]
                    blk = os.path.basename(src)
                    rota = read(f"/sys/block/{blk}/queue/rotational")
                    ra = read(f"/sys/block/{blk}/queue/read_ahead_kb")
                    kind = "virtio" if blk.startswith("vd") else blk
                    disk = (
                        f"{kind} block device ({src}), {fs}, rotational={rota}, read_ahead_kb={ra}"
                    )
                    break
    except (OSError, ValueError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "disk": disk,
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "safetensors (reference)": safetensors.__version__,
    }


def prepare(work: str, quick: bool) -> dict[str, dict[str, str]]:
    """Create (or reuse) the input files and the torch.save twins of each."""
    import torch
    from safetensors.torch import load_file

    paths = {}
    for key, shapes in _files.specs(quick).items():
        path = _files.ensure_file(work, key, shapes)
        pt = path[: -len(".safetensors")] + ".pt"
        if not os.path.exists(pt) or os.path.getmtime(pt) < os.path.getmtime(path):
            torch.save(load_file(path, backend="pread"), pt)
        paths[key] = {"path": path, "pt_path": pt, "out_path": os.path.join(work, f"out.{key}")}
    return paths


def _rss_kinds(pid: int) -> tuple[int, int] | None:
    """``RssAnon`` and ``RssFile`` of process ``pid`` in bytes (None once it is gone)."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return anon, file


def peak_split(pid: int, fd: int, peaks: dict[str, int]) -> None:
    """Sample the worker's anonymous and file-backed RSS every :data:`SAMPLE_S` between its
    start and end signals on ``fd`` (the kernel keeps a peak of their sum only, ``VmHWM``),
    into ``peaks``. Sampled from this process, so the worker's operation runs undisturbed."""
    started = False
    while True:
        ready, _, _ = select.select([fd], [], [], SAMPLE_S if started else None)
        data = os.read(fd, 16) if ready else b""
        if ready and not data:
            return  # the worker exited
        started = started or b"s" in data
        if started:
            now = _rss_kinds(pid)
            if now is not None:
                peaks["anon"] = max(peaks.get("anon", 0), now[0])
                peaks["file"] = max(peaks.get("file", 0), now[1])
                peaks["samples"] = peaks.get("samples", 0) + 1
        if b"e" in data:
            return


def run_one(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One case in a fresh worker process, with its peak anonymous and file-backed memory
    sampled from here during the timed operation."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "_worker.py"),
                json.dumps({**case, "signal_fd": write_end}),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(write_end,),
        )
    finally:
        os.close(write_end)
    peaks: dict[str, int] = {}
    sampler = threading.Thread(target=peak_split, args=(proc.pid, read_end, peaks), daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        sampler.join(timeout=5)
        os.close(read_end)
    if proc.returncode != 0:
        return {"error": (err or out).strip().splitlines()[-1:]}
    res = dict(json.loads(out.strip().splitlines()[-1]))
    if peaks.get("samples"):
        # The end state counts too (a result still growing at the last sample).
        res["peak_anon_delta"] = max(peaks["anon"], res["anon_after"]) - res["anon_before"]
        res["peak_file_delta"] = max(peaks["file"], res["file_after"]) - res["file_before"]
        res["peak_samples"] = peaks["samples"]
    return res


def run_batch(cases: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_worker.py"), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return [{"error": err} for _ in cases]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def case_key(case: dict[str, Any]) -> str:
    return f"{case['file']}|{case['op']}|{case['state']}|{case['arm']}"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x < 0.01:
        return f"{x * 1000:.2f} ms"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    return f"{x:.2f} s"


def fmt_b(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / 2**20:.0f} MiB"


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians per case key ``file|op|state|arm``."""
    out = {}
    for key, runs in raw.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out[key] = {"error": runs[0].get("error"), "n": 0}
            continue
        med: dict[str, Any] = {"n": len(ok), "errors": [r["error"] for r in runs if "error" in r]}
        for field in (
            "seconds",
            "read_bytes",
            "rchar",
            "peak_rss_delta",
            "anon_delta",
            "file_delta",
        ):
            med[field] = statistics.median(r[field] for r in ok)
        # Sampled by run_one only (not in quick mode's batch, nor in results before run 38).
        for field in ("peak_anon_delta", "peak_file_delta"):
            sampled = [r[field] for r in ok if field in r]
            med[field] = statistics.median(sampled) if sampled else None
        # Older results lack it (added later); 0 there reads as "not recorded".
        med["file_pmd_mapped"] = statistics.median(r.get("file_pmd_mapped", 0) for r in ok)
        med["min_seconds"] = min(r["seconds"] for r in ok)
        res = [r["residency_before"] for r in ok if r.get("residency_before") is not None]
        med["residency_before"] = statistics.median(res) if res else None
        out[key] = med
    return out


def strategies() -> dict[str, Any]:
    """The process-wide strategies the workers run with: the defaults unless ``PYSAFETENSORS_*``
    variables (which the workers inherit) set others."""
    from pysafetensors import tuning

    return tuning.settings().as_dict()


def render(meta: dict[str, Any], summary: dict[str, dict[str, Any]], sizes: dict[str, int]) -> str:
    m = meta["machine"]
    lines = [
        "# Benchmark: pysafetensors vs the reference",
        "",
        f"Generated by `benchmarks/run.py{' --quick' if meta['quick'] else ''}` on {meta['date']} "
        f"in {meta['wall_s']:.0f} s; {meta['reps']} repetitions per cell, each in a fresh "
        "subprocess, "
        + (
            f"every cell in a new random order every repetition (seed {meta['order_seed']})"
            if "order_seed" in meta
            else "arms interleaved"
        )
        + "; medians (a cell with fewer successful repetitions shows `(n=k)`).",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in m.items()),
        "",
        *(
            [
                "Strategies in force (`pysafetensors.tuning`, as the environment set them): "
                + "; ".join(f"{k}: {v}" for k, v in meta["strategies"].items()),
                "",
            ]
            if "strategies" in meta
            else []
        ),
        "Starting state: right before every timed operation except opens and the "
        f"`{_cache.WARM_CACHE_ONLY}` row, the worker touches "
        "and frees 1.25x the file's size of memory, so that every arm draws recently used "
        "memory (on this VM, memory the guest has not touched recently faults in several times "
        "slower, most of all as huge pages or large page-cache folios, and single runs of the "
        "same code swung up to 4x with it; see `benchmarks/_cache.py`), then runs a full "
        "garbage collection (the one the imports owe, ~80 ms, which otherwise fell in whichever "
        "arm's operation set it off; from run 27). The warm-up favours an arm that draws huge "
        "pages (ours does, with `madvise` transparent huge pages, where the reference's "
        f"buffers do not), so the warm load is also timed without it (`{_cache.WARM_CACHE_ONLY}`"
        ") and its target judged there too. Warm: the file is "
        "dropped from the page cache and read back sequentially before every repetition, so "
        "that every arm starts from the same cache layout (2 MiB folios where memory allows; "
        "the worker reports `file_pmd_mapped`, the bytes mapped 2 MiB at a time), residency "
        "checked (a repetition that finds less than 99% cached fails). Cold: "
        "dropped, residency checked (a repetition that finds more than 1% of the file the arm "
        "reads still cached fails instead of being timed; only the guest's page cache: a host "
        "may cache the virtual disk). Every result is checked outside the timer: a load or "
        "split has every tensor of the file, of the right shape, with its first and last 4096 "
        "elements and every 4099th equal to the file's; a save of ours or the reference's is "
        "byte-identical to the input file.",
        "",
        "1-minute load average at start / end of the run: "
        + " / ".join(str(x) for x in meta.get("loadavg_start_end", []))
        + " (2 cores; other work may have run on the machine meanwhile).",
        "",
        "Files (random bytes, bf16): "
        + "; ".join(f"`{k}` {fmt_b(v)}" for k, v in sizes.items())
        + " (`llama`: LLaMA-7B-shaped, 4 layers + embeddings + head; `lora`: 1,000 small "
        "tensors; `moe`: 20,000 tiny tensors, the header is the point).",
        "",
        'Arms: **ours** = pysafetensors (`load_file(backend="pread")` for eager loads, '
        "`load_file()` (mmap) for lazy, `parallel.load_shard()` (its default backend, "
        '`"auto"`) for tensor-parallel parts: row parts are read at once into one buffer by '
        "positioned reads, column parts are copied out of a mapping of the same open file, "
        "`save_file`); **ref mmap** / **ref pread** = safetensors 0.8.0 with that backend "
        "(mmap results are `clone()`d where the operation asks for private memory; saves, "
        "which have no backend, show the reference's `save_file` under **ref mmap**); "
        "**torch** = `torch.load(mmap=True, weights_only=True)` of a `torch.save` twin of the "
        "file (+ `clone()` where private memory is asked for; its open lists the keys) / "
        "`torch.save`; **ceiling** = "
        "`pread` into a reused, pre-faulted buffer (4 threads x 16 MiB) / `memcpy` between "
        "pre-faulted buffers / plain `mmap` touch / plain sequential 4 MiB `write`s of the "
        "same bytes (durable: asking the disk to start on every 16 MiB written, "
        "`sync_file_range`, as the library's durable save does, then `fsync`). "
        "**x ref** = ours / the faster reference backend in that row (ratio < 1: we are faster); "
        "**x ref mmap** = ours / the reference's default backend.",
        "",
        "| file | operation | cache | ours | ref mmap | ref pread | torch | ceiling | x ref | "
        "x ref mmap | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen: set[tuple[str, str, str]] = set()
    for file, op, states, _arms in PLAN:
        for state in states:
            if (file, op, state) in seen:
                continue
            seen.add((file, op, state))

            def sec(arm: str, file: str = file, op: str = op, state: str = state) -> float | None:
                v = summary.get(f"{file}|{op}|{state}|{arm}")
                return None if v is None or v.get("n", 0) == 0 else float(v["seconds"])

            def shown(arm: str, file: str = file, op: str = op, state: str = state) -> str:
                v = summary.get(f"{file}|{op}|{state}|{arm}")
                text = fmt_s(sec(arm))
                if v is not None and 0 < v.get("n", 0) < meta["reps"]:
                    text += f" (n={v['n']})"
                return text

            ours = sec("pysafetensors")
            if op.startswith("save"):
                refs = [("ref", sec("ref"))]
                r_mmap = sec("ref")
                r_pread = None
            else:
                r_mmap = sec("ref_mmap")
                r_pread = sec("ref_pread")
                refs = [("ref_mmap", r_mmap), ("ref_pread", r_pread)]
            ref_vals = [v for _, v in refs if v is not None]
            best = min(ref_vals) if ref_vals else None
            all_arms = [a for f2, o2, _, a2 in PLAN if (f2, o2) == (file, op) for a in a2]
            ceil_arms = [a for a in dict.fromkeys(all_arms) if a.startswith("ceiling")]
            ceil_txt = ", ".join(
                f"{fmt_s(sec(a))} ({a.split('_', 1)[1]})" for a in ceil_arms if sec(a) is not None
            )
            ratio = ours / best if ours and best else None
            ratio_m = ours / r_mmap if ours and r_mmap else None
            target = TARGETS.get((file, op, state))
            met_parts = []
            tgt_parts = []
            if target is not None and ratio is not None:
                tgt_parts.append(f"<= {target}x ref")
                met_parts.append("yes" if ratio <= target else "**no**")
            ct = CEILING_TARGETS.get((file, op, state))
            if ct is not None and ours and sec(ct[0]):
                c = ours / float(sec(ct[0]) or 1)
                tgt_parts.append(f"<= {ct[1]}x ceiling ({c:.2f}x)")
                met_parts.append("yes" if c <= ct[1] else "**no**")
            mt = MEMORY_TARGETS.get((file, op, state))
            mine = summary.get(f"{file}|{op}|{state}|pysafetensors")
            if mt is not None and mine and mine.get("n", 0):
                peak = float(mine["peak_rss_delta"])
                tgt_parts.append(f"peak extra memory <= {fmt_b(mt)} ({fmt_b(peak)})")
                met_parts.append("yes" if peak <= mt else "**no**")
            ref_mmap_arm = "ref" if op.startswith("save") else "ref_mmap"
            lines.append(
                f"| {file} | {OP_TITLES[op]} | {state} | {shown('pysafetensors')} | "
                f"{shown(ref_mmap_arm)} | {shown('ref_pread')} | {shown('torch')} | "
                f"{ceil_txt or 'n/a'} | "
                f"{'n/a' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'n/a' if ratio_m is None else f'{ratio_m:.2f}x'} | "
                f"{'; '.join(tgt_parts) or '-'} | {'; '.join(met_parts) or '-'} |"
            )
    # Memory and I/O table.
    lines += [
        "",
        "## Memory and bytes read (medians)",
        "",
        "Peak RSS = VmHWM during the operation minus RSS before it (the kernel's exact peak of "
        "both kinds together). Peak anon / peak file = the highest RssAnon / RssFile during "
        "the operation minus before it, sampled every "
        f"{SAMPLE_S * 1000:.0f} ms by the parent process (so a spike shorter than that can be "
        "missed; opens are too short to sample). Anon / file after = change of RssAnon / "
        "RssFile across the operation with the result still alive (file-backed pages are "
        "reclaimable page cache mapped by the process; anonymous pages are private copies). "
        "Read from disk = `/proc/self/io` `read_bytes` (cold rows only; warm reads hit the "
        "cache); read() bytes = `rchar`, the bytes asked of read system calls (a rank's bytes "
        "by positioned reads, warm or cold; copies out of a mapping do not count). "
        "2 MiB-mapped = `FilePmdMapped` after the operation: how much of the file the process "
        "maps with 2 MiB entries (one fault per 2 MiB; the rest is mapped 4-64 KiB per fault), "
        "which depends on the page cache's folio sizes (see `docs/performance.md`).",
        "",
        "| file | operation | cache | arm | peak RSS | peak anon | peak file | anon after "
        "| file after | 2 MiB-mapped | read from disk | read() bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for file, op, states, arms in PLAN:
        for state in states:
            for arm in arms:
                v = summary.get(f"{file}|{op}|{state}|{arm}")
                if not v or v.get("n", 0) == 0 or op == "open":
                    continue
                rb = fmt_b(v["read_bytes"]) if state == "cold" else "-"
                lines.append(
                    f"| {file} | {op} | {state} | {arm} | {fmt_b(v['peak_rss_delta'])} | "
                    f"{fmt_b(v.get('peak_anon_delta'))} | {fmt_b(v.get('peak_file_delta'))} | "
                    f"{fmt_b(v['anon_delta'])} | {fmt_b(v['file_delta'])} | "
                    f"{fmt_b(v.get('file_pmd_mapped', 0))} | {rb} | {fmt_b(v['rchar'])} |"
                )
    errors = [k for k, v in summary.items() if v.get("n", 0) == 0]
    if errors:
        lines += [
            "",
            "Failed cells: " + ", ".join(f"`{k}` ({summary[k]['error']})" for k in errors),
        ]
    partial = [k for k, v in summary.items() if v.get("errors") and v.get("n", 0)]
    if partial:
        lines += [
            "",
            "Failed repetitions: "
            + ", ".join(f"`{k}` ({'; '.join(map(str, summary[k]['errors']))})" for k in partial),
        ]
    lines += ["", meta.get("notes", "")]
    return "\n".join(lines).rstrip() + "\n"


NOTES_FILE = os.path.join(HERE, "NOTES.md")


def write_outputs(
    raw: dict[str, list[dict[str, Any]]],
    reps: int,
    quick: bool,
    out_arg: str | None,
    out_dir: str,
    t_start: float,
    load_start: tuple[float, float, float],
    sizes: dict[str, int],
    order_seed: int,
) -> None:
    """Write RESULTS.md and results.json for the repetitions collected so far."""
    complete = {k: v[:reps] for k, v in raw.items()}
    summary = summarize(complete)
    notes = ""
    if os.path.exists(NOTES_FILE) and not quick:
        with open(NOTES_FILE) as f:
            notes = f.read()
    meta = {
        "quick": quick,
        "reps": reps,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": time.time() - t_start,
        "machine": machine(),
        "strategies": strategies(),
        "loadavg_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "order_seed": order_seed,
        "notes": notes,
    }
    tag = ".quick" if quick and out_arg is None else ""
    with open(os.path.join(out_dir, f"results{tag}.json"), "w") as f:
        json.dump({"meta": meta, "sizes": sizes, "summary": summary, "raw": complete}, f, indent=1)
    text = render(meta, summary, sizes)
    with open(os.path.join(out_dir, f"RESULTS{tag}.md"), "w") as f:
        f.write(text)
    if quick or not out_arg:
        print(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny files, 1 repetition (< 60 s)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per cell (default 5)")
    ap.add_argument("--only", default="", help="comma-separated ops or files to run")
    ap.add_argument("--out", default=None, help="folder for RESULTS.md and results.json")
    ap.add_argument("--work", default=os.path.join(HERE, "_work"), help="scratch folder")
    ap.add_argument(
        "--seed", type=int, default=None, help="seed of the cells' order (default: random)"
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="rewrite RESULTS.md from results.json (with the current NOTES.md); measure nothing",
    )
    args = ap.parse_args(argv)
    if args.render:
        out_dir = args.out or HERE
        with open(os.path.join(out_dir, "results.json")) as f:
            saved = json.load(f)
        if os.path.exists(NOTES_FILE):
            with open(NOTES_FILE) as f:
                saved["meta"]["notes"] = f.read()
        # Recomputed from the raw runs, so that medians of fields added since are shown.
        saved["summary"] = summarize(saved["raw"])
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(saved, f, indent=1)
        with open(os.path.join(out_dir, "RESULTS.md"), "w") as f:
            f.write(render(saved["meta"], saved["summary"], saved["sizes"]))
        return 0
    quick = args.quick
    reps = args.reps or (1 if quick else 5)
    work = os.path.join(args.work, "quick") if quick else args.work
    out_dir = args.out or (work if quick else HERE)
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    load_start = os.getloadavg()
    files = prepare(work, quick)
    sizes = {k: os.path.getsize(v["path"]) for k, v in files.items()}
    only = {x for x in args.only.split(",") if x}
    cases = []
    for file, op, states, arms in PLAN:
        if only and file not in only and op not in only:
            continue
        for state in states:
            if quick and state == "cold" and file != "llama":
                continue
            for arm in arms:
                cases.append({"file": file, "op": op, "state": state, "arm": arm, **files[file]})
    raw: dict[str, list[dict[str, Any]]] = {}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    total = len(cases) * reps
    if quick:
        # A smoke run: most cells in one subprocess (interpreter start-up dominates tiny
        # files); the cold load cells of ours and the reference's through run_one, the full
        # run's path (a fresh worker each, the peaks sampled).
        alone = [c for c in cases if c["op"] == "load" and c["state"] == "cold"][:2]
        batched = [c for c in cases if c not in alone]
        for _rep in range(reps):
            for case, res in zip(batched, run_batch(batched, timeout=300), strict=True):
                raw.setdefault(case_key(case), []).append(res)
            for case in alone:
                raw.setdefault(case_key(case), []).append(run_one(case, timeout=300))
        total = 0
    done = 0
    for rep in range(reps if total else 0):
        # A new order every repetition: no cell always runs right after the same neighbour
        # (a rotation kept every cell's predecessor), and the order is reproducible.
        order = list(cases)
        random.Random(seed * 1000 + rep).shuffle(order)
        if rep:
            # Results so far, so that an interrupted run still leaves complete repetitions.
            write_outputs(raw, rep, quick, args.out, out_dir, t_start, load_start, sizes, seed)
        for case in order:
            key = case_key(case)
            res = run_one(case, timeout=300)
            raw.setdefault(key, []).append(res)
            done += 1
            if not quick:
                el = time.time() - t_start
                print(
                    f"[{done}/{total} {el:.0f}s] {key}: "
                    + (f"{res['seconds']:.3f}s" if "seconds" in res else str(res)),
                    flush=True,
                )
    write_outputs(raw, reps, quick, args.out, out_dir, t_start, load_start, sizes, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
