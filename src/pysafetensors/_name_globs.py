"""Choosing tensors by shell globs of their names, for many names and many globs at once.

``any(fnmatchcase(name, g) for g in globs)`` per name cost ~1 us per glob and name: extracting
a list of 1,000 names from a file of 100,000 tensors took 30 s. Globs without wildcards are
exact names, looked up in a set; the rest are compiled into one expression.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable

__all__ = ["glob_matcher"]

#: The characters that make a glob more than an exact name (``fnmatch``'s rules: no escapes).
_WILDCARDS = frozenset("*?[")


def glob_matcher(globs: Iterable[str]) -> Callable[[str], bool]:
    """A predicate: whether a name matches at least one of ``globs`` as a whole, by
    :func:`fnmatch.fnmatchcase`'s rules (case-sensitive; ``*``, ``?``, ``[...]``).

    Example:
        >>> accept = glob_matcher(["model.norm.weight", "model.layers.0.*"])
        >>> [accept(n) for n in ("model.norm.weight", "model.layers.0.q", "model.layers.1.q")]
        [True, True, False]
    """
    exact: set[str] = set()
    wild: list[str] = []
    for glob in globs:
        if _WILDCARDS.intersection(glob):
            wild.append(glob)
        else:
            exact.add(glob)
    if not wild:
        return exact.__contains__
    # Each translation is anchored at its end (``\Z``) and match() anchors every alternative
    # at the start: a name matches the expression exactly when it matches one of the globs.
    match = re.compile("|".join(fnmatch.translate(glob) for glob in wild)).match
    return lambda name: name in exact or match(name) is not None
