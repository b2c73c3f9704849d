"""No command prints a URL's ``user:password@`` or its query string (a signed URL's signature),
whatever goes wrong with the file: text and JSON output, errors and warnings alike."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pysafetensors._validate import validate
from pysafetensors.numpy import save_file
from pysafetensors.scan import scan_files

from .conftest import example_tensors, write_sharded
from .rangehttp import RangeHTTPServer

SECRETS = ("alice", "PASSW0RD", "SIGSECRET", "TOKSECRET")


def _bad_file() -> bytes:
    # F32 [4] needs 16 bytes but its offsets span 12, and 4 bytes trail: two errors.
    header = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(16)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RangeHTTPServer]:
    root = tmp_path_factory.mktemp("secrets")
    # No `format` metadata: `validate --strict` warns (MissingFormat) about a valid file.
    save_file({"x": np.arange(8, dtype=np.float32)}, str(root / "plain.safetensors"))
    save_file(example_tensors(), str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "bad.safetensors").write_bytes(_bad_file())
    good = (root / "model.safetensors").read_bytes()
    (root / "trunc.safetensors").write_bytes(good[: len(good) // 2])
    names = list(example_tensors())
    write_sharded(root / "sharded", example_tensors(), [names[:2], names[2:]])
    (root / "sharded" / "model-00002-of-00002.safetensors").write_bytes(_bad_file())
    srv = RangeHTTPServer(root)
    yield srv
    srv.close()


def _url(server: RangeHTTPServer, name: str) -> str:
    host = server.url.partition("://")[2]
    return f"http://alice:PASSW0RD@{host}/{name}?X-Amz-Signature=SIGSECRET&token=TOKSECRET"


def _assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} in output:\n{text}"


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{bad}"],
        ["inspect", "--json", "{bad}"],
        ["inspect", "{trunc}"],
        ["validate", "{bad}"],
        ["validate", "--json", "{bad}"],
        ["validate", "--strict", "{plain}"],
        ["validate", "--strict", "--json", "{plain}"],
        ["validate", "--json", "{sharded}"],
        ["inspect", "{sharded}"],
        ["hash", "{bad}"],
        ["stats", "{trunc}"],
        ["diff", "{bad}", "{plain}"],
        ["diff", "{plain}", "{trunc}"],
        ["metadata", "get", "{bad}"],
        ["extract", "{bad}", "{out}/x.safetensors", "*"],
        ["cast", "{trunc}", "{out}/c.safetensors", "--to", "F16"],
        ["reshard", "{bad}", "{out}/rs", "-s", "1KB"],
        ["merge", "{sharded}", "{out}/m.safetensors"],
        ["convert", "{plain}", "{out}/cv.safetensors"],
        ["scan", "{plain}"],
        ["scan", "--json", "{plain}"],
    ],
    ids=" ".join,
)
def test_cli_never_prints_url_secrets(
    cli_proc, server: RangeHTTPServer, tmp_path: Path, argv: list[str]
) -> None:
    names = {
        "bad": _url(server, "bad.safetensors"),
        "trunc": _url(server, "trunc.safetensors"),
        "plain": _url(server, "plain.safetensors"),
        "sharded": _url(server, "sharded/model.safetensors.index.json"),
        "out": str(tmp_path),
    }
    r = cli_proc(*(a.format(**names) for a in argv))
    assert r.code != 0  # every case is a problem or an error: the file is named somewhere
    assert "Traceback" not in r.err
    _assert_no_secret(r.out + r.err)
    # The file is still named, without the secrets (a shard by its name in the index).
    host = server.url.partition("://")[2]
    assert host in r.out + r.err or "model-00002-of-00002.safetensors" in r.out + r.err


def test_validate_problems_name_the_url_without_secrets(server: RangeHTTPServer) -> None:
    problems = validate(_url(server, "bad.safetensors"))
    assert problems
    for p in problems:
        _assert_no_secret(str(p.file))
        assert p.file == f"{server.url}/bad.safetensors?..."


def test_scan_files_names_a_url_without_secrets(server: RangeHTTPServer) -> None:
    (report,) = scan_files([_url(server, "plain.safetensors")])
    _assert_no_secret(json.dumps(report.to_dict()))
    assert report.format == "error" and report.path == f"{server.url}/plain.safetensors?..."
