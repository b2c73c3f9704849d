"""The Paddle adapter (``framework="paddle"``): tensors over raw bits, saved from their memory.

Reading: the bytes are read into numpy, handed to ``paddle.to_tensor`` (on the requested place)
as a numpy dtype Paddle accepts, or as a signed integer of the same width that is then
reinterpreted with ``Tensor.view(dtype)`` (bfloat16, float8, uint32, uint64: ``to_tensor``
refuses the ml_dtypes and wide unsigned numpy types).

Writing: bytes come straight from ``Tensor.data_ptr()`` (CPU, made contiguous if needed), as in the
reference's Paddle module, so every Paddle dtype safetensors can hold is written without a
numpy detour.

Paddle dtypes are resolved by name from the one table in ``_dtypes``, by the dtype's own
``name``: ``str(paddle.uint16)`` says ``paddle.bfloat16``, so U16 would otherwise be taken for
BF16 (the reference can neither load U16 nor save ``paddle.uint16``). F8_E8M0, the FNUZ
float8s, F4 and F6 have no Paddle dtype and are refused.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import sys
from collections.abc import Iterator
from typing import Any, Final

import numpy as np

from ._adapter import LazyModule, NumpyAdapter, invalid_tensor_error, numpy_dtype
from ._devices import Device, parse_device
from ._dtypes import DTYPES, DType, dtype_from_name
from ._errors import (
    DeviceError,
    DTypeNotSupportedError,
    SafetensorError,
    SerializeError,
    UnstorableDTypeError,
)
from ._format import SERIALIZE_PREFIX
from ._writer import TensorData

# Imported at first use: opening a file to read its header does not import the framework.
paddle: Any = LazyModule("paddle")

__all__ = ["ADAPTER", "PaddleAdapter", "paddle_dtype"]

_NUMPY: Final = NumpyAdapter()


def _version() -> str:
    """This Paddle's version, for messages (looked up then: reading it imports Paddle)."""
    return str(getattr(paddle, "__version__", "?"))


def _type_name(paddle_type: Any) -> str:
    """A Paddle dtype's own name (``uint16``), which ``str`` misreports for UINT16 as
    ``paddle.bfloat16``. Only names of the dtype table count: the ``VarType`` dtypes of older
    Paddles and static graphs are named ``FP32``, ``BF16``..., which ``str`` gets right."""
    name = getattr(paddle_type, "name", None)
    if isinstance(name, str) and name.lower() in _DTYPE_NAMES:
        return name.lower()
    return str(paddle_type).rpartition(".")[2]


_DTYPE_NAMES: Final = frozenset(d.name for d in DTYPES)


def _resolve(name: str) -> Any:
    """``paddle.<name>`` if this Paddle has that very dtype."""
    value = getattr(paddle, name, None)
    if value is None or _type_name(value) != name:
        return None
    return value


@functools.cache
def to_paddle() -> dict[str, Any]:
    """Dtype code to this Paddle's dtype, resolved once from the shared table, at first use
    (resolving imports Paddle); dtypes this Paddle lacks are simply absent."""
    return {
        d.code: _resolve(d.name) for d in DTYPES if not d.packed and _resolve(d.name) is not None
    }


#: The text of a Paddle place object.
_PLACE: Final = re.compile(r"Place\((cpu|gpu:\d+)\)")
#: Signed integer carriers by byte width (``to_tensor`` takes every signed width).
_CARRIER: Final[dict[int, Any]] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def paddle_dtype(dtype: DType) -> Any:
    """The Paddle dtype for a safetensors dtype.

    Raises:
        DTypeNotSupportedError: Paddle has no such dtype.
    """
    try:
        return to_paddle()[dtype.code]
    except KeyError:
        raise DTypeNotSupportedError(
            f"Dtype not understood: {dtype.code} (Paddle {_version()} has no such "
            "dtype; load it with framework='numpy' instead)",
            kind="DtypeNotUnderstood",
        ) from None


@functools.cache
def _native(dtype: DType) -> bool:
    """Whether ``to_tensor`` takes the numpy form of ``dtype`` as that very dtype."""
    try:
        made = paddle.to_tensor(np.zeros(1, numpy_dtype(dtype)))
    except Exception:  # noqa: BLE001 - Paddle reports unknown numpy types as ValueError/TypeError
        return False
    return _type_name(made.dtype) == dtype.name


def _place(device: Device) -> str:
    """Paddle's place string for a parsed device (CUDA is ``gpu`` in Paddle)."""
    if device.type == "cpu":
        return "cpu"
    kind = "gpu" if device.type in ("cuda", "anonymous") else device.type
    return f"{kind}:{device.index or 0}"


def _known_place(device: Device) -> bool:
    """Whether Paddle takes ``device`` as a place (without making anything there)."""
    convert = getattr(paddle.device, "_convert_to_place", None)
    if convert is None:
        return True  # left to Paddle when the tensor is made
    try:
        convert(_place(device))
    except ValueError:
        return False
    return True


def _is_sparse(tensor: Any) -> bool:
    """Whether ``tensor`` is a sparse (COO or CSR) Paddle tensor."""
    is_sparse = getattr(tensor, "is_sparse", None)
    return bool(is_sparse()) if callable(is_sparse) else False


class PaddleAdapter:
    """Paddle tensors on the CPU or any place Paddle was built for."""

    framework = "paddle"

    def check_device(self, device: Any) -> Device:
        if not isinstance(device, (str, int, type(None))):
            # Paddle's place objects (paddle.CPUPlace(), paddle.CUDAPlace(1)), as Paddle takes
            # them: by their text, "Place(cpu)" / "Place(gpu:1)".
            place = _PLACE.fullmatch(str(device))
            if place is not None:
                device = place[1]
        given = device
        if isinstance(device, str):
            # As Paddle reads place strings: in any case ("CPU"), "gpu" for CUDA.
            device = device.lower()
            if device.partition(":")[0] == "gpu":
                device = "cuda" + device[3:]
        try:
            dev = parse_device(device)
        except DeviceError:
            raise
        except SafetensorError as exc:
            # Paddle refuses an unknown place with a ValueError, which the reference lets
            # through: a DeviceError is both (same words as for the other frameworks).
            raise DeviceError(str(exc), kind="InvalidDevice") from None
        if dev.type in ("cuda", "anonymous") and not paddle.device.is_compiled_with_cuda():
            raise DeviceError(
                f"device {given!r} was requested but Paddle {_version()} was built without "
                "CUDA; use device='cpu'",
                kind="InvalidDevice",
            )
        if dev.type not in ("cpu", "cuda", "anonymous") and not _known_place(dev):
            # Paddle refuses these (mps, a custom device not installed, XPU without its build)
            # with a ValueError, as the reference lets through: a DeviceError is both.
            raise DeviceError(
                f"device {given!r} is not a place Paddle {_version()} can use here (not built "
                "with it, or not one it knows); use device='cpu'",
                kind="InvalidDevice",
            )
        return dev

    def from_bytes(
        self, buf: np.ndarray, dtype: DType, shape: tuple[int, ...], device: Device
    ) -> Any:
        target = paddle_dtype(dtype)
        arr = _NUMPY.from_bytes(buf, dtype, shape, device)
        place = _place(device)
        # to_tensor copies, so views of a memory map are not kept alive.
        if _native(dtype):
            return paddle.to_tensor(arr, place=place)
        # Reshape happens in numpy: Paddle has no reshape kernel for uint32/uint64.
        bits = paddle.to_tensor(arr.view(_CARRIER[dtype.bits // 8]), place=place)
        return bits.view(target)

    def to_data(self, name: str, tensor: Any) -> TensorData:
        if isinstance(tensor, (np.ndarray, np.generic)):
            return _NUMPY.to_data(name, tensor)
        if not isinstance(tensor, paddle.Tensor):
            raise invalid_tensor_error(name, "paddle.Tensor", tensor)
        if _is_sparse(tensor):
            # Its values live in separate index and value tensors: it has no memory of its own
            # to write (data_ptr() is None; the reference fails in ctypes, "NULL pointer access").
            raise SerializeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` is sparse; convert it with .to_dense() first",
                kind="SparseTensor",
                tensor=name,
            )
        type_name = _type_name(tensor.dtype)
        try:
            dtype = dtype_from_name(type_name)
        except SerializeError:
            raise UnstorableDTypeError(
                f"{SERIALIZE_PREFIX}tensor `{name}` has dtype {tensor.dtype}, which safetensors "
                "cannot store",
                kind="UnknownDtype",
                tensor=name,
            ) from None
        shape = tuple(int(d) for d in tensor.shape)
        source = tensor

        def chunks() -> Iterator[Any]:
            t = source
            if not t.place.is_cpu_place():
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            nbytes = math.prod(shape) * dtype.bits // 8
            if nbytes == 0:
                return
            # Straight from the tensor's memory, as the reference does: no copy in user space.
            raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
            if sys.byteorder == "big":  # pragma: no cover - no big-endian CI host
                width = dtype.bits // 8
                yield (
                    np.frombuffer(memoryview(raw), f">u{width}").astype(f"<u{width}").view(np.uint8)
                )
            else:
                yield raw
            # Keep `t` alive until the consumer has written the bytes.
            del t

        return TensorData(name, dtype, shape, chunks, keepalive=tensor)


ADAPTER: Final = PaddleAdapter()
