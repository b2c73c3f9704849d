"""Signatures as ``help()``, IDEs and :func:`inspect.signature` show them."""

from __future__ import annotations

import inspect


def show_init_signature(cls: type) -> None:
    """Show ``cls(...)`` with its ``__init__``'s parameters.

    A class that defines ``__new__(cls, *args, **kwargs)`` (to dispatch, or to word argument
    errors as the reference does) is otherwise shown as taking ``(*args, **kwargs)``: the
    documented parameters disappear from ``help()`` and from completion.
    """
    init = inspect.signature(cls.__dict__["__init__"])
    parameters = list(init.parameters.values())[1:]  # less self
    shown = init.replace(parameters=parameters, return_annotation=inspect.Signature.empty)
    cls.__signature__ = shown  # type: ignore[attr-defined]
