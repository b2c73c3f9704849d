"""Shapes every framework can hold: at most 64 dimensions, strides that fit in 63 bits.

The header rules only bound a tensor's byte count; this is checked before an adapter sees a
shape, so that numpy's and torch's own limits come out as a :class:`TensorInfoError` that
names the tensor.
"""

from __future__ import annotations

from typing import Final

from ._dtypes import DType
from ._errors import TensorInfoError

__all__ = ["MAX_NDIM", "check_representable", "max_ndim"]

#: numpy (2.x) and torch both refuse arrays of more than 64 dimensions.
MAX_NDIM: Final = 64

_INTP_MAX: Final = (1 << 63) - 1

#: Frameworks holding fewer dimensions than :data:`MAX_NDIM`: Paddle's tensors have at most 9
#: (a tenth raised Paddle's own ``OSError``, "Invalid dimension to be accessed").
_MAX_NDIM_OF: Final = {"paddle": 9}


def max_ndim(framework: str) -> int:
    """The most dimensions a tensor of ``framework`` can have."""
    return _MAX_NDIM_OF.get(framework, MAX_NDIM)


def check_representable(
    shape: tuple[int, ...], dtype: DType, name: str, *, framework: str = "np"
) -> None:
    """Refuse a shape no framework can hold, before any adapter sees it.

    The header rules only bound a tensor's byte count, so a zero-size tensor may declare any
    dimensions (``[0, 2**62]``) and a one-byte tensor any number of 1s. numpy and torch compute
    strides from the non-zero dimensions and cap the rank, and fail with their own exceptions
    (``ValueError``, ``RuntimeError``) when those limits are crossed; this turns that into a
    :class:`TensorInfoError` naming the tensor. Nothing is allocated either way.

    numpy's strides count bytes, torch's (``framework="pt"``) elements: torch holds a
    ``[0, 2**62]`` float32 tensor (as the reference loads it), numpy does not.

    Raises:
        TensorInfoError: More than 64 dimensions (Paddle: 9), or a stride that does not fit in
            63 bits.
    """
    if len(shape) > MAX_NDIM:
        raise TensorInfoError(
            f"tensor `{name}` has {len(shape)} dimensions; frameworks hold at most {MAX_NDIM}",
            kind="TooManyDimensions",
            tensor=name,
        )
    most = max_ndim(framework)
    if len(shape) > most:
        raise TensorInfoError(
            f"tensor `{name}` has {len(shape)} dimensions; {framework} holds at most {most}"
            " (load it with another framework, or take a slice of fewer dimensions)",
            kind="TooManyDimensions",
            tensor=name,
        )
    extent = 1 if framework == "pt" else max(1, dtype.bits // 8)
    for dim in shape:
        extent *= dim or 1
        if extent > _INTP_MAX:
            raise TensorInfoError(
                f"tensor `{name}` ({dtype.code} {list(shape)}) has no data but its strides "
                + (
                    "overflow 63 bits: torch.empty cannot make it"
                    if framework == "pt"
                    else "overflow 63 bits: numpy cannot hold its shape"
                ),
                kind="ShapeTooLarge",
                tensor=name,
            )
