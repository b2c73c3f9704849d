"""The one dtype table: safetensors codes, their bit sizes, write order and framework names.

Every adapter (numpy, torch, jax, tensorflow, mlx, paddle) resolves its own dtype objects from
this table by name; none keeps a table of its own.

Rules:

* ``bits`` is the size of one logical element. F4 is 4 bits and F6_* are 6 bits, so a tensor's
  byte size is ``nelements * bits / 8`` and is only legal when that product is a multiple of 8.
* ``rank`` is the declaration order of the reference's ``Dtype`` enum. Writers MUST order tensors
  by rank descending, then by name, to produce the reference's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ._errors import DTypeNotSupportedError, SerializeError, TensorInfoError

__all__ = [
    "BY_CODE",
    "DTYPES",
    "UINT64_MAX",
    "DType",
    "byte_size",
    "checked_nbits",
    "dtype_from_code",
    "dtype_from_name",
]

UINT64_MAX: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class DType:
    """One safetensors dtype."""

    code: str
    """The code written in headers, e.g. ``"BF16"``."""
    bits: int
    """Bits per logical element (4 for F4, 6 for F6_*)."""
    rank: int
    """Position in the reference's enum; larger ranks are written first."""
    numpy: str | None
    """numpy / ml_dtypes dtype name of one element, or None."""
    torch: str | None
    """``torch`` attribute name, or None when torch has no such dtype."""
    name: str
    """The dtype name the reference's ``TensorSpec`` accepts (torch-style: ``float8_e4m3fn``)."""
    packed: bool = False
    """True for sub-byte dtypes whose numpy form holds one element per byte."""

    @property
    def is_float(self) -> bool:
        """Whether the dtype holds floating point (or complex) values."""
        return self.code.startswith(("F", "BF", "C"))


# Declaration order of the reference's enum (it MUST stay in this order: rank = index).
DTYPES: Final[tuple[DType, ...]] = tuple(
    DType(code, bits, rank, np_name, torch_name, name, packed)
    for rank, (code, bits, np_name, torch_name, name, packed) in enumerate(
        [
            ("BOOL", 8, "bool", "bool", "bool", False),
            ("F4", 4, "float4_e2m1fn", "float4_e2m1fn_x2", "float4_e2m1fn_x2", True),
            ("F6_E2M3", 6, "float6_e2m3fn", None, "float6_e2m3fn", True),
            ("F6_E3M2", 6, "float6_e3m2fn", None, "float6_e3m2fn", True),
            ("U8", 8, "uint8", "uint8", "uint8", False),
            ("I8", 8, "int8", "int8", "int8", False),
            ("F8_E5M2", 8, "float8_e5m2", "float8_e5m2", "float8_e5m2", False),
            ("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn", False),
            ("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu", "float8_e8m0fnu", False),
            ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz", "float8_e4m3fnuz", False),
            ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz", "float8_e5m2fnuz", False),
            ("I16", 16, "int16", "int16", "int16", False),
            ("U16", 16, "uint16", "uint16", "uint16", False),
            ("F16", 16, "float16", "float16", "float16", False),
            ("BF16", 16, "bfloat16", "bfloat16", "bfloat16", False),
            ("I32", 32, "int32", "int32", "int32", False),
            ("U32", 32, "uint32", "uint32", "uint32", False),
            ("F32", 32, "float32", "float32", "float32", False),
            ("C64", 64, "complex64", "complex64", "complex64", False),
            ("F64", 64, "float64", "float64", "float64", False),
            ("I64", 64, "int64", "int64", "int64", False),
            ("U64", 64, "uint64", "uint64", "uint64", False),
        ]
    )
)

BY_CODE: Final = {d.code: d for d in DTYPES}
# Accept both the reference's TensorSpec names and numpy names (they differ only for bool/F6).
_BY_NAME: Final = {**{d.numpy: d for d in DTYPES if d.numpy}, **{d.name: d for d in DTYPES}}

# The reference's "Supported dtypes" list, in its order; the F6 types, which only we can write
# (from ml_dtypes arrays), come last.
_REFERENCE_ORDER: Final = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "complex64",
]
_SUPPORTED_NAMES: Final = ", ".join(
    sorted(
        (d.name for d in DTYPES if d.torch or d.numpy),
        key=lambda name: (_REFERENCE_ORDER.index(name) if name in _REFERENCE_ORDER else 99, name),
    )
)


def dtype_from_code(code: str) -> DType:
    """Return the dtype for a header code such as ``"F32"``.

    Raises:
        DTypeNotSupportedError: The code is not one of the 22 safetensors codes.
    """
    try:
        return BY_CODE[code]
    except KeyError:
        raise DTypeNotSupportedError(
            f"unknown dtype code {code!r}; expected one of {', '.join(BY_CODE)}",
            kind="UnknownDtype",
        ) from None


def dtype_from_name(name: str) -> DType:
    """Return the dtype for a framework-style name such as ``"bfloat16"``.

    Raises:
        SerializeError: The name is not a dtype safetensors can store.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise SerializeError(
            f'Unknown dtype "{name}". Supported dtypes: {_SUPPORTED_NAMES}',
            kind="UnknownDtype",
        ) from None


def checked_nbits(shape: tuple[int, ...] | list[int], dtype: DType) -> int | None:
    """Emulate the reference's checked u64 arithmetic for the bit size of a tensor.

    The product is folded left to right and fails as soon as an intermediate value exceeds
    ``2**64 - 1``, so the result depends on dimension order (``[2**63, 4, 0]`` overflows while
    ``[0, 2**63, 4]`` does not), exactly as in the reference.

    Returns:
        The number of bits, or None if any step overflows 64 bits.
    """
    n = 1
    for dim in shape:
        n *= dim
        if n > UINT64_MAX:
            return None
    n *= dtype.bits
    if n > UINT64_MAX:
        return None
    return n


def byte_size(shape: tuple[int, ...] | list[int], dtype: DType, *, tensor: str = "") -> int:
    """Return the byte size of a tensor, refusing overflow and sub-byte misalignment.

    Raises:
        TensorInfoError: The size overflows 64 bits or is not a whole number of bytes.
    """
    nbits = checked_nbits(shape, dtype)
    if nbits is None:
        raise TensorInfoError(
            "overflow computing buffer size from shape and/or element type"
            + (f" (tensor {tensor!r}, shape {list(shape)}, dtype {dtype.code})" if tensor else ""),
            kind="ValidationOverflow",
            tensor=tensor or None,
        )
    if nbits % 8:
        raise TensorInfoError(
            "The slice is slicing for subbytes dtypes, and the slice does not end up at a byte "
            "boundary, this is invalid."
            + (
                f" (tensor {tensor!r}: {dtype.code} shape {list(shape)} is {nbits} bits)"
                if tensor
                else ""
            ),
            kind="MisalignedSlice",
            tensor=tensor or None,
        )
    return nbits // 8
