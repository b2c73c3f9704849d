"""Which of a model's tensors ``load_model`` reads straight from the file into their memory.

``load_model`` used to load the file (fresh tensors, or views of a mapping) and let
``load_state_dict`` copy each into the model: the model's memory is already there, so the bytes
can go straight into it instead (one copy, no second set of tensors: no fresh host memory for
the kernel to supply and zero, no second copy of the weights on a CUDA device).
``load_state_dict`` still runs, with those tensors themselves as the values (a copy of a tensor
onto itself is skipped by torch), so its checks, key handling and post hooks are unchanged.
Only what that cannot change is read in place: models whose loading is torch's own code,
without hooks that could rename or transform the values, and without code of their own run in
the middle of the load (``set_extra_state``, post hooks below the root) that could see or
change tensors already read.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ._format import TensorInfo
from ._sharded import ShardedSafeOpen
from ._torch_adapter import ADAPTER, cuda_target, end_ptr, torch_dtype

__all__ = ["in_place_targets", "maps_file"]

#: Per-module hooks that can rename, replace or transform what is saved or loaded.
_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks")


def maps_file(handle: Any, filename: Any, backend: str) -> bool:
    """Whether a load of ``filename``, open as ``handle``, views a mapping of one local file
    (``backend="mmap"``).

    A copy out of the mapping into the model (``load_state_dict``'s) is then the only copy: it
    took as long as reading in place (2 GiB, warm: 126-135 ms against 123-152 ms), and
    leaves the weights in the page cache for the next process. Every other load reads the file
    into fresh memory first, which reading in place skips. A sharded checkpoint is read in
    place too: viewing its mappings kept every shard's pages mapped until ``load_state_dict``
    (a 1.4 GiB model in six shards peaked at 3,080 MiB of RSS, against 1,672 MiB in place and
    1,785 MiB for the reference's ``load_file`` loop over the shards, in about the same time).
    """
    if (
        backend != "mmap"
        or isinstance(handle, ShardedSafeOpen)
        or not isinstance(filename, (str, os.PathLike))
    ):
        return False
    return "://" not in os.fsdecode(os.fspath(filename))


def _torch_own(method: Any) -> bool:
    """Whether a module method is torch's own code (``torch.nn``), not a subclass's."""
    module = getattr(method, "__module__", None) or ""
    return module == "torch.nn.modules.module" or module.startswith("torch.nn.modules.")


def _plain_loading(model: torch.nn.Module) -> bool:
    """Whether ``load_state_dict`` of ``model`` only copies each value into its tensor."""
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    swap = getattr(torch.__future__, "get_swap_module_params_on_conversion", None)
    if swap is not None and swap():
        return False  # tensors are swapped for the values, not copied into
    for module in model.modules():
        kind = type(module)
        if not (
            _torch_own(kind._load_from_state_dict)
            and _torch_own(kind._save_to_state_dict)
            and kind.state_dict is torch.nn.Module.state_dict
            # A module's own code that runs in the middle of the load (its extra state is set
            # after its tensors, before its children's; a post hook runs after its subtree,
            # before the next sibling's) could see or change tensors that, read in place,
            # already hold the file's values: the copy that would have overwritten its
            # changes is skipped. The root's post hooks run last, after every copy.
            and kind.set_extra_state is torch.nn.Module.set_extra_state
        ):
            return False
        if any(getattr(module, hooks, None) for hooks in _HOOKS):
            return False
        if module is not model and getattr(module, "_load_state_dict_post_hooks", None):
            return False
    return True


def _fits(tensor: Any, info: TensorInfo, where: torch.device) -> bool:
    """Whether ``info``'s bytes, as they are in the file, are ``tensor``'s memory exactly, on
    the device loaded to."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.device == where
        and tensor.numel() > 0
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not info.dtype.bits % 8
        and tuple(tensor.shape) == info.shape
        and tensor.dtype == torch_dtype(info.dtype)
    )


def _apart(
    fitting: dict[str, torch.Tensor], named: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``fitting`` less any whose memory overlaps another tensor of ``named`` (every model
    tensor the file names, fitting or not): ``load_state_dict`` copies the names of one tied
    weight in its own order, the last one's values winning, as they would have been. Checked
    among the fitting ones alone, a tied weight's fitting name was read in place and its other
    name (another dtype in the file) copied over it afterwards: the first name's values won.
    """
    spans = sorted(
        (str(t.device), t.data_ptr(), end_ptr(t), name) for name, t in named.items() if t.numel()
    )
    shared: set[str] = set()
    device, reach, holder = "", -1, ""
    for where, begin, end, name in spans:
        if where != device:
            device, reach, holder = where, -1, ""
        if begin < reach:
            shared.update((name, holder))
        if end > reach:
            reach, holder = end, name
    return {name: t for name, t in fitting.items() if name not in shared}


def _device_loaded_to(device: Any) -> torch.device | None:
    """The torch device of ``load_model``'s ``device``: the CPU, or a CUDA device with its
    index (parameters' devices have one); None for others (no staging to them)."""
    parsed = ADAPTER.check_device(device)
    if parsed.type == "cpu":
        return torch.device("cpu")
    where = cuda_target(parsed)
    if where is None:
        return None
    if where.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return where  # type: ignore[no-any-return]


def in_place_targets(
    model: torch.nn.Module, handle: Any, device: Any, *, mapped: bool = False
) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers that the file's tensors of the same names can be
    read straight into: on the device loaded to, contiguous, of the file's dtype and shape,
    and loaded by torch's own code (see the module's docstring). Empty when none can.

    Args:
        model: The model being loaded.
        handle: The open file (``safe_open``, or a sharded checkpoint's handle).
        device: ``load_model``'s device: the CPU, or a CUDA device (through the pinned
            staging pipeline; a load would otherwise hold a second copy of the weights on the
            device until ``load_state_dict`` has copied them).
        mapped: The load would view a mapping of the file (see :func:`maps_file`): a CPU
            load then copies out of it instead.
    """
    if sys.byteorder != "little":
        return {}
    where = _device_loaded_to(device)
    if where is None or (mapped and where.type == "cpu") or not _plain_loading(model):
        return {}
    own = model.state_dict(keep_vars=True)
    # Only entries that are the parameters and buffers themselves (not a module's extra state,
    # which load_state_dict hands to set_extra_state).
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    names = [
        name
        for name in handle.keys()  # noqa: SIM118 - a handle, not a dict
        if name in own
        and own[name] is tensors.get(name)
        # Sparse and mkldnn tensors have no plain memory (data_ptr raises): left to
        # load_state_dict, whose error names them after the others are loaded.
        and own[name].layout == torch.strided
    ]
    infos = dict(zip(names, handle._infos(names), strict=True))
    fitting = {name: own[name] for name in names if _fits(own[name], infos[name], where)}
    return _apart(fitting, {name: own[name] for name in names})
