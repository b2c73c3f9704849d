"""Shared pieces of the subcommands: opening models, safe text, tables, progress, JSON.

Everything printed from a file (tensor names, metadata) goes through :func:`sanitize`, because a
hostile file must not be able to send escape sequences to the user's terminal (as gguf-dump's
``sanitize_name`` does). Rich is used for tables and colour only when stdout is a terminal;
otherwise, or when rich is not installed, tables are plain aligned text that scripts can parse.
tqdm draws progress bars on stderr, only on a terminal, only after a second, never with
``--quiet``.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, TextIO

import numpy as np

from .._dtypes import DType
from .._errors import SafetensorError, make_folder
from .._file_pool import FilePool
from .._format import MAX_HEADER_SIZE, Header, gc_paused
from .._name_globs import glob_matcher
from .._ordered_opens import ahead_for, in_order
from .._planned_reads import BlockBudget, plan_reads, reads_remotely
from .._reader import read_header
from .._remote_urls import shown_location as shown
from .._sharded import MissingShardError
from .._sharding import as_header_metadata, model_metadata, parse_size
from .._sources import ByteSource, PreadSource
from .._validate import (
    CONTROL_CHARS,
    ModelFiles,
    Problem,
    index_problems,
    iter_tensor_chunks,
    locate_model,
    open_model_file,
)
from ._json_text import json_pieces

__all__ = [
    "CHUNK_BYTES",
    "HEADER_LIMIT_HINT",
    "LazyRows",
    "Model",
    "OutputFolders",
    "ShardFile",
    "TensorRef",
    "Ui",
    "UsageError",
    "add_filter_args",
    "add_header_limit_arg",
    "check_source",
    "finite_json",
    "human_bytes",
    "human_count",
    "make_parent",
    "open_model",
    "print_json",
    "quoted",
    "sanitize",
    "shown",
    "to_float64",
    "tolerance",
    "url_argument_errors",
]

#: Bytes read per step when streaming tensor data: a multiple of every element size and of the
#: 3-byte F6 group (so no element straddles two chunks), small enough to bound memory.
CHUNK_BYTES: Final = 24 << 20

# What could control a terminal (see CONTROL_CHARS), and lone surrogates: a file name that is
# not UTF-8 holds them (os.fsdecode), and printing one to a strict UTF-8 stream raised.
# Spaces other than U+0020 too (no-break, en, em, ideographic...): "w\u00a0" printed as "w ".
_UNSAFE: Final = re.compile(
    f"[{CONTROL_CHARS}\ud800-\udfff\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]"
)


class UsageError(SafetensorError):
    """Raised when the command line asks for something impossible (exit code 2)."""

    exit_code = 2


class OutputFolders:
    """The folders a writing command creates, removed again (those still empty) if it fails.

    A failed ``cast``/``reshard``/``merge``/``extract``/``convert`` left the output folder it
    had just created (and its new parents) behind, empty. Use as a context manager around the
    command's writing; :meth:`expect` notes the folders a library call will create itself.
    """

    def __init__(self) -> None:
        self._missing: set[str] = set()

    def expect(self, folder: str) -> None:
        """Note ``folder`` and those of its parents that do not exist yet."""
        path = os.path.abspath(folder)
        while not os.path.lexists(path):
            self._missing.add(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent

    def makedirs(self, folder: str, named: str | None = None) -> None:
        """:func:`make_folder` (``os.makedirs(folder, exist_ok=True)``, a failure naming
        ``named``), noting what it creates."""
        self.expect(folder)
        make_folder(folder, named)

    def remove_empty(self) -> None:
        """Remove the noted folders that exist and are empty, deepest first."""
        for path in sorted(self._missing, key=lambda p: p.count(os.sep), reverse=True):
            with contextlib.suppress(OSError):  # not empty, or gone: leave it
                os.rmdir(path)

    def __enter__(self) -> OutputFolders:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.remove_empty()


def make_parent(path: str, folders: OutputFolders | None = None) -> None:
    """Create the folder an output file goes into, with its parents (``mkdir -p``).

    Every command creates what it writes into: output folders (``reshard``, sharded ``cast``
    and ``extract -s``, folder ``convert``) and the folder of an output file alike. With
    ``folders``, what is created is noted there (and removed again if the command fails).

    Raises:
        UsageError: ``path`` names a folder (it ends with a separator, or is one).
    """
    if "://" in path:
        return
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        # Written as a file, it would fail with "No such file or directory" or "Is a directory".
        what = "is a folder" if os.path.isdir(path) else "names a folder (it ends with a separator)"
        raise UsageError(f"the output {sanitize(path)!r} {what}; name the file to write")
    # As given (the file in the way is named so), but normalised: makedirs of "a/../b" also
    # made "a", which the folders noted (by absolute path) would not remove.
    parent = os.path.dirname(os.path.normpath(path)) or os.curdir
    if folders is not None:
        folders.makedirs(parent, path)
    else:
        make_folder(parent, path)


def warn_beside_index(path: str) -> None:
    """Warn when the output file was written beside an index of its own name
    (``model.safetensors`` beside ``model.safetensors.index.json``) that another checkpoint left.

    Its folder then holds two checkpoints: this library opens the folder by the index (the old
    shards), transformers by the new file. A sharded output replaces a single file of the
    index's name; a single output file leaves the old index and its shards alone (they may be
    all that is left of that checkpoint), so this says so instead of deleting them.
    """
    if "://" in path or not path.endswith(".safetensors"):
        return
    index = path + ".index.json"
    if os.path.isfile(index):
        name = os.path.basename(path)
        Ui.warn(
            f"{sanitize(index)} (an index of another checkpoint) is still beside {sanitize(name)}: "
            f"the folder opens by that index here, by {sanitize(name)} in transformers; delete "
            "the index and its shards to leave the new file alone"
        )


def check_output_folder(path: str, what: str, alternative: str = "") -> None:
    """Refuse an output folder that is a file, or that does not exist and is named like one.

    A sharded output named ``out.safetensors`` became a folder of that name, shards and an
    index inside: rarely what was meant. An existing folder of any name is taken.

    Args:
        path: The output folder as given.
        what: What the command writes, for the message ("reshard writes a folder").
        alternative: How to get one file instead, for the message, if there is a way.

    Raises:
        UsageError: ``path`` is a file, or ends with ``.safetensors`` or ``.json`` and is no
            folder.
    """
    if "://" in path or os.path.isdir(path):
        return
    if os.path.lexists(path):
        # makedirs would say only "File exists".
        raise UsageError(f"the output {sanitize(path)!r} is a file; {what}")
    if path.lower().endswith((".safetensors", ".json")):
        raise UsageError(
            f"the output {sanitize(path)!r} is named like a file; {what} (model.safetensors, "
            f"or shards and their index, inside it): name a folder{alternative}"
        )


def check_source(
    target: str,
    storage_options: dict[str, Any] | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
) -> None:
    """Open a model's headers before a command rewrites it, for errors that name the file.

    ``reshard``/``merge``/``extract`` read through the library, whose header errors do not say
    which shard failed; this reads every header the way ``inspect`` does (naming the file) and
    refuses an index that disagrees with its shards, before anything is written.
    """
    with open_model(target, storage_options, max_header_size) as model:
        model.refuse_inconsistent()


def tolerance(text: str) -> float:
    """``argparse`` type for ``--atol``/``--rtol`` (and ``--lock-timeout``): a finite number
    ``>= 0``.

    NaN would make every comparison false (so every difference "within tolerance"), a negative
    tolerance makes equal values differ, and an infinite one cannot be written in the JSON
    report: all are refused as usage errors (exit 2).
    """
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text!r}")
    return value


#: Said after a header refused as too large (the library's message names its keyword).
HEADER_LIMIT_HINT: Final = (
    "hint: on the command line, raise the limit with --max-header-size BYTES (300MB, say) if "
    "the file is trusted"
)


def add_header_limit_arg(parser: Any) -> None:
    """Add ``--max-header-size`` to a command that reads or writes safetensors headers."""
    parser.add_argument(
        "--max-header-size",
        type=header_size,
        default=MAX_HEADER_SIZE,
        metavar="BYTES",
        help="the largest header read or written, in bytes or with a unit (300MB, 1.5GB); "
        f"default {MAX_HEADER_SIZE:_} as in the reference, which opens no file with a larger "
        "header",
    )


def header_size(text: str) -> int:
    """An ``argparse`` type for ``--max-header-size``: a whole number of bytes, or a size
    with a decimal unit as ``reshard --max-shard-size`` takes it (``300MB``)."""
    import argparse

    try:
        return int(text) if text.strip().isdigit() else parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (a whole number, or with a unit: 300MB, 1.5GB)"
        ) from exc


def whole_number(minimum: int, unit: str = "") -> Callable[[str], int]:
    """An ``argparse`` type: a whole number of at least ``minimum`` (``unit`` names what it
    counts in messages, e.g. ``"bytes"``); anything else is a usage error (exit 2)."""
    import argparse

    what = f"whole number of {unit}" if unit else "whole number"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be {minimum}{' ' + unit if unit else ''} or more, not {text!r}"
            )
        return value

    return parse


def plural(n: int, word: str) -> str:
    """``"1 tensor"``, ``"2 tensors"``: ``n`` and ``word``, with an ``s`` unless ``n`` is 1."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def sanitize(text: str) -> str:
    r"""Escape characters that could control a terminal: ``"a\x1b[31m"`` -> ``"a\\x1b[31m"``."""

    def esc(m: re.Match[str]) -> str:
        c = ord(m.group())
        return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"

    text = _UNSAFE.sub(esc, text)
    encoding = _narrow_stdout_encoding()
    if encoding is not None and not _encodable(text, encoding):
        # What stdout's encoding cannot hold (PYTHONIOENCODING=ascii, a Windows code page):
        # escaped here, so that quoted() quotes such a name (the stream's own fallback
        # escaped it too, but printed "wé" and the text "w\xe9" alike, and misaligned tables).
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    return text


def _narrow_stdout_encoding() -> str | None:
    """stdout's encoding where it cannot hold every character; None for the UTF encodings."""
    encoding = getattr(sys.stdout, "encoding", None)
    return _narrow(encoding) if isinstance(encoding, str) else None


@functools.lru_cache(maxsize=8)
def _narrow(encoding: str) -> str | None:
    # Cached: sanitize runs for every name of a table (20,000 for a MoE model).
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return None
    return None if name.startswith("utf-") else name


def _encodable(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def quoted(text: str) -> str:
    r"""A name or value from a file, shown so that no two texts print alike.

    Text without anything :func:`sanitize` escapes is shown as it is (``C:\models``, or
    ``a\x1b`` for those five characters). Text with something to escape, beginning with a
    double quote, empty, or beginning or ending with a space (``"w "`` printed as ``w`` in a
    padded column) is shown in double quotes with its backslashes and double quotes escaped
    too: ``"a\x1b"`` for ``a`` and ESC, ``"\"q\""`` for ``"q"``. (Escaping alone printed ``a``
    and ESC as ``a\x1b`` too.) Plain output never begins with a double quote, and within quotes
    every backslash begins an escape, so each shown text has one source.
    """
    encoding = _narrow_stdout_encoding()
    if (
        text
        and not _UNSAFE.search(text)
        and not text.startswith(('"', " "))
        and not text.endswith(" ")
        and (encoding is None or _encodable(text, encoding))
    ):
        return text
    return '"' + sanitize(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def display_width(text: str) -> int:
    """The columns ``text`` takes on a terminal: combining marks and format characters none,
    East Asian wide and full-width characters two (``len`` misaligned table rows holding
    them: ``e`` + U+0301 counted 2 for one column)."""
    if text.isascii():
        return len(text)
    import unicodedata

    width = 0
    for char in text:
        if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


def human_count(n: int) -> str:
    """Parameter counts as the hub shows them: ``7.24B``, ``135M``, ``12.5K``.

    The unit is chosen after rounding: 999,950 rounds to 1,000K, shown ``1M`` (``.3g`` of
    999.95 is ``1e+03``).
    """
    units = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3))
    for i, (unit, scale) in enumerate(units):
        if n >= scale:
            text = f"{n / scale:.3g}"
            if float(text) >= 1000:
                if i == 0:  # no larger unit: the whole number of T
                    return f"{n / scale:.0f}{unit}"
                unit, scale = units[i - 1]
                text = f"{n / scale:.3g}"
            return f"{text}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """Decimal byte sizes (as the hub and ``max_shard_size`` use): ``4.9 GB``, ``312 B``.

    The unit is chosen after rounding: 999,960 bytes is ``1.0 MB``, not ``1000.0 kB``.
    """
    units = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
    for i, (unit, scale) in enumerate(units):
        if n >= scale:
            if round(n / scale, 1) >= 1000 and i > 0:
                unit, scale = units[i - 1]
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def print_json(obj: Any, out: TextIO | None = None) -> None:
    """Print JSON with every non-ASCII and control character escaped (safe on any terminal).

    Written as it is encoded, in batches of pieces: ``json.dumps`` of a million tensors' rows
    held every piece and then the whole text at once (over a gigabyte) before printing any.
    Lists may be :class:`LazyRows`, whose items are made as they are written. The text is
    ``json.dumps(obj, indent=2, ensure_ascii=True, allow_nan=False)``'s (see
    :mod:`._json_text`, which writes it several times faster).
    """
    stream = out or sys.stdout
    batch: list[str] = []
    size = 0
    try:
        for piece in json_pieces(obj):
            batch.append(piece)
            size += len(piece)
            # Batches of about a pipe's capacity. Pieces are whole rows now: counted by pieces,
            # a batch was a megabyte, and one write that large to a reader that went away
            # (`| head -c 100`) wrote 64 KiB and lost the rest without an error (exit 0, not
            # 141).
            if size >= _JSON_WRITE_CHARS:
                stream.write("".join(batch))
                batch.clear()
                size = 0
    except RecursionError:
        raise _nested_too_deeply() from None
    batch.append("\n")
    stream.write("".join(batch))


def _nested_too_deeply() -> SafetensorError:
    """The error for a document (an index's metadata, which may hold any JSON) nested too
    deeply to write: a RecursionError's traceback said nothing of where."""
    return SafetensorError(
        "cannot write the JSON output: a value in it (the index's metadata?) is nested too "
        "deeply (hundreds of levels)",
        kind="NestedTooDeep",
    )


#: Characters of JSON text written at a time.
_JSON_WRITE_CHARS: Final = 1 << 16


def finite_json(value: Any) -> Any:
    """``value`` (JSON-like, read from a file) with non-finite floats as None: Python's
    ``json`` reads ``NaN``, ``Infinity`` and ``1e400`` in an index, which :func:`print_json`
    cannot write (its documents hold no NaN or Infinity)."""
    try:
        return _finite(value)
    except RecursionError:
        raise _nested_too_deeply() from None


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class LazyRows(list):  # type: ignore[type-arg]
    """A JSON list whose items are made one by one as :func:`print_json` writes them.

    The pure-Python encoder (used with ``indent``) takes any ``list`` subclass: it asks only
    whether the list is empty and iterates it. Nothing is stored in the list itself.
    """

    def __init__(self, count: int, items: Callable[[], Iterator[Any]]) -> None:
        super().__init__()
        self._count = count
        self._items = items

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Any]:
        return self._items()


def array_rows(values: np.ndarray, block: int = 65_536) -> LazyRows:
    """A 1-D array as a JSON list of Python numbers made a block at a time as it is written:
    ``tolist()`` of a million-bin histogram's edges and counts held ~70 MB at once."""

    def items() -> Iterator[Any]:
        for start in range(0, values.size, block):
            yield from values[start : start + block].tolist()

    return LazyRows(values.size, items)


def add_filter_args(parser: Any) -> None:
    """``--filter`` (glob, repeatable) and ``--regex`` for choosing tensors by name."""
    parser.add_argument(
        "-f",
        "--filter",
        action="append",
        metavar="GLOB",
        help="only tensors whose name matches this glob (repeatable), e.g. 'model.layers.0.*'",
    )
    parser.add_argument("--regex", metavar="RE", help="only tensors whose name matches this regex")


def name_filter(args: Any) -> Callable[[str], bool]:
    """Build the predicate ``--filter``/``--regex`` ask for (everything when neither is given)."""
    globs: list[str] = list(getattr(args, "filter", None) or [])
    pattern = getattr(args, "regex", None)
    regex: re.Pattern[str] | None = None
    if pattern:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise UsageError(f"invalid --regex {pattern!r}: {exc}") from None

    globbed = glob_matcher(globs) if globs else None

    def accept(name: str) -> bool:
        if globbed is not None and not globbed(name):
            return False
        return regex is None or regex.search(name) is not None

    return accept


def check_filter_matches(args: Any, *models: Model) -> None:
    """Refuse a ``--filter``/``--regex`` that matches no tensor of ``models``: a typo
    (``'modle.*'``) made ``diff`` report two different models equal, ``hash`` print the
    digest of nothing, and ``stats``/``inspect`` an empty table, each exiting 0.

    Raises:
        UsageError: Filters were given and no tensor name passes them.
    """
    globs = list(getattr(args, "filter", None) or [])
    pattern = getattr(args, "regex", None)
    if not globs and not pattern:
        return
    accept = name_filter(args)
    if any(accept(name) for model in models for name in model.tensors):
        return
    asked = [f"--filter {g!r}" for g in globs] + ([f"--regex {pattern!r}"] if pattern else [])
    total = sum(len(model.tensors) for model in models)
    raise UsageError(
        f"{' and '.join(asked)} matched none of the {total:,} tensor names"
        " (globs match whole names: 'model.layers.0.*'; --regex searches anywhere in a name)"
    )


# ------------------------------------------------------------------------------------- models


@dataclass(slots=True)
class ShardFile:
    """One open safetensors file of a model."""

    label: str
    """Name shown to the user (relative to the model folder for shards)."""
    path: str
    """Path or URL."""
    source: ByteSource
    """Where its bytes come from."""
    header: Header
    """Its validated header."""
    planned: ByteSource | None = None
    """While :meth:`Model.planned_reads` is in effect for a remote file: where its tensor data
    is read from (few large requests instead of one per read)."""

    @property
    def data(self) -> ByteSource:
        """Where to read tensor data: the planned reader if there is one, else the source."""
        return self.source if self.planned is None else self.planned


class TensorRef(NamedTuple):
    """Where one tensor's bytes are.

    A named tuple, as the header's own entries are: a model of 100,000 tensors built its
    frozen dataclasses in 0.6 s on a 2-core host, most of opening it for a command."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    file: ShardFile
    begin: int
    """Start in the file's data buffer."""
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        """Logical element count (parameters)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def file_offsets(self) -> tuple[int, int]:
        """``(begin, end)`` as offsets in the file, not the data buffer."""
        start = self.file.header.data_start
        return start + self.begin, start + self.end

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
        """The tensor's bytes as fresh uint8 arrays of at most ``chunk_bytes``."""
        for _, buf in iter_tensor_chunks(
            self.file.data, self.file_offsets[0], self.nbytes, chunk_bytes
        ):
            yield buf


@dataclass(slots=True)
class Model:
    """A file, a sharded model or a URL, opened for reading."""

    target: str
    located: ModelFiles
    files: list[ShardFile] = field(default_factory=list)
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    index_problems: list[Problem] = field(default_factory=list)
    """Where the index disagrees with the shards (the tensors listed are the shards')."""

    def warn_index(self) -> int:
        """Print the index problems on stderr as warnings; 1 if there were any, else 0.

        ``reshard``/``merge``/``extract`` refuse such a model; read-only commands still answer
        (about the tensors the shards hold) but must not exit 0 as if the model were sound.
        """
        for p in self.index_problems:
            where = f" (tensor {sanitize(repr(p.tensor))})" if p.tensor is not None else ""
            print(
                f"warning: {sanitize(self.target)}: {sanitize(self.label(p.file or ''))} "
                f"[{p.code}]{where}: "
                f"{sanitize(p.message)} (run `pysafetensors validate`)",
                file=sys.stderr,
            )
        return 1 if self.index_problems else 0

    def refuse_inconsistent(self) -> None:
        """Raise if the index disagrees with the shards (for commands that write a model)."""
        if self.index_problems:
            p = self.index_problems[0]
            raise SafetensorError(
                f"{self.target}: {self.label(p.file or '')}: {p.message}"
                + (f" (tensor {p.tensor!r})" if p.tensor is not None else "")
                + f"; {len(self.index_problems)} problem(s), run `pysafetensors validate`",
                kind=p.code,
                tensor=p.tensor,
            )

    def label(self, label: str) -> str:
        """A file's label as output shows it: a URL without credentials or query string
        (:func:`shown`); a shard's name from the index as it is (it carries no secret)."""
        return shown(label)

    @property
    def sharded(self) -> bool:
        """Whether the model spans an index and shards."""
        return self.located.sharded

    @property
    def metadata(self) -> dict[str, str] | None:
        """The file's ``__metadata__``; for shards, the entries every shard agrees on."""
        metas = [f.header.metadata for f in self.files]
        if len(metas) == 1:
            return metas[0]
        if all(m is None for m in metas):
            return None
        common = dict(metas[0] or {})
        for m in metas[1:]:
            common = {k: v for k, v in common.items() if (m or {}).get(k) == v}
        return common

    @property
    def index_metadata(self) -> dict[str, Any] | None:
        """The index's ``metadata`` object, for sharded models with an index."""
        index = self.located.index
        meta = index.get("metadata") if index else None
        return meta if isinstance(meta, dict) else None

    def model_metadata(self, *, computed: bool = True) -> dict[str, str] | None:
        """The model's metadata as one file would hold it (the entries every file agrees on,
        then the index's; see :func:`model_metadata`): what ``metadata get`` shows and, without
        the index's computed ``total_size``/``total_parameters``, what ``diff`` compares."""
        meta = model_metadata(
            [f.header.metadata for f in self.files], self.index_metadata, computed=computed
        )
        return None if meta is None else as_header_metadata(meta)

    @contextlib.contextmanager
    def planned_reads(self, refs: Iterable[TensorRef]) -> Iterator[None]:
        """Read the data of ``refs`` in few large requests from remote files, until exit.

        For commands that stream tensors (``hash``, ``stats``, ``cast``, ``diff``): each
        remote file reads through a :class:`PlannedReads` of those tensors' ranges, one file's
        blocks held at a time for the whole model. Local files read as before.
        """
        remote = {id(f) for f in self.files if reads_remotely(f.source)}
        ranges: dict[int, list[tuple[int, int]]] = {}
        if remote:  # local files' ranges are not wanted (0.3 s for 100,000 tensors)
            for ref in refs:
                if id(ref.file) in remote:
                    ranges.setdefault(id(ref.file), []).append(ref.file_offsets)
        budget = BlockBudget()
        try:
            for f in self.files:
                if id(f) in ranges:
                    f.planned = plan_reads(f.source, ranges[id(f)], budget)
            yield
        finally:
            for f in self.files:
                if f.planned is not None:
                    f.planned.close()
                    f.planned = None

    def close(self) -> None:
        """Close every file."""
        for f in self.files:
            f.source.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def url_argument_errors() -> Iterator[None]:
    """Turn what opening a URL refuses before any request into a usage error (exit 2).

    The remote sources check the URL and their options (``-H``, ``--remote-option``) first and
    raise a plain ``TypeError``/``ValueError`` naming what is wrong; a malformed file raises a
    ``SafetensorError``, which passes through, as does everything else.
    """
    try:
        yield
    except SafetensorError:
        raise
    except (TypeError, ValueError) as exc:
        # Chained for --debug: these messages name options, never a header's value.
        raise UsageError(str(exc)) from exc


#: The local files of every model a command opened (``diff`` opens two), within one budget.
_OPEN_FILES: Final = FilePool()


def open_model(
    target: str,
    storage_options: dict[str, Any] | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
) -> Model:
    """Open a file, folder, index or URL; the headers are read and validated, the data is not.

    ``storage_options`` are the remote source's options for a URL (see ``_remote_args``);
    ``max_header_size``: the largest header accepted (``--max-header-size``).

    Raises:
        SafetensorError: A file is malformed, the index is unusable, or two shards hold the
            same tensor.
        OSError: A file cannot be opened.
    """
    with url_argument_errors():
        located = locate_model(target, storage_options=storage_options)
    if located.problems:
        # Named by the model as given (``diff`` opens two) and the tensor the entry is for.
        first = located.problems[0]
        about = "" if first.tensor is None else f" (tensor {first.tensor!r})"
        raise SafetensorError(
            f"{shown(target)}: {first.file}: {first.message}{about} (run `pysafetensors "
            "validate` for every problem)",
            kind=first.code,
            tensor=first.tensor,
        )
    model = Model(shown(target), located)

    def open_one(item: tuple[str, str]) -> tuple[ByteSource, Header]:
        path, label = item
        try:
            with url_argument_errors():
                source: ByteSource = open_model_file(path, storage_options)
        except FileNotFoundError as exc:
            if located.index_path is None or isinstance(exc, SafetensorError):
                raise  # the target itself, or a remote error, which names its URL
            # Python's "[Errno 2] No such file or directory" named the file, not the index.
            raise MissingShardError(
                f"{shown(target)}: shard {sanitize(label)} is missing: the index "
                f"{shown(located.index_path)} names it, and there is no file {shown(path)}",
                kind="ShardMissing",
            ) from exc
        try:
            header = read_header(source, max_header_size=max_header_size, prefix_text=f"{label}: ")
            return source, header
        except BaseException:
            source.close()
            raise

    items = list(zip(located.files, located.labels, strict=True))
    # Remote shards opened a few at once; local files one by one, as each may be closed
    # again past the descriptor budget.
    opens = in_order(
        open_one, items, discard=lambda _, pair: pair[0].close(), ahead=ahead_for(located.files)
    )
    try:
        for (path, label), opened in opens:
            source, header = opened.result()
            if isinstance(source, PreadSource):
                # A local file: its descriptor closed past the budget and opened again when
                # read (a model of thousands of shards ran out of descriptors).
                source = _OPEN_FILES.adopt(path, source)
            shard = ShardFile(shown(label), path, source, header)
            model.files.append(shard)
            tensors = model.tensors
            with gc_paused():  # a record per tensor, all kept (see gc_paused)
                for name, dtype, shape, begin, end in header.tensors.values():
                    if name in tensors:
                        raise SafetensorError(
                            f"tensor {sanitize(name)!r} is in both "
                            f"{tensors[name].file.label} and {label}",
                            kind="DuplicateTensor",
                            tensor=name,
                        )
                    tensors[name] = TensorRef(name, dtype, shape, shard, begin, end)
        if located.sharded:
            with gc_paused():  # a pair per tensor
                model.index_problems = index_problems(
                    located,
                    {
                        f.label: {i.name: (i.begin, i.end) for i in f.header.tensors.values()}
                        for f in model.files
                    },
                )
    except BaseException:
        opens.close()  # what is still being opened is closed as it arrives
        model.close()
        raise
    return model


# ------------------------------------------------------------------------------------- values


def to_float64(values: np.ndarray) -> np.ndarray:
    """Values as float64 for statistics; complex values become their magnitude, computed in
    double precision (``abs`` of a complex64 is a float32: a finite 3e38+3e38j became Inf,
    subnormal magnitudes lost their digits)."""
    out: np.ndarray = (
        np.abs(values.astype(np.complex128))
        if values.dtype.kind == "c"
        else values.astype(np.float64)
    )
    return out


# ------------------------------------------------------------------------------------- output


class Ui:
    """Terminal-aware output: tables, colour and progress bars, with plain-text fallbacks."""

    def __init__(self, args: Any) -> None:
        self.quiet: bool = bool(getattr(args, "quiet", False))
        no_color = bool(os.environ.get("NO_COLOR")) or bool(getattr(args, "no_color", False))
        self._rich: Any = None
        if _isatty(sys.stdout) and not no_color:
            with contextlib.suppress(ImportError):
                from rich.console import Console

                self._rich = Console(highlight=False)

    @property
    def color(self) -> bool:
        """Whether output is going to a terminal through rich."""
        return self._rich is not None

    @staticmethod
    def columns() -> int | None:
        """The terminal's width, when stdout is a terminal (None: a file or a pipe)."""
        if not _isatty(sys.stdout):
            return None
        import shutil

        return shutil.get_terminal_size().columns

    def line(self, text: str = "", style: str | None = None) -> None:
        """Print one line (already sanitized); ``style`` is a rich style, used on terminals."""
        if self._rich is not None:
            from rich.text import Text

            self._rich.print(Text(text, style=style or ""))
        else:
            print(text)

    def lines(self, texts: Iterable[str], style: str | None = None) -> None:
        """Print lines (already sanitized), a thousand a write where there is no terminal
        styling (one print a line was a third of ``hash`` of 100,000 tensors' output)."""
        if self._rich is not None:
            for text in texts:
                self.line(text, style)
            return
        block: list[str] = []
        for text in texts:
            block.append(text)
            if len(block) == 1024:
                print("\n".join(block))
                block = []
        if block:
            print("\n".join(block))

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        right: Sequence[str] = (),
        title: str | None = None,
    ) -> None:
        """Print a table; cells are plain strings, never parsed as markup."""
        if self._rich is not None:
            from rich.table import Table
            from rich.text import Text

            table = Table(title=title, title_justify="left", header_style="bold")
            for col in columns:
                table.add_column(col, justify="right" if col in right else "left", overflow="fold")
            for row in rows:
                table.add_row(*(Text(cell) for cell in row))
            self._rich.print(table)
            return
        if title:
            print(title)
        if any(len(row) != len(columns) for row in rows):
            raise ValueError("a table row has another number of cells than the table's columns")
        # Widths column by column: a column of ASCII cells (nearly all) by len, in C; one
        # display_width call a cell was a fifth of `stats` of 100,000 tensors.
        widths = [display_width(c) for c in columns]
        wide: list[int] = []  # the columns with a cell that is not ASCII
        for i, cells in enumerate(zip(*rows, strict=True)):
            if "".join(cells).isascii():
                widths[i] = max(widths[i], max(map(len, cells)))
            else:
                widths[i] = max(widths[i], max(map(display_width, cells)))
                wide.append(i)

        aligned = [col in right for col in columns]
        # ASCII cells are padded by len: a row of them is one format call.
        template = "  ".join(
            f"{{:{'>' if is_right else '<'}{w}}}"
            for is_right, w in zip(aligned, widths, strict=True)
        )

        def fmt(cells: Sequence[str]) -> str:
            parts = []
            for is_right, cell, w in zip(aligned, cells, widths, strict=True):
                pad = " " * (w - (len(cell) if cell.isascii() else display_width(cell)))
                parts.append(pad + cell if is_right else cell + pad)
            return "  ".join(parts).rstrip()

        print(fmt(columns))
        # A thousand rows a print: one print per row was a quarter of `inspect` of 100,000
        # tensors (0.76 of ~3 s).
        self.lines(
            template.format(*row).rstrip()
            if not wide or all(row[i].isascii() for i in wide)
            else fmt(row)
            for row in rows
        )

    @contextlib.contextmanager
    def progress(self, total: int, desc: str) -> Iterator[Callable[[int], None]]:
        """A byte-count progress bar on stderr (terminal only, after one second, not quiet)."""
        bar: Any = None
        if not self.quiet and _isatty(sys.stderr):
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                bar = tqdm(
                    total=total,
                    desc=desc,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    delay=1.0,
                    leave=False,
                    file=sys.stderr,
                    dynamic_ncols=True,
                )
        if bar is None:
            yield lambda n: None
            return
        try:
            yield bar.update
        finally:
            bar.close()

    def note(self, text: str) -> None:
        """An informational line on stderr, unless ``--quiet``."""
        if not self.quiet:
            print(text, file=sys.stderr)

    def done(self, text: str) -> None:
        """What a command that writes did (one line on stdout), unless ``--quiet``."""
        if not self.quiet:
            self.line(text)

    @staticmethod
    def warn(text: str) -> None:
        """``warning: text`` on stderr, also with ``--quiet`` (a warning is not
        informational output: it says something may be wrong)."""
        print(f"warning: {text}", file=sys.stderr)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
