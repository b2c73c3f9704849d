"""One measurement, run in a fresh interpreter by ``run.py``: set up, time one operation, report.

Usage: ``python _worker.py '<json case>'``; prints one JSON object on the last line of stdout.
The case names an operation, an implementation ("arm"), a file and a cache state. Everything
outside the operation itself (imports, creating tensors to save, warming or evicting the page
cache, checking the bytes) happens outside the timer.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cache  # noqa: E402

TP = 8
RANK = 0
PAGE = 4096


def proc_status() -> dict[str, int]:
    """RSS figures from ``/proc/self/status``, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def proc_io() -> dict[str, int]:
    """``rchar`` (bytes asked of read syscalls) and ``read_bytes`` (bytes fetched from storage)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def file_pmd_mapped() -> int:
    """Bytes of file mappings this process maps with 2 MiB entries (``FilePmdMapped``).

    A mapped file's pages are mapped 2 MiB at a time where the page cache holds them in 2 MiB
    folios, one page-table entry (and one fault) per 2 MiB instead of one per 4-64 KiB:
    touching a 2 GiB mapping took 10-20 ms with the whole file in such folios and 85-300 ms
    with a third of it. The page cache's folio sizes come from how the file got there, not
    from the loader, so this is reported to explain lazy-load times.
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak() -> None:
    """Reset VmHWM so the peak reported is the operation's own (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# ------------------------------------------------------------------------------- helpers


def touch_pages(tensors: dict[str, Any]) -> int:
    """Read one byte per 4 KiB page of every tensor (forces lazy mappings to fault in)."""
    import torch

    acc = 0
    for t in tensors.values():
        flat = t.reshape(-1).view(torch.uint8)
        acc += int(flat[::PAGE].sum())
    return acc


def tp_index(shape: list[int], along: str) -> tuple[slice, ...]:
    """Rank 0 of 8: the first eighth along rows (dim 0) or columns (dim 1)."""
    if len(shape) == 0:
        return ()
    if along == "rows" or len(shape) == 1:
        if along == "cols":
            return (slice(None),)  # 1-D tensors (norms) are replicated in a column split
        return (slice(0, shape[0] // TP),)
    return (slice(None), slice(0, shape[1] // TP))


def check(path: str, result: dict[str, Any], along: str | None = None) -> None:
    """Compare the result with the file's bytes (outside the timer): the same tensor names,
    and for every tensor (or its rank-0 part) its shape, its first and last 4096 elements and
    every 4099th in between (a prime stride, which lands on every page of the file in turn
    over the tensors), so that an arm that skipped, cut short or misread a tensor cannot pass
    as fast. Comparing every byte of the 2 GiB file took ~13 s a cell."""
    import torch

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    if set(result) != set(header):
        missing, extra = sorted(set(header) - set(result)), sorted(set(result) - set(header))
        raise AssertionError(f"tensor names differ: missing {missing[:3]}, extra {extra[:3]}")
    # Every tensor of these files is 2-byte; the map reads only the pages compared.
    data = np.memmap(path, np.uint16, "r", offset=8 + n)
    for name in result:
        info = header[name]
        begin, end = (x // 2 for x in info["data_offsets"])
        want = data[begin:end].reshape(info["shape"])
        if along is not None:
            want = want[tp_index(list(want.shape), along)]
        got = result[name].contiguous().view(torch.int16).numpy().view(np.uint16)
        if got.shape != want.shape:
            raise AssertionError(f"shape differs for {name}: {got.shape} != {want.shape}")
        got, want = got.reshape(-1), np.ascontiguousarray(want).reshape(-1)
        for part in (slice(0, 4096), slice(-4096, None), slice(None, None, 4099)):
            if not np.array_equal(got[part], want[part]):
                raise AssertionError(f"bytes differ for {name}")


def same_file(a: str, b: str) -> bool:
    """Whether two files hold the same bytes (a save's output against its input file)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(16 << 20), fb.read(16 << 20)
            if x != y:
                return False
            if not x:
                return True


# -------------------------------------------------------------------------------- arms


def load_arms(path: str, pt_path: str) -> dict[str, Callable[[], Any]]:
    import safetensors.torch as ref
    import torch

    import pysafetensors.torch as ours

    def clone_all(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v.clone() for k, v in d.items()}

    def ceiling() -> Any:
        size = os.path.getsize(path)
        buf = np.empty(size, np.uint8)
        buf[::PAGE] = 0  # pre-fault: the ceiling reuses touched memory
        fd = os.open(path, os.O_RDONLY)
        chunk = 16 << 20

        def one(start: int) -> None:
            end = min(size, start + chunk)
            view = memoryview(buf)
            while start < end:
                start += os.preadv(fd, [view[start:end]], start)

        return fd, buf, one, range(0, size, chunk)

    return {
        "pysafetensors": lambda: ours.load_file(path, backend="pread"),
        "ref_mmap": lambda: clone_all(ref.load_file(path)),
        "ref_pread": lambda: ref.load_file(path, backend="pread"),
        "torch": lambda: clone_all(torch.load(pt_path, mmap=True, weights_only=True)),
        "_ceiling_setup": ceiling,
    }


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    # Import every implementation's torch layer up front: first-use imports (pysafetensors
    # loads its torch adapter lazily) must not land inside the timer.
    import safetensors.torch  # noqa: F401
    import torch

    import pysafetensors._torch_adapter  # noqa: F401

    op, arm, path, state = case["op"], case["arm"], case["path"], case["state"]
    pt_path = case.get("pt_path", "")
    out_path = case.get("out_path", "")
    torch.set_num_threads(os.cpu_count() or 1)
    timed: Callable[[], Any]
    verify: Callable[[Any], None] = lambda r: None  # noqa: E731
    extra: dict[str, Any] = {}

    if op == "load":
        arms = load_arms(path, pt_path)
        if arm == "ceiling_pread":
            fd, buf, one, starts = arms["_ceiling_setup"]()
            pool = ThreadPoolExecutor(4)

            def timed() -> Any:
                list(pool.map(one, starts))
                return buf

        elif arm == "ceiling_memcpy":
            src = np.empty(os.path.getsize(path), np.uint8)
            src[::PAGE] = 1
            dst = np.empty_like(src)
            dst[::PAGE] = 0

            def timed() -> Any:
                np.copyto(dst, src)
                return dst

        else:
            timed = arms[arm]
            verify = lambda r: check(path, r)  # noqa: E731

    elif op == "lazy":
        import safetensors.torch as ref

        import pysafetensors.torch as ours

        if arm == "pysafetensors":
            fn: Callable[[], Any] = lambda: ours.load_file(path)  # noqa: E731
        elif arm == "ref_mmap":
            fn = lambda: ref.load_file(path)  # noqa: E731
        elif arm == "torch":
            fn = lambda: torch.load(pt_path, mmap=True, weights_only=True)  # noqa: E731
        elif arm == "ceiling_mmap":
            import mmap

            def fn() -> Any:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                return {"all": torch.frombuffer(mm, dtype=torch.uint8)}
        else:
            raise ValueError(arm)

        def timed() -> Any:
            d = fn()
            touch_pages(d)
            return d

        if arm != "ceiling_mmap":
            verify = lambda r: check(path, r)  # noqa: E731

    elif op == "open":
        import safetensors

        import pysafetensors

        if arm == "pysafetensors":

            def timed() -> Any:
                with pysafetensors.safe_open(path, "pt") as f:
                    return f.keys()

        elif arm == "ref_mmap":

            def timed() -> Any:
                with safetensors.safe_open(path, "pt") as f:
                    return f.keys()

        elif arm == "ref_pread":

            def timed() -> Any:
                with safetensors.safe_open(path, "pt", backend="pread") as f:
                    return f.keys()

        elif arm == "torch":

            def timed() -> Any:
                return list(torch.load(pt_path, mmap=True, weights_only=True))

        else:
            raise ValueError(arm)

    elif op in ("tp_rows", "tp_cols"):
        import safetensors

        import pysafetensors

        along = "rows" if op == "tp_rows" else "cols"

        def sliced(opener: Callable[[], Any], private: bool) -> dict[str, Any]:
            out = {}
            with opener() as f:
                for name in f.keys():  # noqa: SIM118 - the reference is not iterable
                    sl = f.get_slice(name)
                    t = sl[tp_index(sl.get_shape(), along)]
                    # Lazy views of a mapping are copied into private memory, as a loader must.
                    out[name] = t.clone(memory_format=torch.contiguous_format) if private else t
            return out

        if arm == "pysafetensors":
            # The library's tensor-parallel loader with its default backend ("auto"). Row
            # splits are one contiguous range per tensor: all read at once into one buffer by
            # parallel positioned reads. Column splits need a piece of every row: they are
            # copied out of a mapping, which faults only the pages they lie on.
            from pysafetensors.parallel import load_shard

            def rule(name: str, shape: tuple[int, ...]) -> str:
                # As tp_index: 1-D tensors (norms) are replicated in a column split.
                if along == "rows":
                    return "rows"
                return "columns" if len(shape) >= 2 else "replicate"

            timed = lambda: load_shard(path, 0, TP, rule, framework="pt")  # noqa: E731
        elif arm == "ref_mmap":
            timed = lambda: sliced(lambda: safetensors.safe_open(path, "pt"), True)  # noqa: E731
        elif arm == "ref_pread":
            timed = lambda: sliced(  # noqa: E731
                lambda: safetensors.safe_open(path, "pt", backend="pread"), False
            )
        elif arm == "torch":

            def timed() -> Any:
                sd = torch.load(pt_path, mmap=True, weights_only=True)
                return {
                    k: v[tp_index(list(v.shape), along)].clone(
                        memory_format=torch.contiguous_format
                    )
                    for k, v in sd.items()
                }

        else:
            raise ValueError(arm)
        verify = lambda r: check(path, r, along)  # noqa: E731

    elif op in ("save", "save_durable"):
        import safetensors.torch as ref

        import pysafetensors
        import pysafetensors.torch as ours

        durable = op == "save_durable"
        tensors = ref.load_file(path, backend="pread")  # fresh private memory, outside the timer
        if os.path.exists(out_path):
            os.unlink(out_path)

        def sync_file(p: str) -> None:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fd = os.open(os.path.dirname(p) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        if arm == "pysafetensors":
            timed = lambda: ours.save_file(tensors, out_path, fsync=durable)  # noqa: E731
        elif arm == "ref":

            def timed() -> Any:
                ref.save_file(tensors, out_path)
                if durable:
                    sync_file(out_path)

        elif arm == "torch":

            def timed() -> Any:
                torch.save(tensors, out_path)
                if durable:
                    sync_file(out_path)

        elif arm == "ceiling_write":
            import ctypes

            views = [
                memoryview(
                    (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
                )
                for t in tensors.values()
            ]

            # The library's libc binding and step, so that the ceiling asks what its save asks.
            from pysafetensors._syscalls import SYNC_FILE_RANGE_WRITE, sync_file_range
            from pysafetensors._writer import WRITEBACK_STEP

            sync_range = sync_file_range if durable else None

            def timed() -> Any:
                fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    # One plain sequential stream of the same bytes, straight from tensor
                    # memory, 4 MiB per write() (the fastest size measured on this machine).
                    # Durable: the disk is asked to start on every WRITEBACK_STEP (16 MiB)
                    # written, as the library's own durable save asks (without it, the ceiling
                    # waited for the whole file at the fsync and was slower than the save it
                    # bounds).
                    written = flushed = 0
                    for view in views:
                        for i in range(0, view.nbytes, 4 << 20):
                            piece = view[i : i + (4 << 20)]
                            done = 0
                            while done < piece.nbytes:
                                done += os.write(fd, piece[done:])
                            written += done
                            if sync_range is not None and written - flushed >= WRITEBACK_STEP:
                                sync_range(fd, flushed, written - flushed, SYNC_FILE_RANGE_WRITE)
                                flushed = written
                    if durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if durable:
                    sync_file(out_path)

        else:
            raise ValueError(arm)

        def verify(_: Any) -> None:
            if arm in ("pysafetensors", "ref") and not same_file(out_path, path):
                # The input was written by the reference's save_file from these tensors,
                # without metadata: both writers must give the same bytes.
                raise AssertionError("saved bytes differ from the input file's")
            extra["out_bytes"] = os.path.getsize(out_path)

    else:
        raise ValueError(op)

    # Cache state of the input the arm reads (torch's arm reads the torch.save twin; saves read
    # nothing, so they only start from a quiet disk).
    source = pt_path if arm == "torch" and pt_path else path
    if op.startswith("save"):
        os.sync()
        res_before = None
    elif state.startswith("warm"):
        res_before = _cache.warm(source, refresh=True)
        if res_before < 0.99:
            # A machine short of memory would time a partly cold read as a warm one.
            raise RuntimeError(
                f"not warm: only {res_before:.1%} of {os.path.basename(source)} cached"
            )
    else:
        res_before = _cache.evict(source)
        if res_before > 0.01:
            # Timing it would report a warm read as a cold one: the repetition fails instead.
            raise RuntimeError(
                f"not cold: {res_before:.1%} of {os.path.basename(source)} still cached"
            )
    if state != _cache.WARM_CACHE_ONLY and op != "open":
        _cache.warm_free_memory(os.path.getsize(path) * 5 // 4)
    # The full collection the imports owe (torch's objects, ~80 ms), run here rather than in
    # whichever arm's operation happens to allocate the objects that set it off.
    gc.collect()

    # The parent samples RssAnon/RssFile between these two signals (run.py: peak_split); one
    # write each, so the operation itself is not slowed by the sampling.
    signal_fd = case.get("signal_fd")
    before = proc_status()
    io0 = proc_io()
    reset_peak()
    if signal_fd is not None:
        os.write(signal_fd, b"s")
    t0 = time.perf_counter()
    result = timed()
    seconds = time.perf_counter() - t0
    if signal_fd is not None:
        os.write(signal_fd, b"e")
    io1 = proc_io()
    after = proc_status()
    pmd = file_pmd_mapped()
    res_after = None if op.startswith("save") else _cache.residency(source)
    verify(result)
    if op.startswith("save") and os.path.exists(out_path):
        os.unlink(out_path)
    return {
        "seconds": seconds,
        "residency_before": res_before,
        "residency_after": res_after,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "rchar": io1["rchar"] - io0["rchar"],
        "peak_rss_delta": after["VmHWM"] - before["VmRSS"],
        "anon_delta": after["RssAnon"] - before["RssAnon"],
        "file_delta": after["RssFile"] - before["RssFile"],
        # For the parent's peaks of each kind (sampled during the operation).
        "anon_before": before["RssAnon"],
        "file_before": before["RssFile"],
        "anon_after": after["RssAnon"],
        "file_after": after["RssFile"],
        "file_pmd_mapped": pmd,
        **extra,
    }


def main() -> None:
    """Run one case, or (``--quick`` smoke runs) a list of cases in this one process."""
    arg = json.loads(sys.argv[1])
    if isinstance(arg, list):
        out = []
        for case in arg:
            try:
                out.append(run_case(case))
            except Exception as exc:  # noqa: BLE001 - reported per cell
                out.append({"error": [f"{type(exc).__name__}: {exc}"]})
        print(json.dumps(out))
    else:
        print(json.dumps(run_case(arg)))


if __name__ == "__main__":
    main()
