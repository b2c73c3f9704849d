"""``-H/--header`` and ``--remote-option``: URLs behind authentication, from every command that
reads a target, against a loopback server that answers 401 without the right header."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pysafetensors._cli._remote_args import _value
from pysafetensors.numpy import load_file

from .rangehttp import RangeHTTPServer

TOKEN = "Bearer s3cr3t-t0ken"


@pytest.fixture(scope="module")
def private(http_root: Path) -> Iterator[RangeHTTPServer]:
    """The example files, served only to requests that carry ``Authorization: TOKEN``."""
    pytest.importorskip("pysafetensors._remote")
    server = RangeHTTPServer(http_root, required={"Authorization": TOKEN})
    yield server
    server.close()


@pytest.fixture
def header_file(tmp_path: Path) -> Path:
    path = tmp_path / "headers.txt"
    path.write_text(f"# the model host's token\n\nAuthorization: {TOKEN}\n")
    return path


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert "s3cr3t" not in text


def test_without_the_header_the_server_refuses(cli, private: RangeHTTPServer) -> None:
    r = cli("inspect", f"{private.url}/model.safetensors")
    assert r.code == 2
    assert "authentication required (401)" in r.err
    assert "hint: on the command line, give credentials with -H" in r.err


def test_header_on_the_command_line_and_from_a_file(
    cli, private: RangeHTTPServer, http_root: Path, header_file: Path
) -> None:
    url = f"{private.url}/model.safetensors"
    local = cli("inspect", http_root / "model.safetensors", "--json").json()
    for args in (("-H", f"Authorization: {TOKEN}"), ("--header", f"@{header_file}")):
        seen = len(private.seen)
        r = cli("inspect", url, "--json", *args)
        assert r.code == 0, r.err
        drop = ("file",)  # the URL or the path
        assert [{k: v for k, v in t.items() if k not in drop} for t in r.json()["tensors"]] == [
            {k: v for k, v in t.items() if k not in drop} for t in local["tensors"]
        ]
        # Every request carried the header as given (the value's spaces kept).
        assert private.seen[seen:] and all(
            s == {"Authorization": TOKEN} for s in private.seen[seen:]
        )


def test_every_reading_command_takes_the_headers(
    cli, private: RangeHTTPServer, http_root: Path, header_file: Path, tmp_path: Path
) -> None:
    h = f"@{header_file}"
    url = f"{private.url}/model.safetensors"
    index = f"{private.url}/sharded/model.safetensors.index.json"
    local = http_root / "model.safetensors"
    assert cli("validate", "--strict", url, "-H", h).code == 0
    assert cli("validate", index, "-H", h).code == 0
    assert (
        cli("hash", index, "--json", "-H", h).json()["model"]
        == (cli("hash", local, "--json").json()["model"])
    )
    stats = cli("stats", url, "--json", "-H", h).json()["tensors"]
    assert stats == cli("stats", local, "--json").json()["tensors"]
    assert cli("metadata", "get", url, "format", "-H", h).out.strip() == "pt"
    assert cli("diff", local, url, "-H", h).code == 0  # identical
    assert cli("diff", url, index, "-H", h).code == 0  # one file, same tensors as the shards
    cast = tmp_path / "cast.safetensors"
    assert cli("cast", url, cast, "--to", "F16", "-H", h).code == 0
    assert load_file(str(cast))["model.embed.weight"].dtype == np.float16
    merged = tmp_path / "merged.safetensors"
    assert cli("merge", index, merged, "-H", h).code == 0, "merge"
    expected = load_file(str(local))
    got = load_file(str(merged))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name
    out = tmp_path / "resharded"
    r = cli("reshard", index, out, "-s", "4KB", "-H", h)
    assert r.code == 0, r.err
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    part = tmp_path / "embed.safetensors"
    r = cli("extract", index, part, "model.embed.*", "-H", h)
    assert r.code == 0, r.err
    assert list(load_file(str(part))) == ["model.embed.weight"]
    # And none of them works without it.
    for args in (("validate", index), ("merge", index, tmp_path / "m2.safetensors")):
        assert cli(*args).code == 2
    assert not (tmp_path / "m2.safetensors").exists()


def test_remote_options_reach_the_source(cli, private: RangeHTTPServer) -> None:
    url = f"{private.url}/big.safetensors"
    h = ("-H", f"Authorization: {TOKEN}")
    # part_size splits the 1 MiB tensor into 64 KiB requests: the option was applied.
    seen = len(private.seen)
    r = cli("hash", url, *h, "--remote-option", "part_size=65536", "--remote-option", "timeout=5")
    assert r.code == 0, r.err
    assert len(private.seen) - seen >= 16
    # Checked before any request, as a usage error naming the option.
    for option, words in (
        ("max_connections=0", "max_connections"),
        ("timeout=soon", "timeout"),
        ("bogus=1", "unknown storage option"),
        ("headers=x", "-H/--header"),
        ("timeout", "KEY=VALUE"),
    ):
        seen = len(private.seen)
        r = cli("inspect", url, *h, "--remote-option", option)
        assert r.code == 2, (option, r.err)
        assert words in r.err, (option, r.err)
        assert len(private.seen) == seen, option
    r = cli("inspect", url, *h, "--remote-option", "timeout=1", "--remote-option", "timeout=2")
    assert r.code == 2 and "twice" in r.err


def test_malformed_headers_are_refused_without_quoting_them(
    cli, private: RangeHTTPServer, tmp_path: Path
) -> None:
    url = f"{private.url}/model.safetensors"
    bad_file = tmp_path / "bad.txt"
    bad_file.write_text("Bearer s3cr3t-t0ken\n")
    latin = tmp_path / "latin.txt"
    latin.write_text("Authorization: s3cr3t\u20ac\n", encoding="utf-8")
    cases = [
        (("-H", "Bearer s3cr3t-t0ken"), "NAME: VALUE"),  # the name forgotten
        (("-H", "Authorization: s3cr3t\r\nX-Other: 1"), "control character"),
        (("-H", f"@{latin}"), "Latin-1"),
        (("-H", f"@{bad_file}"), "line 1"),
        (("-H", "Bad Name: s3cr3t"), "not a valid header name"),
        # The text before the first ':' may be the token itself: never shown.
        (("-H", "Authorization Bearer s3cr3t-t0ken:x"), "not a valid header name"),
        (("-H", "Authorization=s3cr3t:x"), "not a valid header name"),
        (("--remote-option", "s3cr3t"), "KEY=VALUE"),
        (("-H", "Authorization: s3cr3t", "-H", "authorization: s3cr3t"), "given twice"),
        (("-H", f"@{tmp_path / 'missing.txt'}"), "cannot read header file"),
        (("-H", "Range: bytes=0-1"), "Range"),  # the library's own check
    ]
    for args, words in cases:
        seen = len(private.seen)
        r = cli("inspect", url, *args)
        assert r.code == 2, (args, r.err)
        assert words in r.err, (args, r.err)
        _no_secret(r.out, r.err)
        assert len(private.seen) == seen, args  # nothing was sent
    # With --debug too: the traceback does not carry the value either.
    r = cli("--debug", "inspect", url, "-H", "Bearer s3cr3t-t0ken")
    assert r.code == 2
    _no_secret(r.out, r.err)


def test_header_file_lines_end_at_newlines_only(
    cli, private: RangeHTTPServer, tmp_path: Path
) -> None:
    """A value holding \x85 or \x0c (Latin-1, sendable) stays one value: str.splitlines()
    cut it in two and quoted the second half as a header name."""
    url = f"{private.url}/model.safetensors"
    for odd in ("\x85", "\x0c", "\u00a0"):
        path = tmp_path / "odd.txt"
        path.write_text(f"X-Note: s3cr3t{odd}half\r\nAuthorization: {TOKEN}\r\n", "utf-8")
        seen = len(private.seen)
        r = cli("inspect", url, "-H", f"@{path}")
        _no_secret(r.out, r.err)
        if odd == "\x0c":  # a C0 control: refused, as one value, on line 1
            assert r.code == 2 and "line 1: the value of 'X-Note'" in r.err, r.err
            assert len(private.seen) == seen
        else:
            assert r.code == 0, (odd, r.err)
            assert all(s == {"Authorization": TOKEN} for s in private.seen[seen:])


def test_header_file_limits(cli, private: RangeHTTPServer, tmp_path: Path) -> None:
    url = f"{private.url}/model.safetensors"
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as f:
        f.truncate((1 << 20) + 1)
    r = cli("inspect", url, "-H", f"@{huge}")
    assert r.code == 2 and "over" in r.err
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"Authorization: \xff\xfe\n")
    r = cli("inspect", url, "-H", f"@{binary}")
    assert r.code == 2 and "not UTF-8" in r.err


def test_header_from_a_pipe(private: RangeHTTPServer) -> None:
    """``-H @<(...)``: a shell's process substitution is a pipe, read like a file."""
    read, write = os.pipe()
    os.write(write, f"Authorization: {TOKEN}\n".encode())
    os.close(write)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pysafetensors", "inspect", f"{private.url}/model.safetensors"]
            + ["-H", f"@/dev/fd/{read}"],
            pass_fds=(read,),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(read)
    assert proc.returncode == 0, proc.stderr
    assert "model.embed.weight" in proc.stdout


def test_options_for_local_targets_are_unused(cli, example: Path) -> None:
    r = cli("inspect", example, "-H", f"Authorization: {TOKEN}", "--remote-option", "timeout=5")
    assert r.code == 0, r.err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("60", 60),
        ("1.5", 1.5),
        ("-1", -1),
        ("true", True),
        ("false", False),
        ("null", None),
        ('{"config": 1}', {"config": 1}),
        ('"60"', "60"),
        ("us-east-1", "us-east-1"),
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("0x10", "0x10"),
        ("-", "-"),
        ("", ""),
        ("True", "True"),
    ],
)
def test_option_values(text: str, value: object) -> None:
    assert _value(text) == value
