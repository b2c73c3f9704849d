"""``pysafetensors inspect``: the header as a table (or JSON), without reading tensor data."""

from __future__ import annotations

import argparse
from typing import Any, Final

from .._sharding import as_header_metadata
from ._common import (
    LazyRows,
    Model,
    TensorRef,
    Ui,
    add_filter_args,
    add_header_limit_arg,
    check_filter_matches,
    finite_json,
    human_bytes,
    human_count,
    name_filter,
    open_model,
    plural,
    print_json,
    quoted,
    sanitize,
    shown,
)
from ._remote_args import add_remote_args, remote_options

SCHEMA: Final = "pysafetensors.inspect/1"


def register(sub: Any) -> None:
    """Add the ``inspect`` subcommand."""
    p = sub.add_parser(
        "inspect",
        help="list tensors, dtypes, shapes, sizes, offsets and metadata",
        description="Show a file's (or model's) header: tensors, per-dtype totals, metadata. "
        "Reads only the header (for a URL, usually one request).",
    )
    p.add_argument("target", metavar="TARGET", help="file, model folder, index or URL")
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    add_filter_args(p)
    p.add_argument(
        "--sort",
        choices=("offset", "name", "size"),
        default="offset",
        help="tensor order (default: as stored)",
    )
    p.add_argument("--no-tensors", action="store_true", help="only totals and metadata")
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


def _dtype_totals(tensors: list[TensorRef]) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = totals.setdefault(t.dtype.code, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += t.numel
        row["bytes"] += t.nbytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]))


def _sorted(tensors: list[TensorRef], order: str) -> list[TensorRef]:
    if order == "name":
        return sorted(tensors, key=lambda t: t.name)
    if order == "size":
        return sorted(tensors, key=lambda t: (-t.nbytes, t.name))
    return tensors


def to_json(model: Model, tensors: list[TensorRef]) -> dict[str, Any]:
    """The ``pysafetensors.inspect/1`` document (see docs/cli.md)."""
    totals = _dtype_totals(tensors)
    return {
        "schema": SCHEMA,
        "target": model.target,
        "sharded": model.sharded,
        "index": shown(model.located.index_path) if model.located.index_path else None,
        "index_metadata": finite_json(model.index_metadata),
        "metadata": model.metadata,
        "files": [
            {
                "path": f.label,
                "size": f.source.size,
                "header_size": f.header.header_size,
                "data_start": f.header.data_start,
                "tensors": len(f.header.tensors),
                "metadata": f.header.metadata,
            }
            for f in model.files
        ],
        # Made as they are printed: a million rows held at once took about a gigabyte.
        "tensors": LazyRows(
            len(tensors),
            lambda: (
                {
                    "name": t.name,
                    "dtype": t.dtype.code,
                    "shape": list(t.shape),
                    "parameters": t.numel,
                    "bytes": t.nbytes,
                    "file": t.file.label,
                    "data_offsets": [t.begin, t.end],
                    "file_offsets": list(t.file_offsets),
                }
                for t in tensors
            ),
        ),
        "totals": {
            "tensors": len(tensors),
            "parameters": sum(t.numel for t in tensors),
            "bytes": sum(t.nbytes for t in tensors),
            "by_dtype": totals,
        },
    }


def run(args: argparse.Namespace) -> int:
    """Run ``inspect``."""
    ui = Ui(args)
    accept = name_filter(args)
    with open_model(args.target, remote_options(args), args.max_header_size) as model:
        # The table lists what the shards hold; an index that disagrees is warned about and
        # makes the exit code 1 (reshard/merge/extract refuse such a model).
        inconsistent = model.warn_index()
        check_filter_matches(args, model)
        tensors = _sorted([t for t in model.tensors.values() if accept(t.name)], args.sort)
        if args.json:
            document = to_json(model, tensors)
            if args.no_tensors:  # as hash --no-tensors: the totals still count them
                del document["tensors"]
            print_json(document)
            return inconsistent
        _print_human(ui, model, tensors, show_tensors=not args.no_tensors)
    return inconsistent


def _print_human(ui: Ui, model: Model, tensors: list[TensorRef], *, show_tensors: bool) -> None:
    total_size = sum(f.source.size for f in model.files)
    if model.sharded:
        ui.line(
            f"Model: {sanitize(model.target)} ({plural(len(model.files), 'file')}, "
            f"{human_bytes(total_size)})",
            style="bold",
        )
        ui.table(
            ["FILE", "SIZE", "HEADER", "TENSORS"],
            [
                [
                    quoted(f.label),
                    human_bytes(f.source.size),
                    f"{f.header.header_size} B",
                    str(len(f.header.tensors)),
                ]
                for f in model.files
            ],
            right=("SIZE", "HEADER", "TENSORS"),
        )
    else:
        f = model.files[0]
        ui.line(
            f"File: {quoted(f.label)} ({human_bytes(f.source.size)}, header "
            f"{f.header.header_size} bytes, data starts at {f.header.data_start})",
            style="bold",
        )
    meta = model.metadata
    ui.line()
    if meta:
        ui.line("Metadata:" if not model.sharded else "Metadata (common to all files):", "bold")
        width = max(len(quoted(k)) for k in meta)
        for key, value in meta.items():
            shown = quoted(value)
            if len(shown) > 200:
                shown = shown[:200] + f"... ({len(value)} chars)"
            ui.line(f"  {quoted(key).ljust(width)}  {shown}")
    else:
        ui.line("Metadata: none" if meta is None else "Metadata: {} (empty)")
    if model.index_metadata:
        # Values that are not strings as their JSON text, as `metadata get` shows them (Python's
        # repr showed True, None and single-quoted objects for the index's JSON).
        shown_index = as_header_metadata(model.index_metadata)
        ui.line(
            "Index metadata: "
            + ", ".join(f"{quoted(str(k))}={quoted(v)}" for k, v in shown_index.items())
        )
    if show_tensors and tensors:
        ui.line()
        columns = ["NAME", "DTYPE", "SHAPE", "PARAMS", "BYTES", "OFFSETS"]
        if model.sharded:
            columns.append("FILE")
        rows = []
        for t in tensors:
            begin, end = t.file_offsets
            row = [
                quoted(t.name),
                t.dtype.code,
                "[" + ", ".join(str(d) for d in t.shape) + "]",
                f"{t.numel:,}",
                f"{t.nbytes:,}",
                f"{begin}-{end}",
            ]
            if model.sharded:
                row.append(quoted(t.file.label))
            rows.append(row)
        ui.table(columns, rows, right=("PARAMS", "BYTES"), title=f"Tensors ({len(tensors)}):")
    totals = _dtype_totals(tensors)
    if totals:
        ui.line()
        ui.table(
            ["DTYPE", "TENSORS", "PARAMS", "BYTES"],
            [
                [
                    code,
                    str(row["tensors"]),
                    f"{row['parameters']:,} ({human_count(row['parameters'])})",
                    f"{row['bytes']:,} ({human_bytes(row['bytes'])})",
                ]
                for code, row in totals.items()
            ],
            right=("TENSORS", "PARAMS", "BYTES"),
            title="Totals by dtype:",
        )
    params = sum(t.numel for t in tensors)
    nbytes = sum(t.nbytes for t in tensors)
    ui.line()
    ui.line(
        f"Total: {plural(len(tensors), 'tensor')}, {human_count(params)} "
        f"parameter{'' if params == 1 else 's'} ({params:,}), "
        f"{human_bytes(nbytes)} of data",
        style="bold",
    )
