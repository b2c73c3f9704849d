"""Remote reads: pysafetensors over HTTP against downloading the file and loading it.

A loopback HTTP server in a subprocess serves byte ranges with a fixed latency per request and
a bandwidth limit per connection (10 ms and 100 MB/s by default: a fast link to an object
store, where one connection rarely gets more). Each case runs in a fresh subprocess, the arms
alternating, and reports the median wall time and the bytes the server sent:

* ``pysafetensors``: ``load_file``, ``load_shard`` or ``get_slice`` on the URL itself, and a
  ``get_tensor`` loop over a LoRA-shaped file of 1,000 tensors (with its read-ahead, without
  it: ``read_ahead=0``, and with 0.3 ms of waiting after each read, as a loop that copies
  each tensor to a device or writes it out: the background fetches' case);
* ``download+ref``: what the reference needs first, the whole file downloaded by one GET,
  then the reference's ``load_file``, ``get_slice`` loop, slice or ``get_tensor`` loop.

Results go to ``benchmarks/REMOTE.md`` and ``benchmarks/remote.json``.

Usage::

    python benchmarks/remote_bench.py            # ~300 MB file, 3 repetitions
    python benchmarks/remote_bench.py --quick    # ~20 MB, 1 repetition (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

SERVER = r"""
import http.server, json, os, re, socketserver, sys, threading, time
root, latency, bandwidth = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
stats = {"requests": 0, "bytes": 0}
lock = threading.Lock()

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm on, a small body
    # waited for the client's delayed ACK (~40 ms a request), which no real server adds.
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def _json(self, value):
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/__stats":
            with lock:
                self._json(dict(stats))
            return
        if self.path == "/__reset":
            with lock:
                stats.update(requests=0, bytes=0)
            self._json({})
            return
        path = os.path.join(root, os.path.basename(self.path))
        size = os.path.getsize(path)
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        first, last = (int(match[1]), int(match[2] or size - 1)) if match else (0, size - 1)
        last = min(last, size - 1)
        time.sleep(latency)
        self.send_response(206 if match else 200)
        if match:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(last - first + 1))
        self.send_header("ETag", '"%x"' % os.stat(path).st_mtime_ns)
        self.end_headers()
        with lock:
            stats["requests"] += 1
            stats["bytes"] += last - first + 1
        start, sent, left = time.perf_counter(), 0, last - first + 1
        with open(path, "rb") as f:
            f.seek(first)
            while left:
                chunk = f.read(min(left, 256 << 10))
                self.wfile.write(chunk)
                left -= len(chunk)
                sent += len(chunk)
                ahead = sent / bandwidth - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)

class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 64

server = Server(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

WORKER = r"""
import json, os, sys, time, urllib.request
arm, case, url, work = sys.argv[1:5]
import numpy as np
if arm == "pysafetensors":
    from pysafetensors import safe_open
    from pysafetensors.numpy import load_file
    from pysafetensors.parallel import load_shard
else:
    from safetensors import safe_open
    from safetensors.numpy import load_file

def download():
    path = os.path.join(work, "downloaded.safetensors")
    with urllib.request.urlopen(url) as reply, open(path, "wb") as out:
        while chunk := reply.read(8 << 20):
            out.write(chunk)
    return path

def ref_parts(path, dim):
    out = {}
    with safe_open(path, "np") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            shape = piece.get_shape()
            if len(shape) < 2:
                out[name] = piece[:]
                continue
            n = shape[dim] // 8
            out[name] = piece[:n] if dim == 0 else piece[:, :n]
    return out

def worked(tensor):
    # Work between reads, as a loop that copies each tensor to a device or writes it out:
    # 0.3 ms a tensor, waiting (the GIL free), in the case that asks for it.
    if case == "lora_loop_work":
        time.sleep(0.0003)
    return tensor

start = time.perf_counter()
if arm == "pysafetensors":
    if case == "load":
        got = load_file(url)
    elif case in ("tp_rows", "tp_cols"):
        rule = "rows" if case == "tp_rows" else "columns"
        got = load_shard(url, 0, 8, {"*norm": "replicate", "*": rule}, framework="np")
    elif case in ("lora_loop", "lora_loop_off", "lora_loop_work"):
        options = {"read_ahead": 0} if case == "lora_loop_off" else {}
        with safe_open(url, "np", storage_options=options) as f:
            got = {name: worked(f.get_tensor(name)) for name in f.keys()}
    else:
        with safe_open(url, "np") as f:
            got = f.get_slice("embed")[:, :256]
else:
    path = download()
    if case == "load":
        got = load_file(path)
    elif case in ("tp_rows", "tp_cols"):
        got = ref_parts(path, 0 if case == "tp_rows" else 1)
    elif case in ("lora_loop", "lora_loop_off", "lora_loop_work"):
        with safe_open(path, "np") as f:
            got = {name: worked(f.get_tensor(name)) for name in f.keys()}
    else:
        with safe_open(path, "np") as f:
            got = f.get_slice("embed")[:, :256]
    os.unlink(path)
seconds = time.perf_counter() - start
size = sum(v.nbytes for v in got.values()) if isinstance(got, dict) else got.nbytes
print(json.dumps({"seconds": seconds, "result_bytes": int(size)}))
"""

CASES = {
    "load": "load_file: every tensor",
    "tp_rows": "load_shard rank 0 of 8, rows",
    "tp_cols": "load_shard rank 0 of 8, columns",
    "slice": "get_slice(embed)[:, :256]",
    "lora_loop": "LoRA file: get_tensor of each of 1,000 tensors",
    "lora_loop_off": "the same loop, read_ahead=0",
    "lora_loop_work": "the same loop, 0.3 ms of work after each read",
}
#: Cases that read the LoRA-shaped file.
LORA_CASES = ("lora_loop", "lora_loop_off", "lora_loop_work")
ARMS = ("pysafetensors", "download+ref")


def make_file(path: str, quick: bool) -> int:
    """A LLaMA-shaped float16 file of random bits (never zeros)."""
    import numpy as np

    from pysafetensors.numpy import save_file

    rng = np.random.default_rng(0)
    hidden, inter, layers, vocab = (512, 1408, 2, 4096) if quick else (2048, 5632, 2, 32000)

    def rand(*shape: int) -> np.ndarray:
        bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
        return bits.view(np.float16)

    tensors = {"embed": rand(vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            tensors[p + name] = rand(hidden, hidden)
        tensors[p + "gate"] = rand(inter, hidden)
        tensors[p + "up"] = rand(inter, hidden)
        tensors[p + "down"] = rand(hidden, inter)
        tensors[p + "norm"] = rand(hidden)
    save_file(tensors, path)
    return os.path.getsize(path)


def make_lora(path: str, quick: bool) -> int:
    """A LoRA-shaped file: 1,000 float16 adapters of rank 16 (random bits)."""
    import numpy as np

    from pysafetensors.numpy import save_file

    rng = np.random.default_rng(1)
    hidden = 512 if quick else 2048
    tensors = {}
    for i in range(250):
        for proj in ("q", "v"):
            a = rng.integers(0, 1 << 16, (16, hidden), dtype=np.uint16).view(np.float16)
            b = rng.integers(0, 1 << 16, (hidden, 16), dtype=np.uint16).view(np.float16)
            tensors[f"layers.{i}.{proj}.lora_A"] = a
            tensors[f"layers.{i}.{proj}.lora_B"] = b
    save_file(tensors, path)
    return os.path.getsize(path)


def fetch(port: int, what: str) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{what}") as reply:
        result: dict[str, int] = json.loads(reply.read())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small file, one repetition")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--latency", type=float, default=0.010, help="seconds per request")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="bytes/s a connection")
    parser.add_argument("--work", default=os.path.join(HERE, "_work"))
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    name = "remote_quick.safetensors" if args.quick else "remote.safetensors"
    size = make_file(os.path.join(args.work, name), args.quick)
    lora_name = "remote_lora_quick.safetensors" if args.quick else "remote_lora.safetensors"
    lora_size = make_lora(os.path.join(args.work, lora_name), args.quick)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, args.work, str(args.latency), str(args.bandwidth)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/{name}"
        lora_url = f"http://127.0.0.1:{port}/{lora_name}"
        runs: dict[str, list[dict[str, float]]] = {}
        for _ in range(reps):
            for case in CASES:
                for arm in ARMS:
                    fetch(port, "__reset")
                    proc = subprocess.run(
                        [
                            sys.executable,
                            "-c",
                            WORKER,
                            arm,
                            case,
                            lora_url if case in LORA_CASES else url,
                            args.work,
                        ],
                        capture_output=True,
                        text=True,
                        timeout=600,
                    )
                    if proc.returncode:
                        raise SystemExit(f"{arm} {case} failed:\n{proc.stderr[-3000:]}")
                    result = json.loads(proc.stdout.strip().splitlines()[-1])
                    served = fetch(port, "__stats")
                    result.update(requests=served["requests"], fetched=served["bytes"])
                    runs.setdefault(f"{case}|{arm}", []).append(result)
    finally:
        server.kill()
        server.wait()
    summary = {
        key: {
            "seconds": statistics.median(r["seconds"] for r in rs),
            "fetched": statistics.median(r["fetched"] for r in rs),
            "requests": statistics.median(r["requests"] for r in rs),
            "n": len(rs),
        }
        for key, rs in runs.items()
    }
    sys.path.insert(0, HERE)
    from run import machine  # the same description as the main benchmark's

    meta = {
        "quick": args.quick,
        "file_bytes": size,
        "lora_file_bytes": lora_size,
        "latency_s": args.latency,
        "bandwidth_per_connection": args.bandwidth,
        "reps": reps,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
    }
    with open(os.path.join(args.out, "remote.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1)
    lines = [
        "# Remote reads: pysafetensors on the URL against download + the reference",
        "",
        f"Files: {size / 1e6:.0f} MB of float16 (LLaMA-shaped, random bits), and for the "
        f"`get_tensor` loops a LoRA-shaped one of {lora_size / 1e6:.0f} MB (1,000 float16 "
        "adapters of rank 16). Server: loopback "
        f"HTTP, {args.latency * 1e3:.0f} ms per request, {args.bandwidth / 1e6:.0f} MB/s per "
        f"connection. Medians of {reps} fresh processes per cell, arms alternating; "
        "`download+ref` fetches the whole file by one GET, then reads it with `safetensors` "
        "(its `get_slice` loop for the splits). One connection is what a plain download "
        "gets: a parallel downloader would narrow the gap where the whole file is fetched "
        "anyway (`load_file`, the column split), not for the row split and the slice, which "
        "fetch a part of it.",
        "",
        "| case | pysafetensors | fetched | requests | download+ref | fetched | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, title in CASES.items():
        ours, ref = summary[f"{case}|pysafetensors"], summary[f"{case}|download+ref"]
        lines.append(
            f"| {title} | {ours['seconds'] * 1e3:.0f} ms | {ours['fetched'] / 1e6:.1f} MB "
            f"| {ours['requests']:.0f} | {ref['seconds'] * 1e3:.0f} ms "
            f"| {ref['fetched'] / 1e6:.1f} MB | {ours['seconds'] / ref['seconds']:.2f}x |"
        )
    host = meta["machine"]
    lines += [
        "",
        f"Machine: {host['cpu']}, {host['cores']} cores, Linux {host['kernel']}, "
        f"Python {host['python']}, numpy {host['numpy']}; {meta['date']}.",
        "",
    ]
    with open(os.path.join(args.out, "REMOTE.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
