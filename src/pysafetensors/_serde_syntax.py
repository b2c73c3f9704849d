"""serde_json's first syntax error in a header, in its words and at its position.

The reference parses headers with serde_json (``from_str``). Python's ``json`` finds the same
malformed headers malformed, but describes them in its own words, at its own positions (in
characters, where serde counts bytes), and sometimes at another spot: serde says ``key must be
a string`` for ``{"a":1,]``, ``EOF while parsing a list`` for ``[1``, ``invalid number`` for
``1.``, ``expected ident`` for ``tru``. This module walks a header the way serde_json's
parser does (``SliceRead`` with UTF-8 validation, the recursion limit of 128) and reports the
first error it would, so that a refused file reads the same here as there. It runs only once
a header is known to be malformed; a valid header never comes here.

Pure: no I/O, no state between calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from ._serde_number import exponent_overflow_at, number_in_range, unexpected_number

__all__ = [
    "OUT_OF_RANGE",
    "PARSE_ONLY_WORDS",
    "RECURSION_LIMIT",
    "SURROGATE_END",
    "SURROGATE_LEADING",
    "WALK_LIMIT",
    "SyntaxErrorAt",
    "first_syntax_error",
]

#: serde_json's words for what it refuses while merely parsing, whatever the value's type.
OUT_OF_RANGE: Final = "number out of range"
RECURSION_LIMIT: Final = "recursion limit exceeded"
SURROGATE_END: Final = "unexpected end of hex escape"
SURROGATE_LEADING: Final = "lone leading surrogate in hex escape"

#: What a message holds where it is one of those (lone surrogates in names, metadata or
#: ignored fields, nesting past the limit, integers past f64's range).
PARSE_ONLY_WORDS: Final = ("hex escape", RECURSION_LIMIT, OUT_OF_RANGE)

#: serde_json's ``remaining_depth`` at the start: the 128th nested container is refused.
_RECURSION_LIMIT: Final = 128
_WHITESPACE: Final = b" \t\n\r"
_DIGITS: Final = frozenset(b"0123456789")
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
#: Bytes a string runs over without a decision: not a quote, a backslash or a control byte.
_PLAIN_RUN: Final = re.compile(rb'[^"\\\x00-\x1f]*')


@dataclass(frozen=True, slots=True)
class SyntaxErrorAt:
    """One serde_json syntax error."""

    message: str
    """serde_json's ``ErrorCode`` text, e.g. ``"expected `,` or `]`"``."""
    line: int
    column: int
    """1-based line; column in bytes, as serde counts them."""
    typed: bool = False
    """A type error in ``__metadata__``: serde deserializes it where it stands (a map of
    strings), so such an error comes before any syntax error after it. Its ``message`` ends
    with what was expected (``a map``, ``a string``)."""

    def __str__(self) -> str:
        return f"{self.message} at line {self.line} column {self.column}"


class _Found(Exception):  # noqa: N818 - an internal signal, not an error users see
    def __init__(self, message: str, index: int, typed: bool = False) -> None:
        self.message = message
        self.index = index
        self.typed = typed


def position_of_index(data: bytes, index: int) -> tuple[int, int]:
    """serde_json's ``position_of_index``: line of ``index``, and bytes since its start."""
    start = data.rfind(b"\n", 0, index) + 1
    return data.count(b"\n", 0, start) + 1, index - start


class _Walk:
    """serde_json's parser over ``data``, keeping only what decides its errors."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.n = len(data)
        self.pos = 0
        self.remaining_depth = _RECURSION_LIMIT

    # serde's two ways to place an error: after what it consumed, or at what it peeked.
    def error(self, message: str) -> _Found:
        return _Found(message, self.pos)

    def peek_error(self, message: str) -> _Found:
        return _Found(message, min(self.pos + 1, self.n))

    def whitespace(self) -> int | None:
        data, n, pos = self.data, self.n, self.pos
        while pos < n and data[pos] in _WHITESPACE:
            pos += 1
        self.pos = pos
        return data[pos] if pos < n else None

    def peek(self) -> int | None:
        return self.data[self.pos] if self.pos < self.n else None

    def next_byte(self) -> int | None:
        if self.pos >= self.n:
            return None
        self.pos += 1
        return self.data[self.pos - 1]

    # ------------------------------------------------------------------------------ scalars
    def ident(self, rest: bytes) -> None:
        for expected in rest:
            got = self.next_byte()
            if got is None:
                raise self.error("EOF while parsing a value")
            if got != expected:
                raise self.error("expected ident")

    def number(self) -> None:
        start = self.pos - 1 if self.pos and self.data[self.pos - 1] == 0x2D else self.pos
        self.digits()
        text = self.data[start : self.pos].decode("ascii")
        if not number_in_range(text):
            # serde stops at the exponent digit that overflows an i32, else after the number.
            at = exponent_overflow_at(text)
            raise _Found(OUT_OF_RANGE, self.pos if at is None else start + at + 1)

    def digits(self) -> None:
        # parse_integer (after an optional '-', already eaten)
        first = self.next_byte()
        if first is None:
            raise self.error("EOF while parsing a value")
        if first == 0x30:  # '0': only one leading zero
            if self.peek() in _DIGITS:
                raise self.peek_error("invalid number")
        elif first in _DIGITS:
            while self.peek() in _DIGITS:
                self.pos += 1
        else:
            raise self.error("invalid number")
        # parse_number
        if self.peek() == 0x2E:  # '.'
            self.pos += 1
            start = self.pos
            while self.peek() in _DIGITS:
                self.pos += 1
            if self.pos == start:
                if self.peek() is not None:
                    raise self.peek_error("invalid number")
                raise self.peek_error("EOF while parsing a value")
        if self.peek() in (0x65, 0x45):  # 'e', 'E'
            self.pos += 1
            if self.peek() in (0x2B, 0x2D):  # '+', '-'
                self.pos += 1
            digit = self.next_byte()
            if digit is None:
                raise self.error("EOF while parsing a value")
            if digit not in _DIGITS:
                raise self.error("invalid number")
            while self.peek() in _DIGITS:
                self.pos += 1

    def string(self) -> int:
        """A string after its opening quote; returns where its content starts."""
        start = self.pos
        data = self.data
        while True:
            match = _PLAIN_RUN.match(data, self.pos)
            assert match is not None  # the pattern matches the empty string
            self.pos = match.end()
            if self.pos == self.n:
                raise self.error("EOF while parsing a string")
            byte = data[self.pos]
            self.pos += 1
            if byte == 0x22:  # '"'
                return start
            if byte == 0x5C:  # '\\'
                self.escape()
            else:
                raise self.error("control character (\\u0000-\\u001F) found while parsing a string")

    def escape(self) -> None:
        byte = self.next_byte()
        if byte is None:
            raise self.error("EOF while parsing a string")
        if byte in b'"\\/bfnrt':
            return
        if byte != 0x75:  # 'u'
            raise self.error("invalid escape")
        unit = self.hex4()
        if 0xDC00 <= unit <= 0xDFFF:
            raise self.error(SURROGATE_LEADING)
        if not 0xD800 <= unit <= 0xDBFF:
            return
        # A leading surrogate: a trailing one must follow as \uXXXX.
        for expected in (0x5C, 0x75):
            byte = self.peek()
            if byte is None:
                raise self.error("EOF while parsing a string")
            self.pos += 1
            if byte != expected:
                raise self.error(SURROGATE_END)
        if not 0xDC00 <= self.hex4() <= 0xDFFF:
            raise self.error(SURROGATE_LEADING)

    def hex4(self) -> int:
        if self.n - self.pos < 4:
            self.pos = self.n
            raise self.error("EOF while parsing a string")
        digits = self.data[self.pos : self.pos + 4]
        self.pos += 4
        if not all(d in _HEX for d in digits):
            raise self.error("invalid escape")
        return int(digits, 16)

    # ------------------------------------------------------------------------------- values
    def value(self) -> str | None:
        """One value at the cursor: ``"seq"``/``"map"`` when a container opened, else None."""
        byte = self.whitespace()
        if byte is None:
            raise self.peek_error("EOF while parsing a value")
        if byte in (0x6E, 0x74, 0x66):  # n, t, f
            self.pos += 1
            self.ident({0x6E: b"ull", 0x74: b"rue", 0x66: b"alse"}[byte])
            return None
        if byte == 0x2D:  # '-'
            self.pos += 1
            self.number()
            return None
        if byte in _DIGITS:
            self.number()
            return None
        if byte == 0x22:
            self.pos += 1
            self.string()
            return None
        if byte in (0x5B, 0x7B):  # '[', '{'
            self.remaining_depth -= 1
            if self.remaining_depth == 0:
                raise self.peek_error(RECURSION_LIMIT)
            self.pos += 1
            return "seq" if byte == 0x5B else "map"
        raise self.peek_error("expected value")

    def typed_value(self, expected: str) -> str | None:
        """A value of ``__metadata__`` (``expected`` "a map": null or a map) or of one of its
        entries ("a string"), refused by type as soon as serde would: a sequence or map
        unread, a scalar once parsed. Returns ``"map"`` when the metadata map opened."""
        byte = self.whitespace()
        start = self.pos
        if byte == 0x22:  # '"'
            if expected == "a string":
                self.pos += 1
                self.string()
                return None
            found = "string " + _json_text(self.data, start, self)
        elif byte == 0x6E and expected == "a map":  # null: no metadata
            self.value()
            return None
        elif byte == 0x7B and expected == "a map":
            return self.value()
        elif byte == 0x7B:
            raise _Found(f"invalid type: map, expected {expected}", self.pos, typed=True)
        elif byte == 0x5B:  # '['
            raise _Found(f"invalid type: sequence, expected {expected}", self.pos, typed=True)
        elif byte in (0x6E, 0x74, 0x66) or byte == 0x2D or byte in _DIGITS:
            self.value()
            found = _scalar_text(self.data[start : self.pos])
        else:
            self.value()  # raises serde's error for what is there
            raise AssertionError  # pragma: no cover
        raise _Found(f"invalid type: {found}, expected {expected}", self.pos, typed=True)

    def next_item(self, top: list[object], close: int, what: str, separators: str) -> bool:
        """Between items of the open container ``top`` (serde's ``has_next_element`` and
        ``has_next_key``): True when it closes here (its ``close`` byte eaten), else False at
        its next item."""
        byte = self.whitespace()
        if byte is None:
            raise self.peek_error(f"EOF while parsing {what}")
        if byte == close:
            self.pos += 1
            self.remaining_depth += 1
            return True
        if top[1]:
            top[1] = False
            return False
        if byte != 0x2C:  # ','
            raise self.peek_error(f"expected {separators}")
        self.pos += 1
        after = self.whitespace()
        if after == close:
            raise self.peek_error("trailing comma")
        if after is None:
            raise self.peek_error("EOF while parsing a value")
        return False

    def document(self) -> None:
        """Walk the whole document."""
        # Open containers, innermost last: [kind, first element still to come, is __metadata__].
        stack: list[list[object]] = []
        seen_metadata = False
        opened = self.value()
        if opened is not None:
            stack.append([opened, True, False])
        while stack:
            top = stack[-1]
            if top[0] == "seq":
                if self.next_item(top, 0x5D, "a list", "`,` or `]`"):
                    stack.pop()
                    continue
                opened = self.value()
            else:
                if self.next_item(top, 0x7D, "an object", "`,` or `}`"):
                    stack.pop()
                    continue
                if self.peek() != 0x22:
                    raise self.peek_error("key must be a string")
                self.pos += 1  # the key's opening quote
                key_start = self.string()
                is_metadata = len(stack) == 1 and _is_metadata_key(self.data[key_start : self.pos])
                if is_metadata and seen_metadata:
                    raise _Found("duplicate field `__metadata__`", self.pos, typed=True)
                colon = self.whitespace()
                if colon is None:
                    raise self.peek_error("EOF while parsing an object")
                if colon != 0x3A:  # ':'
                    raise self.peek_error("expected `:`")
                self.pos += 1
                if is_metadata:
                    seen_metadata = True
                    opened = self.typed_value("a map")
                    if opened is not None:
                        stack.append([opened, True, True])
                    continue
                opened = self.typed_value("a string") if top[2] else self.value()
            if opened is not None:
                stack.append([opened, True, False])


def _json_text(data: bytes, start: int, walk: _Walk) -> str:
    """The string at ``start`` (its opening quote), parsed by ``walk``, as serde shows it."""
    import json

    walk.pos = start + 1
    walk.string()
    return debug_str(json.loads(data[start : walk.pos].decode("utf-8", "surrogatepass")))


#: Characters Rust's ``str`` Debug writes as a short escape.
_DEBUG_SHORT: Final = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"'}
#: Unicode's Other_Grapheme_Extend as the reference's Rust has it (Unicode 16): marks of
#: categories other than Mn/Me that it escapes too (with Mn and Me, its Grapheme_Extend);
#: checked against the reference over every code point.
_OTHER_GRAPHEME_EXTEND: Final = frozenset(
    [0x09BE, 0x09D7, 0x0B3E, 0x0B57, 0x0BBE, 0x0BD7, 0x0CC0, 0x0CC2, 0x0CC7, 0x0CC8, 0x0CCA]
    + [0x0CCB, 0x0CD5, 0x0CD6, 0x0D3E, 0x0D57, 0x0DCF, 0x0DDF, 0x1715, 0x1734, 0x1B35, 0x1B3B]
    + [0x1B3D, 0x1B43, 0x1B44, 0x1BAA, 0x1BF2, 0x1BF3, 0x200C, 0x302E, 0x302F, 0xA953, 0xA9C0]
    + [0xFF9E, 0xFF9F, 0x111C0, 0x11235, 0x1133E, 0x1134D, 0x11357, 0x114B0, 0x114BD, 0x115AF]
    + [0x116B6, 0x11930, 0x1193D, 0x16FF0, 0x16FF1, 0x1D165, 0x1D166, 0x1D16D]
    + [*range(0x1D16E, 0x1D173), *range(0xE0020, 0xE0080)]
)
#: Mn in Python 3.11's Unicode tables, a spacing mark (not Grapheme_Extend) in the reference's.
_NOT_GRAPHEME_EXTEND: Final = frozenset([0x1171E])


def _grapheme_extend(char: str) -> bool:
    """Whether ``char`` is Grapheme_Extend (a mark joining the character before it), as the
    reference's Rust tables have it."""
    import unicodedata

    if char <= "\x7f":
        return False
    code = ord(char)
    if code in _OTHER_GRAPHEME_EXTEND:
        return True
    return unicodedata.category(char) in ("Mn", "Me") and code not in _NOT_GRAPHEME_EXTEND


def debug_str(text: str) -> str:
    """``text`` as Rust's ``{:?}`` writes a ``str`` (serde's ``invalid type: string "..."``).

    Short escapes for NUL, tab, CR, LF, backslash and the double quote; ``\\u{hex}`` for
    characters that do not print (the categories Rust and Python agree on: controls, format
    characters, separators but the space, unassigned and private-use code points) and for
    combining marks (Grapheme_Extend), which would otherwise join the character before them.
    Characters assigned after Python's own Unicode tables (14.0 in 3.11) count as unassigned.
    """
    out = ['"']
    for char in text:
        short = _DEBUG_SHORT.get(char)
        if short is not None:
            out.append(short)
        elif not char.isprintable() or _grapheme_extend(char):
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _scalar_text(literal: bytes) -> str:
    """serde's ``Unexpected`` for a number or literal the walk has checked."""
    if literal in (b"null", b"true", b"false"):
        return "null" if literal == b"null" else f"boolean `{literal.decode()}`"
    return unexpected_number(literal.decode())


def _is_metadata_key(raw: bytes) -> bool:
    """Whether a key (its bytes from after the opening quote through the colon) decodes to
    ``__metadata__``, escapes included."""
    import json

    quoted = raw[: raw.rindex(b'"') + 1]
    if b"\\" not in quoted:
        return quoted == b'__metadata__"'
    try:
        return bool(json.loads(b'"' + quoted) == "__metadata__")
    except ValueError:  # pragma: no cover - the walk checked the string already
        return False


#: Headers walked at most (only malformed ones are walked): the walk costs 0.15-0.55 s a MiB
#: in Python (names and strings fast, long runs of numbers slow), so refusing a malformed
#: header this large takes at most a few seconds, where a 100 MB one would take a minute.
#: Real headers stay far below it (20,000 tensors: 2 MiB). Larger ones keep Python's wording
#: and position.
WALK_LIMIT: Final = 8 << 20


def first_syntax_error(data: bytes) -> SyntaxErrorAt | None:
    """serde_json's first syntax error in ``data`` (a header's bytes), or None (also for a
    header over :data:`WALK_LIMIT` bytes, which is not walked).

    Type errors are not looked for (a document can be well formed and still not a header),
    but for ``__metadata__``'s (see :attr:`SyntaxErrorAt.typed`); numbers are checked as
    serde converts them (:mod:`._serde_number`). After the top-level value,
    anything but whitespace is ``trailing characters``.
    """
    if len(data) > WALK_LIMIT:
        return None
    walk = _Walk(data)
    try:
        walk.document()
        if walk.whitespace() is not None:
            raise walk.peek_error("trailing characters")
    except _Found as found:
        line, column = position_of_index(data, found.index)
        return SyntaxErrorAt(found.message, line, column, found.typed)
    return None
