"""The framework-free top-level API: ``TensorSpec``, ``serialize``, ``serialize_file``,
``deserialize``, and the shared bodies of every framework's ``save``/``load`` functions."""

from __future__ import annotations

import builtins
import ctypes
import operator
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

from ._adapter import Adapter
from ._dtypes import DType, dtype_from_code, dtype_from_name
from ._errors import PathArg, SafetensorError, SerializeError, not_an_instance
from ._format import DESERIALIZE_PREFIX, MAX_HEADER_SIZE, check_max_header_size, gc_paused
from ._fresh_memory import empty_bytes
from ._page_release import tensors_over
from ._reader import read_header, safe_open
from ._representable import check_representable
from ._signatures import show_init_signature
from ._slice_gather import copy_in_parallel
from ._sources import BufferSource
from ._writer import TensorData, serialize_to_bytes, write_file

__all__ = [
    "TensorSpec",
    "deserialize",
    "load_bytes_with",
    "load_file_with",
    "save_bytes_with",
    "save_file_with",
    "serialize",
    "serialize_file",
]


class TensorSpec:
    """A tensor given by raw memory, as the reference's ``TensorSpec``.

    Args:
        dtype: A dtype name such as ``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"`` or
            ``"float4_e2m1fn_x2"`` (whose last dimension holds two values and is doubled).
        shape: The shape.
        data_ptr: Address of the first byte. The memory must stay alive during the call.
        data_len: Number of bytes.

    Raises:
        SerializeError: Unknown dtype, or a null ``data_ptr`` with a non-zero ``data_len``.
        TypeError: A dimension, the pointer or the length is not an integer.
        OverflowError: One of them is negative or does not fit 64 bits (the reference's
            errors for the same arguments).
    """

    __slots__ = ("_data_len", "_data_ptr", "_dtype", "_shape")

    def __new__(cls, *args: Any, **kwargs: Any) -> TensorSpec:
        # Wrong arguments in the reference's words (its bindings' __new__), not Python's
        # (``__init__() takes 1 positional argument``, ``keyword-only arguments``). A
        # subclass's __init__ takes what it declares.
        if cls is TensorSpec and (args or kwargs.keys() != _SPEC_KEYS):
            _check_spec_arguments(args, kwargs)
        return super().__new__(cls)

    def __init__(self, *, dtype: str, shape: Any, data_ptr: int, data_len: int) -> None:
        # The reference's order: every argument's type as its bindings extract them, then
        # the dtype's name.
        if not isinstance(dtype, str):
            raise not_an_instance("dtype", dtype)
        dims = _shape_argument(shape)
        ptr = _unsigned(data_ptr, "data_ptr")
        length = _unsigned(data_len, "data_len")
        dt = dtype_from_name(dtype)
        if dt.bits == 4 and dims:
            if dims[-1] * 2 >= 1 << 64:
                # The reference's checked multiply, and its message.
                raise SerializeError(
                    f"F4 last-dim {dims[-1]} doubled to logical shape overflows usize",
                    kind="ValidationOverflow",
                )
            dims[-1] *= 2
        self._dtype: DType = dt
        self._shape = dims
        self._data_ptr = ptr
        self._data_len = length
        if self._data_ptr == 0 and self._data_len:
            # Reading it would crash the interpreter, not raise.
            raise SerializeError(
                f"data_ptr is null but data_len is {self._data_len}", kind="TensorInvalidInfo"
            )

    @property
    def dtype(self) -> str:
        """The format code, e.g. ``"BF16"``."""
        return self._dtype.code

    @property
    def shape(self) -> list[int]:
        """The logical shape."""
        return list(self._shape)

    @property
    def data_ptr(self) -> int:
        """Address of the data."""
        return self._data_ptr

    @property
    def data_len(self) -> int:
        """Length of the data in bytes."""
        return self._data_len

    def __copy__(self) -> TensorSpec:
        return self  # immutable

    def __deepcopy__(self, memo: Any) -> TensorSpec:
        return self  # a copy of the address, not of the memory: the same spec

    def __reduce_ex__(self, protocol: Any) -> Any:
        # An address means nothing in another process (the reference's cannot be pickled).
        raise TypeError("cannot pickle 'TensorSpec' object: it holds a memory address")

    def __repr__(self) -> str:
        return (
            f"TensorSpec(dtype={self.dtype!r}, shape={self._shape}, data_ptr={self._data_ptr}, "
            f"data_len={self._data_len})"
        )

    def to_data(self, name: str) -> TensorData:
        """Describe the memory for the writer (the length is checked against the shape)."""
        ptr, length = self._data_ptr, self._data_len

        def chunks() -> Iterator[Any]:
            if length:
                yield (ctypes.c_char * length).from_address(ptr)

        return TensorData(name, self._dtype, tuple(self._shape), chunks)


show_init_signature(TensorSpec)

_SPEC_ARGUMENTS: Final = ("dtype", "shape", "data_ptr", "data_len")
_SPEC_KEYS: Final = frozenset(_SPEC_ARGUMENTS)


def _check_spec_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse what ``TensorSpec(...)`` cannot take as the reference's bindings word it:
    positional arguments, then an unknown keyword, then missing ones."""
    where = "TensorSpec.__new__()"
    if args:
        were = "was" if len(args) == 1 else "were"
        raise TypeError(f"{where} takes 0 positional arguments but {len(args)} {were} given")
    for name in kwargs:
        if name not in _SPEC_ARGUMENTS:
            raise TypeError(f"{where} got an unexpected keyword argument '{name}'")
    missing = [f"'{name}'" for name in _SPEC_ARGUMENTS if name not in kwargs]
    if missing:
        if len(missing) <= 2:
            listed = " and ".join(missing)
        else:
            listed = f"{', '.join(missing[:-1])}, and {missing[-1]}"
        plural = "argument" if len(missing) == 1 else "arguments"
        raise TypeError(f"{where} missing {len(missing)} required keyword {plural}: {listed}")


def _sequence(value: Any, argument: str) -> Any:
    """``value`` where the reference's binding takes it as a ``Vec`` (an object with the
    sequence protocol, not a str), else its ``TypeError``, word for word."""
    if isinstance(value, str):
        raise TypeError(f"argument '{argument}': Can't extract `str` to `Vec`")
    if isinstance(value, Mapping) or not hasattr(type(value), "__getitem__"):
        raise not_an_instance(argument, value, "Sequence")
    return value


def _unsigned(value: Any, argument: str) -> int:
    """``value`` as a 64-bit unsigned integer, refused as the reference's binding refuses it."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"argument '{argument}': '{type(value).__name__}' object cannot be interpreted as an "
            "integer"
        ) from None
    if number < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if number >= 1 << 64:
        raise OverflowError("int too big to convert")
    return number


def _shape_argument(value: Any) -> list[int]:
    """A ``shape`` argument as the reference's binding takes it: a sequence of 64-bit
    unsigned integers (its ``TypeError``/``OverflowError`` otherwise)."""
    return [_unsigned(d, "shape") for d in _sequence(value, "shape")]


def _spec_to_data(name: Any, value: Any) -> TensorData:
    if not isinstance(name, str):
        raise not_an_instance("tensor_dict", name, detail=f"(tensor name {name!r})")
    if isinstance(value, TensorSpec):
        return value.to_data(name)
    if isinstance(value, Mapping) and {"dtype", "shape", "data"} <= set(value):
        return _legacy_spec_to_data(name, value)
    raise not_an_instance(
        "tensor_dict",
        value,
        "TensorSpec",
        f"(tensor `{name}`: a TensorSpec, or a dict with dtype, shape and data)",
    )


def _legacy_spec_to_data(name: str, value: Mapping[str, Any]) -> TensorData:
    """The pre-0.8 dict form (``{"dtype", "shape", "data"}``; the dtype a name, ``"float32"``,
    or a code, ``"F32"``), checked as a :class:`TensorSpec` is and named: ``int()`` of each
    item made a shape of ``"12"`` into ``[1, 2]``, of ``[2.9]`` into ``[2]``, silently.

    Raises:
        SerializeError: An unknown dtype.
        TypeError: A shape that is no sequence of integers, or data that is no buffer.
        OverflowError: A dimension below 0 or of 2^64 or more.
    """
    code = str(value["dtype"])
    try:
        try:
            dtype = dtype_from_code(code)
        except SafetensorError:
            dtype = dtype_from_name(code)
    except SerializeError as exc:
        raise SerializeError(f"{exc} (tensor `{name}`)", kind=exc.kind, tensor=name) from None
    try:
        shape = tuple(_shape_argument(value["shape"]))
    except (TypeError, OverflowError) as exc:
        raise type(exc)(f"{exc} (tensor `{name}`)") from None
    data = value["data"]
    try:
        memoryview(data)
    except TypeError:
        raise TypeError(
            f"tensor `{name}`: data must be a bytes-like object, not {type(data).__name__}"
        ) from None
    return TensorData(name, dtype, shape, lambda: [data])


def _check_dict(tensor_dict: Any) -> Mapping[Any, Any]:
    if not isinstance(tensor_dict, Mapping):
        raise not_an_instance("tensor_dict", tensor_dict, "dict")
    return tensor_dict


def serialize(
    tensor_dict: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> bytes:
    """Serialize raw tensors to the bytes of a safetensors file.

    Args:
        tensor_dict: Name to :class:`TensorSpec` (or the older ``{"dtype", "shape", "data"}``
            dict form, where ``data`` is any bytes-like object).
        metadata: Optional ``__metadata__`` (str to str).
        max_header_size: Largest header accepted.

    Returns:
        The file's bytes, identical to the reference's for the same input.

    Raises:
        SerializeError: Sizes disagree with shapes, a name is reserved, the header is too large.
        TypeError: Names, values or metadata have the wrong type.
    """
    data = [_spec_to_data(k, v) for k, v in _check_dict(tensor_dict).items()]
    return serialize_to_bytes(data, metadata, max_header_size=max_header_size)


def serialize_file(
    tensor_dict: Mapping[str, Any],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
) -> None:
    """Like :func:`serialize`, but write the file atomically (temporary file, then rename).

    Args:
        tensor_dict: As for :func:`serialize`.
        filename: Target path.
        metadata: Optional ``__metadata__``.
        fsync: Make the file and its directory entry durable before returning.
        max_header_size: Largest header accepted.
    """
    data = [_spec_to_data(k, v) for k, v in _check_dict(tensor_dict).items()]
    write_file(filename, data, metadata, fsync=fsync, max_header_size=max_header_size)


def _bytes_argument(data: Any) -> memoryview:
    """``data`` as flat bytes: ``bytes`` as the reference takes it, and any C-contiguous
    bytes-like object (``bytearray``, ``memoryview``, a numpy array); anything else refused in
    the reference's words."""
    if isinstance(data, (builtins.bytes, bytearray)):
        return memoryview(data)
    try:
        view = memoryview(data)
    except TypeError:
        raise not_an_instance("bytes", data, "bytes") from None
    if not view.c_contiguous:
        raise not_an_instance("bytes", data, "bytes", detail="(a non-contiguous buffer)")
    return view.cast("B")


def deserialize(
    bytes: builtins.bytes | bytearray | memoryview,  # noqa: A002 - the reference's keyword
    *,
    max_header_size: int = MAX_HEADER_SIZE,
) -> list[tuple[str, dict[str, Any]]]:
    """Parse a whole file held in memory.

    Args:
        bytes: The file's bytes (any bytes-like object).
        max_header_size: Largest header accepted.

    Returns:
        ``[(name, {"shape": [...], "dtype": "F32", "data": bytearray}), ...]`` in file order
        (the reference's order is arbitrary).

    Raises:
        HeaderError: The bytes are not a valid file (messages start with
            ``Error while deserializing: ``).
        TypeError: ``max_header_size`` is not an integer.
        ValueError: ``max_header_size`` is negative.
    """
    view = _bytes_argument(bytes)
    limit = check_max_header_size(max_header_size)
    source = BufferSource(view)
    header = read_header(source, max_header_size=limit, prefix_text=DESERIALIZE_PREFIX)
    start = header.data_start
    return [
        (
            name,
            {
                "shape": list(info.shape),
                "dtype": info.dtype.code,
                "data": bytearray(view[start + info.begin : start + info.end]),
            },
        )
        for name, info in header.tensors.items()
    ]


# ----------------------------------------------------------- shared bodies of save/load functions


def _to_data(adapter: Adapter, tensors: Mapping[str, Any]) -> list[TensorData]:
    out = []
    # A few objects per tensor that all live until the save ends: with the collector on, a
    # save of 20,000 small numpy arrays set off ~250 collections, two of them full (~28 ms of
    # ~100 ms; the reference's numpy save none).
    with gc_paused():
        for name, tensor in tensors.items():
            if not isinstance(name, str):
                raise not_an_instance("tensor_dict", name, detail=f"(tensor name {name!r})")
            out.append(adapter.to_data(name, tensor))
    return out


def save_bytes_with(
    adapter: Adapter, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None
) -> bytes:
    """``save`` for any framework."""
    return serialize_to_bytes(_to_data(adapter, tensors), metadata)


def save_file_with(
    adapter: Adapter,
    tensors: Mapping[str, Any],
    filename: PathArg,
    metadata: Mapping[str, str] | None,
    *,
    fsync: bool = False,
) -> None:
    """``save_file`` for any framework."""
    write_file(filename, _to_data(adapter, tensors), metadata, fsync=fsync)


def load_bytes_with(
    adapter: Adapter, data: bytes | bytearray | memoryview, device: Any
) -> dict[str, Any]:
    """``load`` for any framework: tensors own a private copy of the bytes."""
    view = _bytes_argument(data)
    dev = adapter.check_device(device)
    source = BufferSource(view)
    header = read_header(source, prefix_text=DESERIALIZE_PREFIX)
    for info in header.tensors.values():
        # Shapes no array can hold: our TensorInfoError (a ValueError), not numpy's or torch's.
        check_representable(info.shape, info.dtype, info.name, framework=adapter.framework)
    # One private copy of the data buffer; every tensor views it (the reference copies too),
    # its large ones giving their pages back when dropped. Copied by the reader threads into
    # memory in huge pages where it can be (a bytearray's copy, on one thread into 4 KiB
    # pages, took 0.73-0.80 s for 768 MiB, the reference's load 0.50-0.55 s).
    body = np.frombuffer(view, np.uint8)[header.data_start :]
    buf = empty_bytes(body.size)
    copy_in_parallel(buf, body, source)
    items = ((n, i.dtype, i.shape, i.begin, i.end) for n, i in header.tensors.items())
    return tensors_over(adapter, buf, items, dev)


def load_file_with(
    framework: str,
    filename: Any,
    device: Any,
    backend: str,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``load_file`` for any framework."""
    with safe_open(
        filename, framework, device=device, backend=backend, storage_options=storage_options
    ) as f:
        return f.get_tensors()
