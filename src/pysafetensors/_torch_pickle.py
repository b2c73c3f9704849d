"""Read PyTorch checkpoints without torch and without running anything from the pickle.

The object pickle is interpreted by :mod:`._pickle_vm` under :class:`TorchPolicy`
(:mod:`._torch_policy`: a fixed table of globals, each an inert stand-in; any other global
raises :class:`~pysafetensors._errors.UnsafePickleError` naming it and its byte offset). This
module names the tensors it builds (flattening the state dict), checks them against the
storages really present, and reads the three checkpoint formats.

With ``unknown="skip"``, unknown objects that are not dangerous are kept as placeholders
(:class:`~._torch_policy.SkippedObject`); :class:`Skipped` says where they sat.

Tensors come out as :class:`TensorRecord` (dtype, shape, strides, storage key, offset): nothing
is read from the storages until :meth:`Checkpoint.tensor_chunks` streams them, and every size,
offset and stride has by then been checked against the bytes really present.

Formats: the zip format (``torch.save`` since 1.6, any pickle protocol, ``byteorder`` little or
big), the legacy stacked-pickle format (``_use_new_zipfile_serialization=False``) and the 0.1.1
tar format (members located from the tar headers and read in place: nothing is extracted, links,
devices and duplicate members are refused, every record is checked against its member's size).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import struct
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np

from ._dtypes import DType, dtype_from_code
from ._errors import CheckpointError, first_five
from ._numpy_arrays import substitute
from ._pickle_vm import LIMIT, TRUNCATED, Limits, Result
from ._reader_pool import start_beside
from ._torch_archive import CHUNK, BoundedFile, Buffer, FileBytes, ZipView, open_zip
from ._torch_modules import ModuleViews
from ._torch_policy import (
    LEGACY_MAGIC,
    LEGACY_MAGIC_OPS,
    MAX_DIM,
    MAX_NDIM,
    STORAGE_CLASSES,
    TORCH_DTYPES,
    NumpyDtype,
    SkippedObject,
    Stand,
    StorageRef,
    TensorRecord,
    TensorRef,
    TorchPolicy,
    Unconvertible,
    ValuePolicy,
    bad_checkpoint,
    check_ints,
    is_int,
    module_class,
    policy_machine,
    short_text,
    unsafe_global,
)
from ._zip_directory import LOCAL_SIG

__all__ = [
    "SKIPPED_WHOLE",
    "Checkpoint",
    "Skipped",
    "StorageRef",
    "TensorRecord",
    "TorchPolicy",
    "load_checkpoint",
    "plan_shared",
    "sniff",
]

#: The ``kind`` of the error for a checkpoint that is one skipped object as a whole.
SKIPPED_WHOLE: Final = "SkippedWholeCheckpoint"
LEGACY_PROTOCOL: Final = 1001
#: Largest object pickle read into memory.
MAX_PICKLE_BYTES: Final = 1 << 30
#: Largest nesting of dicts/lists walked when flattening.
MAX_DEPTH: Final = 64
#: Most names (tensors and other values) one state dict flattens to. Shared sub-dicts are
#: walked once per path to them, so a small pickle can name 2**60 entries without this.
MAX_ENTRIES: Final = 1_000_000
#: Most characters in all those names together (a long key reused at every level of the
#: nesting would otherwise make each name megabytes long).
MAX_NAME_CHARS: Final = 64 << 20
#: Values rendered in all the non-tensor leaves of one checkpoint together, and in one leaf
#: (reports and metadata show the rest as "...").
MAX_LEAF_NODES: Final = 1_000_000
MAX_NODES_PER_LEAF: Final = 10_000
#: Characters of strings and dict keys rendered in all the non-tensor leaves together. A
#: string shared through the pickle's memo costs the file two bytes per use and the rendering
#: its whole length each time (a 1 MB file asked for 10 GB of JSON); past this, a string is
#: rendered as ``"<str of N characters>"`` and a dict's remaining keys are dropped.
MAX_LEAF_CHARS: Final = 16 << 20
#: An expanded tensor (stride 0: torch stores one copy of a repeated value) is written out in
#: full; one that would write more than this many bytes and over MAX_EXPANSION times what it
#: stores is refused (a 1.5 KB checkpoint asked for 256 GiB).
EXPANSION_FLOOR: Final = 256 << 20
MAX_EXPANSION: Final = 64
#: Tar checkpoints: the members torch's reader uses, and the most headers walked.
_TAR_MEMBERS: Final = ("sys_info", "pickle", "storages", "tensors")
MAX_TAR_MEMBERS: Final = 16
#: First window read for one pickle of a tar or legacy checkpoint (grown up to
#: MAX_PICKLE_BYTES).
_TAR_WINDOW: Final = 1 << 16

# --------------------------------------------------------------------------------------------
# Naming: flatten the object graph into dotted names.
# --------------------------------------------------------------------------------------------


#: Most digits of an integer key that names a tensor (str() of a longer one is refused by
#: Python, or quadratic where that limit is lifted; no real state dict has one).
MAX_KEY_DIGITS: Final = 100


def _key_text(key: Any, prefix: str = "") -> str:
    if type(key) is str:
        return key
    if type(key) is int and key.bit_length() > MAX_KEY_DIGITS * 3:  # > 10**90
        where = f" under {prefix!r}" if prefix else " at the top level"
        raise bad_checkpoint(
            f"state dict key{where} is an integer of about {key.bit_length() * 3 // 10} "
            f"digits; a key over {MAX_KEY_DIGITS} digits cannot name a tensor"
        )
    if type(key) in (int, bool) or key is None:
        return str(key)
    if isinstance(key, SkippedObject):  # its class, not the placeholder's
        where = f" under {prefix!r}" if prefix else ""
        raise bad_checkpoint(
            f"state dict key{where} is a skipped {key.name} object, which cannot name a tensor"
        )
    raise bad_checkpoint(f"state dict key of type {type(key).__name__} cannot name a tensor")


def _leaf_key_text(key: Any) -> str:
    """The name part of a key under which no tensor lies: any hashable value, in outline."""
    if type(key) in (str, bool) or key is None:
        return _key_text(key)
    if type(key) is int and key.bit_length() <= MAX_KEY_DIGITS * 3:
        return str(key)
    return short_text(key)


def _jsonable(value: Any, budget: list[int] | None = None, depth: int = 0) -> Any:
    """A JSON-ready rendering of a non-tensor leaf (for reports and metadata), bounded: at most
    16 levels, 1000 items per container, ``budget[0]`` values in all (default
    :data:`MAX_NODES_PER_LEAF`) and ``budget[1]`` characters of strings and keys (default
    :data:`MAX_LEAF_CHARS`), decremented as they are rendered; past them, ``"..."`` and
    ``"<str of N characters>"``. A leaf that shares containers or strings renders them once
    per occurrence, so the totals need the caps."""
    if budget is None:
        budget = [MAX_NODES_PER_LEAF, MAX_LEAF_CHARS]
    if budget[0] <= 0:
        return "..."
    budget[0] -= 1
    if value is None or type(value) is bool:
        return value
    if type(value) is str:
        if len(value) > budget[1]:
            budget[1] = 0
            return f"<str of {len(value)} characters>"
        budget[1] -= len(value)
        return value
    if type(value) is int:
        return value if value.bit_length() <= 256 else short_text(value)
    if type(value) is float:
        return value if math.isfinite(value) else str(value)
    if depth > 16:
        return "..."
    if type(value) is np.ndarray:
        # A decoded numpy array: the nested lists ``tolist()`` gives, bounded as lists are
        # (indexing makes views: nothing past what is rendered is converted).
        if value.ndim == 0:
            budget[0] += 1
            return _jsonable(value[()], budget, depth)
        items = []
        for i in range(len(value)):
            if i == 1000 or budget[0] <= 0:
                items.append("...")
                break
            items.append(_jsonable(value[i], budget, depth + 1))
        return items
    if type(value) in (list, tuple, set, frozenset):
        out = []
        for i, v in enumerate(value):
            if i == 1000 or budget[0] <= 0:
                out.append("...")
                break
            out.append(_jsonable(v, budget, depth + 1))
        return out
    if type(value) is dict:
        rendered: dict[str, Any] = {}
        for i, (k, v) in enumerate(value.items()):
            key = _safe_key(k)
            if i == 1000 or budget[0] <= 0 or len(key) > budget[1]:
                break
            budget[1] -= len(key)
            rendered[key] = _jsonable(v, budget, depth + 1)
        return rendered
    if isinstance(value, Stand):
        return f"<{value.name}>"
    if isinstance(value, SkippedObject):
        return f"<skipped {value.name}>"
    if isinstance(value, np.generic):  # a numpy scalar (only numbers are decoded)
        budget[0] += 1
        return _jsonable(value.item(), budget, depth)
    if isinstance(value, NumpyDtype):
        return str(value.dtype)
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, StorageRef):
        return f"<storage {value.key}>"
    return f"<{type(value).__name__}>"


def _safe_key(key: Any) -> str:
    return key if type(key) is str else short_text(key)


def _flatten(
    root: Any,
    skipped_keys: dict[str, str] | None = None,
    modules: dict[str, str] | None = None,
) -> tuple[list[tuple[str, TensorRef]], dict[str, Any]]:
    """Walk the graph iteratively, with a depth cap and cycle detection. Placeholders used as
    keys of the dicts walked are put in ``skipped_keys``, under the dict's name.

    A placeholder whose state is an ``nn.Module``'s (skip mode: a whole pickled model, as the
    checkpoint or as a value in it) is walked as its ``state_dict()`` would be, through its
    view (:mod:`._torch_modules`); where each such module sat is put in ``modules``, by
    dotted name (``""`` for the checkpoint itself), with its class."""
    tensors: list[tuple[str, TensorRef]] = []
    leaves: dict[str, Any] = {}
    views = ModuleViews()
    if modules is None:
        modules = {}
    if isinstance(root, Unconvertible):
        raise root.refusal(None)
    view = views.of(root)
    if view is not None:
        modules[""] = root.name
        root = view
    if isinstance(root, SkippedObject):
        raise CheckpointError(
            f"the checkpoint is a {root.name} object, not a state dict: skipped, it leaves "
            "nothing to convert (any tensors in it are reached only by running its code)",
            kind=SKIPPED_WHOLE,
        )
    if isinstance(root, TensorRef):
        raise bad_checkpoint(
            "the checkpoint is a single tensor without a name; expected a state dict"
        )
    if type(root) is not dict:
        raise bad_checkpoint(f"the checkpoint holds a {type(root).__name__}, not a state dict")
    contains = _tensor_containers(root, views)
    return _ordered(root, contains, tensors, leaves, skipped_keys, views, modules)


def _ordered(
    root: Any,
    contains: set[int],
    tensors: list[tuple[str, TensorRef]],
    leaves: dict[str, Any],
    skipped_keys: dict[str, str] | None,
    views: ModuleViews,
    modules: dict[str, str],
) -> tuple[list[tuple[str, TensorRef]], dict[str, Any]]:
    # Depth-first in key order, iteratively: an explicit stack of iterators.
    stack: list[tuple[str, Iterator[tuple[Any, Any]], int]] = [("", iter(root.items()), 0)]
    on_path: list[int] = [id(root)]
    entries = chars = 0
    while stack:
        prefix, it, depth = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            on_path.pop()
            continue
        key, value = nxt
        if (
            skipped_keys is not None
            and isinstance(key, SkippedObject)
            and len(skipped_keys) < MAX_SKIPPED_LISTED
        ):
            skipped_keys.setdefault(prefix, key.name)
        module = value if isinstance(value, SkippedObject) else None
        view = views.of(module)
        if view is not None:
            value = view  # walked as the module's state_dict() would be
        # Only a name that leads to a tensor must be one a safetensors file can hold; a float
        # or tuple key of a config value is shown in outline.
        holds = isinstance(value, (TensorRef, Unconvertible)) or id(value) in contains
        text = _key_text(key, prefix) if holds else _leaf_key_text(key)
        name = f"{prefix}.{text}" if prefix else text
        if isinstance(value, Unconvertible):
            raise value.refusal(name)
        # Shared sub-dicts are walked once per path to them: bound the names and their text.
        entries += 1
        chars += len(name)
        if entries > MAX_ENTRIES:
            raise bad_checkpoint(
                f"state dict has over {MAX_ENTRIES} entries (shared parts count once per path)"
            )
        if chars > MAX_NAME_CHARS:
            raise bad_checkpoint(f"state dict names are over {MAX_NAME_CHARS} characters in all")
        if isinstance(value, TensorRef):
            tensors.append((name, value))
            continue
        if module is not None and view is not None:
            modules[name] = module.name
            if not view:
                continue  # a module without parameters or buffers (a ReLU) adds no entry
        nested = (type(value) is dict and value) or (
            type(value) in (list, tuple) and id(value) in contains
        )
        if not nested:
            leaves[name] = value
            continue
        if id(value) in on_path:
            raise bad_checkpoint(f"state dict contains itself at {name!r}")
        if depth + 1 > MAX_DEPTH:
            raise bad_checkpoint(f"state dict nested deeper than {MAX_DEPTH} levels")
        items = value.items() if type(value) is dict else enumerate(value)
        stack.append((name, iter(items), depth + 1))
        on_path.append(id(value))
    return tensors, leaves


def _tensor_containers(root: Any, views: ModuleViews) -> set[int]:
    """ids of the lists/tuples/dicts (and module views) that (transitively) hold a tensor;
    iterative, cycle-safe."""
    parents: dict[int, list[int]] = {}
    seen: set[int] = set()
    todo = [root]
    holders: set[int] = set()
    steps = 0
    while todo:
        obj = todo.pop()
        steps += 1
        if steps > 50_000_000:
            raise bad_checkpoint("state dict too large to walk")
        values = obj.values() if type(obj) is dict else obj
        for v in values:
            if isinstance(v, SkippedObject):
                v = views.of(v)  # a module's view, or a leaf (None)
            if isinstance(v, (TensorRef, Unconvertible)):
                holders.add(id(obj))
            elif type(v) in (dict, list, tuple):
                parents.setdefault(id(v), []).append(id(obj))
                if id(v) not in seen:
                    seen.add(id(v))
                    todo.append(v)
    out: set[int] = set()
    todo_ids = list(holders)
    while todo_ids:
        i = todo_ids.pop()
        if i in out:
            continue
        out.add(i)
        todo_ids.extend(parents.get(i, ()))
    return out


#: Placeholders listed per checkpoint by where they sit (all their names are listed anyway).
MAX_SKIPPED_LISTED: Final = 10_000


@dataclass(frozen=True)
class Skipped:
    """What ``unknown="skip"`` left out of a checkpoint."""

    objects: dict[str, str] = field(default_factory=dict)
    """Where each placeholder sits in the state dict, by dotted name (a placeholder inside a
    set, a dict key, or one nested over 16 levels deep is listed under its container's name),
    and the global it stands for;
    at most :data:`MAX_SKIPPED_LISTED`, in state dict order."""
    globals: list[str] = field(default_factory=list)
    """Every global skipped, sorted, wherever it was (also inside other skipped objects)."""
    tensors: int = 0
    """Tensors the pickle built that no name of the state dict reaches (inside skipped
    objects' state): not converted."""
    modules: dict[str, str] = field(default_factory=dict)
    """Placeholders walked as ``nn.Module`` objects (a whole pickled model), by the dotted
    prefix of their entries (``""`` for the checkpoint itself), with their class, in state
    dict order. Their own ``state_dict`` code is not run: the default rule is applied."""


#: Levels of the non-tensor values named in :attr:`Skipped.objects` (as many as their
#: renderings show).
_NAMED_LEVELS: Final = 16


def _skipped_paths(leaves: dict[str, Any]) -> dict[str, str]:
    """Where the placeholders sit inside the non-tensor leaves, by dotted name.

    Bounded as the renderings of the leaves are (:data:`MAX_LEAF_NODES` values walked) and in
    the characters of the names made, since containers shared many times over are walked once
    per path to them. Names stop growing at :data:`_NAMED_LEVELS` levels: a placeholder deeper
    than that is listed under its container at that level (else it was not listed at all, and
    the report said there was none).
    """
    found: dict[str, str] = {}
    nodes, chars = MAX_LEAF_NODES, MAX_NAME_CHARS
    for name, value in leaves.items():
        todo: list[tuple[str, Any, int]] = [(name, value, 0)]
        deep: set[int] = set()
        while todo and nodes > 0 and chars > 0 and len(found) < MAX_SKIPPED_LISTED:
            path, v, depth = todo.pop()
            nodes -= 1
            if isinstance(v, SkippedObject):
                found.setdefault(path, v.name)
                continue
            if type(v) not in (dict, list, tuple, set, frozenset):
                continue
            named = depth < _NAMED_LEVELS
            if not named:
                # Below the named levels one walk of each container is enough (every path to
                # it names the same container): a list that holds itself ends here.
                if id(v) in deep:
                    continue
                deep.add(id(v))
            children: list[tuple[str, Any, int]] = []
            if type(v) is dict:
                for k, x in v.items():
                    if isinstance(k, SkippedObject):
                        children.append((path, k, depth + 1))
                    text = f"{path}.{_leaf_key_text(k)}" if named else path
                    chars -= len(text)
                    children.append((text, x, depth + 1))
                    if len(children) > nodes:
                        break
            elif type(v) in (list, tuple):
                for i, x in enumerate(v):
                    if len(children) > nodes:
                        break
                    text = f"{path}.{i}" if named else path
                    chars -= len(text)
                    children.append((text, x, depth + 1))
            else:
                children = [(path, x, depth + 1) for x, _ in zip(v, range(nodes), strict=False)]
            todo.extend(reversed(children))
    return found


# --------------------------------------------------------------------------------------------
# The checkpoint.
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _StorageLoc:
    nbytes: int
    member: str | None = None  # zip member name
    offset: int = 0  # legacy: file offset of the raw bytes


@dataclass
class Checkpoint:
    """A PyTorch checkpoint, parsed and checked; storages are read only on demand.

    Use as a context manager (it holds the file open).
    """

    path: str
    format: str
    """``"zip"``, ``"legacy"`` or ``"tar"``."""
    tensors: dict[str, TensorRecord]
    """Every tensor by dotted name, in file order (before deduplication)."""
    non_tensors: dict[str, Any]
    """Every other leaf by dotted name (plain values; stand-ins rendered as strings, numpy
    arrays as nested lists)."""
    byteorder: str
    """Byte order of the storages (``"little"`` or ``"big"``)."""
    _file: FileBytes = field(repr=False)
    _zip: ZipView | None = field(repr=False)
    _storages: dict[str, _StorageLoc] = field(repr=False)
    pickle_protocol: int = 2
    _spilled: dict[str, FileBytes] = field(default_factory=dict, repr=False)
    """DEFLATE members inflated into temporary files, by member name."""
    skipped: Skipped = field(default_factory=Skipped)
    """Unknown objects skipped (``unknown="skip"``) and where they were."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying file (and any inflated storage)."""
        self._file.close()
        for spilled in self._spilled.values():
            spilled.close()
        self._spilled.clear()

    @property
    def mappable(self) -> bool:
        """Whether the storages lie in the file as they are (a zip of STORED members), as
        ``torch.load(mmap=True)`` needs: it maps a compressed member's bytes as its values."""
        return self._zip is not None and all(
            m.method == zipfile.ZIP_STORED for m in self._zip.members.values()
        )

    def non_tensor_metadata(self) -> dict[str, str]:
        """Non-tensor leaves rendered as JSON strings (for ``__metadata__``)."""
        return {
            k: json.dumps(_jsonable(v), ensure_ascii=False, sort_keys=False)
            for k, v in self.non_tensors.items()
        }

    def _located(self, key: str, start: int, length: int) -> tuple[FileBytes, int, str | None]:
        """Where bytes ``start .. start+length`` of a storage lie as they are: ``(file, offset
        of the storage, member to CRC-check)``, refusing a range past the storage's end.

        A DEFLATE member (torch never writes one) is inflated once, CRC-checked, into an
        unlinked temporary file: reading its tensors one by one re-inflated it from its start
        each time (137 ms per 4-byte tensor of a 20 MB member, hours for 100,000 of them).
        """
        loc = self._storages[key]
        if start < 0 or length < 0 or start + length > loc.nbytes:
            raise bad_checkpoint(f"read past the end of storage {key}")
        if self._zip is None or loc.member is None:
            return self._file, loc.offset, None
        member = self._zip.members[loc.member]
        if member.method == zipfile.ZIP_STORED:
            return self._file, member.data_offset, loc.member
        spilled = self._spilled.get(loc.member)
        if spilled is None:
            spilled = self._spilled[loc.member] = self._inflate(loc.member)
        return spilled, 0, None

    def _inflate(self, member: str) -> FileBytes:
        assert self._zip is not None
        fd, path = tempfile.mkstemp(prefix=".pysafetensors-inflate-")
        try:
            os.unlink(path)  # nothing to clean up however this process ends
            with open(fd, "wb", closefd=False) as out:
                size = self._zip.members[member].file_size
                for piece in self._crc_checked(member, size, reuse=True):
                    out.write(piece)
            return FileBytes.from_fd(os.dup(fd), path)
        finally:
            os.close(fd)

    def storage_chunks(
        self, key: str, start: int, length: int, *, reuse: bool = False
    ) -> Iterator[Buffer]:
        """Yield bytes ``start .. start+length`` of a storage, in bounded pieces (``reuse``: all
        through one buffer, each valid until the next is asked for; see ``FileBytes.chunks``)."""
        file, base, member = self._located(key, start, length)
        if member is not None and start == 0 and length == self._storages[key].nbytes:
            yield from self._crc_checked(member, length, reuse=reuse)
        else:
            yield from file.chunks(base + start, length, reuse=reuse)

    def _crc_checked(self, member: str, length: int, *, reuse: bool = False) -> Iterator[Buffer]:
        """The member's pieces, its CRC-32 checked after the last. A large piece's share of the
        CRC is computed on a reader thread while the caller writes the piece (``zlib`` lets go
        of the GIL), and waited for before the next piece is read into the same buffer (a 2 GiB
        checkpoint converted in 1.50-1.60 s this way, against 1.76-1.95 s with the CRC after
        each read)."""
        assert self._zip is not None
        crc = 0
        for piece in self._zip.chunks(member, 0, length, reuse=reuse):
            if len(piece) < _CRC_BESIDE_BYTES:
                crc = zlib.crc32(piece, crc)
                yield piece
                continue
            state = [crc]
            wait = start_beside(functools.partial(_crc_into, state, piece))
            try:
                yield piece
            finally:
                wait()  # also when the caller stops early: the buffer is read until then
            crc = state[0]
        if not self._zip.members[member].crc_matches(crc):
            raise CheckpointError(f"zip member {member!r} fails its CRC-32 check", kind="ZipError")

    def _span(self, key: str, start: int, length: int) -> np.ndarray[Any, Any]:
        """Bytes ``start .. start+length`` of a storage as a read-only uint8 array: read into
        memory when small, else a read-only mapping of the file (page cache, not the heap:
        a transposed gigabyte needs its whole span at once; a 16 MiB span read into memory
        added its size to a conversion's peak, next to the block it is gathered into)."""
        file, base, _ = self._located(key, start, length)
        if length <= _SPAN_READ_MAX:
            return np.frombuffer(file.read_array(base + start, length), np.uint8)
        return file.mapped(base + start, length)

    def tensor_chunks(self, rec: TensorRecord, *, reuse: bool = False) -> Iterator[Any]:
        """Yield a tensor's little-endian row-major bytes (buffers or numpy arrays), each piece
        about :data:`CHUNK` bytes or less.

        With ``reuse``, the pieces are read (or gathered, swapped...) into one buffer, so each
        is valid only until the next is asked for: memory holds one piece, not a fresh
        allocation per piece with the previous one still alive (a conversion's memory grew by
        ~50 MiB that way, against ~16 MiB). Otherwise each piece may be kept.
        """
        if rec.numel == 0:
            return
        swap = self.byteorder == "big" and rec.itemsize > 1
        start, stop = rec.span
        if rec.is_contiguous and not rec.neg and not rec.conj:
            step = max(rec.itemsize, CHUNK - CHUNK % rec.itemsize)
            pieces = self.storage_chunks(rec.storage_key, start, stop - start, reuse=reuse)
            for piece in _rechunk(pieces, step, stop - start):
                yield _byteswap(piece, rec) if swap else piece
            return
        # A strided view (transposed, sliced, expanded, conj/neg): gathered block by block out
        # of the bytes it spans, so memory holds the span and one block, never the written-out
        # tensor (an expanded view writes up to 64 times its span).
        unit = np.dtype(f"<u{rec.itemsize}") if rec.itemsize in (1, 2, 4, 8) else None
        if unit is None:  # pragma: no cover - every supported torch dtype has 1..8 bytes
            raise bad_checkpoint(f"unsupported element size {rec.itemsize}")
        flat = self._span(rec.storage_key, start, stop - start).view(unit)
        # A dimension of size 1 never steps, so its stride is any number torch was given
        # (up to MAX_DIM, over what numpy's strides hold): 0 here. Every other stride is
        # inside the span, checked by _record.
        dims = zip(rec.torch_shape, rec.stride, strict=True)
        strides = tuple(0 if s == 1 else st * rec.itemsize for s, st in dims)
        view = np.lib.stride_tricks.as_strided(
            flat, shape=rec.torch_shape, strides=strides, writeable=False
        )
        np_dtype = numpy_dtype(rec.dtype)
        fixed = swap or rec.conj or rec.neg
        blocks = _blocks(rec.torch_shape, rec.itemsize)
        if not reuse:
            for index in blocks:
                block = np.ascontiguousarray(view[index])  # a view where it already is one
                if fixed and not block.flags.writeable:
                    block = block.copy()
                yield _fixed_block(block, rec, swap, np_dtype)
            return
        first = next(blocks)
        # Every block into the file's one scratch buffer (the first block is the largest).
        with self._located(rec.storage_key, start, 0)[0].scratch(view[first].nbytes) as scratch:
            buffer = np.frombuffer(scratch, unit)
            for index in itertools.chain((first,), blocks):
                part = view[index]
                block = buffer[: part.size].reshape(part.shape)
                np.copyto(block, part)
                yield _fixed_block(block, rec, swap, np_dtype)

    def tensor_array(self, rec: TensorRecord) -> np.ndarray[Any, Any]:
        """The whole tensor in memory, as a contiguous array of its real dtype (ml_dtypes for
        bf16/fp8) and torch's shape."""
        pieces = [np.frombuffer(piece, np.uint8) for piece in self.tensor_chunks(rec)]
        raw = np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
        return raw.view(numpy_dtype(rec.dtype)).reshape(rec.torch_shape)


#: Spans of strided views up to this size are read into memory; larger ones are mapped.
_SPAN_READ_MAX: Final = 1 << 20


def _blocks(shape: tuple[int, ...], itemsize: int) -> Iterator[tuple[int | slice, ...]]:
    """Indices that cut an array of ``shape`` into row-major blocks of about :data:`CHUNK`
    bytes: runs along the first axis whose slices are small enough, every index before it."""
    if not shape:
        yield ()
        return
    axis = 0
    inner = math.prod(shape[1:]) * itemsize
    while inner > CHUNK and axis < len(shape) - 1:
        axis += 1
        inner = math.prod(shape[axis + 1 :]) * itemsize
    per = max(1, CHUNK // max(1, inner))
    for lead in np.ndindex(*shape[:axis]):
        for i in range(0, shape[axis], per):
            yield (*lead, slice(i, min(i + per, shape[axis])))


def numpy_dtype(dtype: DType) -> np.dtype[Any]:
    """The numpy dtype holding one byte-sized element of ``dtype`` (F4 packs two per byte)."""
    if dtype.code == "F4":
        return np.dtype(np.uint8)
    name = dtype.numpy or ""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return found


def _fixed_block(
    block: np.ndarray[Any, Any], rec: TensorRecord, swap: bool, np_dtype: np.dtype[Any]
) -> np.ndarray[Any, Any]:
    """A contiguous block of a tensor's elements as its little-endian values, each byte order,
    conjugation and negation the record asks for applied where the block lies (writable
    whenever one is); its bytes."""
    if swap:
        _byteswap_array(block, rec, in_place=True)
    values = block.view(np_dtype)
    if rec.conj:
        np.conjugate(values, out=values)
    if rec.neg:
        np.negative(values, out=values)
    return block.reshape(-1).view(np.uint8)


def _swap_unit(rec: TensorRecord) -> int:
    # Complex numbers are two floats: each half is swapped on its own.
    return rec.itemsize // 2 if rec.dtype.code == "C64" else rec.itemsize


def _byteswap(piece: Buffer, rec: TensorRecord) -> np.ndarray[Any, Any]:
    """``piece`` with each element's bytes swapped: where it lies when its memory is writable
    (the reader's own buffer), else into a new array."""
    unit = _swap_unit(rec)
    values: np.ndarray[Any, Any] = np.frombuffer(piece, dtype=f"<u{unit}")
    if values.flags.writeable:
        values.byteswap(inplace=True)
        return values.view(np.uint8)
    out: np.ndarray[Any, Any] = values.byteswap()
    return out.view(np.uint8)


def _byteswap_array(
    flat: np.ndarray[Any, Any], rec: TensorRecord, *, in_place: bool = False
) -> np.ndarray[Any, Any]:
    unit = _swap_unit(rec)
    out: np.ndarray[Any, Any] = flat.view(f"<u{unit}").byteswap(inplace=in_place)
    return out.view(flat.dtype)


#: Pieces at least this large have their CRC-32 computed beside the caller's use of them.
_CRC_BESIDE_BYTES: Final = 1 << 20


def _crc_into(state: list[int], piece: Buffer) -> None:
    """``state[0]``, a running CRC-32, carried over ``piece``."""
    state[0] = zlib.crc32(piece, state[0])


def _rechunk(pieces: Iterable[Buffer], step: int, total: int) -> Iterator[Buffer]:
    """Re-cut ``total`` bytes of pieces so every piece but the last is a multiple of ``step``
    (itself one of the element size), without copying a piece that already is one (views of it are
    yielded); only bytes carried over to the next piece are copied (its memory may be reused
    for the next)."""
    pending = b""
    done = 0
    for piece in pieces:
        view = memoryview(piece)
        done += view.nbytes
        if pending:
            view = memoryview(pending + view)
            pending = b""
        if done >= total:
            # The last piece: whole, whatever its length.
            if view.nbytes:
                yield view
            continue
        cut = view.nbytes - view.nbytes % step
        if cut:
            yield view[:cut]
        if cut < view.nbytes:
            pending = bytes(view[cut:])
    if pending:
        yield pending


# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------


def sniff(head: bytes) -> str:
    """Classify a file by its first bytes: ``zip``, ``tar``, ``pickle`` or ``unknown``."""
    if head.startswith(LOCAL_SIG):
        return "zip"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "pickle"
    if head[:1] in (b"(", b"}", b"]", b"c", b"N", b"I", b"L", b"S", b"V", b"X", b"K", b"J"):
        return "pickle"
    return "unknown"


def load_checkpoint(
    path: str | os.PathLike[str], *, limits: Limits | None = None, unknown: str = "error"
) -> Checkpoint:
    """Parse and check a PyTorch checkpoint without reading any storage bytes.

    Args:
        path: A ``torch.save`` file (zip, legacy or 0.1.1 tar format).
        limits: Pickle resource caps.
        unknown: ``"error"`` refuses every global outside the allow-list; ``"skip"`` keeps
            those the scanner does not grade dangerous as inert placeholders
            (:attr:`Checkpoint.skipped` lists them).

    Returns:
        A :class:`Checkpoint` (close it, or use it as a context manager).

    Raises:
        UnsafePickleError: The pickle references a global outside the allow-list, or the file
            is a TorchScript archive.
        CheckpointError: The file is broken, truncated, lies about sizes, or holds tensors
            safetensors cannot store.
        OSError: The file cannot be opened.
    """
    if unknown not in ("error", "skip"):
        raise ValueError(f"unknown must be 'error' or 'skip', not {unknown!r}")
    skip = unknown == "skip"
    file = FileBytes(path)
    try:
        head = file.read(0, min(file.size, 512))
        kind = sniff(head)
        if kind == "zip":
            return _load_zip(file, limits, skip)
        if kind == "pickle":
            return _load_legacy(file, limits, skip)
        if kind == "tar":
            return _load_tar(file, limits, skip)
        raise bad_checkpoint("not a PyTorch checkpoint (neither a zip nor a pickle)")
    except BaseException:
        file.close()
        raise


def _checkpoint(
    file: FileBytes,
    fmt: str,
    policy: TorchPolicy,
    result: Result,
    storages: dict[str, _StorageLoc],
    *,
    byteorder: str = "little",
    zip_view: ZipView | None = None,
) -> Checkpoint:
    """The :class:`Checkpoint` of a pickle run to its end (``result``: its value and protocol)
    over ``storages``, every format alike: its tensors named and checked against the storages'
    real sizes (:func:`_records`)."""
    tensors, leaves, skipped = _records(
        policy, result.value, {k: v.nbytes for k, v in storages.items()}, file.size
    )
    return Checkpoint(
        file.path,
        fmt,
        tensors,
        leaves,
        byteorder,
        file,
        zip_view,
        storages,
        result.protocol,
        skipped=skipped,
    )


def _records(
    policy: TorchPolicy, root: Any, sizes: dict[str, int], file_size: int
) -> tuple[dict[str, TensorRecord], dict[str, Any], Skipped]:
    """Name every tensor and check it against the storages' real sizes (and everything they
    would write against the ``file_size`` bytes the checkpoint holds)."""
    root = substitute(root, {i: ph for i, (_, ph) in policy.array_placeholders.items()})
    keys: dict[str, str] = {}
    modules: dict[str, str] = {}
    named, leaves = _flatten(root, keys, modules)
    skipped = Skipped()
    if policy.skipped:
        reached = {id(ref) for _, ref in named}
        skipped = Skipped(
            {**keys, **_skipped_paths(leaves)},
            sorted(policy.skipped),
            len(policy.built_tensors() - reached),
            modules,
        )
    if policy.first_unconvertible is not None:
        # Built but not reached as a value of the state dict (a dict key, say): still refused.
        raise policy.first_unconvertible.refusal(None)
    out: dict[str, TensorRecord] = {}
    for name, ref in named:
        if name in out:
            raise bad_checkpoint(f"two tensors flatten to the same name {name!r}")
        if name == "__metadata__":
            raise bad_checkpoint("a tensor may not be named __metadata__")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_checkpoint(f"tensor name {name!r} is not valid Unicode") from None
        out[name] = _record(ref, sizes, name)
    _check_total_expansion(out, sizes, file_size)
    for name in leaves:
        if name in out:
            raise bad_checkpoint(f"a tensor and another value share the name {name!r}")
    total = [MAX_LEAF_NODES]
    chars = MAX_LEAF_CHARS  # shared by every leaf, as the strings of the memo are
    rendered: dict[str, Any] = {}
    for k, v in leaves.items():
        budget = [min(MAX_NODES_PER_LEAF, max(1, total[0])), chars]
        before = budget[0]
        rendered[k] = _jsonable(v, budget) if total[0] > 0 else "..."
        total[0] -= before - budget[0]
        chars = budget[1]
    return out, rendered, skipped


def _check_total_expansion(
    records: dict[str, TensorRecord], sizes: dict[str, int], file_size: int
) -> None:
    """Refuse tensors that together would write far more than the checkpoint stores.

    Each expanded tensor is bounded by :func:`_record`, but a thousand of them from one 4-byte
    storage would still fill a disk (a 1.7 KB file wrote 2 GiB with eight). Views that overlap
    without any stride 0 do it too: 2,000 views ``M[k:]`` of one 1 MiB storage, each written
    in full, made 2 GB from a 1.1 MB file. So the whole output is bounded as well; views equal
    in every respect (tied weights, stored once) count once. The multiple is of what the file
    holds, not of the storages' inflated size: storages compressed with DEFLATE inflate up to
    ``MAX_DEFLATE_RATIO`` times, and a bound on their inflated size multiplied that (a 113 KB
    file wrote 629 MB). Writing the storages once each, as ``torch.load`` holds them, stays
    allowed whatever they inflate to.
    """
    extra = 0
    written = 0
    seen: set[tuple[Any, ...]] = set()
    for rec in records.values():
        start, stop = rec.span
        extra += max(0, rec.nbytes - (stop - start))
        view = (rec.storage_key, rec.torch_dtype, rec.storage_offset, rec.torch_shape, rec.stride)
        if view not in seen:
            seen.add(view)
            written += rec.nbytes
    stored = sum(sizes.values())
    limit = max(EXPANSION_FLOOR, MAX_EXPANSION * min(stored, file_size), stored)
    if extra > limit:
        raise CheckpointError(
            f"expanded tensors (stride 0) would write {extra} bytes beyond the {stored} bytes "
            f"the checkpoint stores, over {limit}; refusing them",
            kind="ExpandedTensor",
        )
    if written > limit:
        raise CheckpointError(
            f"overlapping views of the checkpoint's storages would write {written} bytes "
            f"from the {stored} bytes it stores, over {limit}; refusing them",
            kind="ExpandedTensor",
        )


#: The dtypes (safetensors codes) whose negative views torch resolves: not bool, the wide
#: unsigned integers or the float8 and smaller floats.
_NEGATABLE: Final = frozenset({"F64", "F32", "F16", "BF16", "C64", "I64", "I32", "I16", "I8", "U8"})


def _record(ref: TensorRef, sizes: dict[str, int], name: str) -> TensorRecord:
    code, itemsize = TORCH_DTYPES[ref.dtype]
    if code is None:
        raise CheckpointError(
            f"tensor {name!r} has dtype torch.{ref.dtype}, which safetensors cannot store",
            kind="DtypeNotSupported",
            tensor=name,
        )
    if ref.neg and code not in _NEGATABLE:
        # torch.load reads it but cannot make its values ("neg_cpu" not implemented).
        raise CheckpointError(
            f"tensor {name!r} is a negative view of a torch.{ref.dtype} tensor, which torch "
            "cannot negate",
            kind="DtypeNotSupported",
            tensor=name,
        )
    if ref.conj and code != "C64":
        raise bad_checkpoint(
            f"tensor {name!r} is a conjugate view of a torch.{ref.dtype} tensor: only complex "
            "tensors are conjugated"
        )
    storage_nbytes = sizes[ref.storage.key]
    numel = math.prod(ref.size)
    if numel:
        last = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride, strict=False))
        limit_bytes = storage_nbytes
        if ref.storage.view_size >= 0:
            limit_bytes = (ref.storage.view_offset + ref.storage.view_size) * itemsize
        if (last + 1) * itemsize > limit_bytes:
            raise CheckpointError(
                f"tensor {name!r} (offset {ref.offset}, size {list(ref.size)}, stride "
                f"{list(ref.stride)}) reaches past the end of its {storage_nbytes}-byte storage",
                kind="OutOfBounds",
                tensor=name,
            )
    out_bytes = numel * itemsize
    if out_bytes > EXPANSION_FLOOR:
        start = ref.offset
        stop = start + 1 + sum((s - 1) * st for s, st in zip(ref.size, ref.stride, strict=False))
        stored = (stop - start) * itemsize
        if out_bytes > MAX_EXPANSION * stored:
            raise CheckpointError(
                f"tensor {name!r} is an expanded view (size {list(ref.size)}, stride "
                f"{list(ref.stride)}): written out it would be {out_bytes} bytes from "
                f"{stored} stored, over {MAX_EXPANSION} times as many; refusing it",
                kind="ExpandedTensor",
                tensor=name,
            )
    shape = ref.size
    if code == "F4":
        if not shape:
            raise bad_checkpoint(f"tensor {name!r}: a 0-d float4_e2m1fn_x2 tensor cannot be stored")
        shape = (*shape[:-1], shape[-1] * 2)
    return TensorRecord(
        dtype_from_code(code),
        shape,
        ref.dtype,
        ref.size,
        ref.stride,
        ref.storage.key,
        ref.offset,
        itemsize,
        storage_nbytes,
        ref.neg,
        ref.conj,
    )


def _load_zip(file: FileBytes, limits: Limits | None, skip: bool) -> Checkpoint:
    zv = open_zip(file)
    if not zv.order:
        raise bad_checkpoint("empty zip archive")
    first = zv.order[0]
    if "/" not in first:
        raise bad_checkpoint(f"zip member {first!r} is not in a subdirectory (not a torch archive)")
    prefix = first.split("/", 1)[0] + "/"
    for name in zv.order:
        if not name.startswith(prefix):
            raise bad_checkpoint(f"zip members under several folders ({prefix!r} and {name!r})")
        rel = name[len(prefix) :]
        if rel == "constants.pkl" or rel.startswith("code/"):
            raise unsafe_global("TorchScript archive (runs its own code on load)", None, 0)
    # Records are looked up as torch's reader looks them up: ignoring ASCII case.
    pkl = zv.find(prefix + "data.pkl")
    if pkl is None:
        raise bad_checkpoint(f"no {prefix + 'data.pkl'!r} in the archive")
    _check_version(zv, prefix)
    byteorder = "little"
    byteorder_record = zv.find(prefix + "byteorder")
    if byteorder_record is not None:
        raw = zv.read(byteorder_record, limit=16)
        if raw not in (b"little", b"big"):
            raise bad_checkpoint(f"byteorder record {raw!r} is neither 'little' nor 'big'")
        byteorder = raw.decode()
    data = zv.read(pkl, limit=MAX_PICKLE_BYTES)
    policy = TorchPolicy(skip_unknown=skip)
    result = policy_machine(data, policy, limits).run(0)
    if result.end != len(data):
        raise bad_checkpoint(f"{pkl}: {len(data) - result.end} bytes after STOP")
    storages: dict[str, _StorageLoc] = {}
    for key, ref in policy.storages.items():
        found = zv.find(f"{prefix}data/{key}")
        if found is None:
            raise bad_checkpoint(
                f"storage {key} is referenced but {f'{prefix}data/{key}'!r} is missing"
            )
        member, m = found, zv.members[found]
        if m.file_size != ref.nbytes:
            raise bad_checkpoint(
                f"storage {key}: the pickle declares {ref.numel} x torch.{ref.dtype} "
                f"({ref.nbytes} bytes) but {member!r} holds {m.file_size} bytes"
            )
        storages[key] = _StorageLoc(ref.nbytes, member=member)
    return _checkpoint(file, "zip", policy, result, storages, byteorder=byteorder, zip_view=zv)


#: The newest archive format torch's reader reads (``kMaxSupportedFileFormatVersion``).
MAX_ARCHIVE_VERSION: Final = 10


def _check_version(zv: ZipView, prefix: str) -> None:
    """Refuse an archive whose ``version`` record torch's reader refuses.

    torch parses it with ``std::stoull`` (leading digits after optional blanks and sign) and
    reads versions 1 to 10. An archive without the record, which torch refuses too, is read
    anyway: nothing in it is ambiguous.
    """
    record = zv.find(prefix + ".data/version") or zv.find(prefix + "version")
    if record is None:
        return
    raw = zv.read(record, limit=64)
    match = re.match(rb"[ \t\n\v\f\r]*([+-]?)([0-9]+)", raw)
    if match is None:
        raise bad_checkpoint(f"{record!r}: the archive version {raw!r} is not a number")
    version = int(match.group(2))
    if match.group(1) == b"-" and version:
        version = (1 << 64) - version  # stoull wraps negative numbers
    if not 1 <= version <= MAX_ARCHIVE_VERSION:
        raise bad_checkpoint(
            f"{record!r}: archive format version {version}; torch reads versions 1 to "
            f"{MAX_ARCHIVE_VERSION}"
        )


def _load_legacy(file: FileBytes, limits: Limits | None, skip: bool) -> Checkpoint:
    # Each leading pickle is read through a small window grown as needed (_run_pickle_at); the
    # raw storages that follow are read on demand. (Reading MAX_PICKLE_BYTES up front held up
    # to 2 GiB, two copies, for pickles of a few hundred KiB.)
    stop = file.size
    not_legacy = "not a PyTorch checkpoint: the first pickle is not the legacy magic number"
    # A first pickle longer than the magic number's is refused at once, not run to its end
    # (an 8 MB stream of trivial opcodes took 9 s before the same answer).
    lim = limits or Limits()
    magic_limits = dataclasses.replace(lim, max_ops=min(lim.max_ops, LEGACY_MAGIC_OPS))
    try:
        magic, _ = _run_pickle_at(file, 0, stop, ValuePolicy, magic_limits)
    except CheckpointError as exc:
        if exc.kind != LIMIT:
            raise
        raise bad_checkpoint(not_legacy) from None
    if type(magic.value) is not int or magic.value != LEGACY_MAGIC:
        raise bad_checkpoint(not_legacy)
    proto, _ = _run_pickle_at(file, magic.end, stop, ValuePolicy, limits)
    if proto.value != LEGACY_PROTOCOL or type(proto.value) is not int:
        raise bad_checkpoint(f"unsupported legacy protocol version {short_text(proto.value)}")
    info, _ = _run_pickle_at(file, proto.end, stop, ValuePolicy, limits)
    if type(info.value) is not dict or info.value.get("little_endian") is not True:
        raise bad_checkpoint(
            "legacy sys_info is missing or declares big-endian storages (unsupported)"
        )
    graph, policy = _run_pickle_at(
        file, info.end, stop, lambda: TorchPolicy(legacy=True, skip_unknown=skip), limits
    )
    keys_res, _ = _run_pickle_at(file, graph.end, stop, ValuePolicy, limits)
    keys = keys_res.value
    if type(keys) is not list or not all(type(k) is str for k in keys):
        raise bad_checkpoint("legacy storage key list is not a list of strings")
    if len(set(keys)) != len(keys):
        raise bad_checkpoint("legacy storage key list names a key twice")
    return _legacy_storages(file, policy, graph, keys, keys_res.end)


def _legacy_storages(
    file: FileBytes, policy: TorchPolicy, graph: Any, keys: list[str], pos: int
) -> Checkpoint:
    """Locate each storage record after the pickles (8-byte count, then the raw bytes)."""
    storages: dict[str, _StorageLoc] = {}
    for key in keys:
        ref = policy.storages.get(key)
        if ref is None:
            raise bad_checkpoint(
                f"legacy storage key {short_text(key)} is not declared in the pickle"
            )
        (count,) = struct.unpack("<q", file.read(pos, 8))
        if count != ref.numel:
            raise bad_checkpoint(
                f"storage {key}: record holds {count} elements, the pickle declares {ref.numel}"
            )
        if pos + 8 + ref.nbytes > file.size:
            raise CheckpointError(
                f"storage {key}: {ref.nbytes} bytes declared, file ends first",
                kind="Truncated",
            )
        storages[key] = _StorageLoc(ref.nbytes, offset=pos + 8)
        pos += 8 + ref.nbytes
    missing = set(policy.storages) - set(storages)
    if missing:
        listed = first_five([repr(key) for key in sorted(missing)])
        raise bad_checkpoint(f"storages {listed} declared but not present")
    return _checkpoint(file, "legacy", policy, graph, storages)


# --------------------------------------------------------------------------------------------
# The 0.1.1 tar format (torch.serialization._load's legacy_load, tarfile branch).
# --------------------------------------------------------------------------------------------

_TENSOR_CLASSES: Final = frozenset(
    f"{t}Tensor"
    for t in (
        "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool",
    )
)  # fmt: skip


class _TablePolicy(ValuePolicy):
    """Records of the ``storages``/``tensors`` members: plain values plus storage/tensor classes."""

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        """Allow ``torch[.cuda].<X>Storage`` and ``torch[.cuda].<X>Tensor`` only."""
        full = f"{module}.{name}"
        if opcode == "GLOBAL" or opcode == "STACK_GLOBAL":
            if module in ("torch", "torch.cuda") and name in STORAGE_CLASSES:
                return Stand("storage", STORAGE_CLASSES[name])
            if module in ("torch", "torch.cuda") and name in _TENSOR_CLASSES:
                return Stand("tensor_class", full)
        raise unsafe_global(f"global {full} is not on the allow-list of tar records", full, offset)


class _TarGraphPolicy(TorchPolicy):
    """The ``pickle`` member: persistent ids are keys of the storage and tensor tables."""

    def __init__(
        self, objects: dict[int, StorageRef | TensorRef], *, skip_unknown: bool = False
    ) -> None:
        super().__init__(skip_unknown=skip_unknown)
        self.objects = objects
        self.referenced: set[int] = set()
        """ids of the tensors of the tables the pickle names (at most one per table entry)."""

    def built_tensors(self) -> set[int]:
        """ids of the tensors the pickle built, and of those of the tables it names."""
        return super().built_tensors() | self.referenced

    def persistent(self, pid: Any, offset: int, opcode: str) -> Any:
        """``int(pid)`` looked up in the tables, as torch's ``persistent_load`` does (and a
        ``(class, source file, source)`` tuple, which names a module class, as that class)."""
        if type(pid) is tuple:
            if len(pid) != 3:
                raise bad_checkpoint(
                    f"unknown persistent id {short_text(pid)} (at byte {offset})", offset
                )
            return module_class(pid, pid, offset)
        if type(pid) is str and pid.isascii() and pid.isdigit() and len(pid) <= 40:
            key = int(pid)
        elif is_int(pid):
            key = pid
        else:
            raise bad_checkpoint(
                f"unknown persistent id {short_text(pid)} (at byte {offset})", offset
            )
        found = self.objects.get(key)
        if found is None:
            raise bad_checkpoint(
                f"persistent id {key} names no storage or tensor of the archive", offset
            )
        if isinstance(found, TensorRef):
            self.referenced.add(id(found))
        return found


#: Tar header blocks, and what headers (PAX records, GNU long names) may hold in all.
BLOCK_SIZE: Final = 512
MAX_TAR_HEADER_BYTES: Final = 1 << 20
MAX_TAR_HEADER_READS: Final = 16 * MAX_TAR_MEMBERS


class _TarHeaderReader(BoundedFile):
    """The file as ``tarfile`` reads it to list members: reads only, each checked first.

    ``tarfile`` reads a PAX or GNU long-name record with one ``read(size)`` of the size its
    header claims (8 GiB in a 1.5 KB file: MemoryError; 2**80: OverflowError). Members' data is
    never read through here (it is located, then read in place), so every read is header
    bytes: each must lie inside the file, and all of them together are capped.
    """

    def __init__(self, file: FileBytes) -> None:
        super().__init__(file.read, file.size)
        self.name = file.path
        self.total = 0
        self.reads = 0

    def _seek_error(self, pos: int) -> Exception:
        return bad_checkpoint(f"tar checkpoint seeks before the start of the file ({pos})")

    def _check_read(self, at: int, n: int | None) -> None:
        if n is None or n < 0:
            raise bad_checkpoint(f"tar checkpoint: a read to the end of the file at byte {at}")
        self.total += n
        self.reads += 1
        if at + n > self._size and n > BLOCK_SIZE:
            raise CheckpointError(
                f"tar checkpoint: an extended header (a PAX record or GNU long name) claims "
                f"{n} bytes at byte {at}, past the end of the {self._size}-byte file",
                kind="Truncated",
                offset=at,
            )
        if self.total > MAX_TAR_HEADER_BYTES or self.reads > MAX_TAR_HEADER_READS:
            raise bad_checkpoint(
                f"tar checkpoint: its headers (with PAX records and GNU long names) take over "
                f"{MAX_TAR_HEADER_BYTES} bytes or {MAX_TAR_HEADER_READS} reads (one of {n} "
                f"bytes at byte {at})",
                at,
            )


def _tar_members(file: FileBytes) -> dict[str, tuple[int, int]]:
    """``{name: (data offset, size)}`` from the tar headers; nothing is extracted."""
    out: dict[str, tuple[int, int]] = {}
    reader: Any = _TarHeaderReader(file)
    try:
        with tarfile.open(fileobj=reader, mode="r:") as tar:
            for count, m in enumerate(tar, 1):
                if count > MAX_TAR_MEMBERS:
                    raise bad_checkpoint(f"tar checkpoint has over {MAX_TAR_MEMBERS} members")
                if m.name not in _TAR_MEMBERS:
                    raise bad_checkpoint(f"unexpected tar member {short_text(m.name)}")
                if m.name in out:
                    raise bad_checkpoint(f"tar member {m.name!r} appears twice")
                if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.sparse is not None:
                    raise bad_checkpoint(
                        f"tar member {m.name!r} is not a regular file (link, device, sparse...)"
                    )
                if m.size < 0 or m.offset_data + m.size > file.size:
                    raise CheckpointError(
                        f"tar member {m.name!r} ({m.size} bytes at {m.offset_data}) runs "
                        f"past the end of the {file.size}-byte file",
                        kind="Truncated",
                    )
                out[m.name] = (m.offset_data, m.size)
    except CheckpointError:
        raise
    except (tarfile.TarError, EOFError, ValueError, OSError, OverflowError, RecursionError) as exc:
        # Numbers of malformed headers; tarfile's own recursion over chained PAX records.
        raise bad_checkpoint(f"unreadable tar checkpoint ({type(exc).__name__}: {exc})") from None
    for name in ("pickle", "storages", "tensors"):
        if name not in out:
            raise bad_checkpoint(f"tar checkpoint has no {name!r} member")
    spans = sorted(out.values())
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        if a + n > b:
            raise bad_checkpoint("tar members overlap")
    return out


_Policy = TypeVar("_Policy", bound=TorchPolicy)


def _run_pickle_at(
    file: FileBytes,
    start: int,
    stop: int,
    new_policy: Callable[[], _Policy],
    limits: Limits | None,
) -> tuple[Result, _Policy]:
    """Run the pickle at file offset ``start`` (inside a member or file ending at ``stop``).

    Reads a small window and grows it 8x at a time while the stream runs past it (up to
    MAX_PICKLE_BYTES), so the raw storage bytes that follow are never loaded whole. Each run
    gets a policy of its own from ``new_policy``: a policy keeps what it built (tensors,
    storages, placeholders), and one reused after a window that was too small reported the
    tensors of the failed partial run as skipped ("not converted") ones.

    Returns:
        The result, its ``end`` a file offset, and the policy of the run that gave it.
    """
    size = min(stop - start, _TAR_WINDOW)
    while True:
        data = file.read(start, size)
        policy = new_policy()
        try:
            res = policy_machine(data, policy, limits, base=start).run(0)
        except CheckpointError as exc:
            if exc.kind != TRUNCATED or size >= min(stop - start, MAX_PICKLE_BYTES):
                raise
            size = min(stop - start, size * 8, MAX_PICKLE_BYTES)
            continue
        return dataclasses.replace(res, end=start + res.end), policy


def _run_at(
    file: FileBytes,
    start: int,
    stop: int,
    new_policy: Callable[[], TorchPolicy],
    limits: Limits | None,
) -> tuple[Any, int]:
    """The value of the pickle at ``start`` and the file offset after it (see
    :func:`_run_pickle_at`)."""
    res, _ = _run_pickle_at(file, start, stop, new_policy, limits)
    return res.value, res.end


def _load_tar(file: FileBytes, limits: Limits | None, skip: bool) -> Checkpoint:
    members = _tar_members(file)
    values = ValuePolicy()
    if "sys_info" in members:
        start, size = members["sys_info"]
        if size > MAX_PICKLE_BYTES:
            raise bad_checkpoint("tar sys_info member is too large")
        info = policy_machine(file.read(start, size), values, limits, base=start).run(0).value
        if type(info) is not dict or info.get("little_endian") is False:
            raise bad_checkpoint(
                "tar sys_info is not a dict or declares big-endian storages (unsupported)"
            )
    objects: dict[int, StorageRef | TensorRef] = {}
    storages: dict[str, _StorageLoc] = {}

    def new_key(key: Any, what: str) -> int:
        if not is_int(key) or key < 0 or key > MAX_DIM:
            raise bad_checkpoint(
                f"tar {what} key {short_text(key)} is not a non-negative 63-bit int"
            )
        if key in objects:
            raise bad_checkpoint(f"tar {what} key {key} is used twice")
        return int(key)

    def open_table(member: str, what: str) -> tuple[int, int, int]:
        """The record count that starts a table member: ``(count, position, member end)``."""
        start, size = members[member]
        stop = start + size
        count, pos = _run_at(file, start, stop, _TablePolicy, limits)
        if not is_int(count) or count < 0 or count > size:
            raise bad_checkpoint(f"tar {member}: invalid {what} count {short_text(count)}")
        return count, pos, stop

    def record(pos: int, stop: int, what: str, fields: str) -> tuple[tuple[Any, ...], int]:
        """One ``(key, ..., type)`` record pickle of a table member."""
        rec, pos = _run_at(file, pos, stop, _TablePolicy, limits)
        if type(rec) is not tuple or len(rec) != 3:
            raise bad_checkpoint(f"tar {what} record {short_text(rec)} is not ({fields})")
        return rec, pos

    def close_table(member: str, pos: int, stop: int) -> None:
        if pos != stop:
            raise bad_checkpoint(f"tar {member}: {stop - pos} bytes after the last record")

    # storages: count, then per storage (key, location, storage_type) + int64 count + raw bytes,
    # then a list of views (view_key, root_key, offset, numel) in elements.
    count, pos, stop = open_table("storages", "storage")
    for _ in range(count):
        rec, pos = record(pos, stop, "storage", "key, location, type")
        key = new_key(rec[0], "storage")
        stype = rec[2]
        if type(rec[1]) is not str or not isinstance(stype, Stand) or stype.kind != "storage":
            raise bad_checkpoint(f"tar storage {key}: invalid location or storage type")
        if pos + 8 > stop:
            raise CheckpointError(f"tar storage {key}: record truncated", kind="Truncated")
        (numel,) = struct.unpack("<q", file.read(pos, 8))
        ref = StorageRef(str(key), stype.name, numel)
        if numel < 0 or numel > MAX_DIM or pos + 8 + ref.nbytes > stop:
            raise CheckpointError(
                f"tar storage {key}: claims {numel} x torch.{stype.name}, but its member holds "
                f"only {max(stop - pos - 8, 0)} more bytes",
                kind="Truncated",
            )
        objects[key] = ref
        storages[ref.key] = _StorageLoc(ref.nbytes, offset=pos + 8)
        pos += 8 + ref.nbytes
    views, pos = _run_at(file, pos, stop, _TablePolicy, limits)
    if type(views) is not list:
        raise bad_checkpoint("tar storages: the view list is not a list")
    for view in views:
        if (
            type(view) is not tuple
            or len(view) != 4
            or not all(is_int(v) and 0 <= v <= MAX_DIM for v in view)
        ):
            raise bad_checkpoint(
                f"tar storage view {short_text(view)} is not four non-negative ints"
            )
        root = objects.get(view[1])
        if not isinstance(root, StorageRef):
            raise bad_checkpoint(f"tar storage view {view[0]} has no root storage {view[1]}")
        key = new_key(view[0], "storage view")
        avail = root.view_size if root.view_size >= 0 else root.numel
        if view[2] + view[3] > avail:
            raise CheckpointError(
                f"tar storage view {key} ({view[3]} elements at {view[2]}) reaches past its "
                f"{avail}-element root",
                kind="OutOfBounds",
            )
        objects[key] = StorageRef(
            root.key, root.dtype, root.numel, root.view_offset + view[2], view[3]
        )
    close_table("storages", pos, stop)

    # tensors: count, then per tensor (key, storage_key, tensor_type) + int32 ndim + 4 pad bytes
    # + ndim int64 sizes + ndim int64 strides + int64 storage offset.
    count, pos, stop = open_table("tensors", "tensor")
    for _ in range(count):
        rec, pos = record(pos, stop, "tensor", "key, storage, type")
        key = new_key(rec[0], "tensor")
        storage = objects.get(rec[1]) if is_int(rec[1]) else None
        if not isinstance(storage, StorageRef):
            raise bad_checkpoint(
                f"tar tensor {key}: storage {short_text(rec[1])} is not in the archive"
            )
        if pos + 8 > stop:
            raise CheckpointError(f"tar tensor {key}: record truncated", kind="Truncated")
        (ndim,) = struct.unpack("<i", file.read(pos, 4))
        if ndim < 0 or ndim > MAX_NDIM:
            raise bad_checkpoint(f"tar tensor {key}: {ndim} dimensions")
        need = 8 + 16 * ndim + 8
        if pos + need > stop:
            raise CheckpointError(f"tar tensor {key}: record truncated", kind="Truncated")
        nums = struct.unpack(f"<{2 * ndim + 1}q", file.read(pos + 8, need - 8))
        pos += need
        size_t = check_ints(nums[:ndim], "size", pos)
        stride_t = check_ints(nums[ndim : 2 * ndim], "stride", pos)
        offset = nums[-1]
        if offset < 0 or offset > MAX_DIM:
            raise bad_checkpoint(f"tar tensor {key}: storage offset {offset} is invalid")
        offset += storage.view_offset
        objects[key] = TensorRef(storage, offset, size_t, stride_t, storage.dtype)
    close_table("tensors", pos, stop)

    start, size = members["pickle"]
    if size > MAX_PICKLE_BYTES:
        raise bad_checkpoint("tar pickle member is too large")
    data = file.read(start, size)
    policy = _TarGraphPolicy(objects, skip_unknown=skip)
    graph = policy_machine(data, policy, limits, base=start).run(0)
    if graph.end != len(data):
        raise bad_checkpoint(f"tar pickle: {len(data) - graph.end} bytes after STOP")
    return _checkpoint(file, "tar", policy, graph, storages)


# --------------------------------------------------------------------------------------------
# Shared storages: the reference's save_model rule.
# --------------------------------------------------------------------------------------------


def plan_shared(tensors: dict[str, TensorRecord]) -> dict[str, str]:
    """Pick the tensors to drop because another one is the very same tensor.

    Tensors are grouped as ``safetensors.torch._remove_duplicate_names`` groups them (by storage,
    then by overlapping byte ranges), and within a group by view: dtype, shape, stride, storage
    offset and neg/conj bits. In each view of two or more names that covers its whole storage,
    the lexicographically first name is kept and the others are dropped (tied weights: the
    reference's choice). Unlike the reference, other views of the storage are never dropped:
    the reference drops every member of the group but one, so ``{"full": M, "row": M[2],
    "T": M.t()}`` would keep ``T`` alone and ``full`` and ``row`` would come back with ``T``'s
    values. They are written as copies, as are identical views that do not cover their storage
    (the reference raises there).

    Returns:
        ``{dropped_name: kept_name}``.
    """
    by_storage: dict[str, list[str]] = {}
    for name, rec in tensors.items():
        # A lazily negated/conjugated view holds other values than its storage: never tie it.
        if rec.storage_nbytes and not (rec.neg or rec.conj):
            by_storage.setdefault(rec.storage_key, []).append(name)
    dropped: dict[str, str] = {}
    for names in by_storage.values():
        if len(names) < 2:
            continue
        areas = sorted((*tensors[n].span, n) for n in names)
        groups: list[list[str]] = [[areas[0][2]]]
        last_stop = areas[0][1]
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                groups.append([name])
            else:
                groups[-1].append(name)
            last_stop = stop  # not max(): the reference's rule, kept for identical output
        for group in groups:
            if len(group) < 2:
                continue
            views: dict[tuple[Any, ...], list[str]] = {}
            for n in sorted(group):
                views.setdefault(_view_key(tensors[n]), []).append(n)
            for same in views.values():
                complete = [n for n in same if tensors[n].is_complete]
                if len(same) < 2 or not complete:
                    continue
                keep = complete[0]
                for n in same:
                    if n != keep:
                        dropped[n] = keep
    return dropped


def _view_key(rec: TensorRecord) -> tuple[Any, ...]:
    """What makes two records of one storage the same tensor (same elements, same values)."""
    return (
        rec.storage_key,
        rec.dtype,
        rec.torch_dtype,
        rec.torch_shape,
        rec.stride,
        rec.storage_offset,
        rec.neg,
        rec.conj,
    )
