"""``pysafetensors convert SRC DST``: PyTorch checkpoint(s) to safetensors, without torch."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Final

from ._cmd_reshard import progress_for
from ._common import (
    OutputFolders,
    Ui,
    UsageError,
    check_output_folder,
    make_parent,
    plural,
    print_json,
    quoted,
    sanitize,
    warn_beside_index,
    whole_number,
)

__all__ = ["register"]

SCHEMA: Final = "pysafetensors.convert/1"


def register(subparsers: Any) -> None:
    """Add the ``convert`` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "convert",
        help="convert a PyTorch checkpoint (.bin/.pt/.pth/.ckpt) or a folder to safetensors",
        description=(
            "Convert a PyTorch checkpoint to safetensors without running its pickle and "
            "without torch. SRC may be a file (DST is then the output file) or a folder "
            "(DST is the output folder; a sharded pytorch_model with index is supported). "
            "Refuses checkpoints whose pickle imports anything outside an allow-list, unless "
            "--skip-unknown is given and nothing it imports is dangerous."
        ),
    )
    p.add_argument("src", metavar="SRC", help="checkpoint file or folder")
    p.add_argument("dst", metavar="DST", help="output file or folder")
    p.add_argument("--verify", action="store_true", help="reload and compare every tensor")
    p.add_argument(
        "--keep-non-tensors",
        action="store_true",
        help="store non-tensor values (epoch, hyper-parameters...) as metadata strings",
    )
    p.add_argument(
        "--skip-unknown",
        action="store_true",
        help=(
            "convert the tensors even if the checkpoint pickles objects of unknown classes "
            "(a script's config, argparse.Namespace, an optimizer object): each is left out, "
            "nothing of it is run; what the scanner grades dangerous is still refused. A whole "
            "pickled model (torch.save(model)) is converted as model.state_dict() names its "
            "tensors"
        ),
    )
    p.add_argument(
        "--subtree",
        metavar="KEY",
        help="convert only the tensors under this dotted key, e.g. state_dict (Lightning)",
    )
    p.add_argument(
        "--metadata",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="extra __metadata__ entry (repeatable)",
    )
    p.add_argument(
        "--workers", type=whole_number(1), default=1, help="threads for folder conversion (>= 1)"
    )
    p.add_argument("--json", action="store_true", help=f"print the report as JSON ({SCHEMA})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``convert``; returns the exit code."""
    from .._errors import CheckpointError
    from ..convert import convert_file, convert_folder

    meta: dict[str, str] = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--metadata expects KEY=VALUE, got {item!r}")
        meta[key] = value
    kwargs: dict[str, Any] = {
        "verify": args.verify,
        "keep_non_tensors": args.keep_non_tensors,
        "subtree": args.subtree,
        "metadata": meta or None,
        "unknown": "skip" if args.skip_unknown else "error",
    }
    index = None
    left_out: dict[str, str] = {}
    # Folders created for the output are removed again (when still empty) if convert fails.
    with OutputFolders() as folders:
        if os.path.isdir(args.src):
            check_output_folder(args.dst, "a folder is converted into a folder")
            folders.expect(args.dst)  # created by convert_folder()
            try:
                if args.workers > 1:
                    from concurrent.futures import ThreadPoolExecutor

                    with ThreadPoolExecutor(args.workers) as pool:
                        folder = convert_folder(args.src, args.dst, executor=pool, **kwargs)
                else:
                    folder = convert_folder(args.src, args.dst, **kwargs)
            except CheckpointError as exc:
                if exc.kind not in ("NothingToConvert", "MissingCheckpoint"):
                    raise
                # A folder with no checkpoint, or an index naming one that is not there, is a
                # target that cannot be read (exit 2), as for every other command, not a
                # malformed file.
                raise UsageError(str(exc)) from None
            reports, index, left_out = folder.files, folder.index, folder.left_out
            if index is None:
                for r in reports:
                    warn_beside_index(r.dst)
        else:
            make_parent(args.dst, folders)
            # The same bar as every other command: after a second of work, on a terminal only.
            with progress_for(Ui(args), "converting") as report:
                reports = [convert_file(args.src, args.dst, progress=report, **kwargs)]
            warn_beside_index(args.dst)
    if args.json:
        # Round-trip through json with default=str: non-tensor values of a checkpoint can be
        # anything JSON-like; NaN/Infinity become null so the document stays strict JSON.
        files = json.loads(
            json.dumps([r.__dict__ for r in reports], default=str), parse_constant=lambda _: None
        )
        print_json(
            {
                "schema": SCHEMA,
                "src": args.src,
                "dst": args.dst,
                "index": index,
                "files": files,
                "left_out": left_out,
            }
        )
    elif not args.quiet:
        for r in reports:
            extra = f", {len(r.dropped)} shared dropped" if r.dropped else ""
            checked = f", verified ({r.verified})" if r.verified else ""
            print(
                f"{sanitize(r.src)} -> {sanitize(r.dst)}: {plural(len(r.tensors), 'tensor')}, "
                f"{r.total_size} bytes{extra}{checked}"
            )
            _print_skipped_values(r, keep=args.keep_non_tensors)
            _print_skipped_objects(r)
        for path, why in left_out.items():
            print(f"{sanitize(path)}: left out, {sanitize(why)}")
    return 0


def _print_skipped_values(r: Any, *, keep: bool) -> None:
    """The non-tensor values of one file not stored, and why (with ``--keep-non-tensors``)."""
    from ..convert import kept_text

    tensors = set(r.tensors)
    # A value whose JSON is a tensor name would read as a tied name {dropped: kept}.
    clash = [
        k
        for k in r.skipped_non_tensors
        if keep and k in r.non_tensors and kept_text(r.non_tensors[k]) in tensors
    ]
    rest = [k for k in r.skipped_non_tensors if k not in clash]
    why = " (their names are metadata keys)" if r.kept_non_tensors else ""
    for names, because in ((rest, why), (clash, " (their values are tensor names)")):
        if not names:
            continue
        # Names from the checkpoint: escaped, as every name printed from a file.
        skipped = ", ".join(quoted(str(k)) for k in names[:10])
        more = len(names) - 10
        skipped += f" and {more} more" if more > 0 else ""
        print(f"  skipped non-tensor values{because}: {skipped}")


def _print_modules(r: Any) -> None:
    """The module classes of a whole pickled model that were walked, with how many of each:
    their own ``state_dict`` code did not run, so a reader can check none of them has any."""
    if not r.modules:
        return
    counts: dict[str, int] = {}
    for cls in r.modules.values():
        counts[cls] = counts.get(cls, 0) + 1
    shown = [f"{sanitize(c)}" + (f" x{n}" if n > 1 else "") for c, n in list(counts.items())[:10]]
    more = len(counts) - 10
    listed = ", ".join(shown) + (f" and {more} more" if more > 0 else "")
    print(
        f"  whole model: {plural(len(r.modules), 'module')} converted as state_dict() does by "
        f"default (their own state_dict code is not run): {listed}"
    )


def _print_skipped_objects(r: Any) -> None:
    """What ``--skip-unknown`` left out of one file: where, of which class, and the tensors
    inside those objects (not converted)."""
    if not r.unknown_globals:
        return
    _print_modules(r)
    where = [f"{quoted(k)} ({sanitize(v)})" for k, v in list(r.skipped_objects.items())[:10]]
    more = len(r.skipped_objects) - 10
    listed = ", ".join(where) + (f" and {more} more" if more > 0 else "")
    if listed or not r.modules:  # a whole model with nothing else has nothing to list
        print(f"  skipped unknown objects: {listed or '(none in the converted part)'}")
    print(f"  unknown globals: {', '.join(sanitize(g) for g in r.unknown_globals)}")
    if r.skipped_tensors:
        n = r.skipped_tensors
        also = " or non-persistent buffers" if r.modules else ""
        print(
            f"  {plural(n, 'tensor')} inside skipped objects{also} {'was' if n == 1 else 'were'} "
            "not converted"
        )
