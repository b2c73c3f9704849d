"""The exception hierarchy of pysafetensors.

Every error the library raises about a file's content or about misuse of its API derives from
:class:`SafetensorError`, the name the reference implementation uses, so ``except
SafetensorError`` keeps working after switching imports. Subclasses also derive from the stdlib
category they belong to, so ``except ValueError`` or ``except KeyError`` catch them too::

    SafetensorError(Exception)
    ├── HeaderError(SafetensorError, ValueError)          the file is malformed
    │   ├── HeaderSizeError       length prefix: too small, too large, past the end of the file
    │   ├── HeaderDecodeError     not UTF-8, not JSON, or JSON of the wrong shape
    │   ├── TensorInfoError       shape x dtype disagrees with the span, overflow, sub-byte misfit
    │   └── OffsetError           holes, overlaps, buffer not exactly covered
    ├── TensorNotFoundError(SafetensorError, KeyError)    no tensor of that name
    ├── DTypeNotSupportedError(SafetensorError, TypeError) the framework cannot hold that dtype
    ├── SliceError(SafetensorError, IndexError)           an index the slicer cannot serve
    │   ├── SliceTypeError(SliceError, TypeError)         an item or bound of no index type
    │   └── SliceValueError(SliceError, ValueError)       a slice step that is not positive
    ├── SerializeError(SafetensorError, ValueError)       input that cannot be written
    │   ├── SharedTensorsError(SerializeError, RuntimeError) tensors share memory
    │   ├── UnstorableDTypeError(SerializeError, KeyError) a dtype no safetensors code names
    │   ├── MetaTensorError(SerializeError, NotImplementedError) a tensor with no data
    │   └── NestedTensorError(SerializeError, RuntimeError) a torch nested tensor
    ├── UnsafePickleError(SafetensorError)                a pickle asks for a forbidden global
    ├── CheckpointError(SafetensorError, ValueError)      a checkpoint is broken or unsupported
    ├── RemoteError(SafetensorError, OSError)             a remote source misbehaved
    │   ├── RemoteNotFoundError(RemoteError, FileNotFoundError)  no such object or bucket
    │   └── RemotePermissionError(RemoteError, PermissionError)  credentials refused
    ├── WriteError(SafetensorError, OSError)              a save could not write its file
    │   └── one per ``OSError`` subclass: WriteFileNotFoundError(WriteError,
    │       FileNotFoundError), WritePermissionError, WriteIsADirectoryError, ...
    └── ClosedFileError(SafetensorError, ValueError)      a handle used after ``close()``

``OSError`` from the operating system while *reading* (missing file, permissions) passes through
unwrapped. While *writing*, the reference wraps it (``Error while serializing: I/O error: ...``),
so saves raise a :class:`WriteError`: a ``SafetensorError`` and the same ``OSError`` subclass
(``FileNotFoundError``, ``PermissionError``, ...), with ``errno`` and ``filename`` set.

Each error carries a ``kind`` naming the reference's error variant where there is one (for
example ``"InvalidOffset"``), so tests and tools can compare outcomes across implementations
without parsing messages.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any, TypeAlias

from ._remote_urls import shown_location

__all__ = [
    "CheckpointError",
    "ClosedFileError",
    "DTypeNotSupportedError",
    "HeaderDecodeError",
    "HeaderError",
    "HeaderSizeError",
    "MetaTensorError",
    "NestedTensorError",
    "OffsetError",
    "PathArg",
    "ReadError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "SafetensorError",
    "SerializeError",
    "SharedTensorsError",
    "SliceError",
    "SliceTypeError",
    "SliceValueError",
    "TensorInfoError",
    "TensorNotFoundError",
    "UnsafePickleError",
    "UnstorableDTypeError",
    "WriteError",
    "add_note",
    "read_error",
    "write_error",
]


class SafetensorError(Exception):
    """Raised for any problem with a safetensors file or with how the API is used.

    Attributes:
        kind: Name of the equivalent error variant of the reference implementation, or a
            pysafetensors-specific name where the reference has none.
        tensor: Name of the tensor the problem concerns, if any.
        offset: Byte offset in the file the problem concerns, if known.
    """

    exit_code = 1

    def __init__(
        self,
        *args: object,
        kind: str | None = None,
        tensor: str | None = None,
        offset: int | None = None,
    ) -> None:
        # Any positional arguments, as for the reference's class (and ``Exception``): user code
        # raises ``SafetensorError()`` or ``SafetensorError(msg, detail)`` too.
        super().__init__(*args)
        self.kind = kind or type(self).__name__
        self.tensor = tensor
        self.offset = offset

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes must survive pickling (multiprocessing sends errors back).
        return (_rebuild_error, (type(self), self.args, self.kind, self.tensor, self.offset))

    def __str__(self) -> str:
        # KeyError subclasses would otherwise quote the message; keep one plain rendering.
        if len(self.args) == 1:
            return str(self.args[0])
        return str(self.args) if self.args else ""


def _rebuild_error(
    cls: type[SafetensorError],
    args: tuple[object, ...] | str,
    kind: str,
    tensor: str | None,
    offset: int | None,
) -> SafetensorError:
    positional = args if isinstance(args, tuple) else (args,)
    return cls(*positional, kind=kind, tensor=tensor, offset=offset)


class HeaderError(SafetensorError, ValueError):
    """Raised when a file's length prefix or header is malformed."""


class HeaderSizeError(HeaderError):
    """Raised when the file is shorter than 8 bytes or the header length is out of bounds."""


class HeaderDecodeError(HeaderError):
    """Raised when the header is not UTF-8, not JSON, or JSON of the wrong shape."""


class TensorInfoError(HeaderError):
    """Raised when a tensor's dtype and shape disagree with its byte span, or overflow."""


class OffsetError(HeaderError):
    """Raised when tensor offsets leave holes, overlap, or do not cover the data buffer."""


class TensorNotFoundError(SafetensorError, KeyError):
    """Raised when a tensor name is not in the file."""


def first_five(texts: Sequence[str]) -> str:
    """``texts`` for a message: the first five joined by commas, then how many more there
    are (`` and 3 more``), if any."""
    return ", ".join(texts[:5]) + (f" and {len(texts) - 5} more" if len(texts) > 5 else "")


def tensor_not_found(name: str) -> TensorNotFoundError:
    """The reference's ``File does not contain tensor NAME``, for a name not in the file.

    A name that is not valid Unicode (a lone surrogate, ``"\\ud800"``) is written escaped:
    the message is then printable (as it stands, printing it raised ``UnicodeEncodeError``);
    ``tensor`` keeps the name as given."""
    try:
        name.encode("utf-8")
        shown = name
    except UnicodeEncodeError:
        shown = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return TensorNotFoundError(
        f"File does not contain tensor {shown}", kind="TensorNotFound", tensor=str(name)
    )


class DTypeNotSupportedError(SafetensorError, TypeError):
    """Raised when a dtype cannot be represented by the requested framework or format."""


class SliceError(SafetensorError, IndexError):
    """Raised when a slice index is malformed or cannot be served."""


class SliceTypeError(SliceError, TypeError):
    """Raised for an index item or slice bound of no index type (a float, a string).

    Also a ``TypeError``: the reference raises one for such slice bounds on every path, and
    its torch slices for string items.
    """


class SliceValueError(SliceError, ValueError):
    """Raised for a slice step of zero or below.

    Also a ``ValueError``, as the reference's torch slices raise (torch takes no such step).
    """


class SerializeError(SafetensorError, ValueError):
    """Raised when tensors or metadata cannot be written as given."""


class UnsafePickleError(SafetensorError):
    """Raised when a pickle stream references a global outside the allow-list.

    Attributes:
        global_name: The ``module.name`` the pickle asked for, when there is one.
        skippable: Whether the converter could have skipped it (``unknown="skip"``, the
            command line's ``--skip-unknown``): an unknown object that is not dangerous. A
            dangerous global, or a trick of the stream itself, is never skippable.
    """

    def __init__(
        self,
        message: str,
        *,
        global_name: str | None = None,
        kind: str | None = None,
        tensor: str | None = None,
        offset: int | None = None,
        skippable: bool = False,
    ) -> None:
        super().__init__(message, kind=kind, tensor=tensor, offset=offset)
        self.global_name = global_name
        self.skippable = skippable

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_unsafe,
            (str(self), self.global_name, self.kind, self.tensor, self.offset, self.skippable),
        )


def _rebuild_unsafe(
    message: str,
    global_name: str | None,
    kind: str,
    tensor: str | None,
    offset: int | None,
    skippable: bool = False,
) -> UnsafePickleError:
    return UnsafePickleError(
        message,
        global_name=global_name,
        kind=kind,
        tensor=tensor,
        offset=offset,
        skippable=skippable,
    )


class CheckpointError(SafetensorError, ValueError):
    """Raised when a PyTorch checkpoint or pickle is broken, truncated, lies about sizes, or holds
    something the converter cannot represent (quantized, sparse, complex128, ...)."""


class RemoteError(SafetensorError, OSError):
    """Raised when a remote byte source fails: missing object, denied, truncated, no ranges."""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """Raised when a remote object or bucket does not exist.

    Also a ``FileNotFoundError``, so code that handles a missing local file handles a missing
    remote one the same way.
    """


class RemotePermissionError(RemoteError, PermissionError):
    """Raised when a remote store refuses the credentials (HTTP 401/403, S3 AccessDenied)."""


class DeviceError(SafetensorError, ValueError):
    """Raised when a device named by a string (``"cuda:0"``, ``"mps"``) is not available to
    the framework (a CPU-only build, no GPU); an integer device is left to the framework at
    the first tensor, as the reference leaves it. Also a ``ValueError``, as Paddle's own
    refusal is."""


class ClosedFileError(SafetensorError, ValueError):
    """Raised when a handle is used after it was closed."""

    exit_code = 2


class SharedTensorsError(SerializeError, RuntimeError):
    """Raised when tensors to be saved share memory (use ``save_model`` for tied weights)."""


# The three below keep the class the reference's save raises for the same tensor (it does not
# check for them: the error comes from its dtype table or from torch), so that ``except``
# clauses written for it still catch ours.


class UnstorableDTypeError(SerializeError, KeyError):
    """Raised when a tensor to be saved has a dtype no safetensors code names (torch's
    ``complex128`` or quantized dtypes, Paddle's ``complex128``).

    Also a ``KeyError``: the reference's torch and Paddle saves raise its dtype table's.
    """


class MetaTensorError(SerializeError, NotImplementedError):
    """Raised when a torch tensor to be saved is on the ``meta`` device: it has no data.

    Also a ``NotImplementedError`` (so a ``RuntimeError``), as torch raises for the
    reference's copy of it.
    """


class NestedTensorError(SerializeError, RuntimeError):
    """Raised when a torch nested tensor is to be saved (safetensors stores dense tensors).

    Also a ``RuntimeError``, as torch raises when the reference asks for its shape.
    """


def _reduce_os_error(self: SafetensorError) -> tuple[object, ...]:
    """``__reduce__`` of the errors that are also an ``OSError``: their ``errno``,
    ``strerror`` and ``filename`` survive pickling (multiprocessing sends errors back)."""
    assert isinstance(self, OSError)
    return (
        _rebuild_os_error,
        (
            type(self),
            str(self),
            self.kind,
            self.errno,
            self.strerror,
            self.filename,
            self.tensor,
            self.offset,
        ),
    )


def _rebuild_os_error(
    cls: type[SafetensorError],
    message: str,
    kind: str,
    errno: int | None,
    strerror: str | None,
    filename: str | None,
    tensor: str | None = None,
    offset: int | None = None,
) -> SafetensorError:
    err = cls(message, kind=kind, tensor=tensor, offset=offset)
    assert isinstance(err, OSError)
    err.errno, err.strerror, err.filename = errno, strerror, filename
    return err


class WriteError(SafetensorError, OSError):
    """Raised when a save cannot create, write or rename its file (an ``OSError`` underneath).

    The subclass also derives from the ``OSError`` subclass of the cause, so ``except
    FileNotFoundError`` and ``except SafetensorError`` both catch a save into a missing folder.
    """

    __reduce__ = _reduce_os_error


class ReadError(SafetensorError, OSError):
    """Raised when reading a file fails (an ``OSError`` underneath: an I/O error of the disk or
    of a network file system), naming the file and the bytes (and the tensor, where a tensor
    was read); ``errno`` is the cause's."""

    __reduce__ = _reduce_os_error


def _os_reason(exc: OSError) -> str:
    """What went wrong, in the reference's (Rust's) words: ``<reason> (os error N)``."""
    code = f" (os error {exc.errno})" if exc.errno is not None else ""
    return f"{exc.strerror or exc}{code}"


def read_error(exc: OSError, name: str, offset: int, length: int) -> ReadError:
    """The :class:`ReadError` for an ``OSError`` reading ``length`` bytes at ``offset`` of the
    file ``name``; raise it ``from exc``."""
    err = ReadError(
        f"{name}: I/O error reading {length} bytes at offset {offset}: {_os_reason(exc)}",
        kind="IoError",
        offset=offset,
    )
    err.errno, err.strerror, err.filename = exc.errno, exc.strerror, name
    return err


class WriteFileNotFoundError(WriteError, FileNotFoundError):
    """A save's folder does not exist."""


class WritePermissionError(WriteError, PermissionError):
    """A save was refused permission."""


class WriteIsADirectoryError(WriteError, IsADirectoryError):
    """A save's target is a directory."""


class WriteNotADirectoryError(WriteError, NotADirectoryError):
    """A component of a save's path is not a directory."""


class WriteFileExistsError(WriteError, FileExistsError):
    """A save's target exists where it must not."""


_WRITE_ERRORS: dict[type[OSError], type[WriteError]] = {
    FileNotFoundError: WriteFileNotFoundError,
    PermissionError: WritePermissionError,
    IsADirectoryError: WriteIsADirectoryError,
    NotADirectoryError: WriteNotADirectoryError,
    FileExistsError: WriteFileExistsError,
}


def write_error(exc: OSError, path: str | None = None, *, detail: str = "") -> WriteError:
    """The :class:`WriteError` for an ``OSError`` a save ran into, in the reference's words.

    Args:
        exc: The error the operating system reported.
        path: The file the save was writing (named rather than the temporary file or whatever
            ``exc`` names); ``exc.filename`` when None.
        detail: Appended to the message (what was being done, where the reference's text
            cannot say it).

    Returns:
        ``Error while serializing: I/O error: <reason> (os error N) at path "<path>"``, then
        ``detail``, with the ``errno``, ``strerror`` and ``filename`` of ``exc``; raise it
        ``from exc``.
    """
    # A WriteError named again (for another path) keeps its class.
    cls = type(exc) if isinstance(exc, WriteError) else _WRITE_ERRORS.get(type(exc), WriteError)
    where = path if path is not None else exc.filename
    at = f' at path "{where}"' if where is not None else ""
    err = cls(f"Error while serializing: I/O error: {_os_reason(exc)}{at}{detail}", kind="IoError")
    err.errno, err.strerror, err.filename = exc.errno, exc.strerror, where
    for note in getattr(exc, "__notes__", ()):  # what the writer knew (which tensor)
        add_note(err, note)
    return err


def make_folder(folder: str, named: str | None = None) -> None:
    """``os.makedirs(folder, exist_ok=True)``, its failure a :class:`WriteError` naming
    ``named`` (the output being written; ``folder`` when None), and naming the file in the way
    where there is one.

    ``makedirs`` reports a file where a folder should be as "File exists" (the file itself)
    or "Not a directory" (a folder below it), naming neither clearly.

    Raises:
        WriteError: The folder cannot be created (``NotADirectoryError`` for a file in the way).
    """
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        failure = exc
    else:
        return
    # Outside the except clause: the error replaces makedirs', chained as its cause below.
    blocker = folder.rstrip(os.sep) or folder  # the deepest part that exists
    while blocker and not os.path.lexists(blocker):
        parent = os.path.dirname(blocker)
        blocker = "" if parent == blocker else parent
    if blocker and os.path.isfile(blocker):
        in_the_way = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), blocker)
        raise write_error(
            in_the_way, named or folder, detail=f" ({blocker!r} is a file, not a folder)"
        ) from failure
    # Anything else in the way (a broken link, a loop of links) keeps the system's reason.
    detail = f" ({blocker!r} is not a folder)" if blocker and not os.path.isdir(blocker) else ""
    raise write_error(failure, named or folder, detail=detail) from failure


def not_an_instance(
    argument: str, value: object, expected: str = "str", detail: str = ""
) -> TypeError:
    """The reference's error for an argument of the wrong type, word for word (its bindings'
    text: ``'None' is`` for None, ``'int' object is`` for anything else), then ``detail``."""
    what = "'None' is" if value is None else f"'{type(value).__name__}' object is"
    tail = f" {detail}" if detail else ""
    return TypeError(f"argument '{argument}': {what} not an instance of '{expected}'{tail}")


#: A path argument as the writers take it: what :func:`path_argument` accepts (bytes paths are
#: decoded with the file system's encoding).
PathArg: TypeAlias = str | bytes | os.PathLike[str] | os.PathLike[bytes]


def path_argument(value: Any, argument: str = "filename") -> str:
    """A path argument as a str (``os.fspath``, bytes decoded), or the reference's ``TypeError``
    for a value that is no path (``argument 'filename': expected str, bytes or os.PathLike
    object, not int``)."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(
            f"argument '{argument}': expected str, bytes or os.PathLike object, not "
            f"{type(value).__name__}"
        ) from None
    return os.fsdecode(path) if isinstance(path, bytes) else path


def looks_like_url(path: str) -> bool:
    """Whether ``path`` is a URL, as the readers and :func:`shown_location` decide: one whose
    credentials and query string messages must not show."""
    return "://" in path


def local_path_refused(path: str, reason: str) -> FileNotFoundError:
    """The error for a URL given where only a local file will do (a save, a metadata edit, a
    checkpoint to convert), saying ``reason`` and naming the URL without its secrets."""
    return FileNotFoundError(errno.ENOENT, reason, shown_location(path))


def nul_in_path(path: str, *, writing: bool) -> OSError:
    """The error for a path with a NUL byte, which no OS file name holds (Python's own is a
    ``ValueError`` that neither ``except OSError`` nor ``except SafetensorError`` catches): as
    the reference, not found when reading and an invalid argument (a :class:`WriteError`, by
    way of :func:`write_error`) when writing. A URL is named without its secrets."""
    shown = shown_location(path)
    if writing:
        return OSError(errno.EINVAL, os.strerror(errno.EINVAL), shown)
    return FileNotFoundError(
        errno.ENOENT, "No such file or directory (a file name cannot hold a NUL byte)", shown
    )


def input_path(value: Any, argument: str = "filename") -> str:
    """A path to read from (:func:`path_argument`); one with a NUL byte is not found."""
    path = path_argument(value, argument)
    if "\x00" in path:
        if isinstance(value, bytes):
            # A file's contents given as its name (the reference refuses bytes here): the
            # message would otherwise quote all of them.
            raise TypeError(
                f"argument '{argument}': bytes with a NUL byte ({len(value)} bytes) are no file "
                "name; pass a file's contents as a bytearray, memoryview or file object"
            )
        raise nul_in_path(path, writing=False)
    return path


def output_path(value: Any, argument: str = "filename", *, file: bool = False) -> str:
    """A path to write to (:func:`path_argument`); one with a NUL byte is a :class:`WriteError`
    (an invalid argument), as any save's I/O failure, and so is a ``file`` path ending in a
    separator."""
    path = path_argument(value, argument)
    if "\x00" in path:
        raise write_error(nul_in_path(path, writing=True), shown_location(path))
    if looks_like_url(path):
        # Saved as a local path it would fail anyway (no folder "https:"), quoting the URL's
        # credentials and signature in the message.
        refused = local_path_refused(
            path, "No such file or directory (saves write local files only, not URLs)"
        )
        raise write_error(refused, shown_location(path))
    if file and path.endswith(("/", os.sep)):
        # A file cannot be saved under a name that ends as a folder's: the reference's rename
        # onto it reports ENOTDIR, whether or not the folder exists.
        gone = OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        raise write_error(gone, path)
    return path


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11+); on 3.10 the same ``__notes__``
    list that PEP 678 defines (which pytest and the ``exceptiongroup`` backport show)."""
    method = getattr(exc, "add_note", None)
    if method is not None:
        method(note)
    else:  # (through __dict__: Python 3.10's stubs have no __notes__)
        exc.__dict__["__notes__"] = [*getattr(exc, "__notes__", ()), note]
