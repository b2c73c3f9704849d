"""Every malicious or broken checkpoint of the corpus is refused with the right error class,
nothing it carries is run, and no output file appears."""

from __future__ import annotations

from pathlib import Path

import pytest

from pysafetensors._errors import SafetensorError, UnsafePickleError
from pysafetensors.convert import convert_file
from pysafetensors.scan import scan_file

from .corpus import CASES, Case


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_refused(case: Case, tmp_path: Path) -> None:
    src = tmp_path / "model.bin"
    canary = tmp_path / "canary"
    case.build(src, canary)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with pytest.raises(SafetensorError) as info:
        convert_file(src, out)
    err = info.value
    assert type(err) is case.error, f"{type(err).__name__}: {err}"
    if case.global_name is not None:
        assert isinstance(err, UnsafePickleError)
        assert err.global_name == case.global_name
        assert err.offset is not None
    assert not canary.exists(), "a payload ran"
    assert list(out.parent.iterdir()) == [], "output (or a partial file) was left behind"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_scanner_survives_and_flags(case: Case, tmp_path: Path) -> None:
    src = tmp_path / "model.bin"
    canary = tmp_path / "canary"
    case.build(src, canary)
    report = scan_file(src)  # never raises on hostile content
    assert not canary.exists()
    if case.error is UnsafePickleError and not case.name.startswith(("torchscript", "build")):
        assert report.grade != "safe", report.to_dict()
    if case.global_name and case.global_name != "builtins.__import__":
        module, _, name = case.global_name.rpartition(".")
        if case.name != "py2_builtin_eval":
            assert any(g.qualname == case.global_name for g in report.globals), report.to_dict()
