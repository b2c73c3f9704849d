"""The torch globals a checkpoint's pickle may name, and what each stands for.

:class:`TorchPolicy` is the policy :mod:`._pickle_vm` runs a checkpoint's object pickle under:
a fixed table of globals (dtypes, storage classes, ``OrderedDict``, ``torch.Size``,
``torch.device``, the tensor rebuild functions), each mapped to an inert :class:`Stand`. REDUCE
on a stand-in dispatches to this module's handler for that exact name; any other global raises
:class:`~pysafetensors._errors.UnsafePickleError` naming it and its byte offset. Tensors come
out as :class:`TensorRef`, checked into :class:`TensorRecord` by :mod:`._torch_pickle`. The
tables are shared with the scanner (:mod:`pysafetensors.scan`), which grades the same names.

With ``skip_unknown``, a global outside the table that the scanner does not grade
``dangerous`` (a user's ``__main__.Config``, an ``argparse.Namespace``) becomes a
:class:`SkippedObject` instead of an error: an inert placeholder naming it. Calling it, building
it or filling it keeps the placeholder and drops the arguments, never calling anything; tensors
built inside those arguments are not reached from the state dict, so they are not converted.
The one thing a placeholder keeps is the dict state BUILD gives it (an object's attributes), as
inert data: a whole pickled ``nn.Module`` is converted from it (:mod:`._torch_modules`). A
``dangerous`` global is refused in either mode.
"""

from __future__ import annotations

import _compat_pickle
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ._dtypes import DType
from ._errors import CheckpointError, UnsafePickleError
from ._numpy_arrays import fill_array, new_array
from ._pickle_vm import Budget, Limits, Machine

__all__ = [
    "NumpyDtype",
    "SkippedObject",
    "Stand",
    "StorageRef",
    "TensorRecord",
    "TensorRef",
    "TorchPolicy",
    "Unconvertible",
]

#: The legacy (pre-zip) format's first pickle: this number as a LONG1.
LEGACY_MAGIC: Final = 0x1950A86A20F9469CFC6C
#: Opcodes the magic number's pickle takes at most (PROTO, FRAME, LONG1, STOP; the text
#: protocols' LONG, STOP): a first pickle that runs longer is not it, whatever follows.
LEGACY_MAGIC_OPS: Final = 16

#: Largest number of dimensions of one tensor.
MAX_NDIM: Final = 64
#: Largest dimension, stride or offset accepted (beyond any real file).
MAX_DIM: Final = 1 << 62
# torch dtype attribute name -> (safetensors code or None, itemsize in bytes, why unsupported).
TORCH_DTYPES: Final[dict[str, tuple[str | None, int]]] = {
    "float32": ("F32", 4), "float": ("F32", 4), "float64": ("F64", 8), "double": ("F64", 8),
    "float16": ("F16", 2), "half": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "long": ("I64", 8), "int32": ("I32", 4), "int": ("I32", 4),
    "int16": ("I16", 2), "short": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "bool": ("BOOL", 1), "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8),
    "complex64": ("C64", 8), "cfloat": ("C64", 8),
    "float8_e5m2": ("F8_E5M2", 1), "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1), "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e8m0fnu": ("F8_E8M0", 1), "float4_e2m1fn_x2": ("F4", 1),
    # Known to torch, not representable in safetensors: refused when a tensor uses them.
    "complex128": (None, 16), "cdouble": (None, 16), "complex32": (None, 4),
    "chalf": (None, 4), "qint8": (None, 1), "quint8": (None, 1), "qint32": (None, 4),
    "quint4x2": (None, 1), "quint2x4": (None, 1), "bits1x8": (None, 1), "bits2x4": (None, 1),
    "bits4x2": (None, 1), "bits8": (None, 1), "bits16": (None, 2),
    **{f"int{i}": (None, 1) for i in range(1, 8)},
    **{f"uint{i}": (None, 1) for i in range(1, 8)},
}  # fmt: skip

# Legacy typed storage classes -> torch dtype name.
STORAGE_CLASSES: Final[dict[str, str]] = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8", "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip

REBUILDS: Final = {
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
}
#: Names that ``setattr`` on a tensor or Parameter hands to torch rather than the instance's
#: ``__dict__`` (the data descriptors of ``torch.nn.Parameter``'s classes, torch 2.13). torch
#: applies a pickled tensor state key by key with ``setattr`` (``_set_obj_state``), so a state
#: naming ``data`` replaces the tensor ``torch.load`` returns, and ``real`` or ``imag`` writes
#: into it: the file a converter writes would hold other values than the ones torch loads.
#: A real state is the tensor's ``__dict__``, which ``setattr`` never fills with these names.
TENSOR_SETTERS: Final = frozenset(
    """H T __class__ __cuda_array_interface__ __dict__ __weakref__ _backward_hooks _base _cdata
    _grad _grad_fn _has_symbolic_sizes_strides _post_accumulate_grad_hooks _python_dispatch
    _version data device dtype grad grad_dtype grad_fn imag is_cpu is_cuda is_ipu is_leaf
    is_maia is_meta is_mkldnn is_mps is_mtia is_nested is_quantized is_sparse is_sparse_csr
    is_vulkan is_xla is_xpu itemsize layout mH mT name names nbytes ndim output_nr real
    requires_grad retains_grad shape volatile""".split()  # noqa: SIM905 - a word list reads better as text
)


def state_setter(state: Any) -> str | None:
    """The first key of a pickled tensor state (a dict, or a ``(dict, slots dict)`` pair)
    that ``setattr`` would not store as a plain attribute (:data:`TENSOR_SETTERS`, or not a
    text), shown as text; None where every key is a plain attribute name or ``state`` is not
    such a state."""
    parts = state if type(state) is tuple else (state,)
    for part in parts:
        if type(part) is dict:
            for key in part:
                if type(key) is not str or key in TENSOR_SETTERS:
                    return repr(key)[:80]
    return None


# Allowed by torch's weights_only unpickler but carrying nothing a safetensors file can hold.
UNCONVERTIBLE: Final = {
    ("torch._utils", "_rebuild_qtensor"): "quantized tensors",
    ("torch._utils", "_rebuild_sparse_tensor"): "sparse tensors",
    ("torch._utils", "_rebuild_sparse_csr_tensor"): "sparse tensors",
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): "meta tensors (no data)",
    ("torch._utils", "_rebuild_wrapper_subclass"): "tensor subclasses (no data)",
    ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): "device tensors",
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): "device tensors from numpy",
    ("torch._utils", "_rebuild_nested_tensor"): "nested tensors",
    ("torch._utils", "_rebuild_mkldnn_tensor"): "mkldnn tensors",
}
# Python 2 module names pickles may carry, mapped as pickle's own compat table does.
_PY2_MODULES: Final = {"__builtin__": "builtins", "copy_reg": "copyreg"}


@dataclass(frozen=True, slots=True)
class Stand:
    """An inert stand-in for an allowed global; REDUCE dispatches on ``kind``."""

    kind: str
    name: str


#: One stand-in per unconvertible global, named by its full name; what each builds, by that name.
_UNCONVERTIBLE_STANDS: Final = {
    key: Stand("unconvertible", f"{key[0]}.{key[1]}") for key in UNCONVERTIBLE
}
_UNCONVERTIBLE_WHAT: Final = {f"{m}.{n}": what for (m, n), what in UNCONVERTIBLE.items()}


@dataclass(frozen=True, slots=True, eq=False)
class Unconvertible:
    """A tensor safetensors cannot hold (sparse, quantized, meta...), built by the pickle: kept
    as a placeholder so that the refusal can name where it sits in the state dict."""

    what: str
    """What it is, e.g. ``sparse tensors``."""
    rebuild: str
    """The global that built it."""
    offset: int
    """Where in the pickle it was built."""

    def refusal(self, name: str | None) -> CheckpointError:
        """The error refusing it, naming the entry when known."""
        where = (
            f"{name!r} is one of the {self.what}" if name else f"the checkpoint holds {self.what}"
        )
        return CheckpointError(
            f"{where} ({self.rebuild}, built at byte {self.offset}), which safetensors cannot "
            "store",
            kind="CheckpointError",
            offset=self.offset,
            tensor=name,
        )


#: How protocol 0 and 1 pickles build a plain object of a class (``copyreg.__reduce_ex__``).
_RECONSTRUCTOR: Final = "copyreg._reconstructor"


@dataclass(slots=True, eq=False)
class SkippedObject:
    """An object of a global the converter does not know, kept as an inert placeholder
    (``skip_unknown``): the global itself, or what calling or building it would have made."""

    name: str
    """The global's ``module.name``, as the unpickler would import it."""
    offset: int
    """Where in the pickle it was named or called."""
    state: dict[Any, Any] | None = None
    """The attributes BUILD gave an object of the class (its ``__dict__``, with its slots),
    kept as the data they are: where a whole pickled ``nn.Module`` holds its parameters
    (:mod:`._torch_modules`). None for the global itself and for objects never built."""


#: numpy dtypes decoded into real values, as ``numpy.dtype.__reduce__`` writes them (bool,
#: integers, floats, complex numbers; ``f16``/``c32`` are platform-dependent long doubles).
NUMPY_CODES: Final = frozenset(
    {"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"}
)


class NumpyDtype:
    """A pickled ``numpy.dtype`` of :data:`NUMPY_CODES`.

    Mutable, as numpy's is: the pickle memoizes the dtype between its REDUCE and its BUILD
    (which sets the byte order), so later references to it are this very object.
    """

    __slots__ = ("code", "order")

    def __init__(self, code: str) -> None:
        self.code = code
        self.order = "="

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype (made from the whitelisted code: nothing else is looked up)."""
        dtype: np.dtype[Any] = np.dtype(self.code)
        if self.order == "<":
            dtype = dtype.newbyteorder("<")
        elif self.order == ">":
            dtype = dtype.newbyteorder(">")
        return dtype


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage declared by a persistent id."""

    key: str
    """Record key (``data/<key>`` in a zip, an entry of the key list in legacy files)."""
    dtype: str
    """torch dtype name of its elements (``uint8`` for untyped storages)."""
    numel: int
    """Elements of ``dtype`` (bytes for untyped storages)."""
    view_offset: int = 0
    """Legacy storage views: first element of the view in the root storage."""
    view_size: int = -1
    """Legacy storage views: elements in the view (-1: the whole storage)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the root storage."""
        return self.numel * TORCH_DTYPES[self.dtype][1]


@dataclass(slots=True)
class TensorRef:
    """A tensor as the pickle describes it, before naming and checking against the files."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    neg: bool = False
    conj: bool = False


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor of a checkpoint, checked, with nothing read yet."""

    dtype: DType
    """safetensors dtype."""
    shape: tuple[int, ...]
    """safetensors shape (for F4 the last torch dimension doubled)."""
    torch_dtype: str
    """torch dtype name."""
    torch_shape: tuple[int, ...]
    """torch's size."""
    stride: tuple[int, ...]
    """Strides in elements."""
    storage_key: str
    """Which storage."""
    storage_offset: int
    """Offset of element 0 in the storage, in elements."""
    itemsize: int
    """Bytes per torch element."""
    storage_nbytes: int
    """Bytes of the whole storage."""
    neg: bool = False
    """Values are negated (torch's lazy neg bit)."""
    conj: bool = False
    """Values are conjugated (torch's lazy conj bit)."""

    @property
    def numel(self) -> int:
        """Number of torch elements."""
        return math.prod(self.torch_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the contiguous result."""
        return self.numel * self.itemsize

    @property
    def span(self) -> tuple[int, int]:
        """Byte range of the storage this tensor touches (start, stop); empty when numel is 0."""
        start = self.storage_offset * self.itemsize
        if self.numel == 0:
            return start, start
        last = sum((s - 1) * st for s, st in zip(self.torch_shape, self.stride, strict=False))
        return start, start + (last + 1) * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements are laid out row-major without gaps."""
        expected = 1
        for s, st in zip(reversed(self.torch_shape), reversed(self.stride), strict=False):
            if s != 1 and st != expected:
                return False
            expected *= s
        return True

    @property
    def is_complete(self) -> bool:
        """Whether it starts at its storage's start and covers all of it (reference rule)."""
        return self.storage_offset == 0 and self.nbytes == self.storage_nbytes


def policy_machine(
    data: bytes, policy: TorchPolicy, limits: Limits | None, base: int = 0
) -> Machine:
    """A machine over ``data`` whose budget ``policy``'s calls charge too."""
    machine = Machine(data, policy, limits, base=base)
    policy.budget = machine.budget
    return machine


def unsafe_global(
    message: str, name: str | None, offset: int, *, skippable: bool = False
) -> UnsafePickleError:
    return UnsafePickleError(
        f"{message} (at byte {offset} of the pickle)",
        global_name=name,
        kind="UnsafePickle",
        offset=offset,
        skippable=skippable,
    )


def py2_name(module: str, name: str) -> tuple[str, str]:
    """The name CPython's ``Unpickler.find_class`` imports for a protocol 0-2 pickle.

    With ``fix_imports`` (the default, and what ``torch.load`` uses) and ``proto < 3`` it maps
    Python 2 names through ``_compat_pickle``: ``commands.getoutput`` is
    ``subprocess.getoutput``, ``cPickle.loads`` is ``pickle.loads``.
    """
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def bad_checkpoint(message: str, offset: int | None = None) -> CheckpointError:
    return CheckpointError(message, kind="CheckpointError", offset=offset)


def is_int(x: Any) -> bool:
    return type(x) is int


def check_ints(value: Any, what: str, offset: int) -> tuple[int, ...]:
    if type(value) is not tuple or not all(is_int(v) for v in value):
        raise bad_checkpoint(f"tensor {what} is not a tuple of ints (at byte {offset})", offset)
    if len(value) > MAX_NDIM:
        raise bad_checkpoint(
            f"tensor has {len(value)} dimensions, over the {MAX_NDIM} limit", offset
        )
    for v in value:
        if v < 0 or v > MAX_DIM:
            raise bad_checkpoint(
                f"tensor {what} {list(value)} has a negative or absurd entry", offset
            )
    return value


def _empty_hooks(hooks: Any, offset: int) -> None:
    # Non-empty backward hooks would be pickled callables; an OrderedDict arrives as a dict.
    if hooks is not None and not (type(hooks) is dict and not hooks):
        raise bad_checkpoint("tensor has backward hooks (pickled callables); refusing", offset)


class TorchPolicy:
    """The converter's policy: a fixed table of globals, each an inert stand-in.

    Args:
        legacy: Accept the legacy format's 6-tuple persistent ids (with storage views).
        skip_unknown: Make a global outside the table that is not graded ``dangerous`` a
            :class:`SkippedObject` instead of refusing it.
    """

    def __init__(self, *, legacy: bool = False, skip_unknown: bool = False) -> None:
        self.legacy = legacy
        self.skip_unknown = skip_unknown
        self.skipped: dict[str, SkippedObject] = {}
        """The placeholder of each unknown global named so far, by ``module.name`` (one each:
        a STACK_GLOBAL of two memo strings is five bytes of the stream)."""
        self.protocol = 0
        """The stream's protocol so far (below 3, Python 2 names are imported as Python 3's)."""
        self.storages: dict[str, StorageRef] = {}
        self.tensors: list[TensorRef] = []
        self.views: dict[str, StorageRef] = {}
        """Legacy storage views by view key (torch builds each once, see :meth:`persistent`)."""
        self.first_unconvertible: Unconvertible | None = None
        """The first tensor built that safetensors cannot hold, refused by :func:`_records`."""
        self.arrays: dict[int, np.ndarray[Any, Any]] = {}
        """numpy arrays made by ``_reconstruct`` and not yet given their state, by id."""
        self.encoded: dict[int, str] = {}
        """Every text ``_codecs.encode`` encoded so far, by id (see ``_h_encode``)."""
        self.array_data: dict[int, bytes] = {}
        """The data of every array filled so far, by id (a second array from the same bytes
        is charged as a copy: see :meth:`build_array`)."""
        self.array_placeholders: dict[int, tuple[np.ndarray[Any, Any], SkippedObject]] = {}
        """Arrays of a dtype not decoded (skip mode), by id, with their placeholder, which
        replaces them wherever the pickle put them (see :func:`._numpy_arrays.substitute`)."""
        self.budget = Budget(Limits(), self)
        """What the calls build is charged here: the budget of the machine running the
        stream (bound by :func:`policy_machine`)."""

    # -- globals ---------------------------------------------------------------------------
    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        """Map an allowed global to its stand-in; skip or refuse every other."""
        module = _PY2_MODULES.get(module, module)
        full = f"{module}.{name}"
        # Classes of the script that saved the checkpoint are pickled as __main__.Name: an
        # unknown class like any other, not a dunder lookup (a dunder *name* still is one).
        dunder_module = module != "__main__" and any(p.startswith("__") for p in module.split("."))
        dotted = "." in name or name.startswith("__") or dunder_module
        # An unconvertible rebuild's stand is refused where a name is known (see
        # Unconvertible), or at the end.
        stand = (
            None
            if dotted
            else lookup_global(module, name) or _UNCONVERTIBLE_STANDS.get((module, name))
        )
        if stand is None:
            return self._unknown_global(module, name, offset, opcode, dotted)
        if opcode in ("INST", "OBJ"):
            raise unsafe_global(f"{opcode} opcode calling {full}", full, offset)
        return stand

    def _unknown_global(
        self, module: str, name: str, offset: int, opcode: str, dotted: bool
    ) -> SkippedObject:
        """A global outside the table: its placeholder when skipping and the scanner does not
        grade it dangerous (the one grading both share); otherwise refused."""
        from .scan import grade_pickled_global  # the scanner imports this module

        full = f"{module}.{name}"
        skippable = grade_pickled_global(module, name, self.protocol) != "dangerous"
        if skippable and self.skip_unknown:
            if self.protocol < 3:
                module, name = py2_name(module, name)  # what the unpickler would import
                full = f"{module}.{name}"
            known = self.skipped.get(full)
            if known is None:
                self.budget.grow(1, 0, offset)
                known = self.skipped[full] = SkippedObject(full, offset)
            return known
        if opcode in ("INST", "OBJ"):
            raise unsafe_global(
                f"{opcode} opcode calling {full}", full, offset, skippable=skippable
            )
        if dotted and not skippable:
            # Unpicklers resolve a dotted name attribute by attribute (a way from an allowed
            # function to builtins.eval); the table is matched exactly, but refuse outright so
            # no future table entry or normalisation can ever match one. The few dunder names
            # the scanner does not grade dangerous (numpy's RNG pickling helpers) are ordinary
            # unknown globals: refused as such, with the skip hint they used to lack.
            raise unsafe_global(f"global {full} uses a dotted or dunder name", full, offset)
        raise unsafe_global(
            f"global {full} is not on the allow-list", full, offset, skippable=skippable
        )

    def skip_call(self, func: SkippedObject, offset: int, args: Any = None) -> SkippedObject:
        """What calling (or building) a placeholder makes: another placeholder of the same
        name. The arguments are dropped: nothing is called, no tensor in them is converted.

        A protocol 0 or 1 pickle builds a plain object as ``copyreg._reconstructor(cls,
        object, None)``: its placeholder is named after ``cls`` when that is a placeholder too,
        as the class is what a report of it should name (protocol 2 names it directly)."""
        self.budget.grow(1, 0, offset)
        if (
            func.name == _RECONSTRUCTOR
            and type(args) is tuple
            and args
            and isinstance(args[0], SkippedObject)
        ):
            return SkippedObject(args[0].name, offset)
        return SkippedObject(func.name, offset)

    def skip_value(self, name: str, message: str, offset: int) -> SkippedObject:
        """A value of a known global that the converter does not decode (a numpy dtype of
        strings, say): a placeholder when skipping, else refused as skippable."""
        if not self.skip_unknown:
            raise unsafe_global(message, name, offset, skippable=True)
        self.budget.grow(1, 0, offset)
        self.skipped.setdefault(name, SkippedObject(name, offset))
        return SkippedObject(name, offset)

    def built_tensors(self) -> set[int]:
        """ids of the tensors the pickle built (each one, however often it is named)."""
        return {id(ref) for ref in self.tensors}

    def unconvertible(self, func: Stand, offset: int) -> Unconvertible:
        """What a call of an unconvertible rebuild (sparse, quantized...) stands for."""
        value = Unconvertible(_UNCONVERTIBLE_WHAT[func.name], func.name, offset)
        if self.first_unconvertible is None:
            self.first_unconvertible = value
        return value

    def bad_stack_global(self, module: Any, name: Any, offset: int) -> Any:
        """STACK_GLOBAL with computed, non-string operands: always refused."""
        raise unsafe_global(
            f"STACK_GLOBAL with non-string operands {type(module).__name__}/{type(name).__name__}",
            None,
            offset,
        )

    # -- calls -----------------------------------------------------------------------------
    def reduce(self, func: Any, args: Any, offset: int, opcode: str) -> Any:
        """Dispatch a call on a stand-in to our own handler for that exact name."""
        if isinstance(func, SkippedObject):
            return self.skip_call(func, offset, args)
        if not isinstance(func, Stand):
            raise unsafe_global(f"{opcode} on a non-callable {type(func).__name__}", None, offset)
        if opcode in ("NEWOBJ_EX", "INST", "OBJ") or (
            opcode == "NEWOBJ" and func.kind not in ("odict", "set")
        ):
            raise unsafe_global(f"{opcode} on {func.name}", func.name, offset)
        handler = _HANDLERS.get(func.kind)
        if handler is None:
            raise unsafe_global(f"{func.name} is not callable", func.name, offset)
        # Every call builds something (a tensor record, a copy): a call of values from the memo
        # is five bytes of the stream, so count its result as the machine counts containers.
        self.budget.grow(1, 0, offset)
        # A Parameter of a sparse tensor is a tensor safetensors cannot hold, too.
        if (
            func.kind == "rebuild"
            and type(args) is tuple
            and args
            and isinstance(args[0], Unconvertible)
        ):
            return args[0]
        return handler(self, func, args, offset)

    def build(self, obj: Any, state: Any, offset: int) -> Any:
        """BUILD: accepted (and ignored) only on dicts, e.g. an OrderedDict's ``_metadata``,
        and on placeholders (which keep a dict state as data, see :meth:`_keep_state`); a numpy
        dtype's sets its byte order, a numpy array's its shape, dtype and data."""
        if type(obj) is dict and (state is None or type(state) in (dict, tuple)):
            return obj
        if isinstance(obj, SkippedObject):
            self._keep_state(obj, state, offset)
            return obj
        if isinstance(obj, NumpyDtype):
            _numpy_dtype_state(obj, state, offset)
            return obj
        if type(obj) is np.ndarray:
            return self.build_array(obj, state, offset)
        if isinstance(obj, (TensorRef, Unconvertible)) and (
            state is None or state == {} or state == ((), {})
        ):
            return obj
        if isinstance(obj, Stand):
            raise unsafe_global(f"BUILD changes the attributes of {obj.name}", obj.name, offset)
        raise unsafe_global(f"BUILD on {type(obj).__name__}", None, offset)

    def _keep_state(self, obj: SkippedObject, state: Any, offset: int) -> None:
        """Keep the attributes BUILD gives an object of an unknown class, as data.

        Only what ``object.__setstate__`` would set is kept: a dict (the ``__dict__``), or a
        ``(dict or None, slots dict)`` pair, copied at BUILD into one dict as the attributes
        they become (a second BUILD on the same object adds to them), each copy charged to
        the budget. Nothing is called and nothing new is reachable: every value was already built
        by the machine from allowed globals or is another placeholder. Any other state (what
        a class's own ``__setstate__`` would read) is dropped, as is a state given to the
        global itself (the placeholder every reference to the class shares).
        """
        if obj is self.skipped.get(obj.name):
            return
        if type(state) is dict:
            parts: tuple[dict[Any, Any], ...] = (state,)
        elif (
            type(state) is tuple
            and len(state) == 2
            and (state[0] is None or type(state[0]) is dict)
            and type(state[1]) is dict
        ):
            parts = tuple(p for p in state if p is not None)
        else:
            return
        # Always a copy, made now: BUILD copies the state into the object's __dict__ (CPython's
        # and nn.Module's __setstate__ alike), so a SETITEMS on the memoised state dict after
        # BUILD changes nothing torch.load returns. Keeping the pickle's own dict made the
        # converter see those later items (another tensor under the same name).
        merged: dict[Any, Any] = {}
        for part in (obj.state or {}, *parts):
            self.budget.grow(0, len(part), offset)
            merged.update(part)  # keys already hashed by the machine
        self.budget.grow(1, 0, offset)
        obj.state = merged

    def build_array(self, obj: np.ndarray[Any, Any], state: Any, offset: int) -> Any:
        """Fill an array that ``_reconstruct`` made with its ``(1, shape, dtype, is_fortran,
        rawdata)`` state (see :mod:`._numpy_arrays`), once.

        numpy keeps the data's ``bytes`` or copies it (small, unaligned or byte-swapped
        arrays): at most the size of a ``bytes`` object that the stream holds or a call made,
        both bounded already. Arrays filled from one ``bytes`` object of the memo are five
        bytes of the stream each, so every use after the first is charged as a copy.
        """
        if self.arrays.pop(id(obj), None) is not obj:
            raise bad_checkpoint(
                f"BUILD on a numpy array that already has its state (at byte {offset})", offset
            )
        if type(state) is not tuple or len(state) != 5:
            raise bad_checkpoint(
                f"numpy array state {short_text(state)} is not (version, shape, dtype, "
                f"is_fortran, data) (at byte {offset})",
                offset,
            )
        dtype = state[2]
        if isinstance(dtype, SkippedObject):
            # A dtype not decoded (objects, strings, records): skip mode only, the dtype itself
            # was refused otherwise.
            placeholder = self.skip_value("numpy.ndarray", "numpy array of a skipped dtype", offset)
            self.array_placeholders[id(obj)] = (obj, placeholder)  # kept alive: its id is key
            return obj
        if not isinstance(dtype, NumpyDtype):
            raise bad_checkpoint(
                f"numpy array state with the dtype {short_text(dtype)} (at byte {offset})", offset
            )
        raw = state[4]
        if type(raw) is bytes:
            if id(raw) in self.array_data:
                self.budget.copy(len(raw), offset)
            else:
                self.array_data[id(raw)] = raw
        fill_array(obj, state, dtype.dtype, offset, short_text)
        return obj

    def persistent(self, pid: Any, offset: int, opcode: str) -> Any:
        """Turn ``("storage", type, key, location, numel[, view])`` into a StorageRef (and in
        the legacy format, ``("module", class, source file, source)`` into the class)."""
        if self.legacy and type(pid) is tuple and len(pid) == 4 and pid[0] == "module":
            return module_class(pid, pid[1:], offset)
        if opcode != "BINPERSID":
            # torch.save(..., pickle_protocol=0) writes them (str() of the storage tuple),
            # and torch.load refuses them too ("saved_id must be a tuple").
            raise bad_checkpoint(
                "text persistent ids (PERSID, written by torch.save with pickle_protocol=0) "
                "do not name a storage; torch.load cannot read them either",
                offset,
            )
        arity = 6 if self.legacy else 5
        if type(pid) is not tuple or len(pid) != arity or pid[0] != "storage":
            raise bad_checkpoint(
                f"unknown persistent id {short_text(pid)} (at byte {offset})", offset
            )
        stype, key, location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(stype, Stand) or stype.kind != "storage":
            raise bad_checkpoint(f"persistent id names no storage type (at byte {offset})", offset)
        if type(key) is not str or not key.isascii() or not key.isdigit() or len(key) > 40:
            raise bad_checkpoint(f"storage key {short_text(key)} is not a decimal string", offset)
        if type(location) is not str:
            raise bad_checkpoint("storage location is not a string", offset)
        if not is_int(numel) or numel < 0 or numel > MAX_DIM:
            raise bad_checkpoint(
                f"storage {key}: element count {short_text(numel)} is invalid", offset
            )
        ref = StorageRef(key, stype.name, numel)
        known = self.storages.get(key)
        if known is None:
            if key in self.views:
                raise bad_checkpoint(f"storage key {key} is also the key of a storage view", offset)
            self.storages[key] = ref
        elif known != ref:
            raise bad_checkpoint(
                f"storage {key} declared twice with different type or size", offset
            )
        else:
            ref = known  # the same object each time: repeated ids build nothing
        if self.legacy and pid[5] is not None:
            view = pid[5]
            if (
                type(view) is not tuple
                or len(view) != 3
                or type(view[0]) is not str
                or not all(is_int(v) and 0 <= v <= MAX_DIM for v in view[1:])
                or view[1] + view[2] > numel
            ):
                raise bad_checkpoint(f"invalid legacy storage view {short_text(view)}", offset)
            # torch's legacy persistent_load builds a view once per view key and hands that
            # same view to every later id naming the key, whatever offset and size they say.
            # Do the same (rebuilding each from its own offset wrote other values than
            # torch.load returns). A view key that is also a storage key is ambiguous there
            # (one table holds both): refused.
            cached = self.views.get(view[0])
            if cached is not None:
                return cached
            if view[0] in self.storages:
                raise bad_checkpoint(
                    f"storage view key {short_text(view[0])} is also a storage key", offset
                )
            self.budget.grow(1, 0, offset)
            made = self.views[view[0]] = StorageRef(key, stype.name, numel, view[1], view[2])
            return made
        return ref

    # -- everything else is refused --------------------------------------------------------
    def extension(self, code: int, offset: int) -> Any:
        """EXT opcodes resolve globals through the copyreg registry: refused."""
        raise unsafe_global(f"extension code {code} (EXT opcode)", None, offset)

    def buffer(self, offset: int, opcode: str) -> Any:
        """Out-of-band buffers: torch never writes them."""
        raise bad_checkpoint(f"{opcode}: out-of-band pickle buffers are not supported", offset)

    def mutate(self, target: Any, opcode: str, items: list[Any], offset: int) -> None:
        """Only real lists, dicts and sets may be filled (and placeholders, which drop the
        items: a skipped dict or list subclass)."""
        if isinstance(target, SkippedObject):
            return
        raise unsafe_global(f"{opcode} into {type(target).__name__}", None, offset)

    def unhashable(self, key: Any, offset: int) -> Any:
        """A key that cannot be hashed is malformed input."""
        raise bad_checkpoint(f"unhashable dict key of type {type(key).__name__}", offset)

    def text(self, raw: bytes, offset: int) -> Any:
        """py2 strings decode as torch decodes them: UTF-8."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_checkpoint("py2 string is not valid UTF-8", offset) from None

    def notice(self, message: str, offset: int) -> None:
        """Anything odd in the stream structure is refused (torch never writes it)."""
        raise bad_checkpoint(f"pickle: {message} at byte {offset}", offset)

    def proto(self, protocol: int, offset: int) -> None:
        """Allowed names are matched as written; unknown ones are graded (and skipped) as the
        unpickler would import them, which depends on the protocol."""
        self.protocol = protocol

    # -- rebuilds --------------------------------------------------------------------------
    def make_tensor(
        self, args: tuple[Any, ...], dtype: str | None, metadata: Any, at: int
    ) -> TensorRef:
        """Check a rebuild call's ``(storage, offset, size, stride)`` and record the tensor."""
        storage, offset, size, stride = args
        if not isinstance(storage, StorageRef):
            raise bad_checkpoint(
                f"tensor rebuilt from a {type(storage).__name__}, not a storage", at
            )
        if not is_int(offset) or offset < 0 or offset > MAX_DIM:
            raise bad_checkpoint(f"tensor storage offset {short_text(offset)} is invalid", at)
        size_t = check_ints(size, "size", at)
        stride_t = check_ints(stride, "stride", at)
        if len(size_t) != len(stride_t):
            raise bad_checkpoint(
                f"tensor size {list(size_t)} and stride {list(stride_t)} differ in length"
            )
        tdtype = dtype or storage.dtype
        if dtype is not None and storage.dtype != "uint8":
            # v3 carries the dtype separately and always uses untyped (byte) storages.
            raise bad_checkpoint("_rebuild_tensor_v3 on a typed storage", at)
        neg = conj = False
        if metadata is not None:
            if type(metadata) is not dict or not all(
                k in ("neg", "conj", "requires_grad") and type(v) is bool
                for k, v in metadata.items()
            ):
                raise bad_checkpoint(f"unsupported tensor metadata {short_text(metadata)}", at)
            # As torch sets them: a key that is there counts, whatever its value.
            neg, conj = "neg" in metadata, "conj" in metadata
        ref = TensorRef(storage, offset + storage.view_offset, size_t, stride_t, tdtype, neg, conj)
        self.tensors.append(ref)
        return ref


def module_class(pid: tuple[Any, ...], parts: tuple[Any, ...], offset: int) -> SkippedObject:
    """The class of a module persistent id ``pid``, whose ``parts`` are ``(class, source
    file, source)``: the legacy format's ``("module", class, source file, source)``, the tar
    format's ``(class, source file, source)``.

    Those formats name each ``nn.Module`` class of a whole pickled model this way the first
    time it occurs, with its source code (which torch only compares with the class's current
    source, to warn). A module class is unknown to the converter: the class is already a
    placeholder in skip mode and refused before this in the other, so this only hands the
    placeholder on.
    """
    cls, source_file, source = parts
    if (
        not isinstance(cls, SkippedObject)
        or not (source_file is None or type(source_file) is str)
        or not (source is None or type(source) is str)
    ):
        raise bad_checkpoint(
            f"module persistent id {short_text(pid)} does not name a module class "
            f"(at byte {offset})",
            offset,
        )
    return cls


def short_text(value: Any) -> str:
    # repr of hostile values can be huge, deeply nested or share parts many times over (a
    # tuple doubled 40 times is 2**40 items to print): render a bounded outline instead.
    text = _outline(value, 3)
    return text if len(text) <= 80 else text[:77] + "..."


def _outline(value: Any, levels: int) -> str:
    """``repr(value)`` for small values; at most 8 items per container, ``levels`` deep."""
    kind = type(value)
    if kind in (str, bytes, bytearray):
        return repr(value[:80]) + ("..." if len(value) > 80 else "")
    if value is None or kind in (bool, float, complex):
        return repr(value)
    if kind is int:
        return repr(value) if value.bit_length() <= 256 else "<int>"
    if isinstance(value, (tuple, list, set, frozenset, dict)):
        if levels <= 0:
            return "..."
        if isinstance(value, dict):
            pairs = list(zip(range(9), value.items(), strict=False))
            parts = [f"{_outline(k, levels - 1)}: {_outline(v, levels - 1)}" for _, (k, v) in pairs]
        else:
            parts = [_outline(v, levels - 1) for _, v in zip(range(9), value, strict=False)]
        if len(parts) > 8:
            parts[8:] = ["..."]
        inner = ", ".join(parts)
        if isinstance(value, tuple):
            body = f"({inner},)" if len(parts) == 1 else f"({inner})"
        elif isinstance(value, list):
            body = f"[{inner}]"
        else:
            body = "{" + inner + "}"
        if kind in (set, frozenset) and not parts:
            return f"{kind.__name__}()"
        if kind in (tuple, list, dict, set):
            return body
        return f"{kind.__name__}({body})"
    if isinstance(value, (Stand, StorageRef, TensorRef)):
        return repr(value)
    if isinstance(value, SkippedObject):  # as the non-tensor values show it
        return f"<skipped {value.name}>"
    return f"<{kind.__name__}>"


def lookup_global(module: str, name: str) -> Stand | None:
    # One stand-in per allowed name (a STACK_GLOBAL of two memo strings is five bytes of the
    # stream: it must not build a new object each time).
    known = _STANDS.get((module, name))
    if known is None:
        known = _make_stand(module, name)
        if known is not None:
            _STANDS[(module, name)] = known
    return known


#: Stand-ins made so far, by (module, name); only allowed names, so a finite table.
_STANDS: Final[dict[tuple[str, str], Stand]] = {}


def _make_stand(module: str, name: str) -> Stand | None:
    if (module, name) in REBUILDS:
        return Stand("rebuild", name)
    if module in ("torch", "torch.cuda") and name in STORAGE_CLASSES:
        return Stand("storage", STORAGE_CLASSES[name])
    if module in ("torch", "torch.storage", "torch.cuda") and name == "UntypedStorage":
        return Stand("storage", "uint8")
    if module == "torch" and name in TORCH_DTYPES:
        return Stand("dtype", name)
    full = f"{module}.{name}"
    return _SIMPLE.get(full)


_SIMPLE: Final[dict[str, Stand]] = {
    "collections.OrderedDict": Stand("odict", "collections.OrderedDict"),
    "collections.Counter": Stand("counter", "collections.Counter"),
    "torch.Size": Stand("size", "torch.Size"),
    "torch.device": Stand("device", "torch.device"),
    "torch.Tensor": Stand("tensor_type", "torch.Tensor"),
    "torch.nn.parameter.Parameter": Stand("tensor_type", "torch.nn.parameter.Parameter"),
    "builtins.set": Stand("set", "builtins.set"),
    "builtins.frozenset": Stand("set", "builtins.frozenset"),
    "builtins.bytearray": Stand("bytearray", "builtins.bytearray"),
    # Protocols 0-2 pickle b"" as bytes() (an empty numpy array's data, say).
    "builtins.bytes": Stand("bytes", "builtins.bytes"),
    "builtins.complex": Stand("complex", "builtins.complex"),
    "_codecs.encode": Stand("encode", "_codecs.encode"),
    # How torch pickles a torch.layout value (``torch.strided`` kept in a state dict): by name.
    "torch.serialization._get_layout": Stand("layout", "torch.serialization._get_layout"),
    # numpy scalars (a metric logged as np.float64) and their dtypes: decoded from their bytes
    # for the dtypes of NUMPY_CODES only (numpy 1 and 2 name the module differently).
    "numpy.dtype": Stand("np_dtype", "numpy.dtype"),
    "numpy.core.multiarray.scalar": Stand("np_scalar", "numpy.core.multiarray.scalar"),
    "numpy._core.multiarray.scalar": Stand("np_scalar", "numpy._core.multiarray.scalar"),
    # numpy arrays of those dtypes: _reconstruct(numpy.ndarray, (0,), b"b"), then BUILD with
    # the shape, dtype and bytes (see _numpy_arrays); the class is only ever an argument.
    "numpy.ndarray": Stand("np_ndarray", "numpy.ndarray"),
    "numpy.core.multiarray._reconstruct": Stand(
        "np_reconstruct", "numpy.core.multiarray._reconstruct"
    ),
    "numpy._core.multiarray._reconstruct": Stand(
        "np_reconstruct", "numpy._core.multiarray._reconstruct"
    ),
    # Constants that only the rebuilds of tensors safetensors cannot hold take (quantization
    # schemes, layouts): inert, so that the refusal names the tensor (see Unconvertible).
    **{
        f"torch.{name}": Stand("constant", f"torch.{name}")
        for name in (
            "per_tensor_affine",
            "per_channel_affine",
            "per_channel_affine_float_qparams",
            "strided",
            "sparse_coo",
            "sparse_csr",
        )
    },
}


# The handlers build from values the stream hands them, and one value from the memo can be
# handed again and again for five bytes each time: each charges what it builds to the machine's
# budget before building it (items copied, bytes copied), and hashes stream values only through
# the budget's depth- and size-checked ``hashable`` (a tuple nested 200,000 deep as an
# OrderedDict key or set item crashed the interpreter in C).


def _h_odict(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    if args == ():
        return {}
    if len(args) == 1 and type(args[0]) is list:
        pairs = args[0]
        p.budget.grow(0, len(pairs), at)
        out: dict[Any, Any] = {}
        for pair in pairs:
            if type(pair) not in (tuple, list) or len(pair) != 2:
                raise bad_checkpoint("OrderedDict items are not pairs", at)
            out[p.budget.hashable(pair[0], at)] = pair[1]
        return out
    raise bad_checkpoint(f"OrderedDict called with {short_text(args)}", at)


def _h_size(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    if len(args) == 1 and type(args[0]) in (tuple, list):
        if type(args[0]) is tuple:
            return args[0]  # tuple(t) is t: nothing built
        p.budget.grow(0, len(args[0]), at)
        return tuple(args[0])
    raise bad_checkpoint(f"torch.Size called with {short_text(args)}", at)


def _h_device(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    if 1 <= len(args) <= 2 and type(args[0]) is str and (len(args) == 1 or is_int(args[1])):
        if len(args) == 2 and not -(1 << 63) <= args[1] < 1 << 63:
            raise bad_checkpoint(
                f"torch.device index {short_text(args[1])} is not a 64-bit integer", at
            )
        p.budget.copy(len(args[0]), at)
        return ":".join(str(a) for a in args)
    raise bad_checkpoint(f"torch.device called with {short_text(args)}", at)


#: The names ``torch.serialization._get_layout`` looks up (``str()`` of each ``torch.layout``).
_LAYOUTS: Final = frozenset(
    f"torch.{name}"
    for name in (
        "strided",
        "sparse_coo",
        "sparse_csr",
        "sparse_csc",
        "sparse_bsr",
        "sparse_bsc",
        "_mkldnn",
        "jagged",
    )
)


def _h_layout(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    # A value like any other constant; tensors of a non-strided layout are refused by their
    # own rebuild functions.
    if len(args) == 1 and type(args[0]) is str and args[0] in _LAYOUTS:
        return Stand("constant", args[0])
    raise bad_checkpoint(f"torch.serialization._get_layout called with {short_text(args)}", at)


def _h_set(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    items = args[0] if len(args) == 1 and type(args[0]) in (list, tuple) else None
    if args and items is None:
        raise bad_checkpoint(f"{f.name} called with {short_text(args)}", at)
    items = items or ()
    p.budget.grow(0, len(items), at)
    values = {p.budget.hashable(x, at) for x in items}
    return frozenset(values) if f.name.endswith("frozenset") else values


def _h_bytearray(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    if args == ():
        return bytearray()
    if len(args) == 1 and type(args[0]) is bytes:
        p.budget.copy(len(args[0]), at)
        return bytearray(args[0])
    raise bad_checkpoint(f"bytearray called with {short_text(args)}", at)


def _h_bytes(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    if args == ():
        return b""
    raise bad_checkpoint(f"bytes called with {short_text(args)}", at)


def _h_complex(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    if len(args) == 2 and all(type(a) in (int, float) for a in args):
        try:
            return complex(args[0], args[1])
        except OverflowError:
            raise bad_checkpoint(
                f"complex called with {short_text(args)}: too large for a float", at
            ) from None
    raise bad_checkpoint(f"complex called with {short_text(args)}", at)


def _h_encode(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    # The protocol-2 way to pickle bytes: _codecs.encode(text, "latin1"). Nothing else.
    if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        # The first encoding of a text is at most as large as the text, which the stream holds
        # (a numpy array's data: hundreds of MB in a real checkpoint); encoding the same text
        # of the memo again is five bytes of the stream each time, so it is charged as a copy.
        if id(args[0]) in p.encoded:
            p.budget.copy(len(args[0]), at)
        else:
            p.encoded[id(args[0])] = args[0]
        try:
            return args[0].encode("latin-1")
        except UnicodeEncodeError:
            pass  # a character over U+00FF: not what pickle writes
    raise unsafe_global(f"_codecs.encode called with {short_text(args)}", "_codecs.encode", at)


def _h_rebuild(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    name, n = f.name, len(args)
    if name == "_rebuild_tensor" and n == 4:
        return p.make_tensor(args, None, None, at)
    if name == "_rebuild_tensor_v2" and n in (6, 7):
        _empty_hooks(args[5], at)
        return p.make_tensor(args[:4], None, args[6] if n == 7 else None, at)
    if name == "_rebuild_tensor_v3" and n in (7, 8):
        _empty_hooks(args[5], at)
        dtype = args[6]
        if not isinstance(dtype, Stand) or dtype.kind != "dtype":
            raise bad_checkpoint("_rebuild_tensor_v3 without a dtype", at)
        meta = args[7] if n == 8 else None
        return p.make_tensor(args[:4], dtype.name, meta, at)
    if name in ("_rebuild_parameter", "_rebuild_parameter_with_state") and n in (3, 4):
        _empty_hooks(args[2], at)
        if n == 4:
            _attribute_state(args[3], at)
        if not isinstance(args[0], TensorRef):
            raise bad_checkpoint("parameter without a tensor", at)
        return args[0]
    if name == "_rebuild_from_type_v2" and n == 4:
        func, new_type, inner, state = args
        if isinstance(new_type, SkippedObject):
            # A tensor subclass of an unknown class (skip mode only): skipped as a whole.
            return p.skip_call(new_type, at)
        if not isinstance(new_type, Stand) or new_type.kind != "tensor_type":
            raise unsafe_global(f"tensor subclass {short_text(new_type)}", None, at)
        if type(inner) is not tuple:
            raise bad_checkpoint(f"_rebuild_from_type_v2 with arguments {short_text(inner)}", at)
        _attribute_state(state, at)
        if isinstance(func, Stand) and func.kind == "unconvertible":
            return p.unconvertible(func, at)
        if not isinstance(func, Stand) or func.kind != "rebuild":
            raise unsafe_global(f"_rebuild_from_type_v2 calling {short_text(func)}", None, at)
        return _h_rebuild(p, func, inner, at)
    raise bad_checkpoint(f"{name} called with {n} arguments", at)


def _attribute_state(state: Any, at: int) -> None:
    """Accept the Python attributes of a tensor or Parameter (``t.tag = "x"``), which torch
    pickles as the state of ``_rebuild_from_type_v2``/``_rebuild_parameter_with_state``: its
    ``__dict__``, or ``(__dict__, slots)``. A safetensors file holds no such attributes, so
    they are not kept, as no save of safetensors keeps them; their values were built by this
    machine from allowed globals only.

    A key torch would not store as an attribute is refused (:func:`state_setter`): ``data``
    swaps the tensor ``torch.load`` returns for another, so the converted file would hold
    values other than torch's."""
    plain = type(state) is dict or (
        type(state) is tuple and len(state) == 2 and all(type(s) is dict for s in state)
    )
    if state is not None and not plain:
        raise bad_checkpoint(f"tensor with Python state {short_text(state)}", at)
    setter = state_setter(state)
    if setter is not None:
        raise unsafe_global(
            f"tensor state sets {setter}: torch.load applies a state with setattr, which for"
            " this name changes the tensor torch returns (as data, real and imag do) or fails,"
            " where a real state holds plain attributes only",
            None,
            at,
        )


def _h_counter(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    # collections.Counter (an LR scheduler's milestones; on torch's weights_only allow-list)
    # pickles as Counter(dict): kept as the dict it holds.
    if args == ():
        return {}
    if len(args) == 1 and type(args[0]) is dict:
        p.budget.grow(0, len(args[0]), at)
        return dict(args[0])  # keys keep their hashes: none is hashed again
    raise bad_checkpoint(f"Counter called with {short_text(args)}", at)


def _h_unconvertible(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    return p.unconvertible(f, at)


def _h_np_dtype(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    # numpy writes numpy.dtype(code, align=False, copy=True), then BUILD with the byte order.
    if (
        len(args) == 3
        and type(args[0]) is str
        and type(args[1]) in (bool, int)
        and type(args[2]) in (bool, int)
        and (args[1], args[2]) == (0, 1)
    ):
        if args[0] in NUMPY_CODES:
            return NumpyDtype(args[0])
        return p.skip_value(
            "numpy.dtype",
            f"numpy.dtype {short_text(args[0])}: only bool, integer, float and complex dtypes "
            "are decoded",
            at,
        )
    raise bad_checkpoint(f"numpy.dtype called with {short_text(args)}", at)


def _numpy_dtype_state(obj: NumpyDtype, state: Any, at: int) -> None:
    """Apply the state numpy pickles for a plain dtype: ``(3, order, None, None, None, -1, -1,
    0)``, the byte order the only thing it sets."""
    if (
        type(state) is tuple
        and len(state) == 8
        and all(is_int(v) for v in (state[0], *state[5:]))
        and state[0] == 3
        and state[1] in ("<", ">", "|", "=")
        and all(v is None for v in state[2:5])
        and state[5:] == (-1, -1, 0)
        and (state[1] != "|" or obj.code in ("b1", "i1", "u1"))
    ):
        obj.order = state[1]
        return
    raise bad_checkpoint(f"numpy dtype {obj.code!r} with the state {short_text(state)}", at)


def _h_np_scalar(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    # A numpy scalar: scalar(dtype, its bytes), read with the decoded dtype, nothing called.
    if len(args) == 2 and isinstance(args[0], SkippedObject):  # of a dtype not decoded
        return p.skip_value(f.name, f"{f.name} of a skipped dtype", at)
    if len(args) == 2 and isinstance(args[0], NumpyDtype) and type(args[1]) is bytes:
        dtype = args[0].dtype
        if len(args[1]) == dtype.itemsize:
            return np.frombuffer(args[1], dtype)[0]
    raise bad_checkpoint(f"{f.name} called with {short_text(args)}", at)


def _h_np_reconstruct(p: TorchPolicy, f: Stand, args: tuple[Any, ...], at: int) -> Any:
    # numpy's ndarray.__reduce__ writes exactly _reconstruct(numpy.ndarray, (0,), b"b"): an
    # empty array that the BUILD after it fills. Nothing else is accepted (another class, shape
    # or dtype code would be numpy building something of its own choosing).
    if len(args) == 3 and isinstance(args[0], SkippedObject):
        # An ndarray subclass of a class not known (numpy.matrix, skip mode): skipped whole.
        return p.skip_call(args[0], at)
    if (
        len(args) == 3
        and isinstance(args[0], Stand)
        and args[0].kind == "np_ndarray"
        and type(args[1]) is tuple
        and len(args[1]) == 1
        and type(args[1][0]) is int
        and args[1][0] == 0
        and type(args[2]) is bytes
        and args[2] == b"b"
    ):
        array = new_array()
        p.arrays[id(array)] = array
        return array
    raise bad_checkpoint(
        f"{f.name} called with {short_text(args)}; only (numpy.ndarray, (0,), b'b'), as numpy "
        f"pickles an array, is read (at byte {at})",
        at,
    )


_HANDLERS: Final[dict[str, Callable[[TorchPolicy, Stand, tuple[Any, ...], int], Any]]] = {
    "np_reconstruct": _h_np_reconstruct,
    "unconvertible": _h_unconvertible,
    "np_dtype": _h_np_dtype,
    "np_scalar": _h_np_scalar,
    "counter": _h_counter,
    "odict": _h_odict,
    "size": _h_size,
    "device": _h_device,
    "layout": _h_layout,
    "set": _h_set,
    "bytearray": _h_bytearray,
    "bytes": _h_bytes,
    "complex": _h_complex,
    "encode": _h_encode,
    "rebuild": _h_rebuild,
}


class ValuePolicy(TorchPolicy):
    """Plain values only (the legacy format's magic, version, sys_info and key list)."""

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        """No global at all is allowed here."""
        full = f"{module}.{name}"
        raise unsafe_global(f"global {full} in a header pickle", full, offset)

    def persistent(self, pid: Any, offset: int, opcode: str) -> Any:
        """No persistent id is expected here."""
        raise bad_checkpoint("persistent id in a header pickle", offset)
