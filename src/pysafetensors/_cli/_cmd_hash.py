"""``pysafetensors hash``: digests of the file, the header, each tensor, and the whole model.

The model digest ignores how tensors are laid out: it is the hash of one line per tensor, sorted
by name, ``name\\0dtype\\0shape\\0tensor-digest\\n`` (shape as compact JSON). Two files, or a
file and a sharded folder, that hold the same tensors (same names, dtypes, shapes and bytes) in
any order or sharding, with any metadata, have the same model digest.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from json.encoder import encode_basestring
from typing import Any, Final

import numpy as np

from .._format import gc_paused
from .._interrupts import interrupts_deferred
from .._validate import iter_tensor_chunks
from ._common import (
    CHUNK_BYTES,
    LazyRows,
    Model,
    ShardFile,
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
    lines = []
    for name, dtype, shape, digest in sorted(rows):
        # The name as a JSON string: a name may hold NUL and newline, and written bare, one
        # tensor's name could spell another tensor's whole line (two models, one digest).
        # encode_basestring is what json.dumps(name, ensure_ascii=False) calls, and the shape
        # is what json.dumps(shape, separators=(",", ":")) writes of a list of ints: the same
        # text without two encoders made per tensor (~40% of the digest's time).
        shape_text = ",".join(map(str, shape))
        lines.append(f"{encode_basestring(name)}\0{dtype}\0[{shape_text}]\0{digest}\n")
        if len(lines) >= _LINES_HASHED_AT_ONCE:
            h.update("".join(lines).encode("utf-8", "surrogatepass"))
            lines.clear()
    h.update("".join(lines).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


#: Lines of the model digest joined into one update (few updates, little memory).
_LINES_HASHED_AT_ONCE: Final = 4096


#: Chunks from this size feed the file's and the tensor's hashers on two threads at once
#: (hashlib lets go of the GIL for them); smaller ones are not worth the hand-over.
_TWO_THREADS_FROM: Final = 1 << 20


def hash_model(model: Model, algorithm: str, accept: Any, progress: Any) -> dict[str, Any]:
    """Read every file once, front to back, feeding the file, header and tensor hashers.

    The document's ``tensors`` is a :class:`LazyRows`, whose rows are made as they are
    iterated (by :func:`print_json`, or the text output): not a list to index or compare."""
    with ThreadPoolExecutor(1, thread_name_prefix="pysafetensors-hash") as helper:
        return _hash_model(model, algorithm, accept, progress, helper)


def _hash_model(
    model: Model, algorithm: str, accept: Any, progress: Any, helper: ThreadPoolExecutor
) -> dict[str, Any]:
    files = []
    tensors: dict[str, str] = {}
    # One read buffer for every file's data, read front to back in chunks.
    largest = max((f.header.data_size for f in model.files), default=0)
    buffer = np.empty(min(CHUNK_BYTES, largest), np.uint8)
    for f in model.files:
        file_h = hashlib.new(algorithm)
        header_h = hashlib.new(algorithm)
        # "header" is the 8-byte length prefix plus the padded JSON: everything before the data.
        for _, buf in iter_tensor_chunks(f.source, 0, f.header.data_start, CHUNK_BYTES):
            file_h.update(buf.data)
            header_h.update(buf.data)
        _hash_data(f, algorithm, file_h, buffer, helper, progress, accept, tensors)
        files.append(
            {
                "path": f.label,
                "size": f.source.size,
                "file": file_h.hexdigest(),
                "header": header_h.hexdigest(),
            }
        )
    with gc_paused():  # a few records per tensor, all kept
        rows = [
            (name, ref.dtype.code, list(ref.shape), tensors[name])
            for name, ref in model.tensors.items()
            if name in tensors
        ]
        digest = model_digest(algorithm, rows)

    def listed() -> Iterator[dict[str, Any]]:
        # Made as they are written (or printed): not all kept at once.
        for name, dtype, shape, tensor_digest in rows:
            yield {"name": name, "dtype": dtype, "shape": shape, "digest": tensor_digest}

    return {
        "schema": SCHEMA,
        "target": model.target,
        "algorithm": algorithm,
        "model": digest,
        "files": files,
        "tensors": LazyRows(len(rows), listed),
    }


def _hash_data(
    f: ShardFile,
    algorithm: str,
    file_h: Any,
    buffer: np.ndarray,
    helper: ThreadPoolExecutor,
    progress: Any,
    accept: Any,
    digests: dict[str, str],
) -> None:
    """Feed ``f``'s data buffer to ``file_h`` and each tensor's bytes to a hasher of its own,
    storing the digests of the tensors ``accept`` takes in ``digests``.

    The data buffer is tiled exactly by the tensors in offset order (rules R6/R8), so it is
    read front to back in chunks of the buffer's size, each tensor hashed from the chunks'
    slices it covers. A read per tensor (100,000 small tensors: 100,000 reads, each with its
    hasher fed in a separate pass) took most of the command's time."""
    infos = iter(f.header.tensors.values())
    # hashlib's named constructor where it has one: a third of the time of hashlib.new's.
    new = getattr(hashlib, algorithm, None) or partial(hashlib.new, algorithm)
    info = next(infos, None)
    tensor_h = new() if info is not None else None
    start = f.header.data_start
    for at, buf in iter_tensor_chunks(f.data, start, f.header.data_size, buffer=buffer):
        chunk = buf.data
        other = None
        if buf.size >= _TWO_THREADS_FROM:
            # The file's digest of a large chunk on the helper while this thread feeds the
            # tensors' hashers (hashlib lets go of the GIL): each is one core's work (about
            # 1.4 GB/s for SHA-256 here), and every byte is hashed twice.
            with interrupts_deferred():  # see _reader_pool._submit
                other = helper.submit(file_h.update, chunk)
        else:
            file_h.update(chunk)
        pos = at - start  # the chunk's start in the data buffer
        chunk_end = pos + buf.size
        try:
            while info is not None and info.end <= chunk_end:
                assert tensor_h is not None
                tensor_h.update(chunk[max(info.begin - pos, 0) : info.end - pos])
                if accept(info.name):
                    digests[info.name] = tensor_h.hexdigest()
                info = next(infos, None)
                tensor_h = new() if info is not None else None
            if info is not None and info.begin < chunk_end:  # runs on into the next chunk
                assert tensor_h is not None
                tensor_h.update(chunk[max(info.begin - pos, 0) :])
        finally:
            if other is not None:
                other.result()  # the buffer is read again only once the helper is done
        progress(buf.size)
    # Tensors of no bytes at the end of the data (or a file of only such tensors).
    while info is not None:
        assert tensor_h is not None
        if accept(info.name):
            digests[info.name] = tensor_h.hexdigest()
        info = next(infos, None)
        tensor_h = new() if info is not None else None


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
        ui.lines(
            f"tensor  {algo}:{row['digest']}  {quoted(row['name'])}" for row in result["tensors"]
        )
    return inconsistent
