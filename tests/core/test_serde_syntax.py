"""Malformed headers are refused in the reference's words: serde_json's first error, its text
and (for syntax errors) its line and column, also where Python's ``json`` words or places the
problem differently, and type errors that serde meets before a later syntax error.

Type errors keep their documented form here (the tensor or ``__metadata__`` named instead of a
position; docs/differences.md).
"""

from __future__ import annotations

import random
import re
import struct

import pytest

import pysafetensors
from pysafetensors._serde_syntax import first_syntax_error

ref = pytest.importorskip("safetensors")

_POSITION = re.compile(r" at line \d+ column \d+$")
_OUR_PLACE = re.compile(r" \((tensor `.*`|in __metadata__)\)$")


def _file(header: str) -> bytes:
    raw = header.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _message(load: object, data: bytes) -> str | None:
    try:
        load(data)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - both libraries' errors are compared as text
        return str(exc)
    return None


def _same(header: str) -> tuple[str | None, str | None] | None:
    """None when both refuse ``header`` alike (or both accept it), else both messages."""
    data = _file(header)
    theirs, ours = _message(ref.deserialize, data), _message(pysafetensors.deserialize, data)
    if theirs is None or ours is None:
        return None if theirs == ours else (theirs, ours)
    if ours == theirs or ours.startswith(theirs) or "invalid JSON in header" not in theirs:
        return None  # (offset and size errors have tests of their own)
    # A type error: the same words, placed by name instead of by column.
    positioned = _POSITION.search(theirs) and not _POSITION.search(ours)
    if positioned and _OUR_PLACE.sub("", ours) == _POSITION.sub("", theirs):
        return None
    return theirs, ours


CASES = [
    # serde's own words where Python's differ
    '{"__metadata__":{"a":"b",c":"d"}}',  # key must be a string
    '{"t":{"dtype":"U8","shape":[1x],"data_offsets":[0,1]}}',  # expected `,` or `]`
    '{"__metadata__":{"a":"b"}',  # EOF while parsing an object
    '{"t":{"dtype":"U8","shape":[1',  # EOF while parsing a list
    '{"__metadata__":tru}',  # expected ident
    '{"t":{"dtype":"U8","shape":[1.],"data_offsets":[0,1]}}',  # invalid number
    '{"t":{"dtype":"U8","shape":[-],"data_offsets":[0,1]}}',
    '{"t":{"dtype":"U8","shape":[1e],"data_offsets":[0,1]}}',
    '{"a":1e+}',
    '{"a":01}',
    '{"t":{"dtype":"U8","shape":[1,},"data_offsets":[0,1]}}',  # expected value
    '{"__metadata__":{"a":"b",]}',
    '{"x":' + "[" * 200,  # recursion limit exceeded
    '{"a":"\\u12x4"}',
    '{"a":"\\q"}',
    '{"a":"x\x01"}',
    '{"é":1,]',  # columns count bytes
    '{"a":[1,2]\n,\n"b":}',  # and lines
    # lone surrogates: which of serde's two messages, and where
    '{"__metadata__":{"\\ud800":"b"},"t":}',
    '{"a":"\\ud800\\u0041"}',
    '{"a":"\\ud800x"}',
    '{"a":"\\udc00"}',
    '"\\ud800"',
    # type errors serde meets before the syntax error after them
    "5{}",
    '"x":1}',
    "[1,}",
    '{"t":{"dtype":"XX","shape":[1],"data_offsets":[0,1]}}}',
    '{"t":{"dtype":"U8","shape":[1]}} x',
    '{"__metadata__":{"a":1},"u":}',
    '{"__metadata__":{"a":null}}',
    '{"__metadata__":{"a":true,',
    '{"__metadata__":{"a":-0,',
    '{"__metadata__":{"a":1.5e3,',
    '{"__metadata__":[1,',
    '{"__metadata__":7 x',
    '{"__metadata__":"s" x',
    '{"__metadata__":{"a":{',
    '{"__metadata__":{},"__metadata__":x',
    '{"__metadata__":{"a":"b"} x',
    '{"__metadata__":nul',
    # what Python's json refuses through our hooks or its own recursion limit
    '{"a": Infinity}',
    '{"a": -Infinity}',
    '{"a": NaN}',
    '{"\\ud800": 1, "a": NaN}',
    '{"a": [1e400]}',
    '{"a":' + "[" * 130 + "1e400",
    '{"a":' + "[" * 3000 + "]" * 3000 + "}",
    # integers outside i64/u64 are f64 to serde
    '{"__metadata__":18446744073709551616}',
    '{"__metadata__":{"a":-9223372036854775809}}',
]


@pytest.mark.parametrize("header", CASES)
def test_refused_in_the_reference_s_words(header: str) -> None:
    assert _same(header) is None, _same(header)


# Numbers: serde_json's own decimal-to-f64 conversion (not correctly rounded past 19 digits)
# and its text for an f64 (ryu: ``1e-9``, ``0.00001``), where Python's float() and repr() differ.
NUMBERS = [
    "1" + "0" * 42,  # 9.999999999999999e+41 to serde
    "123456789012345678901234",
    "-" + "9" * 25,
    "4" * 400,  # out of range (float() of it raised OverflowError)
    "1.7976931348623158e308",  # out of range to serde, finite to Python
    "1e-5",
    "-1.234e-5",
    "885776732306999549E-22",
    "-7.1512433275524304e-9",
    "2.5e-6",
    "1e16",
    "1" + "0" * 25 + ".5e-300",
    "0e99999999999",
    "1e-99999999999",
    "1e100000000000",  # refused at the exponent digit that overflows an i32, as serde stops
    "-5E21474836470000",
    "-0",
]
_PLACES = [
    '{"t":{"dtype":%s,"shape":[1],"data_offsets":[0,1]}}',
    '{"t":{"dtype":{"U8":%s},"shape":[1],"data_offsets":[0,1]}}',
    '{"t":{"dtype":"U8","shape":[%s],"data_offsets":[0,1]}}',
    '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,%s]}}',
    '{"t":%s}',
    '{"__metadata__":{"a":%s}}',
    '{"__metadata__":%s}',
    "%s",
]


@pytest.mark.parametrize("place", _PLACES)
@pytest.mark.parametrize("number", NUMBERS)
def test_numbers_are_read_and_shown_as_serde_does(number: str, place: str) -> None:
    assert _same(place % number) is None, _same(place % number)


def test_random_numbers_are_read_and_shown_as_serde_does() -> None:
    rng = random.Random(20261201)

    def digits(n: int) -> str:
        return str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(n - 1))

    differ = []
    for _ in range(1500):
        number = rng.choice(["", "-"]) + digits(rng.choice([1, 3, 16, 17, 19, 20, 21, 25, 40, 310]))
        if rng.random() < 0.5:
            number += "." + digits(rng.choice([1, 5, 17, 25]))
        if rng.random() < 0.6:
            number += rng.choice(["e", "E-", "e+"]) + str(rng.randint(0, 330))
        header = rng.choice(_PLACES) % number
        found = _same(header)
        if found is not None:
            differ.append((header, found))
    assert not differ, differ[:5]


_BASE = (
    '{"__metadata__":{"format":"pt","x":"y\\n"},'
    '"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
    '"b":{"dtype":"I8","shape":[3],"data_offsets":[16,19]}}'
)
_PIECES = [*'{}[]",:0123456789-+.eE \t\ntruefalsnul\\/aA\x00\x01', "\\u", "\\ud800", "-0", "é"]


def test_random_edits_are_refused_in_the_reference_s_words() -> None:
    rng = random.Random(20261130)
    differ = []
    for _ in range(1500):
        text = list(_BASE)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.35 and text:
                del text[min(i, len(text) - 1)]
            elif op < 0.7:
                text.insert(i, rng.choice(_PIECES))
            elif text:
                text[min(i, len(text) - 1)] = rng.choice(_PIECES)
        header = "".join(text)
        found = _same(header)
        if found is not None:
            differ.append((header, found))
    assert not differ, differ[:5]


@pytest.mark.parametrize(
    "header",
    [
        "[1]",
        " [ ]",
        "[garbage",
        "1",
        "1 x",
        "-0",
        "12345678901234567890123",
        "null",
        "nullx",
        "falsey",
        '"x"',
        '"a\\u00e9"',
        '"\xe9"',
        '"a"  ]',
        "\n\n  12",
        "\t\r\n[{",
    ],
)
def test_a_top_level_value_that_is_no_object_is_placed_as_serde_places_it(header: str) -> None:
    # serde refuses a sequence at what it peeked (before the "["), any other value once parsed:
    # the same words and the same line and column, not only the same words.
    data = _file(header)
    theirs, ours = _message(ref.deserialize, data), _message(pysafetensors.deserialize, data)
    assert theirs is not None and _POSITION.search(theirs), theirs
    assert ours == theirs


def test_a_valid_document_has_no_syntax_error() -> None:
    assert first_syntax_error(_BASE.encode()) is None
    assert first_syntax_error(b'  {"a": [1, -0.5e-3, true, null, "\\ud83d\\ude00"]}\n') is None


def test_a_header_too_large_to_walk_keeps_python_s_words_quickly() -> None:
    from pysafetensors._serde_syntax import WALK_LIMIT

    header = "[" + "0," * (WALK_LIMIT // 2 + 10) + "]"  # a trailing comma, past the limit
    assert first_syntax_error(header.encode()) is None
    with pytest.raises(pysafetensors.SafetensorError, match="invalid JSON in header"):
        pysafetensors.deserialize(_file('{"a":' + header[:-1] + "x]}"))


@pytest.mark.parametrize(
    "header",
    [
        '{"a":[]}\x00',
        '{"t":{"x":"\\ud800\\ud800"}}',
        '{"t":{"dtype":"U8","shape":[nan],"data_offsets":[0,0]}}',
    ],
)
def test_malformed_headers_of_megabytes_get_serde_s_words(header: str) -> None:
    # Headers over 1 MiB were not walked: Python's words and positions, and another first
    # error (trailing characters before a type error). Up to 8 MiB they are now.
    padded = header + " " * (3 << 20)
    assert _same(padded) is None, _same(padded)


def test_lazy_modules_copy_and_pickle() -> None:
    import copy
    import pickle

    from pysafetensors._adapter import LazyModule

    lazy = LazyModule("json")
    for clone in (copy.copy(lazy), copy.deepcopy(lazy), pickle.loads(pickle.dumps(lazy))):
        assert clone.dumps([1]) == "[1]"


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii 'quoted' {x}",
        '\b\x00\x1f\x7f "q" \\ \t\r\n\x0c',
        "e\u0301 \u20dd a\u0903",  # combining marks (Mn, Me) and a spacing mark (Mc)
        "\u0cc0\u1b3b\U0001d166\u200c\uff9e",  # spacing marks that are Grapheme_Extend
        "\xa0\u2000\u2028\u2029\u200b\u202e\ufeff",  # separators and format characters
        "\ue000\U000f0000\uffff\U0010ffff",  # private use, noncharacters
        "\u043c\u043e\u0434\u0435\u043b\u044c \u6a21\u578b \U0001f600",
    ],
)
def test_strings_in_type_errors_are_written_as_rust_writes_them(text: str) -> None:
    # serde shows a string it cannot take with Rust's Debug escapes (\u{8}, \0, combining
    # marks escaped); JSON's (\b, \u0000, raw U+FFFF) read differently.
    import json

    data = _file(json.dumps({"a": text}, ensure_ascii=False))
    theirs = _message(ref.deserialize, data)
    ours = _message(pysafetensors.deserialize, data)
    assert theirs is not None and ours is not None
    shown = re.search(r'string (".*"), expected', theirs, re.S)
    assert shown is not None
    assert shown.group(0) in ours


def test_the_quick_range_check_agrees_with_serde_s_conversion() -> None:
    """``number_in_range`` answers short numbers that Python reads below 1e300 at once; that
    answer is the one the digit-by-digit emulation of serde_json's conversion gives, near the
    threshold and the f64 maximum too (an unknown field of a million floats took ~2 s)."""
    from pysafetensors._serde_number import number_in_range, serde_f64, serde_integer

    rng = random.Random(20261130)
    texts = ["1e299", "9.99e299", "1e300", "1.7976931348623157e308", "1.7976931348623158e308"]
    for _ in range(20000):
        mantissa = str(rng.randint(1, 10 ** rng.randint(1, 25)))
        if rng.random() < 0.5:
            mantissa = mantissa[:1] + "." + (mantissa[1:] or "0")
        texts.append(f"{rng.choice(['', '-'])}{mantissa}e{rng.randint(-330, 330)}")
    for text in texts:
        exact = serde_integer(text) is not None or serde_f64(text) is not None
        assert number_in_range(text) == exact, text


def test_short_floats_kept_as_floats_are_shown_as_serde_does() -> None:
    """Float literals of at most 16 characters whose power of ten is exact are held as Python
    floats (not their text): serde's f64 of them is ``float()``'s, so its messages come out the
    same, against the reference and against the digit-by-digit emulation."""
    from pysafetensors._serde_json import _describe, _parse_float
    from pysafetensors._serde_number import unexpected_number

    rng = random.Random(20261201)
    texts = ["-0.0", "0.0", "0.000000000000001", "999999999999999.9", "-99999999999999.9"]
    texts += ["0e0", "-0E0", "1e22", "1e23", "1.5e-21", "1e-22", "1e-23", "12345678901234e22"]
    for _ in range(20000):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 15)))
        cut = rng.randint(1, len(digits) - 1)
        text = rng.choice(["", "-"]) + (digits[:cut].lstrip("0") or "0")
        if rng.random() < 0.7:
            text += "." + digits[cut:]
        if rng.random() < 0.4 or "." not in text:
            text += rng.choice(["e", "E", "e-", "E+", "e0"]) + str(rng.randint(0, 40))
        texts.append(text)
    short = [t for t in texts if len(t) <= 16]
    assert len(short) > 15000
    floats = 0
    for text in short:
        value = _parse_float(text)
        floats += type(value) is float
        assert _describe(value) == unexpected_number(text), text
    assert floats > 12000
    differ = []
    for text in short[:300]:
        header = _PLACES[rng.randrange(len(_PLACES))] % text
        found = _same(header)
        if found is not None:
            differ.append((header, found))
    assert not differ, differ[:5]
