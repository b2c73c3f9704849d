"""``pysafetensors metadata get|set|delete``: read or edit ``__metadata__``.

Edits happen in place when the new header fits in the old one's padding, otherwise the file is
rewritten atomically (see :func:`pysafetensors.edit_metadata`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Final

from .._errors import SafetensorError
from .._metadata_edit import LockTimeoutError, edit_metadata
from .._reader import safe_open
from .._sources import check_regular
from ._common import (
    Ui,
    UsageError,
    add_header_limit_arg,
    open_model,
    print_json,
    quoted,
    sanitize,
    shown,
    tolerance,
    whole_number,
)
from ._remote_args import add_remote_args, remote_options

SCHEMA: Final = "pysafetensors.metadata/1"


def register(sub: Any) -> None:
    """Add the ``metadata`` subcommand and its actions."""
    p = sub.add_parser(
        "metadata",
        help="get, set or delete __metadata__ entries (in place when the header has room)",
        description="Read or edit a file's __metadata__ (string to string).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    g = actions.add_parser("get", help="print all metadata, or one key's value")
    g.add_argument("target", metavar="TARGET", help="file, model folder, index or URL")
    g.add_argument("key", nargs="?", metavar="KEY", help="print only this key's value")
    g.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    g.add_argument(
        "--raw",
        action="store_true",
        help="print the value of KEY exactly, control characters included",
    )
    add_remote_args(g)
    add_header_limit_arg(g)
    g.set_defaults(func=run_get)

    s = actions.add_parser("set", help="add or change keys: KEY=VALUE ...")
    s.add_argument("target", metavar="FILE", help="a local .safetensors file")
    s.add_argument("pairs", nargs="+", metavar="KEY=VALUE", help="values are stored as strings")
    s.add_argument("--replace", action="store_true", help="drop every other key")
    s.add_argument(
        "--reserve",
        type=whole_number(0, "bytes"),
        default=0,
        metavar="BYTES",
        help="if the file must be rewritten, leave this much spare header room for later edits",
    )
    _in_place_arg(s)
    _lock_timeout_arg(s)
    add_header_limit_arg(s)
    s.set_defaults(func=run_set)

    d = actions.add_parser("delete", help="remove keys")
    d.add_argument("target", metavar="FILE", help="a local .safetensors file")
    d.add_argument("keys", nargs="+", metavar="KEY")
    d.add_argument("--missing-ok", action="store_true", help="ignore keys that are not present")
    _in_place_arg(d)
    _lock_timeout_arg(d)
    add_header_limit_arg(d)
    d.set_defaults(func=run_delete)


#: --in-place choices and the edit_metadata argument each stands for.
_IN_PLACE: Final = {"auto": None, "always": True, "never": False}


def _in_place_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--in-place",
        choices=list(_IN_PLACE),
        default="auto",
        help=(
            "auto: in place when the change stays within one 4 KiB page (a killed edit leaves "
            "the old or the new header), else an atomic rewrite; always: in place whenever the "
            "header fits (no rewrite of a large file; an interrupted edit across pages can "
            "break the header); never: always rewrite"
        ),
    )


def _lock_timeout_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-timeout",
        type=tolerance,
        default=None,
        metavar="SECONDS",
        help=(
            "give up (exit 2, nothing changed) if another process holds a lock on the file "
            "this long (default: wait, saying so after a second)"
        ),
    )


#: Seconds an edit waits for another process's lock on the file before it says it is waiting.
_QUIET_WAIT: Final = 1.0


def _edit(args: argparse.Namespace, **options: Any) -> bool:
    """``edit_metadata(args.target, **options)``, waiting for another process's lock on the
    file at most ``--lock-timeout`` seconds, and saying so after a second: an edit held back
    by a lock (another edit's, a backup or sync tool's) waited without a word."""
    options["max_header_size"] = args.max_header_size
    limit = args.lock_timeout
    first = _QUIET_WAIT if limit is None else min(_QUIET_WAIT, limit)
    try:
        return edit_metadata(args.target, lock_timeout=first, **options)
    except LockTimeoutError:  # only the lock's: a slow file system's timeout is an error
        if limit is not None and limit <= first:
            raise
    more = "" if limit is None else f", at most {limit - first:g} s more"
    Ui(args).note(
        f"{sanitize(args.target)}: another process holds a lock on the file (another edit, or "
        f"a backup or sync tool); waiting for it{more} (Ctrl-C to stop)"
    )
    rest = None if limit is None else limit - first
    return edit_metadata(args.target, lock_timeout=rest, **options)


def run_get(args: argparse.Namespace) -> int:
    """Run ``metadata get``."""
    ui = Ui(args)
    if args.raw and args.key is None:
        raise UsageError("--raw prints one value: name its KEY")
    with open_model(args.target, remote_options(args), args.max_header_size) as model:
        meta = model.model_metadata()
        # As inspect/hash/stats: answer, but not with exit 0 for a model whose index disagrees
        # with its shards.
        status = model.warn_index()
    if args.key is not None:
        if meta is None or args.key not in meta:
            # As `metadata delete` says it (exit 1: a negative answer, not a usage error).
            raise SafetensorError(
                f"{shown(args.target)}: metadata has no key {args.key!r}",
                kind="MetadataKeyNotFound",
            )
        value = meta[args.key]
        if args.json:
            print_json(
                {"schema": SCHEMA, "target": shown(args.target), "key": args.key, "value": value}
            )
        elif args.raw:
            raw = getattr(sys.stdout, "buffer", None)
            if raw is None:
                sys.stdout.write(value + "\n")
            else:
                # Exact whatever stdout's encoding (its escapes would change the value).
                sys.stdout.flush()
                raw.write((value + "\n").encode("utf-8", "surrogateescape"))
        else:
            ui.line(quoted(value))
        return status
    if args.json:
        print_json({"schema": SCHEMA, "target": shown(args.target), "metadata": meta})
        return status
    if not meta:
        # The answer, so also with --quiet (on stderr: stdout holds KEY VALUE lines only).
        print("no metadata" if meta is None else "empty metadata", file=sys.stderr)
        return status
    width = max(len(quoted(k)) for k in meta)
    for key, value in meta.items():
        ui.line(f"{quoted(key).ljust(width)}  {quoted(value)}")
    return status


def _local_file(target: str) -> None:
    import os

    if "://" in target:
        raise UsageError("metadata can only be edited in local files, not URLs")
    if os.path.isdir(target) or target.endswith(".index.json"):
        raise UsageError("metadata is edited per file; name one .safetensors file of the model")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return  # the edit's own error names the file
    # A FIFO would block the reads (and `delete`'s open) for ever; a device is no file to edit.
    check_regular(target, mode)


def _report(ui: Ui, target: str, in_place: bool) -> None:
    how = "in place" if in_place else "by rewriting the file"
    ui.done(f"{sanitize(target)}: metadata updated {how}")


def run_set(args: argparse.Namespace) -> int:
    """Run ``metadata set``."""
    _local_file(args.target)
    updates: dict[str, str] = {}
    for pair in args.pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"expected KEY=VALUE, got {sanitize(repr(pair))}")
        try:
            pair.encode("utf-8")
        except UnicodeEncodeError:
            # Bytes the shell passed that are not UTF-8 (Python keeps them as lone
            # surrogates): metadata is text, so the argument is what is wrong.
            raise UsageError(f"KEY=VALUE must be UTF-8 text, got {sanitize(repr(pair))}") from None
        updates[key] = value
    before = _current_metadata(args.target, args.max_header_size)
    in_place = _edit(
        args,
        set=updates,
        replace=args.replace,
        reserve=args.reserve,
        in_place=_IN_PLACE[args.in_place],
    )
    if before is not None and (
        list(updates.items()) == before
        if args.replace
        else all(dict(before).get(k) == v for k, v in updates.items())
    ):
        # The metadata the edit made is the file's as it was (edit_metadata wrote nothing).
        Ui(args).done(f"{sanitize(args.target)}: metadata unchanged (the values were already set)")
        return 0
    _report(Ui(args), args.target, in_place)
    return 0


def _current_metadata(target: str, max_header_size: int) -> list[tuple[str, str]] | None:
    """The file's metadata, in order (None when it has none or cannot be read: the edit
    then reports what is wrong)."""
    try:
        with safe_open(target, "numpy", max_header_size=max_header_size) as f:
            meta = f.metadata()
    except (SafetensorError, OSError):
        return None
    return None if meta is None else list(meta.items())


def run_delete(args: argparse.Namespace) -> int:
    """Run ``metadata delete``."""
    _local_file(args.target)
    # (A file that cannot be read: edit_metadata reports what is wrong with it.)
    before = dict(_current_metadata(args.target, args.max_header_size) or ())
    present = [key for key in args.keys if key in before]
    in_place = _edit(
        args,
        delete=args.keys,
        missing_ok=args.missing_ok,
        in_place=_IN_PLACE[args.in_place],
    )
    if not present:  # only with --missing-ok: edit_metadata refuses absent keys otherwise
        Ui(args).done(f"{sanitize(args.target)}: metadata unchanged (no such keys)")
        return 0
    _report(Ui(args), args.target, in_place)
    return 0
