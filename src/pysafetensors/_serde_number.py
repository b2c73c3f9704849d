"""JSON numbers as serde_json reads them, for the reference's verdicts and words about them.

serde_json (without its ``float_roundtrip`` feature, as the reference builds it) converts a
decimal to f64 its own way: the significand keeps as many leading digits as fit in a u64, the
rest only move the exponent, and the result is ``significand * 10**exponent`` in f64
arithmetic with the powers of ten from a table. That is not correctly rounded, so it differs
from Python's ``float()`` at the edges: 1.7976931348623158e308 is "number out of range" there
but finite here, and the 43-digit integer 10**42 is ``9.999999999999999e+41`` there, ``1e+42``
here. Integers within i64/u64 stay integers; ``-0`` and everything else is an f64.

Pure: no I/O, no state.
"""

from __future__ import annotations

import math
import re
from typing import Final

_U64_MAX: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_U64_DIV10: Final = _U64_MAX // 10
_U64_MOD10: Final = _U64_MAX % 10
_I32_MAX: Final = 2**31 - 1
# serde_json's table: the correctly rounded f64 of each power, as a Rust literal is.
_POW10: Final = tuple(float(f"1e{k}") for k in range(309))
_NUMBER: Final = re.compile(r"-?(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?")
_INTEGER: Final = re.compile(r"-?\d+")


def serde_f64(text: str) -> float | None:
    """The f64 serde_json makes of the JSON number ``text``, or None where it refuses the number
    as out of range (it never makes an infinity)."""
    match = _NUMBER.fullmatch(text)
    if match is None:  # pragma: no cover - callers hand over valid JSON number literals only
        return None
    negative = text.startswith("-")
    int_digits, frac_digits, exp_text = match.group(1), match.group(2) or "", match.group(3)
    significand = 0
    exponent = 0
    overflowed = False
    # parse_integer, then parse_long_integer once the u64 is full: further integer digits
    # only raise the exponent; parse_decimal: fraction digits past a full u64 are dropped.
    for is_fraction, digits in ((False, int_digits), (True, frac_digits)):
        for ch in digits:
            digit = ord(ch) - 48
            if (
                overflowed
                or significand > _U64_DIV10
                or (significand == _U64_DIV10 and digit > _U64_MOD10)
            ):
                overflowed = True
                if not is_fraction:
                    exponent += 1
            else:
                significand = significand * 10 + digit
                if is_fraction:
                    exponent -= 1
    if exp_text is not None:  # parse_exponent
        digits = exp_text.lstrip("+-").lstrip("0") or "0"
        exp_negative = exp_text.startswith("-")
        if len(digits) > 10 or int(digits) > _I32_MAX:
            # parse_exponent_overflow: an error for a nonzero significand and a positive
            # exponent, a signed zero otherwise.
            if not exp_negative and significand != 0:
                return None
            return -0.0 if negative else 0.0
        explicit = -int(digits) if exp_negative else int(digits)
        exponent = max(-_I32_MAX - 1, min(_I32_MAX, exponent + explicit))  # saturating
    value = _from_parts(significand, exponent)
    if value is None:
        return None
    return -value if negative else value


def exponent_overflow_at(text: str) -> int | None:
    """Where in the JSON number ``text`` serde_json's exponent overflows an i32: the index of
    the digit it stops at (its error's position), or None where it does not."""
    mark = max(text.find("e"), text.find("E"))
    if mark < 0:
        return None
    at = mark + 1
    if at < len(text) and text[at] in "+-":
        at += 1
    exponent = 0
    for index in range(at, len(text)):
        exponent = exponent * 10 + ord(text[index]) - 48
        if exponent > _I32_MAX:
            return index
    return None


def _from_parts(significand: int, exponent: int) -> float | None:
    """serde_json's ``f64_from_parts`` (without ``float_roundtrip``), sign aside."""
    value = float(significand)
    if exponent >= 0:
        if exponent >= len(_POW10):
            return value if value == 0.0 else None
        value *= _POW10[exponent]
        return None if math.isinf(value) else value
    down = -exponent
    while down >= len(_POW10):
        if value == 0.0:
            return value
        value /= 1e308
        down -= 308
    return value / _POW10[down]


def serde_integer(text: str) -> int | None:
    """``text`` as the integer serde_json keeps it as (i64 or u64), or None for an f64."""
    # (Length first: int() of over 4,300 digits raises, and no u64 has over 20.)
    if len(text) <= 21 and text != "-0" and _INTEGER.fullmatch(text):
        value = int(text)
        if _I64_MIN <= value <= _U64_MAX:
            return value
    return None


#: Numbers of at most this many characters that Python reads below :data:`_SURELY_FINITE` in
#: magnitude are in range for serde_json too: its conversion is off by a few units in the last
#: place at most, never by the factor of 10**8 that overflowing would take.
_SHORT_NUMBER: Final = 64
_SURELY_FINITE: Final = 1e300


def number_in_range(text: str) -> bool:
    """Whether serde_json accepts the JSON number ``text`` (no f64 overflow)."""
    if len(text) <= _SHORT_NUMBER:
        # The exact emulation below walks the digits in Python (~2 us a number, which a header
        # of millions of numbers in an unknown field multiplied into seconds).
        try:
            if -_SURELY_FINITE < float(text) < _SURELY_FINITE:
                return True
        except ValueError:  # not a number literal: the exact path says what it makes of it
            pass
    return serde_integer(text) is not None or serde_f64(text) is not None


def unexpected_number(text: str) -> str:
    """serde's ``Unexpected`` for the JSON number ``text``, as in ``invalid type: integer `5```:
    an integer within i64/u64 (but ``-0``) as an integer, anything else as its f64.

    Raises:
        ValueError: serde_json refuses the number as out of range.
    """
    value = serde_integer(text)
    if value is not None:
        return f"integer `{value}`"
    as_float = serde_f64(text)
    if as_float is None:
        raise ValueError(f"number out of range: {text}")
    return f"floating point `{f64_text(as_float)}`"


def f64_text(value: float) -> str:
    """An f64 as serde_json writes it in an error (ryu's shortest digits): Python's ``repr``
    but for the exponent's padding (``1e-9``, not ``1e-09``) and the decade below 1e-4, which
    ryu writes out (``0.00001234``, not ``1.234e-05``)."""
    text = repr(value)
    mantissa, _, exponent = text.partition("e")
    if not exponent:
        return text
    power = int(exponent)
    if power == -5:
        sign = "-" if mantissa.startswith("-") else ""
        return f"{sign}0.0000{mantissa.lstrip('-').replace('.', '')}"
    return f"{mantissa}e{'+' if power > 0 else '-'}{abs(power)}"
