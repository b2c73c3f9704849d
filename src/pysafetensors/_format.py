"""The safetensors format: the file layout and parsing headers. Pure: no I/O, no numpy.

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
    (space, tab, LF, CR); no NaN/Infinity; no number beyond f64 range as serde_json computes it
    (even in ignored fields); no lone surrogate escapes; no raw control characters in strings;
    at most 127 nested arrays/objects. ``__metadata__`` MAY be absent or null, else MUST be an
    object of strings and MUST NOT appear twice. Every other key is a tensor whose entry MUST
    have ``dtype`` (one of the 22 codes), ``shape`` (array of integers in ``[0, 2**64)``;
    ``-0``, floats and booleans are not integers) and ``data_offsets`` (exactly two such
    integers), each at most once; unknown fields are ignored. Duplicate tensor names and
    metadata keys: the last one wins, but every occurrence must be valid. As in serde,
    ``__metadata__`` is checked where it stands, tensor entries after the whole object is read.
    (The reference also accepts an entry written as the array ``[dtype, shape, data_offsets]``
    and a dtype written as ``{"F32": null}``; so do we.)
R6  Tensors are sorted by ``(begin, end)``. For each, in that order: ``begin`` MUST equal the
    previous ``end`` (0 for the first) and ``end >= begin`` (``InvalidOffset``).
R7  Then, for the same tensor: the element count times the dtype's bit size MUST fit in 64 bits,
    folded left to right (``ValidationOverflow``); MUST be a multiple of 8
    (``MisalignedSlice``); and divided by 8 MUST equal ``end - begin`` (``TensorInvalidInfo``).
R8  The last ``end`` MUST equal the data buffer's length: no trailing bytes, nothing missing
    (``MetadataIncompleteBuffer``).

Writing (rules W1-W6) is :mod:`._layout`'s.
"""

from __future__ import annotations

import gc
import json
import math
import operator
import re
import struct
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import accumulate, repeat
from typing import Any, Final, NamedTuple

from ._dtypes import BY_CODE, DTYPES, UINT64_MAX, DType, checked_nbits, dtype_from_code
from ._errors import (
    HeaderDecodeError,
    HeaderSizeError,
    OffsetError,
    SafetensorError,
    TensorInfoError,
)
from ._serde_json import (
    MAYBE_NEG_ZERO,
    MAYBE_SURROGATE,
    JsonObject,
    all_u64,
    big_int_problem,
    decoder_for,
    is_u64,
    reject_constant,
    scan_value,
    serde_syntax_message,
    surrogate_message,
    unexpected,
)
from ._serde_syntax import (
    OUT_OF_RANGE,
    RECURSION_LIMIT,
    WALK_LIMIT,
    SyntaxErrorAt,
    first_syntax_error,
    position_of_index,
)

__all__ = [
    "DESERIALIZE_PREFIX",
    "HEADER_PREFIX",
    "MAX_HEADER_SIZE",
    "N_LEN",
    "SERIALIZE_PREFIX",
    "Header",
    "TensorInfo",
    "decode_json",
    "parse_entry",
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


class TensorInfo(NamedTuple):
    """One validated header entry.

    A named tuple rather than a dataclass: headers can hold millions of entries, and a tuple is
    built several times faster, which matters for opening large headers.
    """

    name: str
    dtype: DType
    #: Logical shape (for F4/F6 the element count, not the packed byte count).
    shape: tuple[int, ...]
    #: Start offset in the data buffer.
    begin: int
    #: End offset (exclusive) in the data buffer.
    end: int

    @property
    def nbytes(self) -> int:
        """Byte length of the tensor's data."""
        return self.end - self.begin


class Header:
    """A parsed and validated header.

    Every rule is checked when the header is parsed; for a compact header (see
    ``_canonical_header``) only the per-entry :class:`TensorInfo` records are built later, on
    the first use of :attr:`tensors`: an open that only lists names (``keys()``) or reads the
    metadata never pays for them (a quarter of a 1,000-entry header's parse).
    """

    __slots__ = ("_build", "_data_size", "_names", "_tensors", "header_size", "metadata")

    #: ``__metadata__``; None when absent or null.
    metadata: dict[str, str] | None
    #: N, the length of the header region including padding.
    header_size: int

    def __init__(
        self,
        tensors: dict[str, TensorInfo],
        metadata: dict[str, str] | None,
        header_size: int,
    ) -> None:
        """A header whose entries are built already.

        Args:
            tensors: Entries in data-offset (file) order.
            metadata: ``__metadata__``; None when absent or null.
            header_size: N, the length of the header region including padding.
        """
        self._tensors: dict[str, TensorInfo] | None = tensors
        self._build: Callable[[], dict[str, TensorInfo]] | None = None
        self._names: Sequence[str] | None = None
        last = next(reversed(tensors.values()), None)
        self._data_size = last.end if last is not None else 0
        self.metadata = metadata
        self.header_size = header_size

    @classmethod
    def deferred(
        cls,
        names: Sequence[str],
        build: Callable[[], dict[str, TensorInfo]],
        data_size: int,
        metadata: dict[str, str] | None,
        header_size: int,
    ) -> Header:
        """A validated header whose entries ``build`` makes on first use.

        Args:
            names: The distinct entry names, in file order.
            build: Returns the entries (``{name: TensorInfo}`` in file order). Threads that
                race to be first may each call it, so it must be repeatable.
            data_size: Length of the data buffer the entries cover.
            metadata: ``__metadata__``; None when absent or null.
            header_size: N, the length of the header region including padding.
        """
        header = cls.__new__(cls)
        header._tensors = None
        header._build = build
        header._names = names
        header._data_size = data_size
        header.metadata = metadata
        header.header_size = header_size
        return header

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Entries in data-offset (file) order, built on first use and kept.

        A property, not ``__getattr__``, which would slow every attribute of the class (~40 ns
        a read against a plain attribute: under 1% of a ``get_tensor``).
        """
        tensors = self._tensors
        if tensors is not None:
            return tensors
        build = self._build
        if build is None:  # another thread stored them after this one's first look
            tensors = self._tensors
            assert tensors is not None
            return tensors
        with gc_paused():  # thousands of records that all survive (see gc_paused)
            tensors = build()
        # Racing threads build equal dicts; whichever is stored last is kept. Stored before
        # _build is cleared, so a thread that finds no builder finds the entries.
        self._tensors = tensors
        self._build = None
        return tensors

    @property
    def names(self) -> Collection[str]:
        """Entry names in data-offset (file) order, without building the entries."""
        names = self._names
        return names if names is not None else self.tensors.keys()

    @property
    def data_start(self) -> int:
        """File offset of the data buffer."""
        return N_LEN + self.header_size

    @property
    def data_size(self) -> int:
        """Length of the data buffer."""
        return self._data_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Header):
            return NotImplemented
        return (
            self.header_size == other.header_size
            and self.metadata == other.metadata
            and list(self.tensors.items()) == list(other.tensors.items())
        )

    __hash__ = None  # type: ignore[assignment]  # mutable contents, as the dataclass had

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled and copied as built entries: the builder is a closure over the parse.
        return (Header, (self.tensors, self.metadata, self.header_size))

    def __repr__(self) -> str:
        return (
            f"Header(tensors={self.tensors!r}, metadata={self.metadata!r}, "
            f"header_size={self.header_size!r})"
        )


# --------------------------------------------------------------------------------------- reading


def _other_format(prefix: bytes) -> str | None:
    """What a file whose first bytes are ``prefix`` looks like, where that is a format people
    mistake for safetensors (their first bytes make an absurd header length)."""
    convert = "; `pysafetensors convert` converts PyTorch checkpoints"
    # A zip's local-header signature (``_zip_directory.LOCAL_SIG``; the format layer imports
    # nothing that reads files).
    if prefix.startswith(b"PK\x03\x04"):
        return f"a zip archive, as torch.save writes them, not a safetensors file{convert}"
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return f"a pickle, as older torch.save writes them, not a safetensors file{convert}"
    if prefix.startswith(b"GGUF"):
        return "a GGUF file, not a safetensors file"
    return None


def check_max_header_size(value: Any) -> int:
    """``value`` as a header size limit: an integer of at least 0 (numpy's included).

    Checked where a reader is opened, so that a wrong limit is named as such instead of
    surfacing as Python's ``'>' not supported`` at the comparison, or as a fraction or a bool
    quoted back as "the limit" when a file is refused.

    Raises:
        TypeError: ``value`` is not an integer (a bool is not taken for one).
        ValueError: ``value`` is negative.
    """
    if isinstance(value, bool):
        raise TypeError(f"max_header_size must be an integer, not {value!r}")
    try:
        limit = operator.index(value)
    except TypeError:
        raise TypeError(f"max_header_size must be an integer, not {type(value).__name__}") from None
    if limit < 0:
        raise ValueError(f"max_header_size must be 0 or more, not {limit}")
    return limit


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
        other = _other_format(prefix)
        advice = (
            f"): the file starts like {other}"
            if other
            else ", raise it with max_header_size= if the file is trusted)"
        )
        raise HeaderSizeError(
            f"{prefix_text}header too large (the length prefix declares {n} bytes; the limit is "
            f"{max_header_size}{advice}",
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


def _decode_error(prefix_text: str, detail: str, tensor: str | None = None) -> HeaderDecodeError:
    where = f" (tensor `{tensor}`)" if tensor is not None else ""
    return HeaderDecodeError(
        f"{prefix_text}invalid JSON in header: {detail}{where}",
        kind="InvalidHeaderDeserialization",
        tensor=tensor,
        offset=N_LEN,
    )


class _TrailingCharacters(HeaderDecodeError):
    """The header's value is well formed but something follows it. serde deserializes the
    value before it looks past it, so a type error in the value comes first: ``value`` is it,
    for the caller to check before raising this."""

    value: Any = None

    def as_raised(self) -> HeaderDecodeError:
        """The same error as the public class users catch and compare types with."""
        return HeaderDecodeError(str(self), kind=self.kind, offset=self.offset)


def _serde_syntax_error(
    text: str, fallback: str, decoder: json.JSONDecoder, prefix_text: str
) -> HeaderDecodeError:
    """The error serde_json reports first for a header ``json`` found malformed: its syntax
    error, in its words and at its position (:mod:`_serde_syntax`), unless it would meet a
    type error first (it deserializes as it parses)."""
    if text.lstrip(" \t\n\r")[:1] == "[":
        # The top level is read as a map: a sequence is refused before it is parsed.
        return _top_level_type_error(text, [], prefix_text)
    raw = text.encode("utf-8", "surrogatepass")
    found = first_syntax_error(raw)
    if found is None:  # a header too large to walk (see WALK_LIMIT): Python's words
        return _decode_error(prefix_text, fallback)
    if found.message == "trailing characters":
        trailing = _TrailingCharacters(
            f"{prefix_text}invalid JSON in header: {found}",
            kind="InvalidHeaderDeserialization",
            offset=N_LEN,
        )
        start = len(text) - len(text.lstrip(" \t\n\r"))
        trailing.value = decoder.raw_decode(text, start)[0]
        return trailing
    return _walked_error(found, prefix_text)


#: Finds where a value ends, converting nothing (no number can fail in it).
_EXTENT_DECODER: Final = json.JSONDecoder(parse_float=str, parse_int=str, parse_constant=str)


def _top_level_type_error(text: str, value: Any, prefix_text: str) -> HeaderDecodeError:
    """serde's error for a header whose top-level value is no object, at serde's position: a
    sequence is refused at what it peeked (before the ``[``, nothing of it parsed), any other
    value once parsed (after its last byte)."""
    start = len(text) - len(text.lstrip(" \t\n\r"))
    end = start if isinstance(value, list) else _EXTENT_DECODER.raw_decode(text, start)[1]
    raw = text[:end].encode("utf-8", "surrogatepass")
    line, column = position_of_index(raw, len(raw))
    detail = unexpected(value, "struct HashMetadata")
    return _decode_error(prefix_text, f"{detail} at line {line} column {column}")


def _walked_error(
    found: SyntaxErrorAt, prefix_text: str, tensor: str | None = None
) -> HeaderDecodeError:
    """The error for serde's first problem as the walk found it, with its line and column: a
    syntax error, or a type error in ``__metadata__`` (deserialized where it stands, so it
    comes first), which also says it is in ``__metadata__``."""
    if found.typed:
        return _decode_error(prefix_text, f"{found} (in __metadata__)")
    return _decode_error(prefix_text, str(found), tensor)


def decode_json(text: str, prefix_text: str) -> Any:
    """Decode a header's JSON ``text`` as serde_json would, or raise its error text."""
    decoder = decoder_for(text)
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as exc:
        fallback = f"{serde_syntax_message(exc)} at line {exc.lineno} column {exc.colno}"
        raise _serde_syntax_error(text, fallback, decoder, prefix_text) from None
    except ValueError as exc:  # raised by our number and constant hooks
        detail = str(exc)
        if "integer string conversion" in detail:
            # Python refuses > 4300 digits; serde reads such a literal as an f64 and overflows.
            detail = OUT_OF_RANGE
        # NaN, Infinity, a number out of range, or a lone surrogate before them: serde's first
        # problem, where it places it.
        raise _serde_syntax_error(text, detail, decoder, prefix_text) from None
    except RecursionError:
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) <= WALK_LIMIT and first_syntax_error(raw) is None:
            # Nested no deeper than serde reads (the walk, which does not recurse, checks it):
            # json recurses once per level and met the caller's own depth (~870 frames). No
            # verdict on the file, which was refused as malformed: Python's error, as any code
            # that recursed there would meet. (A limit raised for the retry is the process's:
            # threads decoding at once pushed it up until the C stack overflowed.)
            raise RecursionError(
                "maximum recursion depth exceeded while decoding a header (the caller's stack "
                "is too deep; the header is nested no deeper than serde reads)"
            ) from None
        raise _serde_syntax_error(text, RECURSION_LIMIT, decoder, prefix_text) from None


_CODES: Final = frozenset(d.code for d in DTYPES)
_CODE_LIST: Final = ", ".join(f"`{d.code}`" for d in DTYPES)


def _scan_entry(value: Any, check_surrogates: bool) -> str | None:
    """:func:`scan_value` for one tensor entry, skipping what field parsing checks anyway.

    A plain entry holds only ``dtype``, ``shape`` and ``data_offsets``, whose values are
    type-checked later; walking them too would cost a second pass over large headers. Unknown
    fields, repeated fields, odd entries and (when the text has surrogate escapes) everything
    are walked.
    """
    if check_surrogates or not isinstance(value, JsonObject):
        return scan_value(value, check_surrogates, 1)
    if value.dup_pairs is None and value.keys() <= _FIELD_SET:
        return None
    # Unknown and repeated fields (the known ones are type-checked when the entry is parsed).
    for key, item in value.pairs():
        if key not in _FIELDS:
            problem = scan_value(item, False, 2)
            if problem:
                return problem
    return None


def _parse_dtype(value: Any) -> DType | str:
    """The dtype, or serde's message for why the value is not one."""
    code = value
    if isinstance(value, dict):
        # serde's externally tagged form of a unit variant: {"F32": null}. Its pairs are
        # counted, not its keys: {"F32": null, "F32": null} is two (refused there too).
        pairs = value.pairs() if isinstance(value, JsonObject) else list(value.items())
        if len(pairs) != 1:
            return "invalid value: map, expected map with a single key"
        ((code, inner),) = pairs
        if code in _CODES and inner is not None:
            return unexpected(inner, "unit")
    elif not isinstance(code, str):
        return unexpected(value, "string or map")
    try:
        return dtype_from_code(code)
    except SafetensorError:
        return f"unknown variant `{code}`, expected one of {_CODE_LIST}"


def _usize_problem(item: Any) -> str | None:
    if is_u64(item):
        return None
    if isinstance(item, (list, dict)):
        # serde buffered the whole entry first, so nesting too deep fails before the type.
        deep = scan_value(item, False, 3)
        if deep:
            return deep
    if type(item) is int:
        big = big_int_problem(item)
        if big:
            return f"{big}, expected usize" if big.startswith("invalid") else big
        return unexpected(item, "usize", invalid="value")
    return unexpected(item, "usize")


def _parse_shape(value: Any) -> list[int] | str:
    if not isinstance(value, list):
        return unexpected(value, "a sequence")
    for item in value:
        problem = _usize_problem(item)
        if problem:
            return problem
    return value


def _parse_offsets(value: Any) -> list[int] | str:
    # A (usize, usize) tuple: serde reads two elements, then complains about the length.
    if not isinstance(value, list):
        return unexpected(value, "a tuple of size 2")
    for item in value[:2]:
        problem = _usize_problem(item)
        if problem:
            return problem
    if len(value) < 2:
        return f"invalid length {len(value)}, expected a tuple of size 2"
    if len(value) > 2:
        return f"invalid length {len(value)}, expected 2 elements in sequence"
    return value


_FIELDS: Final = ("dtype", "shape", "data_offsets")
_FIELD_SET: Final = frozenset(_FIELDS)
_FIELD_PARSERS: Final = (_parse_dtype, _parse_shape, _parse_offsets)


def parse_entry(name: str, value: Any, prefix_text: str) -> tuple[DType, list[int], list[int]]:
    """Deserialize one tensor entry as serde's derived ``TensorInfo`` visitor would."""
    if type(value) is JsonObject and value.dup_pairs is None:
        # Fast path for the common, valid entry; anything unusual takes the exact path below,
        # which also produces serde's message.
        code = value.get("dtype")
        dtype = BY_CODE.get(code) if type(code) is str else None
        shape = value.get("shape")
        offsets = value.get("data_offsets")
        if (
            dtype is not None
            and type(shape) is list
            and type(offsets) is list
            and len(offsets) == 2
            and all_u64(shape)
            and all_u64(offsets)
        ):
            return dtype, shape, offsets
    found: dict[str, Any] = {}
    if isinstance(value, list):
        # serde accepts a struct given as a sequence of its fields in declaration order.
        for field, parser, item in zip(_FIELDS, _FIELD_PARSERS, value[:3], strict=False):
            parsed = parser(item)
            if isinstance(parsed, str):
                raise _decode_error(prefix_text, parsed, name)
            found[field] = parsed
        if len(value) < 3:
            raise _decode_error(
                prefix_text,
                f"invalid length {len(value)}, expected struct TensorInfo with 3 elements",
                name,
            )
        if len(value) > 3:
            raise _decode_error(
                prefix_text, f"invalid length {len(value)}, expected 3 elements in sequence", name
            )
    elif isinstance(value, JsonObject):
        # Fields are visited in document order: a repeated field fails when it is met again,
        # a bad value when it is met; unknown fields are skipped (their syntax was checked).
        for key, item in value.pairs():
            if key not in _FIELDS:
                continue
            if key in found:
                raise _decode_error(prefix_text, f"duplicate field `{key}`", name)
            parsed = _FIELD_PARSERS[_FIELDS.index(key)](item)
            if isinstance(parsed, str):
                raise _decode_error(prefix_text, parsed, name)
            found[key] = parsed
        for field in _FIELDS:
            if field not in found:
                raise _decode_error(prefix_text, f"missing field `{field}`", name)
    else:
        raise _decode_error(prefix_text, unexpected(value, "struct TensorInfo"), name)
    return found["dtype"], found["shape"], found["data_offsets"]


def _parse_metadata(value: Any, prefix_text: str, check_surrogates: bool) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, JsonObject):
        raise _decode_error(prefix_text, unexpected(value, "a map"))
    # serde reads __metadata__ as it streams: each key, then its value, in document order;
    # with repeated keys every value must be a string and the last one wins.
    for key, item in value.pairs():
        problem = surrogate_message(key) if check_surrogates else None
        if problem is None and not isinstance(item, str):
            problem = unexpected(item, "a string")
        if problem is None and check_surrogates:
            problem = surrogate_message(item)
        if problem:
            raise _decode_error(prefix_text, f"{problem} (in __metadata__)")
    return dict(value)


class gc_paused:  # noqa: N801 - used as a function: ``with gc_paused(): ...``
    """Pause the cyclic garbage collector while building many small acyclic objects.

    Parsing a header (and building one view per tensor) allocates thousands to millions of
    objects; every 700 allocations trigger a collection, which rescans the growing heap again
    and again (seconds for 500k tensors), and the first ones after ``import torch`` walk its
    whole object graph (~0.1 s each on a small VM). Nothing built here is cyclic garbage.

    A class rather than a ``contextlib.contextmanager`` generator: it is entered several times
    per call on short paths (a small tensor staged to a GPU went through five), and the
    generator's set-up cost ~1.5 us each time against ~0.3 us.

    Paused by raising the collector's first threshold, not by ``gc.disable()``: a program that
    disables the collector (or sets its thresholds) while a load runs in another thread keeps
    its choice, where ``gc.disable()``/``gc.enable()`` here turned the collector back on behind
    its back. The pause that raised the threshold puts it back on leaving, and only if it still
    holds the pause's value; a pause that finds it raised already (nested, or another thread's)
    leaves it alone. Threads racing to pause can at worst end another's pause early (a
    collection may then run inside it): never leave the threshold raised.
    """

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        now = gc.get_threshold()
        if now[0] == _GC_PAUSED:
            self._saved = None
        else:
            self._saved = now[0]
            gc.set_threshold(_GC_PAUSED, *now[1:])

    def __exit__(self, *_exc: object) -> None:
        if self._saved is not None:
            now = gc.get_threshold()
            if now[0] == _GC_PAUSED:  # else the program set its own meanwhile: kept
                gc.set_threshold(self._saved, *now[1:])


#: The first threshold while paused: no automatic collection of the youngest generation (the
#: one allocations set off) before this many allocations.
_GC_PAUSED: Final = 1 << 30


_JSON_WS: Final = re.compile(r"[ \t\n\r]*")


def top_level_members(text: str) -> Iterator[tuple[str, int, int, int]]:
    """The members of a header's top-level JSON object, in document order, by position.

    Yields ``(key, key_start, value_start, end)`` as character indices of ``text``: where the
    key's opening quote is, where its value begins, and where the whitespace after the value
    ends (at the ``,`` or ``}`` that follows). Keys are decoded (escapes resolved) and repeated
    ones yielded each time. Stops quietly where the text is not such an object, so a caller
    locating problems in a malformed header keeps what was found before them.
    """
    decoder = json.JSONDecoder()
    try:
        i = _JSON_WS.match(text).end()  # type: ignore[union-attr]
        if text[i] != "{":
            return
        i = _JSON_WS.match(text, i + 1).end()  # type: ignore[union-attr]
        while text[i] == '"':
            key_start = i
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _JSON_WS.match(text, i).end()  # type: ignore[union-attr]
            if text[i] != ":":
                return
            value_start = _JSON_WS.match(text, i + 1).end()  # type: ignore[union-attr]
            _, i = decoder.raw_decode(text, value_start)
            i = _JSON_WS.match(text, i).end()  # type: ignore[union-attr]
            yield key, key_start, value_start, i
            if text[i] != ",":
                return
            i = _JSON_WS.match(text, i + 1).end()  # type: ignore[union-attr]
    except (ValueError, IndexError, RecursionError):
        return


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
        # Rust's Utf8Error wording: the length of the bad sequence, or "incomplete" when the
        # header ends inside a character.
        what = (
            "incomplete utf-8 byte sequence"
            if exc.reason == "unexpected end of data"
            else f"invalid utf-8 sequence of {exc.end - exc.start} bytes"
        )
        raise HeaderDecodeError(
            f"{prefix_text}invalid UTF-8 in header: {what} from index {exc.start} "
            f"(file offset {N_LEN + exc.start})",
            kind="InvalidHeader",
            offset=N_LEN + exc.start,
        ) from None
    with gc_paused():
        return _parse_text(text, len(header), data_size, prefix_text)


# A key followed by whitespace before its colon: the fast path's key count cannot see it.
_SPACED_COLON: Final = re.compile(r'"[ \t\n\r]+:')


def _not_ordinary(_text: str) -> Any:
    # No ordinary header holds a float (shapes and offsets are integers, metadata strings):
    # stop decoding at the first one instead of building the rest for nothing.
    raise ValueError("a float")


_PLAIN_DECODER: Final = json.JSONDecoder(parse_float=_not_ordinary, parse_constant=reject_constant)
_GET_FIELDS: Final = operator.itemgetter("dtype", "shape", "data_offsets")


def _is_str_map(value: Any) -> bool:
    """A decoded ``__metadata__`` that the fast paths can take as is: a dict of strings."""
    return type(value) is dict and all(type(v) is str for v in value.values())


def _tensor_infos(
    names: Sequence[str],
    dtypes: Iterable[DType],
    shapes: Iterable[tuple[int, ...]],
    begins: Iterable[int],
    ends: Iterable[int],
) -> dict[str, TensorInfo]:
    """``{name: TensorInfo}`` from columns, in their order (repeated names: the last wins)."""
    # tuple.__new__ straight from C: TensorInfo._make would add a Python call per entry.
    infos = map(
        tuple.__new__, repeat(TensorInfo), zip(names, dtypes, shapes, begins, ends, strict=True)
    )
    return dict(zip(names, infos, strict=True))


def _fast_entries(
    text: str,
) -> tuple[dict[str, str] | None, dict[str, tuple[DType, list[int], list[int]]]] | None:
    """Parse an ordinary header with the C decoder alone, or return None.

    Ordinary means what writers produce: no repeated keys, no unknown fields, no odd forms,
    every value well typed. The exact path (``JsonObject`` pairs, serde's order and messages) is
    several times slower on large headers and only needed when something is unusual, so any
    doubt returns None and the caller takes it.

    Repeated keys are ruled out by counting: every key in the text is followed by ``":``
    (``_SPACED_COLON`` excludes the spaced form), and a string can only add more such
    sequences, never fewer. So if the text holds exactly as many ``":`` as the decoded objects
    hold keys, no key was repeated and nothing was dropped by the plain ``dict``.
    """
    if MAYBE_NEG_ZERO.search(text) or MAYBE_SURROGATE.search(text) or _SPACED_COLON.search(text):
        return None
    try:
        obj = _PLAIN_DECODER.decode(text)
    except (ValueError, RecursionError):
        return None
    if type(obj) is not dict:
        return None
    # Whether the key is there, not whether the text holds its spelling: a name ending in
    # \"__metadata__ holds that too, and counting it hid a repeated field.
    has_metadata = "__metadata__" in obj
    metadata = obj.pop("__metadata__", None)
    keys = len(obj) + 3 * len(obj)
    if metadata is not None:
        if not _is_str_map(metadata):
            return None
        keys += 1 + len(metadata)
    elif has_metadata:
        keys += 1  # written as null
    if text.count('":') != keys:
        return None
    values = list(obj.values())
    if set(map(type, values)) - {dict} or set(map(len, values)) - {3}:
        return None
    try:
        fields = list(map(_GET_FIELDS, values))
        dtypes = list(map(BY_CODE.get, [f[0] for f in fields]))
    except (KeyError, TypeError):  # a missing field, or an unhashable dtype value
        return None
    shapes = [f[1] for f in fields]
    offsets = [f[2] for f in fields]
    # filter(None, ...) tests identity-free truthiness in C; `None in dtypes` would call the
    # dataclass __eq__ once per entry.
    if len(list(filter(None, dtypes))) != len(dtypes):
        return None
    if set(map(type, shapes)) - {list} or set(map(type, offsets)) - {list}:
        return None
    if set(map(len, offsets)) != {2}:
        return None
    # Every number must be a plain int (bool is not) in [0, 2**64).
    for flat in ([x for s in shapes for x in s], [x for o in offsets for x in o]):
        if flat and (set(map(type, flat)) != {int} or min(flat) < 0 or max(flat) > UINT64_MAX):
            return None
    parsed = dict(zip(obj, zip(dtypes, shapes, offsets, strict=True), strict=True))
    return metadata, parsed


def _compile(pattern: str) -> re.Pattern[str]:
    """``re.compile``; before 3.11, which has no possessive quantifiers ("multiple repeat"),
    with them made greedy: each one here is followed by a character its class cannot match,
    so the greedy form matches the same text (and backtracks at most once per character)."""
    if sys.version_info < (3, 11):
        pattern = pattern.replace("}+", "}").replace("*+", "*").replace("++", "+")
    return re.compile(pattern)


# The compact form every mainstream writer emits (the reference, huggingface_hub, this
# library): ``{"name":{"dtype":"BF16","shape":[8,16],"data_offsets":[0,256]},...}`` with
# escape-free names, plain integers and space padding. Without escapes, every '"' in such a
# text delimits a string, so splitting it at '"' yields ten pieces an entry in fixed places
# (see _canonical_header): the structure is checked on whole columns of pieces in C, and
# only the names, the distinct shapes and the offsets need reading.
# At most 20 digits (u64's) in a shape: longer numbers are the generic path's to refuse, and
# int() of over 4,300 digits raises a plain ValueError.
_CANON_NUM: Final = r"(?:0|[1-9][0-9]{0,19}+)"
_CANON_SHAPE: Final = _compile(r":\[((?:" + _CANON_NUM + r"(?:," + _CANON_NUM + r")*+)?)\],")
# The offsets pieces of all entries joined by '"': ``:[0,256]},":[256,512]},...:[a,b]}}``
# (the last one closes the top-level object). Possessive quantifiers keep it linear-time.
_CANON_OFFSETS: Final = _compile(r'(?::\[[0-9]++,[0-9]++\]\},")*+:\[[0-9]++,[0-9]++\]\}\}')
#: The fixed pieces of an entry after its name: (place in the entry's ten, text).
_CANON_PIECES: Final = (
    (1, ":{"),
    (2, "dtype"),
    (3, ":"),
    (5, ","),
    (6, "shape"),
    (8, "data_offsets"),
)
#: Characters no JSON string may hold unescaped (U+0000 to U+001F), as UTF-8 bytes.
_CONTROL_BYTES: Final = bytes(range(0x20))
_CANON_META_PREFIX: Final = '{"__metadata__":'
#: A whole-byte dtype of each width, for the per-shape overflow check.
_WIDEST: Final = {d.bits: d for d in DTYPES if d.bits % 8 == 0}


def _canonical_header(text: str, header_size: int, data_size: int) -> Header | None:
    """Parse and validate a header in the writers' compact form, or return None.

    Large headers are almost always in this form, and for them the generic path's cost is the
    Python objects it builds (a dict and two lists per entry, then a pass per rule). Here the
    text is split at its quotes and the rules run on whole columns of the pieces, with
    per-shape caching. Anything unusual (escapes, other spacing, metadata not first, repeated
    names, zero-size tensors, entries not in offset order, any rule failing) returns None,
    and the generic path decides and words the error exactly as before.
    """
    metadata: dict[str, str] | None = None
    if "\\" in text:
        return None  # escapes: names and metadata need the exact path's rules
    if text.startswith(_CANON_META_PREFIX):
        try:
            meta, end = _PLAIN_DECODER.raw_decode(text, len(_CANON_META_PREFIX))
        except (ValueError, RecursionError):  # the generic path words both
            return None
        if meta is not None:
            if not _is_str_map(meta):
                return None
            # Repeated metadata keys: as in _fast_entries, the key count must match.
            if text.count('":', len(_CANON_META_PREFIX), end) != len(meta):
                return None
            metadata = meta
        if text[end : end + 1] != ",":
            return None
        text = "{" + text[end + 1 :]
    # With no backslash, every '"' opens or closes a string, and no string holds one. So the
    # pieces between quotes are, for "{" E ("," E)* "}" with E an entry in compact form:
    # "{", then per entry its name, ':{', 'dtype', ':', the dtype's code, ',', 'shape',
    # ':[dims],', 'data_offsets', and ':[begin,end]},' (the last entry's ending ']}}').
    # Checking every fixed piece, the codes, the shapes and the offsets below against those
    # exact texts proves the whole text is that form: the pieces rebuild it.
    pieces = text.rstrip(" ").split('"')
    if pieces[0] != "{" or (len(pieces) - 1) % 10:
        return None
    count = (len(pieces) - 1) // 10
    if not count:
        return None
    for place, fixed in _CANON_PIECES:
        if pieces[1 + place :: 10].count(fixed) != count:
            return None
    names = pieces[1::10]
    # A JSON string holds no raw control character; nothing else in a name needs checking.
    # (The UTF-8 form: one C pass, where a str scan would decode every character.)
    name_bytes = "".join(names).encode("utf-8")
    if len(name_bytes.translate(None, _CONTROL_BYTES)) != len(name_bytes):
        return None
    joined_offsets = '"'.join(pieces[10::10])
    if not _CANON_OFFSETS.fullmatch(joined_offsets):
        return None
    numbers = joined_offsets[2:-3].replace(']},":[', ",").split(",")
    begin_texts = numbers[0::2]
    end_texts = numbers[1::2]
    codes = pieces[5::10]
    shape_texts = pieces[8::10]
    # Contiguity on the digit strings (canonical integers are equal exactly when their texts
    # are), so only the ends need converting. Every other begin is an end, and no end may
    # have a leading zero: sizes are positive (checked below), so no end is 0 itself.
    if begin_texts[0] != "0" or begin_texts[1:] != end_texts[:-1]:
        return None
    if ",0" in "," + ",".join(end_texts):
        return None
    try:
        ends = list(map(int, end_texts))
    except ValueError:  # over 4,300 digits
        return None
    # Ends rise (positive sizes, below), so the last bounds them all: every one fits in u64.
    if ends[-1] != data_size:
        return None
    # Checkpoints repeat a handful of dtypes and shapes, so both are converted once each.
    dtype_of: dict[str, DType] = {}
    for code in set(codes):
        dtype = BY_CODE.get(code)
        if dtype is None or dtype.bits % 8:
            return None  # unknown (the exact path words the error) or sub-byte
        dtype_of[code] = dtype
    widest = max(d.bits for d in dtype_of.values())
    shape_of: dict[str, tuple[int, ...]] = {}
    elements_of: dict[str, int] = {}
    for shape_text in set(shape_texts):
        canonical = _CANON_SHAPE.fullmatch(shape_text)
        if not canonical:
            return None  # not canonical ("01", "1,,2", over 20 digits): the generic path's
        dims = canonical[1]
        shape = tuple(map(int, dims.split(","))) if dims else ()
        # checked_nbits with the widest dtype bounds every entry of this shape; zero-size
        # tensors are left to the generic path (ties in offsets need the name order).
        nbits = checked_nbits(shape, _WIDEST[widest])
        if not nbits:
            return None
        shape_of[shape_text] = shape
        elements_of[shape_text] = nbits // widest
    item_size = {code: dtype.bits // 8 for code, dtype in dtype_of.items()}
    sizes: Iterable[int]
    if len(item_size) == 1:
        # One dtype (most checkpoints): each shape's byte size once, one lookup an entry.
        (only_size,) = item_size.values()
        bytes_of = {text: elements * only_size for text, elements in elements_of.items()}
        sizes = map(bytes_of.__getitem__, shape_texts)
    else:
        sizes = map(
            operator.mul,
            map(elements_of.__getitem__, shape_texts),
            map(item_size.__getitem__, codes),
        )
    # Begins are the previous ends (checked above), so every size matches exactly when the
    # running sums of the sizes are the ends.
    if list(accumulate(sizes)) != ends:
        return None
    distinct = set(names)
    if len(distinct) != count or "__metadata__" in distinct:
        return None  # a repeated name (serde's last-wins order needs the exact path)

    def build() -> dict[str, TensorInfo]:
        return _tensor_infos(
            names,
            map(dtype_of.__getitem__, codes),
            map(shape_of.__getitem__, shape_texts),
            [0, *ends[:-1]],
            ends,
        )

    # Everything is checked; the records are built when first asked for (see Header).
    return Header.deferred(names, build, data_size, metadata, header_size)


def _parse_text(text: str, header_size: int, data_size: int, prefix_text: str) -> Header:
    canonical = _canonical_header(text, header_size, data_size)
    if canonical is not None:
        return canonical
    return _parse_generic(text, header_size, data_size, prefix_text)


def _parse_generic(text: str, header_size: int, data_size: int, prefix_text: str) -> Header:
    """Any header: the C decoder when nothing is unusual, else serde's rules step by step."""
    fast = _fast_entries(text)
    if fast is not None:
        return _check_entries(fast[0], fast[1], header_size, data_size, prefix_text)
    trailing: _TrailingCharacters | None = None
    try:
        obj = decode_json(text, prefix_text)
    except _TrailingCharacters as exc:
        obj, trailing = exc.value, exc
    if not isinstance(obj, JsonObject):
        if isinstance(obj, str) and MAYBE_SURROGATE.search(text):
            # serde parses a top-level string before refusing its type: a lone surrogate in
            # it is the error it meets first.
            found = first_syntax_error(text.encode("utf-8", "surrogatepass"))
            if found is not None and not found.typed and found.message != "trailing characters":
                raise _walked_error(found, prefix_text)
        raise _top_level_type_error(text, obj, prefix_text)
    check_surrogates = MAYBE_SURROGATE.search(text) is not None

    # Pass 1, as serde streams the top-level object: __metadata__ is deserialized where it
    # stands; every other entry is only parsed (buffered), which already refuses lone
    # surrogates and nesting past the recursion limit.
    try:
        metadata, raw = _stream_pass(obj, prefix_text, check_surrogates)
    except HeaderDecodeError as exc:
        raise _serde_first(text, exc, prefix_text) from None

    # Pass 2: the buffered entries become TensorInfo in document order (so an earlier entry
    # of a repeated name must be valid too), and the last entry of a name wins.
    parsed: dict[str, tuple[DType, list[int], list[int]]] = {}
    for name, value in raw:
        try:
            parsed[name] = parse_entry(name, value, prefix_text)
        except HeaderDecodeError:
            _raise_buffered_problem(raw, text, prefix_text, check_surrogates)
            raise
    if trailing is not None:
        raise trailing.as_raised()
    return _check_entries(metadata, parsed, header_size, data_size, prefix_text)


def _raise_buffered_problem(
    raw: list[tuple[str, Any]], text: str, prefix_text: str, check_surrogates: bool
) -> None:
    """Raise the first problem serde meets while buffering the entries, if any.

    serde buffers every entry before it converts any, so a number out of range or nesting
    past the limit anywhere in the document comes before any entry's type error. Pass 1 walks
    only unknown fields (:func:`_scan_entry`); on the way to a type error, every entry is
    walked whole, in document order.
    """
    for name, value in raw:
        problem = scan_value(value, check_surrogates, 1)
        if problem:
            raise _serde_first(text, _decode_error(prefix_text, problem, name), prefix_text)


def _stream_pass(
    obj: JsonObject, prefix_text: str, check_surrogates: bool
) -> tuple[dict[str, str] | None, list[tuple[str, Any]]]:
    """Pass 1 of :func:`_parse_generic`: ``(metadata, buffered entries)``."""
    metadata: dict[str, str] | None = None
    seen_metadata = False
    raw: list[tuple[str, Any]] = []
    for name, value in obj.pairs():
        problem = surrogate_message(name) if check_surrogates else None
        if problem:
            raise _decode_error(prefix_text, problem)
        if name == "__metadata__":
            if seen_metadata:
                raise _decode_error(prefix_text, "duplicate field `__metadata__`")
            seen_metadata = True
            metadata = _parse_metadata(value, prefix_text, check_surrogates)
            continue
        problem = _scan_entry(value, check_surrogates)
        if problem:
            raise _decode_error(prefix_text, problem, name)
        raw.append((name, value))
    return metadata, raw


def _serde_first(text: str, exc: HeaderDecodeError, prefix_text: str) -> HeaderDecodeError:
    """``exc`` (a problem pass 1 found while streaming the header) as serde words and places
    it: which of a lone surrogate's two messages applies, and where, needs its escapes."""
    found = first_syntax_error(text.encode("utf-8", "surrogatepass"))
    if found is None or found.message == "trailing characters":  # too large to walk
        return exc
    return _walked_error(found, prefix_text, exc.tensor)


def _check_entries_fast(
    metadata: dict[str, str] | None,
    parsed: dict[str, tuple[DType, list[int], list[int]]],
    header_size: int,
    data_size: int,
) -> Header | None:
    """Rules R6-R8 for a valid header, with list-level operations instead of a loop per entry.

    Returns None as soon as anything is off (or unusual: ties in offsets, zero-size tensors
    whose fold could overflow, sub-byte dtypes); the caller's per-entry loop then finds the
    first failing tensor in offset order and reports it exactly.
    """
    names = list(parsed)
    count = len(names)
    if not count:
        return None
    values = list(parsed.values())
    begins = [v[2][0] for v in values]
    if len(set(begins)) != count:
        return None  # zero-size tensors sharing an offset: ties need the name order
    order = sorted(range(count), key=begins.__getitem__)
    values = [values[i] for i in order]
    names = [names[i] for i in order]
    begins = [v[2][0] for v in values]
    ends = [v[2][1] for v in values]
    if begins[0] != 0 or begins[1:] != ends[:-1] or ends[-1] != data_size:
        return None
    shapes = [v[1] for v in values]
    elements = list(map(math.prod, shapes))
    if min(elements) == 0 and any(
        len(s) > 1 for s, e in zip(shapes, elements, strict=True) if not e
    ):
        return None  # the left-to-right overflow check depends on where the zero is
    bits = [v[0].bits for v in values]
    if max(elements) * 64 > UINT64_MAX or any(b % 8 for b in bits):
        return None
    if [e * b // 8 for e, b in zip(elements, bits, strict=True)] != [
        e - b for b, e in zip(begins, ends, strict=True)
    ]:
        return None
    tensors = _tensor_infos(names, [v[0] for v in values], map(tuple, shapes), begins, ends)
    return Header(tensors=tensors, metadata=metadata, header_size=header_size)


def _check_entries(
    metadata: dict[str, str] | None,
    parsed: dict[str, tuple[DType, list[int], list[int]]],
    header_size: int,
    data_size: int,
    prefix_text: str,
) -> Header:
    """Rules R6-R8 over deserialized entries, in offset order."""
    fast = _check_entries_fast(metadata, parsed, header_size, data_size)
    if fast is not None:
        return fast
    entries = [
        (begin, end, name, dtype, shape) for name, (dtype, shape, (begin, end)) in parsed.items()
    ]
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    data_start = N_LEN + header_size
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
    return Header(tensors=tensors, metadata=metadata, header_size=header_size)
