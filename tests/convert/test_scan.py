"""The scanner: grades, bypass tricks, and the CLI's exit codes (run as a real subprocess)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from pysafetensors import CheckpointError, SafetensorError
from pysafetensors.scan import grade_global, scan_file

from .corpus import (
    LEGACY_MAGIC,
    F32x4,
    P,
    cli,
    good_pickle,
    make_legacy,
    make_zip,
    payload,
    pid,
    state_dict,
    tensor,
    write_tar,
)


def _scan_with_peak(path: Path) -> tuple[Any, int]:
    """The report, and the most memory Python allocated at once while scanning."""
    import tracemalloc

    tracemalloc.start()
    try:
        report = scan_file(path)
        return report, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_grades() -> None:
    assert grade_global("torch._utils", "_rebuild_tensor_v2") == "safe"
    assert grade_global("collections", "OrderedDict") == "safe"
    assert grade_global("torch", "BFloat16Storage") == "safe"
    assert grade_global("os", "system") == "dangerous"
    assert grade_global("__builtin__", "eval") == "dangerous"
    assert grade_global("_operator", "attrgetter") == "dangerous"
    assert grade_global("torch.utils.collect_env", "run") == "dangerous"
    assert grade_global("numpy", "__builtins__") == "dangerous"
    assert grade_global("mylib.models", "Net") == "suspicious"
    # Value types a defaultdict or a protocol 0/1 object names run nothing of their own.
    for name in ("dict", "list", "tuple", "object", "set", "frozenset"):
        assert grade_global("builtins", name) == "safe", name
    for name in ("getattr", "type", "eval", "exec", "open", "__import__", "dict.fromkeys"):
        assert grade_global("builtins", name) == "dangerous", name
    assert grade_global("__main__", "Config") == "suspicious"
    assert grade_global("__main__", "__builtins__") == "dangerous"


@pytest.mark.parametrize(
    "full",
    [
        # Aliases of names graded dangerous, reached through another module.
        "_ctypes.dlopen",
        "pandas.io.pickle.read_pickle",
        "numpy.lib.npyio.load",
        "numpy.lib._npyio_impl.load",
        "torch._C.import_ir_module",
        # Code run or native code loaded.
        "imp.load_source",
        "_frozen_importlib_external.SourceFileLoader",
        "numpy.ctypeslib.load_library",
        "sympy.sympify",
        "sympy.parsing.sympy_parser.parse_expr",
        "Cython.Build.Inline.cython_inline",
        "mako.template.Template",
        "numexpr.evaluate",
        "torch._C._load_for_lite_interpreter",
        "torch._C._jit_script_compile",
        "torch._C._pickle_load_obj",
        "torch._C.CompilationUnit",
        "torch._C._abort",
        # Files read or written.
        "linecache.getline",
        "tokenize.open",
        "torch._C.PyTorchFileWriter",
        "torch._C._save_jit_module",
        "torch.from_file",
        "torch.save",
        "numpy.memmap",
        "numpy._core.multiarray.fromfile",
        "numpy.core.memmap.memmap",
    ],
)
def test_globals_that_run_code_or_read_files_are_dangerous(full: str) -> None:
    """They were graded suspicious, which convert --skip-unknown skips (nothing was called)
    and scan reported with exit 1, not 2: torch.load(weights_only=False) runs them."""
    module, _, name = full.rpartition(".")
    assert grade_global(module, name) == "dangerous"


def test_torch_c_functions_a_pickled_model_names_stay_suspicious() -> None:
    # A module holding torch.nn.functional.gelu pickles it as torch._C._nn.gelu.
    assert grade_global("torch._C._nn", "gelu") == "suspicious"
    assert grade_global("torch._C", "_VariableFunctions") == "suspicious"


def test_grade_pickled_global_reads_python_2_names_below_protocol_3() -> None:
    from pysafetensors.scan import grade_pickled_global

    assert grade_pickled_global("commands", "getoutput", 2) == "dangerous"
    assert grade_pickled_global("commands", "getoutput", 3) == "suspicious"  # no such module
    assert grade_pickled_global("UserDict", "UserDict", 2) == "suspicious"
    assert grade_pickled_global("numpy", "dtype") == "safe"
    assert grade_pickled_global("numpy._core.multiarray", "scalar") == "safe"


def test_clean_checkpoints_are_safe(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sd = {"w": torch.ones(2), "b": torch.zeros(2, dtype=torch.uint16)}
    torch.save(sd, tmp_path / "z.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "l.pt", _use_new_zipfile_serialization=False)
    for name, fmt, streams in (("z.pt", "zip", 1), ("l.pt", "legacy", 5)):
        report = scan_file(tmp_path / name)
        assert (report.grade, report.format, report.streams) == ("safe", fmt, streams)
        assert {g.qualname for g in report.globals} >= {"collections.OrderedDict"}


def test_stack_global_resolved_through_memo(tmp_path: Path) -> None:
    data = P.PROTO2 + P.u("os") + b"q\x01" + P.u("junk") + b"0" + P.u("system") + b"q\x02"
    data += b"0h\x01h\x02\x93" + P.u("id") + b"\x85R."
    report = scan_file(_write(tmp_path / "a.pkl", data))
    assert report.grade == "dangerous"
    assert [g.qualname for g in report.globals] == ["os.system"]
    assert report.globals[0].opcode == "STACK_GLOBAL"


def test_second_stream_and_broken_stream(tmp_path: Path) -> None:
    benign = pickle.dumps({"a": 1}, protocol=2)
    evil = P.PROTO2 + payload("subprocess", "call", tmp_path / "c") + b"."
    assert scan_file(_write(tmp_path / "two.pkl", benign + evil)).grade == "dangerous"
    # nullifAI: payload first, garbage after: still dangerous, plus a parse finding.
    broken = scan_file(_write(tmp_path / "broken.pkl", evil[:-1] + b"\xff"))
    assert broken.grade == "dangerous"
    assert any("could not be fully parsed" in f.message for f in broken.findings)


def test_zip_tricks(tmp_path: Path) -> None:
    evil = P.PROTO2 + payload("os", "system", tmp_path / "c") + b"."
    # A pickle under a non-pickle name, outside the usual data.pkl path.
    make_zip(tmp_path / "a.pt", good_pickle(), extra={"archive/notes/data.txt": evil})
    report = scan_file(tmp_path / "a.pt")
    assert report.grade == "dangerous"
    assert any(g.where.endswith("data.txt") for g in report.globals)
    # Bad CRC: torch ignores it, so the scanner reads the member anyway.
    make_zip(tmp_path / "b.pt", evil)
    raw = bytearray((tmp_path / "b.pt").read_bytes())
    cd = raw.find(b"PK\x01\x02")
    struct.pack_into("<I", raw, cd + 16, 0)
    struct.pack_into("<I", raw, 14, 0)
    assert scan_file(_write(tmp_path / "b.pt", bytes(raw))).grade == "dangerous"
    # A pickle prepended to a zip.
    make_zip(tmp_path / "c.pt", good_pickle())
    both = evil + (tmp_path / "c.pt").read_bytes()
    assert scan_file(_write(tmp_path / "c.pt", both)).grade == "dangerous"


def test_nested_pickle_is_scanned(tmp_path: Path) -> None:
    inner = P.PROTO2 + payload("os", "system", tmp_path / "c") + b"."
    outer = state_dict(
        [
            (
                "w",
                P.g("torch.storage", "_load_from_bytes")
                + b"C"
                + bytes([len(inner)])
                + inner
                + b"\x85R",
            )
        ]
    )
    make_zip(tmp_path / "n.pt", outer)
    report = scan_file(tmp_path / "n.pt")
    assert {"torch.storage._load_from_bytes", "os.system"} <= {g.qualname for g in report.globals}


def test_legacy_with_trailing_pickle(tmp_path: Path) -> None:
    make_legacy(tmp_path / "l.pt")
    data = (tmp_path / "l.pt").read_bytes() + P.PROTO2 + payload("os", "system", tmp_path / "c")
    report = scan_file(_write(tmp_path / "l.pt", data + b"."))
    assert report.format == "legacy"
    assert report.grade == "dangerous"
    assert LEGACY_MAGIC  # the file really starts with the legacy magic


def test_unknown_global_is_suspicious(tmp_path: Path) -> None:
    data = P.PROTO2 + P.g("mylib.models", "Net") + b")R."
    assert scan_file(_write(tmp_path / "s.pkl", data)).grade == "suspicious"


_MUTATED_TENSORS = {
    # Items stored into a tensor: the pattern of CVE-2026-24747.
    "SETITEM": tensor() + P.i(100) + P.u("x") + b"s",
    "SETITEMS": tensor() + b"(" + P.i(100) + P.u("x") + b"u",
    "APPENDS": tensor() + b"(" + P.i(100) + b"e",
    # Tensor.__setstate__'s legacy set_ state: the tensor pointed past its storage.
    "BUILD": tensor() + b"(" + pid() + P.i(1 << 20) + P.tup((1 << 16,)) + P.tup((1,)) + b"tb",
}


_OD = P.g("collections", "OrderedDict") + b")R"
_PARAMETER = P.g("torch.nn.parameter", "Parameter") + b"(" + tensor() + b"\x89tR"
_SEVENS = struct.pack("<4f", 7, 7, 7, 7)


def _with_state(rebuild: bytes, state: bytes) -> bytes:
    """A tensor rebuilt with ``state`` (a pickled dict, or pair of dicts) applied to it."""
    if rebuild == b"parameter":
        head = P.g("torch._utils", "_rebuild_parameter_with_state") + b"(" + tensor()
        return head + b"\x89" + _OD + state + b"tR"
    inner = b"(" + pid() + b"Q" + P.i(0) + P.tup((4,)) + P.tup((1,)) + b"\x89" + _OD + b"t"
    head = P.g("torch._tensor", "_rebuild_from_type_v2") + b"("
    head += P.g("torch._utils", "_rebuild_tensor_v2") + P.g("torch", "Tensor") + inner
    return head + state + b"tR"


_SWAPPED_TENSORS = {
    # Parameter(t) then BUILD with Tensor.__setstate__'s 5-tuple: its first item becomes the
    # data torch.load returns ([7, 7, 7, 7]).
    "BUILD on Parameter": _PARAMETER + b"(" + tensor("1") + b"N" + _OD + b"\x89" + _OD + b"tb",
    # The state torch applies with setattr: "data" swaps the tensor for another.
    "parameter state data": _with_state(b"parameter", b"}" + P.u("data") + tensor("1") + b"s"),
    "type_v2 state data": _with_state(b"type_v2", b"}" + P.u("data") + tensor("1") + b"s"),
    "slots state real": _with_state(
        b"parameter", b"}" + b"}" + P.u("real") + tensor("1") + b"s\x86"
    ),
    "state key not text": _with_state(b"type_v2", b"}" + P.i(3) + P.i(1) + b"s"),
}


@pytest.mark.parametrize("case", list(_SWAPPED_TENSORS))
def test_pickles_that_swap_a_tensors_data_are_dangerous(tmp_path: Path, case: str) -> None:
    """A rebuilt tensor's state is applied by torch with setattr: a state naming ``data``
    made torch.load return other values, dtype and shape than the file's rebuild describes,
    while the scanner graded the file safe and the converter wrote the described tensor."""
    from pysafetensors import UnsafePickleError
    from pysafetensors.convert import convert_file

    make_zip(
        tmp_path / "m.pt", state_dict([("w", _SWAPPED_TENSORS[case])]), {"0": F32x4, "1": _SEVENS}
    )
    report = scan_file(tmp_path / "m.pt")
    assert report.grade == "dangerous", report.findings
    with pytest.raises((UnsafePickleError, CheckpointError)):
        convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_plain_tensor_attributes_stay_safe(tmp_path: Path) -> None:
    from pysafetensors.convert import convert_file

    pkl = state_dict([("w", _with_state(b"parameter", b"}" + P.u("tag") + P.u("x") + b"s"))])
    make_zip(tmp_path / "a.pt", pkl)
    assert (scan_file(tmp_path / "a.pt").grade, scan_file(tmp_path / "a.pt").findings) == (
        "safe",
        [],
    )
    convert_file(tmp_path / "a.pt", tmp_path / "a.safetensors")


@pytest.mark.parametrize(
    "name",
    [
        ("py_compile", "compile"),
        ("compileall", "compile_file"),
        ("dbm", "open"),
        ("mailbox", "mbox"),
        ("zipapp", "create_archive"),
        ("wave", "open"),
        ("torch.utils.benchmark.utils.cpp_jit", "compile_timeit_template"),
    ],
)
def test_file_writers_and_compilers_are_dangerous(name: tuple[str, str]) -> None:
    assert grade_global(*name) == "dangerous"


@pytest.mark.parametrize("opcode", list(_MUTATED_TENSORS))
def test_pickles_that_change_a_tensor_are_dangerous(tmp_path: Path, opcode: str) -> None:
    """Only globals and odd targets were graded: a tensor from an allowed rebuild, changed
    afterwards, was "safe" (the converter refused it all along)."""
    from pysafetensors import UnsafePickleError
    from pysafetensors.convert import convert_file

    pkl = state_dict([("w", _MUTATED_TENSORS[opcode])])
    make_zip(tmp_path / "m.pt", pkl)
    for path in (tmp_path / "m.pt", _write(tmp_path / "m.pkl", pkl)):
        report = scan_file(path)
        assert report.grade == "dangerous", path
        assert any(f"{opcode} " in f.message and "tensor" in f.message for f in report.findings)
    with pytest.raises((UnsafePickleError, CheckpointError)):
        convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors")


def test_containers_filled_or_built_after_their_call_stay_safe(tmp_path: Path) -> None:
    # How torch.save writes a state dict: OrderedDict() filled by SETITEMS, its _metadata set
    # by BUILD; a defaultdict and a Counter are filled the same way.
    odict = P.g("collections", "OrderedDict") + b")R"
    filled = odict + b"(" + P.u("w") + tensor() + b"u}" + P.u("_metadata") + odict + b"sb"
    counter = P.g("collections", "Counter") + b")R" + b"(" + P.u("a") + P.i(1) + b"u"
    pkl = state_dict([("sd", filled), ("n", counter)])
    make_zip(tmp_path / "c.pt", pkl)
    report = scan_file(tmp_path / "c.pt")
    assert (report.grade, report.findings) == ("safe", [])


def test_items_stored_into_an_unknown_call_result_are_suspicious(tmp_path: Path) -> None:
    data = P.PROTO2 + P.g("torch", "Size") + b")R" + P.i(0) + P.i(1) + b"s."
    report = scan_file(_write(tmp_path / "s.pkl", data))
    assert report.grade == "suspicious"
    assert [f.message for f in report.findings] == ["SETITEM into what torch.Size returned"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, timeout=60)


def test_cli_exit_codes(tmp_path: Path) -> None:
    safe = tmp_path / "safe.pkl"
    safe.write_bytes(pickle.dumps({"a": [1, 2]}, protocol=2))
    sus = _write(tmp_path / "sus.pkl", P.PROTO2 + P.g("mylib", "Net") + b")R.")
    bad = _write(tmp_path / "bad.pkl", P.PROTO2 + payload("os", "system", tmp_path / "c") + b".")
    assert _cli("scan", str(safe)).returncode == 0
    assert _cli("scan", str(safe), str(sus)).returncode == 1
    res = _cli("scan", "--json", str(safe), str(sus), str(bad))
    assert res.returncode == 2
    doc = json.loads(res.stdout)
    assert doc["schema"] == "pysafetensors.scan/1" and doc["grade"] == "dangerous"
    reports = doc["files"]
    assert [r["grade"] for r in reports] == ["safe", "suspicious", "dangerous"]
    assert reports[2]["globals"][0]["qualname"] == "os.system"
    assert not (tmp_path / "c").exists()


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, to see what a user's terminal would get."""

    def isatty(self) -> bool:
        return True


def test_cli_convert_progress_waits_a_second_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # convert shares the other commands' bar: nothing for work under a second (it printed a
    # bar, or a bare "converting: 100%" line without tqdm, at once).
    from pysafetensors._cli import main

    make_zip(tmp_path / "m.bin", good_pickle())
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["convert", str(tmp_path / "m.bin"), str(tmp_path / "m.safetensors")]) == 0
    assert terminal.getvalue() == ""
    assert (tmp_path / "m.safetensors").exists()


def test_cli_convert(tmp_path: Path) -> None:
    make_zip(tmp_path / "m.bin", good_pickle())
    res = _cli("convert", str(tmp_path / "m.bin"), str(tmp_path / "m.safetensors"), "--verify")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # no progress bar when stderr is not a terminal
    assert (tmp_path / "m.safetensors").exists()
    evil = state_dict([("w", payload("os", "system", tmp_path / "canary"))])
    make_zip(tmp_path / "e.bin", evil)
    res = _cli("convert", str(tmp_path / "e.bin"), str(tmp_path / "e.safetensors"))
    assert res.returncode == 1 and "os.system" in res.stderr
    assert not (tmp_path / "e.safetensors").exists() and not (tmp_path / "canary").exists()
    with zipfile.ZipFile(tmp_path / "m.bin") as zf:
        assert "archive/data.pkl" in zf.namelist()


# -- dotted and dunder names (review: a "safe" grade for a working RCE) --------------------------


def _su(text: str) -> bytes:
    """SHORT_BINUNICODE, the opcode protocol 4 uses for STACK_GLOBAL operands."""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _fromtype_rce(canary: Path) -> bytes:
    """``_rebuild_from_type_v2(eval-via-__builtins__, Tensor, (code,), {})``: real torch runs it.

    ``torch._utils`` + ``_rebuild_tensor.__builtins__.get`` resolves (protocol 4 dotted names)
    to ``dict.get`` of that module's builtins, so ``get("eval")`` is ``builtins.eval``, and
    ``_rebuild_from_type_v2`` calls its first argument with the code string.
    """
    code = f"__import__('pathlib').Path({str(canary)!r}).touch()"
    return (
        b"\x80\x04"
        + _su("torch._tensor")
        + _su("_rebuild_from_type_v2")
        + b"\x93("
        + _su("torch._utils")
        + _su("_rebuild_tensor.__builtins__.get")
        + b"\x93"
        + _su("eval")
        + b"\x85R"
        + _su("torch")
        + _su("Tensor")
        + b"\x93"
        + _su(code)
        + b"\x85}tR."
    )


def test_dotted_and_dunder_names_are_dangerous_before_any_allow_rule() -> None:
    # Each would match an allow-list entry or prefix rule on its first component.
    assert grade_global("torch._utils", "_rebuild_tensor.__builtins__.get") == "dangerous"
    assert grade_global("torch._utils", "_rebuild_tensor.__class__") == "dangerous"
    assert grade_global("torch._utils", "_rebuild_tensor_v2.__globals__") == "dangerous"
    assert grade_global("torch", "Size.__init__") == "dangerous"
    assert grade_global("torch.nn", "parameter.Parameter") == "dangerous"
    assert grade_global("numpy", "core.multiarray._reconstruct") == "dangerous"
    assert grade_global("builtins", "set.__reduce__") == "dangerous"
    assert grade_global("collections", "OrderedDict.fromkeys") == "dangerous"
    assert grade_global("posixpath", "os.system") == "dangerous"
    assert grade_global("torch.__builtins__", "eval") == "dangerous"
    # No prefix rule any more: only exact table entries are safe.
    assert grade_global("torch._utils", "_rebuild_xla_tensor") == "suspicious"
    assert grade_global("torch._utils", "_rebuild_tensor_v3") == "safe"
    assert grade_global("torch._utils", "_rebuild_sparse_tensor") == "safe"


def test_file_and_path_modules_are_dangerous() -> None:
    for module in ("posixpath", "ntpath", "genericpath", "pathlib", "codecs", "shutil"):
        assert grade_global(module, "system") == "dangerous", module
    assert grade_global("pathlib", "Path") == "dangerous"
    assert grade_global("pathlib._local", "Path") == "dangerous"
    assert grade_global("codecs", "open") == "dangerous"
    # The protocol-2 bytes helper is a different module and stays allowed.
    assert grade_global("_codecs", "encode") == "safe"


def test_rebuild_from_type_rce_is_dangerous_and_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    canary = tmp_path / "ran"
    pkl = _fromtype_rce(canary)
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as zf:
        zf.writestr("archive/version", "3\n")
        zf.writestr("archive/data.pkl", pkl)
    report = scan_file(tmp_path / "evil.pt")
    assert report.grade == "dangerous"
    graded = {g.qualname: g.grade for g in report.globals}
    assert graded["torch._utils._rebuild_tensor.__builtins__.get"] == "dangerous"
    assert any(
        "_rebuild_from_type_v2 calls a computed object" in f.message for f in report.findings
    )
    assert _cli("scan", str(tmp_path / "evil.pt")).returncode == 2
    # The converter refuses it and runs nothing.
    from pysafetensors._errors import UnsafePickleError
    from pysafetensors.convert import convert_file

    with pytest.raises(UnsafePickleError) as exc:
        convert_file(tmp_path / "evil.pt", tmp_path / "evil.safetensors")
    assert exc.value.global_name == "torch._utils._rebuild_tensor.__builtins__.get"
    assert not canary.exists() and not (tmp_path / "evil.safetensors").exists()
    # Proof that the payload is live: torch.load without weights_only runs it.
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import torch; torch.load({str(tmp_path / 'evil.pt')!r}, weights_only=False)",
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert canary.exists(), torch.__version__


def test_converter_refuses_dotted_names_that_alias_allowed_ones(tmp_path: Path) -> None:
    from pysafetensors._errors import UnsafePickleError
    from pysafetensors.convert import convert_file

    # torch.nn + parameter.Parameter is the allowed Parameter class reached by attribute walk.
    sd = state_dict([("w", _su("torch.nn") + _su("parameter.Parameter") + b"\x93)R")])
    make_zip(tmp_path / "d.pt", sd)
    with pytest.raises(UnsafePickleError, match="dotted or dunder"):
        convert_file(tmp_path / "d.pt", tmp_path / "d.safetensors")


class _Sub:
    """Set to a torch.Tensor subclass by the test below (torch is optional here)."""


def test_rebuild_from_type_with_a_real_subclass_is_not_flagged(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    global _Sub
    _Sub = type("_Sub", (torch.Tensor,), {"__module__": __name__, "__qualname__": "_Sub"})
    torch.save({"w": torch.ones(3).as_subclass(_Sub)}, tmp_path / "s.pt")
    report = scan_file(tmp_path / "s.pt")
    # torch writes _rebuild_from_type_v2(_rebuild_tensor_v2, _Sub, ...): the rebuild function
    # is accepted; only the user class is unknown.
    assert "torch._tensor._rebuild_from_type_v2" in {g.qualname for g in report.globals}
    assert report.findings == []
    assert {g.qualname for g in report.globals if g.grade != "safe"} == {f"{__name__}._Sub"}
    assert report.grade == "suspicious"


def test_zip_bomb_is_refused_before_inflating(tmp_path: Path) -> None:
    bomb_size = 64 << 20
    with zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/version", "3\n")
        zf.writestr("archive/data.pkl", good_pickle() + bytes(bomb_size))
    assert (tmp_path / "bomb.pt").stat().st_size < bomb_size // 500
    report, peak = _scan_with_peak(tmp_path / "bomb.pt")
    assert report.grade == "suspicious"
    assert any("compression ratio over 100" in f.message for f in report.findings)
    assert peak < 8 << 20
    # A central directory that lies about the inflated size: inflation stops at the same ratio.
    raw = bytearray((tmp_path / "bomb.pt").read_bytes())
    cd = raw.rfind(b"PK\x01\x02")  # the data.pkl entry is the last one
    compressed = struct.unpack_from("<I", raw, cd + 20)[0]
    struct.pack_into("<I", raw, cd + 24, compressed)
    _write(tmp_path / "liar.pt", bytes(raw))
    report, peak = _scan_with_peak(tmp_path / "liar.pt")
    assert any("possible zip bomb" in f.message for f in report.findings)
    assert report.grade == "suspicious"
    assert peak < 100 * compressed + (8 << 20)


def test_cli_convert_usage_errors_json_schema_and_named_errors(tmp_path: Path) -> None:
    make_zip(tmp_path / "m.bin", good_pickle())
    src, out = str(tmp_path / "m.bin"), tmp_path / "sub" / "dir" / "m.safetensors"
    for bad in (["--metadata", "novalue"], ["--metadata", "=x"], ["--workers", "0"]):
        res = _cli("convert", src, str(out), *bad)
        assert res.returncode == 2 and "Traceback" not in res.stderr, bad
    assert not out.exists()
    # The output's folder is created, as every command creates what it writes into.
    res = _cli("convert", src, str(out), "--json", "--metadata", "k=v")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "pysafetensors.convert/1" and doc["index"] is None
    assert [f["tensors"] for f in doc["files"]] == [["w"]]
    # A truncated zip: the error names the file.
    (tmp_path / "t.bin").write_bytes((tmp_path / "m.bin").read_bytes()[:-30])
    res = _cli("convert", str(tmp_path / "t.bin"), str(tmp_path / "t.safetensors"))
    assert res.returncode == 1 and res.stderr.startswith(f"error: {tmp_path / 't.bin'}: ")


# -- review: first opcodes, member selection, Python 2 names, crashes, caps ----------------------


def _touch(canary: Path) -> bytes:
    """``os.system("touch canary")`` as a protocol 0 REDUCE, then STOP."""
    return b"cos\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR."


# Each first opcode pushes one value that POP drops: CPython runs the GLOBAL and REDUCE after it.
_FIRST_OPS = [b"M\x01\x00", b"\x88", b"\x89", b"\x8c\x01a", b"C\x01a", b"\x8f", b"G" + bytes(8)]


def test_every_opcode_may_start_a_pickle(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    for i, first in enumerate(_FIRST_OPS):
        canary = tmp_path / f"ran{i}"
        pkl = first + b"0" + _touch(canary)
        with zipfile.ZipFile(tmp_path / f"e{i}.pt", "w") as zf:
            zf.writestr("archive/data.pkl", pkl)
            zf.writestr("archive/version", "3\n")
        report = scan_file(tmp_path / f"e{i}.pt")
        assert report.grade == "dangerous", first
        assert [g.qualname for g in report.globals] == ["os.system"], first
        bare = scan_file(_write(tmp_path / f"e{i}.pkl", pkl))
        assert (bare.grade, bare.format) == ("dangerous", "pickle"), first
    assert _cli("scan", str(tmp_path / "e0.pt")).returncode == 2
    # The payloads are live: torch.load without weights_only runs every one of them.
    code = "import sys, torch\nfor p in sys.argv[1:]: torch.load(p, weights_only=False)"
    paths = [str(tmp_path / f"e{i}.pt") for i in range(len(_FIRST_OPS))]
    subprocess.run(
        [sys.executable, "-c", code, *paths], capture_output=True, timeout=120, check=False
    )
    assert all((tmp_path / f"ran{i}").exists() for i in range(len(_FIRST_OPS))), torch.__version__


def test_protocol_1_pickles_of_plain_values_are_safe(tmp_path: Path) -> None:
    for value in (300, True, "s", b"b", 1.5, {1, 2}):
        for proto in (0, 1, 2, 5):
            report = scan_file(_write(tmp_path / "v.pkl", pickle.dumps(value, protocol=proto)))
            assert (report.grade, report.format) == ("safe", "pickle"), (value, proto)
            assert report.findings == []


def test_pickle_member_that_does_not_parse_is_not_safe(tmp_path: Path) -> None:
    # A FRAME then POP with nothing to pop: CPython fails there too, but a data.pkl that is not
    # a pickle is never "safe", whatever its first byte.
    for i, pkl in enumerate([b"\x95" + bytes(8) + b"0" + _touch(tmp_path / "c"), b"\x00junk"]):
        make_zip(tmp_path / f"b{i}.pt", pkl)
        report = scan_file(tmp_path / f"b{i}.pt")
        assert report.grade == "suspicious", pkl
        assert any("could not be fully parsed" in f.message for f in report.findings)


def test_any_member_that_starts_an_acting_pickle_is_scanned(tmp_path: Path) -> None:
    evil_prefix = b"M\x01\x000" + _touch(tmp_path / "c")[:-1] + b"\x00garbage"
    # Under any name but a tensor storage's, with a first opcode outside the usual ones and
    # garbage after the REDUCE: the unpickler runs os.system before it fails.
    make_zip(tmp_path / "m.pt", good_pickle(), extra={"archive/extra.bin": evil_prefix})
    report = scan_file(tmp_path / "m.pt")
    assert report.grade == "dangerous"
    assert any(g.where.endswith("extra.bin") and g.qualname == "os.system" for g in report.globals)
    # Tensor bytes that merely start with an opcode are not reported.
    make_zip(tmp_path / "t.pt", good_pickle(), storages={"0": b"N." + bytes(14)})
    assert scan_file(tmp_path / "t.pt").grade == "safe"


def test_tensor_storages_are_raw_bytes_torch_never_unpickles(tmp_path: Path) -> None:
    # A storage that starts a pickle which imports and then fails is what random tensor bytes
    # look like (EXT1-4 are bytes 0x82-0x84): torch.load never unpickles data/N, so not a
    # finding. A storage that is one whole pickle ending at its last byte is suspicious, never
    # dangerous, and its globals are not among the file's (nothing imports them).
    canary = tmp_path / "c"
    for data in (b"M\x01\x000" + _touch(canary)[:-1] + b"\x00garbage", b"\x82\x01" + bytes(10)):
        make_zip(tmp_path / "p.pt", good_pickle(), storages={"0": data})
        report = scan_file(tmp_path / "p.pt")
        assert (report.grade, report.findings) == ("safe", []), data
    for data, detail in ((_touch(canary), "importing os.system"), (b"\x82\x01.", "EXT opcode")):
        make_zip(tmp_path / "w.pt", good_pickle(), storages={"0": data})
        report = scan_file(tmp_path / "w.pt")
        assert report.grade == "suspicious", data
        assert "os.system" not in {g.qualname for g in report.globals}
        (finding,) = report.findings
        assert finding.where.endswith("archive/data/0") and detail in finding.message
    # A whole pickle with trailing bytes, or one that runs on past a window, is not whole.
    make_zip(tmp_path / "x.pt", good_pickle(), storages={"0": _touch(canary) + b"\x00"})
    assert scan_file(tmp_path / "x.pt").grade == "safe"
    # Only data/N is a storage: the same bytes under another name are a pickle someone may load.
    make_zip(tmp_path / "o.pt", good_pickle(), extra={"archive/data/x": _touch(canary)})
    assert scan_file(tmp_path / "o.pt").grade == "dangerous"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_real_checkpoints_of_random_tensors_are_safe(tmp_path: Path, protocol: int) -> None:
    # Random float32 storages start with EXT1/EXT2/EXT4 (0x82-0x84) one time in 85 and with
    # GLOBAL ('c') one in 256: 4 of 56 such torch.save files were graded dangerous. The first
    # tensors are set so that their storages start with those bytes whatever the seed.
    torch = pytest.importorskip("torch")
    torch.manual_seed(20240601)
    leads = (0x82, 0x83, 0x84, ord("c"), ord("i"))
    state = {}
    for i, lead in enumerate(leads):
        raw = bytes([lead]) + b"\n\x01\x3f" + bytes([lead]) + b"\n\n\x3f" + b"\x2e\n\n\x3f"
        state[f"lead{i}"] = torch.frombuffer(bytearray(raw), dtype=torch.float32).clone()
    state.update({f"t{i}": torch.randn(3) for i in range(500)})
    path = tmp_path / f"random{protocol}.pt"
    torch.save(state, path, pickle_protocol=protocol)
    with zipfile.ZipFile(path) as zf:
        firsts = {zf.read(n)[0] for n in zf.namelist() if n.split("/")[-2:-1] == ["data"]}
    assert firsts >= set(leads)
    report = scan_file(path)
    assert (report.grade, report.format, report.findings) == ("safe", "zip", []), report.findings
    # A genuine checkpoint (weights_only refuses the FRAME opcode of protocols 4 and 5).
    assert torch.equal(torch.load(path, weights_only=False)["lead0"], state["lead0"])


def test_large_tensor_members_are_not_copied(tmp_path: Path) -> None:
    size = 48 << 20
    # 'K' is BININT1: a valid first opcode, so the member is probed, not skipped by its byte.
    make_zip(tmp_path / "big.pt", good_pickle(), storages={"0": b"K" + bytes(size - 1)})
    report, peak = _scan_with_peak(tmp_path / "big.pt")
    assert report.grade == "safe"
    assert peak < 8 << 20


def test_safetensors_shaped_pickle_is_graded_as_a_pickle(tmp_path: Path) -> None:
    # BINBYTES whose 4-byte length and payload make bytes 0-7 a plausible header length and
    # byte 8 a '{': pickle.load runs the rest of the file.
    head = b"B" + struct.pack("<I", 4) + b"\x00\x00\x00{" + b"0"
    body = head + _touch(tmp_path / "c")
    n = struct.unpack_from("<Q", body)[0]
    data = body + b" " * (8 + n - len(body))
    report = scan_file(_write(tmp_path / "x.safetensors", data))
    assert report.grade == "dangerous"
    assert [g.qualname for g in report.globals] == ["os.system"]


def test_real_safetensors_files_stay_safe(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from pysafetensors.numpy import save_file

    # Header lengths whose low byte is each pickle opcode in turn.
    for pad in range(0, 256, 7):
        save_file({"w": np.zeros(3, np.float32)}, tmp_path / "m.safetensors", {"p": "x" * pad})
        report = scan_file(tmp_path / "m.safetensors")
        assert (report.grade, report.format) == ("safe", "safetensors"), pad


def test_tar_whose_name_is_a_pickle(tmp_path: Path) -> None:
    import io
    import tarfile

    name = _touch(tmp_path / "c").decode()
    with tarfile.open(tmp_path / "t.pt", "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(name[:99])
        data = pickle.dumps({}, protocol=2)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    raw = (tmp_path / "t.pt").read_bytes()
    assert raw.startswith(name.encode()[:99])
    report = scan_file(tmp_path / "t.pt")
    assert report.format == "tar" and report.grade == "dangerous"


def test_tar_record_with_a_string_storage_class_is_a_finding(tmp_path: Path) -> None:
    for stype in ("FloatStorage", 7, None):
        storages = pickle.dumps(1, 2) + pickle.dumps((0, "cpu", stype), 2)
        members = {"storages": storages, "tensors": pickle.dumps(0, 2), "pickle": b"\x80\x02}."}
        report = scan_file(write_tar(tmp_path / "t.pt", members))
        assert report.grade == "suspicious", stype
        assert any("could not follow the tar records" in f.message for f in report.findings)


def test_cli_reports_every_file_when_one_cannot_be_scanned(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.pkl", P.PROTO2 + payload("os", "system", tmp_path / "c") + b".")
    missing = tmp_path / "missing.pkl"
    res = _cli("scan", str(missing), str(tmp_path), str(bad))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"{missing}: suspicious (error" in res.stdout
    assert f"{bad}: dangerous" in res.stdout
    res = _cli("scan", "--json", str(missing), str(bad))
    doc = json.loads(res.stdout)
    assert [(r["format"], r["grade"]) for r in doc["files"]] == [
        ("error", "suspicious"),
        ("pickle", "dangerous"),
    ]
    assert "FileNotFoundError" in doc["files"][0]["findings"][0]["message"]
    assert res.returncode == 2


def test_scanner_errors_become_findings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pysafetensors.scan as scan

    def boom(*args: object) -> None:
        raise RecursionError("deep")

    monkeypatch.setattr(scan, "_scan_pickle_file", boom)
    report = scan.scan_bytes(pickle.dumps(1), "x.pkl")
    assert report.grade == "suspicious"
    assert "internal error (RecursionError: deep)" in report.findings[0].message


def test_python2_names_are_mapped_below_protocol_3() -> None:
    from pysafetensors.scan import scan_bytes

    getoutput = b"ccommands\ngetoutput\nX\x02\x00\x00\x00id\x85R."
    for proto in (b"", b"\x80\x01", b"\x80\x02"):
        report = scan_bytes(proto + getoutput)
        assert report.grade == "dangerous", proto
        assert [g.qualname for g in report.globals] == ["subprocess.getoutput"]
        assert any("commands.getoutput is read as subprocess" in f.message for f in report.findings)
    # CPython maps only while the protocol is under 3 (find_class: proto < 3 and fix_imports).
    for proto in (b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        report = scan_bytes(proto + getoutput)
        assert [(g.qualname, g.grade) for g in report.globals] == [
            ("commands.getoutput", "suspicious")
        ]
    # The protocol is the last PROTO seen before the global, as the unpickler's self.proto.
    assert scan_bytes(b"\x80\x04\x80\x02" + getoutput).globals[0].grade == "dangerous"
    assert scan_bytes(b"\x80\x02\x80\x04" + getoutput).globals[0].grade == "suspicious"
    assert scan_bytes(b"\x80\x02N0\x80\x04" + getoutput).globals[0].grade == "suspicious"
    assert scan_bytes(b"\x80\x04N0\x80\x01" + getoutput).globals[0].grade == "dangerous"
    # NAME_MAPPING too: __builtin__.reduce is functools.reduce.
    report = scan_bytes(b"\x80\x02c__builtin__\nreduce\n.")
    assert [(g.qualname, g.grade) for g in report.globals] == [("functools.reduce", "dangerous")]
    # Python 2 names of safe globals stay safe.
    assert scan_bytes(b"\x80\x02c__builtin__\nset\n)R.").grade == "safe"


def test_python2_loader_names_have_their_payload_scanned() -> None:
    from pysafetensors.scan import scan_bytes

    inner = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00id\x85R."
    outer = b"\x80\x02ccPickle\nloads\nC" + bytes([len(inner)]) + inner + b"\x85R."
    assert pickle.loads.__name__ == "loads"  # (pickle.loads(outer) would run `id`)
    report = scan_bytes(outer)
    assert report.grade == "dangerous"
    assert [g.qualname for g in report.globals] == ["pickle.loads", "os.system"]
    assert ">nested@" in report.globals[1].where


def test_nested_payloads_are_scanned_once() -> None:
    import time

    from pysafetensors.scan import scan_bytes

    def calls(inner: bytes, n: int) -> bytes:
        # loads(inner) n times over, the function and the bytes from the memo.
        head = b"\x80\x02cpickle\nloads\nq\x01B" + struct.pack("<I", len(inner)) + inner
        return head + b"q\x020" + b"h\x01h\x02\x85R0" * n + b"N."

    level = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00id\x85R."
    for _ in range(3):
        level = calls(level, 300)
    t0 = time.monotonic()
    report = scan_bytes(level)
    assert time.monotonic() - t0 < 10
    assert report.grade == "dangerous"
    assert "os.system" in {g.qualname for g in report.globals}


def test_listed_globals_are_capped_but_still_graded() -> None:
    from pysafetensors.scan import MAX_LISTED, scan_bytes

    data = b"cmylib\nA\n0" * (MAX_LISTED + 10) + b"cos\nsystem\n0N."
    report = scan_bytes(data)
    assert len(report.globals) == MAX_LISTED
    assert report.grade == "dangerous"
    assert any(f.message.startswith(f"more than {MAX_LISTED}") for f in report.findings)
    assert len(report.to_dict()["globals"]) == MAX_LISTED


def test_stream_count_is_capped() -> None:
    from pysafetensors.scan import MAX_STREAMS, scan_bytes

    report = scan_bytes(b"N." * (MAX_STREAMS * 3))
    assert report.streams <= MAX_STREAMS + 1  # the first stream, then at most MAX_STREAMS more
    assert report.grade == "suspicious"


def test_large_safetensors_file_is_not_too_large(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    np = pytest.importorskip("numpy")
    import pysafetensors.scan as scan
    from pysafetensors.numpy import save_file

    save_file({"w": np.zeros(1 << 16, np.float32)}, tmp_path / "m.safetensors")
    # Over the pickle size limit, as a multi-GB model is over the real one.
    monkeypatch.setattr(scan, "MAX_PICKLE_BYTES", 1 << 16)
    report = scan.scan_file(tmp_path / "m.safetensors")
    assert (report.grade, report.format) == ("safe", "safetensors")


def test_a_tar_over_the_pickle_limit_is_scanned_in_place(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A tar checkpoint over 1 GiB was "too large to analyse as a pickle" (suspicious), its
    # dangerous pickle member never looked at. The limit is lowered here as in the test above.
    import tarfile

    import pysafetensors.scan as scan

    path = tmp_path / "ck.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, payload in (
            ("pickle", _touch(tmp_path / "canary")),
            ("storages", bytes(1 << 17)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    monkeypatch.setattr(scan, "MAX_PICKLE_BYTES", 1 << 16)
    report = scan.scan_file(path)
    assert (report.grade, report.format) == ("dangerous", "tar")


def test_a_safetensors_file_over_64_gib_is_scanned_in_place(tmp_path: Path) -> None:
    # scan_file refused anything over 64 GiB by default ("not analysed", suspicious): a
    # single-file 70B model is larger. The file is sparse: no disk used.
    np = pytest.importorskip("numpy")
    import pysafetensors.scan as scan
    from pysafetensors.numpy import save_file

    path = tmp_path / "huge.safetensors"
    save_file({"w": np.zeros(16, np.float32)}, path)
    os.truncate(path, 65 << 30)
    report = scan.scan_file(path)
    assert (report.grade, report.format) == ("safe", "safetensors")
    limited = scan.scan_file(path, max_bytes=64 << 30)  # a limit is still the caller's to set
    assert limited.grade == "suspicious" and "not analysed" in limited.findings[0].message


def test_mutated_checkpoints_never_raise(tmp_path: Path) -> None:
    """A short seeded mutation fuzz: every mutant gets a report, never an exception."""
    import random

    from pysafetensors.scan import scan_bytes

    make_zip(tmp_path / "z.pt", good_pickle())
    make_legacy(tmp_path / "l.pt")
    storages = pickle.dumps(1, 2) + pickle.dumps((0, "cpu", None), 2) + struct.pack("<q", 0)
    write_tar(tmp_path / "t.pt", {"storages": storages, "pickle": good_pickle()})
    seeds = [(tmp_path / n).read_bytes() for n in ("z.pt", "l.pt", "t.pt")]
    tokens = [b"\x80\x02", b"\x95", b"(", b"R", b"\x93", b"0", b"\x00\x00\x00\x80", b"PK\x05\x06"]
    rng = random.Random(1234)
    for _ in range(1500):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            p = rng.randrange(len(data))
            k = rng.random()
            if k < 0.5:
                data[p] = rng.randrange(256)
            elif k < 0.8:
                data[p : p + 2] = rng.choice(tokens)
            else:
                del data[p : p + rng.randint(1, 16)]
        report = scan_bytes(bytes(data), "m.pt")
        assert report.grade in ("safe", "suspicious", "dangerous")
        assert not any("internal error" in f.message for f in report.findings), report.findings


def test_legacy_checkpoints_over_the_pickle_limit_are_scanned_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A legacy checkpoint is small pickles then raw storages: one larger than the limit for a
    plain pickle (1 GiB; 512 bytes here) is read through the mapping, not called too large."""
    torch = pytest.importorskip("torch")
    from pysafetensors import scan

    monkeypatch.setattr(scan, "MAX_PICKLE_BYTES", 512)
    path = tmp_path / "l.pt"
    torch.save({"w": torch.ones(1000)}, path, _use_new_zipfile_serialization=False)
    assert path.stat().st_size > 512
    report = scan_file(path)
    assert (report.grade, report.format, report.streams) == ("safe", "legacy", 5)
    # Made dangerous after its magic number, it is graded by what it does.
    evil = P.PROTO2 + payload("os", "system", tmp_path / "c") + b"."
    make_legacy(tmp_path / "evil.pt", graph=evil)
    assert scan_file(tmp_path / "evil.pt").grade == "dangerous"
    # A plain pickle that large is still not analysed.
    big = _write(tmp_path / "big.pkl", pickle.dumps(list(range(1000)), protocol=2))
    assert [f.message for f in scan_file(big).findings] == ["file too large to analyse as a pickle"]


def _memo_nul_prefix() -> bytes:
    """PUT then GET with a NUL in their operand lines: CPython reads ``1`` (C string) and
    goes on; a reader that takes the whole line as the number stops here."""
    return b"I5\np1\x00\n0g1\x00\n0"


def _limit_prefixes() -> list[tuple[str, bytes]]:
    """Prefixes CPython reads through (dropping what they push), where this scanner stops at
    one of its limits."""
    long4 = b"\x8b" + struct.pack("<i", 5000) + bytes(5000) + b"0"
    marks = b"(" * 100_001 + b"1" * 100_001
    return [("LONG4", long4), ("marks", marks)]


def test_memo_operands_are_read_as_cpython_reads_them(tmp_path: Path) -> None:
    """A GET/PUT operand with a NUL in it stopped the scan as unparsable; CPython reads the
    number before the NUL, and the payload after it runs: graded by that payload."""
    pkl = _memo_nul_prefix() + _touch(tmp_path / "ran")
    make_zip(tmp_path / "p.pt", pkl)
    for path in (_write(tmp_path / "p.pkl", pkl), tmp_path / "p.pt"):
        report = scan_file(path)
        assert report.grade == "dangerous", path
        assert [g.qualname for g in report.globals] == ["os.system"]
    pickle.loads(_memo_nul_prefix() + b"N.")  # CPython reads it (without the payload)


def test_a_stop_at_a_scanner_limit_is_never_taken_for_the_end(tmp_path: Path) -> None:
    """What follows a limit stop is not analysed but is run by a loader: the report says so
    and is never safe, in a plain pickle, a checkpoint's data.pkl, and a file shaped like
    safetensors (or a tar) whose first bytes are such a pickle."""
    for name, prefix in _limit_prefixes():
        pkl = prefix + _touch(tmp_path / "ran")
        assert pickle.loads(prefix + b"N.") is None, name  # CPython reads through it
        make_zip(tmp_path / "p.pt", pkl)
        for path in (_write(tmp_path / "p.pkl", pkl), tmp_path / "p.pt"):
            report = scan_file(path)
            assert report.grade == "suspicious", (name, path)
            assert any("where a limit of this scanner" in f.message for f in report.findings)
        # Shaped like safetensors: the first 8 bytes a length, then "{". BINUNICODE of 16
        # bytes covers the length's high bytes and the header.
        head = b"X" + struct.pack("<I", 16)
        polyglot = head + b"\x00\x00\x00{" + b'"a":1}'.ljust(12) + b"0" + pkl
        (n,) = struct.unpack_from("<Q", polyglot, 0)
        polyglot += b" " * max(0, n + 8 - len(polyglot))
        report = scan_file(_write(tmp_path / "p.safetensors", polyglot))
        assert report.grade != "safe", name
    # The NUL operand in the same polyglot: read through, graded by its payload.
    head = b"X" + struct.pack("<I", 16) + b"\x00\x00\x00{" + b'"a":1}'.ljust(12) + b"0"
    polyglot = head + _memo_nul_prefix() + _touch(tmp_path / "ran")
    (n,) = struct.unpack_from("<Q", polyglot, 0)
    polyglot += b" " * max(0, n + 8 - len(polyglot))
    assert scan_file(_write(tmp_path / "q.safetensors", polyglot)).grade == "dangerous"


def test_text_lines_of_any_length_are_read_through(tmp_path: Path) -> None:
    """CPython reads a text operand of any length; so does the scanner (a 1 MiB cap stopped
    it there), so a payload after one is found."""
    pkl = b"V" + b"a" * ((1 << 20) + 10) + b"\n0" + _touch(tmp_path / "ran")
    report = scan_file(_write(tmp_path / "p.pkl", pkl))
    assert report.grade == "dangerous"


@pytest.mark.parametrize("low_byte", [0x70, 0x50])  # PUT and PERSID read a text line
def test_safetensors_files_with_big_headers_stay_safe(tmp_path: Path, low_byte: int) -> None:
    """A header length whose low byte is an opcode that reads a text line, and a header of
    over 1 MiB: the line runs into the tensor data; the pickle then fails where CPython fails,
    and the file is graded as the safetensors file it is."""
    import numpy as np

    from pysafetensors.numpy import save_file

    tensors = {f"model.layers.{i}.w": np.zeros(1, np.float32) for i in range(25_000)}
    path = tmp_path / "big.safetensors"
    save_file(tensors, path, metadata={"pad": ""})
    # The header length is a multiple of 8, as both low bytes are: 8 more characters of
    # metadata move it 8 bytes, so one more save gives the low byte wanted.
    length = int.from_bytes(path.read_bytes()[:8], "little")
    save_file(tensors, path, metadata={"pad": "x" * ((low_byte - length) % 256)})
    first = path.read_bytes()[:8]
    assert first[0] == low_byte and int.from_bytes(first, "little") > 1 << 20
    report = scan_file(path)
    assert (report.grade, report.format) == ("safe", "safetensors"), report.findings


def test_the_opcodes_run_are_bounded_per_file_not_per_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each stream had a cap of its own, so a file of many long streams of trivial opcodes
    # (a 1 GiB one: ~25 minutes) was bounded only by its size. With a budget of 1,000 here,
    # three streams of 400 opcodes are scanned as far as the budget goes, and the rest is
    # reported as not analysed.
    from pysafetensors import scan as scan_module

    monkeypatch.setattr(scan_module, "MAX_OPS", 1_000)
    stream = b"\x80\x02" + b"N0" * 199 + b"N."  # 400 opcodes
    path = tmp_path / "many.pkl"
    path.write_bytes(stream * 3)
    report = scan_module.scan_file(path)
    assert report.grade == "suspicious"
    assert report.streams == 3  # the third stopped at the budget's end
    assert any("opcodes" in f.message and "not analysed" in f.message for f in report.findings)
    path.write_bytes(stream * 2)
    assert scan_module.scan_file(path).grade == "safe"  # 800 opcodes: within the budget


def _npy(descr: str, data: bytes, version: int = 1) -> bytes:
    """A ``.npy`` file as ``numpy.save`` lays it out: magic, version, header, then ``data``."""
    header = f"{{'descr': {descr}, 'fortran_order': False, 'shape': (1,), }}".encode()
    size = struct.pack("<H" if version == 1 else "<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + size + header + data


_NPY_PAYLOAD = P.PROTO2 + P.g("os", "system") + P.u("echo") + b"\x85R."


@pytest.mark.parametrize("version", [1, 2, 3])
def test_object_arrays_of_npy_files_are_scanned(tmp_path: Path, version: int) -> None:
    # numpy.load(..., allow_pickle=True) unpickles the data of an object array: the payload
    # after the header ran, while the scanner read the file from its first byte only.
    report = scan_file(_write(tmp_path / "a.npy", _npy("'|O'", _NPY_PAYLOAD, version)))
    assert report.format == "npy"
    assert report.grade == "dangerous"
    assert [g.qualname for g in report.globals] == ["os.system"]
    # A structured dtype with an object field is unpickled too.
    fields = "[('x', '<f4'), ('y', '|O')]"
    assert scan_file(_write(tmp_path / "b.npy", _npy(fields, _NPY_PAYLOAD))).grade == "dangerous"


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_object_arrays_in_npz_members_are_scanned(tmp_path: Path, compression: int) -> None:
    # An .npz holding one such array was graded safe: its member starts with the npy magic,
    # not with a pickle.
    path = tmp_path / "a.npz"
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr("arr_0.npy", _npy("'|O'", _NPY_PAYLOAD))
    report = scan_file(path)
    assert report.grade == "dangerous"
    assert [(g.qualname, g.where) for g in report.globals] == [("os.system", "a.npz:arr_0.npy")]


def test_npy_files_numpy_does_not_unpickle_stay_safe(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "f.npy", np.arange(6.0))
    np.save(tmp_path / "o.npy", np.array([1, "x", None], dtype=object))
    assert scan_file(tmp_path / "f.npy").grade == "safe"
    assert scan_file(tmp_path / "o.npy").grade == "safe"
    np.savez(tmp_path / "one.npz", a=np.array([1.5, None], dtype=object))
    assert scan_file(tmp_path / "one.npz").grade == "safe"
    # Several arrays are several members at the top of the zip: no torch archive's folders.
    np.savez(tmp_path / "two.npz", a=np.arange(3), b=np.array([None], dtype=object))
    two = scan_file(tmp_path / "two.npz")
    assert (two.grade, two.findings) == ("safe", [])
    # Raw numeric data that happens to be a pickle is never unpickled by numpy.
    numeric = _write(tmp_path / "n.npy", _npy("'<f4'", _NPY_PAYLOAD))
    assert scan_file(numeric).grade == "safe"


def test_npy_data_after_a_header_not_read_here_is_probed(tmp_path: Path) -> None:
    # A header this reader cannot parse (numpy may, e.g. a Python 2 one): the data is kept
    # as a pickle when it imports or calls something.
    bad = b"\x93NUMPY\x01\x00" + struct.pack("<H", 5) + b"{'a'," + _NPY_PAYLOAD
    assert scan_file(_write(tmp_path / "p.npy", bad)).grade == "dangerous"


def test_zip_members_outside_the_archive_s_one_folder_are_suspicious(tmp_path: Path) -> None:
    # torch reads the folder of the first record; members elsewhere are ones it never reads.
    safe_pickle = P.PROTO2 + b"}q\x00."
    for extra in ("other/data.pkl", "data.pkl"):
        path = tmp_path / "c.pt"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("archive/data.pkl", safe_pickle)
            zf.writestr(extra, safe_pickle)
        report = scan_file(path)
        assert report.grade == "suspicious"
        assert [f.message for f in report.findings] == [
            f"zip members under several folders {sorted(['archive', extra.split('/')[0]])}"
        ]


_OPEN_CALL = b"cbuiltins\nopen\n(Vmarker\nVw\ntR."


def test_an_int_line_starting_with_nul_is_read_as_cpython_reads_it(tmp_path: Path) -> None:
    # CPython's strtol reads no digits from "\0..." and stops at the NUL: INT 0. The scanner
    # refused the operand and stopped there, where pickle.load goes on to the call; a
    # safetensors-shaped file (header length 0x49: "I\0...") was graded safe that way.
    assert pickle.loads(b"I\x00anything\n.") == 0 and pickle.loads(b"I\x00a\n.") is False
    payload = b"\n0" + _OPEN_CALL
    header = json.dumps(
        {"x": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}},
        separators=(",", ":"),
    ).encode()
    polyglot = struct.pack("<Q", 0x49) + header.ljust(0x49, b" ") + payload
    report = scan_file(_write(tmp_path / "model.bin", polyglot))
    assert report.grade == "dangerous"
    assert [(g.module, g.name) for g in report.globals] == [("builtins", "open")]
    zipped = tmp_path / "nul.pt"
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr("archive/data.pkl", b"I\x00\n0" + _OPEN_CALL)
    assert scan_file(zipped).grade == "dangerous"


def test_tar_members_torch_would_read_unlike_the_scanner_are_flagged(tmp_path: Path) -> None:
    import tarfile

    # A member of an unknown type is extracted (and read) as a regular file: it was skipped.
    unknown = tmp_path / "unknown.pt"
    with tarfile.open(unknown, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("storages")
        info.size, info.type = len(_OPEN_CALL), b"Z"
        tar.addfile(info, io.BytesIO(_OPEN_CALL))
    assert scan_file(unknown).grade == "dangerous"
    # A sparse member whose map lists one place twice: extraction keeps the second chunk,
    # extractfile (what the scanner read) the first, a harmless table.
    evil = _OPEN_CALL
    benign = b"V" + b"a" * (len(evil) - 8) + b"\n0K\x00.]."
    sparse = tmp_path / "sparse.pt"
    info = tarfile.TarInfo("storages")
    info.size = 2 * len(evil)
    info.pax_headers = {
        "GNU.sparse.map": f"0,{len(evil)},0,{len(evil)}",
        "GNU.sparse.size": str(len(evil)),
    }
    with tarfile.open(sparse, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(benign + evil))
    report = scan_file(sparse)
    assert report.grade != "safe"
    assert any("sparse tar member" in str(f) for f in report.findings)


def _zip_bytes(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


#: A torch-style zip checkpoint whose data.pkl runs ``os.system("echo pwned")``.
_EVIL_PICKLE = P.PROTO2 + P.g("os", "system") + P.u("echo pwned") + b"\x85R."
_EVIL_CHECKPOINT = _zip_bytes({"archive/data.pkl": _EVIL_PICKLE, "archive/version": b"3\n"})


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_checkpoints_inside_archives_are_scanned(tmp_path: Path, compression: int) -> None:
    # A checkpoint stored as a member of another zip (a downloaded model folder, zipped) was
    # only probed as a raw pickle: the probe failed, nothing inside was read, the outer file
    # was graded safe.
    assert scan_file(_write(tmp_path / "inner.pt", _EVIL_CHECKPOINT)).grade == "dangerous"
    outer = _zip_bytes({"model/pytorch_model.bin": _EVIL_CHECKPOINT}, compression)
    report = scan_file(_write(tmp_path / "outer.zip", outer))
    assert report.grade == "dangerous"
    assert [(g.qualname, g.where) for g in report.globals] == [
        ("os.system", "outer.zip:model/pytorch_model.bin:archive/data.pkl")
    ]
    # A checkpoint named like a pickle (torch.save(model, "model.pkl")) is read as what it is.
    named = _zip_bytes({"model.pkl": _EVIL_CHECKPOINT}, compression)
    assert scan_file(_write(tmp_path / "named.zip", named)).grade == "dangerous"
    # A 0.1.1 tar checkpoint in a zip, and a zip checkpoint in a tar.
    tar = _tar_bytes({"sys_info": pickle.dumps({}, 2), "pickle": _OPEN_CALL})
    report = scan_file(_write(tmp_path / "tar.zip", _zip_bytes({"old/model.pt": tar})))
    assert report.grade == "dangerous"
    assert {g.where for g in report.globals} == {"tar.zip:old/model.pt:pickle"}
    # (A README after it keeps the zip's end record out of the tar's tail, where it would make
    # the whole tar a zip with data in front.)
    tar = _tar_bytes({"m.pt": _EVIL_CHECKPOINT, "README": bytes(1 << 17)})
    report = scan_file(_write(tmp_path / "zip.tar", tar))
    assert report.grade == "dangerous"
    assert {g.where for g in report.globals} == {"zip.tar:m.pt:archive/data.pkl"}
    # A clean checkpoint inside a zip stays safe.
    make_zip(tmp_path / "clean.pt", good_pickle())
    clean = _zip_bytes({"m/clean.pt": (tmp_path / "clean.pt").read_bytes()}, compression)
    report = scan_file(_write(tmp_path / "clean.zip", clean))
    assert (report.grade, report.findings) == ("safe", [])


def test_archives_nested_too_deep_or_too_large_are_not_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Archives nested past MAX_NESTING are reported, not silently passed over.
    from pysafetensors import scan

    data = _EVIL_CHECKPOINT
    for level in range(scan.MAX_NESTING + 1):
        data = _zip_bytes({f"level{level}/m.zip": data})
    report = scan_file(_write(tmp_path / "deep.zip", data))
    assert report.grade == "suspicious"
    (finding,) = report.findings
    assert "nested archive" in finding.message and "not analysed" in finding.message
    assert finding.where.count(":") == scan.MAX_NESTING + 1
    # One level less is read to the bottom.
    data = _EVIL_CHECKPOINT
    for level in range(scan.MAX_NESTING):
        data = _zip_bytes({f"level{level}/m.zip": data})
    assert scan_file(_write(tmp_path / "deep.zip", data)).grade == "dangerous"
    # A nested archive over the size limit is not read into memory, and says so.
    big = _zip_bytes({"archive/data.pkl": good_pickle(), "archive/data/0": bytes(8192)})
    monkeypatch.setattr(scan, "MAX_PICKLE_BYTES", 4096)
    report = scan_file(_write(tmp_path / "big.zip", _zip_bytes({"m/big.pt": big})))
    assert report.grade == "suspicious"
    assert [(f.message, f.where) for f in report.findings] == [
        ("nested archive (zip) over 4096 bytes: not analysed", "big.zip:m/big.pt")
    ]


def test_deflated_members_are_inflated_in_bounded_memory(tmp_path: Path) -> None:
    # The whole compressed member was copied out of the mapping to read a 64 KiB probe, and
    # the decompressor kept a second copy as its unconsumed input: scanning an 800 MB
    # np.savez_compressed file took 2.3 GB.
    np = pytest.importorskip("numpy")
    # Random nibbles: deflate halves them, so the compressed member is tens of MB.
    values = np.random.default_rng(0).integers(0, 16, 64 << 20, dtype=np.uint8)
    np.savez_compressed(tmp_path / "a.npz", a=values)
    with zipfile.ZipFile(tmp_path / "a.npz") as zf:
        assert zf.infolist()[0].compress_size > 24 << 20
    report, peak = _scan_with_peak(tmp_path / "a.npz")
    assert (report.grade, report.findings) == ("safe", [])
    assert peak < 8 << 20


def test_numpy_random_generators_are_not_dangerous(tmp_path: Path) -> None:
    # numpy pickles its random generators through numpy.random._pickle.__randomstate_ctor,
    # __generator_ctor and __bit_generator_ctor (and a SeedSequence through Cython's
    # __pyx_unpickle_SeedSequence): the dunder names made every checkpoint with RNG state (a
    # training checkpoint's) dangerous, and convert --skip-unknown refused it.
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    state = {
        "w": torch.ones(2),
        "rng": np.random.RandomState(0),
        "gen": np.random.default_rng(0),
        "bits": np.random.PCG64(1),
    }
    torch.save(state, tmp_path / "rng.pt")
    report = scan_file(tmp_path / "rng.pt")
    assert report.grade == "suspicious", [f for f in report.findings if f.grade == "dangerous"]
    names = {g.qualname: g.grade for g in report.globals}
    for ctor in ("__randomstate_ctor", "__generator_ctor", "__bit_generator_ctor"):
        assert names[f"numpy.random._pickle.{ctor}"] == "suspicious"
    # A Generator's SeedSequence comes back through the helper Cython made for it.
    assert names["numpy.random.bit_generator.__pyx_unpickle_SeedSequence"] == "suspicious"
    # True dunder lookups stay dangerous, in that module and everywhere.
    assert grade_global("numpy.random._pickle", "__builtins__") == "dangerous"
    assert grade_global("numpy.random", "__randomstate_ctor") == "dangerous"
    assert grade_global("__builtin__", "__import__") == "dangerous"
    assert grade_global("numpy.random._pickle", "__randomstate_ctor.__globals__") == "dangerous"


def test_numpy_random_constructors_calling_other_callables_are_dangerous(tmp_path: Path) -> None:
    # __randomstate_ctor(name, ctor) calls ctor(name): numpy passes its own
    # __bit_generator_ctor there (or nothing), anything else makes it a call gadget.
    ctor = P.g("numpy.random._pickle", "__randomstate_ctor")
    own = P.g("numpy.random._pickle", "__bit_generator_ctor")
    fine = P.PROTO2 + ctor + P.u("MT19937") + own + b"\x86R."
    assert scan_file(_write(tmp_path / "fine.pkl", fine)).grade == "suspicious"
    gadget = P.PROTO2 + ctor + P.u("echo pwned") + P.g("mylib", "run") + b"\x86R."
    report = scan_file(_write(tmp_path / "gadget.pkl", gadget))
    assert report.grade == "dangerous"
    assert [f.message for f in report.findings if f.grade == "dangerous"] == [
        "numpy.random._pickle.__randomstate_ctor calls mylib.run with the pickle's "
        "argument, not numpy's bit generator constructor"
    ]


def _tar_header_pickle(pickled: bytes) -> bytes:
    """A 512-byte block that ``tarfile`` takes for a tar (its checksum is right) and whose
    first bytes, the member name, are ``pickled``."""
    import tarfile

    block = tarfile.TarInfo(pickled.decode("latin1")).tobuf(tarfile.USTAR_FORMAT, "latin1")
    assert len(block) == 512 and block.startswith(pickled)
    return block


_TAR_SHAPED_RCE = _tar_header_pickle(b"cos\nsystem\n(S'touch /tmp/x'\ntR.")


def test_pickle_members_shaped_like_archives_are_read_as_pickles_past_the_archive_budget(
    tmp_path: Path,
) -> None:
    # A *.pkl member (or a tar checkpoint's member) that tarfile takes for a tar was read only
    # as an archive: once the nested-archive budget was spent (256 tiny zips before it), it
    # was not read at all and graded suspicious, while torch.load unpickles it and runs it.
    from pysafetensors import scan

    junk = _zip_bytes({"x": b""})
    members = {f"archive/extra/{i}": junk for i in range(scan.MAX_NESTED_SCANS)}
    members["archive/data.pkl"] = _TAR_SHAPED_RCE
    report = scan_file(_write(tmp_path / "ckpt.pt", _zip_bytes(members)))
    assert report.grade == "dangerous"
    assert [(g.qualname, g.where) for g in report.globals] == [
        ("os.system", "ckpt.pt:archive/data.pkl")
    ]
    assert any("nested archive (tar) past" in f.message for f in report.findings)
    # The same member in a 0.1.1 tar checkpoint (a README keeps the zips' end records out of
    # the tar's tail).
    members = {f"extra/{i}": junk for i in range(scan.MAX_NESTED_SCANS)}
    members["pickle"] = _TAR_SHAPED_RCE
    members["README"] = bytes(1 << 17)
    report = scan_file(_write(tmp_path / "ckpt.tar", _tar_bytes(members)))
    assert report.grade == "dangerous"
    assert [(g.qualname, g.where) for g in report.globals] == [("os.system", "ckpt.tar:pickle")]
    # Within the budget, the member is read both ways, each once.
    report = scan_file(_write(tmp_path / "one.pt", _zip_bytes({"a/data.pkl": _TAR_SHAPED_RCE})))
    assert [(g.qualname, g.where) for g in report.globals] == [("os.system", "one.pt:a/data.pkl")]


def test_nested_archives_share_one_memory_budget_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each nesting level could hold 1 GiB in memory at once: a 35 MiB zip of a 1 GiB zip of a
    # 1 GiB zip of a 1 GiB zip peaked at 4.18 GB. The bytes of all nested archives a file
    # makes the scanner hold are now one budget.
    from pysafetensors import scan

    inner = _zip_bytes({"m/c.pt": _EVIL_CHECKPOINT, "m/pad": bytes(4096)})
    middle = _zip_bytes({"m/b.zip": inner, "m/pad": bytes(4096)}, zipfile.ZIP_DEFLATED)
    outer = _zip_bytes({"m/a.zip": middle}, zipfile.ZIP_DEFLATED)
    path = _write(tmp_path / "chain.zip", outer)
    assert scan_file(path).grade == "dangerous"  # read to the bottom with the default budget
    monkeypatch.setattr(scan, "MAX_NESTED_ARCHIVE_BYTES", len(middle) + len(inner) // 2)
    read: list[tuple[str, int]] = []
    zip_member = scan._zip_member

    def spy(data: bytes, info: zipfile.ZipInfo, limit: int) -> tuple[bytes, bool]:
        read.append((info.filename, limit))
        return zip_member(data, info, limit)

    monkeypatch.setattr(scan, "_zip_member", spy)
    report = scan_file(path)
    assert report.grade == "suspicious"
    assert [(f.message, f.where) for f in report.findings] == [
        (
            f"nested archive (zip) past the {len(middle) + len(inner) // 2} bytes of nested "
            "archives read per file: not analysed",
            "chain.zip:m/a.zip:m/b.zip",
        )
    ]
    # b.zip's first window was read to learn that it is a zip, not the member to scan it, and
    # nothing inside it was read.
    assert [limit for name, limit in read if name == "m/b.zip"] == [scan._PROBE_WINDOW]
    assert [name for name, _ in read if name.startswith("m/c.pt") or "archive/" in name] == []


def test_numpy_random_constructors_with_computed_arguments_are_dangerous(
    tmp_path: Path,
) -> None:
    # The call-gadget check read only a literal argument tuple, and the machine refuses a call
    # whose arguments are a call result: builtins.tuple of a list holding mypkg.tools.run hid
    # it (and every opcode after it), and the pickle was graded suspicious.
    from pysafetensors import scan

    ctor = P.g("numpy.random._pickle", "__randomstate_ctor")
    items = P.u("MT19937") + P.g("mypkg.tools", "run")
    computed = P.g("builtins", "tuple") + b"](" + items + b"e\x85R"
    gadget = P.PROTO2 + ctor + computed + b"R."
    report = scan_file(_write(tmp_path / "gadget.pkl", gadget))
    assert report.grade == "dangerous"
    assert [f.message for f in report.findings if f.grade == "dangerous"] == [
        "numpy.random._pickle.__randomstate_ctor calls mypkg.tools.run with the pickle's "
        "argument, not numpy's bit generator constructor"
    ]
    # Opcodes after such a call are read: a payload behind list(tuple([])) went unread.
    hidden = b"cbuiltins\nlist\ncbuiltins\ntuple\n]\x85RR0cos\nsystem\n(S'echo x'\ntR."
    assert scan_file(_write(tmp_path / "hidden.pkl", hidden)).grade == "dangerous"
    # Arguments that are not a literal tuple at all, whatever opcode hands them over.
    report = scan.ScanReport("x")
    args = scan._SymCall(scan._SymGlobal("builtins", "tuple"), ())
    scan._ScanPolicy(report, "x", 0)._check_rng_ctor("f", args, 0)
    assert [f.grade for f in report.findings] == ["dangerous"]
    # numpy's own forms stay suspicious: the name alone, and with its constructor.
    own = P.g("numpy.random._pickle", "__bit_generator_ctor")
    for args_ in (P.u("MT19937") + b"\x85", P.u("MT19937") + own + b"\x86"):
        data = P.PROTO2 + ctor + args_ + b"R."
        assert scan_file(_write(tmp_path / "own.pkl", data)).grade == "suspicious"


@pytest.mark.parametrize("opcode", [b"R", b"\x81"])
def test_calls_after_one_with_computed_arguments_are_read(tmp_path: Path, opcode: bytes) -> None:
    """``list(list([]))``: REDUCE (or NEWOBJ) whose arguments are a call's result stopped the
    machine ("arguments are not a tuple"), and the ``os.system`` after it was never read: the
    file was graded suspicious, while pickle.loads runs it. The converter still refuses it."""
    from pysafetensors.convert import convert_file

    program = (
        b"\x80\x02cbuiltins\nlist\ncbuiltins\nlist\n(]tR" + opcode + b"0"
        b"cos\nsystem\n(S'echo pwned'\ntR."
    )
    path = tmp_path / "computed.pkl"
    path.write_bytes(program)
    report = scan_file(str(path))
    assert report.grade == "dangerous", report.findings
    assert any(g.module == "os" and g.name == "system" for g in report.globals), report.globals
    with pytest.raises(SafetensorError):
        convert_file(str(path), str(tmp_path / "out.safetensors"))
