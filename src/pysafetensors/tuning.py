"""Process-wide choices of how files are read and written.

Every default is the strategy measured fastest on Linux (see ``docs/performance.md``); these
switches pick another one explicitly. Choices that belong to one call stay that call's
arguments (``backend=``, ``threads=``, ``fsync=``); what is here applies to every call in the
process:

* ``hugepage_destinations``: fresh memory for large eager reads. ``"auto"`` (default) asks
  for transparent huge pages for destinations of 4 MiB or more and falls back to 4 KiB pages
  while huge pages fault in slowly; ``True`` always asks for them (numpy's own behaviour);
  ``False`` never does.
* ``direct_reads``: ``True`` (default) reads large runs of a file that are mostly not in the
  page cache (a cold tensor-parallel row split, a cold ``read_into`` or in-place
  ``load_model``) with direct I/O (``O_DIRECT``), which skips the page cache; ``False`` reads
  everything through it, so that other processes reading the same file share the pages.
* ``prefetch``: ``True`` (default) reads a large, mostly uncached span of a memory-mapped
  file into the page cache on the reader threads before a slice is copied out of it (a
  column split of a cold file); ``False`` leaves the page faults of the copy to read it.
* ``read_threads``: reader threads for large positioned reads (``backend="pread"``, eager
  loads, row splits, ``read_into``) when a call does not say (``safe_open(threads=N)`` does).
  ``0`` (default) means ``min(8, 2 x cores)``, at least 2; more threads help cold caches and
  network filesystems (more requests in flight), on a warm cache two per core is enough. At
  most :data:`MAX_READ_THREADS`. A ``pread`` handle keeps the count in force when it was
  opened.
* ``preallocate``: ``True`` reserves a saved file's space before writing it, in every save
  (the streaming writers and ``reshard``/``merge``/``extract`` too; ``posix_fallocate``: a
  full disk or a file size limit fails before anything is written, but buffered writes into
  the reserved space were about 2x slower on ext4); ``False`` (default) does not.

Each can also be set before the process starts, by environment variables read when this
module is first imported: ``PYSAFETENSORS_HUGEPAGES`` (``auto``, or a switch),
``PYSAFETENSORS_DIRECT_READS``, ``PYSAFETENSORS_PREFETCH`` and ``PYSAFETENSORS_PREALLOCATE``
(a switch: ``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``), and
``PYSAFETENSORS_READ_THREADS`` (a count, ``0`` for the default).

Example:
    >>> from pysafetensors import tuning
    >>> previous = tuning.configure(direct_reads=False)
    >>> tuning.settings().direct_reads
    False
    >>> _ = tuning.configure(**previous.as_dict())
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal

__all__ = ["MAX_READ_THREADS", "Settings", "configure", "configured", "settings"]

#: The most reader threads a process keeps, whatever a setting or ``threads=`` asks for.
MAX_READ_THREADS: Final = 64

HugePages = bool | Literal["auto"]

_TRUE: Final = frozenset({"1", "on", "true", "yes"})
_FALSE: Final = frozenset({"0", "off", "false", "no"})


@dataclasses.dataclass(frozen=True)
class Settings:
    """The strategies in force (see the module's documentation for each)."""

    hugepage_destinations: HugePages = "auto"
    direct_reads: bool = True
    prefetch: bool = True
    read_threads: int = 0
    preallocate: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The settings as keyword arguments for :func:`configure`."""
        return dataclasses.asdict(self)


def _checked(name: str, value: object) -> Any:
    """``value`` if it is allowed for setting ``name``, else a ``ValueError`` naming both."""
    if name == "read_threads":
        if type(value) is not int or not 0 <= value <= MAX_READ_THREADS:
            raise ValueError(
                f"tuning: read_threads must be an int from 0 (the default count) to"
                f" {MAX_READ_THREADS} (got {value!r})"
            )
        return value
    allowed: tuple[object, ...] = (
        (True, False, "auto") if name == "hugepage_destinations" else (True, False)
    )
    # ``1 == True``, so compare types too: an int or a string in place of a bool is a mistake.
    if not any(value is a or (type(value) is str and value == a) for a in allowed):
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"tuning: {name} must be one of {choices} (got {value!r})")
    return value


def _from_environment(environ: Mapping[str, str]) -> Settings:
    """The defaults, overridden by the ``PYSAFETENSORS_*`` variables that are set.

    Each value is read as the setting's type and then checked by :func:`_checked`, the one
    place that knows what each setting allows; a refusal names the variable.
    """
    found: dict[str, Any] = {}
    for variable, name in (
        ("PYSAFETENSORS_HUGEPAGES", "hugepage_destinations"),
        ("PYSAFETENSORS_DIRECT_READS", "direct_reads"),
        ("PYSAFETENSORS_PREFETCH", "prefetch"),
        ("PYSAFETENSORS_READ_THREADS", "read_threads"),
        ("PYSAFETENSORS_PREALLOCATE", "preallocate"),
    ):
        raw = environ.get(variable)
        if raw is None or raw.strip() == "":
            continue
        text = raw.strip().lower()
        value: object
        if name == "read_threads":
            # ASCII digits only: ``str.isdigit`` also accepts ``"²"``, which ``int`` refuses.
            value = int(text) if text.isascii() and text.isdigit() else text
            expected = f"a count from 0 to {MAX_READ_THREADS}"
        else:
            value = True if text in _TRUE else False if text in _FALSE else text
            expected = "1, on, true, yes, 0, off, false, no"
            if name == "hugepage_destinations":
                expected += ", auto"
        try:
            found[name] = _checked(name, value)
        except ValueError:
            raise ValueError(
                f"environment variable {variable}={raw!r}: expected {expected}"
            ) from None
    return dataclasses.replace(Settings(), **found)


# Read by the readers and the writer at every call: one attribute lookup, and replaced whole
# (never mutated), so a thread sees either the old settings or the new ones.
_current: Settings = _from_environment(os.environ)
# Two threads configuring at once must not lose one's change (a read-modify-write).
_CONFIGURE_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    # A child forked while another thread configured would wait for the lock forever.
    global _CONFIGURE_LOCK
    _CONFIGURE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def settings() -> Settings:
    """The strategies in force now."""
    return _current


def configure(
    *,
    hugepage_destinations: HugePages | None = None,
    direct_reads: bool | None = None,
    prefetch: bool | None = None,
    read_threads: int | None = None,
    preallocate: bool | None = None,
) -> Settings:
    """Change some strategies for the whole process; ``None`` leaves one as it is.

    Args:
        hugepage_destinations: ``"auto"``, ``True`` or ``False``.
        direct_reads: ``True`` or ``False``.
        prefetch: ``True`` or ``False``.
        read_threads: ``0`` (the default count) to :data:`MAX_READ_THREADS`.
        preallocate: ``True`` or ``False``.

    Returns:
        The settings that were in force before, to restore them with
        ``configure(**previous.as_dict())``.

    Raises:
        ValueError: A value that is not one of the allowed ones (nothing is changed).
    """
    return _apply(
        _named(
            hugepage_destinations=hugepage_destinations,
            direct_reads=direct_reads,
            prefetch=prefetch,
            read_threads=read_threads,
            preallocate=preallocate,
        )
    )


def _named(**settings: object) -> dict[str, Any]:
    """The settings given (not None), each checked (a refusal changes nothing)."""
    return {name: _checked(name, value) for name, value in settings.items() if value is not None}


def _apply(changes: Mapping[str, Any]) -> Settings:
    """Put ``changes`` in force; the settings in force before."""
    global _current
    with _CONFIGURE_LOCK:
        previous = _current
        _current = dataclasses.replace(previous, **changes)
    return previous


@contextlib.contextmanager
def configured(
    *,
    hugepage_destinations: HugePages | None = None,
    direct_reads: bool | None = None,
    prefetch: bool | None = None,
    read_threads: int | None = None,
    preallocate: bool | None = None,
) -> Iterator[Settings]:
    """:func:`configure` for the duration of a ``with`` block, then restore what was there.

    The change is process-wide while the block runs: reads and saves in other threads see it
    too. Leaving the block restores only the settings it named, and only those still holding
    the block's value: a change made meanwhile (by another thread, or inside the block by
    :func:`configure`) stays.

    Yields:
        The settings in force inside the block.
    """
    # What this block puts in force: the settings it names.
    applied = _named(
        hugepage_destinations=hugepage_destinations,
        direct_reads=direct_reads,
        prefetch=prefetch,
        read_threads=read_threads,
        preallocate=preallocate,
    )
    previous = _apply(applied)
    try:
        yield _current
    finally:
        _restore(previous, applied)


def _restore(previous: Settings, applied: Mapping[str, object]) -> None:
    """Put back ``previous``'s value of each setting in ``applied`` that still holds the value
    ``applied`` gives it (the same object and type: ``1`` is not ``True``)."""
    global _current
    with _CONFIGURE_LOCK:
        untouched = {
            name: getattr(previous, name)
            for name, value in applied.items()
            if type(getattr(_current, name)) is type(value) and getattr(_current, name) == value
        }
        _current = dataclasses.replace(_current, **untouched)
