"""Commands that stream every tensor of a remote file fetch it in few large requests, not one
request per tensor, and only the bytes of the tensors they read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pysafetensors.numpy import load_file, save_file

from .rangehttp import RangeHTTPServer

N_TENSORS = 1000


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RangeHTTPServer, Path]]:
    pytest.importorskip("pysafetensors._remote")
    root = tmp_path_factory.mktemp("lora")
    rng = np.random.default_rng(3)
    # LoRA-shaped: a thousand small adapters, F32 and F16 (value checks read both).
    tensors = {
        f"layers.{i // 4}.{'qkvo'[i % 4]}.lora_{'AB'[i % 2]}": rng.standard_normal((8, 64)).astype(
            np.float32 if i % 3 else np.float16
        )
        for i in range(N_TENSORS)
    }
    save_file(tensors, str(root / "lora.safetensors"), metadata={"format": "pt"})
    # A large file where a filter picks a small tensor between two large ones.
    big = {
        "a.big": rng.standard_normal(1 << 20).astype(np.float32),
        "b.small": np.arange(16, dtype=np.float32),
        "c.big": rng.standard_normal(1 << 20).astype(np.float32),
    }
    save_file(big, str(root / "big.safetensors"), metadata={"format": "pt"})
    server = RangeHTTPServer(root)
    yield server, root
    server.close()


def _requests(server: RangeHTTPServer, name: str) -> int:
    return sum(1 for path, _, _ in server.log if path.lstrip("/") == name)


@pytest.mark.parametrize(
    "command",
    [("hash", "--json"), ("stats", "--json"), ("validate", "--strict", "--json")],
    ids=["hash", "stats", "validate-strict"],
)
def test_streaming_commands_take_few_requests(
    cli, served: tuple[RangeHTTPServer, Path], command: tuple[str, ...]
) -> None:
    server, root = served
    url = f"{server.url}/lora.safetensors"
    size = (root / "lora.safetensors").stat().st_size
    before_n, before_b = (
        _requests(server, "lora.safetensors"),
        server.bytes_sent("lora.safetensors"),
    )
    remote = cli(command[0], url, *command[1:])
    assert remote.code == 0, remote.err
    requests = _requests(server, "lora.safetensors") - before_n
    sent = server.bytes_sent("lora.safetensors") - before_b
    # The header (1-2 requests) and the 1.5 MiB of data in blocks that double: not 1,000.
    assert requests <= 6, requests
    # Each byte once: hash read the header's bytes past the first 64 KiB a second time.
    assert sent == size, (sent, size)
    local = cli(command[0], root / "lora.safetensors", *command[1:]).json()
    got = remote.json()
    if command[0] == "hash":
        assert got["model"] == local["model"] and got["tensors"] == local["tensors"]
    elif command[0] == "stats":
        assert got["tensors"] == local["tensors"]
    else:
        assert got["valid"] and got["problems"] == local["problems"] == []


def test_cast_and_diff_take_few_requests(
    cli, served: tuple[RangeHTTPServer, Path], tmp_path: Path
) -> None:
    server, root = served
    url = f"{server.url}/lora.safetensors"
    before = _requests(server, "lora.safetensors")
    out = tmp_path / "cast.safetensors"
    assert cli("cast", url, out, "--to", "BF16").code == 0
    assert _requests(server, "lora.safetensors") - before <= 6
    local_out = tmp_path / "cast-local.safetensors"
    assert cli("cast", root / "lora.safetensors", local_out, "--to", "BF16").code == 0
    assert out.read_bytes() == local_out.read_bytes()
    before = _requests(server, "lora.safetensors")
    r = cli("diff", url, root / "lora.safetensors")
    assert r.code == 0, r.out + r.err
    assert _requests(server, "lora.safetensors") - before <= 6
    r = cli("diff", url, out, "--json")
    assert r.code == 1 and r.json()["summary"]["changed"] == N_TENSORS


def test_a_filtered_pass_fetches_only_its_tensor(cli, served: tuple[RangeHTTPServer, Path]) -> None:
    server, root = served
    url = f"{server.url}/big.safetensors"
    before = server.bytes_sent("big.safetensors")
    r = cli("stats", url, "--filter", "b.small", "--json")
    assert r.code == 0, r.err
    sent = server.bytes_sent("big.safetensors") - before
    assert sent < 70 * 1024  # the header and 64 bytes, never a block of the 4 MiB around it
    assert r.json()["tensors"][0]["max"] == 15.0
    assert load_file(str(root / "big.safetensors"))["b.small"].max() == 15.0


def test_a_filtered_diff_fetches_only_its_tensor(cli, served: tuple[RangeHTTPServer, Path]) -> None:
    server, root = served
    url = f"{server.url}/big.safetensors"
    before = server.bytes_sent("big.safetensors")
    r = cli("diff", url, root / "big.safetensors", "--filter", "b.small", "--json")
    assert r.code == 0, r.err
    assert r.json()["summary"]["identical"] == 1
    assert server.bytes_sent("big.safetensors") - before < 70 * 1024


def test_mixed_dtypes_cast_and_diff_fetch_the_file_once(
    cli, served: tuple[RangeHTTPServer, Path], tmp_path: Path
) -> None:
    """cast reads in its output's order and diff in name order: over a file of two dtype
    groups that is two runs through it, not a jump and a fresh block per tensor."""
    server, root = served
    url = f"{server.url}/lora.safetensors"  # F32 and F16 tensors, names interleaved
    size = (root / "lora.safetensors").stat().st_size
    for args in (("cast", url, tmp_path / "c.safetensors", "--to", "F16"), ("diff", url, url)):
        before_n = _requests(server, "lora.safetensors")
        before_b = server.bytes_sent("lora.safetensors")
        assert cli(*args).code == 0
        sent = server.bytes_sent("lora.safetensors") - before_b
        requests = _requests(server, "lora.safetensors") - before_n
        reads = 2 if args[0] == "diff" else 1  # diff reads the URL as A and as B
        # Each read of the file fetches it about once (a part retried after a dropped
        # connection is sent again, hence the margin; the jumps this guards against fetched
        # a block per tensor).
        assert sent <= 1.5 * reads * size, (args[0], sent, size)
        assert requests <= reads * 8, (args[0], requests)


def test_diff_refuses_options_before_any_request(cli, served: tuple[RangeHTTPServer, Path]) -> None:
    """An option the second target's source does not take is refused before the first
    target is opened (both use the same options)."""
    server, _ = served
    before = len(server.log)
    r = cli(
        "diff",
        f"{server.url}/lora.safetensors",
        "s3://bucket/lora.safetensors",
        "--remote-option",
        "timeout=5",
    )
    assert r.code == 2 and "timeout" in r.err, r.err
    assert len(server.log) == before


def test_cast_of_mixed_dtypes_fetches_the_file_once(
    cli, served: tuple[RangeHTTPServer, Path], tmp_path: Path
) -> None:
    """The F32 group's block ahead reaches into the F16 group, whose first read takes it
    over; the F32 stream's next block ahead stopped short of it only when it began after
    its own block's end, not at it: those bytes were fetched again (1.18 times the file)."""
    server, root = served
    url = f"{server.url}/lora.safetensors"
    size = (root / "lora.safetensors").stat().st_size
    before = server.bytes_sent("lora.safetensors")
    assert cli("cast", url, tmp_path / "c.safetensors", "--to", "BF16").code == 0
    assert server.bytes_sent("lora.safetensors") - before <= 1.08 * size
