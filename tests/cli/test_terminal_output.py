"""The command line on a real terminal (a pseudo-terminal): styled output, ``--no-color`` and
``NO_COLOR`` without it, and names from a file shown as they are, never read as markup or
passed through as the terminal's escape sequences. Every other CLI test runs piped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pysafetensors.numpy import save_file

pty = pytest.importorskip("pty")

MARKUP = "[bold red]x[/]"
ESCAPE = "e\x1b[31mred"


def _on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pysafetensors", *args], stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=60), out.decode("utf-8", "replace")


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    path = tmp_path / "hostile.safetensors"
    save_file({MARKUP: np.ones(2, np.float32), ESCAPE: np.ones(1, np.float32)}, path)
    return path


@pytest.fixture
def env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env["COLUMNS"] = "200"  # wide enough that no name is cut
    return env


def test_a_terminal_gets_styles_and_the_names_as_they_are(
    hostile: Path, env: dict[str, str]
) -> None:
    code, out = _on_a_terminal(["inspect", str(hostile)], env)
    assert code == 0
    assert "\x1b[1m" in out  # styled: a terminal
    assert MARKUP in out  # not read as markup (bold red, and the text gone)
    assert ESCAPE not in out and "\\x1b[31mred" in out  # shown escaped, not sent


@pytest.mark.parametrize("how", ["--no-color", "NO_COLOR"])
def test_no_color_on_a_terminal(hostile: Path, env: dict[str, str], how: str) -> None:
    args = ["inspect", str(hostile)]
    if how == "--no-color":
        args.insert(0, how)
    else:
        env["NO_COLOR"] = "1"
    code, out = _on_a_terminal(args, env)
    assert code == 0 and "\x1b" not in out
    assert MARKUP in out and "\\x1b[31mred" in out
