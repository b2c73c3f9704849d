"""Planning a file for a save: tensor order, offsets and the header bytes. Pure: no I/O.

The reading side, with the file layout, is :mod:`._format`.

Rules W1-W6 (the output is byte-identical to the reference's)
=============================================================

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

import contextlib
import json
import math
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._dtypes import UINT64_MAX, DType, checked_nbits
from ._errors import SerializeError, not_an_instance
from ._format import MAX_HEADER_SIZE, SERIALIZE_PREFIX, TensorInfo

__all__ = ["Layout", "build_layout", "check_metadata"]


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


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    """A copy of the metadata to write, checked as the reference checks its ``metadata``
    argument (a mapping of str to str, or None), in its words."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise not_an_instance("metadata", metadata, "dict")
    out: dict[str, str] = {}
    for key, value in metadata.items():
        for item in (key, value):
            if not isinstance(item, str):
                raise not_an_instance("metadata", item)
            # A lone surrogate: the reference's UnicodeEncodeError, placed in this string (not
            # in the whole header, as encoding the header would place it).
            item.encode("utf-8")
        out[key] = value
    return out


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise not_an_instance("tensor_dict", name, detail=f"(tensor name {name!r})")
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


def _check_unicode_names(specs: Iterable[tuple[str, DType, Sequence[int]]]) -> None:
    """Raise for a tensor name that is not valid Unicode among ``specs``. The reference reads
    every name before it looks at the metadata or for a tensor named ``__metadata__``: such a
    name is the error it reports first. Called only on the way to another error, so that
    saves that succeed encode each name once."""
    for name, _, _ in specs:
        if isinstance(name, str) and name != "__metadata__":
            _check_name(name)


#: ``build_layout``'s sort key: its items start with the negated rank, then the name.
_RANK_AND_NAME: Final = operator.itemgetter(0, 1)


def _checked_shape(name: Any, shape: Iterable[Any]) -> tuple[int, ...]:
    """A tensor's shape to write, as ints, refusing dimensions no reader accepts.

    Raises:
        SerializeError: A dimension is negative, or 2^64 or more.
    """
    shape_t = tuple(map(int, shape))
    # One min/max instead of two generator scans: ~20k tensors (an MoE) add up.
    if shape_t and min(shape_t) < 0:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor `{name}` has a negative dimension {list(shape_t)}",
            kind="TensorInvalidInfo",
            tensor=str(name),
        )
    if shape_t and max(shape_t) > UINT64_MAX:
        # A zero-size tensor passes the size checks with any dimension, but a reader
        # refuses a dimension that is not a u64 (found by fuzzing the streaming writer).
        raise SerializeError(
            f"{SERIALIZE_PREFIX}tensor `{name}` has a dimension of 2^64 or more {list(shape_t)}",
            kind="ValidationOverflow",
            tensor=str(name),
        )
    return shape_t


def _checked_nbytes(name: str, dtype: DType, shape: tuple[int, ...]) -> int:
    """The bytes a tensor takes, checked as the reference checks them.

    Raises:
        SerializeError: The size overflows 64 bits, or is not whole bytes.
    """
    # The product of positive dimensions never shrinks, so when it (times the width) fits
    # in 64 bits no step of the reference's left-to-right checked product overflowed;
    # only shapes with a 0 or a huge product take the step-by-step check.
    count = math.prod(shape)
    product = count * dtype.bits
    nbits = product if count and product <= UINT64_MAX else checked_nbits(shape, dtype)
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
    return nbits // 8


#: A str as JSON, not ASCII-escaped: what ``json.dumps(text, ensure_ascii=False)`` gives.
_json_string: Final = json.encoder.encode_basestring


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
    try:
        meta = check_metadata(metadata)
    except (TypeError, UnicodeEncodeError):
        _check_unicode_names(specs)
        raise
    # Sort keys first (rank descending, then name): itemgetter sorts in C, where a key
    # function was a Python call per tensor.
    items: list[tuple[int, str, DType, tuple[int, ...]]] = []
    # Shapes already converted and checked: checkpoints repeat a handful of shapes, and an MoE
    # of 20,000 tensors paid the conversion and both bounds per tensor (equal shapes convert
    # alike: int() of each dimension).
    checked: dict[Any, tuple[int, ...]] = {}
    for name, dtype, shape in specs:
        try:
            shape_t = checked.get(shape)
        except TypeError:  # a list, or unhashable dimensions: converted each time
            shape_t = None
        if shape_t is None:
            shape_t = _checked_shape(name, shape)
            with contextlib.suppress(TypeError):  # unhashable: not remembered
                checked[shape] = shape_t
        if type(name) is not str or not name.isascii() or name == "__metadata__":
            # isascii() is a flag lookup: other names need none of _check_name's tests.
            if name == "__metadata__":
                _check_unicode_names(specs)  # the rest of them (all of a list), before this
            _check_name(name)
        items.append((-dtype.rank, name, dtype, shape_t))
    items.sort(key=_RANK_AND_NAME)

    tensors: list[TensorInfo] = []
    # The header's JSON is put together entry by entry, byte for byte what json.dumps of the
    # whole object with compact separators gives (pinned against the reference's files by the
    # tests), at a fraction of the cost of building the object first for 20,000 tensors.
    parts: list[str] = []
    # The metadata encoded on its own: a value of one non-ASCII character makes the whole
    # string two or four bytes a character, and joined with the tensors' entries it was that
    # large twice before encoding (a 20 MB value peaked at 200 MiB, now 120).
    meta_json = b""
    if meta is not None:
        text = json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
        meta_json = text.encode("utf-8")
        del text
    seen: set[str] = set()
    offset = 0
    new_info = tuple.__new__  # straight from C, as in the reader (a Python frame per entry)
    # Per (shape, dtype): the JSON of the dims and the byte count, worked out once.
    sized: dict[tuple[tuple[int, ...], str], tuple[str, int]] = {}
    for _, name, dtype, shape in items:
        if name in seen:
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor name `{name}` appears twice",
                kind="DuplicateName",
                tensor=name,
            )
        known = sized.get((shape, dtype.code))
        if known is None:
            known = sized[(shape, dtype.code)] = (
                ",".join(map(str, shape)),
                _checked_nbytes(name, dtype, shape),
            )
        dims, nbytes = known
        end = offset + nbytes
        if end > UINT64_MAX:
            # Each tensor's size fits, their sum does not: offsets no reader can parse (a
            # streaming writer then failed with a bare OverflowError making its file).
            raise SerializeError(
                f"{SERIALIZE_PREFIX}overflow computing the data offsets: tensor `{name}` "
                f"({dtype.code} {list(shape)}) would end at byte {end} of the data, past 2^64-1",
                kind="ValidationOverflow",
                tensor=name,
            )
        seen.add(name)
        parts.append(
            f'{_json_string(name)}:{{"dtype":"{dtype.code}","shape":[{dims}],'
            f'"data_offsets":[{offset},{end}]}}'
        )
        tensors.append(new_info(TensorInfo, (name, dtype, shape, offset, end)))
        offset = end

    # The entries joined and encoded once, then one copy into the header: a header of
    # 100,000 tensors (10 MB) or a 20 MB metadata value was copied three more times on the
    # way (braces, padding, length), each a whole header of memory and time.
    body = ",".join(parts).encode("utf-8")
    del parts
    pieces = [b"{"]
    if meta is not None:
        pieces += [b'"__metadata__":', meta_json, b"," if body else b""]
    pieces += [body, b"}"]
    unpadded = sum(map(len, pieces))
    padding = -unpadded % 8
    size = unpadded + padding
    if size > max_header_size:
        raise SerializeError(
            f"{SERIALIZE_PREFIX}header too large ({size} bytes; the limit is {max_header_size})",
            kind="HeaderTooLarge",
        )
    header = b"".join([struct.pack("<Q", size), *pieces, b" " * padding])
    return Layout(header=header, tensors=tuple(tensors))
