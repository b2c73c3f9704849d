"""``safe_open`` on URLs: tensors equal the local file's, with the requests counted server-side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .conftest import BUCKET
from .rangeserver import RangeServer

pysafetensors = pytest.importorskip("pysafetensors")
safe_open = getattr(pysafetensors, "safe_open", None)
if safe_open is None:  # pragma: no cover - only while the reader is being written
    pytest.skip("pysafetensors.safe_open is not available yet", allow_module_level=True)


def _local(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def test_http_open_and_read_every_tensor(server: RangeServer, data_dir: Path) -> None:
    local = _local(data_dir / "model.safetensors")
    with safe_open(server.url("model.safetensors"), "np") as f:
        assert server.requests() == 1  # size, prefix and header in one ranged GET
        assert sorted(f.keys()) == sorted(local)
        assert f.metadata() == {"format": "np"}
        for name, expected in local.items():
            np.testing.assert_array_equal(f.get_tensor(name), expected)
    # The first 64 KiB came once, at open; the tensors past them, read in file order, from
    # windows read ahead: every byte of the file crossed the wire exactly once, in a few
    # requests rather than one per tensor.
    assert server.bytes_sent() == (data_dir / "model.safetensors").stat().st_size
    assert server.requests() < _tensors_past_head(data_dir / "model.safetensors")
    assert server.requests() <= 6
    # Without read-ahead: each tensor fetched only its bytes past the head, one request each.
    server.reset()
    with safe_open(server.url("model.safetensors"), "np", storage_options={"read_ahead": 0}) as f:
        for name, expected in local.items():
            np.testing.assert_array_equal(f.get_tensor(name), expected)
    assert server.bytes_sent() == (data_dir / "model.safetensors").stat().st_size
    assert server.requests() == 1 + _tensors_past_head(data_dir / "model.safetensors")


def _tensors_past_head(path: Path) -> int:
    """How many tensors end past the first 64 KiB (so need a request of their own)."""
    import json
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return sum(
        1
        for name, info in json.loads(data[8 : 8 + n]).items()
        if name != "__metadata__" and 8 + n + info["data_offsets"][1] > 64 * 1024
    )


def test_http_one_tensor_is_one_request(server: RangeServer, data_dir: Path) -> None:
    local = _local(data_dir / "model.safetensors")
    with safe_open(server.url("model.safetensors"), "np") as f:
        server.reset()
        np.testing.assert_array_equal(f.get_tensor("embed"), local["embed"])
    assert server.requests() == 1
    assert server.bytes_sent() == local["embed"].nbytes


def test_http_long_header_opens_in_two_requests(server: RangeServer, data_dir: Path) -> None:
    local = _local(data_dir / "bigheader.safetensors")
    with safe_open(server.url("bigheader.safetensors"), "np") as f:
        assert server.requests() == 2
        assert len(f.keys()) == len(local)
        name = sorted(local)[-1]
        np.testing.assert_array_equal(f.get_tensor(name), local[name])


def test_http_slices_are_coalesced(server: RangeServer, data_dir: Path) -> None:
    local = _local(data_dir / "model.safetensors")["embed"]
    with safe_open(server.url("model.safetensors"), "np") as f:
        server.reset()
        np.testing.assert_array_equal(f.get_slice("embed")[10:20], local[10:20])
        assert server.requests() == 1
        assert server.bytes_sent() == local[10:20].nbytes
        server.reset()
        # 512 runs of 16 bytes, 2032 bytes apart: one request for their hull.
        np.testing.assert_array_equal(f.get_slice("embed")[:, 0:4], local[:, 0:4])
        assert server.requests() == 1


def test_http_get_tensors_pread(server: RangeServer, data_dir: Path) -> None:
    local = _local(data_dir / "model.safetensors")
    with safe_open(server.url("model.safetensors"), "np", backend="pread") as f:
        got = f.get_tensors()
    assert set(got) == set(local)
    for name, expected in local.items():
        np.testing.assert_array_equal(got[name], expected)
    assert server.requests() == 2  # open, then everything past the cached first 64 KiB


def test_http_torch(server: RangeServer, data_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    local = _local(data_dir / "model.safetensors")
    with safe_open(server.url("model.safetensors"), "pt") as f:
        t = f.get_tensor("proj")
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), local["proj"])


def test_http_missing_file_is_file_not_found(server: RangeServer) -> None:
    with pytest.raises(FileNotFoundError):
        safe_open(server.url("missing.safetensors"), "np")


def test_s3_end_to_end(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    local = _local(data_dir / "model.safetensors")
    with safe_open(f"s3://{BUCKET}/model.safetensors", "np") as f:
        assert sorted(f.keys()) == sorted(local)
        for name in ("embed", "ids", "block.3.bias"):
            np.testing.assert_array_equal(f.get_tensor(name), local[name])


def test_memory_end_to_end(data_dir: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    url = "memory://pst-e2e/model.safetensors"
    fsspec.filesystem("memory").pipe_file(url, (data_dir / "model.safetensors").read_bytes())
    local = _local(data_dir / "model.safetensors")
    try:
        with safe_open(url, "np") as f:
            np.testing.assert_array_equal(f.get_tensor("proj"), local["proj"])
            np.testing.assert_array_equal(f.get_slice("embed")[3:5], local["embed"][3:5])
    finally:
        fsspec.filesystem("memory").rm(url)


def test_load_shard_of_a_url_fetches_the_rank_s_parts_together(
    server: RangeServer, data_dir: Path
) -> None:
    """One request per tensor, one after another, was a round trip each: 97 sequential
    requests for a 100-tensor file's row split."""
    torch = pytest.importorskip("torch")
    import pysafetensors.torch as ptorch
    from pysafetensors.parallel import load_shard

    full = {f"layer{i:03d}.w": torch.randn(16 + i % 5, 24) for i in range(100)}
    full["odd.h"] = torch.arange(6, dtype=torch.float16)  # runs of 2-byte elements in between
    ptorch.save_file(full, data_dir / "many_tp.safetensors")
    url = server.url("many_tp.safetensors")
    for rank in (0, 3):
        server.reset()
        got = load_shard(url, rank, 4, {"*": "rows"})
        assert server.requests("many_tp.safetensors") <= 4
        assert list(got) == list(full)
        for name, tensor in full.items():
            chunks = torch.chunk(tensor, 4)  # fewer than 4 when a dimension is short
            expected = chunks[rank] if rank < len(chunks) else tensor[:0]
            assert torch.equal(got[name], expected), name
            assert got[name].data_ptr() % got[name].element_size() == 0
