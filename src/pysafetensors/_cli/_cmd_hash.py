"""``pysafetensors hash``: digests of the file, the header, each tensor, and the whole model.

The model digest ignores how tensors are laid out: it is the hash of one line per tensor, sorted
by name, ``name\\0dtype\\0shape\\0tensor-digest\\n`` (shape as compact JSON). Two files, or a
file and a sharded folder, that hold the same tensors (same names, dtypes, shapes and bytes) in
any order or sharding, with any metadata, have the same model digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np

from .._interrupts import interrupts_deferred
from .._validate import iter_tensor_chunks
from ._common import (
    CHUNK_BYTES,
    Model,
    Ui,
    add_filter_args,
    add_header_limit_arg,
    check_filter_matches,
    name_filter,
    open_model,
    print_json,
    quoted,
)
from ._remote_args import add_remote_args, remote_options

SCHEMA: Final = "pysafetensors.hash/2"


def register(sub: Any) -> None:
    """Add the ``hash`` subcommand."""
    p = sub.add_parser(
        "hash",
        help="digests of the file, header, each tensor, and a layout-independent model digest",
        description="Hash a file or model in one streaming pass. The model digest is the same "
        "for files holding the same tensors in another order or sharding.",
    )
    p.add_argument("target", metavar="TARGET", help="file, model folder, index or URL")
    p.add_argument(
        "-a",
        "--algorithm",
        default="sha256",
        choices=sorted(
            a for a in ("sha256", "sha512", "sha1", "md5", "blake2b", "blake2s", "sha3_256")
        ),
        help="hash algorithm (default sha256)",
    )
    p.add_argument("--no-tensors", action="store_true", help="do not list per-tensor digests")
    add_filter_args(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


def model_digest(algorithm: str, rows: list[tuple[str, str, list[int], str]]) -> str:
    """The layout-independent digest over ``(name, dtype, shape, tensor digest)`` rows."""
    h = hashlib.new(algorithm)
    for name, dtype, shape, digest in sorted(rows):
        # The name as a JSON string: a name may hold NUL and newline, and written bare, one
        # tensor's name could spell another tensor's whole line (two models, one digest).
        quoted = json.dumps(name, ensure_ascii=False)
        line = f"{quoted}\0{dtype}\0{json.dumps(shape, separators=(',', ':'))}\0{digest}\n"
        h.update(line.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


#: Chunks from this size feed the file's and the tensor's hashers on two threads at once
#: (hashlib lets go of the GIL for them); smaller ones are not worth the hand-over.
_TWO_THREADS_FROM: Final = 1 << 20


def hash_model(model: Model, algorithm: str, accept: Any, progress: Any) -> dict[str, Any]:
    """Read every file once, front to back, feeding the file, header and tensor hashers."""
    with ThreadPoolExecutor(1, thread_name_prefix="pysafetensors-hash") as helper:
        return _hash_model(model, algorithm, accept, progress, helper)


def _hash_model(
    model: Model, algorithm: str, accept: Any, progress: Any, helper: ThreadPoolExecutor
) -> dict[str, Any]:
    files = []
    tensors: dict[str, str] = {}
    # One read buffer for every tensor of every file: one per tensor, with the previous
    # tensor's last chunk still held while the next was made, held two (48 MiB, now 24).
    largest = max((i.nbytes for f in model.files for i in f.header.tensors.values()), default=0)
    buffer = np.empty(min(CHUNK_BYTES, largest), np.uint8)
    for f in model.files:
        file_h = hashlib.new(algorithm)
        header_h = hashlib.new(algorithm)
        # "header" is the 8-byte length prefix plus the padded JSON: everything before the data.
        for _, buf in iter_tensor_chunks(f.source, 0, f.header.data_start, CHUNK_BYTES):
            file_h.update(buf.data)
            header_h.update(buf.data)
        # The data buffer is tiled exactly by the tensors (rule R6/R8), so walking them in
        # offset order reads the rest of the file sequentially, once.
        for info in f.header.tensors.values():
            tensor_h = hashlib.new(algorithm)
            start = f.header.data_start + info.begin
            for _, buf in iter_tensor_chunks(f.data, start, info.nbytes, buffer=buffer):
                if buf.size >= _TWO_THREADS_FROM:
                    # Both digests of a large chunk at once: each is one core's work (about
                    # 1.4 GB/s for SHA-256 here), and the chunk is hashed twice.
                    with interrupts_deferred():  # see _reader_pool._submit
                        other = helper.submit(tensor_h.update, buf.data)
                    file_h.update(buf.data)
                    other.result()
                else:
                    file_h.update(buf.data)
                    tensor_h.update(buf.data)
                progress(buf.size)
            if accept(info.name):
                tensors[info.name] = tensor_h.hexdigest()
        files.append(
            {
                "path": f.label,
                "size": f.source.size,
                "file": file_h.hexdigest(),
                "header": header_h.hexdigest(),
            }
        )
    rows = [
        (name, ref.dtype.code, list(ref.shape), tensors[name])
        for name, ref in model.tensors.items()
        if name in tensors
    ]
    return {
        "schema": SCHEMA,
        "target": model.target,
        "algorithm": algorithm,
        "model": model_digest(algorithm, rows),
        "files": files,
        "tensors": [
            {"name": name, "dtype": dtype, "shape": shape, "digest": digest}
            for name, dtype, shape, digest in rows
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Run ``hash``."""
    ui = Ui(args)
    accept = name_filter(args)
    with open_model(args.target, remote_options(args), args.max_header_size) as model:
        inconsistent = model.warn_index()
        check_filter_matches(args, model)
        total = sum(t.nbytes for t in model.tensors.values())
        with ui.progress(total, "hash") as update, model.planned_reads(model.tensors.values()):
            result = hash_model(model, args.algorithm, accept, update)
    if args.json:
        if args.no_tensors:
            del result["tensors"]
        print_json(result)
        return inconsistent
    algo = args.algorithm
    filtered = bool(args.filter or args.regex)
    ui.line(f"model   {algo}:{result['model']}" + ("  (filtered tensors)" if filtered else ""))
    for f in result["files"]:
        ui.line(f"file    {algo}:{f['file']}  {quoted(f['path'])}")
        ui.line(f"header  {algo}:{f['header']}  {quoted(f['path'])}")
    if not args.no_tensors:
        for row in result["tensors"]:
            ui.line(f"tensor  {algo}:{row['digest']}  {quoted(row['name'])}")
    return inconsistent
