"""Loading across processes and machines: tensor-parallel shards, and many files at once.

Tensor-parallel loading
    :func:`load_shard` gives one rank of a tensor-parallel group its part of every tensor,
    reading that part's bytes (``get_slice`` turns the part into byte runs; a column split
    reads the rows it lies in, see :func:`load_shard`). Rules map
    tensor-name patterns to a split::

        rules = {
            "*.q_proj.weight": "rows",       # dim 0
            "*.o_proj.weight": "columns",    # dim 1
            "*.norm.weight": "replicate",    # every rank gets all of it
            "*.conv.weight": 2,              # any dimension, negative counts from the end
        }
        shard = load_shard("model.safetensors", rank, world_size, rules, framework="pt")

    Uneven sizes are split like ``torch.chunk`` by default (blocks of ``ceil(size / world_size)``;
    the last ranks may get a shorter or empty block), like ``torch.tensor_split`` with
    ``uneven="tensor_split"`` (sizes differ by at most one), or refused with ``uneven="error"``.
    No communication happens here: each rank calls :func:`load_shard` itself, so it works the
    same under ``torch.distributed``, MPI or a job array.

Many files at once
    :func:`map_files` runs a function over many files with any ``concurrent.futures.Executor``
    (threads, processes, ``ray.util.multiprocessing.Pool``-backed executors, Dask's
    ``Client.get_executor()``), returning results in input order. :func:`validate_files` and
    :func:`hash_files` are built on it and take ``executor=`` too.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import math
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, TypeVar

import numpy as np

from ._errors import SafetensorError, add_note
from ._format import MAX_HEADER_SIZE, gc_paused
from ._interrupts import interrupts_deferred
from ._reader import safe_open
from ._slicing import Part
from ._validate import Problem, validate

__all__ = [
    "RuleSplit",
    "Rules",
    "ShardSpec",
    "Split",
    "hash_files",
    "load_shard",
    "map_files",
    "plan_shard",
    "shard_range",
    "validate_files",
]

#: How one tensor is divided: ``"rows"`` (dim 0), ``"columns"`` (dim 1), ``"replicate"``, or a
#: dimension number (negative numbers count from the end).
Split: TypeAlias = Literal["rows", "columns", "replicate"] | int
#: A rule's split: a :data:`Split`, or any ``str``, checked when the rules are applied (a dict
#: of rules assigned to a variable is typed ``dict[str, str]``, which ``Split`` alone refuses).
RuleSplit: TypeAlias = Split | str
#: Rules: pattern to split (fnmatch globs matched against the full name, or compiled regexes
#: matched with ``fullmatch``), first match wins; or a function ``(name, shape) -> Split | None``.
#: (Mapping's key type is invariant: each key type is listed, so that a ``dict[str, ...]`` and
#: a ``dict[re.Pattern[str], ...]`` pass as well as a dict of both.)
Rules: TypeAlias = (
    Mapping[str, RuleSplit]
    | Mapping[re.Pattern[str], RuleSplit]
    | Mapping[str | re.Pattern[str], RuleSplit]
    | Sequence[tuple[str | re.Pattern[str], RuleSplit]]
    | Callable[[str, tuple[int, ...]], RuleSplit | None]
)
#: How sizes that the world size does not divide are split (see :func:`shard_range`).
Uneven: TypeAlias = Literal["chunk", "tensor_split", "error"]

_T = TypeVar("_T")
_R = TypeVar("_R")

_SPLIT_NAMES: Final = {"rows": 0, "columns": 1}


# ------------------------------------------------------------------------------ tensor parallel


def shard_range(size: int, rank: int, world_size: int, uneven: Uneven = "chunk") -> tuple[int, int]:
    """The ``[start, stop)`` part of a dimension of ``size`` that ``rank`` owns.

    Args:
        size: Length of the dimension being split.
        rank: This process's rank, ``0 <= rank < world_size``.
        world_size: Number of parts.
        uneven: ``"chunk"`` (``torch.chunk``: blocks of ``ceil(size / world_size)``, trailing
            ranks may get less or nothing), ``"tensor_split"`` (``torch.tensor_split`` /
            ``numpy.array_split``: the first ``size % world_size`` ranks get one extra), or
            ``"error"`` (``size`` must divide evenly).

    Returns:
        ``(start, stop)`` with ``0 <= start <= stop <= size``.

    Raises:
        ValueError: Bad rank, world size or size, unknown ``uneven``, or an uneven split with
            ``uneven="error"``.
        TypeError: ``rank`` or ``world_size`` is not an int (a bool is not).

    Example:
        >>> [shard_range(10, r, 4) for r in range(4)]
        [(0, 3), (3, 6), (6, 9), (9, 10)]
        >>> [shard_range(10, r, 4, "tensor_split") for r in range(4)]
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    rank, world_size = _check_group(rank, world_size)
    size = _integer(size)
    if size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    return _range_of(size, rank, world_size, uneven)


def _range_of(size: int, rank: int, world_size: int, uneven: Uneven) -> tuple[int, int]:
    """:func:`shard_range` of arguments already checked (a plan calls it once per tensor)."""
    if uneven == "chunk":
        block = -(-size // world_size)
        return min(rank * block, size), min((rank + 1) * block, size)
    if uneven == "tensor_split":
        base, extra = divmod(size, world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)
    if uneven == "error":
        if size % world_size:
            raise ValueError(
                f"a dimension of size {size} does not split evenly into {world_size} parts "
                "(pass uneven='chunk' or 'tensor_split' to allow it)"
            )
        block = size // world_size
        return rank * block, (rank + 1) * block
    raise ValueError(f"uneven must be 'chunk', 'tensor_split' or 'error', not {uneven!r}")


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """What one rank takes of one tensor."""

    name: str
    """Tensor name."""
    shape: tuple[int, ...]
    """The full tensor's shape."""
    dim: int | None
    """The split dimension (non-negative), or None when the tensor is replicated."""
    start: int
    """First index taken along ``dim`` (0 when replicated)."""
    stop: int
    """One past the last index taken along ``dim`` (``shape[0]``, or 0 for scalars, when
    replicated: ``dim`` is None then, and the whole tensor is taken)."""

    @property
    def index(self) -> tuple[slice, ...]:
        """The index to apply to the full tensor (``()`` for the whole tensor)."""
        if self.dim is None:
            return ()
        index: tuple[slice, ...] = Part(self.dim, self.start, self.stop).index
        return index

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of this rank's part."""
        if self.dim is None:
            return self.shape
        dims = list(self.shape)
        dims[self.dim] = self.stop - self.start
        return tuple(dims)


def _rule_matcher(rules: Rules, default: Split) -> Callable[[str, tuple[int, ...]], RuleSplit]:
    """``(name, shape) -> split`` for checked ``rules``: the first rule whose pattern matches,
    else ``default``. Glob patterns are compiled once here, not looked up per tensor."""
    if callable(rules):
        chooser = rules

        def chosen(name: str, shape: tuple[int, ...]) -> RuleSplit:
            try:
                split = chooser(name, shape)
            except Exception as exc:
                # The caller's function failed: say for which tensor.
                add_note(exc, f"in the rules function, for tensor {name!r} of shape {list(shape)}")
                raise
            return default if split is None else split

        return chosen
    items = rules.items() if isinstance(rules, Mapping) else rules
    compiled = [
        (
            (
                pattern
                if isinstance(pattern, re.Pattern)
                else re.compile(fnmatch.translate(pattern))
            ).fullmatch,
            split,
        )
        for pattern, split in items
    ]

    def matched(name: str, _shape: tuple[int, ...]) -> RuleSplit:
        for fullmatch, split in compiled:
            if fullmatch(name):
                return split
        return default

    return matched


def _split_dim(name: str, shape: tuple[int, ...], split: RuleSplit) -> int | None:
    """The dimension a split names for a tensor of ``shape`` (None: replicate)."""
    if split == "replicate":
        return None
    if isinstance(split, str):
        if split not in _SPLIT_NAMES:
            raise ValueError(
                f"tensor {name!r}: unknown split {split!r} (expected 'rows', 'columns', "
                "'replicate' or a dimension number)"
            )
        dim = _SPLIT_NAMES[split]
    elif _is_integer(split):
        dim = operator.index(split)  # numpy integers too
    else:
        raise TypeError(f"tensor {name!r}: a split must be a str or an int, not {split!r}")
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"tensor {name!r} of shape {list(shape)} has no dimension {dim} to split "
            f"(rule {split!r}); give it a 'replicate' rule or a dimension it has"
        )
    return dim % ndim


def _is_integer(value: Any) -> bool:
    """Python and numpy integers, not bools."""
    if type(value) is int:  # the common case, ~4x cheaper (a plan checks every dimension)
        return True
    return not isinstance(value, (bool, np.bool_)) and hasattr(value, "__index__")


def _integer(value: Any, what: str = "size") -> int:
    """``value`` as an int (see :func:`_is_integer`).

    Raises:
        TypeError: Not an integer.
    """
    if type(value) is int:
        return value
    if not _is_integer(value):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}: {value!r}")
    return operator.index(value)


def _check_group(rank: Any, world_size: Any) -> tuple[int, int]:
    """Refuse a rank or group size that cannot be, before any tensor is looked at; return
    both as ints.

    Raises:
        ValueError: ``world_size`` < 1, or ``rank`` outside ``[0, world_size)``.
        TypeError: Either is not an integer.
    """
    rank = _integer(rank, "rank")
    world_size = _integer(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} is not in a group of size {world_size} (0..{world_size - 1})"
        )
    return rank, world_size


def _check_options(rules: Any, default: Any, uneven: Any) -> None:
    """Refuse malformed ``rules``, ``default`` and ``uneven`` up front, whatever the tensors
    (a typo was caught only if some tensor happened to use it).

    Raises:
        TypeError: ``rules`` is not a mapping, a sequence of pairs or a callable.
        ValueError: ``default`` or ``uneven`` is not one of their values.
    """
    if isinstance(rules, (str, bytes)) or not (
        callable(rules) or isinstance(rules, (Mapping, Sequence))
    ):
        raise TypeError(
            "rules must be a mapping of patterns to splits, a sequence of (pattern, split) "
            f"pairs or a callable, not {type(rules).__name__}: {rules!r:.60}"
        )
    if not callable(rules):
        pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        for pair in pairs:
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(f"rules: {pair!r:.60} is not a (pattern, split) pair")
            pattern, split = pair
            if not (
                isinstance(pattern, str)
                or (isinstance(pattern, re.Pattern) and isinstance(pattern.pattern, str))
            ):
                raise TypeError(
                    f"rules: pattern {pattern!r:.60} is not a str or a compiled str regex"
                )
            # Every rule's split, used or not: a typo ("row", "colums") caught on one rank
            # only, because only its tensors matched, left the others waiting in a collective.
            if not _is_split(split):
                raise ValueError(
                    f"rules: unknown split {split!r:.60} for pattern {pattern!r:.60} (expected "
                    "'rows', 'columns', 'replicate' or a dimension number)"
                )
    if uneven not in ("chunk", "tensor_split", "error"):
        raise ValueError(f"uneven must be 'chunk', 'tensor_split' or 'error', not {uneven!r}")
    if not _is_split(default):
        raise ValueError(
            f"default must be 'rows', 'columns', 'replicate' or a dimension, not {default!r}"
        )


def _is_split(value: Any) -> bool:
    """Whether ``value`` is a split: ``"rows"``, ``"columns"``, ``"replicate"`` or a dimension."""
    if isinstance(value, str):
        return value in _SPLIT_NAMES or value == "replicate"
    return _is_integer(value)


def _first_bad_ranks(size: int, world_size: int, uneven: Uneven) -> list[int]:
    """The ranks whose bounds decide whether every boundary of a split is byte-aligned.

    The boundaries of every rule are at most two arithmetic progressions from 0: ``k * block``
    (capped at ``size`` for ``"chunk"``); ``r * (base + 1)`` up to rank ``extra``, then steps
    of ``base`` (``"tensor_split"``). A progression from an aligned start is aligned all along
    iff its step is, so its first misaligned bound, if any, is its first step: rank 0's end, or
    rank ``extra``'s end. The one other bound is ``size`` itself, the end of the first rank
    that reaches it. So these few ranks, in order, find the first rank a loop over all of them
    would (world sizes can be in the millions).
    """
    ranks = {0, world_size - 1}
    if uneven == "chunk" and size:
        block = -(-size // world_size)
        ranks.add(min(world_size - 1, -(-size // block) - 1))
    elif uneven == "tensor_split":
        ranks.add(min(world_size - 1, size % world_size))
    return sorted(ranks)


def _check_byte_aligned(
    plan: Mapping[str, tuple[tuple[int, ...], Part]],
    bits: Mapping[str, int],
    world_size: int,
    uneven: Uneven,
) -> None:
    """Refuse a split of a sub-byte tensor (F4, F6) whose boundaries fall inside a byte, on
    every rank alike (the ranks whose own part happened to be aligned loaded it, the others
    failed: a distributed job then hangs at its next collective).

    Raises:
        ValueError: Some rank's part of a sub-byte tensor does not start or end on a byte.
    """
    for name, width in bits.items():
        shape, part = plan[name]
        if part.dim is None or width % 8 == 0:
            continue
        size = shape[part.dim]
        inner = math.prod(shape[part.dim + 1 :])
        for rank in _first_bad_ranks(size, world_size, uneven):
            for bound in shard_range(size, rank, world_size, uneven):
                if bound * inner * width % 8:
                    raise ValueError(
                        f"tensor {name!r} of shape {list(shape)} holds {width}-bit values "
                        f"packed into bytes: split {world_size} ways along dimension "
                        f"{part.dim}, rank {rank}'s part would begin or end inside a byte "
                        f"(at index {bound}); split it along another dimension, or replicate "
                        "it"
                    )


def plan_shard(
    shapes: Mapping[str, Sequence[int]],
    rank: int,
    world_size: int,
    rules: Rules,
    *,
    default: Split = "replicate",
    uneven: Uneven = "chunk",
) -> dict[str, ShardSpec]:
    """Decide what ``rank`` takes of each tensor, from shapes alone (no I/O).

    Args:
        shapes: Tensor name to full shape (e.g. ``{k: f.get_slice(k).get_shape() ...}``).
        rank: This process's rank.
        world_size: Size of the tensor-parallel group.
        rules: Name patterns to splits (see the module docstring), or a function.
        default: The split of tensors no rule matches.
        uneven: How to split sizes that ``world_size`` does not divide (see :func:`shard_range`).

    Returns:
        Name to :class:`ShardSpec`, in the order of ``shapes``.

    Raises:
        ValueError: A shape has a negative dimension, a rule names a dimension the tensor
            lacks, a split is uneven with ``uneven="error"``, ``rank`` is not in
            ``[0, world_size)``, or ``default`` or ``uneven`` is unknown.
        TypeError: ``rank``, ``world_size`` or a dimension is not an integer, or ``rules`` is
            not a mapping, a sequence of pairs or a callable.
    """
    rank, world_size = _check_group(rank, world_size)
    _check_options(rules, default, uneven)
    return {
        name: ShardSpec(name, shape, part.dim, part.start, part.stop)
        for name, (shape, part) in _plan_parts(
            shapes, rank, world_size, rules, default, uneven
        ).items()
    }


def _plan_parts(
    shapes: Mapping[str, Sequence[int]],
    rank: int,
    world_size: int,
    rules: Rules,
    default: Split,
    uneven: Uneven,
) -> dict[str, tuple[tuple[int, ...], Part]]:
    """:func:`plan_shard`'s work on checked arguments: ``{name: (shape, part)}``, the part
    ``Part(None, 0, shape[0] or 0)`` for a replicated tensor.

    Tensors of one shape under one split share their part, worked out once: a mixture of
    experts repeats a few shapes over thousands of tensors, and a ``ShardSpec`` and the split's
    arithmetic per tensor were ~1 us each of a 20,000-tensor ``load_shard``.
    """
    if not isinstance(shapes, Mapping):
        raise TypeError(
            f"shapes must be a mapping of tensor names to shapes, not {type(shapes).__name__}"
        )
    rule_for = _rule_matcher(rules, default)
    plan: dict[str, tuple[tuple[int, ...], Part]] = {}
    parts: dict[tuple[Any, tuple[int, ...]], Part] = {}
    # Shapes already checked, by the identity of the object given: a parsed header shares one
    # tuple among the tensors of one shape. Not by equality, under which (True, 2) and
    # (np.int64(1), 2) equal (1, 2). The object is kept with its entry, so that its id cannot
    # pass to another (a mapping may make its values as they are asked for).
    checked: dict[int, tuple[Any, tuple[int, ...]]] = {}
    for name, raw_shape in shapes.items():
        known = checked.get(id(raw_shape))
        if known is not None and known[0] is raw_shape:
            shape = known[1]
        else:
            try:
                shape = tuple(raw_shape)
            except TypeError:
                raise TypeError(
                    f"tensor {name!r}: a shape must be a sequence of ints, not "
                    f"{type(raw_shape).__name__}"
                ) from None
            # Plain ints (every header's shapes) need no conversion: a plan is made per
            # tensor, and a 20,000-tensor checkpoint paid a function call per dimension.
            if not all(type(d) is int for d in shape):
                shape = tuple(_integer(d, f"tensor {name!r}: a dimension") for d in shape)
            if shape and min(shape) < 0:
                raise ValueError(f"tensor {name!r}: shape {list(shape)} has a negative dimension")
            if type(raw_shape) is tuple:
                checked[id(raw_shape)] = (raw_shape, shape)
        split = rule_for(name, shape)
        # Only splits of the types _split_dim takes are remembered (a rule function may
        # return anything; the others raise there, naming the tensor).
        key = (split, shape) if type(split) in (str, int) else None
        part = None if key is None else parts.get(key)
        if part is None:
            part = _part_of(name, shape, split, rank, world_size, uneven)
            if key is not None:
                parts[key] = part
        plan[name] = (shape, part)
    return plan


def _part_of(
    name: str, shape: tuple[int, ...], split: RuleSplit, rank: int, world_size: int, uneven: Uneven
) -> Part:
    """``rank``'s part of a tensor of ``shape`` under ``split``.

    Raises:
        ValueError: The split names no dimension of the shape, or is uneven with
            ``uneven="error"`` (naming the tensor).
        TypeError: The split is neither a str nor an int.
    """
    dim = _split_dim(name, shape, split)
    if dim is None:
        return Part(None, 0, shape[0] if shape else 0)
    try:
        start, stop = _range_of(shape[dim], rank, world_size, uneven)
    except ValueError as exc:
        raise ValueError(f"tensor {name!r} of shape {list(shape)}, dim {dim}: {exc}") from None
    return Part(dim, start, stop)


def load_shard(
    path: Any,
    rank: int,
    world_size: int,
    rules: Rules,
    framework: str = "pt",
    device: Any = "cpu",
    *,
    backend: str = "auto",
    default: Split = "replicate",
    uneven: Uneven = "chunk",
    names: Iterable[str] | None = None,
    max_header_size: int = MAX_HEADER_SIZE,
    storage_options: dict[str, Any] | None = None,
    slice_reads: str = "coalesce",
) -> dict[str, Any]:
    """Load ``rank``'s shard of every tensor of a file or sharded model folder.

    Each split tensor is read as ``get_slice`` would, so a rank reads only its own rows or
    columns (by positioned reads, its rows exactly and its columns as the rows' blocks, or
    exactly with ``slice_reads="exact"``; out of a mapping, only the pages they lie on, but a
    tensor's span not yet cached is read in whole first, which the disk serves faster than
    the pages one by one).
    Replicated tensors are read whole. From a local file read by positioned reads (the
    default; each shard of a folder alike), every part that is one contiguous byte range (rows,
    whole tensors) is read at once, in parallel, into one buffer the parts view (faster than a
    ``get_slice`` loop: fewer page faults, all reads in flight together). On a CUDA device
    (torch) those parts go through one run of the pinned-buffer staging pipeline into one
    device buffer, with either backend, and the column splits are gathered block by block
    into reused pinned buffers whose copies overlap the next block's gather.

    By default (``backend="auto"``) a local file is read by positioned reads, and its column
    splits, which need a piece of every row, are copied out of a mapping of the same open file
    (so of the same file even if its path is replaced meanwhile), copying only their bytes,
    instead of reading whole rows (which it falls back to where the file cannot be mapped): a
    TP=8 column split of a 2 GiB file took 87 ms instead of 262 ms on 2 cores, 27 ms instead
    of 130-162 ms to an H200 (``benchmarks/GPU.md``). URLs, file objects without a descriptor
    and ``slice_reads="exact"`` read every part by positioned reads.

    Args:
        path: A ``.safetensors`` file (path, URL or file object), or a model folder, index
            file, index URL or folder URL, which ``safe_open`` opens as one logical file
            across its shards.
        rank: This process's rank in the tensor-parallel group (e.g. ``dist.get_rank()``).
        world_size: Size of the group.
        rules: Name patterns to splits: ``"rows"``, ``"columns"``, ``"replicate"`` or a
            dimension; first match wins (see the module docstring). A function is called
            once per tensor while the plan is made, with the cyclic garbage collector paused.
        framework: As for ``safe_open`` (``"pt"``, ``"np"``, ``"flax"``, ...).
        device: Where the tensors go (``"cuda:0"``, ... for torch and paddle).
        backend: ``"auto"`` (default: as above), ``"pread"`` (every part by positioned
            reads into fresh memory; a file that changes while it is read raises a clear error,
            where touching a mapping past a truncated end is SIGBUS) or ``"mmap"``.
        default: Split for tensors no rule matches.
        uneven: ``"chunk"``, ``"tensor_split"`` or ``"error"`` (see :func:`shard_range`).
        names: Load only these tensors, in this order (default: all, in file order); a name
            given twice is loaded once.
        max_header_size: Largest header accepted.
        storage_options: For URLs: as for ``safe_open`` (headers, credentials, endpoint).
        slice_reads: As for ``safe_open``: ``"coalesce"`` reads column splits as whole-row
            blocks, and the small parts of tensors less than a page apart as one span (fast),
            ``"exact"`` reads exactly each rank's bytes.

    Returns:
        Name to this rank's part, in file order (or the order of ``names``).

    Raises:
        ValueError: A rule cannot apply to a tensor (no such dimension, an uneven split with
            ``uneven="error"``, a packed F4/F6 tensor whose parts would split a byte), the rank
            is not in the group, or ``default``/``uneven`` is unknown (see :func:`plan_shard`).
        TypeError: ``rank``/``world_size`` are not integers, or ``rules``/``names`` are
            malformed (a str where pairs or names are expected).
        TensorNotFoundError: A name in ``names`` is not in the file.
        SafetensorError: The file is malformed, or ``backend``/``slice_reads`` is unknown.
        OSError: The file cannot be read.

    Example:
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> shard = load_shard(  # doctest: +SKIP
        ...     "model.safetensors", dist.get_rank(), dist.get_world_size(),
        ...     {"*.up.weight": "rows", "*.down.weight": "columns"})
    """
    rank, world_size = _check_group(rank, world_size)  # before opening anything
    _check_options(rules, default, uneven)
    if isinstance(backend, str) and backend not in ("auto", "mmap", "pread"):
        # safe_open's own check would list only its two, not this function's default.
        raise SafetensorError(
            f'backend "{backend}" is invalid (expected one of: "auto", "mmap", "pread")',
            kind="InvalidBackend",
        )
    if isinstance(names, (str, bytes)):
        raise TypeError(f"names must be an iterable of tensor names, not one name: {names!r:.60}")
    # "auto" reads by positioned reads and maps the same open file for the column splits.
    map_fragmented = backend == "auto" and slice_reads != "exact"
    with safe_open(
        path,
        framework,
        device=device,
        backend="pread" if backend == "auto" else backend,
        max_header_size=max_header_size,
        storage_options=storage_options,
        slice_reads=slice_reads,
    ) as f:
        wanted = list(f.offset_keys()) if names is None else list(names)
        # Header entries, not slices: a slice keeps its shard open, and a folder of thousands
        # of shards ran out of descriptors.
        found = f._infos(wanted)
        # The plan with the collector paused (no I/O): a part and a request per tensor are
        # many small objects, and the collections they set off walk torch's whole object graph
        # once it is imported (a 20,000-tensor load spent ~60 ms in them). The rules run in it
        # too, each between the checks of the tensors before and after it, as plan_shard
        # orders them (the first bad tensor is the one an error names).
        with gc_paused():
            shapes = {name: info.shape for name, info in zip(wanted, found, strict=True)}
            widths = {name: info.dtype.bits for name, info in zip(wanted, found, strict=True)}
            # The bits of sub-byte tensors, whose splits must align.
            packed = {name: bits for name, bits in widths.items() if bits % 8}
            plan = _plan_parts(shapes, rank, world_size, rules, default, uneven)
            _check_byte_aligned(plan, packed, world_size, uneven)
            requests = [(name, part) for name, (_, part) in plan.items()]
        many = getattr(f, "_read_slices", None)
        if many is not None:
            # All parts at once: one destination, read in parallel (see safe_open._read_slices).
            result: dict[str, Any] = many(requests, map_fragmented=map_fragmented)
            return result
        return {
            name: f.get_tensor(name) if part.dim is None else f.get_slice(name)[part.index]
            for name, part in requests
        }


# ---------------------------------------------------------------------------------- many files


def map_files(
    fn: Callable[[_T], _R],
    paths: Iterable[_T],
    executor: Executor | None = None,
) -> list[_R]:
    """Apply ``fn`` to every path, optionally in parallel, and return results in input order.

    Args:
        fn: The work for one file. With a process pool it must be picklable (a module-level
            function or a ``functools.partial`` of one).
        paths: The files (or any items ``fn`` takes).
        executor: Any ``concurrent.futures.Executor`` (``ThreadPoolExecutor``,
            ``ProcessPoolExecutor``, Dask's ``client.get_executor()``, ...). ``None`` runs
            ``fn`` here, one file after another. The executor is not shut down.

    Returns:
        ``[fn(p) for p in paths]``.

    Raises:
        Exception: The first failure in input order, re-raised with a note naming its item.
            Later items are still cancelled where the executor allows it.
    """
    items = list(paths)
    if executor is None:
        return [_call_noting(fn, item) for item in items]
    futures: list[Future[_R]] = []
    results: list[_R] = []
    try:
        # A Ctrl-C inside submit could leave its lock held for good: held until every item is
        # handed over, then raised inside the try, which cancels the items not yet started.
        with interrupts_deferred():
            futures.extend(executor.submit(fn, item) for item in items)
        for item, future in zip(items, futures, strict=True):
            try:
                results.append(future.result())
            except Exception as exc:
                _note(exc, item)
                raise
    finally:
        for future in futures:
            future.cancel()
    return results


def _note(exc: BaseException, item: Any) -> None:
    add_note(exc, f"while processing {item!r}")


def _call_noting(fn: Callable[[_T], _R], item: _T) -> _R:
    try:
        return fn(item)
    except Exception as exc:
        _note(exc, item)
        raise


def _validate_one(
    target: str | os.PathLike[str], strict: bool = False, check_values: bool | None = None
) -> list[Problem]:
    """:func:`~pysafetensors._validate.validate` one target; a target that cannot be opened
    (missing, unreadable, an ambiguous folder, a malformed path) becomes one Problem, so that
    one bad target does not stop a batch.

    Module level so that process pools can pickle it.
    """
    try:
        return validate(target, strict=strict, check_values=check_values)
    except (OSError, ValueError, SafetensorError) as exc:
        kind = getattr(exc, "kind", None) or "FileNotReadable"
        return [Problem("error", kind, f"{type(exc).__name__}: {exc}")]


def validate_files(
    paths: Iterable[str | os.PathLike[str]],
    executor: Executor | None = None,
    *,
    strict: bool = False,
    check_values: bool | None = None,
) -> dict[str, list[Problem]]:
    """Validate many files (or model folders, index files, URLs), optionally in parallel.

    Each target gets the full lenient validation of ``pysafetensors validate``: every problem
    is collected instead of stopping at the first.

    Args:
        paths: The targets.
        executor: Any ``concurrent.futures.Executor``; ``None`` checks them one by one here.
        strict: Add warnings (NaN/Inf, alignment, ``format`` metadata, ...).
        check_values: Read tensor data for the value checks; defaults to ``strict``.

    Returns:
        Target (as given, via ``os.fspath``) to its problems, in input order; an empty list
        means valid. A target that cannot be opened gets one error, whose kind is the
        exception's (``NoCheckpoint`` for a folder without one, ...) or ``FileNotReadable``.

    Example:
        >>> from concurrent.futures import ProcessPoolExecutor
        >>> with ProcessPoolExecutor() as pool:  # doctest: +SKIP
        ...     bad = {p: e for p, e in validate_files(files, pool).items() if e}
    """
    items = list(paths)
    job = functools.partial(_validate_one, strict=strict, check_values=check_values)
    found = map_files(job, items, executor)
    return {os.fspath(p): problems for p, problems in zip(items, found, strict=True)}


#: Files are hashed this many bytes at a time.
_READ_BLOCK: Final = 8 << 20


def _hash_one(path: str | os.PathLike[str], algorithm: str = "sha256") -> str:
    """Hex digest of one file (module level so that process pools can pickle it)."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        # hashlib releases the GIL for large updates, so thread pools hash files in parallel.
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_files(
    paths: Iterable[str | os.PathLike[str]],
    executor: Executor | None = None,
    *,
    algorithm: str = "sha256",
) -> dict[str, str]:
    """Hash many files (the hub's LFS ``sha256`` by default), optionally in parallel.

    Args:
        paths: Local files.
        executor: Any ``concurrent.futures.Executor``; ``None`` hashes them one by one here.
        algorithm: Any ``hashlib`` algorithm name with a fixed digest size.

    Returns:
        Path (as given, via ``os.fspath``) to hex digest, in input order.

    Raises:
        OSError: A file cannot be read.
        ValueError: The algorithm is unknown or has no fixed size (``shake_128``).
    """
    probe = hashlib.new(algorithm)  # an unknown name fails here, before any file is read
    if probe.digest_size == 0:
        raise ValueError(f"{algorithm!r} has no fixed digest size (shake_*); pick another")
    items = list(paths)
    digests = map_files(functools.partial(_hash_one, algorithm=algorithm), items, executor)
    return {os.fspath(p): d for p, d in zip(items, digests, strict=True)}
