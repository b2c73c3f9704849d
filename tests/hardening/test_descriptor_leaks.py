"""Descriptors, files and memory left behind on failure and interruption paths: each test
repeats a failure and checks that nothing accumulates."""

from __future__ import annotations

import gc
import io
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import pysafetensors
import pysafetensors._writer as writer
from pysafetensors import safe_open
from pysafetensors.numpy import save_file

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_edit_metadata_closes_every_descriptor(tmp_path: Path) -> None:
    # Each call leaked the second descriptor that read_header's partial reads open.
    good, bad = tmp_path / "m.safetensors", tmp_path / "bad.safetensors"
    save_file({"a": np.ones(16, np.float32)}, good, metadata={"format": "pt"})
    bad.write_bytes(good.read_bytes()[:40])
    before = _open_fds()
    for i in range(30):
        pysafetensors.edit_metadata(good, set={"k": str(i % 2)})
        with pytest.raises(pysafetensors.SafetensorError):
            pysafetensors.edit_metadata(bad, set={"k": "v"})
    assert _open_fds() == before


def test_an_interrupt_as_a_metadata_edit_opens_its_file_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_sigint_handler: None
) -> None:
    # Ctrl-C during the open of the file to edit is raised as os.open returns, before its
    # descriptor is stored: it leaked. The open is held from it, and the descriptor closed.
    import signal

    target = tmp_path / "m.safetensors"
    save_file({"a": np.ones(16, np.float32)}, target)
    before, content = _open_fds(), target.read_bytes()
    real_open = os.open

    def interrupted_open(path: str, flags: int, mode: int = 0o777) -> int:
        fd = real_open(path, flags, mode)
        os.kill(os.getpid(), signal.SIGINT)
        return fd

    with monkeypatch.context() as m:
        m.setattr(os, "open", interrupted_open)
        for _ in range(5):
            with pytest.raises(KeyboardInterrupt):
                pysafetensors.edit_metadata(target, set={"k": "v"})
    assert _open_fds() == before and target.read_bytes() == content


def test_an_interrupt_as_the_temporary_file_opens_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal during open(2) is raised as os.open returns, before the descriptor is stored:
    # the descriptor leaked and the locked .partial file stayed (no later save removed it).
    real_open = os.open

    def interrupted_open(path: str, flags: int, mode: int = 0o777) -> int:
        real_open(path, flags, mode)
        raise KeyboardInterrupt

    target = tmp_path / "out.safetensors"
    before = _open_fds()
    monkeypatch.setattr(writer.os, "open", interrupted_open)
    for _ in range(5):
        with pytest.raises(KeyboardInterrupt):
            save_file({"x": np.ones(8, np.float32)}, target)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [] and _open_fds() == before


def test_a_failed_parallel_read_leaves_no_cycle_holding_its_buffer(tmp_path: Path) -> None:
    # The exception was raised from run_parallel's frame, which held the futures holding the
    # exception: a cycle that kept the destination buffer until the cyclic collector ran.
    path = tmp_path / "f.safetensors"
    save_file({"a": np.ones(5 << 20, np.float32)}, path)  # 20 MiB: read by several threads
    flags = gc.get_debug()
    gc.collect()
    gc.disable()
    try:
        f = safe_open(path, "np", backend="pread", threads=4)
        os.truncate(path, os.path.getsize(path) - 4096)  # the reader threads meet the end
        with pytest.raises(pysafetensors.SafetensorError):
            f.get_tensors()
        f.close()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        frames = {o.f_code.co_name for o in gc.garbage if type(o).__name__ == "frame"}
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()
    assert not frames & {"run_parallel", "read_fresh", "get_tensors"}, frames


def test_the_command_line_closes_what_it_opens_for_a_broken_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pysafetensors._cli import main

    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": np.ones(4, np.float32) for i in range(200)}, path)
    before = _open_fds()
    codes = set()
    for _ in range(5):
        read_end, write_end = os.pipe()
        os.close(read_end)  # whatever is written now raises BrokenPipeError
        with open(write_end, "wb", buffering=0) as raw:
            monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, write_through=True))
            codes.add(main(["inspect", str(path)]))
    assert codes == {141} and _open_fds() == before


def test_a_file_exists_error_from_the_writing_still_removes_the_temporary_file(
    tmp_path: Path,
) -> None:
    # Only the open's own FileExistsError (O_EXCL refusing a name that is not ours) keeps the
    # file; one raised while writing is a failed save like any other.
    before = _open_fds()
    with pytest.raises(FileExistsError), writer.atomic_output(tmp_path / "out.safetensors"):
        raise FileExistsError("raised while writing")
    assert os.listdir(tmp_path) == [] and _open_fds() == before


def test_a_second_interrupt_during_a_save_s_clean_up_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_sigint_handler: None
) -> None:
    """A first Ctrl-C stops the write; a second one, landing in the clean-up before the
    temporary file is deleted, raised KeyboardInterrupt there and left the file. It is held
    until the clean-up is done now, then raised; the handler is Python's again after."""
    import signal

    real_writev, real_getpid = os.writev, os.getpid
    interrupted: list[int] = []

    def interrupted_writev(fd: int, buffers: object) -> int:
        interrupted.append(1)
        raise KeyboardInterrupt  # the first Ctrl-C, mid-write

    def second_ctrl_c() -> int:
        if interrupted:  # in the clean-up (the save asks for its pid at its start too)
            interrupted.clear()
            signal.raise_signal(signal.SIGINT)  # handled at the next bytecode boundary
        return real_getpid()

    target = tmp_path / "out.safetensors"
    before = _open_fds()
    for _ in range(3):
        monkeypatch.setattr(writer.os, "writev", interrupted_writev)
        monkeypatch.setattr(writer.os, "getpid", second_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            save_file({"x": np.ones(1 << 16, np.float32)}, target)
        monkeypatch.setattr(writer.os, "writev", real_writev)
        monkeypatch.setattr(writer.os, "getpid", real_getpid)
        assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _open_fds() == before
    save_file({"x": np.ones(4, np.float32)}, target)  # and the next save works
    assert os.listdir(tmp_path) == ["out.safetensors"]


def test_a_program_s_own_interrupt_handler_is_left_in_charge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    calls: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with writer.interrupts_deferred():
            assert signal.getsignal(signal.SIGINT) is handler
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):  # let the handler run (it runs between bytecodes)
                if calls:
                    break
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_interrupt_handler_comes_back_when_another_signal_s_handler_raises(
    monkeypatch: pytest.MonkeyPatch, python_sigint_handler: None
) -> None:
    """signal.signal runs pending handlers first and, when one raises, returns without
    setting the handler: the deferral's temporary handler stayed for good (every later
    Ctrl-C swallowed). The restore is retried, then that exception raised."""
    import signal

    from pysafetensors import _interrupts

    raw = _interrupts._raw_signal  # the C module the deferral calls (see _interrupts)
    calls: list[object] = []

    class Alarm(Exception):
        pass

    class Flaky:
        getsignal = staticmethod(raw.getsignal)

        @staticmethod
        def signal(signum: int, handler: object) -> object:
            calls.append(handler)
            if len(calls) == 2:  # the restore: another signal's handler raised first
                raise Alarm
            return raw.signal(signum, handler)

    monkeypatch.setattr(_interrupts, "_raw_signal", Flaky)
    with pytest.raises(Alarm), writer.interrupts_deferred():
        pass
    monkeypatch.undo()
    assert len(calls) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
