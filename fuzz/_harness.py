"""Shared checks for the fuzz targets and for the quick hypothesis runs in the test suite.

Every ``check_*`` function takes one input and enforces the hardening invariant: the library
either raises a :class:`~pysafetensors.SafetensorError` subclass or returns correct results.
Any other exception escapes from the check as :class:`Violation` (wrapping the original) so the
caller (atheris, hypothesis, a regression test) sees it.

"Correct" is checked against the file's own bytes, independently of the reader's internals:
every tensor's bytes must equal the bytes its header entry points at, both backends must agree,
``get_tensors()`` must agree with ``get_tensor()``, and every slice must equal numpy indexing of
the full tensor (or be refused with ``SliceError`` for an index the slicer does not support).

This module imports pysafetensors lazily, so atheris can instrument it first.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

DTYPE_CODES = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64",
)  # fmt: skip
_BITS = (8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64)
BITS = dict(zip(DTYPE_CODES, _BITS, strict=True))
INTERESTING_INTS = (
    0, 1, 2, 3, 4, 7, 8, 15, 16, 63, 64, 65, 255, 256, 4096, 65535, 2**31 - 1, 2**31, 2**32 - 1,
    2**32, 2**53, 2**61 - 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -1, -(2**63),
    4194305, 211106198978564, 100_000_000, 100_000_001,
)  # fmt: skip


class Violation(AssertionError):
    """The invariant was broken: a foreign exception escaped, or a result was wrong."""


def _lib() -> Any:
    import pysafetensors

    return pysafetensors


# ------------------------------------------------------------------------------ file helpers


def frame(header: bytes, body: bytes = b"", pad: bool = True) -> bytes:
    """Build a file from header JSON bytes and a data buffer (space-padding the header)."""
    if pad:
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + body


def split(data: bytes) -> tuple[bytes, bytes] | None:
    """Split a file into (header, body) if its length prefix is in range."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        return None
    return data[8 : 8 + n], data[8 + n :]


def nbytes_of(dtype: str, shape: list[int]) -> int | None:
    """Byte size of a tensor, or None where the reference rejects it (overflow, sub-byte)."""
    count = 1
    for d in shape:
        count *= d
        if count >= 2**64:
            return None
    bits = count * BITS[dtype]
    if bits >= 2**64 or bits % 8:
        return None
    return bits // 8


def repair(header_obj: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], bytes] | None:
    """Rewrite offsets so every entry with a computable size tiles the buffer; random body."""
    out: dict[str, Any] = {}
    offset = 0
    for name, entry in header_obj.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            out[name] = entry
            continue
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if (
            not isinstance(dtype, str)
            or dtype not in BITS
            or not isinstance(shape, list)
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            out[name] = entry
            continue
        size = nbytes_of(dtype, shape)
        if size is None or size > 1 << 16:
            out[name] = entry
            continue
        out[name] = {**entry, "data_offsets": [offset, offset + size]}
        offset += size
    return out, rng.randbytes(offset)


def write_temp(data: bytes, folder: str) -> str:
    """Write ``data`` to a fixed scratch file in ``folder`` (reused across inputs)."""
    path = os.path.join(folder, "input.safetensors")
    with open(path, "wb") as f:
        f.write(data)
    return path


_SCRATCH: str | None = None


def scratch_dir() -> str:
    """A per-process scratch folder, in RAM where available."""
    global _SCRATCH
    if _SCRATCH is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        _SCRATCH = tempfile.mkdtemp(prefix="pysafetensors-fuzz-", dir=base)
        # libFuzzer may exit without running this; test runs (the common case) clean up.
        atexit.register(shutil.rmtree, _SCRATCH, True)
    return _SCRATCH


# ------------------------------------------------------------------------ the header target


def _is_safetensor_error(exc: BaseException) -> bool:
    return isinstance(exc, _lib().SafetensorError)


def guard(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; return its result, or None if it raised a SafetensorError; else Violation."""
    try:
        return fn()
    except Violation:
        raise
    except Exception as exc:
        if _is_safetensor_error(exc):
            return None
        raise Violation(f"foreign exception {type(exc).__name__}: {exc}") from exc
    except RecursionError as exc:  # pragma: no cover - subclass of Exception, kept explicit
        raise Violation("RecursionError escaped") from exc


def check_compact_path(data: bytes) -> None:
    """The compact-header fast path may only accept what the generic parser accepts, as is.

    Its result must equal the generic parser's to the last field: the same entries in the
    same order with the same dtypes, shapes and offsets, and the same metadata.
    """
    from pysafetensors._format import _canonical_header, _parse_generic

    parts = split(data)
    if parts is None:
        return
    header, body = parts
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError:
        return
    n, data_size = len(header), len(body)
    fast = guard(lambda: _canonical_header(text, n, data_size))
    if fast is None:
        return
    generic = guard(lambda: _parse_generic(text, n, data_size, ""))
    if generic is None:
        raise Violation("the compact path accepted a header the generic parser refuses")
    if list(fast.tensors.items()) != list(generic.tensors.items()):
        raise Violation("the compact path's entries differ from the generic parser's")
    if fast.metadata != generic.metadata or fast.header_size != generic.header_size:
        raise Violation("the compact path's metadata differs from the generic parser's")


def check_header(data: bytes) -> None:
    """Parse a whole file's framing and header; a valid result must tile the data buffer."""
    from pysafetensors._format import parse_header, parse_header_length

    def run() -> Any:
        n = parse_header_length(data[:8], len(data))
        return parse_header(data[8 : 8 + n], len(data) - 8 - n)

    header = guard(run)
    check_compact_path(data)
    if header is None:
        return
    running = 0
    for info in header.tensors.values():
        if info.begin != running or info.end < info.begin:
            raise Violation(f"accepted a header that does not tile: {info}")
        size = nbytes_of(info.dtype.code, list(info.shape))
        if size != info.end - info.begin:
            raise Violation(f"accepted a size mismatch: {info}")
        running = info.end
    if 8 + header.header_size + running != len(data):
        raise Violation("accepted a file whose data buffer is not exactly covered")
    if header.metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items()
    ):
        raise Violation("accepted non-string metadata")


# ------------------------------------------------------------------ the validate target


def check_validate(data: bytes) -> None:
    """``validate`` never raises on bytes, reports errors exactly when the reader refuses the
    file (the reader's reason among them: an error of its code), and lists no problem twice."""
    from pysafetensors._errors import SafetensorError
    from pysafetensors._format import parse_header, parse_header_length
    from pysafetensors._sources import BufferSource
    from pysafetensors._validate import validate_source

    refused: SafetensorError | None = None
    try:
        n = parse_header_length(data[:8], len(data))
        parse_header(data[8 : 8 + n], len(data) - 8 - n)
    except SafetensorError as exc:
        refused = exc
    try:
        problems = validate_source(BufferSource(data), strict=True, check_values=True)
    except Exception as exc:
        raise Violation(f"validate raised {type(exc).__name__}: {exc}") from exc
    errors = [p for p in problems if p.severity == "error"]
    if refused is None and errors:
        raise Violation(f"the reader accepts the file, validate reports {errors}")
    if refused is not None and not any(p.code == refused.kind for p in errors):
        raise Violation(f"the reader refuses the file ({refused.kind}: {refused}); {errors}")
    seen = [(p.severity, p.code, p.tensor, p.message) for p in problems]
    if len(set(seen)) != len(seen):
        raise Violation(f"a problem listed twice: {problems}")


# ------------------------------------------------------------------ the safe_open target


def expected_array(raw: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The numpy array a tensor's raw bytes stand for, built without pysafetensors' reader."""
    from pysafetensors._adapter import numpy_dtype, unpack_subbyte
    from pysafetensors._dtypes import dtype_from_code

    dt = dtype_from_code(dtype)
    buf = np.frombuffer(raw, np.uint8)
    if dt.packed:
        count = int(np.prod(shape, dtype=object)) if shape else 1
        return unpack_subbyte(buf, dt, count).view(numpy_dtype(dt)).reshape(shape)
    return buf.view(numpy_dtype(dt)).reshape(shape)


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of two arrays (NaN-safe), including dtype and shape."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def random_index(rng: random.Random, ndim: int, dims: tuple[int, ...]) -> Any:
    """An index drawn from the supported grammar and beyond it (hostile values included)."""

    def bound() -> Any:
        r = rng.random()
        if r < 0.2:
            return None
        size = dims[rng.randrange(len(dims))] if dims else 1
        choices = [0, 1, -1, size, size + 1, -size, -size - 1, size // 2, 2**63, -(2**63), 2**70]
        value = rng.choice(choices)
        return np.int64(value) if r > 0.9 and -(2**63) <= value < 2**63 else value

    def item() -> Any:
        r = rng.random()
        if r < 0.35:
            step = rng.choice([None, None, 1, 2, 3, 0, -1, 2**64])
            return slice(bound(), bound(), step)
        if r < 0.7:
            b = bound()
            return 0 if b is None else b
        if r < 0.8:
            return Ellipsis
        if r < 0.9:
            return advanced()
        return rng.choice([None, 1.5, "a", [0], [], True, (1,), slice(1.5, 2)])

    def advanced() -> Any:
        # get_slice's advanced items (numpy's rules): ranges, integer lists and arrays,
        # boolean masks of the right length and of a wrong one.
        size = dims[rng.randrange(len(dims))] if dims else 1
        r = rng.random()
        if r < 0.3:
            return range(
                rng.choice([0, 1, -1, size]),
                rng.choice([0, size, size + 1, -1]),
                rng.choice([1, 2, -1, 3]),
            )
        picks = [rng.choice([0, 1, -1, size - 1, size, -size]) for _ in range(rng.randrange(4))]
        if r < 0.55:
            return picks
        if r < 0.8:
            kind = rng.choice([np.int64, np.int32, np.uint8, np.intp])
            if all(np.iinfo(kind).min <= p <= np.iinfo(kind).max for p in picks):
                return np.array(picks, dtype=kind)
            return picks
        length = size if rng.random() < 0.8 else size + 1
        return np.array([rng.random() < 0.5 for _ in range(min(length, 64))], dtype=bool)

    r = rng.random()
    if r < 0.05:
        return ()
    if r < 0.1:
        return []
    if r < 0.35:
        return item()
    return tuple(item() for _ in range(rng.randrange(0, ndim + 3)))


def _supported(index: Any, advanced: bool = False) -> bool:
    """Whether pysafetensors promises numpy semantics for this index.

    Args:
        index: The index.
        advanced: ``get_slice`` (True), which also takes ``None``, bools, lists and arrays
            (numpy's rules); ``plan_slice`` (False) takes basic indices only.
    """
    import operator

    items = index if isinstance(index, tuple) else (index,)
    if isinstance(index, list):
        return index == [] or advanced
    for it in items:
        if advanced and (it is None or isinstance(it, (bool, list, tuple, range, np.ndarray))):
            continue
        if isinstance(it, (bool, np.bool_)):
            return False
        if it is Ellipsis:
            continue
        if isinstance(it, slice):
            for b in (it.start, it.stop, it.step):
                if b is None:
                    continue
                try:
                    operator.index(b)
                except TypeError:
                    return False
            if it.step is not None and operator.index(it.step) <= 0:
                return False
            continue
        if it is None:
            return False
        try:
            operator.index(it)
        except TypeError:
            return False
    return True


def _length(r: range) -> int:
    """``len(r)``, which raises OverflowError past ``sys.maxsize``."""
    return max(0, (r.stop - r.start + r.step - (1 if r.step > 0 else -1)) // r.step)


def numpy_index(full: np.ndarray, index: Any) -> np.ndarray | None:
    """numpy's answer for ``full[index]``, or None if numpy refuses it."""
    # Index a same-size unsigned view: numpy scalars would normalise BOOL bytes and NaN bits.
    raw = full.view(f"u{full.dtype.itemsize}")
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(it, range) and _length(it) > 2**24 for it in items):
        # numpy builds a range value by value; pysafetensors refuses one longer than twice its
        # dimension (some values out of bounds) or than 2^24 on a tensor of no elements.
        return None
    try:
        return np.asarray(raw[index]).view(full.dtype)
    except (IndexError, TypeError, ValueError, OverflowError, MemoryError):
        # MemoryError: advanced indices on a zero-size tensor with a huge dimension; numpy
        # cannot answer, and ours must refuse with its own error (checked by the caller).
        return None


def check_slice_result(
    full: np.ndarray, index: Any, packed: bool, get: Callable[[], Any], advanced: bool = True
) -> None:
    """Compare ``get()`` (a SafeSlice read, or a basic plan if not ``advanced``) with numpy
    indexing of the full array."""
    from pysafetensors._slicing import is_advanced

    want = numpy_index(full, index) if _supported(index, advanced=advanced) else None
    try:
        got = get()
    except Violation:
        raise
    except Exception as exc:
        if not _is_safetensor_error(exc):
            raise Violation(
                f"slice {index!r} of {full.dtype}{full.shape}: foreign {type(exc).__name__}: {exc}"
            ) from exc
        # Sub-byte dtypes: runs that split a byte, and advanced indices, are refused.
        allowed = (
            ("MisalignedSlice", "InvalidSlice") if is_advanced(index) else ("MisalignedSlice",)
        )
        if want is not None and not (packed and getattr(exc, "kind", "") in allowed):
            raise Violation(f"slice {index!r} of {full.dtype}{full.shape} refused: {exc}") from exc
        return
    if want is None:
        raise Violation(f"slice {index!r} of {full.dtype}{full.shape} accepted, numpy refuses")
    if not same_array(np.asarray(got), want):
        raise Violation(f"slice {index!r} of {full.dtype}{full.shape}: wrong data")


def _torch_difference(index: Any) -> bool:
    """Whether ``index`` is one where ``"pt"`` slices keep numpy's rule on purpose
    (docs/differences.md): two ellipses, a step torch's length computation overflows on, a
    range too long to build."""
    items = index if isinstance(index, tuple) else (index,)
    return (
        sum(1 for it in items if it is Ellipsis) > 1
        or any(isinstance(it, slice) and _huge_step(it.step) for it in items)
        or any(isinstance(it, range) and _length(it) > 2**24 for it in items)
    )


def _huge_step(step: Any) -> bool:
    import operator

    try:
        return step is not None and operator.index(step) >= 2**63 - 1
    except TypeError:
        return False


def check_torch_slice(full: Any, index: Any, get: Callable[[], Any]) -> None:
    """Compare ``get()`` (a ``"pt"`` SafeSlice read) with torch's indexing of the whole tensor,
    which the reference's torch slices use: the same elements, or a refusal where torch
    refuses."""
    import warnings

    import torch

    if _torch_difference(index):
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # torch's uint8-mask and list-as-tuple deprecations
        try:
            want = full[index]
        except RuntimeError:
            if full.numel() == 0 and max(full.shape) >= 2**31:
                return  # torch's strides (step x row length) overflow int64: its own bug
            want = None
        except (IndexError, TypeError, ValueError, OverflowError):
            want = None
        except SystemError:
            # torch raising its own warning with an exception already set (seen only under
            # the fuzzer's tracing): no answer to compare with.
            return
        try:
            got = get()
        except Exception as exc:
            if not _is_safetensor_error(exc):
                raise Violation(
                    f"torch slice {index!r}: foreign {type(exc).__name__}: {exc}"
                ) from exc
            if want is not None:
                raise Violation(
                    f"torch slice {index!r} of {tuple(full.shape)} refused: {exc}"
                ) from exc
            return
    if want is None:
        raise Violation(f"torch slice {index!r} of {tuple(full.shape)} accepted, torch refuses")
    if any(d < 0 for d in want.shape) or any("Truncating" in str(w.message) for w in caught):
        # torch's own overflow on dimensions near 2**63 (docs/differences.md): a negative
        # length for [::3] of 2**63 - 1 rows, or bounds truncated to 0; ours are Python's.
        return

    def bits(t: Any) -> bytes:
        # A fresh tensor: a contiguous one may keep any stride on a dimension of 1.
        fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        return bytes(fresh.reshape(-1).view(torch.uint8).numpy())

    if got.dtype != want.dtype or got.shape != want.shape or bits(got) != bits(want):
        raise Violation(f"torch slice {index!r} of {tuple(full.shape)}: wrong data")


def check_file(
    data: bytes, *, seed: int | None = None, frameworks: tuple[str, ...] = ("np",)
) -> None:
    """Open ``data`` as a file with both backends and exercise every accessor."""
    lib = _lib()
    path = write_temp(data, scratch_dir())
    rng = random.Random(zlib.crc32(data) if seed is None else seed)
    results: dict[str, dict[str, np.ndarray]] = {}
    accepted: list[bool] = []
    for framework in frameworks:
        for backend in ("mmap", "pread"):
            got = guard(lambda fw=framework, be=backend: _exercise(lib, path, data, fw, be, rng))
            accepted.append(got is not None)
            if got is not None and framework == "np":
                results[backend] = got
    if len(set(accepted)) > 1:
        raise Violation(f"backends/frameworks disagree on acceptance: {accepted}")
    if len(results) == 2:
        a, b = results["mmap"], results["pread"]
        if list(a) != list(b) or not all(same_array(a[k], b[k]) for k in a):
            raise Violation("mmap and pread return different tensors")


def _exercise(
    lib: Any, path: str, data: bytes, framework: str, backend: str, rng: random.Random
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with lib.safe_open(path, framework, backend=backend) as f:
        header = f.header
        keys = f.keys()
        if keys != sorted(header.tensors) or f.offset_keys() != list(header.tensors):
            raise Violation("keys()/offset_keys() disagree with the header")
        meta = f.metadata()
        if meta is not None and not all(isinstance(v, str) for v in meta.values()):
            raise Violation("metadata holds non-strings")
        start = header.data_start
        for name in f.offset_keys():
            info = header.tensors[name]
            raw = data[start + info.begin : start + info.end]
            if len(raw) != info.end - info.begin:
                raise Violation(f"tensor {name!r} points past the end of the file")
            tensor = guard(lambda name=name: f.get_tensor(name))
            if tensor is None:
                # Refusing to materialise a tensor is allowed (e.g. a zero-size tensor whose
                # shape the framework cannot hold); slices of it must then be refused too.
                continue
            if framework == "pt":
                shape = list(info.shape)
                if info.dtype.code == "F4" and shape:
                    shape[-1] //= 2  # torch's float4_e2m1fn_x2 holds two values per element
                if list(tensor.shape) != shape:
                    raise Violation(f"torch tensor {name!r} has the wrong shape")
                if info.dtype.bits % 8 == 0:
                    sl = f.get_slice(name)
                    for _ in range(3):
                        index = random_index(rng, len(info.shape), info.shape)
                        check_torch_slice(tensor, index, lambda index=index, sl=sl: sl[index])
                continue
            want = expected_array(raw, info.dtype.code, info.shape)
            if not same_array(tensor, want):
                raise Violation(f"tensor {name!r} has wrong data/dtype/shape")
            out[name] = tensor
            sl = f.get_slice(name)
            if sl.get_shape() != list(info.shape) or sl.get_dtype() != info.dtype.code:
                raise Violation(f"slice of {name!r} reports the wrong shape/dtype")
            for _ in range(3):
                index = random_index(rng, len(info.shape), info.shape)
                check_slice_result(
                    want, index, info.dtype.packed, lambda index=index, sl=sl: sl[index]
                )
        if framework == "np":
            everything = guard(f.get_tensors)
            if everything is not None:
                if list(everything) != f.offset_keys() or len(out) != len(everything):
                    raise Violation("get_tensors() returned a different set of tensors")
                for k, v in everything.items():
                    if not same_array(v, out[k]):
                        raise Violation(f"get_tensors()[{k!r}] differs from get_tensor()")
        try:
            f.get_tensor("\x00no such tensor\x00")
        except lib.TensorNotFoundError:
            pass
        else:
            raise Violation("a missing tensor was found")
    return out


# ------------------------------------------------------------------ the slicing target


def check_plan(dtype_code: str, shape: tuple[int, ...], index: Any) -> None:
    """``plan_slice`` must pick exactly the bytes numpy indexing picks (or refuse)."""
    from pysafetensors._dtypes import dtype_from_code
    from pysafetensors._slicing import plan_slice

    dt = dtype_from_code(dtype_code)
    size = nbytes_of(dtype_code, list(shape))
    if size is None:
        return
    raw = bytes((i * 7 + 3) % 251 for i in range(size))
    try:
        full = expected_array(raw, dtype_code, shape)
    except ValueError:
        # A zero-size shape numpy cannot hold: the plan must still be computed without
        # allocating and select nothing.
        plan = guard(lambda: plan_slice(shape, dt, index))
        if plan is not None and plan.nbytes != 0:
            raise Violation(f"plan of an empty tensor selects {plan.nbytes} bytes") from None
        return

    def read() -> np.ndarray:
        plan = plan_slice(shape, dt, index)
        buf = bytearray()
        for off, length in plan.coalesced():
            if off < 0 or off + length > size:
                raise Violation(f"plan reads outside the tensor: {(off, length)}")
            buf += raw[off : off + length]
        if len(buf) != plan.nbytes:
            raise Violation("plan.nbytes disagrees with its runs")
        return expected_array(bytes(buf), dtype_code, plan.shape)

    check_slice_result(full, index, dt.packed, read, advanced=False)


# ------------------------------------------------------------------ the differential target


def _ours(data: bytes) -> tuple[str, Any]:
    lib = _lib()
    try:
        items = lib.deserialize(data)
    except lib.SafetensorError as exc:
        return "reject", getattr(exc, "kind", type(exc).__name__)
    return "accept", {n: (d["dtype"], list(d["shape"]), bytes(d["data"])) for n, d in items}


def _theirs(data: bytes) -> tuple[str, Any]:
    import safetensors

    try:
        items = safetensors.deserialize(data)
    except Exception as exc:  # the reference raises SafetensorError, sometimes others
        return "reject", f"{type(exc).__name__}: {str(exc)[:80]}"
    return "accept", {n: (d["dtype"], list(d["shape"]), bytes(d["data"])) for n, d in items}


#: ``(ours, theirs)`` prefixes of disagreements that are intentional and documented in
#: ``docs/differences.md`` ("Found by differential fuzzing").
KNOWN_DIFFERENCES: tuple[tuple[str, str], ...] = ()


def known_difference(ours: str, theirs: str) -> bool:
    """Whether a disagreement found by :func:`differential` is a documented one."""
    return any(ours.startswith(a) and theirs.startswith(b) for a, b in KNOWN_DIFFERENCES)


def differential(data: bytes) -> tuple[str, str] | None:
    """Compare the reference and pysafetensors on one file.

    Returns:
        None when they agree, else ``(ours, theirs)`` short descriptions.
    """
    ours = guard(lambda: _ours(data))
    theirs = _theirs(data)
    if ours is None:  # pragma: no cover - _ours catches SafetensorError itself
        raise Violation("unreachable")
    if ours[0] != theirs[0]:
        return (
            f"{ours[0]} {ours[1] if ours[0] == 'reject' else ''}".strip(),
            f"{theirs[0]} {theirs[1] if theirs[0] == 'reject' else ''}".strip(),
        )
    if ours[0] == "accept" and ours[1] != theirs[1]:
        return "accept (different tensors)", "accept"
    if ours[0] == "accept":
        # Metadata is only visible through safe_open on both sides.
        import safetensors

        path = write_temp(data, scratch_dir())
        with safetensors.safe_open(path, "np") as f:
            ref_meta = f.metadata()
        with _lib().safe_open(path, "np") as g:
            our_meta = g.metadata()
        if (ref_meta or None) != (our_meta or None) and ref_meta != our_meta:
            return f"metadata {our_meta!r:.60}", f"metadata {ref_meta!r:.60}"
    return None


# ------------------------------------------------------------------ the pickle target


def check_pickle(data: bytes) -> None:
    """Load a fuzzed PyTorch checkpoint with the torch-free reader, if it exists, in both of its
    modes for unknown globals (``unknown="error"`` and ``"skip"``).

    Only ``SafetensorError`` may escape either, and the modes must agree: skip mode differs
    only where error mode refused an unknown object as skippable. Where error mode reads the
    file, skip mode reads the same tensors and values and skips nothing; where it fails in any
    other way (a dangerous global, a broken file), skip mode fails with the same error; where
    skip mode skips something, error mode refused it as skippable.
    """
    try:
        from pysafetensors import _torch_pickle
        from pysafetensors._errors import UnsafePickleError
    except ImportError:
        return
    path = os.path.join(scratch_dir(), "input.pt")
    with open(path, "wb") as fh:
        fh.write(data)

    def run(unknown: str) -> tuple[Any, ...]:
        with _torch_pickle.load_checkpoint(path, unknown=unknown) as ckpt:
            for rec in ckpt.tensors.values():
                total = 0
                for chunk in ckpt.tensor_chunks(rec):
                    total += memoryview(chunk).nbytes
                    if total > len(data) * 64 + (1 << 20):
                        raise Violation("a checkpoint expanded far beyond its file size")
            return ckpt.tensors, ckpt.non_tensor_metadata(), ckpt.skipped

    def attempt(unknown: str) -> tuple[Any, BaseException | None]:
        caught: list[BaseException] = []

        def go() -> Any:
            try:
                return run(unknown)
            except Exception as exc:
                caught.append(exc)
                raise

        result = guard(go)
        return result, (caught[0] if result is None and caught else None)

    strict, strict_error = attempt("error")
    lenient, lenient_error = attempt("skip")
    skippable = isinstance(strict_error, UnsafePickleError) and strict_error.skippable
    if strict is not None:
        if lenient is None:
            raise Violation(f"skip mode fails where error mode reads the file: {lenient_error}")
        if lenient[:2] != strict[:2] or lenient[2].globals:
            raise Violation("skip mode reads other tensors or values where nothing is unknown")
    elif not skippable:
        same = type(lenient_error) is type(strict_error) and str(lenient_error) == str(strict_error)
        if not same:
            raise Violation(
                f"error mode refused with {strict_error!r}, skip mode gave {lenient_error!r}"
            )
    if lenient is not None and lenient[2].globals and not skippable:
        raise Violation("skip mode skipped objects that error mode did not refuse as skippable")


# ------------------------------------------------------------------ the streaming target


def streaming_module() -> Any | None:
    """The streaming writer, once it exists."""
    try:
        from pysafetensors import _streaming
    except ImportError:
        return None
    return _streaming


def check_streaming(data: bytes) -> None:
    """Drive ``StreamingWriter`` with a fuzzed plan of declarations and writes.

    The input seeds the choice of tensors (names, dtypes, small or hostile shapes, metadata)
    and a sequence of writes (in range or not, overlapping or not, wrong dtypes, unknown names),
    then a close or an abort. Only ``SafetensorError`` may escape; a committed file must read
    back (by pysafetensors and by the reference) with exactly the bytes written; a failed or
    aborted writer must leave no file and no temporary file behind.
    """
    streaming = streaming_module()
    if streaming is None or len(data) < 2:
        return
    rng = random.Random(data)
    folder = tempfile.mkdtemp(dir=scratch_dir())
    target = os.path.join(folder, "out.safetensors")
    decls: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i in range(data[0] % 5):
        dtype = rng.choice(DTYPE_CODES)
        shape = tuple(rng.choice([0, 1, 2, 3, 4, 8]) for _ in range(rng.randrange(0, 4)))
        if rng.random() < 0.05:
            shape = (*shape, rng.choice(INTERESTING_INTS))
        decls[rng.choice([f"t{i}", f"t{i}", "", "__metadata__", "\u00e9"])] = (dtype, shape)
    # (Non-string metadata is a TypeError by design, as in the reference: not fuzzed here.)
    metadata = rng.choice([None, {}, {"a": "b"}, {"\u00e9": ""}])
    shadow: dict[str, bytearray] = {}
    writer = guard(lambda: streaming.StreamingWriter(target, decls, metadata))
    try:
        if writer is None:
            return
        if writer.layout.file_size > 1 << 20:
            # A huge declaration is legal (the file is sparse until written); don't shadow it.
            guard(writer.abort)
            return
        for info in writer.layout.tensors:
            shadow[info.name] = bytearray(info.nbytes)
        names = [*shadow, "missing"]
        for _ in range(data[1] % 12):
            name = rng.choice(names)
            size = len(shadow.get(name, b""))
            offset = rng.choice([0, 0, 1, size // 2, size, size + 1, -1])
            length = rng.choice([0, 1, 2, 3, max(0, size - offset), size + 1])
            payload = rng.randbytes(max(0, length))
            if rng.random() < 0.1:
                arg: Any = np.frombuffer(payload, np.uint8)
            else:
                arg = payload

            def write(name: str = name, offset: int = offset, arg: Any = arg) -> int:
                return int(writer.write(name, arg, offset))

            done = guard(write)
            if done is not None:
                if name not in shadow or offset < 0 or offset + len(payload) > size:
                    raise Violation(f"write outside tensor {name!r} accepted")
                shadow[name][offset : offset + len(payload)] = payload
        finish = guard(writer.close if rng.random() < 0.9 else writer.abort)
        if finish is None or not os.path.exists(target):
            guard(writer.abort)
    finally:
        if writer is not None:
            guard(writer.abort)
    leftovers = [f for f in os.listdir(folder) if f != "out.safetensors"]
    if leftovers:
        raise Violation(f"temporary files left behind: {leftovers}")
    if os.path.exists(target):
        with open(target, "rb") as fh:
            content = fh.read()
        got = _ours(content)
        if got[0] != "accept":
            raise Violation(f"committed file does not read back: {got[1]}")
        for name, want in shadow.items():
            if got[1][name][2] != bytes(want):
                raise Violation(f"committed tensor {name!r} has the wrong bytes")
        if _theirs(content)[0] != "accept":
            raise Violation("the reference cannot read a committed file")
    for f in os.listdir(folder):
        os.unlink(os.path.join(folder, f))
    os.rmdir(folder)


# ------------------------------------------------------------------ structure-aware mutation


def mutate_file(data: bytes, rng: random.Random, byte_mutate: Callable[[bytes], bytes]) -> bytes:
    """Mutate a safetensors file at the level of its structure, re-framing the result.

    ``byte_mutate`` is the fuzzer's own byte-level mutator (atheris.Mutate); structure-aware
    moves keep the file parseable often enough to reach the deep code (slicing, reads).
    """
    parts = split(data)
    if parts is None or rng.random() < 0.2:
        return byte_mutate(data)
    header, body = parts
    op = rng.randrange(10)
    if op == 0:
        return frame(byte_mutate(header), body, pad=rng.random() < 0.5)
    if op == 1:  # change the length prefix slightly or wildly
        n = len(header) + rng.choice([-1, 1, -8, 8, 2**63, 100_000_001])
        return struct.pack("<Q", n % 2**64) + header + body
    if op == 2:  # resize the data buffer
        cut = rng.randrange(-3, 4)
        return frame(header, body[:cut] if cut < 0 else body + rng.randbytes(cut), pad=False)
    try:
        obj = json.loads(header)
    except (ValueError, RecursionError):
        return byte_mutate(data)
    if not isinstance(obj, dict):
        return byte_mutate(data)
    names = [k for k in obj if k != "__metadata__"]
    if op == 3 and names:  # an interesting integer somewhere in an entry
        entry = obj[rng.choice(names)]
        if isinstance(entry, dict):
            field = rng.choice(["shape", "data_offsets"])
            seq = entry.get(field)
            if isinstance(seq, list) and seq:
                seq[rng.randrange(len(seq))] = rng.choice(INTERESTING_INTS)
            elif isinstance(seq, list):
                seq.append(rng.choice(INTERESTING_INTS))
    elif op == 4 and names:  # another dtype (valid or not)
        entry = obj[rng.choice(names)]
        if isinstance(entry, dict):
            entry["dtype"] = rng.choice([*DTYPE_CODES, "f32", "F128", "", "float32"])
    elif op == 5:  # a new tensor with a hostile or ordinary shape
        ndim = rng.randrange(0, 5)
        shape = [rng.choice([0, 1, 2, 3, 4, 5, 8]) for _ in range(ndim)]
        if rng.random() < 0.2:
            shape.append(rng.choice(INTERESTING_INTS))
        obj[rng.choice(["w", "b", "", "x" * 3, "\u00e9", "a/b"])] = {
            "dtype": rng.choice(DTYPE_CODES),
            "shape": shape,
            "data_offsets": [0, 0],
        }
    elif op == 6:  # metadata, hostile or not
        obj["__metadata__"] = rng.choice(
            [None, {}, {"a": "b"}, {"a": 1}, [], "x", {"k" * 3: "v" * 100}]
        )
    elif op == 7 and names:  # drop an entry
        del obj[rng.choice(names)]
    # Writers emit the compact form, which the reader parses on its own fast path; the
    # spaced form exercises the generic parser. Both, so that both paths are fuzzed.
    separators = (",", ":") if rng.random() < 0.6 else (", ", ": ")
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, separators=separators).encode(
        "utf-8", "surrogatepass"
    )
    if op in (3, 4) and rng.random() < 0.5 or op >= 8:
        fixed = repair(obj, rng)
        if fixed is not None:
            obj, body = fixed
            text = json.dumps(obj, separators=separators).encode("utf-8", "surrogatepass")
    return frame(text, body, pad=rng.random() < 0.8)
