"""Signatures as ``help()``, IDEs and :func:`inspect.signature` show them."""

from __future__ import annotations

import inspect
from typing import Any


class _InitSignature:
    """``cls.__signature__`` for a class and its subclasses: the parameters of the ``__init__``
    the class (or the nearest base) defines, less ``self``."""

    def __get__(self, obj: object, owner: type) -> inspect.Signature | None:
        if obj is not None:
            return None  # an instance: inspect's own rules
        init: Any = next(c.__dict__["__init__"] for c in owner.__mro__ if "__init__" in c.__dict__)
        shown = inspect.signature(init)
        parameters = list(shown.parameters.values())[1:]  # less self
        return shown.replace(parameters=parameters, return_annotation=inspect.Signature.empty)


def show_init_signature(cls: type) -> None:
    """Show ``cls(...)`` (and a subclass's) with its ``__init__``'s parameters.

    A class that defines ``__new__(cls, *args, **kwargs)`` (to dispatch, or to word argument
    errors as the reference does) is otherwise shown as taking ``(*args, **kwargs)``: the
    documented parameters disappear from ``help()`` and from completion.
    """
    cls.__signature__ = _InitSignature()  # type: ignore[attr-defined]
