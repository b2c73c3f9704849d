"""Whole pickled models (``torch.save(model)``): the state dict of a skipped ``nn.Module``.

With ``unknown="skip"`` an object of a module class is a
:class:`~._torch_policy.SkippedObject` that keeps the attributes BUILD gave it, as data. When
they are an ``nn.Module``'s (``_parameters``, ``_buffers`` and ``_modules`` dicts, and
optionally ``_non_persistent_buffers_set``), :class:`ModuleViews` gives the placeholder a
*view*: a dict shaped as ``Module.state_dict()`` fills its destination by default, the
parameters, then the persistent buffers, then the submodules (each a placeholder again,
expanded in turn under its name), None entries left out, in insertion order. Flattening the
views with dotted names then gives ``state_dict()``'s keys in its order.

Nothing of the model runs, so what a class changes in its own ``state_dict`` (state dict
hooks, a ``_save_to_state_dict`` override, ``get_extra_state``) is not honoured: the default
rule is applied to every module.
"""

from __future__ import annotations

from typing import Any, Final

from ._torch_policy import SkippedObject, TensorRef, Unconvertible, bad_checkpoint, short_text

__all__ = ["MODULE_KEYS", "ModuleViews"]

#: The attributes every ``nn.Module`` has, whose presence makes a state a module's.
MODULE_KEYS: Final = ("_parameters", "_buffers", "_modules")
#: The buffers ``state_dict()`` leaves out (``register_buffer(..., persistent=False)``).
NON_PERSISTENT: Final = "_non_persistent_buffers_set"


def _where(obj: SkippedObject) -> str:
    return f"module {obj.name} (built at byte {obj.offset} of the pickle)"


class ModuleViews:
    """The state-dict view of each module placeholder, made once per placeholder.

    Each view is a new dict of references to values the pickle built (no tensor is copied);
    making it is linear in the sizes of the module's three dicts, and each placeholder is
    viewed once however often it is reached, so all the views cost what the pickle built.
    """

    def __init__(self) -> None:
        # By id of the placeholder; the placeholder is kept with its view so that the id
        # stays its own while the entry lives.
        self._views: dict[int, tuple[SkippedObject, dict[Any, Any] | None]] = {}

    def of(self, value: Any) -> dict[Any, Any] | None:
        """The view of ``value`` when it is a placeholder whose state is an ``nn.Module``'s,
        else None.

        Raises:
            CheckpointError: The state names the three module dicts but is not a module's
                (a ``_parameters`` that is not a dict, a parameter that is not a tensor...).
        """
        if not isinstance(value, SkippedObject) or value.state is None:
            return None
        known = self._views.get(id(value))
        if known is not None:
            return known[1]
        view = _view(value) if is_module_state(value.state) else None
        self._views[id(value)] = (value, view)
        return view


def is_module_state(state: dict[Any, Any]) -> bool:
    """Whether an object's attributes name the three dicts every ``nn.Module`` has."""
    return all(key in state for key in MODULE_KEYS)


def _view(obj: SkippedObject) -> dict[Any, Any]:
    """What ``Module._save_to_state_dict`` and ``state_dict`` put under the module's prefix:
    ``{name: tensor or submodule placeholder}``."""
    assert obj.state is not None
    state = obj.state
    params, buffers, modules = (state[key] for key in MODULE_KEYS)
    for key, value in zip(MODULE_KEYS, (params, buffers, modules), strict=True):
        if type(value) is not dict:
            raise bad_checkpoint(
                f"{_where(obj)}: its {key} is a {type(value).__name__}, not a dict",
                obj.offset,
            )
    hidden = state.get(NON_PERSISTENT, frozenset())
    if type(hidden) not in (set, frozenset):
        raise bad_checkpoint(
            f"{_where(obj)}: its {NON_PERSISTENT} is a {type(hidden).__name__}, not a set",
            obj.offset,
        )
    view: dict[Any, Any] = {}
    for name, param in params.items():
        if param is not None:
            view[name] = _tensor(obj, "parameter", name, param)
    for name, buf in buffers.items():
        # A name put twice keeps its first place and takes the later value, as assigning
        # into state_dict()'s OrderedDict does (torch never registers one name twice).
        if buf is not None and name not in hidden:
            view[name] = _tensor(obj, "buffer", name, buf)
    for name, sub in modules.items():
        if sub is None:
            continue
        if name in view:
            # torch refuses a submodule named as an attribute; a name for two things cannot
            # be flattened into one state dict.
            raise bad_checkpoint(
                f"{_where(obj)}: {short_text(name)} is both a parameter or buffer and a submodule",
                obj.offset,
            )
        if not isinstance(sub, SkippedObject) or sub.state is None:
            what = (
                f"a {sub.name} object without a module's attributes (it pickles itself its own way)"
                if isinstance(sub, SkippedObject)
                else f"a {type(sub).__name__}"
            )
            raise bad_checkpoint(
                f"{_where(obj)}: its submodule {short_text(name)} is {what}, not a module",
                obj.offset,
            )
        if not is_module_state(sub.state):
            missing = [key for key in MODULE_KEYS if key not in sub.state]
            raise bad_checkpoint(
                f"{_where(obj)}: its submodule {short_text(name)} is a {sub.name} object "
                f"without {', '.join(missing)}, not a module",
                obj.offset,
            )
        view[name] = sub
    return view


def _tensor(obj: SkippedObject, what: str, name: Any, value: Any) -> Any:
    """A parameter or buffer: a tensor, one safetensors cannot hold (refused where it is
    named), or a tensor of an unknown subclass (skipped, listed where it is named)."""
    if isinstance(value, (TensorRef, Unconvertible)):
        return value
    if isinstance(value, SkippedObject) and value.state is None:
        return value
    kind = value.name if isinstance(value, SkippedObject) else type(value).__name__
    raise bad_checkpoint(
        f"{_where(obj)}: its {what} {short_text(name)} is a {kind} object, not a tensor",
        obj.offset,
    )
