"""Lenient validation: every problem in a file or a sharded model, not just the first.

The strict parser in ``_format`` is the gate for reading and stops at the first broken rule.
This module walks the same rules (R1-R8, reusing ``_format``'s own helpers so the two cannot
drift apart) but keeps going: each problem becomes a :class:`Problem` with the file, the tensor
and the byte offset it concerns, and checking resumes wherever the rest of the file can still be
understood. The invariant the tests hold it to: a file has no ``"error"`` problems exactly when
``_format.parse_header`` accepts it.

``strict=True`` adds warnings about files the reference reads but that are likely to cause
trouble elsewhere: NaN/Inf values, tensors not aligned to their element size, missing or unknown
``format`` metadata (the hub's loaders check it), duplicate tensor names, whitespace before the
opening ``{``, headers over the hub's 25 MB limit, BOOL bytes other than 0/1, names with control
characters.

Sharded models (a folder, or a ``*.safetensors.index.json``) are checked as a whole: the index's
JSON, unsafe shard names, missing shards, tensors the index lists but no shard holds, tensors a
shard holds that the index does not list, tensors held by two shards, and ``total_size``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np

from ._dtypes import DType, checked_nbits, dtype_from_code
from ._errors import HeaderError, SafetensorError, looks_like_url
from ._format import (
    MAX_HEADER_SIZE,
    N_LEN,
    decode_json,
    parse_entry,
    parse_header,
    parse_header_length,
    top_level_members,
)
from ._ordered_opens import ahead_for, in_order
from ._planned_reads import plan_reads
from ._remote_urls import (
    shown_location,
    shown_name,
    url_dirname,
    url_join,
)
from ._serde_json import all_u64
from ._serde_syntax import PARSE_ONLY_WORDS
from ._sharding import declared_total_size, normal_shard_name, unsafe_shard_name
from ._sources import ByteSource, NotRegularFileError, PreadSource, open_regular_file

__all__ = [
    "HUB_MAX_HEADER_SIZE",
    "KNOWN_FORMATS",
    "ModelFiles",
    "Problem",
    "index_problems",
    "iter_tensor_chunks",
    "locate_model",
    "open_model_file",
    "validate",
    "validate_source",
]

Severity = Literal["error", "warning"]

#: The hub's own, lower header limit (``SAFETENSORS_MAX_HEADER_LENGTH``).
HUB_MAX_HEADER_SIZE: Final = 25_000_000
#: ``format`` values that transformers, the hub and accelerate accept.
KNOWN_FORMATS: Final = frozenset({"pt", "tf", "flax", "mlx"})
#: Bytes read at a time when values are checked: a multiple of every element size and of the
#: 3-byte F6 group, so chunks never split an element.
CHUNK_BYTES: Final = 24 << 20
#: Characters that could control a terminal or reorder what it shows: C0, DEL, C1 (0x9b is a
#: one-byte CSI on some terminals), line and paragraph separators, and the bidirectional marks,
#: overrides and isolates of "trojan source" (CVE-2021-42574: U+061C, U+200E, U+200F,
#: U+202A-U+202E, U+2066-U+2069). One list for the names ``validate --strict`` warns about and
#: the text the command line escapes.
# Invisible characters too (soft hyphen, zero-width space, word joiner and invisible operators,
# byte-order mark): a name holding one prints like another name.
CONTROL_CHARS: Final = (
    "\x00-\x1f\x7f-\x9f\u00ad\u2028\u2029\u061c\u200b\u200e\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u2069\ufeff"
)
_CONTROL: Final = re.compile(f"[{CONTROL_CHARS}]")


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a file or a model."""

    severity: Severity
    """``"error"`` (the reference refuses the file or the model is inconsistent) or
    ``"warning"`` (readable, but likely to cause trouble; only with ``strict=True``)."""
    code: str
    """Short stable name: the reference's error variant where there is one (``InvalidOffset``)."""
    message: str
    """What is wrong, in one line, without the file name."""
    file: str | None = None
    """The file (or index) concerned, as given or relative to the model folder."""
    tensor: str | None = None
    """The tensor concerned, if any."""
    offset: int | None = None
    """Byte offset in ``file`` the problem concerns, if known."""

    def as_dict(self) -> dict[str, Any]:
        """The problem as a JSON-ready dict."""
        return {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "file": self.file,
            "tensor": self.tensor,
            "offset": self.offset,
        }


#: The dtype an entry that failed to parse is counted with (see _walk_header).
_PLAIN_BYTES: Final = dtype_from_code("U8")


def _salvaged_offsets(value: Any) -> tuple[int, int] | None:
    """A failed entry's ``data_offsets``, where they are two unsigned 64-bit integers."""
    if isinstance(value, dict):
        offsets = value.get("data_offsets")
    elif isinstance(value, list) and len(value) >= 3:
        offsets = value[2]  # serde's sequence form: dtype, shape, data_offsets
    else:
        return None
    if type(offsets) is not list or len(offsets) != 2 or not all_u64(offsets):
        return None
    return offsets[0], offsets[1]


@dataclass(slots=True)
class _Entry:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int
    ok: bool = True


@dataclass(slots=True)
class _Collector:
    file: str | None
    problems: list[Problem] = field(default_factory=list)
    strict: bool = False
    # Each problem once: the entries of a repeated name, each with the same fault, listed it
    # once per entry in the same words at the same place.
    _listed: set[Problem] = field(default_factory=set)

    def _add(self, problem: Problem) -> None:
        if problem not in self._listed:
            self._listed.add(problem)
            self.problems.append(problem)

    def error(
        self, code: str, message: str, tensor: str | None = None, offset: int | None = None
    ) -> None:
        self._add(Problem("error", code, message, self.file, tensor, offset))

    def warn(
        self, code: str, message: str, tensor: str | None = None, offset: int | None = None
    ) -> None:
        if self.strict:
            self._add(Problem("warning", code, message, self.file, tensor, offset))


def _metadata_problem(value: Any) -> str | None:
    """Why ``__metadata__`` is not a string-to-string map (None or a map of strings is fine)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "invalid type for __metadata__, expected a map"
    for key, item in _pairs(value):
        if not isinstance(item, str):
            return f"invalid type for key {key!r}: {type(item).__name__}, expected a string"
    return None


class _KeyOffsets:
    """File offsets of the header's top-level keys, for locating header problems.

    Built once, on first use, by one pass over the top-level object (keys decoded as JSON, so
    escaped names are found, and never a match inside metadata or a tensor's fields); a search
    per problem re-read the text before each match, which made validating a header with tens of
    thousands of reportable names take minutes.
    """

    def __init__(self, text: str) -> None:
        self._text = text
        self._offsets: dict[str, int] | None = None

    def __call__(self, name: str) -> int | None:
        if self._offsets is None:
            self._offsets = self._scan()
        return self._offsets.get(name)

    def _scan(self) -> dict[str, int]:
        text = self._text
        offsets: dict[str, int] = {}
        done_chars, done_bytes = 0, 0  # bytes of text[:done_chars], advanced as keys are found
        for key, start, _, _ in top_level_members(text):
            done_bytes += len(text[done_chars:start].encode("utf-8", "surrogatepass"))
            done_chars = start
            offsets.setdefault(key, N_LEN + done_bytes)
        return offsets


def _check_header(col: _Collector, header: bytes, data_size: int) -> list[_Entry] | None:
    """Rules R4-R8 on the header bytes, collecting every problem. Returns the usable entries.

    The verdict is always the strict parser's: the lenient walk only adds detail. If the strict
    parser accepts the header, any error the walk believes it found is dropped; if it refuses
    the header and the walk missed the reason, the strict parser's error is reported.
    """
    gate: HeaderError | None = None
    try:
        parse_header(header, data_size, prefix_text="")
    except HeaderError as exc:
        gate = exc
    walk = _Collector(col.file, strict=col.strict)
    entries: list[_Entry] | None
    try:
        entries = _walk_header(walk, header, data_size)
    except Exception:  # noqa: BLE001 - the gate's verdict stands even if the walk trips
        entries = None
    errors = [p for p in walk.problems if p.severity == "error"]
    if gate is None:
        col.problems.extend(p for p in walk.problems if p.severity != "error")
        return entries
    words = str(gate).removesuffix(f" (tensor `{gate.tensor}`)")  # as the walk's
    reason = Problem("error", gate.kind, words, col.file, gate.tensor, gate.offset)
    if entries is None:
        # The walk gave up on the whole header (not UTF-8, not JSON, not a map): the reader's
        # words say why, with where ("expected a map" said less, and said it twice).
        col.problems.extend(p for p in walk.problems if p.severity != "error")
        col.problems.append(reason)
        return None
    # The reader's reason, unless the walk reported it (the same code, about the same tensor
    # or the whole header; the two word it differently). Problems only the strict parser sees
    # are always added: another error of their code, elsewhere or in the same tensor, hid them.
    # (In the reader's words without the tensor's name, which may hold them too.)
    bare = words if gate.tensor is None else words.replace(f"`{gate.tensor}`", "")
    # What only the strict parser refuses in a header the walk decodes (serde's).
    strict_only = any(kind in bare for kind in PARSE_ONLY_WORDS)
    if strict_only or not any(
        p.code == gate.kind and gate.tensor in (None, p.tensor) for p in errors
    ):
        col.problems.append(reason)
    col.problems.extend(walk.problems)
    return entries


def _pairs(obj: Any) -> list[tuple[str, Any]]:
    """Every ``(key, value)`` of a decoded object in document order, repeated keys included."""
    pairs = getattr(obj, "pairs", None)
    return list(pairs()) if callable(pairs) else list(obj.items())


def _walk_header(col: _Collector, header: bytes, data_size: int) -> list[_Entry] | None:
    data_start = N_LEN + len(header)
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as exc:
        col.error(
            "InvalidHeader",
            f"invalid UTF-8 in header at byte {exc.start} of the header",
            offset=N_LEN + exc.start,
        )
        return None
    try:
        obj = decode_json(text, "")
    except HeaderError as exc:
        col.error(exc.kind, str(exc), offset=exc.offset)
        return None
    if not isinstance(obj, dict):
        col.error(
            "InvalidHeaderDeserialization", "invalid JSON in header: expected a map", offset=N_LEN
        )
        return None
    key_offset = _KeyOffsets(text)
    pairs = _pairs(obj)
    counts: dict[str, int] = {}
    for key, _ in pairs:
        counts[key] = counts.get(key, 0) + 1
    if counts.get("__metadata__", 0) > 1:
        col.error(
            "InvalidHeaderDeserialization",
            "invalid JSON in header: duplicate field `__metadata__`",
            offset=key_offset("__metadata__"),
        )
    for name in sorted(k for k, n in counts.items() if n > 1 and k != "__metadata__"):
        col.warn(
            "DuplicateTensorName",
            f"tensor name {name!r} appears {counts[name]} times; readers keep the last entry",
            tensor=name,
            offset=key_offset(name),
        )
    if text[:1] in (" ", "\t", "\r", "\n"):
        col.warn(
            "LeadingWhitespace",
            "whitespace before the opening `{` (the reference reads it; the spec text and older "
            "readers require `{` first)",
            offset=N_LEN,
        )

    metadata: dict[str, str] | None = None
    parsed: dict[str, _Entry] = {}
    # Entries whose offsets are lost (missing, or not two integers): their bytes may be any
    # hole or the trailing bytes, so those are not reported besides the entry's own error.
    unplaced = False
    for name, value in pairs:
        if name == "__metadata__":
            bad = _metadata_problem(value)
            if bad:
                col.error(
                    "InvalidHeaderDeserialization",
                    f"invalid JSON in header: {bad} (in __metadata__)",
                    offset=key_offset(name),
                )
            elif value is not None:
                metadata = dict(value)
            continue
        try:
            dtype, shape, (begin, end) = parse_entry(name, value, "")
        except HeaderError as exc:
            message = str(exc).removesuffix(f" (tensor `{name}`)")
            col.error(exc.kind, message, tensor=name, offset=key_offset(name))
            offsets = _salvaged_offsets(value)
            if offsets is not None:
                # Its bytes are still its own: counted as plain bytes (U8, a size its offsets
                # always match) by the coverage walk and the index check, so that an unknown
                # dtype is one problem, not also trailing bytes or a tensor missing from its
                # shard. Not ok: no value checks.
                begin, end = offsets
                size = max(0, end - begin)
                parsed[name] = _Entry(name, _PLAIN_BYTES, (size,), begin, end, ok=False)
            else:
                unplaced = True
            continue
        # A repeated name: the last entry wins, as in the reference.
        parsed[name] = _Entry(name, dtype, tuple(shape), begin, end)
    entries = list(parsed.values())
    for e in entries:
        name = e.name
        if _CONTROL.search(name):
            col.warn(
                "SuspiciousName",
                "tensor name contains control or bidirectional-override characters",
                tensor=name,
                offset=key_offset(name),
            )

    # R6/R7: the same walk as the strict parser, but a failure is recorded and the walk goes on
    # from the furthest byte covered so far.
    def where_in_data(pos: int, name: str) -> int | None:
        # A byte of the file where there is one; an offset past its end (a header may say
        # 2^64 - 1) would be no place to look, so the tensor's key in the header instead.
        return data_start + pos if pos <= data_size else key_offset(name)

    entries.sort(key=lambda e: (e.begin, e.end, e.name))
    running = 0
    previous: str | None = None
    for e in entries:
        where = f"data_offsets [{e.begin}, {e.end}]"
        if e.end < e.begin:
            col.error(
                "InvalidOffset",
                f"invalid offset: {where} ends before it begins",
                tensor=e.name,
                offset=where_in_data(e.begin, e.name),
            )
            e.ok = False
            continue
        if e.begin > running and not unplaced:
            col.error(
                "InvalidOffset",
                f"invalid offset: {where} leaves a hole of {e.begin - running} bytes after "
                + (f"tensor {previous!r}" if previous is not None else "the start of the data"),
                tensor=e.name,
                offset=where_in_data(running, e.name),
            )
            e.ok = False
        elif e.begin < running:
            col.error(
                "InvalidOffset",
                f"invalid offset: {where} overlaps the previous tensor {previous!r}, which ends "
                f"at {running}",
                tensor=e.name,
                offset=where_in_data(e.begin, e.name),
            )
            e.ok = False
        nbits = checked_nbits(e.shape, e.dtype)
        if nbits is None:
            col.error(
                "ValidationOverflow",
                f"overflow computing buffer size from shape and/or element type "
                f"({e.dtype.code} {list(e.shape)})",
                tensor=e.name,
                offset=where_in_data(e.begin, e.name),
            )
            e.ok = False
        elif nbits % 8:
            col.error(
                "MisalignedSlice",
                f"{e.dtype.code} {list(e.shape)} is {nbits} bits, not a whole number of bytes",
                tensor=e.name,
                offset=where_in_data(e.begin, e.name),
            )
            e.ok = False
        elif e.end - e.begin != nbits // 8:
            col.error(
                "TensorInvalidInfo",
                f"invalid shape, data type, or offset: {e.dtype.code} {list(e.shape)} needs "
                f"{nbits // 8} bytes but {where} span {e.end - e.begin}",
                tensor=e.name,
                offset=where_in_data(e.begin, e.name),
            )
            e.ok = False
        if e.end > running:
            running, previous = e.end, e.name
    if running > data_size or (running < data_size and not unplaced):
        what = "trailing bytes" if data_size > running else "missing bytes"
        col.error(
            "MetadataIncompleteBuffer",
            f"incomplete metadata, file not fully covered: tensors cover {running} bytes of data "
            f"but the file holds {data_size} ({what})",
            offset=data_start + min(running, data_size),
        )

    if col.strict:
        if metadata is None or "format" not in metadata:
            col.warn(
                "MissingFormat",
                "no `format` in __metadata__; transformers, accelerate and the hub's loaders "
                "expect one of pt, tf, flax, mlx",
                offset=N_LEN,
            )
        elif metadata["format"] not in KNOWN_FORMATS:
            col.warn(
                "UnknownFormat",
                f"__metadata__ format {metadata['format']!r} is not one the hub's loaders accept "
                "(pt, tf, flax, mlx)",
                offset=N_LEN,
            )
        if len(header) % 8:
            col.warn(
                "UnalignedDataBuffer",
                f"header length {len(header)} is not a multiple of 8, so the data buffer "
                f"starts at file offset {data_start}, not 8-byte aligned",
                offset=0,
            )
        if len(header) > HUB_MAX_HEADER_SIZE:
            col.warn(
                "HeaderOverHubLimit",
                f"header is {len(header)} bytes; huggingface_hub refuses headers over "
                f"{HUB_MAX_HEADER_SIZE}",
                offset=0,
            )
        for e in entries:
            size = e.dtype.bits // 8
            if e.ok and e.dtype.bits % 8 == 0 and size > 1 and (data_start + e.begin) % size:
                col.warn(
                    "Unaligned",
                    f"{e.dtype.code} tensor starts at file offset {data_start + e.begin}, not a "
                    f"multiple of its {size}-byte element size (zero-copy loaders must copy it)",
                    tensor=e.name,
                    offset=data_start + e.begin,
                )
    return entries


def iter_tensor_chunks(
    source: ByteSource,
    start: int,
    nbytes: int,
    chunk_bytes: int = CHUNK_BYTES,
    *,
    reuse: bool = False,
    buffer: np.ndarray | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Read ``nbytes`` at ``start`` in chunks; yields ``(file_offset, uint8 array)``.

    Each chunk is fresh memory, or with ``reuse`` the same buffer each time (valid until the
    next chunk is asked for; fresh pages cost a fault each, ~10% of checking a chunk), or
    ``buffer`` (a flat uint8 array, chunks cut to its size): the caller's, for one buffer
    through many tensors (a buffer per tensor, the previous one's last chunk still held while
    the next was made, doubled the memory of ``hash`` and ``validate --strict``).
    ``chunk_bytes`` should be a multiple of 24 so that no element is split between chunks.
    """
    pos = 0
    buf: np.ndarray | None = buffer
    if buffer is not None:
        reuse = True
        chunk_bytes = min(chunk_bytes, buffer.size)
    while pos < nbytes:
        n = min(chunk_bytes, nbytes - pos)
        if buf is None or not reuse:
            buf = np.empty(n, np.uint8)
        chunk = buf[:n]
        source.readinto(start + pos, chunk.data)
        yield start + pos, chunk
        pos += n


#: Float dtypes whose NaN and Inf are exactly the values with every exponent bit set: the
#: unsigned view of an element, the mask of its bits but the sign, and the smallest masked
#: value that is not finite. A chunk whose largest masked element is below that is all
#: finite, which one mask and one max tell ~5x faster than isnan and isinf (BF16 elements go
#: through ml_dtypes' conversion for those: ~0.6 GB/s). Others (the FP8 formats without Inf
#: or with a NaN of their own, F4, F6) take the exact path only.
_NONFINITE_BITS: Final[dict[str, tuple[type[np.unsignedinteger[Any]], int, int]]] = {
    "F8_E5M2": (np.uint8, 0x7F, 0x7C),
    "F16": (np.uint16, 0x7FFF, 0x7C00),
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    "C64": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),  # two F32 each
    "F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def _all_finite(code: str, raw: np.ndarray, scratch: list[np.ndarray]) -> bool:
    """Whether a chunk of a ``code`` tensor surely holds no NaN or Inf (False: look closer).

    ``scratch`` holds the buffer of the masked elements from one call to the next.
    """
    bits = _NONFINITE_BITS.get(code)
    if bits is None:
        return False
    kind, mask, first_nonfinite = bits
    elements = raw.view(kind)
    if not scratch or scratch[0].dtype != elements.dtype or scratch[0].size < elements.size:
        scratch[:] = [np.empty(elements.size, elements.dtype)]
    masked = np.bitwise_and(elements, kind(mask), out=scratch[0][: elements.size])
    return bool(masked.max() < first_nonfinite)


def _float_view(dtype: DType, raw: np.ndarray) -> np.ndarray | None:
    """The chunk as float values to scan for NaN/Inf, or None for non-float dtypes (BF16
    widened by its bits: the same NaN and Inf, without importing ml_dtypes)."""
    if not dtype.is_float:
        return None
    from ._adapter import chunk_values_widened

    return chunk_values_widened(dtype, raw)


def _check_values(
    col: _Collector,
    source: ByteSource,
    data_start: int,
    entries: Sequence[_Entry],
    progress: Callable[[int], None] | None,
) -> None:
    """Strict value checks: NaN/Inf in float tensors, BOOL bytes other than 0/1."""
    checked = [
        e
        for e in entries
        if e.ok and e.end > e.begin and (e.dtype.is_float or e.dtype.code == "BOOL")
    ]
    if progress is not None:
        # The header and the tensors not read count as done at once, so that a valid file's
        # counts add up to its size (the total a caller can know without parsing it).
        progress(
            data_start
            + sum(e.end - e.begin for e in entries)
            - sum(e.end - e.begin for e in checked)
        )
    # Tensors in file order, each read in chunks (runs of small ones at once): over a URL a
    # request per read, unless the reads are planned into few large ones.
    planned = plan_reads(source, [(data_start + e.begin, data_start + e.end) for e in checked])
    try:
        _check_tensors(col, planned or source, data_start, checked, progress)
    finally:
        if planned is not None:
            planned.close()


def _check_tensors(
    col: _Collector,
    source: ByteSource,
    data_start: int,
    checked: Sequence[_Entry],
    progress: Callable[[int], None] | None,
) -> None:
    # One read buffer for every tensor, and the values looked at in sub-chunks of ~1 MiB, so
    # that the masks (NaN, Inf, a widened BF16 copy) stay ~1 MiB each: 48 -> 24 MiB in all.
    runs = list(_adjacent_runs(checked))
    buffer = np.empty(
        min(CHUNK_BYTES, max((r[-1].end - r[0].begin for r in runs), default=0)), np.uint8
    )
    scratch: list[np.ndarray] = []
    for run in runs:
        if len(run) == 1:
            e = run[0]
            chunks = iter_tensor_chunks(
                source, data_start + e.begin, e.end - e.begin, buffer=buffer
            )
            _check_tensor(col, e, _sub_chunks(chunks), progress, scratch)
            continue
        # Small tensors of one dtype one after another (a MoE's experts, a LoRA's adapters):
        # one read and one test for all of them, where a read and a test each cost 100,000
        # tensors most of `validate --strict`'s time. Each is looked at alone only if the run
        # holds a value to report (as one sub-chunk, as it would be on its own).
        first = run[0]
        span = buffer[: run[-1].end - first.begin]
        assert span.size == run[-1].end - first.begin  # runs fit the buffer (_adjacent_runs)
        source.readinto(data_start + first.begin, span.data)
        if _clean(first.dtype, span, scratch):
            if progress is not None:
                progress(span.size)
            continue
        for e in run:
            piece = span[e.begin - first.begin : e.end - first.begin]
            _check_tensor(col, e, [(data_start + e.begin, piece)], progress, scratch)


def _adjacent_runs(checked: Sequence[_Entry]) -> Iterator[list[_Entry]]:
    """``checked`` in order, as runs of tensors of one dtype that lie next to each other and
    each fit one sub-chunk, of at most :data:`_SUB_CHUNK_BYTES` in all (the memory the checks
    of a sub-chunk take) and at most a read (:data:`CHUNK_BYTES`, the read buffer's size at
    most), and lone tensors."""
    cap = min(_SUB_CHUNK_BYTES, CHUNK_BYTES)
    run: list[_Entry] = []
    size = 0
    for e in checked:
        n = e.end - e.begin
        if run and not (e.begin == run[-1].end and e.dtype == run[-1].dtype and size + n <= cap):
            yield run
            run, size = [], 0
        run.append(e)
        size += n
    if run:
        yield run


def _clean(dtype: DType, raw: np.ndarray, scratch: list[np.ndarray]) -> bool:
    """Whether a chunk of ``dtype`` values holds nothing to report: no NaN or Inf, or for
    BOOL no byte other than 0 and 1."""
    if dtype.code == "BOOL":
        return bool(raw.max() <= 1)
    if _all_finite(dtype.code, raw, scratch):
        return True
    values = _float_view(dtype, raw)  # the formats _all_finite does not know, or a NaN
    assert values is not None
    with np.errstate(invalid="ignore"):
        return not (np.isnan(values).any() or np.isinf(values).any())


def _check_tensor(
    col: _Collector,
    e: _Entry,
    chunks: Iterable[tuple[int, np.ndarray]],
    progress: Callable[[int], None] | None,
    scratch: list[np.ndarray],
) -> None:
    """Check one tensor's values, given as ``(file_offset, sub-chunk)`` pairs."""
    nan = inf = bad_bool = 0
    first: int | None = None
    element = max(1, e.dtype.bits // 8)
    for offset, raw in chunks:
        if _all_finite(e.dtype.code, raw, scratch):
            pass
        elif e.dtype.code == "BOOL":
            bad = np.flatnonzero(raw > 1)
            bad_bool += int(bad.size)
            if bad.size and first is None:
                first = offset + int(bad[0])
        else:
            values = _float_view(e.dtype, raw)
            assert values is not None
            # (C64: per complex element, NaN or Inf where a part is, as numpy counts.)
            with np.errstate(invalid="ignore"):
                isnan = np.isnan(values)
                isinf = np.isinf(values)
            nan += int(isnan.sum())
            inf += int(isinf.sum())
            if first is None and (nan or inf):
                idx = int(np.flatnonzero(isnan | isinf)[0])
                # Sub-byte elements have no byte offset of their own; report their byte.
                first = offset + (idx * e.dtype.bits // 8 if e.dtype.bits % 8 else idx * element)
        if progress is not None:
            progress(raw.size)
    if nan or inf:
        col.warn(
            "NonFinite",
            f"{e.dtype.code} tensor holds {nan} NaN and {inf} Inf values (first at file "
            f"offset {first})",
            tensor=e.name,
            offset=first,
        )
    if bad_bool:
        col.warn(
            "BoolNotZeroOne",
            f"BOOL tensor holds {bad_bool} bytes other than 0 and 1 (first at file offset {first})",
            tensor=e.name,
            offset=first,
        )


#: Bytes of a chunk looked at at a time by the value checks (a multiple of 24: no element
#: split between two).
_SUB_CHUNK_BYTES: Final = (1 << 20) - (1 << 20) % 24


def _sub_chunks(chunks: Iterable[tuple[int, np.ndarray]]) -> Iterator[tuple[int, np.ndarray]]:
    """Each ``(file_offset, uint8 array)`` chunk cut into views of at most
    :data:`_SUB_CHUNK_BYTES`."""
    for offset, raw in chunks:
        for at in range(0, raw.size, _SUB_CHUNK_BYTES):
            yield offset + at, raw[at : at + _SUB_CHUNK_BYTES]


def validate_source(
    source: ByteSource,
    *,
    file: str | None = None,
    strict: bool = False,
    check_values: bool | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    progress: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Check one safetensors file and return every problem found.

    Args:
        source: The file's bytes.
        file: Name to record in each problem (defaults to the source's name).
        strict: Add warnings (see the module docstring).
        check_values: Read the data to look for NaN/Inf; defaults to ``strict``.
        max_header_size: Largest header accepted (rule R2).
        progress: Called with byte counts as the file is read for value checks (the header's
            first): a valid file's add up to its size.

    Returns:
        Problems in the order found: errors and, with ``strict``, warnings.
    """
    return _validate_source(
        source,
        file if file is not None else source.name,
        strict,
        strict if check_values is None else check_values,
        max_header_size,
        progress,
    )[0]


def _validate_source(
    source: ByteSource,
    file: str,
    strict: bool,
    check_values: bool,
    max_header_size: int,
    progress: Callable[[int], None] | None,
) -> tuple[list[Problem], list[_Entry] | None]:
    col = _Collector(file, strict=strict)
    size = source.size
    prefix = bytearray(min(size, N_LEN))
    source.readinto(0, memoryview(prefix))
    try:
        n = parse_header_length(
            bytes(prefix), size, max_header_size=max_header_size, prefix_text=""
        )
    except HeaderError as exc:
        col.error(exc.kind, str(exc), offset=exc.offset)
        return col.problems, None
    header = bytearray(n)
    if n:
        source.readinto(N_LEN, memoryview(header))
    entries = _check_header(col, bytes(header), size - N_LEN - n)
    # Values are read only from a structurally valid file: a truncated one would fail the reads
    # (and its format error, already reported, is the answer).
    valid = not any(p.severity == "error" for p in col.problems)
    if entries is not None and check_values and valid:
        _check_values(col, source, N_LEN + n, entries, progress)
    return col.problems, entries


# ------------------------------------------------------------------------------ sharded models


@dataclass(slots=True)
class ModelFiles:
    """Where the files of a model are: one file, or the shards named by an index."""

    target: str
    """What was asked for: a file, a folder, an index, or a URL."""
    files: list[str]
    """Paths or URLs of the safetensors files, in index order (first appearance)."""
    labels: list[str]
    """How to show each file: its name relative to the model folder (the path for one file)."""
    index_path: str | None = None
    """The index file, for sharded models."""
    index: dict[str, Any] | None = None
    """The index JSON, when it could be read."""
    weight_map: dict[str, str] | None = None
    """Tensor name to shard label, from the index."""
    refused: set[str] = field(default_factory=set)
    """Tensors the index lists with a shard name it cannot have (reported as problems)."""
    problems: list[Problem] = field(default_factory=list)
    """Errors met while locating the files (bad index, unsafe or missing shard names)."""

    @property
    def sharded(self) -> bool:
        """Whether the model is made of an index and shards (or several files)."""
        return self.index_path is not None or len(self.files) > 1


def open_model_file(path: str, storage_options: Mapping[str, Any] | None = None) -> ByteSource:
    """Open one file of a model for positioned reads: a URL through the remote sources (with
    ``storage_options``), a local path only if it is a regular file (:func:`open_regular_file`:
    a FIFO would block the open for ever).

    Raises:
        NotRegularFileError: A local path names a FIFO, socket or device.
        OSError: The file cannot be opened.
    """
    if looks_like_url(path):
        from ._reader import open_source_for

        return open_source_for(path, "pread", dict(storage_options or {}))
    fd = open_regular_file(path)
    try:
        return PreadSource(fd, path)
    except BaseException:
        os.close(fd)
        raise


def _read_small(
    target: str,
    limit: int,
    storage_options: Mapping[str, Any] | None,
    opened: ByteSource | None = None,
) -> bytes:
    """The bytes of the index ``target``; a URL's read through ``opened`` if given (then closed
    here)."""
    if looks_like_url(target):
        from ._remote import open_source

        if opened is None:
            opened = open_source(target, storage_options=storage_options)
        with contextlib.closing(opened) as src:
            if src.size > limit:
                raise _IndexTooLarge(f"index is {src.size} bytes, over the limit of {limit}")
            buf = bytearray(src.size)
            if src.size:
                src.readinto(0, memoryview(buf))
            return bytes(buf)
    with open(open_regular_file(target), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _IndexTooLarge(f"index is over the limit of {limit} bytes")
    return data


class _IndexTooLarge(SafetensorError):
    """An index over the size limit: a problem of the model (``IndexInvalid``), as any other
    unusable index, not a failure to run."""


def _join(base: str, name: str) -> str:
    """The shard ``name`` next to the index ``base``. For a URL, as ``safe_open`` resolves
    it: the index's query string (a signature, ``?download=true``) is not passed on."""
    if looks_like_url(base):
        return url_join(url_dirname(base), name)
    return os.path.join(os.path.dirname(base), name)


def locate_model(
    target: str | os.PathLike[str],
    *,
    max_index_size: int = MAX_HEADER_SIZE,
    storage_options: Mapping[str, Any] | None = None,
) -> ModelFiles:
    """Find the safetensors files of a file, folder, index or URL without opening them.

    Folders and URLs are resolved as ``safe_open`` resolves them
    (``_sharded.resolve_checkpoint``: ``model.safetensors.index.json``, ``model.safetensors``,
    a single index, a single file; a folder URL listed, or over HTTP tried for the first two).
    An index names its shards relative to itself; names that are absolute or contain ``..``
    are refused and recorded as problems rather than raised, so that ``validate`` can list
    them all. ``storage_options`` are used to read an index given by URL.

    Raises:
        FileNotFoundError: A folder (or folder URL) holds no checkpoint.
        SafetensorError: A folder holds several checkpoints and no rule picks one.
        RemoteError: A folder URL could not be listed or probed.
        ValueError: ``storage_options`` that cannot go to every shard of an index or folder
            URL (an S3 ``version_id``).
    """
    path = os.fspath(target)
    if looks_like_url(path) or os.path.isdir(path):
        # The same rules as safe_open(folder or URL), so every tool opens the same files. An
        # index URL is told as the reader tells it (is_index_path): by the path without query
        # string or fragment, and for s3:// by the whole key, where '?' and '#' are characters
        # of the name (cut at the '?', an index under such a key was read as a safetensors
        # file).
        from ._sharded import resolve_checkpoint

        resolved, is_index, opened = resolve_checkpoint(path, dict(storage_options or {}))
        if is_index:
            return _from_index(path, resolved, max_index_size, storage_options, opened)
        # The label is what messages and reports show: never a password or a signature.
        label = shown_location(path) if resolved == path else shown_name(resolved)
        return ModelFiles(path, [resolved], [label])
    if path.endswith(".index.json"):
        return _from_index(path, path, max_index_size)
    return ModelFiles(path, [path], [path])


def _from_index(
    target: str,
    index_path: str,
    limit: int,
    storage_options: Mapping[str, Any] | None = None,
    opened: ByteSource | None = None,
) -> ModelFiles:
    model = ModelFiles(target, [], [], index_path=index_path)
    label = shown_name(index_path)

    def bad(code: str, message: str, tensor: str | None = None) -> None:
        model.problems.append(Problem("error", code, message, label, tensor, None))

    try:
        # Decoded as the reader decodes it: strict UTF-8 (json.loads of bytes would also take
        # UTF-16/32 and a byte-order mark, which the reader refuses).
        obj = json.loads(_read_small(index_path, limit, storage_options, opened).decode("utf-8"))
    except _IndexTooLarge as exc:
        bad("IndexInvalid", str(exc))
        return model
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: arrays or objects nested deeper than the parser's recursion limit.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        bad("IndexInvalid", f"index is not valid JSON: {reason}")
        return model
    if not isinstance(obj, dict):
        bad("IndexInvalid", "index is not a JSON object")
        return model
    model.index = obj
    weight_map = obj.get("weight_map")
    if not isinstance(weight_map, dict):
        bad("IndexInvalid", "index has no `weight_map` object")
        return model
    meta = obj.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        bad("IndexInvalid", "index `metadata` is not an object")
    clean: dict[str, str] = {}
    normal: dict[str, str] = {}  # shard names as given -> as checked and normalised
    refused: set[str] = set()
    listed: set[str] = set()  # model.labels as a set: a list lookup per tensor was quadratic
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            bad(
                "IndexInvalid",
                f"weight_map value is {type(shard).__name__}, not a file name",
                tensor,
            )
            model.refused.add(tensor)
            continue
        if shard in refused:
            model.refused.add(tensor)
            continue
        if shard in normal:
            shard = normal[shard]
        else:
            # Each distinct name checked once (a million entries name a few hundred shards).
            why = unsafe_shard_name(shard)
            if why is not None:
                bad("UnsafeShardName", f"refusing shard name {shard!r}: {why}", tensor)
                refused.add(shard)
                model.refused.add(tensor)
                continue
            shard = normal[shard] = normal_shard_name(shard)
        clean[tensor] = shard
        if shard not in listed:
            listed.add(shard)
            model.labels.append(shard)
            model.files.append(_join(index_path, shard))
    model.weight_map = clean
    return model


def index_problems(
    model: ModelFiles, headers: dict[str, dict[str, tuple[int, int]] | None]
) -> list[Problem]:
    """The errors ``validate`` reports for an index against its shards' headers.

    For commands that open a sharded model and would otherwise trust whichever side they read
    (the shards' headers): a tensor the index places in the wrong shard, lists but no shard
    holds, or a shard holds but the index does not list.

    Args:
        model: What :func:`locate_model` found.
        headers: Shard label to ``{tensor: (begin, end)}``.
    """
    col = _Collector(model.index_path and shown_name(model.index_path), strict=False)
    if model.index_path is not None:
        _check_index(model, headers, col)
    return col.problems


def _check_index(
    model: ModelFiles, headers: dict[str, dict[str, tuple[int, int]] | None], col: _Collector
) -> None:
    """Cross-check an index against the shards' headers (``shard -> {tensor: (begin, end)}``)."""
    weight_map = model.weight_map or {}
    holders: dict[str, list[str]] = {}
    for shard, tensors in headers.items():
        for tensor in tensors or {}:
            holders.setdefault(tensor, []).append(shard)
    for tensor, shards in holders.items():
        if len(shards) > 1:
            col.error(
                "DuplicateTensor",
                f"tensor is stored in {len(shards)} files: {', '.join(shards)}",
                tensor=tensor,
            )
    if model.index_path is None:
        if model.sharded:
            col.warn("NoIndex", "several safetensors files but no *.safetensors.index.json")
        return
    if model.weight_map is None:
        return  # no weight_map to check against (an IndexInvalid problem already)
    for tensor, shard in weight_map.items():
        tensors = headers.get(shard)
        if tensors is None or tensor in tensors:
            continue
        elsewhere = holders.get(tensor)
        if elsewhere:
            col.error(
                "IndexWrongShard",
                f"the index places this tensor in {shard!r} but it is in {', '.join(elsewhere)}",
                tensor=tensor,
            )
        else:
            col.error(
                "IndexTensorMissing",
                f"the index places this tensor in {shard!r}, which does not hold it",
                tensor=tensor,
            )
    for tensor, shards in holders.items():
        # A tensor listed with a refused shard name is listed (its problem is that name).
        if tensor not in weight_map and tensor not in model.refused:
            col.error(
                "IndexTensorUnlisted",
                f"{', '.join(shards)} holds this tensor but the index does not list it",
                tensor=tensor,
            )
    meta = (model.index or {}).get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    sizes = {
        tensor: end - begin
        for tensors in headers.values()
        for tensor, (begin, end) in (tensors or {}).items()
    }
    if total is None:
        col.warn("IndexNoTotalSize", "index metadata has no `total_size`")
    elif all(h is not None for h in headers.values()):
        # Each listed tensor counts where it is held, in whichever shard. Where the index and
        # the shards name different tensors (reported above) the right total is unknown, but
        # bounded: at least the listed tensors that exist, at most those and the unlisted
        # ones (no bound when a listed tensor is missing). Only a total outside that range is
        # a problem of its own, not a repeat of the ones above.
        low = sum(n for t, n in sizes.items() if t in weight_map)
        unlisted = sum(n for t, n in sizes.items() if t not in weight_map)
        # A tensor listed with a refused shard name counts as missing: held or not, the
        # total may count it, so there is no upper bound.
        missing = bool(model.refused) or any(t not in sizes for t in weight_map)
        declared = declared_total_size(total)
        if declared is None or declared < low or (not missing and declared > low + unlisted):
            if missing:
                held = f"at least {low} bytes"
            elif unlisted:
                held = f"{low} bytes ({low + unlisted} with the unlisted ones)"
            else:
                held = f"{low} bytes"
            # A warning, counted by --strict as the reader's validate() refuses it: the
            # checkpoint loads (no loader reads total_size), and older transformers releases
            # (shard_checkpoint) wrote totals that count a bool as 1/8 of a byte.
            col.warn(
                "IndexTotalSize",
                f"index total_size is {total!r} but the listed tensors hold {held}",
            )
    if model.index_path is not None and not looks_like_url(model.index_path):
        folder = os.path.dirname(model.index_path)
        listed = set(model.labels)
        for name in sorted(os.listdir(folder or ".")):
            if name.endswith(".safetensors") and name not in listed:
                col.warn("StrayShard", f"{name!r} is in the folder but not in the index")


def _close_source(source: ByteSource | None) -> None:
    if source is not None:
        source.close()


def validate(
    target: str | os.PathLike[str],
    *,
    strict: bool = False,
    check_values: bool | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    progress: Callable[[int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Problem]:
    """Check a file, a sharded model (folder or index) or a URL; return every problem found.

    Args:
        target: Path, folder, ``*.safetensors.index.json`` or ``http(s)://`` URL.
        strict: Add warnings (NaN/Inf, alignment, ``format`` metadata, ...).
        check_values: Read tensor data for the value checks; defaults to ``strict``.
        max_header_size: Largest header accepted.
        progress: Called with byte counts as files are read for value checks (each header
            first): a valid model's add up to the sizes of its files.
        storage_options: For a URL: options of the remote source (``headers``, ``timeout``,
            ``endpoint_url``...), for the index and every shard, as for ``safe_open``.

    Returns:
        Every problem; an empty list means the target is valid.

    Raises:
        OSError: The target (not one of its shards) cannot be opened.
        SafetensorError: A folder holds several indexes.

    Example:
        >>> for p in validate("model.safetensors", strict=True):  # doctest: +SKIP
        ...     print(p.severity, p.code, p.tensor, p.offset, p.message)
    """
    model = locate_model(target, storage_options=storage_options)
    problems = list(model.problems)
    headers: dict[str, dict[str, tuple[int, int]] | None] = {}
    col = _Collector(model.index_path and shown_name(model.index_path), strict=strict)

    def open_one(item: tuple[str, str]) -> ByteSource | None:
        path = item[0]
        if model.sharded and not looks_like_url(path) and os.path.isdir(path):
            return None
        return open_model_file(path, storage_options)

    # The shards of a URL opened a few at once, handed over in order.
    opens = in_order(
        open_one,
        list(zip(model.files, model.labels, strict=True)),
        discard=lambda _, source: _close_source(source),
        ahead=ahead_for(model.files),
    )
    with contextlib.closing(opens):
        for (_, label), opened in opens:
            try:
                source = opened.result()
            except FileNotFoundError:
                if not model.sharded:
                    raise
                problems.append(Problem("error", "ShardMissing", "shard file not found", label))
                headers[label] = None
                continue
            except NotRegularFileError as exc:
                if not model.sharded:
                    raise
                problems.append(Problem("error", "ShardMissing", f"shard is {exc.strerror}", label))
                headers[label] = None
                continue
            if source is None:
                # A folder where the index names a shard: a problem of the model, not a
                # failure to run (opening a folder for reading succeeds on Linux; reading
                # it fails).
                problems.append(
                    Problem("error", "ShardMissing", "shard path is a folder, not a file", label)
                )
                headers[label] = None
                continue
            try:
                found, entries = _validate_source(
                    source,
                    label,
                    strict,
                    strict if check_values is None else check_values,
                    max_header_size,
                    progress,
                )
                problems.extend(found)
                headers[label] = (
                    None if entries is None else {e.name: (e.begin, e.end) for e in entries}
                )
            finally:
                source.close()
    if model.sharded:
        _check_index(model, headers, col)
    problems.extend(col.problems)
    return problems
