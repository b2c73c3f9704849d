"""Scan pickles and PyTorch checkpoints for the globals they would import, without running them.

:func:`scan_file` runs the converter's pickle stack machine in symbolic mode: every global
becomes an inert record and every call a symbolic node, so ``STACK_GLOBAL`` operands built
through the memo are just the stack values they are (see ``docs/scan.md``).
Each global is graded from an allow-list:

* ``safe``: nothing that runs code: what the torch-free converter reads (numpy scalars,
  dtypes and arrays included), what it refuses only because safetensors cannot hold it
  (sparse, quantized tensors...) and inert builtins (``dict``, ``list``, ``slice``...); see
  ``docs/scan.md``;
* ``dangerous``: known code-running, file, network or name-resolving callables, and files that
  two readers would read as different programs (an operand running past the end of its FRAME,
  a zip whose central directory torch's reader and ``zipfile`` find in different places);
* ``suspicious``: everything else, and anything the scanner could not fully analyse (parse
  errors, unreadable members, calls of computed objects...).

Files are parsed the way their victims would parse them: every pickle stream of a file (legacy
checkpoints are five pickles plus raw data; extra streams after STOP are scanned), every
``*.pkl`` zip member, and any other member that starts a pickle which imports or calls
something, whatever its name (CRC, flag bits and local-name mismatches are ignored, as torch's
reader ignores them), except tensor storages (``data/N``), raw bytes torch never unpickles,
which are only reported (suspicious) when they are one whole pickle that imports; the members
of 0.1.1 tar checkpoints, zip and tar archives held by a member (a checkpoint in a zipped
model folder), and pickles nested inside ``pickle.loads``/``torch.load``-style calls. Any
opcode may start a pickle, as in CPython's unpickler, and Python 2 names are read as CPython
reads them below protocol 3 (``commands.getoutput`` is ``subprocess.getoutput``). A file is
read in every way a loader may read it (zip, tar as ``tarfile`` recognises one, pickle),
graded by the worst.

Exit codes of ``pysafetensors scan``: 0 all safe, 1 suspicious (or not fully analysable),
2 dangerous.
"""

from __future__ import annotations

import ast
import errno
import mmap
import os
import re
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, cast

from ._errors import SafetensorError, first_five, input_path
from ._pickle_vm import LIMIT, OPNAMES, TRUNCATED, Limits, Machine
from ._remote_urls import shown_location
from ._sources import open_regular_file
from ._torch_archive import MAX_DEFLATE_RATIO, BoundedFile, caseless
from ._torch_policy import (
    LEGACY_MAGIC,
    LEGACY_MAGIC_OPS,
    REBUILDS,
    STORAGE_CLASSES,
    TORCH_DTYPES,
    UNCONVERTIBLE,
    lookup_global,
    py2_name,
    state_setter,
)
from ._zip_directory import EOCD, EOCD_SIG, LOCAL_SIG, ZIP64_EOCD, end_records

__all__ = [
    "GRADES",
    "Finding",
    "GlobalUse",
    "Grade",
    "ScanReport",
    "grade_global",
    "grade_pickled_global",
    "scan_file",
]

Grade = Literal["safe", "suspicious", "dangerous"]
#: Grades from best to worst; a report's grade is the worst of its parts.
GRADES: Final[tuple[Grade, ...]] = ("safe", "suspicious", "dangerous")
_RANK: Final = {g: i for i, g in enumerate(GRADES)}

#: Largest pickle (file or member) analysed; bigger ones are reported as not analysable.
MAX_PICKLE_BYTES: Final = 1 << 30
#: How deep pickles nested in calls are followed.
MAX_NESTING: Final = 3
#: Nested pickles scanned per file: a pickle can pass the same payload to ``pickle.loads`` a
#: million times through the memo, each call a full scan of it (and of what it nests).
MAX_NESTED_SCANS: Final = 256
#: Bytes of nested archives (zip or tar members that are archives themselves) read into memory
#: per file, all nesting levels together: each level held up to 1 GiB while the next was read,
#: so a 35 MiB zip of 1 GiB zips nested three deep took 4 GB. One nested checkpoint of up to
#: 1 GiB is still read whole.
MAX_NESTED_ARCHIVE_BYTES: Final = 1 << 30
#: Pickle streams analysed per buffer: a file of ``N.`` repeated is hundreds of millions of
#: streams, no real checkpoint has more than a handful.
MAX_STREAMS: Final = 10_000
#: Opcodes run for one file, all its streams together (one stream's cap, ``Limits.max_ops``):
#: each stream had the cap of its own, so a 1 GiB file of trivial streams took ~25 minutes.
MAX_OPS: Final = Limits().max_ops
#: Caps for running the first pickle of a file to see whether it is the legacy magic number.
_MAGIC_LIMITS: Final = Limits(max_ops=LEGACY_MAGIC_OPS)
#: Globals and findings listed per report (each list): a 300 MB pickle of ``GLOBAL; POP`` pairs
#: is 25 million records, gigabytes of memory. The grades of the unlisted ones still count.
MAX_LISTED: Final = 100_000
#: Bytes of a zip member read first to decide whether it starts with a pickle: the window grows
#: only while the pickle runs past it, so multi-GB tensor members are never copied whole.
_PROBE_WINDOW: Final = 1 << 16
#: The message prefix of a stream that could not be parsed.
_PARSE_FAILED: Final = "pickle could not be fully parsed"
#: A ``.npy`` file's first bytes (also each member of an ``.npz``).
_NPY_MAGIC: Final = b"\x93NUMPY"
#: Header length field and text encoding of each ``.npy`` version numpy reads.
_NPY_VERSIONS: Final = {(1, 0): ("<H", "latin1"), (2, 0): ("<I", "latin1"), (3, 0): ("<I", "utf8")}
#: Longest ``.npy`` header parsed to learn its dtype; a longer one (numpy's own cap is 10,000
#: characters, lifted by ``allow_pickle=True``) has its data scanned as a possible pickle.
_NPY_MAX_HEADER: Final = 1 << 20

_EXTRA_SAFE: Final = frozenset(
    {
        "collections.Counter",
        "torch.strided",
        "torch.sparse_coo",
        "torch.sparse_csr",
        "torch.per_tensor_affine",
        "torch.per_channel_affine",
        "torch.per_channel_affine_float_qparams",
    }
)
# Modules (and their submodules) whose every name is dangerous: code, processes, network, name
# resolution, and file access (``posixpath.os``/``ntpath.os`` reach ``os``; pathlib and codecs
# write files; archive modules unpack them).
_DANGEROUS_MODULES: Final = frozenset(
    """os posix nt sys subprocess socket shutil pty runpy pickle _pickle pip ctypes asyncio
    importlib marshal types code codeop multiprocessing webbrowser requests urllib http httplib
    ssl venv timeit cProfile profile pdb bdb pydoc pkgutil operator _operator functools
    _posixsubprocess _io io shelve signal _thread threading dill cloudpickle joblib idlelib
    lib2to3 doctest ensurepip imaplib smtplib ftplib telnetlib poplib nntplib xmlrpc trace
    _osx_support _aix_support _pyrepl test tempfile glob zipimport aiohttp uuid sqlite3
    numpy.f2py numpy.testing numpy.distutils torch.serialization torch._inductor torch.jit
    torch.hub torch.utils.collect_env torch._dynamo torch.utils.bottleneck
    torch.utils.data.datapipes torch.fx torch.package torch._export torch.export
    torch.storage torch.distributed torch.utils.cpp_extension setuptools distutils yaml
    jinja2 logging posixpath ntpath genericpath macpath pathlib codecs fileinput zipfile
    tarfile gzip bz2 lzma mmap site sysconfig _sitebuiltins inspect imp _imp _ctypes
    _frozen_importlib _frozen_importlib_external pkg_resources pyximport Cython mako numexpr
    sympy linecache tokenize _winapi msvcrt winreg numpy.ctypeslib numpy.lib.npyio
    numpy.lib._npyio_impl numpy.lib.format pandas.io py_compile compileall dbm _dbm _gdbm
    dumbdbm anydbm whichdb mailbox zipapp wave aifc sunau pstats tabnanny filecmp
    torch.utils.benchmark""".split()  # noqa: SIM905 - a word list reads better as text
)
# What torch's C extension has that loads, imports, compiles or unpickles (TorchScript, mobile
# modules, its own pickler): the rest of ``torch._C`` is what a pickled model's functional
# references name (``torch._C._nn.gelu``), ``suspicious`` like any unknown global.
_TORCH_C_ACTING: Final = re.compile(
    r"load|import|compil|pickle|backport|exec|eval|file|buffer|bytes|save|writer|reader|abort"
    r"|crash",
    re.IGNORECASE,
)
# numpy's pickling helpers for its random generators (``RandomState``, ``Generator``, their bit
# generators and ``SeedSequence``, whose Cython-made helper only fills a ``SeedSequence``
# subclass instance): the one place where dunder names are ordinary functions, so matched
# exactly, before the dunder rule. They construct numpy RNG objects and nothing else, except
# that ``__randomstate_ctor(name, ctor)`` and ``__generator_ctor`` call ``ctor(name)``: numpy
# passes its own ``__bit_generator_ctor`` there, or nothing; anything else is a call gadget
# (see ``_ScanPolicy._check_rng_ctor``). Not ``safe``, as the converter does not read them:
# ``suspicious``, so ``convert --skip-unknown`` skips them. Every checkpoint holding a numpy
# RNG (a training loop's state) used to be graded dangerous, and so refused in skip mode too.
_NUMPY_RNG_MODULE: Final = "numpy.random._pickle"
_NUMPY_RNG_HELPERS: Final = frozenset(
    {
        (_NUMPY_RNG_MODULE, "__randomstate_ctor"),
        (_NUMPY_RNG_MODULE, "__generator_ctor"),
        (_NUMPY_RNG_MODULE, "__bit_generator_ctor"),
        ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"),
    }
)
#: The helpers that call their second argument (see ``_NUMPY_RNG_HELPERS``).
_RNG_CALLING_CTORS: Final = ("__randomstate_ctor", "__generator_ctor")
_DANGEROUS_NAMES: Final = frozenset(
    {
        "numpy.load",
        "numpy.loads",
        "numpy.fromfile",
        "numpy.fromregex",
        "numpy.loadtxt",
        "numpy.genfromtxt",
        "numpy.memmap",
        "numpy.save",
        "numpy.savez",
        "numpy.savetxt",
        "numpy.core.multiarray.fromfile",
        "numpy._core.multiarray.fromfile",
        "numpy.core.memmap.memmap",
        "numpy._core.memmap.memmap",
        "pandas.read_pickle",
        "pandas.read_csv",
        "torch.from_file",
        "torch.save",
    }
)
# Callables that unpickle their bytes argument: the bytes are scanned as a nested file.
_NESTED_LOADERS: Final = frozenset(
    {
        "pickle.loads",
        "_pickle.loads",
        "torch.storage._load_from_bytes",
        "torch.load",
        "torch.serialization.load",
        "dill.loads",
        "joblib.load",
    }
)
# Builtins that build a value and run nothing of their own: the pickle hands them values it
# built itself, whose code (if any) comes from globals graded on their own. ``dict``, ``list``
# and ``tuple`` are a ``defaultdict``'s factory (an optimizer object's state), ``object`` the
# base of protocol 0/1 pickles of plain objects (``copyreg._reconstructor(cls, object, None)``).
_SAFE_BUILTINS: Final = frozenset(
    {
        "set",
        "frozenset",
        "bytearray",
        "bytes",
        "complex",
        "slice",
        "dict",
        "list",
        "tuple",
        "object",
    }
)
# The pickle machine's notices about FRAME boundaries that CPython itself reads in two ways. With
# bytes (``pickle.loads``, or a buffered file and a frame under 8 KiB) its C unpickler reads on
# linearly, as this scanner does; with a file it reads frames into a buffer of their own
# (``torch.load`` of a zip member reads from an ``io.BytesIO``; a buffered file does it for
# frames of 8 KiB and more), and an operand that runs past that buffer is read from the bytes
# after the frame while what was left in the frame is dropped. ``frame(b"g1") + b"2\n"`` is
# GET 12 one way and GET 2 the other. No pickler writes any of these, and a scanner cannot grade
# two programs as one: they are dangerous.
_FRAME_DESYNC: Final = {
    "an operand crosses the end of its FRAME": (
        "CPython and this scanner would read different programs (a file reader drops the rest "
        "of the frame and reads the operand from the bytes after it)"
    ),
    "FRAME begins inside another frame": (
        "CPython reads the bytes from here on differently from a file and from bytes (the "
        "pure-Python unpickler refuses it), so they cannot be graded as one program"
    ),
    "STOP inside a FRAME that announces more bytes": (
        "a file reader starts the next pickle after the frame, this scanner and pickle.loads "
        "right after the STOP, so the streams that follow cannot be graded as one program"
    ),
}


def grade_global(module: str, name: str) -> Grade:
    """Grade one ``module.name`` global.

    A dotted ``name`` is refused before any allow-list rule: unpicklers resolve it attribute by
    attribute (``torch._utils`` + ``_rebuild_tensor.__builtins__.get`` is ``builtins.dict.get``
    on the builtins of that module, a way to ``eval``), so no prefix or table match on the
    first component says anything about the object reached. Dunder components are refused for
    the same reason. Only exact table entries are ever ``safe``.
    """
    module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)
    full = f"{module}.{name}"
    if (module, name) in _NUMPY_RNG_HELPERS:
        return "suspicious"
    if "." in name or any(p.startswith("__") for p in name.split(".")):
        return "dangerous"
    if any(p.startswith("__") for p in module.split(".")) and module != "__main__":
        return "dangerous"  # __builtins__-style lookups through a module path
    if module == "builtins":
        return "safe" if name in _SAFE_BUILTINS else "dangerous"
    if lookup_global(module, name) is not None or (module, name) in UNCONVERTIBLE:
        return "safe"
    if full in _EXTRA_SAFE:
        return "safe"
    if full in _DANGEROUS_NAMES or full in _NESTED_LOADERS:
        return "dangerous"
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in _DANGEROUS_MODULES:
            return "dangerous"
    if parts[:2] == ["torch", "_C"] and _TORCH_C_ACTING.search(name):
        return "dangerous"
    return "suspicious"


def grade_pickled_global(module: str, name: str, protocol: int = 3) -> Grade:
    """Grade a global as a pickle of protocol ``protocol`` names it: the one grading the
    scanner and the converter share (the converter refuses a ``dangerous`` global even when
    it skips unknown objects, and skips only the others).

    Below protocol 3, CPython's unpickler (``fix_imports``, as ``torch.load`` runs it) imports
    Python 2 names under their Python 3 names, so they are graded as those:
    ``commands.getoutput`` is ``subprocess.getoutput``, ``dangerous``.

    Example::

        >>> grade_pickled_global("os", "system")
        'dangerous'
        >>> grade_pickled_global("argparse", "Namespace")
        'suspicious'
        >>> grade_pickled_global("commands", "getoutput", protocol=2)
        'dangerous'
    """
    if protocol < 3:
        module, name = py2_name(module, name)
    return grade_global(module, name)


@dataclass(frozen=True, slots=True)
class GlobalUse:
    """One global a pickle imports."""

    module: str
    name: str
    grade: Grade
    where: str
    """The member or stream it was found in."""
    offset: int
    """Byte offset of the opcode within that member or stream's buffer."""
    opcode: str

    @property
    def qualname(self) -> str:
        """``module.name``."""
        return f"{self.module}.{self.name}"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something other than a global that matters: structure, parse errors, tricks."""

    grade: Grade
    message: str
    where: str
    offset: int | None = None


@dataclass
class _Spent:
    """What the scan of one file has spent of its per-file budgets, shared by every report
    made while scanning it (a probe's report is merged into the file's, or dropped, only at
    the end)."""

    nested_archive_bytes: int = 0
    """Bytes of nested archives read so far (see :data:`MAX_NESTED_ARCHIVE_BYTES`)."""


@dataclass
class ScanReport:
    """The result of scanning one file."""

    path: str
    format: str = "unknown"
    """``zip``, ``legacy``, ``pickle``, ``tar``, ``npy``, ``safetensors`` or ``unknown``."""
    globals: list[GlobalUse] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    streams: int = 0
    """Pickle streams analysed."""
    _unlisted: int = field(default=0, repr=False, compare=False)
    """The worst rank of globals and findings over :data:`MAX_LISTED`, not kept."""
    _nested_scans: int = field(default=0, repr=False, compare=False)
    _limited: bool = field(default=False, repr=False, compare=False)
    """Whether a stream stopped at a limit of the scanner (not at an error of the pickle)."""
    _ops: int = field(default=0, repr=False, compare=False)
    """Opcodes run for this file so far, all its streams together (see :data:`MAX_OPS`)."""
    _spent: _Spent = field(default_factory=_Spent, repr=False, compare=False)

    @property
    def grade(self) -> Grade:
        """The worst grade of any global or finding (``safe`` when there are none)."""
        worst = self._unlisted
        for g in self.globals:
            worst = max(worst, _RANK[g.grade])
        for f in self.findings:
            worst = max(worst, _RANK[f.grade])
        return GRADES[worst]

    @property
    def exit_code(self) -> int:
        """0 safe, 1 suspicious, 2 dangerous."""
        return _RANK[self.grade]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready rendering."""
        return {
            "path": self.path,
            "format": self.format,
            "grade": self.grade,
            "streams": self.streams,
            "globals": [{**asdict(g), "qualname": g.qualname} for g in self.globals],
            "findings": [asdict(f) for f in self.findings],
        }

    def _child(self) -> ScanReport:
        """An empty report for a reading that may be kept or dropped (see :func:`_keep_probe`),
        spending this file's budgets: a fresh one had budgets of its own."""
        return ScanReport(self.path, _spent=self._spent)

    def _add(self, grade: Grade, message: str, where: str, offset: int | None = None) -> None:
        if len(self.findings) < MAX_LISTED:
            self.findings.append(Finding(grade, message, where, offset))
            return
        self._over_cap(grade, where)

    def _add_global(self, use: GlobalUse) -> None:
        if len(self.globals) < MAX_LISTED:
            self.globals.append(use)
            return
        self._over_cap(use.grade, use.where)

    def _over_cap(self, grade: Grade, where: str) -> None:
        # Only the grade is kept. One finding past the cap says the lists are cut; no real
        # checkpoint gets near it (pickles memoize their globals), so it is suspicious itself.
        if self._unlisted == 0:
            self.findings.append(
                Finding(
                    "suspicious",
                    f"more than {MAX_LISTED} globals or findings: the rest are not listed, "
                    "their grades still count",
                    where,
                )
            )
        self._unlisted = max(self._unlisted, _RANK[grade], _RANK["suspicious"])

    def _merge(self, other: ScanReport) -> None:
        for g in other.globals:
            self._add_global(g)
        for f in other.findings:
            self._add(f.grade, f.message, f.where, f.offset)
        self._unlisted = max(self._unlisted, other._unlisted)
        self._limited = self._limited or other._limited
        self.streams += other.streams
        self._nested_scans += other._nested_scans
        self._ops += other._ops


# --------------------------------------------------------------------------------------------
# Symbolic policy.
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _SymGlobal:
    module: str
    name: str


@dataclass(eq=False)
class _SymCall:
    func: Any
    args: Any


@dataclass(eq=False)
class _SymPersistent:
    pid: Any


class _Opaque:
    """Stands for an unhashable dict key, so the walk goes on."""

    __slots__ = ()


class _ScanPolicy:
    #: REDUCE and NEWOBJ with arguments that are a call's result reach :meth:`reduce` (see
    #: :class:`~._pickle_vm.Policy`): the machine stopped there, and whatever the pickle did
    #: after (``os.system``) was not read, while CPython runs it.
    computed_arguments = True

    def __init__(self, report: ScanReport, where: str, depth: int) -> None:
        self.report = report
        self.where = where
        self.depth = depth
        self.pids: list[Any] = []
        self.truncated = False
        """Whether the stream failed because its bytes ran out (a bigger window may parse)."""
        # The unpickler's protocol starts at 0 and is whatever the last PROTO said (the machine
        # reports each, see proto()); it decides whether Python 2 names are mapped (CPython:
        # ``self.proto < 3 and self.fix_imports``).
        self.protocol = 0
        # Nested payloads already scanned, by identity (the memo hands out the same object);
        # the objects are kept so that their ids stay theirs.
        self.nested_seen: dict[int, Any] = {}

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        written = f"{module}.{name}"
        grade = grade_pickled_global(module, name, self.protocol)
        if self.protocol < 3:
            module, name = py2_name(module, name)
        self.report._add_global(GlobalUse(module, name, grade, self.where, offset, opcode))
        if grade != "safe" and f"{module}.{name}" != written:
            self.report._add(
                grade,
                f"{written} is read as {module}.{name} (a Python 2 name in a protocol "
                f"{self.protocol} pickle)",
                self.where,
                offset,
            )
        if opcode == "INST" and grade == "safe":
            self.report._add("suspicious", f"INST opcode on {module}.{name}", self.where, offset)
        return _SymGlobal(module, name)

    def bad_stack_global(self, module: Any, name: Any, offset: int) -> Any:
        self.report._add_global(
            GlobalUse(_text(module), _text(name), "dangerous", self.where, offset, "STACK_GLOBAL")
        )
        self.report._add(
            "dangerous", "STACK_GLOBAL with operands that are not strings", self.where, offset
        )
        return _SymGlobal(_text(module), _text(name))

    def reduce(self, func: Any, args: Any, offset: int, opcode: str) -> Any:
        if isinstance(func, _SymGlobal):
            full = f"{func.module}.{func.name}"
            if full == "_codecs.encode" and (
                type(args) is not tuple or len(args) != 2 or args[1] not in ("latin1", "latin-1")
            ):
                self.report._add(
                    "suspicious", "_codecs.encode with an unusual encoding", self.where, offset
                )
            if full in _NESTED_LOADERS:
                for arg in args if type(args) is tuple else ():
                    if isinstance(arg, (bytes, bytearray)):
                        self._nested(arg, offset)
            if full == "torch._tensor._rebuild_from_type_v2":
                self._check_rebuild_func(args, offset)
            if full in _STATE_REBUILDS:
                self._check_tensor_state(full, args, offset)
            if func.module == _NUMPY_RNG_MODULE and func.name in _RNG_CALLING_CTORS:
                self._check_rng_ctor(full, args, offset)
        elif not isinstance(func, (_SymCall, _SymGlobal)):
            self.report._add(
                "suspicious", f"{opcode} on a {type(func).__name__} value", self.where, offset
            )
        else:  # pragma: no cover - covered by the first branch
            pass
        if isinstance(func, _SymCall):
            # Calling the result of a call: the getattr/getitem gadget pattern.
            self.report._add("suspicious", f"{opcode} calls a computed object", self.where, offset)
        if type(args) is not tuple and opcode in ("REDUCE", "NEWOBJ"):
            self.report._add("suspicious", f"{opcode} with computed arguments", self.where, offset)
        if opcode in ("OBJ", "NEWOBJ_EX"):
            self.report._add("suspicious", f"{opcode} opcode", self.where, offset)
        if (
            isinstance(func, _SymGlobal)
            and (func.module, func.name) == ("builtins", "tuple")
            and opcode != "NEWOBJ_EX"
            and type(args) is tuple
            and len(args) == 1
            and type(args[0]) in (list, tuple)
        ):
            # tuple([...]) is that tuple, and is read as one: as a call result it was an
            # argument tuple the machine refused (REDUCE arguments are not a tuple), so what
            # it called and every opcode after it went unread, while CPython calls it.
            return tuple(args[0])
        return _SymCall(func, args)

    def _check_rebuild_func(self, args: Any, offset: int) -> None:
        # _rebuild_from_type_v2(func, type, args, state) calls func(*args): torch only ever
        # passes one of its rebuild functions. Anything else turns it into a call gadget.
        func = args[0] if type(args) is tuple and args else None
        if isinstance(func, _SymGlobal) and (
            (func.module, func.name) in REBUILDS
            or (func.module == "torch._utils" and (func.module, func.name) in UNCONVERTIBLE)
        ):
            return
        what = "a computed object" if isinstance(func, _SymCall) else _text(func)
        if isinstance(func, _SymGlobal):
            what = f"{func.module}.{func.name}"
        self.report._add(
            "dangerous",
            f"_rebuild_from_type_v2 calls {what}, not a tensor rebuild",
            self.where,
            offset,
        )

    def _check_tensor_state(self, full: str, args: Any, offset: int) -> None:
        # The last argument is a state torch applies to the tensor key by key with setattr:
        # a real one is the tensor's __dict__ (plain attributes); "data" swaps the tensor
        # torch.load returns for another, "real" and "imag" write into it.
        if type(args) is not tuple or len(args) != 4:
            return
        setter = state_setter(args[3])
        if setter is not None:
            self.report._add(
                "dangerous",
                f"{full} sets {setter} on the tensor it makes (torch.load applies its state with"
                " setattr: the tensor it returns is not the one pickled)",
                self.where,
                offset,
            )

    def _check_rng_ctor(self, full: str, args: Any, offset: int) -> None:
        # __randomstate_ctor(name, ctor) and __generator_ctor(name, ctor) call ctor(name):
        # numpy writes its own __bit_generator_ctor there, or leaves it out. Anything else
        # runs a callable of the pickle's choice on an argument of its choice.
        if type(args) is not tuple:
            # numpy always writes a literal tuple. Computed arguments hide what is called, and
            # passed as numpy's own. (The machine refuses REDUCE and NEWOBJ with them before
            # this policy sees the call; this holds whatever opcode hands them over.)
            self.report._add(
                "dangerous",
                f"{full} called with computed arguments (numpy writes a tuple of a name and "
                "its own bit generator constructor)",
                self.where,
                offset,
            )
            return
        ctor = args[1] if len(args) > 1 else None
        if ctor is None or (
            isinstance(ctor, _SymGlobal)
            and (ctor.module, ctor.name) == (_NUMPY_RNG_MODULE, "__bit_generator_ctor")
        ):
            return
        if isinstance(ctor, _SymGlobal):
            what = f"{ctor.module}.{ctor.name}"
        else:
            what = "a computed object" if isinstance(ctor, _SymCall) else type(ctor).__name__
        self.report._add(
            "dangerous",
            f"{full} calls {what} with the pickle's argument, not numpy's bit generator "
            "constructor",
            self.where,
            offset,
        )

    def _nested(self, arg: bytes | bytearray, offset: int) -> None:
        if self.depth >= MAX_NESTING:
            self.report._add("suspicious", "nested pickles too deep", self.where, offset)
            return
        self.report._add("dangerous", "a nested pickle is loaded by a call", self.where, offset)
        if id(arg) in self.nested_seen:
            return  # the same payload again: its globals are listed already
        self.nested_seen[id(arg)] = arg
        if self.report._nested_scans >= MAX_NESTED_SCANS:
            self.report._add(
                "suspicious", f"more than {MAX_NESTED_SCANS} nested pickles", self.where, offset
            )
            return
        self.report._nested_scans += 1
        _scan_bytes(self.report, bytes(arg), f"{self.where}>nested@{offset}", self.depth + 1)

    def build(self, obj: Any, state: Any, offset: int) -> Any:
        if isinstance(obj, _SymGlobal):
            self.report._add(
                "dangerous",
                f"BUILD changes the attributes of {obj.module}.{obj.name}",
                self.where,
                offset,
            )
        elif _made_by(obj, _TENSOR_MAKERS):
            # Tensor.__setstate__: a (storage, offset, size, stride) state points the tensor
            # anywhere (torch's legacy set_ path), a 5-tuple's first item becomes its data;
            # torch.save never writes one.
            self.report._add(
                "dangerous",
                f"BUILD sets the state of a tensor {_maker(obj)} made",
                self.where,
                offset,
            )
        return obj

    def persistent(self, pid: Any, offset: int, opcode: str) -> Any:
        self.pids.append(pid)
        return _SymPersistent(pid)

    def extension(self, code: int, offset: int) -> Any:
        self.report._add("dangerous", f"EXT opcode (registry global {code})", self.where, offset)
        return _SymGlobal("copyreg", f"<extension {code}>")

    def buffer(self, offset: int, opcode: str) -> Any:
        self.report._add("suspicious", f"{opcode}: out-of-band buffer", self.where, offset)
        return None

    def mutate(self, target: Any, opcode: str, items: list[Any], offset: int) -> None:
        if isinstance(target, _SymGlobal):
            self.report._add(
                "dangerous",
                f"{opcode} into {target.module}.{target.name}",
                self.where,
                offset,
            )
        elif not isinstance(target, _SymCall):
            self.report._add(
                "suspicious", f"{opcode} into a {type(target).__name__}", self.where, offset
            )
        elif _made_by(target, _TENSOR_MAKERS):
            # Items stored into a tensor: the pattern of CVE-2026-24747 (memory corruption
            # under torch.load's weights_only).
            self.report._add(
                "dangerous", f"{opcode} into a tensor {_maker(target)} made", self.where, offset
            )
        elif not _made_by(target, _CONTAINERS):
            self.report._add(
                "suspicious", f"{opcode} into what {_maker(target)} returned", self.where, offset
            )

    def unhashable(self, key: Any, offset: int) -> Any:
        return _Opaque()

    def text(self, raw: bytes, offset: int) -> Any:
        return raw.decode("utf-8", "surrogateescape")

    def notice(self, message: str, offset: int) -> None:
        why = _FRAME_DESYNC.get(message)
        if why is not None:
            self.report._add("dangerous", f"{message}: {why}", self.where, offset)
            return
        self.report._add("suspicious", message, self.where, offset)

    def proto(self, protocol: int, offset: int) -> None:
        self.protocol = protocol


#: The tensor rebuilds whose last argument is a state torch applies with setattr.
_STATE_REBUILDS: Final = {
    "torch._utils._rebuild_parameter_with_state",
    "torch._tensor._rebuild_from_type_v2",
}

#: Callables that return a tensor: a BUILD on their result runs ``Tensor.__setstate__``.
#: ``Parameter(tensor)`` is how no torch.save writes a parameter, but weights_only allows it.
_TENSOR_MAKERS: Final = REBUILDS | {
    ("torch.nn.parameter", "Parameter"),
    ("torch.nn", "Parameter"),
    ("torch", "Tensor"),
    ("torch._tensor", "Tensor"),
}

#: Callables whose results pickles fill with SETITEM(S)/APPEND(S)/ADDITEMS: containers
#: (``OrderedDict`` is how torch.save writes every state dict).
_CONTAINERS: Final = {
    (module, name)
    for module in ("builtins", "__builtin__", "collections")
    for name in ("dict", "list", "set", "OrderedDict", "defaultdict", "Counter")
}


def _made_by(value: Any, makers: set[tuple[str, str]]) -> bool:
    """Whether ``value`` is what calling one of ``makers`` (``(module, name)`` globals) gave."""
    func = value.func if isinstance(value, _SymCall) else None
    return isinstance(func, _SymGlobal) and (func.module, func.name) in makers


def _maker(value: _SymCall) -> str:
    """The callable a call result came from, as findings name it."""
    func = value.func
    return f"{func.module}.{func.name}" if isinstance(func, _SymGlobal) else "a computed call"


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, _SymCall):
        return "<computed>"
    return f"<{type(value).__name__}>"


# --------------------------------------------------------------------------------------------
# Streams and containers.
# --------------------------------------------------------------------------------------------


def _looks_like_pickle(data: bytes, pos: int = 0) -> bool:
    """Whether CPython's unpickler would run the first opcode at ``pos``.

    The unpickler takes any opcode first (``M\x01\x00`` is the protocol 1 pickle of 1, and a
    leading ``BININT2; POP`` hides a GLOBAL from a list of usual first opcodes), and PROTO
    anywhere; only PROTO checks its operand. So every opcode counts.
    """
    if pos >= len(data):
        return False
    b = data[pos]
    if b == 0x80:
        return pos + 1 < len(data) and data[pos + 1] <= 5
    return b in OPNAMES


def _run_stream(
    report: ScanReport, data: bytes, pos: int, where: str, depth: int
) -> tuple[int | None, _ScanPolicy]:
    """Scan one stream; return its end, or None if it could not be parsed."""
    policy = _ScanPolicy(report, where, depth)
    left = MAX_OPS - report._ops
    if left <= 0:
        report._limited = True
        report._add(
            "suspicious",
            f"not analysed past byte {pos}: the {MAX_OPS} opcodes this scanner runs per file "
            "are spent; pickle.load has no such limit and reads on",
            where,
            pos,
        )
        return None, policy
    report.streams += 1
    try:
        result = Machine(data, policy, Limits(max_ops=left)).run(pos)
    except SafetensorError as exc:
        kind = getattr(exc, "kind", None)
        policy.truncated = kind == TRUNCATED
        if kind == LIMIT:
            # pickle.load has no such limits: what follows is read and run by a loader, and
            # not analysed here (a payload after a LONG4 of over 4 KiB, 100,001 MARKs...).
            report._limited = True
            report._add(
                "suspicious",
                f"not analysed past byte {exc.offset}, where a limit of this scanner stopped "
                f"it ({exc}); pickle.load has no such limit and reads on",
                where,
                exc.offset,
            )
        else:
            report._add("suspicious", f"{_PARSE_FAILED}: {exc}", where, exc.offset)
        return None, policy
    report._ops += result.ops
    return result.end, policy


def _scan_streams(report: ScanReport, data: bytes, where: str, depth: int, start: int = 0) -> None:
    """Scan every pickle stream of ``data`` from ``start`` to the end."""
    pos: int | None = start
    n = 0
    while pos is not None and pos < len(data):
        if n >= MAX_STREAMS:
            report._add(
                "suspicious",
                f"more than {MAX_STREAMS} pickle streams: the rest are not analysed",
                where,
                pos,
            )
            return
        if not _looks_like_pickle(data, pos):
            report._add(
                "suspicious",
                f"{len(data) - pos} bytes after the last pickle stream are not a pickle",
                where,
                pos,
            )
            return
        pos, _ = _run_stream(report, data, pos, f"{where}#{n}" if n else where, depth)
        n += 1


def _legacy_records(
    report: ScanReport, data: bytes, pos: int, keys: Any, pids: list[Any], where: str
) -> int | None:
    """Skip a legacy checkpoint's raw storage records; return where they end."""
    sizes: dict[str, int] = {}
    for pid in pids:
        if type(pid) is tuple and len(pid) >= 5 and isinstance(pid[1], _SymGlobal):
            cls = pid[1].name
            dtype = STORAGE_CLASSES.get(cls, "uint8" if cls == "UntypedStorage" else "")
            if dtype and type(pid[2]) is str:
                sizes[pid[2]] = TORCH_DTYPES[dtype][1]
    if type(keys) is not list:
        return None
    for key in keys:
        itemsize = sizes.get(key) if type(key) is str else None
        if itemsize is None or pos + 8 > len(data):
            return None
        (count,) = struct.unpack_from("<q", data, pos)
        if count < 0 or pos + 8 + count * itemsize > len(data):
            return None
        pos += 8 + count * itemsize
    return pos


def _scan_pickle_file(report: ScanReport, data: bytes, where: str, depth: int) -> bool:
    """A raw pickle or a legacy checkpoint: five pickles, raw records, maybe more pickles.

    Returns:
        Whether the first stream parsed up to its STOP.
    """
    pos, _ = _run_stream(report, data, 0, where, depth)
    if pos is None:
        return False
    if _is_legacy(data):
        report.format = "legacy" if depth == 0 else report.format
        keys: Any = None
        pids: list[Any] = []
        for i in range(1, 5):
            if pos is None or not _looks_like_pickle(data, pos):
                report._add("suspicious", "legacy checkpoint with missing pickles", where, pos)
                return True
            start = pos
            pos, policy = _run_stream(report, data, pos, f"{where}#{i}", depth)
            if i == 4 and pos is not None:
                try:
                    keys = Machine(data, _Values(), Limits()).run(start).value
                except SafetensorError:
                    keys = None
            if i == 3:
                pids = policy.pids
        if pos is None:
            return True
        end = _legacy_records(report, data, pos, keys, pids, where)
        if end is None:
            report._add("suspicious", "could not follow the legacy storage records", where, pos)
            return True
        pos = end
    if pos < len(data):
        _scan_streams(report, data, where, depth, pos)
    return True


class _Values(_ScanPolicy):
    """Plain values only; anything else makes the value unusable (raises)."""

    def __init__(self) -> None:
        super().__init__(ScanReport(""), "", 0)

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        raise SafetensorError("not a plain value")


def _scan_bytes(
    report: ScanReport, data: bytes, where: str, depth: int, *, pickled: bool = False
) -> None:
    """Scan bytes of unknown kind (a file, a member, a nested payload).

    Every reading that some loader may apply is scanned, never only the first that matches:
    ``torch.load`` reads a file that starts with a local header as a zip, tries any other file
    as a tar first (``tarfile`` takes any block with a valid header checksum, old V7 headers
    without ``ustar`` included) and unpickles it when that fails, and ``pickle.load`` reads any
    file from its first byte. A file that is several of these at once is graded by the worst.

    Args:
        pickled: Whether the caller scanned ``data`` as a pickle from its first byte already
            (a member torch unpickles by its name), so that it is not read so again.
    """
    containers: list[str] = []
    zip_at_0 = data[:4] == LOCAL_SIG
    if zip_at_0 or EOCD_SIG in data[-(22 + 0xFFFF) :]:
        containers.append("zip")
        if report.format == "unknown":
            report.format = "zip"
        if not zip_at_0 and _looks_like_pickle(data):
            # A pickle prepended to a zip: both sides are read by someone.
            report._add("suspicious", "data before the zip archive", where, 0)
            if not pickled:
                _scan_pickle_file(report, data, where, depth)
                pickled = True
        _scan_zip(report, data, where, depth)
    if _is_tar(data):
        containers.append("tar")
        if report.format == "unknown":
            report.format = "tar"
        _scan_tar(report, data, where, depth)
    if len(containers) > 1:
        report._add("suspicious", "a file that is both a zip and a tar archive", where, 0)
    safetensors = depth == 0 and len(data) >= 10 and data[8:9] == b"{"
    if safetensors:
        (n,) = struct.unpack_from("<Q", data, 0)
        safetensors = 8 + n <= len(data)
    if containers:
        if safetensors:
            report._add(
                "suspicious", f"a safetensors-shaped file that is also a {containers[0]}", where, 0
            )
        # A tar's first bytes are a member name, and a zip may have anything before it: they
        # can be a pickle as well, which pickle.load of the file (and torch.load, when
        # tarfile refuses the file after all) runs. A file that starts with a zip local header
        # starts with PERSID, which every unpickler without persistent_load refuses at once,
        # and torch.load reads it as a zip.
        if not pickled and not zip_at_0 and _probe(report, data, where, depth, keep_clean=False):
            report._add("suspicious", f"a {containers[0]} file that is also a pickle", where, 0)
        return
    if safetensors:
        # A safetensors file holds no pickle, but its first bytes (the header length) are
        # often a valid opcode, and they can start a pickle that imports or calls before
        # failing: graded by what such a pickle would do, not by the file's shape.
        if not _probe(report, data, where, depth, keep_clean=False):
            report.format = "safetensors"
            return
        report.format = "pickle"
        report._add("suspicious", "a safetensors-shaped file that is also a pickle", where, 0)
        return
    npy = _npy_header(data)
    if npy is not None:
        if report.format == "unknown":
            report.format = "npy"
        _scan_npy(report, data, npy, where, depth, complete=True)
        # pickle.load of the file itself meets STACK_GLOBAL (the magic's first byte) on an
        # empty stack and stops having run nothing; kept only if that ever changes.
        _probe(report, data, where, depth, keep_clean=False)
        return
    if _looks_like_pickle(data):
        if report.format == "unknown":
            report.format = "pickle"
        _scan_pickle_file(report, data, where, depth)
        return
    report._add("suspicious", "not a pickle, zip or tar file", where, 0)


def _npy_header(data: bytes) -> tuple[int, bool | None] | None:
    """Where a ``.npy`` file's data starts and whether numpy unpickles it, if it is one.

    ``numpy.load`` (and ``numpy.lib.format.read_array``) reads an array of a dtype that holds
    Python objects with ``pickle.load`` from right after the header, when ``allow_pickle=True``;
    any other array is raw bytes. The header is read as numpy reads it (a Python literal
    ``dict`` whose ``descr`` is the dtype). Returns None when ``data`` is not a ``.npy`` numpy
    reads (no magic, an unknown version, a header past the end), else ``(data offset,
    has_object)``; ``has_object`` is None when the header cannot be read here (too long, or
    not a literal this reader takes), so that the data is scanned as a possible pickle.
    """
    if data[: len(_NPY_MAGIC)] != _NPY_MAGIC or len(data) < 10:
        return None
    version = (data[6], data[7])
    if version not in _NPY_VERSIONS:
        return None
    fmt, encoding = _NPY_VERSIONS[version]
    size_at = 8 + struct.calcsize(fmt)
    if size_at > len(data):
        return None
    (header_len,) = struct.unpack_from(fmt, data, 8)
    start = size_at + header_len
    if start > len(data):
        return None
    if header_len > _NPY_MAX_HEADER:
        return start, None
    try:
        import numpy as np

        header = ast.literal_eval(bytes(data[size_at:start]).decode(encoding))
        if type(header) is not dict or "descr" not in header:
            return start, None
        return start, bool(np.lib.format.descr_to_dtype(header["descr"]).hasobject)
    except Exception:  # noqa: BLE001 - hostile headers fail in many ways: scan the data instead
        return start, None


def _scan_npy(
    report: ScanReport,
    data: bytes,
    header: tuple[int, bool | None],
    where: str,
    depth: int,
    *,
    complete: bool,
) -> bool:
    """Scan the pickle a ``.npy`` file (or ``.npz`` member) holds, as ``numpy.load`` reads it.

    An object array is one pickle stream after the header, which ``numpy.load(...,
    allow_pickle=True)`` runs: it is scanned like any pickle, so one that does not parse is
    suspicious. Data of a header this reader cannot parse is kept only when it starts a pickle
    that imports or calls something; raw numeric data is not a pickle numpy runs.

    Args:
        header: What :func:`_npy_header` read of ``data``.
        complete: Whether ``data`` is the whole file or member; a prefix only decides whether
            the rest is needed.

    Returns:
        Whether the whole of ``data`` is needed (an object array, or an unknown header) and
        ``complete`` was False, in which case nothing was scanned.
    """
    start, has_object = header
    if has_object is False:
        return False
    if not complete:
        return True
    if has_object:
        end, _ = _run_stream(report, data, start, where, depth)
        if end is not None and end < len(data):
            _scan_streams(report, data, where, depth, end)
        return False
    if _looks_like_pickle(data, start):
        parsed = report._child()
        end, _ = _run_stream(parsed, data, start, where, depth)
        _keep_probe(report, parsed, end is not None, keep_clean=False)
    return False


def _is_tar(data: bytes) -> bool:
    """Whether ``tarfile`` (and so ``torch.load``'s first attempt) takes ``data`` for a tar.

    ``tarfile`` accepts a first block whose header checksum is right, whatever else it holds:
    old V7 headers have no ``ustar`` magic, and the file's first bytes (the first member's
    name) can be anything. This is the check ``tarfile.open`` makes on the first block.
    """
    if len(data) < tarfile.BLOCKSIZE:
        return False
    try:
        tarfile.TarInfo.frombuf(bytes(data[: tarfile.BLOCKSIZE]), "utf-8", "surrogateescape")
    except (tarfile.HeaderError, ValueError, OverflowError):
        return False
    return True


def _probe(report: ScanReport, data: bytes, where: str, depth: int, *, keep_clean: bool) -> bool:
    """Scan bytes that may or may not be meant as a pickle; keep the result if it matters.

    See :func:`_keep_probe`. Returns whether the result was kept.
    """
    if not _looks_like_pickle(data):
        return False
    parsed = report._child()
    first_ok = _scan_pickle_file(parsed, data, where, depth)
    return _keep_probe(report, parsed, first_ok, keep_clean=keep_clean)


def _keep_probe(
    report: ScanReport, parsed: ScanReport, first_ok: bool, *, keep_clean: bool
) -> bool:
    """Merge ``parsed`` into ``report`` when the pickle it scanned matters; return whether.

    It matters when it imports anything or does something dangerous before it stops, whether
    it parses to the end or not (the unpickler acts on each opcode as it reads it), when it
    stopped at a limit of the scanner (the unpickler would read on, into what was not
    analysed), or, with ``keep_clean``, when its first stream parses to STOP. Bytes that only
    fail to parse are dropped: the unpickler raises on them having imported and called nothing.
    """
    active = bool(parsed.globals) or parsed._unlisted > 0 or parsed._limited
    active = active or any(f.grade == "dangerous" for f in parsed.findings)
    if active or (keep_clean and first_ok):
        report._merge(parsed)
        return True
    return False


def _bounded(data: bytes, end: int | None = None) -> BoundedFile:
    """A file over bytes or a mapping, up to ``end``, for ``tarfile`` and ``zipfile``."""
    size = len(data) if end is None else min(end, len(data))
    return BoundedFile(lambda at, n: bytes(data[at : at + n]), size)


def _scan_zip(report: ScanReport, data: bytes, where: str, depth: int) -> None:
    eocd = _miniz_eocd(data)
    try:
        # zipfile is shown the file up to the end record torch's reader uses: a signature after
        # it (in the archive comment) is where zipfile would look, and not torch.
        view = _bounded(data, None if eocd is None else eocd + EOCD.size)
        with zipfile.ZipFile(cast(Any, view)) as zf:
            infos = zf.infolist()
            start = zf.start_dir
    except Exception as exc:  # zipfile raises many types on hostile input
        report._add("suspicious", f"unreadable zip directory ({exc})", where)
        return
    problem = None if eocd is None else _directory_disagreement(data, eocd, start)
    if problem:
        report._add("dangerous", problem, where)
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        report._add("suspicious", "duplicate zip member names", where)
    elif len({caseless(n) for n in names}) != len(names):
        # torch's reader finds members ignoring ASCII case: which one it reads is its choice.
        report._add("suspicious", "zip member names that differ only in case", where)
    # torch's reader takes the archive's folder from its first record: members under other
    # folders (or beside it, at the top) are ones torch never reads but another tool might. A
    # zip with every member at the top (an .npz: one .npy per array) has no folder to differ.
    folders = {n.split("/", 1)[0] for n in names if "/" in n}
    at_top = sorted(n for n in names if "/" not in n)
    if len(folders) > 1 or (folders and at_top):
        shown = sorted(folders)[:4] + at_top[: max(0, 4 - len(folders))]
        report._add("suspicious", f"zip members under several folders {shown}", where)
    for info in infos:
        member = f"{where}:{info.filename}"
        folded = caseless(info.filename)
        if "constants.pkl" in folded or "/code/" in folded:
            report._add("dangerous", "TorchScript archive (torch.jit.load runs its code)", member)
        try:
            _scan_member(report, data, info, member, depth)
        except (ValueError, zlib.error, struct.error) as exc:
            report._add("suspicious", f"member could not be read ({exc})", member)


def _miniz_eocd(data: bytes) -> int | None:
    """Where the end record is that torch's zip reader (miniz) uses, if it finds one.

    miniz takes the last signature with a whole record after it, searching back about 64 KiB
    from the end in blocks of 4 KiB. ``zipfile`` takes the last signature in the last 64 KiB
    and refuses the file when no whole record follows it (a signature in the comment).
    """
    tail_at = max(len(data) - (EOCD.size + 0xFFFF + 4096), 0)
    tail = bytes(data[tail_at:])
    idx = tail.rfind(EOCD_SIG)
    while idx >= 0 and len(tail) - idx < EOCD.size:
        idx = tail.rfind(EOCD_SIG, 0, idx + 3)
    return None if idx < 0 else tail_at + idx


def _directory_disagreement(data: bytes, eocd: int, zipfile_start: int) -> str | None:
    """Why torch's zip reader and Python's ``zipfile`` may read different members, if they may.

    torch reads zips with miniz, which takes the central directory at the offset its end
    record (at ``eocd``) states, or the zip64 record's, which miniz finds through the locator.
    ``zipfile`` assumes the directory ends right before the end records and, when the stated
    offset says otherwise, takes the difference for data prepended to the archive and shifts
    every offset by it. A file with two directories, one where the end record points and one
    right before it, is two archives: the scanner would list one, torch load the other. Real
    archives have no such gap (``zipfile_start`` is where ``zipfile`` read the directory).
    """
    records = end_records(lambda at, n: bytes(data[at : at + n]), len(data), eocd)
    miniz, view = records.miniz, records.zipfile
    if records.locator is not None and (miniz.offset, miniz.size) != (view.offset, view.size):
        return (
            f"the zip64 end record is read at offset {records.locator - ZIP64_EOCD.size} by "
            f"Python's zipfile and at offset {records.located} by torch's reader (miniz), and "
            "they place the central directory differently: they may see different members"
        )
    gap = view.records - view.size - view.offset
    if gap != 0 or zipfile_start != view.offset:
        return (
            f"the zip's end record places the central directory at offset {view.offset}, and "
            f"{gap} bytes lie between its end and the end record: torch's reader (miniz) reads "
            f"the directory at the stated offset, Python's zipfile at offset {zipfile_start} "
            "(it takes the gap for data prepended to the archive and shifts every offset by "
            "it), so the two may see different members"
        )
    return None


def _scan_member(
    report: ScanReport, data: bytes, info: zipfile.ZipInfo, member: str, depth: int
) -> None:
    """One zip member: a pickle by name is always scanned, any other one when it acts.

    ``*.pkl`` members (``data.pkl``, ``constants.pkl``) are what torch unpickles: they are
    scanned whatever their first byte, so one that does not parse is suspicious, never
    skipped. Tensor storages (``data/N``) are raw bytes that torch reads and never unpickles:
    see :func:`_grade_storage`. Any other member (``version``, a pickle under another name) is
    kept when it starts a pickle that imports or calls something (someone may unpickle it), or
    when it is a pickle that parses.
    """
    base = info.filename.rsplit("/", 1)[-1]
    if base.lower().endswith(".pkl"):
        content, complete = _zip_member(data, info, MAX_PICKLE_BYTES)
        if not complete:
            report._add("suspicious", f"pickle over {MAX_PICKLE_BYTES} bytes; not analysed", member)
            return
        _scan_pickled_member(report, content, member, depth)
        return
    rel = info.filename.split("/", 1)[-1]
    key = rel[5:]
    is_storage = rel.startswith("data/") and key.isascii() and key.isdigit()
    # Only the bytes the first stream needs are read: a multi-GB tensor member is not copied
    # to find that its first opcode is not followed by a valid one.
    window = _PROBE_WINDOW
    content, complete = _zip_member(data, info, window)
    kind = None if is_storage else _archive_kind(content)
    if kind is not None and _scan_archive_member(report, data, info, kind, member, depth):
        return
    # Not an archive, or one past a limit of this scanner: its bytes are still probed as a
    # pickle (a tar's first bytes are a member name, which can be one).
    npy = _npy_header(content)
    if npy is not None or (not complete and content[: len(_NPY_MAGIC)] == _NPY_MAGIC):
        # An .npz member: numpy.load unpickles an object array's data after the header.
        if npy is None or _scan_npy(report, content, npy, member, depth, complete=complete):
            content, complete = _zip_member(data, info, MAX_PICKLE_BYTES)
            if not complete:
                report._add(
                    "suspicious", f"npy member over {MAX_PICKLE_BYTES} bytes; not analysed", member
                )
                return
            npy = _npy_header(content)
            if npy is not None:
                _scan_npy(report, content, npy, member, depth, complete=True)
        return
    while True:
        if not _looks_like_pickle(content):
            return
        first = report._child()
        end, policy = _run_stream(first, content, 0, member, depth)
        if end is None and policy.truncated and not complete and window < MAX_PICKLE_BYTES:
            window = min(window * 8, MAX_PICKLE_BYTES)
            content, complete = _zip_member(data, info, window)
            continue
        break
    if is_storage:
        _grade_storage(report, first, whole=complete and end == len(content), where=member)
        return
    parsed = report._child()
    if end is not None and not complete:
        # The first stream parsed: later streams may follow anywhere in the member.
        content, complete = _zip_member(data, info, MAX_PICKLE_BYTES)
    if not complete:
        parsed._add(
            "suspicious", f"only the first {len(content)} bytes of the member analysed", member
        )
    first_ok = _scan_pickle_file(parsed, content, member, depth)
    _keep_probe(report, parsed, first_ok, keep_clean=True)


def _grade_storage(report: ScanReport, first: ScanReport, *, whole: bool, where: str) -> None:
    """Grade a tensor storage member (``data/N``) by the first pickle stream read from it.

    torch.load reads storages as raw tensor bytes and never unpickles them (of a checkpoint's
    members it unpickles ``data.pkl`` only), and raw bytes often start with an opcode that
    imports: EXT1, EXT2 and EXT4 are bytes 0x82-0x84, so about one float32 storage in 85
    starts with one. A prefix that imports and then fails is no sign of anything there, and a
    storage is never graded dangerous: nothing in it runs. Only a storage that is one whole
    pickle (its first stream ends at a STOP that is its last byte) importing or calling
    something is reported, as suspicious: torch.save never writes one, and random tensor
    bytes practically never are one.
    """
    if not whole:
        return
    dangerous = [f.message for f in first.findings if f.grade == "dangerous"]
    if not (first.globals or first._unlisted or dangerous):
        return
    names = sorted({g.qualname for g in first.globals})
    detail = f"importing {first_five(names)}"
    report._add(
        "suspicious",
        f"a tensor storage member is a whole pickle ({detail if names else dangerous[0]}): "
        "torch.load reads it as raw tensor bytes and never unpickles it, but torch.save never "
        "writes one",
        where,
        0,
    )


def _archive_kind(head: bytes) -> str | None:
    """``zip`` or ``tar`` when the bytes of a member (or their first 64 KiB) are an archive a
    loader opens as such (``torch.load`` opens a zip only when it starts with a local header),
    else None."""
    if head[:4] == LOCAL_SIG:
        return "zip"
    return "tar" if _is_tar(head) else None


def _scan_pickled_member(report: ScanReport, content: bytes, where: str, depth: int) -> None:
    """A member that a loader unpickles by its name (a ``*.pkl`` zip member, a tar
    checkpoint's member): read as a pickle whatever else it is, and as an archive too when it
    is one (``torch.save(model, "model.pkl")`` writes a zip under a pickle's name).

    The pickle reading comes first and is never skipped: it was made only when the member was
    not an archive, so a ``data.pkl`` that ``tarfile`` takes for a tar (any block with a right
    checksum, its name field a pickle) was not read at all once a limit skipped the archive
    reading (256 tiny zips before it), and graded suspicious where ``torch.load`` runs it.
    """
    kind = _archive_kind(content)
    if kind == "zip":
        # A zip's first byte is PERSID, which every unpickler refuses (none has a
        # persistent_load that takes a string): kept only if it acts, as in _scan_bytes.
        _probe(report, content, where, depth, keep_clean=False)
    else:
        _scan_pickle_file(report, content, where, depth)
    if kind is not None and _may_scan_archive(report, kind, len(content), where, depth):
        _scan_bytes(report, content, where, depth + 1, pickled=True)


def _may_scan_archive(report: ScanReport, kind: str, size: int, where: str, depth: int) -> bool:
    """Whether an archive held by a member (of ``size`` bytes) is scanned as one, under the
    caps of nested pickles: :data:`MAX_NESTING` levels, :data:`MAX_NESTED_SCANS` per file,
    :data:`MAX_PICKLE_BYTES` each, and :data:`MAX_NESTED_ARCHIVE_BYTES` all together, which
    ``size`` is charged to. When it is not, a finding says so: an archive inside a zip (a
    checkpoint in a zipped model folder) was probed as a pickle only, and graded safe
    whatever it held.
    """
    spent = report._spent
    if depth >= MAX_NESTING:
        why = f"more than {MAX_NESTING} levels deep"
    elif size > MAX_PICKLE_BYTES:
        why = f"over {MAX_PICKLE_BYTES} bytes"
    elif report._nested_scans >= MAX_NESTED_SCANS:
        why = f"past the {MAX_NESTED_SCANS} nested pickles and archives scanned per file"
    elif spent.nested_archive_bytes + size > MAX_NESTED_ARCHIVE_BYTES:
        why = f"past the {MAX_NESTED_ARCHIVE_BYTES} bytes of nested archives read per file"
    else:
        report._nested_scans += 1
        spent.nested_archive_bytes += size
        return True
    report._add("suspicious", f"nested archive ({kind}) {why}: not analysed", where)
    return False


def _scan_archive_member(
    report: ScanReport, data: bytes, info: zipfile.ZipInfo, kind: str, member: str, depth: int
) -> bool:
    """Scan a zip member that is itself a zip or tar (its every reading, see
    :func:`_scan_bytes`), its members named ``member:inner``.

    Returns:
        Whether it was scanned; when not (past a limit, which a finding says), the caller
        still reads it as it reads any member.
    """
    stored = info.compress_type == zipfile.ZIP_STORED
    declared = info.compress_size if stored else info.file_size
    # Sizes first: a member known too large is not read (nor inflated) to learn it. The size
    # declared is what is charged, so no more than it is read.
    if not _may_scan_archive(report, kind, declared, member, depth):
        return False
    content, complete = _zip_member(data, info, declared)
    if not complete:
        report._add(
            "suspicious",
            f"nested archive ({kind}) inflates past the {declared} bytes its header declares: "
            "not analysed",
            member,
        )
        return False
    _scan_bytes(report, content, member, depth + 1)
    return True


def _zip_member(data: bytes, info: zipfile.ZipInfo, limit: int) -> tuple[bytes, bool]:
    """The first ``limit`` bytes of a member, and whether that is all of it.

    Read like torch's reader: no CRC, flag or local-name checks.
    """
    hdr = info.header_offset
    if hdr + 30 > len(data) or data[hdr : hdr + 4] != LOCAL_SIG:
        raise ValueError("no local header")
    nlen, xlen = struct.unpack_from("<HH", data, hdr + 26)
    start = hdr + 30 + nlen + xlen
    if info.flag_bits & 0x1:
        raise ValueError("encrypted member")
    if start + info.compress_size > len(data):
        raise ValueError("member runs past the end of the file")
    if info.compress_type == zipfile.ZIP_STORED:
        return data[start : start + min(info.compress_size, limit)], info.compress_size <= limit
    if info.compress_type == zipfile.ZIP_DEFLATED:
        # The converter's zip bomb rule: the declared ratio is checked before inflating
        # anything, and the real output is capped at the same ratio, since the declared size
        # may lie.
        cap = MAX_DEFLATE_RATIO * max(info.compress_size, 1024)
        if info.file_size > cap:
            raise ValueError(
                f"declares {info.file_size} bytes from {info.compress_size}: compression ratio "
                f"over {MAX_DEFLATE_RATIO} (possible zip bomb); not inflated"
            )
        # One byte over what is wanted tells whether there is more.
        out = _inflate_head(data, start, info.compress_size, min(limit, cap) + 1)
        if len(out) > cap:
            raise ValueError(f"inflates past {cap} bytes (possible zip bomb)")
        if len(out) > limit:
            return out[:limit], False
        return out, True
    raise ValueError(f"compression method {info.compress_type}")


#: Compressed bytes handed to the decompressor at a time (see :func:`_inflate_head`).
_INFLATE_STEP: Final = 1 << 20


def _inflate_head(data: bytes, start: int, size: int, want: int) -> bytes:
    """The first ``want`` bytes (fewer if it is shorter) that the raw DEFLATE stream
    ``data[start:start + size]`` inflates to.

    The compressed bytes are fed :data:`_INFLATE_STEP` at a time, so memory holds one step and
    the output: the whole compressed member used to be copied out of the mapping, and kept a
    second time as the decompressor's unconsumed input, even to read a 64 KiB probe (2.3 GB
    to scan an 800 MB ``np.savez_compressed`` file). The converter streams members the same
    way (``ZipView._inflate``), from a file rather than from bytes or a mapping.
    """
    dec = zlib.decompressobj(-15)
    parts: list[bytes] = []
    got, pos, end = 0, start, start + size
    while got < want and not dec.eof:
        piece = dec.unconsumed_tail
        if not piece and pos < end:
            piece = data[pos : min(pos + _INFLATE_STEP, end)]
            pos += len(piece)
        out = dec.decompress(piece, want - got)
        if not out and not piece:
            break  # every input byte taken and nothing held back
        parts.append(out)
        got += len(out)
    return b"".join(parts)


def _scan_tar(report: ScanReport, data: bytes, where: str, depth: int) -> None:
    try:
        with tarfile.open(fileobj=cast(Any, _bounded(data)), mode="r:") as tar:
            _scan_tar_members(report, tar, where, depth)
    except (tarfile.TarError, EOFError, ValueError, OSError) as exc:
        report._add("suspicious", f"unreadable tar ({exc})", where)


def _scan_tar_members(report: ScanReport, tar: tarfile.TarFile, where: str, depth: int) -> None:
    seen: set[str] = set()
    for m in tar.getmembers():
        member = f"{where}:{m.name}"
        if m.name in seen:
            report._add("suspicious", "duplicate tar member", member)
        seen.add(m.name)
        unknown = m.type not in tarfile.SUPPORTED_TYPES
        if not m.isfile() and not unknown:
            if m.issym() or m.islnk():
                report._add("suspicious", "link in a checkpoint tar", member)
            continue
        # tarfile reads and extracts a member of an unknown type as a regular file (torch's
        # legacy loader extracts "storages" and unpickles it): scanned as one. A sparse member
        # is extracted chunk by chunk, later chunks over earlier ones, where extractfile reads
        # the first chunk of each place: the bytes scanned need not be the bytes torch loads.
        # torch.save writes neither.
        if unknown:
            report._add("suspicious", f"tar member of unknown type {m.type!r}", member)
        if m.sparse is not None:
            report._add("suspicious", "sparse tar member (read and extracted unlike)", member)
        f = tar.extractfile(m)
        if f is None or m.size > MAX_PICKLE_BYTES:
            report._add("suspicious", "member too large or unreadable", member)
            continue
        content = f.read()
        if m.name in ("storages", "tensors"):
            _scan_tar_table(report, content, member, depth, m.name == "tensors")
        else:
            _scan_pickled_member(report, content, member, depth)


def _scan_tar_table(report: ScanReport, data: bytes, where: str, depth: int, tensors: bool) -> None:
    """``storages``/``tensors`` of a tar checkpoint: pickles interleaved with raw records."""
    pos, _ = _run_stream(report, data, 0, where, depth)
    try:
        count = Machine(data, _Values(), Limits()).run(0).value
    except SafetensorError:
        count = None
    if pos is None or type(count) is not int or count < 0:
        report._add("suspicious", "could not follow the tar records", where, 0)
        return
    for i in range(count):
        if i >= MAX_STREAMS:
            report._add("suspicious", f"more than {MAX_STREAMS} tar records", where, pos)
            return
        start = pos
        pos, policy = _run_stream(report, data, pos, where, depth)
        if pos is None:
            return
        try:
            args = Machine(data, _Records(), Limits()).run(start).value
            if tensors:
                (ndim,) = struct.unpack_from("<i", data, pos)
                if ndim < 0 or ndim > 64:
                    raise ValueError
                pos += 8 + 16 * ndim + 8
            else:
                # (key, location, storage class): every part comes from the file, checked.
                if type(args) is not tuple or len(args) < 3:
                    raise ValueError
                stype = args[2]
                if not isinstance(stype, _SymGlobal) or stype.name not in STORAGE_CLASSES:
                    raise ValueError
                itemsize = TORCH_DTYPES[STORAGE_CLASSES[stype.name]][1]
                (n,) = struct.unpack_from("<q", data, pos)
                if n < 0:
                    raise ValueError
                pos += 8 + n * itemsize
        except (SafetensorError, ValueError, TypeError, KeyError, IndexError, struct.error):
            report._add("suspicious", "could not follow the tar records", where, pos)
            return
        if pos > len(data):
            report._add("suspicious", "tar record runs past the end", where, pos)
            return
    if pos < len(data):
        _scan_streams(report, data, where, depth, pos)


class _Records(_Values):
    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        return _SymGlobal(module, name)


def scan_bytes(data: bytes, name: str = "<bytes>") -> ScanReport:
    """Scan an in-memory file (see :func:`scan_file`); never raises on its content.

    Args:
        data: The file's bytes.
        name: What the report calls it.

    Returns:
        A :class:`ScanReport`.
    """
    report = ScanReport(name)
    where = os.path.basename(name) or name
    try:
        _scan_bytes(report, data, where, 0)
    except Exception as exc:  # noqa: BLE001 - hostile input must give a verdict, not a crash
        # A scanner bug or exhaustion on hostile bytes: the file was not fully analysed,
        # which is never safe. What was found before stays in the report.
        report._add(
            "suspicious", f"scan stopped by an internal error ({type(exc).__name__}: {exc})", where
        )
    return report


def scan_file(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> ScanReport:
    """List every global a pickle or PyTorch checkpoint imports, graded, without running it.

    Args:
        path: A pickle, a PyTorch checkpoint (zip, legacy or tar), or any zip holding pickles.
        max_bytes: Files larger than this are not read (reported as not analysable); None (the
            default): no limit. Zip, legacy, tar and safetensors files are read in place through
            a mapping, touching only their pickles, whatever their size (a tar member over 1 GiB
            is not analysed); a file of any other kind over 1 GiB is not analysed as a pickle.

    Returns:
        A :class:`ScanReport`; ``report.grade`` is the verdict and ``report.exit_code`` the
        CLI's exit code (0 safe, 1 suspicious, 2 dangerous).

    Raises:
        OSError: The file cannot be read.
    """
    p = input_path(path, "path")
    if "://" in p:
        # Named without credentials or query string (a signed URL's signature).
        raise FileNotFoundError(
            errno.ENOENT,
            "URLs are not supported; download the file and scan the local copy",
            shown_location(p),
        )
    # Opened before anything else, without blocking on a FIFO (which has no writer when it
    # is a stray one in a folder given as `scan *`), and only if it is a regular file.
    with open(open_regular_file(p), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            report = ScanReport(p)
            report._add("suspicious", f"file larger than {max_bytes} bytes; not analysed", p)
            return report
        if size > MAX_PICKLE_BYTES:
            head = fh.read(tarfile.BLOCKSIZE)
            if not (_is_zip_or_safetensors(head) or _is_legacy(head[:64]) or _is_tar(head)):
                report = ScanReport(p)
                report._add("suspicious", "file too large to analyse as a pickle", p)
                return report
        if size == 0:
            return scan_bytes(b"", p)
        # Mapped, not read: a multi-GB checkpoint is scanned touching only its pickles.
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return scan_bytes(cast(bytes, mm), p)


def _is_zip_or_safetensors(head: bytes) -> bool:
    # Both are read in place through the mapping, touching only their pickles (a safetensors
    # file only as far as its first bytes parse as one): a 10 GB model is not "too large".
    return head[:4] == LOCAL_SIG or head[8:9] == b"{"


def _is_legacy(head: bytes) -> bool:
    # A legacy (pre-zip) checkpoint is five small pickles, then raw storage bytes: it is read
    # in place through the mapping like a zip, however large its storages are. Recognised by
    # its first pickle (within the file's first 64 bytes), the format's magic number: run
    # for a few opcodes only (a long first stream is not run through to learn it is not that).
    try:
        first = Machine(head, _Values(), _MAGIC_LIMITS).run(0).value
    except SafetensorError:
        return False
    return type(first) is int and first == LEGACY_MAGIC


def scan_files(paths: Iterable[str | os.PathLike[str]]) -> list[ScanReport]:
    """Scan several files, each to its own report, whatever happens to the others.

    A file that cannot be read (missing, a folder, no permission) or scanned gets a report of
    format ``error`` with one ``suspicious`` finding that says why, instead of an exception
    that would leave the other files unreported.

    Args:
        paths: The files.

    Returns:
        One :class:`ScanReport` per path, in order.
    """
    reports = []
    for path in paths:
        try:
            reports.append(scan_file(path))
        except Exception as exc:  # noqa: BLE001 - one file's failure is that file's verdict
            p = shown_location(
                os.fsdecode(os.fspath(path))
                if isinstance(path, (str, bytes, os.PathLike))
                else repr(path)
            )
            report = ScanReport(p, format="error")
            report._add("suspicious", f"could not be scanned ({type(exc).__name__}: {exc})", p)
            reports.append(report)
    return reports
