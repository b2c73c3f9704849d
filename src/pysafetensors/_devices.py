"""Parsing ``device=`` arguments the way the reference does."""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any, Final

from ._errors import SafetensorError

__all__ = ["Device", "parse_device"]

#: Device types the reference accepts by name; a bare name means index 0.
DEVICE_TYPES: Final = ("cpu", "cuda", "mps", "npu", "xpu", "xla", "mlu", "musa", "hpu")


@dataclass(frozen=True, slots=True)
class Device:
    """A parsed device."""

    type: str
    """``cpu``, ``cuda``, ... or ``anonymous`` for a bare integer."""
    index: int | None = None
    """Device index, if given."""

    def __str__(self) -> str:
        if self.type == "anonymous":
            return str(self.index)
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def torch_spec(self) -> str | int:
        """What to pass to ``torch.device``."""
        if self.type == "anonymous":
            assert self.index is not None
            return self.index
        return str(self)


CPU: Final = Device("cpu")


def parse_device(device: Any) -> Device:
    """Parse ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, an int, ...

    ``torch.device`` objects are accepted too (the reference refuses them; we convert them).

    Raises:
        SafetensorError: The device string is not understood.
        ValueError: The index is not a number (``cuda:x``), as in the reference.
    """
    if device is None:
        return CPU
    if isinstance(device, bool):
        raise SafetensorError(f"device {device} is invalid", kind="InvalidDevice")
    if not isinstance(device, (int, str)) and hasattr(type(device), "__index__"):
        # numpy integers and other int-likes: the reference takes whatever has __index__, and
        # names a refused one by its repr (np.int64(-1)).
        try:
            as_int = operator.index(device)
        except TypeError:
            as_int = -1
        if not 0 <= as_int < 1 << 64:
            raise SafetensorError(f"device {device!r} is invalid", kind="InvalidDevice")
        device = as_int
    if isinstance(device, int):
        if not 0 <= device < 1 << 64:  # the reference's usize
            raise SafetensorError(f"device {device} is invalid", kind="InvalidDevice")
        return Device("anonymous", device)
    if not isinstance(device, str) and type(device).__name__ == "device":
        # torch.device: has .type and .index.
        index = getattr(device, "index", None)
        if index is None and str(device.type) == "cuda":
            # torch.device("cuda") means the current device (torch.cuda.set_device: a process
            # per GPU); the string "cuda" means cuda:0, as in the reference.
            index = _current_cuda_index()
        return parse_device(str(device.type) + ("" if index is None else f":{index}"))
    if not isinstance(device, str):
        raise SafetensorError(f"device {device!r} is invalid", kind="InvalidDevice")
    kind, sep, rest = device.partition(":")
    if kind not in DEVICE_TYPES:
        raise SafetensorError(f"device {device} is invalid", kind="InvalidDevice")
    if not sep:
        # The CPU and MPS have no index (the reference prints both as bare names).
        return Device(kind, None if kind in ("cpu", "mps") else 0)
    if ":" in rest:  # "cuda:0:0": the reference splits on ':' and wants two parts
        raise SafetensorError(f"device {device} is invalid", kind="InvalidDevice")
    if kind == "cpu" and not (
        0 < len(rest) <= 19 and rest.isascii() and rest.isdigit() and rest == str(int(rest))
    ):
        # The reference refuses every "cpu:..."; we take "cpu:N" as torch.device does (see
        # docs/differences.md), and refuse the rest in the reference's words.
        raise SafetensorError(f"device {device} is invalid", kind="InvalidDevice")
    index = _rust_usize(rest)
    if kind == "mps":
        if index != 0:
            raise SafetensorError(
                f"device {device} is invalid: only mps or mps:0 is supported", kind="InvalidDevice"
            )
        return Device(kind)
    return Device(kind, index)


def _current_cuda_index() -> int | None:
    """torch's current CUDA device, where CUDA is there (torch is imported: its device object
    was given); else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return int(torch.cuda.current_device())


def _rust_usize(text: str) -> int:
    """``text`` parsed as Rust's ``usize::from_str`` parses it (a leading ``+``, ASCII digits
    only), with its errors' words.

    Raises:
        ValueError: Empty, not digits, or over 64 bits, as in the reference.
    """
    if not text:
        raise ValueError("cannot parse integer from empty string")
    digits = text[1:] if text[0] == "+" else text
    if not digits or not all("0" <= c <= "9" for c in digits):
        raise ValueError("invalid digit found in string")
    value = int(digits)
    if value >= 1 << 64:
        raise ValueError("number too large to fit in target type")
    return value
