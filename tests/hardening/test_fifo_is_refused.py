"""A FIFO opened as a safetensors file is refused at once; devices read as the reference does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def test_safe_open_of_a_fifo_is_refused_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    # open(2) of a FIFO for reading waits for a writer: safe_open (and load_file) blocked for
    # ever. In a child process, so that a regression fails the test instead of hanging it.
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code = textwrap.dedent(
        f"""
        import pysafetensors
        from pysafetensors.numpy import load_file
        for backend in ("mmap", "pread"):
            try:
                pysafetensors.safe_open({str(fifo)!r}, "np", backend=backend)
            except OSError as exc:
                assert "FIFO" in str(exc) and {str(fifo)!r} in str(exc), exc
            else:
                raise AssertionError("opened")
        try:
            load_file({str(fifo)!r})
        except OSError as exc:
            assert "FIFO" in str(exc), exc
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_reads_as_a_file_of_its_reported_size_as_in_the_reference() -> None:
    import pysafetensors

    with pytest.raises(pysafetensors.SafetensorError, match="header too small"):
        pysafetensors.safe_open("/dev/zero", "np")


def test_a_save_over_a_fifo_or_socket_is_refused_not_replacing_it(tmp_path: Path) -> None:
    """A save renames its file over the target: a FIFO (or, run as root, /dev/null) was
    replaced by a regular file, as the reference does."""
    import socket
    import stat

    import numpy as np

    import pysafetensors
    from pysafetensors.numpy import save_file

    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.safetensors"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    try:
        for target, kind in ((fifo, stat.S_ISFIFO), (sock_path, stat.S_ISSOCK)):
            for save in (
                lambda t=target: save_file({"x": np.zeros(2, np.float32)}, t),
                lambda t=target: pysafetensors.serialize_file({}, t),
            ):
                with pytest.raises(FileExistsError, match="device, FIFO or socket") as info:
                    save()
                assert isinstance(info.value, pysafetensors.WriteError)
            assert kind(os.lstat(target).st_mode)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["fifo.safetensors", "sock.safetensors"]  # no temporary file either
    finally:
        server.close()
