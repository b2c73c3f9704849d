"""Scan pickles and PyTorch checkpoints for the globals they would import, without running them.

:func:`scan_file` runs the converter's pickle stack machine in symbolic mode: every global
becomes an inert record and every call a symbolic node, so ``STACK_GLOBAL`` operands built
through the memo are just the stack values they are (``threat-model-and-pickle.md`` §3.5).
Each global is graded from an allow-list:

* ``safe``: what the torch-free converter (and torch's ``weights_only`` loader) accepts;
* ``dangerous``: known code-running, file, network or name-resolving callables;
* ``suspicious``: everything else, and anything the scanner could not fully analyse (parse
  errors, unreadable members, frame violations, calls of computed objects...).

Files are parsed the way their victims would parse them: every pickle stream of a file (legacy
checkpoints are five pickles plus raw data; extra streams after STOP are scanned), every zip
member that looks like a pickle by content whatever its name (CRC, flag bits and local-name
mismatches are ignored, as torch's reader ignores them), the members of 0.1.1 tar checkpoints,
and pickles nested inside ``pickle.loads``/``torch.load``-style calls.

Exit codes of ``pysafetensors scan``: 0 all safe, 1 suspicious (or not fully analysable),
2 dangerous.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, cast

from ._errors import SafetensorError
from ._pickle_vm import Limits, Machine
from ._torch_archive import MAX_DEFLATE_RATIO
from ._torch_pickle import _REBUILDS, _STORAGE_CLASSES, _TORCH_DTYPES, _UNCONVERTIBLE, _lookup

__all__ = ["GRADES", "Finding", "GlobalUse", "Grade", "ScanReport", "grade_global", "scan_file"]

Grade = Literal["safe", "suspicious", "dangerous"]
#: Grades from best to worst; a report's grade is the worst of its parts.
GRADES: Final[tuple[Grade, ...]] = ("safe", "suspicious", "dangerous")
_RANK: Final = {g: i for i, g in enumerate(GRADES)}

#: Largest pickle (file or member) analysed; bigger ones are reported as not analysable.
MAX_PICKLE_BYTES: Final = 1 << 30
#: How deep pickles nested in calls are followed.
MAX_NESTING: Final = 3

_EXTRA_SAFE: Final = frozenset(
    {
        "collections.Counter",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
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
    tarfile gzip bz2 lzma mmap site sysconfig _sitebuiltins inspect""".split()  # noqa: SIM905 - a word list reads better as text
)
_DANGEROUS_NAMES: Final = frozenset(
    {"numpy.load", "numpy.loads", "numpy.fromfile", "pandas.read_pickle", "pandas.read_csv"}
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
_SAFE_BUILTINS: Final = frozenset({"set", "frozenset", "bytearray", "complex", "slice"})


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
    if "." in name or any(p.startswith("__") for p in name.split(".")):
        return "dangerous"
    if any(p.startswith("__") for p in module.split(".")) and module != "__main__":
        return "dangerous"  # __builtins__-style lookups through a module path
    if module == "builtins":
        return "safe" if name in _SAFE_BUILTINS else "dangerous"
    if _lookup(module, name) is not None or (module, name) in _UNCONVERTIBLE:
        return "safe"
    if full in _EXTRA_SAFE:
        return "safe"
    if full in _DANGEROUS_NAMES or full in _NESTED_LOADERS:
        return "dangerous"
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in _DANGEROUS_MODULES:
            return "dangerous"
    return "suspicious"


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
class ScanReport:
    """The result of scanning one file."""

    path: str
    format: str = "unknown"
    """``zip``, ``legacy``, ``pickle``, ``tar`` or ``unknown``."""
    globals: list[GlobalUse] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    streams: int = 0
    """Pickle streams analysed."""

    @property
    def grade(self) -> Grade:
        """The worst grade of any global or finding (``safe`` when there are none)."""
        worst = 0
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

    def _add(self, grade: Grade, message: str, where: str, offset: int | None = None) -> None:
        self.findings.append(Finding(grade, message, where, offset))


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
    def __init__(self, report: ScanReport, where: str, depth: int) -> None:
        self.report = report
        self.where = where
        self.depth = depth
        self.pids: list[Any] = []

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        grade = grade_global(module, name)
        self.report.globals.append(GlobalUse(module, name, grade, self.where, offset, opcode))
        if opcode == "INST" and grade == "safe":
            self.report._add("suspicious", f"INST opcode on {module}.{name}", self.where, offset)
        return _SymGlobal(module, name)

    def bad_stack_global(self, module: Any, name: Any, offset: int) -> Any:
        self.report.globals.append(
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
                        self._nested(bytes(arg), offset)
            if full == "torch._tensor._rebuild_from_type_v2":
                self._check_rebuild_func(args, offset)
        elif not isinstance(func, (_SymCall, _SymGlobal)):
            self.report._add(
                "suspicious", f"{opcode} on a {type(func).__name__} value", self.where, offset
            )
        else:  # pragma: no cover - covered by the first branch
            pass
        if isinstance(func, _SymCall):
            # Calling the result of a call: the getattr/getitem gadget pattern.
            self.report._add("suspicious", f"{opcode} calls a computed object", self.where, offset)
        if opcode in ("OBJ", "NEWOBJ_EX"):
            self.report._add("suspicious", f"{opcode} opcode", self.where, offset)
        return _SymCall(func, args)

    def _check_rebuild_func(self, args: Any, offset: int) -> None:
        # _rebuild_from_type_v2(func, type, args, state) calls func(*args): torch only ever
        # passes one of its rebuild functions. Anything else turns it into a call gadget.
        func = args[0] if type(args) is tuple and args else None
        if isinstance(func, _SymGlobal) and (
            (func.module, func.name) in _REBUILDS
            or (func.module == "torch._utils" and (func.module, func.name) in _UNCONVERTIBLE)
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

    def _nested(self, data: bytes, offset: int) -> None:
        if self.depth >= MAX_NESTING:
            self.report._add("suspicious", "nested pickles too deep", self.where, offset)
            return
        self.report._add("dangerous", "a nested pickle is loaded by a call", self.where, offset)
        _scan_bytes(self.report, data, f"{self.where}>nested@{offset}", self.depth + 1)

    def build(self, obj: Any, state: Any, offset: int) -> Any:
        if isinstance(obj, _SymGlobal):
            self.report._add(
                "dangerous",
                f"BUILD changes the attributes of {obj.module}.{obj.name}",
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

    def unhashable(self, key: Any, offset: int) -> Any:
        return _Opaque()

    def text(self, raw: bytes, offset: int) -> Any:
        return raw.decode("utf-8", "surrogateescape")

    def notice(self, message: str, offset: int) -> None:
        self.report._add("suspicious", message, self.where, offset)


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
    if pos >= len(data):
        return False
    b = data[pos]
    if b == 0x80:
        return pos + 1 < len(data) and data[pos + 1] <= 5
    # Protocol 0/1 pickles start with an ordinary opcode.
    return b in b"(}]cN)KJIXVSUTFGLi"


def _run_stream(
    report: ScanReport, data: bytes, pos: int, where: str, depth: int
) -> tuple[int | None, _ScanPolicy]:
    """Scan one stream; return its end, or None if it could not be parsed."""
    policy = _ScanPolicy(report, where, depth)
    report.streams += 1
    try:
        result = Machine(data, policy, Limits()).run(pos)
    except SafetensorError as exc:
        report._add("suspicious", f"pickle could not be fully parsed: {exc}", where, exc.offset)
        return None, policy
    return result.end, policy


def _scan_streams(report: ScanReport, data: bytes, where: str, depth: int, start: int = 0) -> None:
    """Scan every pickle stream of ``data`` from ``start`` to the end."""
    pos: int | None = start
    n = 0
    while pos is not None and pos < len(data):
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
            dtype = _STORAGE_CLASSES.get(cls, "uint8" if cls == "UntypedStorage" else "")
            if dtype and type(pid[2]) is str:
                sizes[pid[2]] = _TORCH_DTYPES[dtype][1]
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


def _scan_pickle_file(report: ScanReport, data: bytes, where: str, depth: int) -> None:
    """A raw pickle or a legacy checkpoint: five pickles, raw records, maybe more pickles."""
    pos, _ = _run_stream(report, data, 0, where, depth)
    if pos is None:
        return
    try:
        first = Machine(data, _Values(), Limits()).run(0).value
    except SafetensorError:
        first = None
    if first == 0x1950A86A20F9469CFC6C and type(first) is int:
        report.format = "legacy" if depth == 0 else report.format
        keys: Any = None
        pids: list[Any] = []
        for i in range(1, 5):
            if pos is None or not _looks_like_pickle(data, pos):
                report._add("suspicious", "legacy checkpoint with missing pickles", where, pos)
                return
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
            return
        end = _legacy_records(report, data, pos, keys, pids, where)
        if end is None:
            report._add("suspicious", "could not follow the legacy storage records", where, pos)
            return
        pos = end
    if pos < len(data):
        _scan_streams(report, data, where, depth, pos)


class _Values(_ScanPolicy):
    """Plain values only; anything else makes the value unusable (raises)."""

    def __init__(self) -> None:
        super().__init__(ScanReport(""), "", 0)

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        raise SafetensorError("not a plain value")


def _scan_bytes(report: ScanReport, data: bytes, where: str, depth: int) -> None:
    """Scan bytes of unknown kind (a file, a member, a nested payload)."""
    zip_at_0 = data[:4] == b"PK\x03\x04"
    if zip_at_0 or b"PK\x05\x06" in data[-(22 + 0xFFFF) :]:
        if report.format == "unknown":
            report.format = "zip"
        if not zip_at_0 and _looks_like_pickle(data):
            # A pickle prepended to a zip: both sides are read by someone.
            report._add("suspicious", "data before the zip archive", where, 0)
            _scan_pickle_file(report, data, where, depth)
        _scan_zip(report, data, where, depth)
        return
    if len(data) >= 262 and data[257:262] == b"ustar":
        if report.format == "unknown":
            report.format = "tar"
        _scan_tar(report, data, where, depth)
        return
    if _looks_like_pickle(data):
        if report.format == "unknown":
            report.format = "pickle"
        _scan_pickle_file(report, data, where, depth)
        return
    if depth == 0 and len(data) >= 10 and data[8:9] == b"{":
        (n,) = struct.unpack_from("<Q", data, 0)
        if 8 + n <= len(data):
            # A safetensors file holds no pickle; its header is validated by the reader.
            report.format = "safetensors"
            return
    report._add("suspicious", "not a pickle, zip or tar file", where, 0)


def _scan_zip(report: ScanReport, data: bytes, where: str, depth: int) -> None:
    try:
        with zipfile.ZipFile(_fileobj(data)) as zf:
            infos = zf.infolist()
    except Exception as exc:  # zipfile raises many types on hostile input
        report._add("suspicious", f"unreadable zip directory ({exc})", where)
        return
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        report._add("suspicious", "duplicate zip member names", where)
    prefixes = {n.split("/", 1)[0] for n in names}
    if len(prefixes) > 1:
        report._add(
            "suspicious", f"zip members under several folders {sorted(prefixes)[:4]}", where
        )
    for info in infos:
        member = f"{where}:{info.filename}"
        if any(n in info.filename for n in ("constants.pkl",)) or "/code/" in info.filename:
            report._add("dangerous", "TorchScript archive (torch.jit.load runs its code)", member)
        try:
            content = _zip_member(data, info)
        except (ValueError, zlib.error, struct.error) as exc:
            report._add("suspicious", f"member could not be read ({exc})", member)
            continue
        if not _looks_like_pickle(content):
            continue
        rel = info.filename.split("/", 1)[-1]
        is_storage = rel.startswith("data/") and rel[5:].isdigit()
        if is_storage:
            # Raw tensor bytes that happen to start like a pickle: torch never unpickles
            # them; report them only if they really are a clean pickle.
            probe = ScanReport(report.path)
            _scan_streams(probe, content, member, depth)
            if not any(f.message.startswith("pickle could not") for f in probe.findings):
                report.globals.extend(probe.globals)
                report.findings.extend(probe.findings)
                report.streams += probe.streams
            continue
        _scan_pickle_file(report, content, member, depth)


def _fileobj(data: bytes) -> Any:
    # An mmap is already a seekable file object; bytes need a wrapper.
    if isinstance(data, mmap.mmap):
        data.seek(0)
        return data
    return io.BytesIO(data)


def _zip_member(data: bytes, info: zipfile.ZipInfo) -> bytes:
    """A member's bytes read like torch's reader: no CRC, flag or local-name checks."""
    hdr = info.header_offset
    if hdr + 30 > len(data) or data[hdr : hdr + 4] != b"PK\x03\x04":
        raise ValueError("no local header")
    nlen, xlen = struct.unpack_from("<HH", data, hdr + 26)
    start = hdr + 30 + nlen + xlen
    if info.flag_bits & 0x1:
        raise ValueError("encrypted member")
    if start + info.compress_size > len(data):
        raise ValueError("member runs past the end of the file")
    raw = data[start : start + info.compress_size]
    if info.compress_type == zipfile.ZIP_STORED:
        return raw
    if info.compress_type == zipfile.ZIP_DEFLATED:
        # The converter's zip bomb rule (threat-model-and-pickle.md §1.2): the declared ratio
        # is checked before inflating anything, and the real output is capped at the same
        # ratio, since the declared size may lie.
        limit = MAX_DEFLATE_RATIO * max(info.compress_size, 1024)
        if info.file_size > limit:
            raise ValueError(
                f"declares {info.file_size} bytes from {info.compress_size}: compression ratio "
                f"over {MAX_DEFLATE_RATIO} (possible zip bomb); not inflated"
            )
        limit = min(limit, MAX_PICKLE_BYTES)
        dec = zlib.decompressobj(-15)
        out = dec.decompress(raw, limit)
        if dec.unconsumed_tail:
            raise ValueError(f"inflates past {limit} bytes (possible zip bomb)")
        return out
    raise ValueError(f"compression method {info.compress_type}")


def _scan_tar(report: ScanReport, data: bytes, where: str, depth: int) -> None:
    try:
        with tarfile.open(fileobj=_fileobj(data), mode="r:") as tar:
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
        if not m.isfile():
            if m.issym() or m.islnk():
                report._add("suspicious", "link in a checkpoint tar", member)
            continue
        f = tar.extractfile(m)
        if f is None or m.size > MAX_PICKLE_BYTES:
            report._add("suspicious", "member too large or unreadable", member)
            continue
        content = f.read()
        if m.name in ("storages", "tensors"):
            _scan_tar_table(report, content, member, depth, m.name == "tensors")
        else:
            _scan_pickle_file(report, content, member, depth)


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
    for _ in range(count):
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
                stype = args[2]
                itemsize = _TORCH_DTYPES[_STORAGE_CLASSES[stype.name]][1]
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
    """Scan an in-memory file (see :func:`scan_file`)."""
    report = ScanReport(name)
    _scan_bytes(report, data, os.path.basename(name) or name, 0)
    return report


def scan_file(path: str | os.PathLike[str], *, max_bytes: int = 64 << 30) -> ScanReport:
    """List every global a pickle or PyTorch checkpoint imports, graded, without running it.

    Args:
        path: A pickle, a PyTorch checkpoint (zip, legacy or tar), or any zip holding pickles.
        max_bytes: Files larger than this are not read (reported as not analysable).

    Returns:
        A :class:`ScanReport`; ``report.grade`` is the verdict and ``report.exit_code`` the
        CLI's exit code (0 safe, 1 suspicious, 2 dangerous).

    Raises:
        OSError: The file cannot be read.
    """
    p = os.fspath(path)
    size = os.path.getsize(p)
    if size > max_bytes:
        report = ScanReport(p)
        report._add("suspicious", f"file larger than {max_bytes} bytes; not analysed", p)
        return report
    if size > MAX_PICKLE_BYTES and not _is_zip(p):
        report = ScanReport(p)
        report._add("suspicious", "file too large to analyse as a pickle", p)
        return report
    with open(p, "rb") as fh:
        if size == 0:
            return scan_bytes(b"", p)
        # Mapped, not read: a multi-GB checkpoint is scanned touching only its pickles.
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return scan_bytes(cast(bytes, mm), p)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4)
    return head == b"PK\x03\x04"


def scan_files(paths: Iterable[str | os.PathLike[str]]) -> list[ScanReport]:
    """Scan several files."""
    return [scan_file(p) for p in paths]
