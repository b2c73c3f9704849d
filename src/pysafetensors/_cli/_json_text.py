"""JSON text as ``json.dumps(obj, indent=2, ensure_ascii=True, allow_nan=False)`` writes it,
in pieces to write as they come, several times faster for documents of many small rows.

With ``indent``, Python's ``json`` takes its pure-Python encoder: generators nested one per
level of the document, each piece (a key, a separator, a number) passed up through all of them.
A row of ``hash``'s output, four keys and a shape, cost ~15 us that way: 1.5 s of a 100,000-tensor
model's 4 s. Here a small container (at most :data:`_SMALL_ITEMS` values in all, however
nested) is written as one string by plain recursion, and only larger ones, or lists made as they
are written (``LazyRows``, whose items may be many), are taken apart into pieces, so that memory
stays that of one small container at a time. The text is the same, character for character
(tested against ``json.dumps``), and so are the errors for values ``json`` refuses: a NaN or
infinity raises ``ValueError``, a value ``json`` cannot write ``TypeError``.

Not checked for cycles, which ``json`` refuses with ``ValueError("Circular reference
detected")``: the commands' documents are trees. A cycle would end in ``RecursionError``, and
so does nesting some 600 levels deep, where ``json`` goes on to about 900 (the commands'
documents are a few levels deep).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from json.encoder import encode_basestring_ascii
from typing import Any, Final

__all__ = ["json_pieces"]

#: Values (scalars and containers) a container may hold in all to be written as one string.
_SMALL_ITEMS: Final = 256

_INDENT: Final = "  "


class _TooLarge(Exception):
    """A container holds more than :data:`_SMALL_ITEMS` values, or a list made as it is
    written: taken apart into pieces instead."""


#: A string as ``json`` writes it.
_encode: Callable[[str], str] = encode_basestring_ascii


def _scalar(value: Any) -> str | None:
    """A scalar's text, as ``json`` writes it; None for a container."""
    if isinstance(value, str):
        return _encode(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, (list, tuple, dict)):
        return None
    raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")


_INF: Final = float("inf")


def _key(key: Any) -> str | None:
    """A dict key's text as ``json`` writes it (numbers and constants as strings); None for a
    key it cannot take (``json`` raises TypeError for those: so does the caller)."""
    if isinstance(key, str):
        return str(encode_basestring_ascii(key))
    if isinstance(key, float):
        text = _scalar(key)
        assert text is not None
        return str(encode_basestring_ascii(text))
    if key is True or key is False or key is None:
        return '"' + ("true" if key is True else "false" if key is False else "null") + '"'
    if isinstance(key, int):
        return '"' + int.__repr__(key) + '"'
    return None


def _bad_key(key: Any) -> TypeError:
    return TypeError(f"keys must be str, int, float, bool or None, not {key.__class__.__name__}")


def _float_text(value: float) -> str:
    """A float (or an instance of a subclass, from :func:`_scalar`) as ``json`` writes it."""
    if value != value or value in (_INF, -_INF):
        raise ValueError("Out of range float values are not JSON compliant: " + repr(value))
    return float.__repr__(value)


#: How values of these exact types are written, without a call of :func:`_small` each (most
#: of a document's values): subclasses go through :func:`_scalar`, as ``json`` treats them.
_WRITERS: Final[dict[type, Callable[[Any], str]]] = {
    str: _encode,
    int: int.__repr__,
    bool: {True: "true", False: "false"}.__getitem__,
    type(None): {None: "null"}.__getitem__,
    float: _float_text,
}


def _small(value: Any, level: int, budget: list[int]) -> str:
    """``value``'s whole text at indent ``level``; raises :class:`_TooLarge` past the budget
    (a one-item list, shared by the recursion: the values still allowed, each container's
    items taken from it at once). Scalars of the plain types are written without a call of
    this function (:data:`_WRITERS`)."""
    kind = type(value)
    if kind is not dict and kind is not list and kind is not tuple:
        text = _scalar(value)
        if text is None:  # a LazyRows, or another subclass of list or dict: pieces
            raise _TooLarge
        return text
    budget[0] -= len(value)
    if budget[0] < 0:
        raise _TooLarge
    if not value:
        return "{}" if kind is dict else "[]"
    inner = "\n" + _INDENT * (level + 1)
    level += 1
    writers = _WRITERS
    if kind is dict:
        parts = []
        for k, v in value.items():
            key = _encode(k) if type(k) is str else _key(k)
            if key is None:
                raise _bad_key(k)
            write = writers.get(type(v))
            parts.append(key + ": " + (write(v) if write else _small(v, level, budget)))
        return "{" + inner + ("," + inner).join(parts) + "\n" + _INDENT * (level - 1) + "}"
    items = [
        write(v) if (write := writers.get(type(v))) else _small(v, level, budget) for v in value
    ]
    return "[" + inner + ("," + inner).join(items) + "\n" + _INDENT * (level - 1) + "]"


def _text_or_pieces(value: Any, level: int, before: str = "") -> Iterator[str]:
    """``value`` at ``level`` after ``before`` (its separator): one string if it is small,
    else its pieces."""
    try:
        yield before + _small(value, level, [_SMALL_ITEMS])
    except _TooLarge:
        if before:
            yield before
        yield from _pieces(value, level)


def _pieces(value: Any, level: int) -> Iterator[str]:
    """A container's text in pieces (its items each whole where small)."""
    text = _scalar(value)
    if text is not None:
        yield text
        return
    if not value:
        yield "{}" if isinstance(value, dict) else "[]"
        return
    inner = "\n" + _INDENT * (level + 1)
    level += 1
    if isinstance(value, dict):
        first = True
        for k, v in value.items():
            key = _key(k)
            if key is None:
                raise _bad_key(k)
            yield from _text_or_pieces(v, level, ("{" if first else ",") + inner + key + ": ")
            first = False
        yield "\n" + _INDENT * (level - 1) + "}"
        return
    before, between, writers = "[" + inner, "," + inner, _WRITERS
    for v in value:  # _text_or_pieces inlined: a generator per row cost a fifth of a row
        write = writers.get(type(v))
        if write is not None:
            # A number or a string (a histogram's edges and counts: a million of them): no
            # call of _small, which made such lists 35-50% slower than json's own encoder.
            yield before + write(v)
        else:
            try:
                yield before + _small(v, level, [_SMALL_ITEMS])
            except _TooLarge:
                yield before
                yield from _pieces(v, level)
        before = between
    yield "\n" + _INDENT * (level - 1) + "]"


def json_pieces(obj: Any) -> Iterator[str]:
    """The text of ``obj`` as ``json.dumps(obj, indent=2, ensure_ascii=True,
    allow_nan=False)`` writes it, in pieces: lists and dicts (and their subclasses, such as
    lists whose items are made as they are iterated) of strings, numbers, booleans and None.
    Tuples are written as lists, as ``json`` does."""
    return _text_or_pieces(obj, 0)
