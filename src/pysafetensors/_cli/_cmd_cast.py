"""``pysafetensors cast``: convert floating-point tensors to another dtype, streaming.

Each tensor goes to :func:`~pysafetensors._writer.write_file` as a
:class:`~pysafetensors._writer.TensorData` whose ``chunks`` callable reads a chunk of elements
at a time and has it converted on worker threads (see :mod:`._chunk_work`), so a tensor is never
held whole in memory (the writer batches up to its ``writev`` limit). Integer, boolean,
complex and sub-byte (F4, F6) tensors are copied unchanged (naming them in ``--from`` is a
usage error), and so are FP8 tensors unless ``--from`` names them, since those usually carry
quantization scales that a cast would make meaningless.
Rounding is numpy/ml_dtypes' round-to-nearest-even; values beyond the target's range become Inf
(or NaN for types without Inf), and ``cast`` says how many.

A sharded model is written as a folder with the same shard names and an index whose
``total_size`` is recomputed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np

from .._adapter import chunk_values_widened, numpy_dtype
from .._dtypes import DType, dtype_from_code
from .._format import gc_paused
from .._remote_urls import shown_name
from .._sharding import index_text, pattern_for_stem, remove_stale_files
from .._writer import SaveGroup, TensorData, atomic_output, write_all, write_file
from . import _chunk_work
from ._chunk_work import ChunkWorkers, element_chunks
from ._common import (
    Model,
    OutputFolders,
    TensorRef,
    Ui,
    UsageError,
    add_header_limit_arg,
    check_output_folder,
    make_parent,
    name_filter,
    open_model,
    plural,
    quoted,
    sanitize,
    warn_beside_index,
)
from ._remote_args import add_remote_args, remote_options

#: Targets a cast can produce (whole-byte floating types numpy/ml_dtypes can compute in).
TARGETS: Final = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
DEFAULT_FROM: Final = ("F64", "F32", "F16", "BF16")


def register(sub: Any) -> None:
    """Add the ``cast`` subcommand."""
    p = sub.add_parser(
        "cast",
        help="convert floating tensors to another dtype (e.g. F32 -> BF16) into a new file",
        description="Cast floating-point tensors, streaming tensor by tensor into a new file "
        "(or folder, for a sharded model). Integers and other dtypes are copied unchanged.",
    )
    p.add_argument("target", metavar="TARGET", help="file, model folder, index or URL")
    p.add_argument("output", metavar="OUTPUT", help="output file (a folder for sharded input)")
    p.add_argument("--to", required=True, type=str.upper, choices=TARGETS, help="target dtype")
    p.add_argument(
        "--from",
        dest="sources",
        action="append",
        metavar="CODES",
        help=f"comma-separated dtypes to convert, repeatable (default {','.join(DEFAULT_FROM)})",
    )
    p.add_argument(
        "-f", "--filter", action="append", metavar="GLOB", help="only cast matching tensors"
    )
    p.add_argument("--regex", metavar="RE", help="only cast tensors matching this regex")
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


#: What converts a chunk (on any thread): its cast bytes and the counts of :data:`_LOSSES`.
Converter = Callable[[np.ndarray], tuple[np.ndarray, tuple[int, int, int]]]


def _converter(source: DType, target: DType) -> Converter:
    """What casts chunks of ``source`` to ``target`` (made once per source dtype)."""
    out_dtype = numpy_dtype(target)
    # BF16 is widened to float32 by its bits (exact), then cast once: the bytes ml_dtypes
    # writes for every target (every BF16 value tested), but F16's NaN (see _quiet_nans).
    widened_to_f16 = source.code == "BF16" and target.code == "F16"
    # Only a value below the target's smallest subnormal can become 0, so only those are
    # compared with 0 (comparing a whole chunk of BF16 values took twice as long as its cast),
    # and none where the target reaches as low as the source.
    tiny = _smallest_positive(out_dtype)

    def convert(raw: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A chunk cast, and how many of its values it lost (:data:`_LOSSES`; on any thread)."""
        values = chunk_values_widened(source, raw)
        with np.errstate(over="ignore", invalid="ignore"):  # per thread
            cast = values.astype(out_dtype, copy=False)  # BF16 widened to F32: as it is
            if widened_to_f16:
                _quiet_nans(values, cast)
            # A cast never makes a value finite (NaN and Inf stay, or become NaN): the values
            # it lost are the non-finite ones it has beyond the source's, counted in the
            # source only when the cast has any. Infinities become NaN in the FP8 types
            # without one. Nor does it make a zero nonzero: the zeros it has beyond the
            # source's are values below its smallest subnormal.
            lost = to_nan = 0
            non_finite = cast.size - int(np.count_nonzero(np.isfinite(cast)))
            if non_finite:
                non_finite_before = values.size - int(np.count_nonzero(np.isfinite(values)))
                lost = non_finite - non_finite_before
                if non_finite_before:
                    to_nan = int(np.count_nonzero(np.isinf(values) & np.isnan(cast)))
            flushed = 0
            if tiny > _smallest_positive(values.dtype):
                small = np.abs(values) < tiny
                flushed = int(np.count_nonzero(cast[small] == 0)) - int(
                    np.count_nonzero(values[small] == 0)
                )
        return cast.view(np.uint8), (lost, flushed, to_nan)

    return convert


def _count_losses(overflow: dict[str, list[int]], name: str, losses: tuple[int, ...]) -> None:
    """Add a chunk's losses to ``name``'s counts."""
    if any(losses):
        counts = overflow.setdefault(name, [0] * len(_LOSSES))
        for i, n in enumerate(losses):
            counts[i] += n


def _converted(
    ref: TensorRef,
    convert: Converter,
    overflow: dict[str, list[int]],
    progress: Callable[[int], None],
    workers: ChunkWorkers,
) -> Callable[[], Iterator[np.ndarray]]:
    """A tensor's cast bytes, a chunk at a time converted on the workers."""

    def chunks() -> Iterator[np.ndarray]:
        alone = ref.numel <= _chunk_work.CHUNK_ELEMENTS
        for raw, (cast, losses) in workers.ordered(convert, element_chunks(ref), alone=alone):
            _count_losses(overflow, ref.name, losses)
            progress(raw.size)
            yield cast

    return chunks


#: What a cast can lose, as each count is reported (see ``convert`` in :func:`_converter`).
_LOSSES: Final = (
    "finite {values} of {name} became Inf/NaN in {to}",
    "nonzero {values} of {name} became 0 in {to} (below its smallest subnormal)",
    "{infinities} of {name} became NaN in {to}, which has no infinity",
)


def _smallest_positive(dtype: np.dtype[Any]) -> float:
    """A float dtype's smallest positive value: its smallest subnormal, whose bits are 1 in
    every format cast reads or writes (the FNUZ ones too)."""
    return float(np.array(1, f"u{dtype.itemsize}").view(dtype)[()])


def _quiet_nans(wide: np.ndarray, half: np.ndarray) -> None:
    """NaN in ``half`` (cast from the float32 ``wide``) as the quiet NaN of its sign, as
    ml_dtypes casts BF16 to F16: numpy keeps the payload's top bits (0x7f81 became 0x7c08, a
    signalling NaN)."""
    nan = np.isnan(wide)
    if nan.any():
        half.view(np.uint16)[nan] = np.where(np.signbit(wide[nan]), 0xFE00, 0x7E00)


def _copied(ref: TensorRef, progress: Callable[[int], None]) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        for raw in ref.chunks():
            progress(raw.size)
            yield raw

    return chunks


def _plan(
    model: Model,
    args: argparse.Namespace,
    overflow: dict[str, list[int]],
    progress: Callable[[int], None],
    workers: ChunkWorkers,
) -> dict[str, list[TensorData]]:
    try:
        # Repeated --from options add up (as -f does), instead of the last one winning.
        codes = ",".join(args.sources or DEFAULT_FROM).split(",")
        sources = {dtype_from_code(c.strip().upper()) for c in codes if c.strip()}
    except Exception as exc:
        raise UsageError(f"--from: {exc}") from None
    if not sources:
        given = ",".join(args.sources or ())
        raise UsageError(f"--from names no dtype ({given!r}); give codes such as F32,F16")
    # Refused whatever the file holds: the same command line must not be accepted for one
    # model and refused for another (or with another --filter).
    uncastable = sorted(d.code for d in sources if d.bits % 8 or not d.is_float or d.code == "C64")
    if uncastable:
        codes_text = ",".join(uncastable)
        raise UsageError(f"cannot cast {codes_text} tensors (--from {codes_text})")
    target = dtype_from_code(args.to)
    accept = name_filter(args)
    converters: dict[DType, Converter] = {}
    chosen: dict[str, list[tuple[TensorRef, Converter | None]]] = {f.label: [] for f in model.files}
    for ref in model.tensors.values():
        convert = None
        if ref.dtype in sources and ref.dtype != target and accept(ref.name):
            convert = converters.get(ref.dtype)
            if convert is None:
                convert = converters[ref.dtype] = _converter(ref.dtype, target)
        chosen[ref.file.label].append((ref, convert))
    cap = _chunk_work.CHUNK_ELEMENTS if BATCH_ELEMENTS is None else BATCH_ELEMENTS
    per_file: dict[str, list[TensorData]] = {}
    for label, treated in chosen.items():
        out = per_file[label] = []
        for unit in _spans(treated, target, cap):
            if isinstance(unit, _Span):
                for i, (ref, convert) in enumerate(unit.members):
                    dtype = ref.dtype if convert is None else target
                    chunks = unit.chunks(i, overflow, progress)
                    out.append(TensorData(ref.name, dtype, ref.shape, chunks))
                continue
            ref, convert = unit
            if convert is None:
                out.append(TensorData(ref.name, ref.dtype, ref.shape, _copied(ref, progress)))
            else:
                chunks = _converted(ref, convert, overflow, progress, workers)
                out.append(TensorData(ref.name, target, ref.shape, chunks))
    return per_file


#: Elements a span of small tensors read and cast at once may hold (see :class:`_Span`);
#: None: :data:`._chunk_work.CHUNK_ELEMENTS`, a chunk of the per-tensor path; 0: no spans.
BATCH_ELEMENTS: int | None = None


class _Span:
    """Small tensors next to each other in the input file, written one after another, that
    are read in one request and cast (or copied) together.

    A tensor at a time, each of 100,000 small tensors cost a read, a converter and some
    twenty numpy calls: 13 s to cast a file of them on a 2-core host. A cast works value by
    value, so a span's cast bytes are its tensors' cast bytes one after another: each tensor
    gets its slice. Only the losses (:data:`_LOSSES`) are counted per tensor, again slice by
    slice where the span lost any. The span is read when its first tensor is written and let
    go once its last one is, as the writer takes the tensors in the output's order, which the
    spans follow (:func:`_spans`): a few spans in memory at most (the writer gathers small
    slices into writes of up to 4 MiB), each of up to a chunk's elements.
    """

    __slots__ = ("_bounds", "_bytes", "_left", "convert", "members", "target")

    def __init__(self, members: list[tuple[TensorRef, Converter | None]], target: DType) -> None:
        self.members = members
        self.convert = members[0][1]
        self.target = target
        self._bytes: np.ndarray | None = None
        self._bounds: list[int] = []
        self._left = len(members)

    def chunks(
        self, i: int, overflow: dict[str, list[int]], progress: Callable[[int], None]
    ) -> Callable[[], Iterator[np.ndarray]]:
        """Member ``i``'s ``TensorData.chunks``: its slice of the span."""

        def chunks() -> Iterator[np.ndarray]:
            if self._bytes is None:
                self._read(overflow)
            assert self._bytes is not None
            piece = self._bytes[self._bounds[i] : self._bounds[i + 1]]
            self._left -= 1
            if not self._left:
                self._bytes = None  # the slices handed out keep what is still to be written
            progress(self.members[i][0].nbytes)
            yield piece

        return chunks

    def _read(self, overflow: dict[str, list[int]]) -> None:
        first, last = self.members[0][0], self.members[-1][0]
        raw = np.empty(last.end - first.begin, np.uint8)
        if raw.size:
            first.file.data.readinto(first.file_offsets[0], raw.data)
        in_bounds = [ref.begin - first.begin for ref, _ in self.members]
        in_bounds.append(raw.size)
        if self.convert is None:
            self._bytes, self._bounds = raw, in_bounds
            return
        cast, losses = self.convert(raw)
        # Whole bytes an element on both sides (cast takes no sub-byte dtype).
        size_in, size_out = first.dtype.bits // 8, self.target.bits // 8
        bounds = [b // size_in * size_out for b in in_bounds]
        if any(losses):  # which tensors lost values: counted slice by slice
            for j, (ref, _) in enumerate(self.members):
                piece = raw[in_bounds[j] : in_bounds[j + 1]]
                if piece.size:
                    _count_losses(overflow, ref.name, self.convert(piece)[1])
        self._bytes, self._bounds = cast, bounds


def _spans(
    chosen: list[tuple[TensorRef, Converter | None]], target: DType, cap: int
) -> Iterator[_Span | tuple[TensorRef, Converter | None]]:
    """The tensors of one file in the output's order (the writer's: rank descending, then
    name), runs of small ones next to each other in the input and treated alike (the same
    converter, or copied) as spans of at most ``cap`` elements, the others alone."""

    def written_order(item: tuple[TensorRef, Converter | None]) -> tuple[int, str]:
        ref, convert = item
        return -(ref.dtype if convert is None else target).rank, ref.name

    ordered = sorted(chosen, key=written_order)
    run: list[tuple[TensorRef, Converter | None]] = []
    elements = 0
    for ref, convert in ordered:
        n = ref.numel
        small = cap > 0 and n <= cap and n <= _chunk_work.CHUNK_ELEMENTS
        if run:
            last, last_convert = run[-1]
            follows = (
                small
                and convert is last_convert
                and ref.begin == last.end
                and ref.dtype == last.dtype
                and elements + n <= cap
            )
            if not follows:
                yield _Span(run, target) if len(run) > 1 else run[0]
                run, elements = [], 0
        if small:
            run.append((ref, convert))
            elements += n
        else:
            yield ref, convert
    if run:
        yield _Span(run, target) if len(run) > 1 else run[0]


def run(args: argparse.Namespace) -> int:
    """Run ``cast``."""
    ui = Ui(args)
    overflow: dict[str, list[int]] = {}
    # Folders the cast creates are removed again (when still empty) if it fails.
    with (
        open_model(args.target, remote_options(args), args.max_header_size) as model,
        OutputFolders() as folders,
    ):
        model.refuse_inconsistent()  # as reshard/merge/extract: never write a model from it
        total = sum(t.nbytes for t in model.tensors.values())
        with (
            ui.progress(total, "cast") as update,
            model.planned_reads(model.tensors.values()),
            ChunkWorkers() as workers,
        ):
            with gc_paused():  # a few records per tensor, all kept until written
                plan = _plan(model, args, overflow, update, workers)
            written = 0
            if not model.sharded:
                f = model.files[0]
                make_parent(args.output, folders)
                layout = write_file(
                    args.output,
                    plan[f.label],
                    f.header.metadata,
                    max_header_size=args.max_header_size,
                )
                warn_beside_index(args.output)
                written = layout.file_size
                data_bytes = {f.label: layout.data_size}
            else:
                check_output_folder(args.output, "a sharded model is cast into a folder")
                folders.makedirs(args.output)
                data_bytes = {}
                index = _index_target(model, args.output)
                # Every shard and the index are renamed into place together once all are
                # written (as sharded saves are): a cast that fails midway, into its own folder
                # above all, leaves the earlier checkpoint whole instead of a mix of dtypes.
                retire = _single_file_beside(index, plan)
                with SaveGroup(seal=index, retire=retire) as group:
                    for f in model.files:
                        layout = write_file(
                            _shard_output(args.output, f.label, folders),
                            plan[f.label],
                            f.header.metadata,
                            group=group,
                            max_header_size=args.max_header_size,
                        )
                        written += layout.file_size
                        data_bytes[f.label] = layout.data_size
                    if index is not None:
                        _write_index(model, index, data_bytes, group)
                if index is not None:
                    _remove_stale(args.output, index, plan)
        before = sum(t.nbytes for t in model.tensors.values())
        after = sum(data_bytes.values())
        converted = sum(
            1 for ts in plan.values() for t in ts if t.dtype != model.tensors[t.name].dtype
        )
    for name, counts in overflow.items():
        for count, text in zip(counts, _LOSSES, strict=True):
            if count:
                words = {"values": "value" if count == 1 else "values"}
                words["infinities"] = "infinity" if count == 1 else "infinities"
                ui.warn(f"{count} " + text.format(name=quoted(name), to=args.to, **words))
    if (args.filter or args.regex) and not any(map(name_filter(args), model.tensors)):
        ui.warn("--filter/--regex matched no tensor: the output is a copy of the input")
    ui.done(
        f"{sanitize(args.output)}: cast {converted} of {plural(len(model.tensors), 'tensor')} "
        f"to {args.to}; "
        f"data {before:,} -> {after:,} bytes ({written:,} bytes written)"
    )
    return 0


def _shard_output(folder: str, label: str, folders: OutputFolders) -> str:
    """Where the shard named ``label`` in the index is written: at the same relative path in
    ``folder``, whose subfolders (``sub/model-00001-of-00002.safetensors``) are created.

    The name is relative and free of ``..`` (:func:`locate_model` refused others); a link in
    ``folder`` that would lead the shard outside it is refused too.

    Raises:
        UsageError: The shard would be written outside ``folder``.
    """
    path = os.path.join(folder, label)
    parent = os.path.dirname(path)
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(parent)]) != root:
        raise UsageError(
            f"the shard {sanitize(repr(label))} would be written outside {sanitize(repr(folder))} "
            "(through a link there)"
        )
    folders.makedirs(parent)
    return path


def _index_target(model: Model, folder: str) -> str | None:
    """Where the output's index goes (named as the source's), or None without one."""
    index_path = model.located.index_path
    if index_path is None:
        return None
    return os.path.join(folder, shown_name(index_path))


def _family_pattern(index: str) -> str | None:
    """The file name pattern of the checkpoint whose index is ``index``
    (``model{suffix}.safetensors`` for ``model.safetensors.index.json``), or None for an index
    name no pattern gives."""
    single = os.path.basename(index).removesuffix(".index.json")
    if not single.endswith(".safetensors"):
        return None
    return pattern_for_stem(single.removesuffix(".safetensors"))


def _single_file_beside(index: str | None, plan: dict[str, list[TensorData]]) -> str | None:
    """The single file of the index's name (``model.safetensors``) in the output folder, which
    the sharded output replaces: transformers opens it before any index, so left there it
    would still load the folder's earlier weights. None where the cast writes that very name
    (an index may list it as a shard)."""
    pattern = None if index is None else _family_pattern(index)
    if index is None or pattern is None:
        return None
    single = pattern.format(suffix="")
    if single in plan:
        return None
    return os.path.join(os.path.dirname(index), single)


def _remove_stale(folder: str, index: str, plan: dict[str, list[TensorData]]) -> None:
    """Delete the files of an earlier checkpoint of the same name pattern in ``folder`` that
    the cast did not write (shards of another count, crashed saves' temporary files), as a
    sharded save does: left there, they are stray shards beside the new index."""
    pattern = _family_pattern(index)
    if pattern is not None:
        remove_stale_files(folder, pattern, [*plan, os.path.basename(index)])


def _write_index(model: Model, path: str, data_bytes: dict[str, int], group: SaveGroup) -> None:
    index = dict(model.located.index or {})
    meta = dict(index.get("metadata") or {})
    meta["total_size"] = sum(data_bytes.values())
    index["metadata"] = meta
    with atomic_output(path, group=group) as fd:
        write_all(fd, (index_text(index) + "\n").encode("utf-8"))
