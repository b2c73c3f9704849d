"""Hypothesis strategies for structurally valid but hostile safetensors files.

Three families, from "valid" to "hostile":

* :func:`valid_files`: well-formed files (random dtypes, shapes including scalars and zero-size
  tensors, hostile-but-legal names and metadata), built by an independent writer recipe
  (the format's canonical layout written out by hand), so the reader is never tested against
  its own writer.
* :func:`hostile_files`: valid JSON whose *values* attack the reader: offsets that overlap, leave
  holes or point past the end; shapes that overflow 64 bits, wrap, hide behind a zero
  dimension, or have hundreds of dimensions; unknown or lower-case dtypes; duplicate names;
  metadata of the wrong types; length prefixes that lie.
* :func:`near_valid_files`: a valid file with one small mutation (a flipped byte, a truncated or
  extended buffer, a changed length prefix, one integer replaced by an interesting value).

Each strategy yields ``bytes`` of a whole file.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import strategies as st

DTYPE_CODES = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64",
)  # fmt: skip
_BITS = (8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64)
BITS = dict(zip(DTYPE_CODES, _BITS, strict=True))
#: Values that break naive readers: boundaries of 32/63/64-bit arithmetic, wrap-to-small
#: products (safetensors-cpp #9254), the header cap and negatives.
INTERESTING = (
    0, 1, 2, 3, 7, 8, 16, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**61 - 1,
    2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 4194305, 211106198978564, 100_000_000,
    100_000_001, -1, -(2**63),
)  # fmt: skip

names = st.one_of(
    st.sampled_from(["w", "bias", "", "__metadata", "a/b", "../x", "\x00", "\u00e9", "\U0001f600"]),
    st.text(min_size=0, max_size=12),
).filter(lambda s: s != "__metadata__" and not any("\ud800" <= c <= "\udfff" for c in s))

metadata_values = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=4),
)


def nbytes_of(dtype: str, shape: list[int]) -> int | None:
    """Byte size of a tensor, or None when the reference refuses it (overflow, sub-byte)."""
    count = 1
    for d in shape:
        count *= d
        if count >= 2**64:
            return None
    bits = count * BITS[dtype]
    if bits >= 2**64 or bits % 8:
        return None
    return bits // 8


def frame(header: bytes, body: bytes = b"", *, pad: bool = True, n: int | None = None) -> bytes:
    """``u64 LE N`` + header (space-padded to 8 unless ``pad`` is False) + body."""
    if pad:
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if n is None else n % 2**64) + header + body


def encode(obj: Any, ascii_only: bool = False) -> bytes:
    """Compact JSON as the reference writes it."""
    return json.dumps(obj, ensure_ascii=ascii_only, separators=(",", ":")).encode("utf-8")


@st.composite
def _valid_tensor(draw: st.DrawFn) -> tuple[str, list[int]]:
    dtype = draw(st.sampled_from(DTYPE_CODES))
    shape = draw(st.lists(st.integers(0, 5), max_size=4))
    if BITS[dtype] % 8:
        # Sub-byte dtypes need a whole number of bytes: make the element count fit.
        per = 2 if BITS[dtype] == 4 else 4
        shape = [*shape, per] if all(shape) else shape
        if nbytes_of(dtype, shape) is None:
            shape = [per]
    return dtype, shape


@st.composite
def valid_files(draw: st.DrawFn, max_tensors: int = 5) -> bytes:
    """A well-formed file written by an independent recipe (any tensor order in the header)."""
    tensors = draw(st.dictionaries(names, _valid_tensor(), max_size=max_tensors))
    meta = draw(metadata_values)
    order = draw(st.permutations(list(tensors)))
    obj: dict[str, Any] = {}
    if meta is not None or draw(st.booleans()):
        obj["__metadata__"] = meta
    offset = 0
    body = bytearray()
    for name in order:
        dtype, shape = tensors[name]
        size = nbytes_of(dtype, shape)
        assert size is not None
        obj[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        body += draw(st.binary(min_size=size, max_size=size))
        offset += size
    header = encode(obj, ascii_only=draw(st.booleans()))
    lead = draw(st.sampled_from([b"", b"", b" ", b"\n", b"\t\r\n "]))
    return frame(lead + header, bytes(body))


@st.composite
def _hostile_entry(draw: st.DrawFn) -> Any:
    dtype: Any = draw(
        st.one_of(
            st.sampled_from(DTYPE_CODES),
            st.sampled_from(["f32", "float32", "F128", "C128", "", "BF 16", "U8 "]),
            st.sampled_from([None, 8, ["F32"], {"F32": None}, {"F32": 1}, {}]),
        )
    )
    dim = st.one_of(st.integers(0, 6), st.sampled_from(INTERESTING))
    shape: Any = draw(
        st.one_of(
            st.lists(dim, max_size=5),
            st.lists(st.just(1), min_size=60, max_size=300),
            st.lists(dim, max_size=3).map(lambda s: [0, *s]),
            st.sampled_from([None, 4, "4", [2.0], [True], [-0.0], {}]),
        )
    )
    off = st.one_of(st.integers(0, 64), st.sampled_from(INTERESTING))
    offsets: Any = draw(
        st.one_of(
            st.lists(off, min_size=2, max_size=2),
            st.lists(off, max_size=4),
            st.sampled_from([None, "0,4", [0.0, 4], [False, True]]),
        )
    )
    entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    for field in ("dtype", "shape", "data_offsets"):
        if draw(st.integers(0, 15)) == 0:
            del entry[field]
    if draw(st.integers(0, 7)) == 0:
        entry[draw(st.sampled_from(["extra", "DTYPE", "x"]))] = draw(
            st.sampled_from([1, None, [[[]]], {"a": {"b": []}}, "s"])
        )
    if draw(st.integers(0, 15)) == 0:
        return [entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")]
    return entry


@st.composite
def hostile_files(draw: st.DrawFn) -> bytes:
    """Valid JSON with hostile values; the data buffer is sized to match roughly."""
    entries = draw(st.lists(st.tuples(names, _hostile_entry()), max_size=5))
    meta: Any = draw(
        st.one_of(
            metadata_values,
            st.sampled_from([{"a": 1}, {"a": None}, {"a": {"b": "c"}}, [], "s", 0]),
        )
    )
    parts = []
    if draw(st.booleans()):
        parts.append(encode("__metadata__") + b":" + encode(meta))
    for name, entry in entries:
        parts.append(encode(name) + b":" + encode(entry))
    if draw(st.integers(0, 7)) == 0 and parts:
        parts.append(parts[draw(st.integers(0, len(parts) - 1))])  # a duplicate key
    header = b"{" + b",".join(parts) + b"}"
    total = 0
    for _, entry in entries:
        offs = entry.get("data_offsets") if isinstance(entry, dict) else None
        if isinstance(offs, list):
            total = max([total, *(o for o in offs if type(o) is int and 0 <= o <= 1 << 12)])
    body = bytes(draw(st.sampled_from([total, total, 0, total + 1, max(0, total - 1)])))
    n = draw(st.sampled_from([None, None, None, 0, 2**63, 100_000_001, len(header) + 1]))
    return frame(header, body, pad=draw(st.booleans()), n=n)


@st.composite
def near_valid_files(draw: st.DrawFn) -> bytes:
    """A valid file with one mutation a careless writer or an attacker might make."""
    data = bytearray(draw(valid_files(max_tensors=3)))
    op = draw(st.integers(0, 5))
    if op == 0 and data:
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= 1 << draw(st.integers(0, 7))
    elif op == 1:
        cut = draw(st.integers(1, 9))
        data = data[:-cut] if len(data) > cut else data
    elif op == 2:
        data += draw(st.binary(min_size=1, max_size=9))
    elif op == 3:
        (n,) = struct.unpack("<Q", data[:8])
        n = draw(st.sampled_from([n - 1, n + 1, n + 8, 0, 2**64 - 1, 100_000_000]))
        data[:8] = struct.pack("<Q", n % 2**64)
    elif op == 4:
        # Replace one number in the header by an interesting one (keeps the JSON valid).
        (n,) = struct.unpack("<Q", data[:8])
        text = bytes(data[8 : 8 + n])
        digits = [i for i, c in enumerate(text) if 48 <= c <= 57 and not 48 <= text[i - 1] <= 57]
        if digits:
            i = draw(st.sampled_from(digits))
            j = i
            while j < len(text) and 48 <= text[j] <= 57:
                j += 1
            value = str(draw(st.sampled_from(INTERESTING))).encode()
            text = text[:i] + value + text[j:]
            data = bytearray(frame(text.rstrip(b" "), bytes(data[8 + n :])))
    else:
        # Pad the header with something that is not JSON whitespace.
        (n,) = struct.unpack("<Q", data[:8])
        junk = draw(st.sampled_from([b"\x00", b"\x0c", b"\xc2\xa0", b"{}", b"\xef\xbb\xbf"]))
        text = bytes(data[8 : 8 + n]).rstrip(b" ") + junk
        data = bytearray(frame(text, bytes(data[8 + n :])))
    return bytes(data)


any_files = st.one_of(valid_files(), hostile_files(), near_valid_files())
