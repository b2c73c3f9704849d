"""``pysafetensors diff``: what differs between two files or models.

Headers are compared first (added and removed tensors, dtype and shape changes, metadata). Then,
unless ``--no-values``, the values of tensors present in both with the same shape: tensors of the
same dtype are compared byte for byte first (cheap, exact); when bytes differ, or the dtypes
differ (say F32 against its BF16 cast), values are compared as float64 and the largest absolute
and relative differences are reported. A tensor whose values all satisfy
``|a - b| <= atol + rtol * |b|`` is "close", not "changed". Non-finite values compare exactly,
whatever the tolerances and in either order: NaN equals NaN, an infinity equals the same-sign
infinity, and any other pair involving Inf or NaN differs beyond tolerance.

Exit code: 0 when nothing changed beyond the tolerances, 1 when something did, 2 on errors.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np

from .._adapter import chunk_values, chunk_values_widened
from .._dtypes import DType
from .._format import gc_paused
from . import _chunk_work
from ._chunk_work import (
    ChunkWorkers,
    as_float64,
    element_chunks,
    take_float64,
    take_masks,
)
from ._common import (
    Model,
    TensorRef,
    Ui,
    add_filter_args,
    add_header_limit_arg,
    check_filter_matches,
    name_filter,
    open_model,
    print_json,
    quoted,
    sanitize,
    shown,
    to_float64,
    tolerance,
    url_argument_errors,
)
from ._paired_batches import PairBatch, batched_pairs, read_pair_batch
from ._remote_args import add_remote_args, remote_options

SCHEMA: Final = "pysafetensors.diff/1"


def register(sub: Any) -> None:
    """Add the ``diff`` subcommand."""
    p = sub.add_parser(
        "diff",
        help="added, removed and changed tensors and metadata between two files or models",
        description="Compare two files or models (a file against a sharded folder works too). "
        "Exit code: 0 no differences beyond tolerance, 1 differences, 2 errors.",
    )
    p.add_argument("a", metavar="A", help="file, model folder, index or URL")
    p.add_argument("b", metavar="B", help="file, model folder, index or URL")
    p.add_argument("--atol", type=tolerance, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=tolerance, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--no-values", action="store_true", help="compare headers only")
    add_filter_args(p)
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run, trouble_code=2)


def _integer(code: str) -> bool:
    return code[0] in "IU"


def _integer_differences(
    ia: np.ndarray, ib: np.ndarray, atol: float, rtol: float
) -> tuple[int, float, float, int]:
    """Differing count, max abs and rel difference, and count outside tolerance, exactly.

    float64 holds integers exactly only up to 2**53 (``2**53`` and ``2**53 + 1`` compared as
    floats are equal), so integer tensors are compared as integers. The differing elements are
    measured with numpy where every value is below 2**52 in magnitude (so every difference is
    below 2**53, and exact in both int64 and float64: the same results as Python's exact
    integers), else with Python's integers (wide 64-bit values, usually few).
    """
    if ia.dtype == ib.dtype or np.promote_types(ia.dtype, ib.dtype) != np.float64:
        ne = ia != ib
    else:
        # uint64 against a signed type, which numpy would compare as float64: equal where the
        # signed value is not negative and its bits read unsigned are the same.
        unsigned, signed = (ia, ib) if ia.dtype.kind == "u" else (ib, ia)
        ne = (signed < 0) | (unsigned != signed.astype(np.uint64))
    n_ne = int(ne.sum())
    if not n_ne:
        return 0, 0.0, 0.0, 0
    xa, xb = ia[ne], ib[ne]
    if _below_2_52(xa) and _below_2_52(xb):
        a64, b64 = xa.astype(np.int64), xb.astype(np.int64)
        diffs = np.abs(a64 - b64).astype(np.float64)
        scale = np.abs(b64).astype(np.float64)
        with np.errstate(divide="ignore"):
            rel = np.where(scale > 0, diffs / scale, math.inf)
        out = int((diffs > atol + rtol * scale).sum())
        return n_ne, float(diffs.max()), float(rel.max()), out
    la, lb = xa.tolist(), xb.tolist()
    exact = [abs(int(x) - int(y)) for x, y in zip(la, lb, strict=True)]
    big = float(max(exact))
    rel_max = max((d / abs(y) if y else math.inf) for d, y in zip(exact, lb, strict=True))
    # Python compares an int with a float exactly.
    out = sum(1 for d, y in zip(exact, lb, strict=True) if d > atol + rtol * abs(y))
    return n_ne, big, rel_max, out


#: Integers below this magnitude differ by less than 2**53: exact as float64.
_HALF_EXACT: Final = 1 << 52


def _below_2_52(values: np.ndarray) -> bool:
    """Whether every value's magnitude is below 2**52 (at once for types of 32 bits or less)."""
    if values.dtype.itemsize <= 4:
        return True
    return int(values.min()) > -_HALF_EXACT and int(values.max()) < _HALF_EXACT


def _comparable(va: np.ndarray, vb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64, or both as complex128 when either is complex (``to_float64`` keeps a
    complex value's magnitude only, as statistics want: 3+4j equalled 4+3j)."""
    if va.dtype.kind == "c" or vb.dtype.kind == "c":
        return va.astype(np.complex128), vb.astype(np.complex128)
    return to_float64(va), to_float64(vb)


@dataclass(frozen=True, slots=True)
class _Differences:
    """How one chunk of A differs from the same chunk of B."""

    identical: bool
    differ: int = 0
    outside: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0


def _chunk_differences(
    a: DType, b: DType, atol: float, rtol: float
) -> Callable[[tuple[np.ndarray, np.ndarray]], _Differences]:
    """What compares a chunk of A (dtype ``a``) with B's (dtype ``b``), on any thread."""
    integers = _integer(a.code) and _integer(b.code)
    complex_ = a.code[0] == "C" or b.code[0] == "C"
    # A 64-bit integer against real floats: float64 rounds integers past 2**53.
    wide = not integers and not complex_ and any(_integer(d.code) and d.bits == 64 for d in (a, b))

    def compare(pair: tuple[np.ndarray, np.ndarray]) -> _Differences:
        raw_a, raw_b = pair
        if a == b and np.array_equal(raw_a, raw_b):
            return _Differences(True)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # per thread
            if integers:
                differ, big, rel, outside = _integer_differences(
                    chunk_values(a, raw_a), chunk_values(b, raw_b), atol, rtol
                )
                return _Differences(False, differ, outside, big, rel)
            if wide:
                return _wide_integer_differences(a, b, raw_a, raw_b, atol, rtol)
            if not complex_:
                found = _finite_differences(a, b, raw_a, raw_b, atol, rtol)
                if found is not None:
                    return found
            va, vb = _comparable(chunk_values_widened(a, raw_a), chunk_values_widened(b, raw_b))
            return _any_differences(va, vb, atol, rtol)

    return compare


def _wide_integer_differences(
    a: DType, b: DType, raw_a: np.ndarray, raw_b: np.ndarray, atol: float, rtol: float
) -> _Differences:
    """The differences of a chunk of 64-bit integers and one of real floats, exactly.

    As float64, ``2**53 + 1`` equalled ``2.0**53``: "values equal" for values that are not.
    An integer equals a float only where the float is a whole number in the integer type's
    range, so those floats are compared as integers (:func:`_integer_differences`, exact);
    every other float (a fraction, out of range, NaN, Inf) differs from every integer, by a
    difference float64 measures well, except where it rounds to 0 (an integer near 2**63
    against the float 2.0**63), measured with Python's integers then.
    """
    a_int = _integer(a.code)
    ints = chunk_values(a if a_int else b, raw_a if a_int else raw_b)
    floats = to_float64(chunk_values_widened(b if a_int else a, raw_b if a_int else raw_a))
    info = np.iinfo(ints.dtype)
    whole = (floats == np.floor(floats)) & (floats >= info.min) & (floats < float(info.max) + 1)
    as_int = np.where(whole, floats, 0).astype(ints.dtype)
    pair = (ints[whole], as_int[whole]) if a_int else (as_int[whole], ints[whole])
    differ, max_abs, max_rel, outside = _integer_differences(*pair, atol, rtol)
    other = ~whole
    if other.any():
        fi, ff = ints[other], floats[other]
        diff = np.abs(fi.astype(np.float64) - ff)
        diff[~np.isfinite(ff)] = math.inf
        for at in np.flatnonzero(diff == 0):  # rounded away: measured exactly
            diff[at] = float(abs(int(fi[at]) - int(ff[at])))
        scale = np.abs(ff if a_int else fi.astype(np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(scale > 0, diff / scale, math.inf)
        rel[np.isnan(rel)] = math.inf
        differ += int(other.sum())
        outside += int(((diff > atol + rtol * scale) | ~np.isfinite(ff)).sum())
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float(rel.max()))
    return _Differences(False, differ, outside, max_abs, max_rel)


def _finite_differences(
    a: DType, b: DType, raw_a: np.ndarray, raw_b: np.ndarray, atol: float, rtol: float
) -> _Differences | None:
    """The differences of two chunks of real values that are all finite (and whose differences
    are), in this thread's scratch memory; None for any other pair (:func:`_any_differences`
    then). Finite values are equal exactly when their difference is 0."""
    va, _ = as_float64(a, raw_a, 0)
    vb, _ = as_float64(b, raw_b, 1)
    diff = np.abs(np.subtract(va, vb, out=va), out=va)
    if not math.isfinite(float(diff.sum())):  # a NaN or Inf somewhere (or a huge difference)
        return None
    changed, _ = take_masks(diff.size)
    differ = int(np.count_nonzero(np.not_equal(diff, 0, out=changed)))
    if not differ:
        return _Differences(False)
    scale = np.abs(vb, out=vb)
    limit = np.multiply(scale, rtol, out=take_float64(diff.size, 2))
    outside = int(np.count_nonzero(np.greater(diff, np.add(limit, atol, out=limit), out=changed)))
    # 0/0 is NaN where the values are equal zeros: fmax passes over it (their rel is 0).
    rel = float(np.fmax.reduce(np.divide(diff, scale, out=scale)))
    return _Differences(False, differ, outside, float(diff.max()), 0.0 if rel != rel else rel)


def _equal_or_both_nan(va: np.ndarray, vb: np.ndarray) -> np.ndarray:
    """Where two arrays of real values hold the same value or both NaN."""
    same: np.ndarray = (va == vb) | (np.isnan(va) & np.isnan(vb))
    return same


def _any_differences(va: np.ndarray, vb: np.ndarray, atol: float, rtol: float) -> _Differences:
    """The differences of two chunks of values, any values (NaN, Inf, complex)."""
    # Equal: same value, same-sign infinities, or NaN against NaN (whatever payload); a complex
    # value part by part (np.isnan of one is true where either part is NaN: 1+nanj against
    # 2+nanj would pass).
    eq = _equal_or_both_nan(va.real, vb.real)
    if np.iscomplexobj(va) or np.iscomplexobj(vb):
        eq &= _equal_or_both_nan(va.imag, vb.imag)
    ne = ~eq
    n_ne = int(ne.sum())
    if not n_ne:
        return _Differences(False)
    diff = np.abs(va - vb)
    diff[eq] = 0.0
    # A difference involving Inf or NaN (inf vs -inf, 5 vs inf, inf vs NaN) is infinite and
    # beyond any tolerance: atol + rtol*|inf| is inf or NaN and would let it pass, and only
    # for one argument order.
    nonfinite = ne & ~(np.isfinite(va) & np.isfinite(vb))
    diff[nonfinite | np.isnan(diff)] = math.inf
    rel = np.where(ne, diff / np.abs(vb), 0.0)
    rel[np.isnan(rel)] = math.inf
    beyond = (diff > atol + rtol * np.abs(vb)) | nonfinite
    overflowed = ne & ~nonfinite & np.isinf(diff)
    if overflowed.any():
        # Finite values whose difference overflows float64 (1.2e308 against -1.2e308): the
        # limit overflowed too, and inf > inf let it pass as within tolerance. Compared in
        # quarters, exact for such values, where neither side overflows (a complex value's
        # modulus included).
        qa, qb = va[overflowed] / 4, vb[overflowed] / 4
        beyond[overflowed] = np.abs(qa - qb) > atol / 4 + rtol * np.abs(qb)
    outside = int(beyond.sum())
    return _Differences(False, n_ne, outside, float(diff.max()), float(rel.max()))


def compare_values(
    a: TensorRef,
    b: TensorRef,
    atol: float,
    rtol: float,
    progress: Callable[[int], None],
    workers: ChunkWorkers,
) -> dict[str, Any]:
    """Stream both tensors and measure how their values differ (chunks on ``workers``)."""
    identical = a.dtype == b.dtype
    differ = 0
    outside = 0
    max_abs = 0.0
    max_rel = 0.0
    compare = _chunk_differences(a.dtype, b.dtype, atol, rtol)
    pairs = zip(element_chunks(a), element_chunks(b), strict=True)
    alone = a.numel <= _chunk_work.CHUNK_ELEMENTS
    for (raw_a, raw_b), found in workers.ordered(compare, pairs, alone=alone):
        progress(raw_a.size + raw_b.size)
        identical = identical and found.identical
        differ += found.differ
        outside += found.outside
        max_abs = max(max_abs, found.max_abs)
        max_rel = max(max_rel, found.max_rel)
    return _values(identical, differ, outside, max_abs, max_rel)


def _values(
    identical: bool, differ: int, outside: int, max_abs: float, max_rel: float
) -> dict[str, Any]:
    """A tensor's ``values`` entry of the document."""
    if identical:
        return {
            "identical": True,
            "differing": 0,
            "outside_tolerance": 0,
            "max_abs": 0.0,
            "max_rel": 0.0,
        }
    return {
        "identical": False,
        "differing": differ,
        "outside_tolerance": outside,
        "max_abs": max_abs if math.isfinite(max_abs) else None,
        "max_rel": max_rel if math.isfinite(max_rel) else None,
    }


#: Elements (a side) a batch of small pairs may hold (see :mod:`._paired_batches`); None:
#: :data:`._chunk_work.CHUNK_ELEMENTS`, a chunk of the per-tensor path; 0: every pair alone.
BATCH_ELEMENTS: int | None = None


def _batch_differences(
    atol: float, rtol: float
) -> Callable[[tuple[PairBatch, np.ndarray, np.ndarray]], list[dict[str, Any]]]:
    """A worker job: each pair of a read batch compared, as :func:`compare_values` would
    (each tensor is one chunk of it), from the two spans' slices."""
    compares: dict[tuple[DType, DType], Callable[[tuple[np.ndarray, np.ndarray]], _Differences]]
    compares = {}

    def run(item: tuple[PairBatch, np.ndarray, np.ndarray]) -> list[dict[str, Any]]:
        batch, raw_a, raw_b = item
        base_a, base_b = batch.pairs[0][0].begin, batch.pairs[0][1].begin
        if all(a.dtype == b.dtype for a, b in batch.pairs) and np.array_equal(raw_a, raw_b):
            return [dict(_IDENTICAL) for _ in batch.pairs]  # copies of the same tensors: one test
        found = []
        for a, b in batch.pairs:
            sa = raw_a[a.begin - base_a : a.end - base_a]
            sb = raw_b[b.begin - base_b : b.end - base_b]
            same = a.dtype == b.dtype
            if same and sa.tobytes() == sb.tobytes():  # faster than a numpy call on a few bytes
                found.append(dict(_IDENTICAL))
            elif not sa.size and not sb.size:  # no elements: no chunk on the per-tensor path
                found.append(_values(same, 0, 0, 0.0, 0.0))
            else:
                compare = compares.get((a.dtype, b.dtype))
                if compare is None:
                    compare = compares[a.dtype, b.dtype] = _chunk_differences(
                        a.dtype, b.dtype, atol, rtol
                    )
                d = compare((sa, sb))
                found.append(
                    _values(same and d.identical, d.differ, d.outside, d.max_abs, d.max_rel)
                )
        return found

    return run


_IDENTICAL: Final = _values(True, 0, 0, 0.0, 0.0)


def compare_all(
    pairs: Sequence[tuple[TensorRef, TensorRef]],
    atol: float,
    rtol: float,
    progress: Callable[[int], None],
    workers: ChunkWorkers,
) -> dict[str, dict[str, Any]]:
    """Each pair's ``values`` entry by name: runs of small pairs adjacent in both files read
    and compared in batches (:mod:`._paired_batches`), the others by :func:`compare_values`.
    The entries are the same either way."""
    cap = _chunk_work.CHUNK_ELEMENTS if BATCH_ELEMENTS is None else BATCH_ELEMENTS
    units = list(batched_pairs(pairs, cap))
    job = _batch_differences(atol, rtol)
    results: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(units):
        unit = units[i]
        if not isinstance(unit, PairBatch):
            a, b = unit
            results[a.name] = compare_values(a, b, atol, rtol, progress, workers)
            i += 1
            continue
        j = i
        while j < len(units) and isinstance(units[j], PairBatch):
            j += 1
        group = cast("list[PairBatch]", units[i:j])
        # Read on this thread (one reader at a time: remote planned reads), compared on the
        # workers; one batch alone is compared here (a hand-off would cost more).
        batches = map(read_pair_batch, group)
        for (batch, _, _), found in workers.ordered(job, batches, alone=len(group) == 1):
            for (a, b), values in zip(batch.pairs, found, strict=True):
                progress(a.nbytes + b.nbytes)
                results[a.name] = values
        i = j
    return results


def value_pairs(ma: Model, mb: Model, args: argparse.Namespace) -> list[str]:
    """The names whose values ``diff`` compares, in A's file order: in both, chosen by the
    filters, of the same shape (none with ``--no-values``)."""
    if args.no_values:
        return []
    accept = name_filter(args)
    return [
        n
        for n, a in ma.tensors.items()
        if accept(n) and n in mb.tensors and a.shape == mb.tensors[n].shape
    ]


def _varying_keys(model: Model, agreed: dict[str, str]) -> set[str]:
    """The metadata keys some of a model's files hold that are not in its ``agreed`` metadata:
    the files disagree on them (an index key, which wins, is agreed)."""
    keys = {k for f in model.files for k in f.header.metadata or {}}
    return keys - agreed.keys()


def _file_values(model: Model, agreed: dict[str, str], key: str) -> dict[str, str | None]:
    """``key``'s value for the tensors of each of a model's files (None where a file lacks
    it), by label: the model's own where it has one (an index key wins over the files')."""
    if key in agreed:
        return {model.label(f.label): agreed[key] for f in model.files}
    return {model.label(f.label): (f.header.metadata or {}).get(key) for f in model.files}


def _by_shard_changes(
    ma: Model, meta_a: dict[str, str], mb: Model, meta_b: dict[str, str], keys: list[str]
) -> dict[str, Any]:
    """The keys, of those on which a model's files disagree, that a tensor in both models sees
    differently (its file's value of the key in A against B's), each as ``[A's files' values,
    B's]``. The models' files may split the tensors differently: a key the same for every
    tensor is no difference, however the files hold it."""
    changed: dict[str, Any] = {}
    if not keys:
        return changed
    # Which file of A and which of B each tensor in both lies in: a pair of files per
    # tensor, but few pairs (shards), each checked once per key instead of every tensor.
    pairs = {
        (ma.label(ma.tensors[n].file.label), mb.label(mb.tensors[n].file.label))
        for n in ma.tensors
        if n in mb.tensors
    }
    for key in keys:
        seen_a = _file_values(ma, meta_a, key)
        seen_b = _file_values(mb, meta_b, key)
        if any(seen_a[a] != seen_b[b] for a, b in pairs):
            changed[key] = [seen_a, seen_b]
    return changed


def diff_models(
    ma: Model,
    mb: Model,
    args: argparse.Namespace,
    progress: Callable[[int], None],
    workers: ChunkWorkers,
) -> dict[str, Any]:
    """The ``pysafetensors.diff/1`` document."""
    # A few records per tensor, nearly all kept: with the collector running, its collections
    # walked the two models' records again and again (about a second of 100,000 tensors').
    with gc_paused():
        return _diff_models(ma, mb, args, progress, workers)


def _diff_models(
    ma: Model,
    mb: Model,
    args: argparse.Namespace,
    progress: Callable[[int], None],
    workers: ChunkWorkers,
) -> dict[str, Any]:
    accept = name_filter(args)
    # Compared as one file would hold it: a sharded model equals its merge, and the index's
    # own keys count (its total_size, which the tensors' bytes decide, does not).
    meta_a = ma.model_metadata(computed=False) or {}
    meta_b = mb.model_metadata(computed=False) or {}
    # A key on which a model's shards disagree is in neither model's metadata; it is compared
    # tensor by tensor instead (transformers reads a quantizer's keys from each shard).
    varying = _varying_keys(ma, meta_a) | _varying_keys(mb, meta_b)
    metadata = {
        "added": {k: v for k, v in meta_b.items() if k not in meta_a and k not in varying},
        "removed": {k: v for k, v in meta_a.items() if k not in meta_b and k not in varying},
        "changed": {
            k: [v, meta_b[k]]
            for k, v in meta_a.items()
            if k in meta_b and meta_b[k] != v and k not in varying
        },
        "by_shard": _by_shard_changes(ma, meta_a, mb, meta_b, sorted(varying)),
    }
    names = [n for n in ma.tensors if accept(n)] + [
        n for n in mb.tensors if n not in ma.tensors and accept(n)
    ]
    # Values compared in A's file order (a remote A is then read front to back, in few
    # requests), reported in name order.
    pairs = [(ma.tensors[n], mb.tensors[n]) for n in value_pairs(ma, mb, args)]
    compared = compare_all(pairs, args.atol, args.rtol, progress, workers)
    tensors = []
    counts = {"added": 0, "removed": 0, "changed": 0, "close": 0, "identical": 0, "unchecked": 0}
    for name in sorted(names):
        a, b = ma.tensors.get(name), mb.tensors.get(name)
        row: dict[str, Any] = {"name": name}
        if a is None or b is None:
            ref = a or b
            assert ref is not None
            row.update(
                status="removed" if b is None else "added",
                dtype=ref.dtype.code,
                shape=list(ref.shape),
            )
        else:
            row.update(dtype=[a.dtype.code, b.dtype.code], shape=[list(a.shape), list(b.shape)])
            changed = a.dtype != b.dtype or a.shape != b.shape
            if a.shape != b.shape or args.no_values:
                row["values"] = None
                status = "changed" if changed else "unchecked"
            else:
                values = compared[name]
                row["values"] = values
                if values["outside_tolerance"]:
                    status = "changed"
                elif values["identical"] and not changed:
                    status = "identical"
                else:
                    status = "close" if values["differing"] or changed else "identical"
                if a.dtype != b.dtype and status != "changed":
                    # A dtype change is a change even when the values survived it.
                    status = "changed"
            row["status"] = status
        counts[row["status"]] += 1
        tensors.append(row)
    meta_changed = any(metadata.values())
    equal = not meta_changed and not (counts["added"] or counts["removed"] or counts["changed"])
    return {
        "schema": SCHEMA,
        "a": ma.target,
        "b": mb.target,
        "atol": args.atol,
        "rtol": args.rtol,
        "equal": equal,
        "summary": counts,
        "metadata": metadata,
        "tensors": tensors,
    }


def _shape(s: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def _num(v: float | None) -> str:
    return "inf" if v is None else f"{v:.4g}"


def _by_file(values: dict[str, str | None]) -> str:
    """A key's value in each file (``-`` where a file lacks it), the first few (``--json``
    lists them all)."""
    shown = [f"{sanitize(f)}: {'-' if v is None else quoted(v)}" for f, v in values.items()]
    more = len(shown) - _FILES_SHOWN
    return ", ".join(shown[:_FILES_SHOWN]) + (f", ... ({more} more)" if more > 0 else "")


#: Files whose value of a key ``diff`` prints on its line, for each model.
_FILES_SHOWN: Final = 4


def run(args: argparse.Namespace) -> int:
    """Run ``diff``."""
    ui = Ui(args)
    options = remote_options(args)  # for whichever of A and B is a URL
    limit = args.max_header_size
    if options:
        from .._remote import check_option_names

        for target in (args.a, args.b):
            if "://" in target:
                # Both checked before either is opened (a usage error, before any request).
                with url_argument_errors():
                    check_option_names(target, options)
    with open_model(args.a, options, limit) as ma, open_model(args.b, options, limit) as mb:
        # Compared: what the shards hold. An index that disagrees with them is warned about, and
        # the exit code is then 2 (the answer cannot be trusted as "equal"/"different").
        inconsistent = ma.warn_index() | mb.warn_index()
        check_filter_matches(args, ma, mb)
        common = value_pairs(ma, mb, args)  # what compare_values will read
        total = sum(ma.tensors[n].nbytes + mb.tensors[n].nbytes for n in common)
        with (
            ui.progress(total, "diff") as update,
            ma.planned_reads(ma.tensors[n] for n in common),
            mb.planned_reads(mb.tensors[n] for n in common),
            ChunkWorkers() as workers,
        ):
            result = diff_models(ma, mb, args, update, workers)
    if args.json:
        print_json(result)
        return 2 if inconsistent else 0 if result["equal"] else 1
    ui.line(f"--- {sanitize(shown(args.a))}", style="red")
    ui.line(f"+++ {sanitize(shown(args.b))}", style="green")
    meta = result["metadata"]
    for key, value in meta["removed"].items():
        ui.line(f"- metadata {quoted(key)}: {quoted(value)}", style="red")
    for key, value in meta["added"].items():
        ui.line(f"+ metadata {quoted(key)}: {quoted(value)}", style="green")
    for key, (old, new) in meta["changed"].items():
        ui.line(f"~ metadata {quoted(key)}: {quoted(old)} -> {quoted(new)}", style="yellow")
    for key, sides in meta["by_shard"].items():
        old, new = (_by_file(side) for side in sides)
        ui.line(f"~ metadata {quoted(key)} by file: {old} -> {new}", style="yellow")
    tol = f"atol={args.atol:g}, rtol={args.rtol:g}"
    for row in result["tensors"]:
        status = row["status"]
        if status == "identical" or status == "unchecked":
            continue  # not listed (most rows, when comparing two copies)
        name = quoted(row["name"])
        if status in ("added", "removed"):
            sign, style = ("+", "green") if status == "added" else ("-", "red")
            ui.line(f"{sign} {name}  {row['dtype']} {_shape(row['shape'])}", style=style)
            continue
        parts = []
        (da, db), (sa, sb) = row["dtype"], row["shape"]
        if da != db:
            parts.append(f"dtype {da} -> {db}")
        if sa != sb:
            parts.append(f"shape {_shape(sa)} -> {_shape(sb)}")
        v = row.get("values")
        if v and not v["identical"]:
            parts.append(
                f"{v['differing']:,} values differ (max abs {_num(v['max_abs'])}, max rel "
                f"{_num(v['max_rel'])}; {v['outside_tolerance']:,} outside {tol})"
                if v["differing"]
                else "values equal"
            )
        if status == "changed":
            ui.line(f"~ {name}  " + "; ".join(parts), style="yellow")
        else:
            ui.line(f"~ {name}  " + "; ".join(parts) + " (within tolerance)", style="cyan")
    c = result["summary"]
    ui.line(
        f"{c['added']} added, {c['removed']} removed, {c['changed']} changed, "
        f"{c['close']} within tolerance, {c['identical']} identical"
        + (f", {c['unchecked']} not compared" if c["unchecked"] else "")
        + (", metadata differs" if any(meta.values()) else ""),
        style="bold",
    )
    return 2 if inconsistent else 0 if result["equal"] else 1
