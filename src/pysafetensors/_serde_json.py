"""JSON values as serde_json reads them: numbers, repeated keys, surrogates, nesting, and its
words for what it refuses. Pure: no I/O.

Python's ``json`` module decodes the header; the hooks here make it keep what serde_json would
see (every pair of a repeated key, floats that are not integers, numbers out of f64 range) and
the checks here find what serde_json refuses while merely parsing. :mod:`._serde_number` and
:mod:`._serde_syntax` hold the number rules and the syntax errors; :mod:`._format` applies all
of it to a header.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import chain
from typing import Any, Final

from ._dtypes import UINT64_MAX
from ._serde_number import f64_text, number_in_range, serde_integer, unexpected_number
from ._serde_syntax import (
    OUT_OF_RANGE,
    RECURSION_LIMIT,
    SURROGATE_END,
    SURROGATE_LEADING,
    debug_str,
)

__all__ = [
    "MAYBE_NEG_ZERO",
    "MAYBE_SURROGATE",
    "JsonObject",
    "all_u64",
    "big_int_problem",
    "decoder_for",
    "is_u64",
    "reject_constant",
    "scan_value",
    "serde_syntax_message",
    "surrogate_message",
    "unexpected",
]


class JsonObject(dict[str, Any]):
    """A JSON object that keeps every ``(key, value)`` pair when a key appears more than once.

    serde deserializes each occurrence of a repeated key (and fails on a bad one) before the
    last one wins, so validation must see the earlier values too, not only the dict's.
    """

    __slots__ = ("dup_pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.dup_pairs: list[tuple[str, Any]] | None = pairs if len(self) != len(pairs) else None

    def pairs(self) -> list[tuple[str, Any]]:
        """Every pair in document order, repeated keys included."""
        return self.dup_pairs if self.dup_pairs is not None else list(self.items())


class _NotInt:
    """A JSON number that serde_json reads as a float (``1.0``, ``1e1``, ``-0``, ``2**64``)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


#: Float literals this short have at most 15 significant digits; where their power of ten is
#: also exact (10**22 at most, either way), serde's f64 arithmetic (the significand times or
#: over that power) rounds once, as ``float()`` does, so the value can stand for the literal.
_EXACT_FLOAT: Final = 16


def _parse_float(text: str) -> float | _NotInt:
    if len(text) <= _EXACT_FLOAT:
        # A float (24 bytes) instead of the text in a wrapper (~100): a header of millions
        # of numbers in an unknown field is held whole while it is checked.
        if "e" not in text and "E" not in text:
            return float(text)  # 15 decimals at most: the power is exact
        mantissa, _, exponent = text.lower().partition("e")
        if -22 <= int(exponent) - len(mantissa.partition(".")[2]) <= 22:
            return float(text)
    if not number_in_range(text):
        raise ValueError(OUT_OF_RANGE)
    return _NotInt(text)


#: Every ``-0`` of a header: one object, not one each (a 100 MB header of ``-0,`` held 33
#: million wrappers, over 4 GB).
_NEG_ZERO: Final = _NotInt("-0")


def _parse_int(text: str) -> int | _NotInt:
    # serde_json reads "-0" as the float -0.0, and integers outside u64/i64 as f64 (which may
    # overflow), so neither is an integer there.
    if text == "-0":
        return _NEG_ZERO
    if len(text) <= 19:
        return int(text)  # at most 19 digits: within u64 or i64 whatever they are
    value = serde_integer(text)
    if value is not None:
        return value
    if not number_in_range(text):
        raise ValueError(OUT_OF_RANGE)
    return _NotInt(text)


def reject_constant(name: str) -> Any:
    """A decoder hook that refuses ``NaN`` and ``Infinity`` in serde_json's words."""
    # serde_json has no NaN/Infinity literals: "-Infinity" fails inside its number parser.
    raise ValueError("invalid number" if name.startswith("-") else "expected value")


_DECODER: Final = json.JSONDecoder(
    object_pairs_hook=JsonObject, parse_float=_parse_float, parse_constant=reject_constant
)
_DECODER_SLOW: Final = json.JSONDecoder(
    object_pairs_hook=JsonObject,
    parse_float=_parse_float,
    parse_int=_parse_int,
    parse_constant=reject_constant,
)


# Cheap pre-check that decides whether the slower integer hook is needed at all ("-0" may also
# be inside a string; the slow path is still exact). Integers too large for u64 are left to the
# C scanner and checked afterwards: a regex for long digit runs costs seconds on a 100 MB header.
MAYBE_NEG_ZERO: Final = re.compile(r"-0(?![0-9.eE])")


def decoder_for(text: str) -> json.JSONDecoder:
    """The decoder for ``text``: the slower one, whose integer hook reads ``-0`` as serde_json
    does, only where the text may hold one."""
    return _DECODER_SLOW if MAYBE_NEG_ZERO.search(text) else _DECODER


#: Finds an escape that may be a surrogate (``\\ud800``-``\\udfff``): such a text needs the
#: slower checks.
MAYBE_SURROGATE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


#: serde_json's recursion limit: with the top-level object, 127 nested arrays/objects parse and
#: 128 fail (found by testing the reference: 125 nested arrays in an unknown tensor field pass).
_MAX_DEPTH: Final = 127


def _describe(value: Any) -> str:
    """Render a value as serde's ``Unexpected`` does (``integer `5```, ``string "x"``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return unexpected_number(str(value))
    if isinstance(value, _NotInt):
        return unexpected_number(value.text)
    if isinstance(value, float):  # a short float literal (see _parse_float)
        return f"floating point `{f64_text(value)}`"
    if isinstance(value, str):
        return f"string {debug_str(value)}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def unexpected(value: Any, expected: str, *, invalid: str = "type") -> str:
    """serde's error for a value it cannot take: ``invalid type: <value>, expected <what>``; or
    ``number out of range`` for an integer too large even for an f64, which serde_json refuses
    while parsing, before any type is checked."""
    if type(value) is int and not number_in_range(str(value)):
        return OUT_OF_RANGE
    return f"invalid {invalid}: {_describe(value)}, expected {expected}"


def serde_syntax_message(exc: json.JSONDecodeError) -> str:
    """Translate a ``json`` syntax error into serde_json's wording for the same problem."""
    msg, text, pos = exc.msg, exc.doc, exc.pos
    at_eof = not text[pos:].strip(" \t\r\n")
    if msg.startswith("Expecting value"):
        if at_eof:
            return "EOF while parsing a value"
        before = text[:pos].rstrip(" \t\r\n")
        if before.endswith(","):
            closing = text[pos:].lstrip(" \t\r\n")[:1] in ("]", "}")
            return "trailing comma" if closing else "expected value"
        return "expected value"
    if msg.startswith("Extra data"):
        return "trailing characters"
    if msg.startswith("Expecting property name"):
        if at_eof:
            return "EOF while parsing an object"
        if text[:pos].rstrip(" \t\r\n").endswith(","):
            return "trailing comma"
        return "key must be a string"
    if msg.startswith("Expecting ',' delimiter"):
        if at_eof:
            return "EOF while parsing a value"
        if pos > 0 and text[pos - 1] == "0" and text[pos : pos + 1].isdigit():
            return "invalid number"  # a leading zero such as 016
        return "expected `,` or `}`"
    if msg.startswith("Expecting ':' delimiter"):
        return "EOF while parsing an object" if at_eof else "expected `:`"
    if msg.startswith("Unterminated string"):
        return "EOF while parsing a string"
    if msg.startswith("Invalid control character"):
        return "control character (\\u0000-\\u001F) found while parsing a string"
    if msg.startswith("Invalid \\"):
        return "invalid escape"
    return msg  # pragma: no cover - every message of the stdlib scanner is mapped above


def is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= UINT64_MAX


def all_u64(values: list[Any]) -> bool:
    """Whether every value is an ``int`` that fits a u64 (``bool`` is not one)."""
    return all(type(value) is int and 0 <= value <= UINT64_MAX for value in values)


def surrogate_message(value: str) -> str | None:
    found = _SURROGATE.search(value)
    if found is None:
        return None
    # serde_json: a high surrogate not followed by an escape ends the escape early; a low one
    # first is "lone leading".
    if found.group() < "\udc00":
        return SURROGATE_END
    return SURROGATE_LEADING


def scan_value(value: Any, check_surrogates: bool, depth: int) -> str | None:
    """What serde_json refuses while merely parsing a value: lone surrogates, deep nesting.

    ``depth`` counts the containers around ``value``. Iterative, so that it works for values
    nested as deep as the ``json`` module allows, and in document order (serde reports the
    first problem it meets). A stack of iterators, one per open container, rather than an
    item per element: a list of millions of numbers took a tuple each (~50 bytes a number).
    """
    stack: list[tuple[Iterator[Any], int]] = [(iter((value,)), depth)]
    while stack:
        items, level = stack[-1]
        for item in items:
            if isinstance(item, str):
                if check_surrogates:
                    problem = surrogate_message(item)
                    if problem:
                        return problem
            elif type(item) is int:
                problem = big_int_problem(item)
                if problem == OUT_OF_RANGE:
                    return problem
            elif isinstance(item, dict):
                if level + 1 > _MAX_DEPTH:
                    return RECURSION_LIMIT
                if not item:
                    continue  # nothing inside (a field of millions of {} took 4 us each)
                pairs = item.pairs() if isinstance(item, JsonObject) else item.items()
                stack.append((chain.from_iterable(pairs), level + 1))  # key, value, key...
                break
            elif isinstance(item, list):
                if level + 1 > _MAX_DEPTH:
                    return RECURSION_LIMIT
                if not item:
                    continue
                stack.append((iter(item), level + 1))
                break
        else:
            stack.pop()
    return None


def big_int_problem(item: int) -> str | None:
    """serde_json reads integers outside u64/i64 as f64: out of range, or not an integer."""
    if -(1 << 63) <= item <= UINT64_MAX:
        return None
    if not number_in_range(str(item)):
        return OUT_OF_RANGE
    return f"invalid type: {unexpected_number(str(item))}"
