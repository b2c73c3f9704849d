"""The safetensors format: parsing and building headers. Pure: no I/O, no numpy.

Layout
======

A file is ``[N: u64 little-endian][N bytes: UTF-8 JSON header][data buffer]``. ``N`` counts the
whole header region including padding; the data buffer starts at byte ``8 + N``. Every tensor
entry's ``data_offsets: [BEGIN, END]`` is relative to the data buffer, ``END`` exclusive. Tensor
bytes are little-endian, row-major and packed.

Reading (rules R1-R8, in this order; the first failing rule decides the error)
==============================================================================

R1  A file shorter than 8 bytes MUST be refused (``HeaderTooSmall``).
R2  ``N`` MUST NOT exceed ``max_header_size`` (100,000,000 by default; exactly the limit is
    accepted) (``HeaderTooLarge``).
R3  ``8 + N`` MUST NOT exceed the file size (``InvalidHeaderLength``).
R4  The header MUST be valid UTF-8 (``InvalidHeader``). A BOM is not stripped.
R5  The header MUST be JSON as serde_json reads it into the reference's struct
    (``InvalidHeaderDeserialization``): one object, optionally surrounded by JSON whitespace
    (space, tab, LF, CR); no NaN/Infinity; no lone surrogate escapes; no raw control characters
    in strings; nesting below serde_json's recursion limit. ``__metadata__`` MAY be absent or
    null, else MUST be an object of strings and MUST NOT appear twice. Every other key is a
    tensor whose entry MUST have ``dtype`` (one of the 22 codes), ``shape`` (array of integers in
    ``[0, 2**64)``; ``-0``, floats and booleans are not integers) and ``data_offsets`` (exactly two
    such integers), each at most once; unknown fields are ignored. Duplicate tensor names: the
    last one wins. (The reference also accepts an entry written as the array
    ``[dtype, shape, data_offsets]`` and a dtype written as ``{"F32": null}``; so do we.)
R6  Tensors are sorted by ``(begin, end)``. For each, in that order: ``begin`` MUST equal the
    previous ``end`` (0 for the first) and ``end >= begin`` (``InvalidOffset``).
R7  Then, for the same tensor: the element count times the dtype's bit size MUST fit in 64 bits,
    folded left to right (``ValidationOverflow``); MUST be a multiple of 8
    (``MisalignedSlice``); and divided by 8 MUST equal ``end - begin`` (``TensorInvalidInfo``).
R8  The last ``end`` MUST equal the data buffer's length: no trailing bytes, nothing missing
    (``MetadataIncompleteBuffer``).

Writing (rules W1-W6; the output is byte-identical to the reference's)
=======================================================================

W1  Tensors MUST be ordered by dtype rank descending (see ``_dtypes``), then name ascending by
    code point.
W2  Offsets are assigned consecutively from 0 in that order, with no padding between tensors.
W3  The header object holds ``__metadata__`` first (only when metadata is given; ``{}`` is written
    as ``{}``), then the tensors in data order, each with fields ``dtype, shape, data_offsets``.
    Metadata keeps the caller's order (the reference's order is random).
W4  JSON is compact (``separators=(",", ":")``) and not ASCII-escaped.
W5  The JSON is padded with spaces (0x20) to a multiple of 8 bytes; ``N`` is the padded length.
W6  A padded header over ``max_header_size`` MUST be refused. A tensor named ``__metadata__``
    MUST be refused (the reference writes it and then cannot read the file).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._dtypes import UINT64_MAX, DType, checked_nbits, dtype_from_code
from ._errors import (
    HeaderDecodeError,
    HeaderSizeError,
    OffsetError,
    SafetensorError,
    SerializeError,
    TensorInfoError,
)

__all__ = [
    "DESERIALIZE_PREFIX",
    "HEADER_PREFIX",
    "MAX_HEADER_SIZE",
    "N_LEN",
    "SERIALIZE_PREFIX",
    "Header",
    "Layout",
    "TensorInfo",
    "build_layout",
    "parse_header",
    "parse_header_length",
]

N_LEN: Final = 8
#: Why a cap at all: the header is parsed into memory in full, so an attacker-chosen length must
#: not decide how much we allocate. 100,000,000 is the reference's value (decimal, not MiB).
MAX_HEADER_SIZE: Final = 100_000_000

#: Prefixes the reference puts before messages, by entry point.
HEADER_PREFIX: Final = "Error while deserializing header: "
DESERIALIZE_PREFIX: Final = "Error while deserializing: "
SERIALIZE_PREFIX: Final = "Error while serializing: "

# serde_json's recursion limit: it fails when entering the 128th nested array/object.
_MAX_DEPTH: Final = 127


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One validated header entry."""

    name: str
    """Tensor name."""
    dtype: DType
    """Element type."""
    shape: tuple[int, ...]
    """Logical shape (for F4/F6 the element count, not the packed byte count)."""
    begin: int
    """Start offset in the data buffer."""
    end: int
    """End offset (exclusive) in the data buffer."""

    @property
    def nbytes(self) -> int:
        """Byte length of the tensor's data."""
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed and validated header."""

    tensors: dict[str, TensorInfo]
    """Entries in data-offset (file) order."""
    metadata: dict[str, str] | None
    """``__metadata__``; None when absent or null."""
    header_size: int
    """N, the length of the header region including padding."""

    @property
    def data_start(self) -> int:
        """File offset of the data buffer."""
        return N_LEN + self.header_size

    @property
    def data_size(self) -> int:
        """Length of the data buffer."""
        last = next(reversed(self.tensors.values()), None)
        return last.end if last is not None else 0


@dataclass(frozen=True, slots=True)
class Layout:
    """What a writer emits: the full header region and where each tensor goes."""

    header: bytes
    """The 8-byte length prefix followed by the padded JSON header."""
    tensors: tuple[TensorInfo, ...]
    """Entries in data order, with offsets relative to the data buffer."""

    @property
    def data_size(self) -> int:
        """Length of the data buffer."""
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        """Length of the whole file."""
        return len(self.header) + self.data_size


# --------------------------------------------------------------------------------------- reading


def parse_header_length(
    prefix: bytes,
    file_size: int,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
    prefix_text: str = HEADER_PREFIX,
) -> int:
    """Check rules R1-R3 and return N, the header length.

    Args:
        prefix: The first 8 bytes of the file (fewer if the file is shorter).
        file_size: Size of the whole file in bytes.
        max_header_size: Largest N accepted.
        prefix_text: Text put before error messages.

    Raises:
        HeaderSizeError: The file is too small or N is out of bounds.
    """
    if file_size < N_LEN or len(prefix) < N_LEN:
        raise HeaderSizeError(
            f"{prefix_text}header too small (file is {file_size} bytes; the length prefix "
            f"alone needs {N_LEN})",
            kind="HeaderTooSmall",
            offset=0,
        )
    (n,) = struct.unpack("<Q", prefix[:N_LEN])
    if n > max_header_size:
        raise HeaderSizeError(
            f"{prefix_text}header too large (the length prefix declares {n} bytes; the limit is "
            f"{max_header_size}, raise it with max_header_size= if the file is trusted)",
            kind="HeaderTooLarge",
            offset=0,
        )
    if N_LEN + n > file_size:
        raise HeaderSizeError(
            f"{prefix_text}invalid header length (the length prefix declares {n} bytes of "
            f"header but the file has only {file_size - N_LEN} after the prefix)",
            kind="InvalidHeaderLength",
            offset=0,
        )
    return int(n)


class _Obj(dict[str, Any]):
    """A JSON object that remembers which keys appeared more than once."""

    __slots__ = ("dups",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.dups: frozenset[str] = frozenset()
        if len(self) != len(pairs):
            seen: set[str] = set()
            dups = set()
            for key, _ in pairs:
                if key in seen:
                    dups.add(key)
                seen.add(key)
            self.dups = frozenset(dups)


class _NotInt:
    """A JSON number that serde_json reads as a float (``1.0``, ``1e1``, ``-0``)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _int_or_marker(text: str) -> Any:
    # serde_json parses "-0" as the float -0.0, so it is not an integer there.
    return _NotInt(text) if text == "-0" else int(text)


_DECODER: Final = json.JSONDecoder(
    object_pairs_hook=_Obj, parse_float=_NotInt, parse_constant=_reject_constant
)
_DECODER_SLOW: Final = json.JSONDecoder(
    object_pairs_hook=_Obj,
    parse_float=_NotInt,
    parse_int=_int_or_marker,
    parse_constant=_reject_constant,
)
# Cheap pre-checks that decide whether the slower, exact paths are needed at all.
_MAYBE_NEG_ZERO: Final = re.compile(r"-0(?![0-9.eE])")
_MAYBE_SURROGATE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _decode_error(prefix_text: str, detail: str, tensor: str | None = None) -> HeaderDecodeError:
    return HeaderDecodeError(
        f"{prefix_text}invalid JSON in header: {detail}",
        kind="InvalidHeaderDeserialization",
        tensor=tensor,
        offset=N_LEN,
    )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, _NotInt):
        return f"floating point `{value.text}`"
    if isinstance(value, str):
        return f"string {json.dumps(value, ensure_ascii=False)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def _u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= UINT64_MAX


def _depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (scalars are 0)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def _decode_json(text: str, prefix_text: str) -> Any:
    decoder = _DECODER_SLOW if _MAYBE_NEG_ZERO.search(text) else _DECODER
    try:
        obj = decoder.decode(text)
    except json.JSONDecodeError as exc:
        raise _decode_error(
            prefix_text, f"{exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})"
        ) from None
    except ValueError as exc:
        raise _decode_error(prefix_text, str(exc)) from None
    except RecursionError:
        raise _decode_error(prefix_text, "recursion limit exceeded") from None
    if _MAYBE_SURROGATE.search(text) and _has_surrogate(obj):
        raise _decode_error(prefix_text, "lone leading or trailing surrogate in hex escape")
    return obj


def _parse_dtype(value: Any, name: str, prefix_text: str) -> DType:
    code = value
    # serde's externally tagged form of a unit variant: {"F32": null}.
    if isinstance(value, dict) and len(value) == 1:
        ((code, inner),) = value.items()
        if inner is not None:
            raise _decode_error(prefix_text, f"tensor {name!r}: invalid dtype {value!r}", name)
    if not isinstance(code, str):
        raise _decode_error(
            prefix_text,
            f"tensor {name!r}: invalid type: {_describe(value)}, expected a dtype string",
            name,
        )
    try:
        return dtype_from_code(code)
    except SafetensorError:
        raise _decode_error(
            prefix_text,
            f"tensor {name!r}: unknown variant `{code}`, expected one of the 22 dtype codes",
            name,
        ) from None


def _parse_ints(value: Any, name: str, field: str, prefix_text: str, length: int | None) -> list[int]:
    if not isinstance(value, list):
        raise _decode_error(
            prefix_text,
            f"tensor {name!r}: invalid type: {_describe(value)}, expected an array for {field}",
            name,
        )
    for item in value:
        if not _u64(item):
            raise _decode_error(
                prefix_text,
                f"tensor {name!r}: invalid value in {field}: {_describe(item)}, expected an "
                "integer in [0, 2^64)",
                name,
            )
    if length is not None and len(value) != length:
        raise _decode_error(
            prefix_text,
            f"tensor {name!r}: invalid length {len(value)} for {field}, expected {length} elements",
            name,
        )
    return value


_FIELDS: Final = ("dtype", "shape", "data_offsets")


def _parse_entry(name: str, value: Any, prefix_text: str) -> tuple[DType, list[int], list[int]]:
    if isinstance(value, list):
        # serde accepts a struct given as a sequence of its fields in declaration order.
        if len(value) != 3:
            raise _decode_error(
                prefix_text,
                f"tensor {name!r}: invalid length {len(value)}, expected struct TensorInfo "
                "with 3 elements",
                name,
            )
        fields = dict(zip(_FIELDS, value))
        extra: list[Any] = []
    elif isinstance(value, dict):
        assert isinstance(value, _Obj)
        for field in _FIELDS:
            if field in value.dups:
                raise _decode_error(prefix_text, f"tensor {name!r}: duplicate field `{field}`", name)
        fields = value
        extra = [v for k, v in value.items() if k not in _FIELDS]
    else:
        raise _decode_error(
            prefix_text,
            f"tensor {name!r}: invalid type: {_describe(value)}, expected struct TensorInfo",
            name,
        )
    for field in _FIELDS:
        if field not in fields:
            raise _decode_error(prefix_text, f"tensor {name!r}: missing field `{field}`", name)
    # Unknown fields are ignored, but serde still parses them under its recursion limit;
    # the top-level object and the entry account for two levels.
    for item in extra:
        if 2 + _depth(item) > _MAX_DEPTH:
            raise _decode_error(prefix_text, "recursion limit exceeded", name)
    dtype = _parse_dtype(fields["dtype"], name, prefix_text)
    shape = _parse_ints(fields["shape"], name, "shape", prefix_text, None)
    offsets = _parse_ints(fields["data_offsets"], name, "data_offsets", prefix_text, 2)
    return dtype, shape, offsets


def _parse_metadata(value: Any, prefix_text: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _decode_error(
            prefix_text, f"__metadata__: invalid type: {_describe(value)}, expected a map"
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise _decode_error(
                prefix_text,
                f"__metadata__[{key!r}]: invalid type: {_describe(item)}, expected a string",
            )
    return dict(value)


def parse_header(
    header: bytes | memoryview,
    data_size: int,
    *,
    prefix_text: str = HEADER_PREFIX,
) -> Header:
    """Check rules R4-R8 on a header region and return the validated header.

    Args:
        header: The N bytes after the length prefix.
        data_size: Length of the data buffer (file size minus 8 minus N).
        prefix_text: Text put before error messages.

    Raises:
        HeaderDecodeError: R4/R5 fail.
        OffsetError: R6 or R8 fail.
        TensorInfoError: R7 fails.
    """
    try:
        text = bytes(header).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderDecodeError(
            f"{prefix_text}invalid UTF-8 in header: invalid utf-8 sequence of 1 bytes from "
            f"index {exc.start} (file offset {N_LEN + exc.start})",
            kind="InvalidHeader",
            offset=N_LEN + exc.start,
        ) from None
    obj = _decode_json(text, prefix_text)
    if not isinstance(obj, dict):
        raise _decode_error(prefix_text, f"invalid type: {_describe(obj)}, expected a map")
    assert isinstance(obj, _Obj)
    if "__metadata__" in obj.dups:
        raise _decode_error(prefix_text, "duplicate field `__metadata__`")

    metadata: dict[str, str] | None = None
    entries: list[tuple[int, int, str, DType, list[int]]] = []
    for name, value in obj.items():
        if name == "__metadata__":
            metadata = _parse_metadata(value, prefix_text)
            continue
        dtype, shape, (begin, end) = _parse_entry(name, value, prefix_text)
        entries.append((begin, end, name, dtype, shape))

    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    data_start = N_LEN + len(header)
    tensors: dict[str, TensorInfo] = {}
    running = 0
    for begin, end, name, dtype, shape in entries:
        if begin != running or end < begin:
            why = (
                f"end {end} is before begin {begin}"
                if end < begin
                else f"it begins at {begin} but the previous tensor ends at {running}"
            )
            raise OffsetError(
                f"{prefix_text}invalid offset for tensor `{name}` (data_offsets [{begin}, {end}]: "
                f"{why}; file offset {data_start + min(begin, running)})",
                kind="InvalidOffset",
                tensor=name,
                offset=data_start + min(begin, running),
            )
        nbits = checked_nbits(shape, dtype)
        if nbits is None:
            raise TensorInfoError(
                f"{prefix_text}overflow computing buffer size from shape and/or element type "
                f"(tensor `{name}`: {dtype.code} {shape})",
                kind="ValidationOverflow",
                tensor=name,
                offset=data_start + begin,
            )
        if nbits % 8:
            raise TensorInfoError(
                f"{prefix_text}The slice is slicing for subbytes dtypes, and the slice does not "
                f"end up at a byte boundary, this is invalid. (tensor `{name}`: {dtype.code} "
                f"{shape} is {nbits} bits)",
                kind="MisalignedSlice",
                tensor=name,
                offset=data_start + begin,
            )
        if end - begin != nbits // 8:
            raise TensorInfoError(
                f"{prefix_text}invalid shape, data type, or offset for tensor `{name}` "
                f"({dtype.code} {shape} needs {nbits // 8} bytes but data_offsets "
                f"[{begin}, {end}] span {end - begin}; file offset {data_start + begin})",
                kind="TensorInvalidInfo",
                tensor=name,
                offset=data_start + begin,
            )
        running = end
        tensors[name] = TensorInfo(name, dtype, tuple(shape), begin, end)

    if running != data_size:
        raise OffsetError(
            f"{prefix_text}incomplete metadata, file not fully covered (tensors cover "
            f"{running} bytes of data but the file holds {data_size}: "
            f"{'trailing bytes' if data_size > running else 'missing bytes'} at file offset "
            f"{data_start + min(running, data_size)})",
            kind="MetadataIncompleteBuffer",
            offset=data_start + min(running, data_size),
        )
    return Header(tensors=tensors, metadata=metadata, header_size=len(header))


# --------------------------------------------------------------------------------------- writing


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"argument 'metadata': '{type(metadata).__name__}' object cannot be converted to 'PyDict'"
        )
    out: dict[str, str] = {}
    for key, value in metadata.items():
        for item in (key, value):
            if not isinstance(item, str):
                raise TypeError(
                    f"argument 'metadata': '{type(item).__name__}' object is not an instance of "
                    "'str'"
                )
        out[key] = value
    return out


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__}: {name!r}")
    if name == "__metadata__":
        raise SerializeError(
            f"{SERIALIZE_PREFIX}a tensor cannot be named `__metadata__`: the name is reserved "
            "for the metadata entry and no reader could load the file",
            kind="ReservedName",
            tensor=name,
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor name {name!r} is not valid Unicode (lone surrogate)",
            kind="InvalidName",
            tensor=name,
        ) from None
    return name


def build_layout(
    specs: Iterable[tuple[str, DType, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> Layout:
    """Plan a file: order tensors, assign offsets and build the header bytes (rules W1-W6).

    Args:
        specs: ``(name, dtype, shape)`` for every tensor, in any order.
        metadata: ``__metadata__`` (str to str), or None to omit it.
        max_header_size: Largest padded header accepted.

    Returns:
        The layout; its ``header`` is the exact prefix of the file.

    Raises:
        SerializeError: A name is reserved or repeated, a size is not whole bytes, or the
            header is too large.
        TypeError: Names or metadata are not strings.
    """
    meta = _check_metadata(metadata)
    items: list[tuple[str, DType, tuple[int, ...]]] = []
    for name, dtype, shape in specs:
        shape_t = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape_t):
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` has a negative dimension {list(shape_t)}",
                kind="TensorInvalidInfo",
                tensor=str(name),
            )
        items.append((_check_name(name), dtype, shape_t))
    items.sort(key=lambda it: (-it[1].rank, it[0]))

    tensors: list[TensorInfo] = []
    obj: dict[str, Any] = {}
    if meta is not None:
        obj["__metadata__"] = meta
    offset = 0
    for name, dtype, shape in items:
        if name in obj:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor name `{name}` appears twice",
                kind="DuplicateName",
                tensor=name,
            )
        nbits = checked_nbits(shape, dtype)
        if nbits is None:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}overflow computing buffer size from shape and/or element "
                f"type (tensor `{name}`: {dtype.code} {list(shape)})",
                kind="ValidationOverflow",
                tensor=name,
            )
        if nbits % 8:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}The slice is slicing for subbytes dtypes, and the slice does "
                f"not end up at a byte boundary, this is invalid. (tensor `{name}`: "
                f"{dtype.code} {list(shape)} is {nbits} bits)",
                kind="MisalignedSlice",
                tensor=name,
            )
        end = offset + nbits // 8
        obj[name] = {"dtype": dtype.code, "shape": list(shape), "data_offsets": [offset, end]}
        tensors.append(TensorInfo(name, dtype, shape, offset, end))
        offset = end

    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > max_header_size:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}header too large ({len(text)} bytes; the limit is "
            f"{max_header_size})",
            kind="HeaderTooLarge",
        )
    return Layout(header=struct.pack("<Q", len(text)) + text, tensors=tuple(tensors))
