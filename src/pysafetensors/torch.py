"""torch: ``save``, ``save_file``, ``load``, ``load_file``, ``save_model``, ``load_model``.

Signatures, checks and messages follow the reference's ``safetensors.torch``, including the
helpers its users import (``storage_ptr``, ``storage_size``, ``_find_shared_tensors``,
``_remove_duplicate_names``). Differences: inputs (the model's state dict, the metadata dict) are
never modified, and ``save_file`` writes straight from tensor memory.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar

import numpy as np
import torch

from ._adapter import invalid_tensor_error, non_contiguous_error
from ._api import (
    TensorSpec,
    deserialize,
    load_bytes_with,
    load_file_with,
    save_bytes_with,
    save_file_with,
    serialize,
    serialize_file,
)
from ._devices import CPU
from ._dtypes import dtype_from_code
from ._errors import MetaTensorError, PathArg, SerializeError, SharedTensorsError, first_five
from ._layout import check_metadata
from ._reader import safe_open
from ._sharded import ShardedSafeOpen, shown
from ._sharding import save_model_sharded, save_sharded
from ._torch_adapter import ADAPTER, TO_TORCH, end_ptr
from ._torch_in_place import in_place_targets, maps_file

__all__ = [
    "TensorSpec",
    "deserialize",
    "load",
    "load_file",
    "load_model",
    "safe_open",
    "save",
    "save_file",
    "save_model",
    "save_model_sharded",
    "save_sharded",
    "serialize",
    "serialize_file",
    "storage_ptr",
    "storage_size",
]

_DOCS = "https://huggingface.co/docs/safetensors/torch_shared_tensors"
#: A dict's value type for saves: any tensor type (``dict[str, torch.nn.Parameter]`` too; a
#: ``dict[str, torch.Tensor]`` parameter would refuse it, dict being invariant).
_TensorT = TypeVar("_TensorT", bound=torch.Tensor)

# The reference module's helper names, which other code (and the reference's own tests) import
# from it: ``safe_open``, ``serialize``, ``serialize_file`` and ``deserialize`` above, and these.

#: Format code to torch dtype (``"BF16"`` -> ``torch.bfloat16``), every dtype this torch has.
_TYPES: dict[str, torch.dtype] = dict(TO_TORCH)

#: torch dtype to bytes per element (``float4_e2m1fn_x2`` holds two values in one byte).
_SIZE: dict[torch.dtype, int] = {t: t.itemsize for t in _TYPES.values()}


def _getdtype(dtype_str: str) -> torch.dtype:
    """The torch dtype of a format code, as the reference's helper of that name."""
    return _TYPES[dtype_str]


# The reference's names for the dtypes older torch builds lack (None where this one does).
_float8_e4m3fn = getattr(torch, "float8_e4m3fn", None)
_float8_e4m3fnuz = getattr(torch, "float8_e4m3fnuz", None)
_float8_e5m2 = getattr(torch, "float8_e5m2", None)
_float8_e5m2fnuz = getattr(torch, "float8_e5m2fnuz", None)
_float8_e8m0 = getattr(torch, "float8_e8m0fnu", None)
_float4_e2m1_x2 = getattr(torch, "float4_e2m1fn_x2", None)


def _to_ndarray(tensor: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """A tensor's bytes (row-major, little-endian) as a uint8 array, and the tensor, as the
    reference's helper returns them.

    Raises:
        SerializeError: The tensor cannot be stored (sparse, meta, an unknown dtype).
    """
    data = ADAPTER.to_data("tensor", tensor)
    raw = np.frombuffer(bytearray(b"".join(bytes(c) for c in data.chunks())), np.uint8)
    return raw, tensor


def _view2torch(safeview: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, torch.Tensor]:
    """Tensors from :func:`deserialize`'s ``(name, {"dtype", "shape", "data"})`` entries."""
    return {
        name: ADAPTER.from_bytes(
            np.frombuffer(bytearray(view["data"]), np.uint8),
            dtype_from_code(view["dtype"]),
            tuple(view["shape"]),
            CPU,
        )
        for name, view in safeview
    }


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the storage a tensor views (0 when it has none)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - e.g. tensors without storage
        return 0


def storage_size(tensor: torch.Tensor) -> int:
    """Size in bytes of the storage a tensor views."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001
        return 0


#: The reference's name (``safetensors.torch._end_ptr``), for code that calls it.
_end_ptr = end_ptr


def _filter_shared_not_shared(
    tensors: list[set[str]], state_dict: Mapping[str, torch.Tensor]
) -> list[set[str]]:
    """Split groups on one storage into groups whose byte ranges really overlap."""
    filtered: list[set[str]] = []
    for shared in tensors:
        if len(shared) < 2:
            filtered.append(shared)
            continue
        areas = sorted(
            (state_dict[name].data_ptr(), end_ptr(state_dict[name]), name) for name in shared
        )
        _, last_stop, last_name = areas[0]
        filtered.append({last_name})
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                filtered.append({name})
            else:
                filtered[-1].add(name)
            last_stop = stop
    return filtered


#: Save errors that ``save_model`` adds its ``force_contiguous`` hint to, as the reference adds
#: it to its ``ValueError``s (non-contiguous, sparse, not a tensor).
_CONTIGUITY_HINTED: Final = frozenset({"NonContiguous", "SparseTensor", "InvalidTensor"})


def _find_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Groups of names whose tensors share memory (singletons for the rest)."""
    groups: dict[tuple[Any, int, int], set[str]] = defaultdict(set)
    for name, tensor in state_dict.items():
        if tensor.device != torch.device("meta") and storage_ptr(tensor) and storage_size(tensor):
            groups[(tensor.device, storage_ptr(tensor), storage_size(tensor))].add(name)
    # The reference's ``sorted`` of the sets, which compares them by inclusion: disjoint groups
    # keep their first name's order in the dict, and so do its error messages.
    ordered = sorted(groups.values())
    return _filter_shared_not_shared(ordered, state_dict)


def _is_complete(tensor: torch.Tensor) -> bool:
    return bool(
        tensor.data_ptr() == storage_ptr(tensor)
        and tensor.nelement() * tensor.element_size() == storage_size(tensor)
    )


def _remove_duplicate_names(
    state_dict: Mapping[str, torch.Tensor],
    *,
    preferred_names: Iterable[str] | None = None,
    discard_names: Iterable[str] | None = None,
) -> dict[str, list[str]]:
    """For each group of shared tensors, the name to keep and the names to drop."""
    preferred = set(preferred_names or ())
    discard = set(discard_names or ())
    to_remove: dict[str, list[str]] = defaultdict(list)
    for shared in _find_shared_tensors(state_dict):
        complete = {name for name in shared if _is_complete(state_dict[name])}
        if not complete:
            raise SharedTensorsError(
                "Error while trying to find names to remove to save state dict, but found no "
                f"suitable name to keep for saving amongst: {shared}. None is covering the entire "
                "storage.Refusing to save/load the model since you could be storing much more "
                f"memory than needed. Please refer to {_DOCS} for more information. Or open an "
                "issue.",
                kind="SharedTensors",
            )
        keep = sorted(complete)[0]
        kept_ok = complete - discard
        if kept_ok:
            keep = sorted(kept_ok)[0]
        if preferred:
            chosen = preferred & complete
            if chosen:
                keep = sorted(chosen)[0]
        for name in sorted(shared):
            if name != keep:
                to_remove[keep].append(name)
    return to_remove


def _evaluate_tensors_for_save(tensors: Any) -> None:
    """The reference's helper: its checks of a dict to save (a dict of dense tensors, none
    sharing memory with another), with its messages.

    Raises:
        SerializeError: Not a dict, a value is not a tensor, or sparse tensors.
        SharedTensorsError: Tensors share memory (use :func:`save_model`).
    """
    if not isinstance(tensors, dict):
        raise SerializeError(
            f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}",
            kind="InvalidTensor",
        )
    sparse = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise invalid_tensor_error(name, "torch.Tensor", tensor, prefix="")
        if tensor.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise SerializeError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            "support. You can make it a dense tensor before saving with `.to_dense()` but be "
            "aware this might make a much larger file than needed.",
            kind="SparseTensor",
        )
    failing = [names for names in _find_shared_tensors(tensors) if len(names) > 1]
    if failing:
        # The reference's text to the whitespace (an indented triple-quoted string there), so
        # that code comparing messages sees no difference.
        indent = "\n" + " " * 12
        raise SharedTensorsError(
            f"{indent}Some tensors share memory, this will lead to duplicate memory on disk and "
            f"potential differences when loading them again: {failing}.{indent}A potential way "
            f"to correctly save your model is to use `save_model`.{indent}More information at "
            f"{_DOCS}{indent}",
            kind="SharedTensors",
        )


def _copied_to_save(value: Any) -> bool:
    """Whether ``force_contiguous`` saves a copy of ``value``: a dense tensor whose memory does
    not hold its elements in order (``.contiguous()`` of it is a new tensor). A sparse tensor
    is not: torch refuses to make it contiguous, and the writer's checks refuse it with the
    reference's words."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_contiguous()
    )


def _flatten(tensors: Any) -> Mapping[str, torch.Tensor]:
    """``tensors``, after the reference's checks before saving (its messages), and ours of
    meta tensors."""
    _evaluate_tensors_for_save(tensors)
    for name, tensor in tensors.items():
        if tensor.device.type == "meta":
            raise MetaTensorError(
                f"Cannot copy out of meta tensor `{name}`; it has no data",
                kind="MetaTensor",
                tensor=str(name),
            )
        if not tensor.is_contiguous():
            raise non_contiguous_error(name)
    checked: Mapping[str, torch.Tensor] = tensors
    return checked


def _flatten_as_ptr(tensors: Any, keep_alive_buffer: list[Any]) -> dict[str, TensorSpec]:
    """The reference's helper: ``{name: TensorSpec}`` over a little-endian copy of each
    tensor's bytes (appended with its tensor to ``keep_alive_buffer``), as ``serialize`` takes
    them.

    Raises:
        SerializeError: As :func:`save`.
        SharedTensorsError: Tensors share memory.
    """
    flattened = {}
    for name, tensor in _flatten(tensors).items():
        arr, kept = _to_ndarray(tensor)
        keep_alive_buffer.append((arr, kept))
        flattened[name] = TensorSpec(
            dtype=str(tensor.dtype).split(".")[-1],
            shape=list(tensor.shape),
            data_ptr=arr.ctypes.data,
            data_len=arr.nbytes,
        )
    return flattened


def save(tensors: dict[str, _TensorT], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize tensors to the bytes of a safetensors file.

    Args:
        tensors: Name to tensor (dense, contiguous, not sharing memory with each other).
        metadata: Optional ``__metadata__`` (str to str).

    Raises:
        SerializeError: Sparse, non-contiguous or meta tensors, or values that are not tensors.
        SharedTensorsError: Tensors share memory (use :func:`save_model`).

    Example:
        >>> import torch
        >>> from pysafetensors.torch import save, load
        >>> load(save({"a": torch.ones(2)}))["a"]
        tensor([1., 1.])
    """
    return save_bytes_with(ADAPTER, _flatten(tensors), metadata)


def save_file(
    tensors: dict[str, _TensorT],
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = False,
) -> None:
    """Write tensors to a file atomically, straight from their memory.

    Args:
        tensors: As for :func:`save`.
        filename: Target path; an existing file (even one still memory-mapped by tensors being
            saved) is replaced only once the new one is complete.
        metadata: Optional ``__metadata__``.
        fsync: Make the file durable before returning.
    """
    save_file_with(ADAPTER, _flatten(tensors), filename, metadata, fsync=fsync)


def load(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Load CPU tensors from the bytes of a safetensors file (they own a copy)."""
    return load_bytes_with(ADAPTER, data, "cpu")


def load_file(
    filename: Any,
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a file, in file order.

    Args:
        filename: A path, URL or binary file object; a model folder, index file or their
            URL loads a sharded checkpoint whole.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int, ...
        backend: ``"mmap"`` (copy-on-write views, zero-copy on CPU) or ``"pread"``.
        storage_options: For URLs: headers, credentials, endpoint (as for ``safe_open``).
    """
    return load_file_with("pt", filename, device, backend, storage_options)


def save_model(
    model: torch.nn.Module,
    filename: PathArg,
    metadata: Mapping[str, str] | None = None,
    force_contiguous: bool = True,
) -> None:
    """Save a model's state dict, dropping duplicate names of tied weights.

    Each dropped name is recorded in the metadata as ``{dropped: kept}`` (user keys win), so
    :func:`load_model` can restore the ties. The caller's metadata dict is not modified.
    """
    state_dict = dict(model.state_dict())
    meta = check_metadata(metadata)  # before adding to it: a str or list is refused, as there
    for kept, dropped in _remove_duplicate_names(state_dict).items():
        for name in dropped:
            if meta is None:
                meta = {}
            meta.setdefault(name, kept)
            del state_dict[name]
    try:
        if force_contiguous:
            # Not `.contiguous()` of each up front, which held copies of all of them at once
            # (a model of transposed weights: its size again); the writer copies them a slab
            # at a time. Left out of the checks of `save_file`, as those copies were: their
            # memory is their own (never shared) and contiguous.
            _flatten({k: v for k, v in state_dict.items() if not _copied_to_save(v)})
            save_file_with(ADAPTER, state_dict, filename, meta)
        else:
            save_file(state_dict, filename, metadata=meta)
    except SharedTensorsError:
        raise
    except SerializeError as exc:
        if force_contiguous or exc.kind not in _CONTIGUITY_HINTED:
            # A meta tensor, an unstorable dtype, or a sparse tensor with the option already
            # given: the hint would mislead.
            raise
        raise SerializeError(
            f"{exc} Or use save_model(..., force_contiguous=True), read the docs for potential "
            "caveats.",
            kind=exc.kind,
            tensor=exc.tensor,
        ) from None


def _warn_stale_entries(index: str, dropped: Mapping[str, str]) -> None:
    """Warn that ``load_model`` left out index entries their shards do not hold."""
    if not dropped:
        return
    named = first_five([f"{name!r} (in {shard!r})" for name, shard in dropped.items()])
    warnings.warn(
        f"index {shown(index)} places {len(dropped)} tensor(s) in shards that do not hold them, "
        f"left out of the load: {named}",
        UserWarning,
        stacklevel=3,
    )


def load_model(
    model: torch.nn.Module,
    filename: Any,
    strict: bool = True,
    device: Any = "cpu",
    *,
    backend: str = "mmap",
) -> tuple[set[str], list[str]]:
    """Load a file into a model, restoring tied weights that :func:`save_model` dropped.

    A CPU load of a local file (not a sharded checkpoint) under ``backend="mmap"`` views a
    mapping of it, which ``load_state_dict`` copies into the model (no private copy of the
    weights besides the model's own). Any other load would first read the whole file into
    fresh memory (on the device, for ``device="cuda"``): instead the file's bytes are read
    straight into the model's own parameters and buffers where they fit (on that device, same
    dtype and shape, contiguous, loaded by torch's own code without state-dict hooks), by the
    reader threads or, on a CUDA device, through the pinned staging pipeline;
    ``load_state_dict`` then runs as usual (its copy of a tensor onto itself is skipped) and
    copies the rest. A load that is refused (a tensor the file cannot give, tensors of the
    model sharing memory) leaves the model as it was; if a read fails part way, the tensors
    read so far hold the file's values.

    Args:
        model: The model to load into.
        filename: A path, URL or binary file object; a model folder or index file loads a
            sharded checkpoint (index entries for tensors their shard does not hold are left
            out with a ``UserWarning``, as transformers loads them: see
            :meth:`~pysafetensors.ShardedSafeOpen.drop_stale_entries`).
        strict: Raise if keys are missing or unexpected (after restoring tied weights).
        device: Where the file's tensors are loaded: the model's parameters on that device
            are read in place (the CPU, or a CUDA device).
        backend: ``"mmap"`` or ``"pread"``, for the tensors not read in place.

    Returns:
        ``(missing, unexpected)``: the set of missing keys and the list of unexpected ones (the
        reference's types).

    Raises:
        RuntimeError: ``strict`` and keys are missing or unexpected.
    """
    with safe_open(filename, "pt", device=device, backend=backend) as f:
        if isinstance(f, ShardedSafeOpen):
            _warn_stale_entries(f.path, f.drop_stale_entries())
        mapped = maps_file(f, filename, backend)
        in_place = in_place_targets(model, f, device, mapped=mapped)
        if in_place:
            # Everything that can refuse the load (the other tensors' reads, every shard's
            # header, the model's shared tensors) comes before the first byte goes into the
            # model: a refused load leaves it as it was, as the reference's does.
            names = f.offset_keys()
            rest = {name: f.get_tensor(name) for name in names if name not in in_place}
            to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=names)
            f.read_into(in_place)
            state_dict = {
                name: in_place[name] if name in in_place else rest[name] for name in names
            }
        else:
            state_dict = f.get_tensors()
            to_removes = _remove_duplicate_names(
                model.state_dict(), preferred_names=state_dict.keys()
            )
    missing_list, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing_list)
    unexpected = list(unexpected)
    for group in to_removes.values():
        for name in group:
            if name not in missing:
                unexpected.append(name)
            else:
                missing.remove(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(missing)
            )
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(unexpected)
            )
        raise RuntimeError(error)
    return missing, unexpected
