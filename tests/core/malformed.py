"""A table of malformed (and borderline valid) files, with the reference's verdict on each.

Each :class:`Case` holds the exact bytes of a file, the error variant the reference (safetensors
0.8.0) reports for it (``None`` when it loads), and the reference's message text for it, without
the ``Error while deserializing...: `` prefix and without serde's ``at line L column C``.
``tests/core/test_malformed.py`` checks pysafetensors against every row, and against the
reference itself when it is installed; other tests may reuse the table::

    from core.malformed import CASES

The expectations were recorded from the reference and are checked again on every run where it
is installed, so the table cannot drift from it silently.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from conftest import raw_file

__all__ = ["CASES", "REFERENCE_KINDS", "Case", "kind_of_reference_message"]

#: How a reference message maps to its Rust variant name (the reference exposes only text).
REFERENCE_KINDS: tuple[tuple[str, str], ...] = (
    ("header too small", "HeaderTooSmall"),
    ("header too large", "HeaderTooLarge"),
    ("invalid header length", "InvalidHeaderLength"),
    ("invalid UTF-8 in header", "InvalidHeader"),
    ("invalid JSON in header", "InvalidHeaderDeserialization"),
    ("invalid offset for tensor", "InvalidOffset"),
    ("overflow computing buffer size", "ValidationOverflow"),
    ("slicing for subbytes dtypes", "MisalignedSlice"),
    ("invalid shape, data type, or offset for tensor", "TensorInvalidInfo"),
    ("incomplete metadata, file not fully covered", "MetadataIncompleteBuffer"),
)


def kind_of_reference_message(message: str) -> str:
    """The variant name for a message of the reference's ``SafetensorError``."""
    for text, kind in REFERENCE_KINDS:
        if text in message:
            return kind
    raise AssertionError(f"unknown reference message: {message!r}")


@dataclass(frozen=True)
class Case:
    """One file and the reference's verdict."""

    id: str
    """Short name, used as the pytest id."""
    data: bytes
    """The whole file."""
    kind: str | None
    """The reference's error variant, or None if the file loads."""
    text: str
    """The reference's message without prefix and position (empty when the file loads)."""
    tensor: str | None = None
    """A tensor name our message must mention, where the error is about one tensor."""


def _t(dtype: str = "I32", shape: str = "[4]", offsets: str = "[0,16]", extra: str = "") -> str:
    """One tensor entry as JSON text (kept as text so that invalid JSON can be spliced in)."""
    return f'{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}{extra}}}'


def _one(entry: str, data: bytes = bytes(16), name: str = "t") -> bytes:
    return raw_file(f'{{"{name}":{entry}}}'.encode(), data)


def _ignored(value: str) -> bytes:
    """A valid tensor with an unknown field ``x`` holding ``value`` (JSON text)."""
    return _one(_t(extra=f',"x":{value}'))


def _nest(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


_VARIANTS = (
    "expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`, "
    "`F8_E8M0`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `I16`, `U16`, `F16`, `BF16`, `I32`, `U32`, `F32`, "
    "`C64`, `F64`, `I64`, `U64`"
)
_J = "InvalidHeaderDeserialization"
_OFF = "InvalidOffset"
_INFO = "TensorInvalidInfo"
_INCOMPLETE = "MetadataIncompleteBuffer"
_OVERFLOW = "ValidationOverflow"
_MISALIGNED = "MisalignedSlice"
_INFO_TEXT = "invalid shape, data type, or offset for tensor"
_INCOMPLETE_TEXT = "incomplete metadata, file not fully covered"
_OVERFLOW_TEXT = "overflow computing buffer size from shape and/or element type"
_MISALIGNED_TEXT = (
    "The slice is slicing for subbytes dtypes, and the slice does not end up at a byte "
    "boundary, this is invalid."
)
_U64 = 2**64 - 1
_EMPTY = b"{}" + b" " * 6

CASES: tuple[Case, ...] = (
    # --- §1.2 rules 1-4: the length prefix --------------------------------------------------
    Case("empty-file", b"", "HeaderTooSmall", "header too small"),
    Case("seven-bytes", b"\x08" + bytes(6), "HeaderTooSmall", "header too small"),
    Case("n-zero", struct.pack("<Q", 0), _J, "EOF while parsing a value"),
    Case("n-zero-with-data", struct.pack("<Q", 0) + b"{}", _J, "EOF while parsing a value"),
    Case("n-over-limit", struct.pack("<Q", 100_000_001), "HeaderTooLarge", "header too large"),
    Case("n-u64-max", struct.pack("<Q", _U64) + _EMPTY, "HeaderTooLarge", "header too large"),
    Case(
        "n-at-limit-but-short",
        raw_file(_EMPTY, n=100_000_000),
        "InvalidHeaderLength",
        "invalid header length",
    ),
    Case("n-past-end", raw_file(b"{}", n=3), "InvalidHeaderLength", "invalid header length"),
    Case("n-unpadded-ok", raw_file(b"{}"), None, ""),
    Case("empty-padded-ok", raw_file(_EMPTY), None, ""),
    # --- rule 5: UTF-8 ---------------------------------------------------------------------
    Case(
        "utf8-ff",
        raw_file(b'{"\xff":1}'),
        "InvalidHeader",
        "invalid UTF-8 in header: invalid utf-8 sequence of 1 bytes from index 2",
    ),
    Case(
        "utf8-overlong",
        raw_file(b'{"\xc0\x80":1}'),
        "InvalidHeader",
        "invalid UTF-8 in header: invalid utf-8 sequence of 1 bytes from index 2",
    ),
    Case(
        "utf8-encoded-surrogate",
        raw_file(b'{"\xed\xa0\x80":1}'),
        "InvalidHeader",
        "invalid UTF-8 in header: invalid utf-8 sequence of 1 bytes from index 2",
    ),
    Case(
        "utf8-truncated",
        raw_file(b'{"\xe2\x82":1}'),
        "InvalidHeader",
        "invalid UTF-8 in header: invalid utf-8 sequence of 2 bytes from index 2",
    ),
    Case(
        "utf8-late-before-json",
        raw_file(('{"t":' + _t() + ',"\xff":1}').encode("latin-1"), bytes(16)),
        "InvalidHeader",
        "invalid UTF-8 in header",
    ),
    Case("utf8-bom", raw_file(b"\xef\xbb\xbf{}"), _J, "expected value"),
    Case("utf8-multibyte-name-ok", _one(_t(), name="é漢😀"), None, ""),
    # --- §1.3 whitespace and framing -------------------------------------------------------
    Case("ws-all-four-around-ok", raw_file(b" \t\r\n{ \t\r\n} \t\r\n"), None, ""),
    Case("ws-leading-spaces-ok", raw_file(b"      {}"), None, ""),
    Case("ws-trailing-tab-lf-ok", raw_file(b"{}\t\n\r\t\n\r  "), None, ""),
    Case("ws-only", raw_file(b" " * 8), _J, "EOF while parsing a value"),
    Case("trailing-nul", raw_file(b"{}\x00"), _J, "trailing characters"),
    Case("leading-nul", raw_file(b"\x00{}"), _J, "expected value"),
    Case("trailing-formfeed", raw_file(b"{}\x0c"), _J, "trailing characters"),
    Case("trailing-vtab", raw_file(b"{}\x0b"), _J, "trailing characters"),
    Case("trailing-nbsp", raw_file(b"{}\xc2\xa0"), _J, "trailing characters"),
    Case("two-objects", raw_file(b"{}{}"), _J, "trailing characters"),
    Case("top-array", raw_file(b"[]"), _J, "invalid type: sequence, expected struct HashMetadata"),
    Case("top-null", raw_file(b"null"), _J, "invalid type: null, expected struct HashMetadata"),
    Case("top-string", raw_file(b'"x"'), _J, 'invalid type: string "x", expected struct'),
    Case("top-int", raw_file(b"1"), _J, "invalid type: integer `1`, expected struct"),
    Case("unterminated-object", raw_file(('{"t":' + _t()).encode(), bytes(16)), _J, "EOF while"),
    Case("trailing-comma", _one(_t(extra=",")), _J, "trailing comma"),
    Case("single-quotes", raw_file(b"{'t':1}"), _J, "key must be a string"),
    Case("comment", raw_file(b"{/*x*/}"), _J, "key must be a string"),
    Case("nonstring-key", raw_file(b"{1:2}"), _J, "key must be a string"),
    # --- numbers ---------------------------------------------------------------------------
    Case("nan", _one(_t(shape="[NaN]")), _J, "expected value"),
    Case("infinity", _one(_t(offsets="[0,Infinity]")), _J, "expected value"),
    Case("minus-infinity", _one(_t(shape="[-Infinity]")), _J, "invalid number"),
    Case(
        "minus-zero",
        _one(_t(shape="[-0]", offsets="[0,0]"), b""),
        _J,
        "invalid type: floating point `-0.0`, expected usize",
    ),
    Case(
        "float-16.0",
        _one(_t(offsets="[0,16.0]")),
        _J,
        "invalid type: floating point `16.0`, expected usize",
    ),
    Case("exp-1e1", _one(_t(shape="[1e1]")), _J, "invalid type: floating point `10.0`, expected"),
    Case("exp-1E1", _one(_t(shape="[1E1]")), _J, "invalid type: floating point `10.0`, expected"),
    Case("bool-true", _one(_t(shape="[true]")), _J, "invalid type: boolean `true`, expected usize"),
    Case("null-dim", _one(_t(shape="[null]")), _J, "invalid type: null, expected usize"),
    Case("leading-zero", _one(_t(offsets="[0,016]")), _J, "invalid number"),
    Case("plus-sign", _one(_t(shape="[+4]")), _J, "expected value"),
    Case(
        "negative-offset",
        _one(_t(offsets="[-1,16]")),
        _J,
        "invalid value: integer `-1`, expected usize",
    ),
    Case(
        "string-offset",
        _one(_t(offsets='[0,"16"]')),
        _J,
        'invalid type: string "16", expected usize',
    ),
    Case(
        "two-to-the-64",
        _one(_t(shape="[18446744073709551616]")),
        _J,
        "invalid type: floating point `1.8446744073709552e+19`, expected usize",
    ),
    Case("u64-max-dim-then-zero-ok", _one(_t("U8", f"[{_U64},0]", "[0,0]"), b""), None, ""),
    Case("ignored-minus-zero-ok", _ignored("-0"), None, ""),
    Case("ignored-big-int-ok", _ignored("1" * 30), None, ""),
    Case("ignored-308-digits-ok", _ignored("9" * 308), None, ""),
    Case("ignored-309-digits", _ignored("9" * 309), _J, "number out of range"),
    Case("ignored-1e400", _ignored("1e400"), _J, "number out of range"),
    Case("ignored-1e-400-ok", _ignored("1e-400"), None, ""),
    Case("ignored-0e999-ok", _ignored("0e999"), None, ""),
    Case("ignored-f64-max-ok", _ignored("1.7976931348623157e308"), None, ""),
    # serde_json's f64 parsing is not correctly rounded: this rounds to f64::MAX in Python.
    Case("ignored-f64-max-plus", _ignored("1.7976931348623158e308"), _J, "number out of range"),
    Case("ignored-nan", _ignored("NaN"), _J, "expected value"),
    # --- strings ---------------------------------------------------------------------------
    Case("surrogate-high-in-name", _one(_t(), name="\\ud800"), _J, "unexpected end of hex escape"),
    Case(
        "surrogate-low-in-name",
        _one(_t(), name="\\udc00"),
        _J,
        "lone leading surrogate in hex escape",
    ),
    Case(
        "surrogate-reversed-pair",
        _one(_t(), name="\\ude00\\ud83d"),
        _J,
        "lone leading surrogate in hex escape",
    ),
    Case("surrogate-in-dtype", _one(_t(dtype="\\ud800")), _J, "unexpected end of hex escape"),
    Case("surrogate-in-ignored", _ignored('"\\ud800"'), _J, "unexpected end of hex escape"),
    Case(
        "surrogate-in-metadata-value",
        raw_file(('{"__metadata__":{"a":"\\ud800"},"t":' + _t() + "}").encode(), bytes(16)),
        _J,
        "unexpected end of hex escape",
    ),
    Case(
        "surrogate-in-metadata-key",
        raw_file(b'{"__metadata__":{"\\ud800":"a"}}'),
        _J,
        "unexpected end of hex escape",
    ),
    Case("surrogate-pair-ok", _one(_t(), name="\\ud83d\\ude00"), None, ""),
    Case(
        "raw-control-in-name",
        _one(_t(), name="a\x01"),
        _J,
        "control character (\\u0000-\\u001F) found while parsing a string",
    ),
    Case("raw-nul-in-name", _one(_t(), name="a\x00"), _J, "control character"),
    Case("raw-tab-in-name", _one(_t(), name="a\tb"), _J, "control character"),
    Case("raw-lf-in-metadata", raw_file(b'{"__metadata__":{"a":"x\ny"}}'), _J, "control character"),
    Case("raw-control-in-ignored", _ignored('"\x01"'), _J, "control character"),
    Case("escaped-nul-name-ok", _one(_t(), name="\\u0000"), None, ""),
    Case("del-in-name-ok", _one(_t(), name="a\x7f"), None, ""),
    Case("empty-name-ok", _one(_t(), name=""), None, ""),
    Case("escaped-name-ok", _one(_t(), name="\\u0074"), None, ""),
    Case("bad-escape", _one(_t(), name="\\x"), _J, "invalid escape"),
    Case("short-u-escape", _one(_t(), name="\\u12"), _J, "invalid escape"),
    # --- keys and duplicates ---------------------------------------------------------------
    Case(
        "duplicate-metadata",
        raw_file(b'{"__metadata__":{},"__metadata__":{}}'),
        _J,
        "duplicate field `__metadata__`",
    ),
    Case(
        "duplicate-metadata-null",
        raw_file(b'{"__metadata__":null,"__metadata__":null}'),
        _J,
        "duplicate field `__metadata__`",
    ),
    Case(
        "duplicate-metadata-escaped",
        raw_file(b'{"\\u005f_metadata__":{"a":"b"},"__metadata__":{}}'),
        _J,
        "duplicate field `__metadata__`",
    ),
    Case(
        "duplicate-dtype",
        _one('{"dtype":"I32","dtype":"I32","shape":[4],"data_offsets":[0,16]}'),
        _J,
        "duplicate field `dtype`",
        "t",
    ),
    Case(
        "duplicate-shape",
        _one('{"dtype":"I32","shape":[4],"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "duplicate field `shape`",
        "t",
    ),
    Case(
        "duplicate-data-offsets",
        _one(_t(extra=',"data_offsets":[0,16]')),
        _J,
        "duplicate field `data_offsets`",
        "t",
    ),
    Case("duplicate-unknown-field-ok", _one(_t(extra=',"x":1,"x":2')), None, ""),
    Case("duplicate-metadata-key-ok", raw_file(b'{"__metadata__":{"a":"1","a":"2"}}'), None, ""),
    Case(
        "duplicate-metadata-key-first-bad",
        raw_file(b'{"__metadata__":{"a":1,"a":"x"}}'),
        _J,
        "invalid type: integer `1`, expected a string",
    ),
    Case(
        "duplicate-name-hole",
        raw_file(('{"t":' + _t() + ',"t":' + _t(offsets="[16,32]") + "}").encode(), bytes(32)),
        _OFF,
        "invalid offset for tensor",
        "t",
    ),
    Case(
        "duplicate-name-same-range-ok",
        raw_file(('{"t":' + _t() + ',"t":' + _t("F32") + "}").encode(), bytes(16)),
        None,
        "",
    ),
    Case(
        "duplicate-name-first-bad-dtype",
        raw_file(('{"t":' + _t("XX") + ',"t":' + _t() + "}").encode(), bytes(16)),
        _J,
        "unknown variant `XX`",
        "t",
    ),
    Case(
        "duplicate-name-first-missing-field",
        raw_file(('{"t":{"dtype":"I32"},"t":' + _t() + "}").encode(), bytes(16)),
        _J,
        "missing field `shape`",
        "t",
    ),
    Case(
        "duplicate-name-first-bad-size-ok",
        raw_file(('{"t":' + _t(shape="[5]") + ',"t":' + _t() + "}").encode(), bytes(16)),
        None,
        "",
    ),
    Case("unknown-fields-ok", _one(_t(extra=',"x":{"y":[1,2.5,null,"z"]},"q":true')), None, ""),
    Case("nesting-125-ok", _ignored(_nest(125)), None, ""),
    Case("nesting-126", _ignored(_nest(126)), _J, "recursion limit exceeded", "t"),
    Case("nesting-200", _ignored(_nest(200)), _J, "recursion limit exceeded", "t"),
    Case("nesting-objects-125-ok", _ignored('{"a":' * 125 + "1" + "}" * 125), None, ""),
    Case("nesting-objects-126", _ignored('{"a":' * 126 + "1" + "}" * 126), _J, "recursion limit"),
    Case("nesting-in-shape-126", _one(_t(shape=_nest(126))), _J, "recursion limit exceeded"),
    Case(
        "nesting-duplicate-unknown",
        _one(_t(extra=',"x":' + _nest(130) + ',"x":1')),
        _J,
        "recursion limit exceeded",
    ),
    # --- tensor entries --------------------------------------------------------------------
    Case("missing-dtype", _one('{"shape":[4],"data_offsets":[0,16]}'), _J, "missing field `dtype`"),
    Case(
        "missing-shape", _one('{"dtype":"I32","data_offsets":[0,16]}'), _J, "missing field `shape`"
    ),
    Case(
        "missing-offsets",
        _one('{"dtype":"I32","shape":[4]}'),
        _J,
        "missing field `data_offsets`",
        "t",
    ),
    Case("missing-all", _one("{}"), _J, "missing field `dtype`", "t"),
    Case(
        "offsets-length-3",
        _one(_t(offsets="[0,16,16]")),
        _J,
        "invalid length 3, expected 2 elements in sequence",
        "t",
    ),
    Case(
        "offsets-length-1",
        _one(_t(offsets="[0]")),
        _J,
        "invalid length 1, expected a tuple of size 2",
    ),
    Case(
        "offsets-empty", _one(_t(offsets="[]")), _J, "invalid length 0, expected a tuple of size 2"
    ),
    Case(
        "offsets-int",
        _one(_t(offsets="16")),
        _J,
        "invalid type: integer `16`, expected a tuple of size 2",
    ),
    Case("shape-int", _one(_t(shape="4")), _J, "invalid type: integer `4`, expected a sequence"),
    Case(
        "shape-string", _one(_t(shape='"4"')), _J, 'invalid type: string "4", expected a sequence'
    ),
    Case("shape-null", _one(_t(shape="null")), _J, "invalid type: null, expected a sequence"),
    Case("shape-nested", _one(_t(shape="[[4]]")), _J, "invalid type: sequence, expected usize"),
    Case("dtype-lowercase", _one(_t("i32")), _J, f"unknown variant `i32`, {_VARIANTS}", "t"),
    Case("dtype-f128", _one(_t("F128")), _J, "unknown variant `F128`, expected one of"),
    Case(
        "dtype-int",
        _one('{"dtype":5,"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid type: integer `5`, expected string or map",
    ),
    Case(
        "dtype-null",
        _one('{"dtype":null,"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid type: null, expected string or map",
    ),
    Case(
        "dtype-tagged-unit-ok",
        _one('{"dtype":{"I32":null},"shape":[4],"data_offsets":[0,16]}'),
        None,
        "",
    ),
    Case(
        "dtype-tagged-value",
        _one('{"dtype":{"I32":1},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid type: integer `1`, expected unit",
    ),
    Case(
        "dtype-tagged-two-keys",
        _one('{"dtype":{"I32":null,"F32":null},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid value: map, expected map with a single key",
    ),
    Case(
        "dtype-tagged-same-key-twice",
        _one('{"dtype":{"I32":null,"I32":null},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid value: map, expected map with a single key",
    ),
    Case(
        "dtype-tagged-same-key-twice-bad-first",
        _one('{"dtype":{"I32":1,"I32":null},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid value: map, expected map with a single key",
    ),
    Case(
        "dtype-tagged-same-key-twice-bad-last",
        _one('{"dtype":{"I32":null,"I32":1},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid value: map, expected map with a single key",
    ),
    Case(
        "dtype-tagged-empty",
        _one('{"dtype":{},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "invalid value: map, expected map with a single key",
    ),
    Case(
        "positional-dtype-same-key-twice",
        _one('[{"I32":null,"I32":null},[4],[0,16]]'),
        _J,
        "invalid value: map, expected map with a single key",
    ),
    Case(
        "dtype-tagged-unknown",
        _one('{"dtype":{"i32":null},"shape":[4],"data_offsets":[0,16]}'),
        _J,
        "unknown variant `i32`",
    ),
    Case("positional-entry-ok", _one('["I32",[4],[0,16]]'), None, ""),
    Case(
        "positional-entry-short",
        _one('["I32",[4]]'),
        _J,
        "invalid length 2, expected struct TensorInfo with 3 elements",
    ),
    Case(
        "positional-entry-long",
        _one('["I32",[4],[0,16],1]'),
        _J,
        "invalid length 4, expected 3 elements in sequence",
    ),
    Case("entry-string", _one('"x"'), _J, 'invalid type: string "x", expected struct TensorInfo'),
    Case("entry-null", _one("null"), _J, "invalid type: null, expected struct TensorInfo"),
    Case(
        "entry-bool", _one("true"), _J, "invalid type: boolean `true`, expected struct TensorInfo"
    ),
    # --- §1.5 __metadata__ -----------------------------------------------------------------
    Case("metadata-null-ok", raw_file(b'{"__metadata__":null}'), None, ""),
    Case("metadata-empty-ok", raw_file(b'{"__metadata__":{}}'), None, ""),
    Case(
        "metadata-after-tensors-ok",
        raw_file(('{"t":' + _t() + ',"__metadata__":{"a":"b"}}').encode(), bytes(16)),
        None,
        "",
    ),
    Case(
        "metadata-int-value",
        raw_file(b'{"__metadata__":{"a":1}}'),
        _J,
        "invalid type: integer `1`, expected a string",
    ),
    Case(
        "metadata-object-value",
        raw_file(b'{"__metadata__":{"a":{}}}'),
        _J,
        "invalid type: map, expected a string",
    ),
    Case(
        "metadata-array-value",
        raw_file(b'{"__metadata__":{"a":[]}}'),
        _J,
        "invalid type: sequence, expected a string",
    ),
    Case(
        "metadata-null-value",
        raw_file(b'{"__metadata__":{"a":null}}'),
        _J,
        "invalid type: null, expected a string",
    ),
    Case(
        "metadata-array",
        raw_file(b'{"__metadata__":[]}'),
        _J,
        "invalid type: sequence, expected a map",
    ),
    Case(
        "metadata-string",
        raw_file(b'{"__metadata__":"x"}'),
        _J,
        'invalid type: string "x", expected a map',
    ),
    Case(
        "metadata-shaped-like-tensor",
        raw_file(('{"__metadata__":' + _t() + "}").encode(), bytes(16)),
        _J,
        "invalid type: sequence, expected a string",
    ),
    Case(
        "metadata-error-beats-earlier-tensor-error",
        raw_file(('{"t":' + _t("XX") + ',"__metadata__":5}').encode(), bytes(16)),
        _J,
        "invalid type: integer `5`, expected a map",
    ),
    # --- §1.4 offsets and coverage ---------------------------------------------------------
    Case(
        "first-begins-late",
        _one(_t(offsets="[4,20]"), bytes(20)),
        _OFF,
        "invalid offset for tensor `t`",
        "t",
    ),
    Case(
        "hole-between",
        raw_file(('{"a":' + _t() + ',"b":' + _t(offsets="[20,36]") + "}").encode(), bytes(36)),
        _OFF,
        "invalid offset for tensor `b`",
        "b",
    ),
    Case(
        "overlap",
        raw_file(('{"a":' + _t() + ',"b":' + _t(offsets="[8,24]") + "}").encode(), bytes(24)),
        _OFF,
        "invalid offset for tensor `b`",
        "b",
    ),
    Case(
        "end-before-begin",
        raw_file(('{"a":' + _t() + ',"b":' + _t(offsets="[16,8]") + "}").encode(), bytes(16)),
        _OFF,
        "invalid offset for tensor `b`",
        "b",
    ),
    Case(
        "zero-length-twice-at-start-ok",
        raw_file(
            (
                '{"z1":'
                + _t(shape="[0]", offsets="[0,0]")
                + ',"z2":'
                + _t(shape="[0]", offsets="[0,0]")
                + ',"t":'
                + _t()
                + "}"
            ).encode(),
            bytes(16),
        ),
        None,
        "",
    ),
    Case(
        "zero-length-at-end-ok",
        raw_file(
            ('{"t":' + _t() + ',"z":' + _t(shape="[2,0]", offsets="[16,16]") + "}").encode(),
            bytes(16),
        ),
        None,
        "",
    ),
    Case(
        "zero-length-inside",
        raw_file(
            ('{"t":' + _t() + ',"z":' + _t(shape="[0]", offsets="[8,8]") + "}").encode(),
            bytes(16),
        ),
        _OFF,
        "invalid offset for tensor",
    ),
    Case("trailing-bytes", _one(_t(), bytes(17)), _INCOMPLETE, _INCOMPLETE_TEXT),
    Case("missing-bytes", _one(_t(), bytes(15)), _INCOMPLETE, _INCOMPLETE_TEXT),
    Case("no-tensors-trailing-bytes", raw_file(_EMPTY, b"\x00"), _INCOMPLETE, _INCOMPLETE_TEXT),
    Case("size-error-beats-missing-data", _one(_t(shape="[5]"), b""), _INFO, _INFO_TEXT),
    Case("wrong-size", _one(_t(shape="[3]")), _INFO, _INFO_TEXT),
    Case("offset-error-beats-size-error", _one(_t(shape="[3]", offsets="[4,16]")), _OFF, "`t`"),
    Case(
        "first-in-offset-order-decides",
        raw_file(
            ('{"a":' + _t(offsets="[16,32]") + ',"b":' + _t(shape="[3]") + "}").encode(),
            bytes(32),
        ),
        _INFO,
        _INFO_TEXT,
    ),
    Case(
        "header-order-irrelevant-ok",
        raw_file(
            ('{"b":' + _t(offsets="[16,32]") + ',"a":' + _t() + "}").encode(),
            bytes(32),
        ),
        None,
        "",
    ),
    Case("offset-u64-max", _one(_t(offsets=f"[{_U64},{_U64}]"), b""), _OFF, "invalid offset"),
    # --- overflow and sub-byte sizes (§1.2 7b-7d, §1.7) ------------------------------------
    Case(
        "overflow-2^63,4,0",
        _one(_t("U64", f"[{2**63},4,0]", "[0,0]"), b""),
        _OVERFLOW,
        _OVERFLOW_TEXT,
    ),
    Case("no-overflow-0,2^63,4-ok", _one(_t("U64", f"[0,{2**63},4]", "[0,0]"), b""), None, ""),
    Case(
        "overflow-bits-2^61-1-u64",
        _one(_t("U64", f"[{2**61 - 1}]", "[0,0]"), b""),
        _OVERFLOW,
        _OVERFLOW_TEXT,
    ),
    Case(
        "overflow-bits-2^61-u8",
        _one(_t("U8", f"[{2**61}]", "[0,0]"), b""),
        _OVERFLOW,
        _OVERFLOW_TEXT,
    ),
    Case("f4-odd-count", _one(_t("F4", "[3]", "[0,2]"), bytes(2)), _MISALIGNED, _MISALIGNED_TEXT),
    Case("f4-scalar", _one(_t("F4", "[]", "[0,1]"), bytes(1)), _MISALIGNED, _MISALIGNED_TEXT),
    Case("f4-four-ok", _one(_t("F4", "[4]", "[0,2]"), bytes(2)), None, ""),
    Case("f4-1x2-ok", _one(_t("F4", "[1,2]", "[0,1]"), bytes(1)), None, ""),
    Case("f4-wrong-size", _one(_t("F4", "[4]", "[0,4]"), bytes(4)), _INFO, _INFO_TEXT),
    Case(
        "f6-two",
        _one(_t("F6_E2M3", "[2]", "[0,2]"), bytes(2)),
        _MISALIGNED,
        _MISALIGNED_TEXT,
    ),
    Case("f6-four-ok", _one(_t("F6_E2M3", "[4]", "[0,3]"), bytes(3)), None, ""),
    Case("f6-e3m2-eight-ok", _one(_t("F6_E3M2", "[2,4]", "[0,6]"), bytes(6)), None, ""),
    Case("scalar-f64-ok", _one(_t("F64", "[]", "[0,8]"), bytes(8)), None, ""),
    Case("scalar-wrong-size", _one(_t("F64", "[]", "[0,4]"), bytes(4)), _INFO, _INFO_TEXT),
    Case("zero-dim-ok", _one(_t("F32", "[0,5]", "[0,0]"), b""), None, ""),
    Case("bool-byte-2-ok", _one(_t("BOOL", "[2]", "[0,2]"), b"\x02\x00"), None, ""),
    Case("float-nan-data-ok", _one(_t("F32", "[1]", "[0,4]"), b"\x00\x00\xc0\x7f"), None, ""),
    # --- found by differential fuzzing -----------------------------------------------------
    # A name ending in \"__metadata__ holds the text "__metadata__" without the key being
    # there: the fast path counted it as a null __metadata__ and missed a repeated field.
    Case(
        "dup-field-beside-metadata-like-name",
        raw_file(
            (
                '{"\\"__metadata__":'
                + _t("U8", "[0]", "[0,0]")
                + ',"t":'
                + _t("F32", "[1]", "[0,1]", ',"dtype":"U8"')
                + "}"
            ).encode(),
            b"a",
        ),
        _J,
        "duplicate field `dtype`",
    ),
    Case(
        "dup-name-earlier-invalid-beside-metadata-like-name",
        raw_file(
            (
                '{"\\"__metadata__":'
                + _t("U8", "[0]", "[0,0]")
                + ',"t":{},"t":'
                + _t("U8", "[1]", "[0,1]")
                + "}"
            ).encode(),
            b"a",
        ),
        _J,
        "missing field `dtype`",
    ),
    # int() refuses over 4,300 digits with a plain ValueError.
    Case(
        "offset-4301-digits",
        _one(_t("U8", "[1]", f"[0,{'1' * 4301}]"), b"a"),
        _J,
        "number out of range",
    ),
    Case(
        "shape-4301-digits",
        _one(_t("U8", f"[{'1' * 4301}]", "[0,1]"), b"a"),
        _J,
        "number out of range",
    ),
    # serde buffers every entry before converting any: a number out of range or nesting past
    # the limit anywhere comes before any entry's type error.
    Case(
        "type-error-then-big-number",
        _one(_t("b", "[]", f"[0,{'1' * 400}]")),
        _J,
        "number out of range",
    ),
    Case(
        "nesting-in-dtype",
        _one(_t(_nest(130), "[]", "[0,0]").replace('"[', "[").replace(']"', "]")),
        _J,
        "recursion limit exceeded",
    ),
    Case(
        "type-error-then-nesting-in-a-later-entry",
        raw_file(
            (
                '{"a":' + _t("x", "[]", "[0,0]") + ',"b":' + _t("U8", _nest(130), "[0,0]") + "}"
            ).encode()
        ),
        _J,
        "recursion limit exceeded",
    ),
    Case(
        "metadata-nested-1000",
        raw_file(('{"__metadata__":' + _nest(1000) + "}").encode()),
        _J,
        "invalid type: sequence, expected a map",
    ),
)

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
