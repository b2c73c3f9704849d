"""Planning and saving sharded checkpoints the way the Hugging Face hub does.

The split is a port of ``huggingface_hub.serialization.split_state_dict_into_shards_factory``
(the de facto standard every hub tool reads), so the same state dict and limit give the same
file names, the same shard boundaries and a byte-identical index JSON:

* Greedy, in key order, no bin packing: a tensor that would tip the current shard over the
  limit closes it and starts a new one.
* A tensor larger than the limit gets a shard of its own, appended at once while the current
  shard stays open (so shard numbers can fall out of key order).
* Tensors that share a storage are counted once and go to the shard of the first of them.
* String values (bitsandbytes serialization) are skipped.
* Sizes are decimal (``"5GB"`` is 5 * 10**9 bytes); ``total_size`` is the sum of the sizes
  counted, i.e. bytes of tensor data, not file sizes.
* One shard is written as ``model.safetensors``; several as ``model-00001-of-00003.safetensors``
  plus ``model.safetensors.index.json`` (``json.dumps(indent=2)``).

Sizing follows the hub too: a torch tensor counts its whole storage (``untyped_storage().nbytes()``)
and is identified by ``(device, storage pointer, storage size)``; any other array counts its own
bytes and shares nothing.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import posixpath
import re
import secrets
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import PureWindowsPath
from typing import Any, Final, TypeVar

import numpy as np

from ._adapter import Adapter, get_adapter
from ._errors import SerializeError, SharedTensorsError, make_folder, output_path
from ._format import MAX_HEADER_SIZE
from ._writer import (
    SaveGroup,
    StaleFileWarning,
    TensorData,
    atomic_output,
    partial_stem,
    partial_target,
    remove_stale_partial,
    write_all,
    write_file,
)

__all__ = [
    "COMPUTED_KEYS",
    "DEFAULT_FILENAME_PATTERN",
    "MAX_SHARD_SIZE",
    "ShardPlan",
    "adapter_for",
    "as_header_metadata",
    "check_filename_pattern",
    "checkpoint_group",
    "index_filename",
    "index_json",
    "index_text",
    "is_torch",
    "model_metadata",
    "parse_size",
    "pattern_for_stem",
    "remove_stale_files",
    "save_model_sharded",
    "save_sharded",
    "split_into_shards",
    "write_checkpoint",
    "write_index",
]

#: The hub's default limit (``huggingface_hub.constants``); transformers v5 uses "50GB".
MAX_SHARD_SIZE: Final = "5GB"
#: ``SAFETENSORS_WEIGHTS_FILE_PATTERN`` of the hub.
DEFAULT_FILENAME_PATTERN: Final = "model{suffix}.safetensors"
#: Decimal units, as the hub's ``parse_size_to_int``: "5GiB" or "500M" are refused there too.
SIZE_UNITS: Final = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}

T = TypeVar("T")


def parse_size(size: int | str) -> int:
    """Turn a shard size into bytes exactly as the hub does.

    A number is a byte count (a fractional one rounds down; a bool is refused). A string is
    read as a number followed by a two-letter decimal unit (``TB``, ``GB``, ``MB``, ``KB``, any
    case); the number may be fractional (``"1.5GB"``).

    Raises:
        ValueError: The unit is not one of the four, or the number does not parse.

    Example:
        >>> parse_size("1.5GB")
        1500000000
    """
    if isinstance(size, numbers.Real) and not isinstance(size, (bool, np.bool_)):
        # The hub compares sizes with any number it is given (8e3, numpy integers): sizes are
        # whole bytes, so a fractional limit is its floor.
        if not math.isfinite(size):
            raise ValueError(f"max_shard_size must be a finite number of bytes, got {size!r}")
        return math.floor(size)
    if not isinstance(size, str):
        raise TypeError(f"max_shard_size must be a number or a str, got {type(size).__name__}")
    text = size.strip()
    unit = text[-2:].upper()
    if unit not in SIZE_UNITS:
        raise ValueError(
            f"Unit '{unit}' not supported. Supported units are TB, GB, MB, KB. Got '{text}'."
        )
    try:
        value = float(text[:-2].strip())
    except ValueError as exc:
        raise ValueError(f"Could not parse the size value from '{text}': {exc}") from exc
    if not math.isfinite(value):
        # int() of an infinite size is OverflowError, which argparse and callers catching
        # ValueError would not report as a bad size.
        raise ValueError(f"Could not parse the size value from '{text}': not a finite number")
    # int(float * unit), not Decimal arithmetic: "1.1GB" must round the way the hub rounds.
    return int(value * SIZE_UNITS[unit])


def pattern_for_stem(stem: str) -> str | None:
    """The file name pattern of a checkpoint whose single file is ``{stem}.safetensors``
    (``model{suffix}.safetensors`` for ``model``), or None for a stem no pattern can give
    (braces, a path separator...)."""
    pattern = stem + "{suffix}.safetensors"
    try:
        check_filename_pattern(pattern, shards=2)
    except SerializeError:
        return None
    return pattern


def _bad_pattern(pattern: str, why: str) -> SerializeError:
    return SerializeError(f"invalid filename pattern {pattern!r}: {why}", kind="InvalidPattern")


def check_filename_pattern(pattern: str, shards: int = 1) -> None:
    """Refuse a file name pattern that could lose data or write outside the output folder.

    The hub formats the pattern without checking it, so a pattern without ``{suffix}`` names
    every shard the same and each overwrites the last, and ``../x{suffix}`` writes next to the
    folder. Here the pattern must use no field but ``{suffix}``, must contain it when more
    than one file results, and must give plain ``*.safetensors`` names (no path separator, not
    absolute, not ``.``/``..``): the only shard names an index may hold.

    Args:
        pattern: A ``str.format`` pattern such as ``"model{suffix}.safetensors"``.
        shards: How many files it must name.

    Raises:
        SerializeError: The pattern is refused (``kind="InvalidPattern"``; also a ValueError).
    """
    import string

    try:
        pieces = list(string.Formatter().parse(pattern))
    except ValueError as exc:
        raise _bad_pattern(pattern, str(exc)) from None
    parsed = [(f, spec, conv) for _, f, spec, conv in pieces]
    fields = [f for f, _, _ in parsed if f is not None]
    unknown = [f for f in fields if f != "suffix"]
    if unknown:
        raise _bad_pattern(pattern, f"unknown field {{{unknown[0]}}}; the only field is {{suffix}}")
    if len(fields) > 1:
        # The clean-up and the source checks recognise a family by one {suffix}.
        raise _bad_pattern(pattern, "{suffix} may appear only once")
    if any("{" in text or "}" in text for text, _, _, _ in pieces):
        # "{{" formats as "{": names that pattern_family (built from the pattern's text)
        # would not recognise, so neither the clean-up nor the source checks would see them.
        raise _bad_pattern(pattern, "literal braces ({{ or }}) are not supported in names")
    if any(spec or conv for f, spec, conv in parsed if f is not None):
        # {suffix!r} quotes it, {suffix:>30} pads it with spaces: names the loaders' pattern
        # (-NNNNN-of-NNNNN) and the clean-up no longer recognise.
        raise _bad_pattern(pattern, "{suffix} takes no conversion or format spec")
    if shards > 1 and not fields:
        raise _bad_pattern(
            pattern,
            "no {suffix} field, so every shard would get the same name and overwrite each other",
        )
    try:
        names = {pattern.format(suffix=""), pattern.format(suffix="-00001-of-00002")}
    except (ValueError, IndexError, KeyError) as exc:  # format specs such as {suffix:d}
        raise _bad_pattern(pattern, f"does not format ({exc})") from None
    if shards > 1 and len(names) < 2:
        raise _bad_pattern(pattern, "does not give distinct names for distinct shards")
    for name in names:
        if (
            any(sep in name for sep in ("/", "\\", "\0"))
            or os.path.isabs(name)
            or re.match(r"[A-Za-z]:", name)
        ):
            raise _bad_pattern(pattern, "names must be plain file names inside the output folder")
        if name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise _bad_pattern(pattern, "names must end in .safetensors")


@dataclass(frozen=True)
class ShardPlan:
    """Which tensor goes to which file (the hub's ``StateDictSplit``)."""

    metadata: dict[str, Any]
    """``{"total_size": N}``: bytes of tensor data counted by the split."""
    filename_to_tensors: dict[str, list[str]]
    """File name to tensor names, in shard order."""
    tensor_to_filename: dict[str, str]
    """The index's ``weight_map``, in the hub's order."""

    @property
    def is_sharded(self) -> bool:
        """True when there is more than one file (and so an index)."""
        return len(self.filename_to_tensors) > 1

    @property
    def total_size(self) -> int:
        """Bytes of tensor data counted by the split."""
        return int(self.metadata["total_size"])


def split_into_shards(
    state_dict: Mapping[str, T],
    *,
    get_storage_size: Callable[[T], int],
    get_storage_id: Callable[[T], Any] | None = None,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> ShardPlan:
    """Split tensors into shards; a line-for-line port of the hub's splitter.

    Args:
        state_dict: Name to tensor; its iteration order decides the split.
        get_storage_size: Bytes a tensor counts for.
        get_storage_id: Identity of a tensor's storage (tensors with the same id are counted
            once and kept together), or None for "shares nothing".
        filename_pattern: A ``str.format`` pattern with a ``{suffix}`` field.
        max_shard_size: Limit per shard, an int (bytes) or a string such as ``"5GB"``.

    Returns:
        The plan. With no tensors it has no files at all, as the hub's does.
    """
    limit = parse_size(max_shard_size)
    storage_id_to_tensors: dict[Any, list[str]] = {}
    shard_list: list[dict[str, T]] = []
    current: dict[str, T] = {}
    current_size = 0
    total_size = 0

    for key, tensor in state_dict.items():
        # bitsandbytes serialization puts strings in state dicts; the hub skips them.
        if isinstance(tensor, str):
            continue
        storage_id = get_storage_id(tensor) if get_storage_id is not None else None
        if storage_id is not None:
            if storage_id in storage_id_to_tensors:
                # Placed later, next to the first tensor of this storage; not counted again.
                storage_id_to_tensors[storage_id].append(key)
                continue
            storage_id_to_tensors[storage_id] = [key]

        size = get_storage_size(tensor)
        if size > limit:
            # Its own shard, appended now; the current shard stays open.
            total_size += size
            shard_list.append({key: tensor})
            continue
        if current_size + size > limit:
            shard_list.append(current)
            current = {}
            current_size = 0
        current[key] = tensor
        current_size += size
        total_size += size

    if current:
        shard_list.append(current)
    count = len(shard_list)
    # Before any name is made: a bad pattern would overwrite shards or escape the folder.
    check_filename_pattern(filename_pattern, count)

    for keys in storage_id_to_tensors.values():
        for shard in shard_list:
            if keys[0] in shard:
                for key in keys:
                    shard[key] = state_dict[key]
                break

    if count == 1:
        filename = filename_pattern.format(suffix="")
        names = list(shard_list[0])
        return ShardPlan(
            metadata={"total_size": total_size},
            filename_to_tensors={filename: names},
            tensor_to_filename=dict.fromkeys(names, filename),
        )

    tensor_to_filename: dict[str, str] = {}
    filename_to_tensors: dict[str, list[str]] = {}
    for idx, shard in enumerate(shard_list):
        filename = filename_pattern.format(suffix=f"-{idx + 1:05d}-of-{count:05d}")
        for key in shard:
            tensor_to_filename[key] = filename
        filename_to_tensors[filename] = list(shard)
    return ShardPlan(
        metadata={"total_size": total_size},
        filename_to_tensors=filename_to_tensors,
        tensor_to_filename=tensor_to_filename,
    )


def declared_total_size(value: Any) -> int | None:
    """An index's ``total_size`` as the integer it declares, or None when it declares none
    that can be (a bool, a fraction, ``1e400``, text that is not digits). The reader's
    ``validate()`` and the command line's ``validate`` share this one rule.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 30:
        # (No size has 30 digits; int() refuses over 4,300 with a ValueError.)
        return int(value)
    return None


def unsafe_shard_name(name: str) -> str | None:
    """Why a shard name an index lists must not be opened, or None if it may be.

    Index entries are untrusted: an index may name only ``.safetensors`` files inside its own
    folder. Names are also parsed as Windows paths on every OS, so drive letters, UNC paths and
    backslash tricks are caught too (the hub's rule). The reader and the command line's
    ``validate`` share this one rule.
    """
    if not name:
        return "empty name"
    win = PureWindowsPath(name)
    if name.startswith(("/", "\\")) or win.drive or win.is_absolute() or os.path.isabs(name):
        return "absolute path or drive"
    if ".." in re.split(r"[\\/]", name):
        return "`..` in path"
    if "\x00" in name:
        return "NUL in name"
    if not name.endswith(".safetensors"):
        return "not a .safetensors file"
    if "://" in name:
        # Joined to a local folder it would still read as a URL: a local checkpoint must
        # never make a loader fetch from the network.
        return "looks like a URL, not a file name"
    return None


def normal_shard_name(name: str) -> str:
    """One spelling per shard an index names: ``./x`` and ``a//x`` are ``x`` and ``a/x``
    (transformers and the hub open them as one file), not shards holding the same tensors."""
    return posixpath.normpath(name)


#: Index metadata keys that describe how the bytes are split, recomputed by every writer.
COMPUTED_KEYS: Final = ("total_size", "total_parameters")


def model_metadata(
    shards: Iterable[Mapping[str, str] | None],
    index: Mapping[str, Any] | None,
    *,
    computed: bool = True,
) -> dict[str, Any] | None:
    """A model's metadata as one file would hold it: the rule ``merge`` writes by, ``diff``
    compares by and ``metadata get`` shows.

    Args:
        shards: Each file's ``__metadata__`` (one for a single file).
        index: The index's ``metadata`` (None for a single file), JSON values as they are.
        computed: Keep the index's ``total_size`` and ``total_parameters``; without them, a
            sharded model and its merge into one file have the same metadata.

    Returns:
        The entries every file agrees on, then the index's (which win over a file's); None when
        neither files nor index have metadata.
    """
    metas = list(shards)
    common: dict[str, Any] | None = None
    if any(m is not None for m in metas):
        common = dict(metas[0] or {})
        for m in metas[1:]:
            common = {k: v for k, v in common.items() if (m or {}).get(k) == v}
    if index is None:
        return common
    return {
        **(common or {}),
        **{k: v for k, v in index.items() if computed or k not in COMPUTED_KEYS},
    }


def as_header_metadata(meta: Mapping[str, Any]) -> dict[str, str]:
    """Metadata as a header holds it: strings, other JSON values of an index as their text."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def index_filename(filename_pattern: str = DEFAULT_FILENAME_PATTERN) -> str:
    """The index's file name for a pattern: ``model.safetensors.index.json`` by default."""
    return filename_pattern.format(suffix="") + ".index.json"


def index_json(plan: ShardPlan, metadata: Mapping[str, Any] | None = None) -> str:
    """The index file's text, byte-identical to the hub's ``json.dump(index, f, indent=2)``.

    Args:
        plan: The split.
        metadata: User metadata, merged after ``total_size`` (user keys win, as in the hub).
            A ``total_parameters`` there goes first, as transformers (v5) writes it.
    """
    merged = {**plan.metadata, **(metadata or {})}
    if "total_parameters" in merged:
        merged = {"total_parameters": merged["total_parameters"], **merged}
    index = {
        "metadata": merged,
        "weight_map": plan.tensor_to_filename,
    }
    return index_text(index)


def index_text(index: Mapping[str, Any]) -> str:
    """An index as ``json.dumps(index, indent=2)`` writes it (the hub's bytes), but always
    strict JSON.

    Python's ``json`` writes an infinite float as ``Infinity`` and NaN as ``NaN``, which no
    strict parser reads (serde, JavaScript); such floats come from user metadata or from an
    index read back (``1e400`` in a source index reads as infinity). Here an infinity is
    written ``1e400`` / ``-1e400`` (valid JSON, read back by Python as the same infinity) and
    NaN, which JSON cannot hold, as ``null``.
    """
    try:
        return json.dumps(index, indent=2, allow_nan=False)
    except ValueError:
        pass
    # Each non-finite float becomes a string token unique to this call, then its quoted text
    # in the output is replaced by the JSON number (or null).
    nonce = secrets.token_hex(8)
    found: dict[str, str] = {}

    def strict(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            token = f"nonfinite-{nonce}-{len(found)}"
            found[token] = "null" if math.isnan(value) else "1e400" if value > 0 else "-1e400"
            return token
        if isinstance(value, Mapping):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(v) for v in value]
        return value

    text = json.dumps(strict(index), indent=2)
    for token, number in found.items():
        text = text.replace(f'"{token}"', number)
    return text


def write_index(
    folder: str | os.PathLike[str],
    plan: ShardPlan,
    metadata: Mapping[str, Any] | None = None,
    *,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
    fsync: bool = False,
    group: SaveGroup | None = None,
) -> str:
    """Write the index JSON atomically and return its path (renamed with ``group``, if any)."""
    path = os.path.join(os.fspath(folder), index_filename(filename_pattern))
    data = index_json(plan, metadata).encode("utf-8")
    with atomic_output(path, fsync=fsync, group=group) as fd:
        write_all(fd, data)
    return path


def checkpoint_group(
    folder: str, plan: ShardPlan, filename_pattern: str, *, fsync: bool = False
) -> SaveGroup:
    """The :class:`SaveGroup` a checkpoint's files are renamed into place with, sealed by its
    index when it has one (the old index goes first, the new one last). Each form retires
    the other's entry point first, also without ``clean`` (which keeps the earlier save's
    files): a single file the old index, which would still be what the folder opens as; shards
    the old single file, which transformers opens before any index (a crash before the
    clean-up, or ``clean=False``, left it loading the old weights there)."""
    index = os.path.join(folder, index_filename(filename_pattern))
    if plan.is_sharded:
        single = os.path.join(folder, filename_pattern.format(suffix=""))
        return SaveGroup(fsync=fsync, seal=index, retire=single)
    return SaveGroup(fsync=fsync, retire=index)


def write_checkpoint(
    folder: str,
    plan: ShardPlan,
    metadata: Mapping[str, Any] | None,
    write_shard: Callable[[str, list[str], SaveGroup], None],
    *,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
    fsync: bool = False,
    clean: bool = True,
    group: SaveGroup | None = None,
) -> None:
    """Write every shard of ``plan`` and its index, then put them in place together.

    ``write_shard(path, names, group)`` writes (or finishes) one file through ``group``; the
    index follows. All are renamed into place together once all are written (:class:`SaveGroup`,
    the old index removed first), so an interrupted save leaves the earlier checkpoint whole
    rather than mixed with new shards; on failure the group's files are discarded. Then, with
    ``clean``, files of an earlier save with the same pattern that this one did not write are
    deleted. ``group``: one made earlier with :func:`checkpoint_group` (a streaming writer's
    shards join it as they are opened).
    """
    written = []
    if group is None:
        group = checkpoint_group(folder, plan, filename_pattern, fsync=fsync)
    with group:
        for filename, names in plan.filename_to_tensors.items():
            write_shard(os.path.join(folder, filename), names, group)
            written.append(filename)
        if plan.is_sharded:
            index = write_index(
                folder, plan, metadata, filename_pattern=filename_pattern, fsync=fsync, group=group
            )
            written.append(os.path.basename(index))
    if clean:
        remove_stale_files(folder, filename_pattern, written)


#: The ``{suffix}`` of a shard among several, as :func:`split_into_shards` writes it
#: (``-00002-of-00005``; six digits and more past 99,999 shards, as the hub's own pattern);
#: group ``count``: how many shards.
SHARD_SUFFIX: Final = r"-\d{5,}-of-(?P<count>\d{5,})"


def pattern_family(filename_pattern: str) -> re.Pattern[str]:
    """The names a save with ``filename_pattern`` writes, replaces or cleans up: its single
    file, its shards (``-NNNNN-of-NNNNN``) and its index (``fullmatch`` them)."""
    prefix, _, suffix = filename_pattern.partition("{suffix}")
    return re.compile(
        re.escape(prefix) + f"(?:{SHARD_SUFFIX})?" + re.escape(suffix) + r"(\.index\.json)?"
    )


def remove_stale_files(
    folder: str | os.PathLike[str],
    filename_pattern: str,
    keep: Iterable[str],
) -> list[str]:
    """Delete files of an earlier save with the same pattern that the new save did not write.

    The hub deletes ``pattern(-NNNNN-of-NNNNN)?(.index.json)?`` before saving; we delete after,
    sparing the files just written, so a crash mid-save never leaves the folder empty.

    Returns:
        The names removed.
    """
    regex = pattern_family(filename_pattern)
    kept = set(keep)
    removed = []
    # Index files first: an index left behind by an interrupted cleanup would still name
    # (and open as) shards that are half gone.
    names = sorted(os.listdir(folder), key=lambda n: (not n.endswith(".index.json"), n))
    # A name too long to stand whole in its temporary files' names stands there as a cut stem
    # (partial_stem), which the pattern does not match: known by the names of this pattern
    # present, or just written.
    cut_stems = {
        stem for n in (*names, *kept) if regex.fullmatch(n) and (stem := partial_stem(n)) != n
    }
    for name in names:
        target = partial_target(name)
        if target is not None and (regex.fullmatch(target) or target in cut_stems):
            # A crashed save's temporary file of this pattern (a save to another shard count
            # never targets its name again, so nothing else would remove it).
            if remove_stale_partial(os.path.join(folder, name)):
                removed.append(name)
            continue
        if name in kept or not regex.fullmatch(name):
            continue
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            continue
        except OSError as exc:
            # The save is in place already: raised, it read as a save that failed (a folder
            # of that name, a file another user owns in a sticky folder). Said, and left.
            warnings.warn(
                f"the save to {os.fspath(folder)!r} is complete, but an older file of its "
                f"name pattern could not be removed: {name!r} ({exc.strerror or exc}); "
                "loaders go by the new index or file and do not read it",
                StaleFileWarning,
                stacklevel=2,
            )
            continue
        removed.append(name)
    return removed


# ---------------------------------------------------------------------------- framework sizing


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (or subclass), without importing torch."""
    # By module name first, so that numpy-only callers never import torch; then by class, for
    # subclasses defined elsewhere (a model's own Parameter, bitsandbytes' Params4bit, ...),
    # which can exist only once torch is imported.
    kind = type(value)
    if kind is np.ndarray:
        return False  # the common case of numpy callers, asked several times per tensor
    module = kind.__module__
    if module == "torch" or module.startswith("torch."):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _copied_to_save(value: Any) -> bool:
    """Whether ``force_contiguous`` saves a copy of ``value`` (see ``torch._copied_to_save``:
    the writer copies it a slab at a time); torch is imported only where a value is a tensor."""
    if not is_torch(value):
        return False
    from .torch import _copied_to_save as copied

    return copied(value)


def torch_storage_size(tensor: Any) -> int:
    """The hub's ``get_torch_storage_size``: bytes of the whole storage a tensor views."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except (AttributeError, NotImplementedError, RuntimeError):
        return int(tensor.nelement() * tensor.element_size())


def torch_storage_id(tensor: Any) -> Any:
    """The hub's ``get_torch_storage_id``: ``(device, storage pointer, storage size)``.

    Meta tensors have no identity (None). Every empty tensor has pointer 0 and size 0, so they
    all share one id, and the hub's splitter puts them all in the shard of the first one; we
    keep that quirk because file boundaries must match.
    """
    if tensor.device.type == "meta":
        return None
    try:
        ptr = int(tensor.untyped_storage().data_ptr())
    except (AttributeError, NotImplementedError, RuntimeError):
        ptr = 0
    return (tensor.device, ptr, torch_storage_size(tensor))


def adapter_for(value: Any) -> Adapter:
    """The adapter that saves ``value``: torch's for a torch tensor, numpy's otherwise."""
    return get_adapter("pt" if is_torch(value) else "numpy")


def _data_size(name: str, value: Any) -> int:
    if is_torch(value):
        return torch_storage_size(value)
    if type(value) is np.ndarray and value.dtype.kind in "biuf" and value.dtype.itemsize <= 8:
        # numpy's own bool, int and float types: all stored, whole bytes, as they lie in
        # memory. The adapter's conversion (~2 us) is for the rest (ml_dtypes' sub-byte
        # floats are packed in the file; float128 is refused there, naming the tensor).
        return int(value.nbytes)
    data = adapter_for(value).to_data(name, value)
    nbits = 1
    for dim in data.shape:
        nbits *= dim
    return nbits * data.dtype.bits // 8


def _copy_size(tensor: Any) -> int:
    """The storage size of a contiguous copy of a torch tensor (its elements' bytes)."""
    return int(tensor.nelement() * tensor.element_size())


def _storage_id(value: Any) -> Any:
    return torch_storage_id(value) if is_torch(value) else None


# ------------------------------------------------------------------------------------- saving


def _drop_shared(
    tensors: dict[str, Any],
    metadata: dict[str, str],
    discard_names: Iterable[str] | None,
) -> dict[str, Any]:
    """The hub's ``_clean_state_dict_for_safetensors``: keep one name per shared storage.

    Each dropped name is recorded as ``metadata[dropped] = kept`` unless the caller set it.
    """
    torch_part = {k: v for k, v in tensors.items() if is_torch(v)}
    if not torch_part:
        return tensors
    from .torch import _remove_duplicate_names

    try:
        groups = _remove_duplicate_names(torch_part, discard_names=discard_names)
    except SharedTensorsError as exc:
        # The hub's words (a space after "storage."), as its save_torch_model says them; the
        # reference's save_model, whose words _remove_duplicate_names keeps, has none.
        raise SharedTensorsError(
            str(exc).replace("entire storage.Refusing", "entire storage. Refusing"),
            kind=exc.kind,
        ) from None
    for kept, dropped in groups.items():
        for name in dropped:
            metadata.setdefault(name, kept)
            del tensors[name]
    return tensors


def save_sharded(
    tensors: Mapping[str, Any],
    folder: str | os.PathLike[str],
    max_shard_size: int | str = MAX_SHARD_SIZE,
    *,
    metadata: Mapping[str, str] | None = None,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
    force_contiguous: bool = True,
    shared_tensors_to_discard: Iterable[str] | None = None,
    format: str = "pt",  # noqa: A002 - the metadata key's name
    clean: bool = True,
    fsync: bool = False,
    max_header_size: int = MAX_HEADER_SIZE,
) -> ShardPlan:
    """Save tensors as the hub's ``save_torch_state_dict`` does: shards plus an index.

    Values may be numpy arrays or torch tensors (mixed is fine). Torch tensors that share
    memory are deduplicated first exactly as the hub does (one name kept per storage, the
    others recorded in the metadata as ``{dropped: kept}``).

    Every file gets ``{"format": format}`` in its header. When everything fits in one shard the
    result is a single ``model.safetensors`` whose header also holds ``metadata``; otherwise
    ``metadata`` goes into the index's ``"metadata"`` after ``total_size``.

    Args:
        tensors: Name to array/tensor; the iteration order decides the split. Never modified.
        folder: Target folder (created if missing).
        max_shard_size: Limit per shard, bytes or ``"5GB"``-style decimal units.
        metadata: User metadata (str to str).
        filename_pattern: File name pattern with a ``{suffix}`` field.
        force_contiguous: Make torch tensors contiguous before writing (the hub's default).
        shared_tensors_to_discard: Names to prefer dropping among tied weights (for a
            transformers model, its ``_tied_weights_keys``).
        format: The value of the ``format`` header key.
        clean: Delete files of an earlier save with the same pattern that this save did not
            write (done after the new files are in place). Without it the earlier shards stay,
            but a single file saved over a sharded checkpoint still removes the old index,
            which would otherwise remain what the folder opens as.
        fsync: Make every file durable before returning.
        max_header_size: Largest header accepted per shard.

    Returns:
        The plan that was written.

    Raises:
        SerializeError: A tensor cannot be written.
        SharedTensorsError: Tied torch tensors of which none covers its whole storage.
        ValueError: ``max_shard_size`` does not parse.

    Example:
        >>> import numpy as np, tempfile
        >>> from pysafetensors import save_sharded
        >>> sd = {f"layer{i}": np.zeros(1000, np.float32) for i in range(4)}
        >>> plan = save_sharded(sd, tempfile.mkdtemp(), max_shard_size="8KB")
        >>> sorted(plan.filename_to_tensors)
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    limit = parse_size(max_shard_size)
    meta: dict[str, str] = dict(metadata) if metadata is not None else {}
    state = dict(tensors)
    state = _drop_shared(state, meta, shared_tensors_to_discard)
    # Tensors saved as copies (force_contiguous) are not copied here, all at once (a model of
    # transposed weights held its size again), but by the writer, a slab at a time. They are
    # planned and checked as their copies were: a storage of their own, of their own size.
    copied = {id(v) for v in state.values() if _copied_to_save(v)} if force_contiguous else set()
    # Sized by name first, so that a value no adapter takes is refused naming its tensor
    # (strings are skipped by the split, as the hub skips them).
    sizes = {
        id(v): _copy_size(v) if id(v) in copied else _data_size(k, v)
        for k, v in state.items()
        if not isinstance(v, str)
    }
    plan = split_into_shards(
        state,
        get_storage_size=lambda value: sizes[id(value)],
        get_storage_id=lambda v: ("copy", id(v)) if id(v) in copied else _storage_id(v),
        filename_pattern=filename_pattern,
        max_shard_size=limit,
    )
    if not plan.filename_to_tensors:
        # The hub writes nothing for an empty state dict; an empty model.safetensors is more
        # useful, since the folder then still opens as a (tensor-less) checkpoint.
        plan = ShardPlan(
            metadata={"total_size": 0},
            filename_to_tensors={filename_pattern.format(suffix=""): []},
            tensor_to_filename={},
        )
    out = output_path(folder, "folder")
    make_folder(out)  # a file where the folder should be is named
    per_file: dict[str, str] = {"format": format}
    if not plan.is_sharded:
        per_file.update(meta)

    def write_shard(path: str, names: list[str], group: SaveGroup) -> None:
        shard = {name: state[name] for name in names}
        if shard and all(is_torch(v) for v in shard.values()):
            from .torch import _flatten

            # The reference's checks (sparse, meta, non-contiguous) with its messages.
            _flatten({k: v for k, v in shard.items() if id(v) not in copied})
        data: list[TensorData] = [adapter_for(v).to_data(k, v) for k, v in shard.items()]
        write_file(path, data, per_file, fsync=fsync, max_header_size=max_header_size, group=group)

    write_checkpoint(
        out,
        plan,
        meta,
        write_shard,
        filename_pattern=filename_pattern,
        fsync=fsync,
        clean=clean,
    )
    return plan


def save_model_sharded(
    model: Any,
    folder: str | os.PathLike[str],
    max_shard_size: int | str = MAX_SHARD_SIZE,
    *,
    metadata: Mapping[str, str] | None = None,
    force_contiguous: bool = True,
    shared_tensors_to_discard: Iterable[str] | None = None,
    filename_pattern: str = DEFAULT_FILENAME_PATTERN,
    clean: bool = True,
    fsync: bool = False,
) -> ShardPlan:
    """Save a torch model's state dict sharded, as the hub's ``save_torch_model``.

    Tied weights are written once; see :func:`save_sharded` for everything else. A model with
    no tensors is saved as an empty ``model.safetensors`` (the hub's writes nothing, and the
    folder then opens as no checkpoint).
    """
    return save_sharded(
        model.state_dict(),
        folder,
        max_shard_size,
        metadata=metadata,
        filename_pattern=filename_pattern,
        force_contiguous=force_contiguous,
        shared_tensors_to_discard=shared_tensors_to_discard,
        clean=clean,
        fsync=fsync,
    )
