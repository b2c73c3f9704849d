"""HTTPSource against a real loopback server: bytes, request counts, and misbehaving servers."""

from __future__ import annotations

import os
import random
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors._errors import ClosedFileError, RemoteError, SafetensorError
from pysafetensors._range_reads import read_ranges_into
from pysafetensors._remote import (
    DEFAULT_HEAD_BYTES,
    HTTPSource,
    RemoteNotFoundError,
    RemotePermissionError,
    open_source,
    read_prefix,
)

from .rangeserver import SLOW_SECONDS, TOKEN, RangeServer

FAST = {"backoff": 0.001}


def _read(src: HTTPSource, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    src.readinto(offset, memoryview(buf))
    return bytes(buf)


def _tensor_span(data: bytes, name: str) -> tuple[int, int]:
    import json

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    begin, end = header[name]["data_offsets"]
    return 8 + n + begin, end - begin


# ----------------------------------------------------------------------------- opening


def test_open_is_one_request_and_caches_the_head(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    with HTTPSource(server.url("model.safetensors")) as src:
        assert src.size == len(data)
        assert src.stats.requests == 1
        assert src.stats.bytes_fetched == DEFAULT_HEAD_BYTES
        assert src.head == data[:DEFAULT_HEAD_BYTES]
        # Length prefix and whole header are inside the cached bytes: no more requests.
        (n,) = struct.unpack("<Q", read_prefix(src, 8))
        assert 8 + n <= DEFAULT_HEAD_BYTES
        assert _read(src, 8, n) == data[8 : 8 + n]
        assert src.stats.requests == 1
    assert server.requests("model.safetensors") == 1
    assert server.records()[0].range == f"bytes=0-{DEFAULT_HEAD_BYTES - 1}"


def test_long_header_needs_exactly_two_requests(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "bigheader.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert 8 + n > DEFAULT_HEAD_BYTES
    with HTTPSource(server.url("bigheader.safetensors")) as src:
        (m,) = struct.unpack("<Q", read_prefix(src, 8))
        assert _read(src, 8, m) == data[8 : 8 + n]
        assert src.stats.requests == 2
        # Only the part of the header past the cached bytes was fetched the second time.
        assert src.stats.bytes_fetched == 8 + n
    assert server.requests() == 2


def test_file_smaller_than_the_head(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "small.safetensors").read_bytes()
    with HTTPSource(server.url("small.safetensors")) as src:
        assert src.size == len(data) < DEFAULT_HEAD_BYTES
        assert src.head == data
        assert _read(src, 0, len(data)) == data
        assert src.stats.as_dict() == {"requests": 1, "bytes_fetched": len(data), "retries": 0}


def test_empty_file(server: RangeServer) -> None:
    with HTTPSource(server.url("empty.bin")) as src:
        assert src.size == 0
        assert src.stats.requests == 1
        src.readinto(0, memoryview(bytearray()))


def test_prefetch_head_extends_the_cache_with_one_request(
    server: RangeServer, data_dir: Path
) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    with HTTPSource(server.url("blob.bin"), head_bytes=1000) as src:
        assert bytes(src.prefetch_head(5000)) == data[:5000]
        assert src.stats.requests == 2
        assert src.stats.bytes_fetched == 5000
        assert _read(src, 10, 4990) == data[10:5000]
        assert src.stats.requests == 2


# ----------------------------------------------------------------------------- reads


def test_random_ranges_match_the_file(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    rnd = random.Random(7)
    with HTTPSource(server.url("blob.bin"), part_size=256 << 10) as src:
        for _ in range(40):
            offset = rnd.randrange(len(data))
            length = rnd.randrange(0, min(len(data) - offset, 700_000) + 1)
            assert _read(src, offset, length) == data[offset : offset + length]


def test_one_small_tensor_is_one_request(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    start, length = _tensor_span(data, "ids")
    assert start >= DEFAULT_HEAD_BYTES  # really outside the cached bytes
    with HTTPSource(server.url("model.safetensors")) as src:
        src.stats.reset()
        assert _read(src, start, length) == data[start : start + length]
        assert src.stats.requests == 1
        assert src.stats.bytes_fetched == length
    assert server.records()[-1].range == f"bytes={start}-{start + length - 1}"


def test_large_range_is_split_into_parallel_parts(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    part = 256 << 10
    offset, length = 100_000, 8 * part
    with HTTPSource(server.url("slow/blob.bin"), part_size=part, head_bytes=0) as src:
        server.reset()
        src.stats.reset()
        assert _read(src, offset, length) == data[offset : offset + length]
        assert src.stats.requests == 8
        assert src.stats.bytes_fetched == length
    records = server.records("slow/blob.bin")
    assert len(records) == 8
    expected = {f"bytes={offset + k * part}-{offset + (k + 1) * part - 1}" for k in range(8)}
    assert {r.range for r in records} == expected
    # Each request waits SLOW_SECONDS on the server, so requests overlap only if they are sent
    # in parallel: the server counts them (no wall-clock bound: timing belongs to benchmarks).
    assert server.max_inflight >= 4


def test_parts_are_balanced(server: RangeServer) -> None:
    with HTTPSource(server.url("blob.bin"), part_size=100_000, head_bytes=0) as src:
        server.reset()
        _read(src, 0, 100_001)  # two halves, not 100000 bytes and then 1 byte
    sizes = sorted(r.nbytes for r in server.records())
    assert sizes == [50_000, 50_001]


def test_adjacent_ranges_are_coalesced_into_one_request(
    server: RangeServer, data_dir: Path
) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    names = [f"block.{i}.bias" for i in range(12)]
    spans = [_tensor_span(data, name) for name in names]
    assert all(start >= DEFAULT_HEAD_BYTES for start, _ in spans)
    total = sum(length for _, length in spans)
    with HTTPSource(server.url("model.safetensors")) as src:
        src.stats.reset()
        out = bytearray(total)
        read_ranges_into(src, spans, memoryview(out))  # delegates to readinto_many
        assert bytes(out) == b"".join(data[s : s + n] for s, n in spans)
        assert src.stats.requests == 1
        hull = max(s + n for s, n in spans) - min(s for s, _ in spans)
        assert src.stats.bytes_fetched == hull


def test_near_ranges_in_any_order_are_coalesced(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    base = 1 << 20
    # Gaps of 1000 bytes, asked for out of file order: one request, scattered into place.
    ranges = [(base + k * 5000, 4000) for k in range(10)]
    random.Random(3).shuffle(ranges)
    with HTTPSource(server.url("blob.bin"), head_bytes=0) as src:
        src.stats.reset()
        out = bytearray(40_000)
        src.readinto_many(ranges, memoryview(out))
        assert bytes(out) == b"".join(data[o : o + n] for o, n in ranges)
        assert src.stats.requests == 1
        assert src.stats.bytes_fetched == 9 * 5000 + 4000


def test_scattered_pieces_share_one_plan(server: RangeServer, data_dir: Path) -> None:
    """Pieces going to different buffers are planned together: near ones share a request
    (scattered to their buffers), far ones do not, a large one lands in its buffer directly,
    and a piece outside the object is refused before anything is sent."""
    data = (data_dir / "blob.bin").read_bytes()
    base = 1 << 20
    bufs = [bytearray(4000) for _ in range(6)] + [bytearray(300_000), bytearray(10)]
    offsets = [base + k * 5000 for k in range(6)] + [base + 30_000, 3_000_000]
    pieces = [(o, len(b), memoryview(b), 0) for o, b in zip(offsets, bufs, strict=True)]
    random.Random(4).shuffle(pieces)
    with HTTPSource(server.url("blob.bin"), head_bytes=0, max_gap=1 << 16) as src:
        src.stats.reset()
        src.readinto_scattered(pieces)
        for offset, buf in zip(offsets, bufs, strict=True):
            assert bytes(buf) == data[offset : offset + len(buf)]
        assert src.stats.requests == 2
        assert src.stats.bytes_fetched == 30_000 + 300_000 + 10
        src.stats.reset()
        src.readinto_scattered(pieces, max_gap=0)  # exact: only the pieces' bytes
        assert src.stats.bytes_fetched == 6 * 4000 + 300_000 + 10
        with pytest.raises(SafetensorError):
            src.readinto_scattered([(len(data) - 5, 10, memoryview(bytearray(10)), 0)])
        with pytest.raises(ValueError):
            src.readinto_scattered([(0, 10, memoryview(bytearray(10)), 1)])
        requests = src.stats.requests
        for unusable in (memoryview(bytes(10)), memoryview(bytearray(20))[::2]):
            with pytest.raises(ValueError, match="writable and contiguous"):
                src.readinto_scattered([(0, 10, unusable, 0)])
        assert src.stats.requests == requests  # refused before any request


def test_far_ranges_are_separate_requests(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    ranges = [(100_000, 10), (1_500_000, 20), (3_000_000, 30)]
    with HTTPSource(server.url("blob.bin"), head_bytes=0, max_gap=1 << 16) as src:
        src.stats.reset()
        out = bytearray(60)
        src.readinto_many(ranges, memoryview(out))
        assert bytes(out) == b"".join(data[o : o + n] for o, n in ranges)
        assert src.stats.requests == 3
        assert src.stats.bytes_fetched == 60


def test_overlapping_and_duplicate_ranges(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    ranges = [(200_000, 5000), (202_000, 5000), (200_000, 5000), (0, 10), (209_000, 0)]
    with HTTPSource(server.url("blob.bin"), head_bytes=100, part_size=3000) as src:
        out = bytearray(15_010)
        src.readinto_many(ranges, memoryview(out))
        assert bytes(out) == b"".join(data[o : o + n] for o, n in ranges)


def test_coalesced_group_larger_than_a_part_is_split(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    ranges = [(k * 100_000, 100_000) for k in range(10)]  # 1 MB contiguous
    with HTTPSource(server.url("blob.bin"), head_bytes=0, part_size=250_000) as src:
        src.stats.reset()
        out = bytearray(1_000_000)
        src.readinto_many(ranges, memoryview(out))
        assert bytes(out) == data[:1_000_000]
        assert src.stats.requests == 4
        assert src.stats.bytes_fetched == 1_000_000


def test_concurrent_readers_share_one_source(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    errors: list[BaseException] = []
    with HTTPSource(server.url("blob.bin"), part_size=64 << 10) as src:

        def work(seed: int) -> None:
            rnd = random.Random(seed)
            try:
                for _ in range(10):
                    offset = rnd.randrange(len(data) - 200_000)
                    assert _read(src, offset, 200_000) == data[offset : offset + 200_000]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The counters are updated from many threads at once and must not lose increments.
        assert src.stats.requests == server.requests()
        assert src.stats.bytes_fetched == server.bytes_sent()
    assert not errors


def test_keep_alive_connections_are_reused(server: RangeServer) -> None:
    # One request per read (no read-ahead, which would serve these nearby reads from few).
    with HTTPSource(server.url("blob.bin"), read_ahead=0) as src:
        for k in range(10):
            _read(src, 100_000 + k * 1000, 100)
    records = server.records()
    assert len(records) == 11
    assert len({r.client_port for r in records}) == 1


def test_out_of_bounds_read_sends_nothing(server: RangeServer) -> None:
    with HTTPSource(server.url("small.safetensors")) as src:
        with pytest.raises(SafetensorError) as info:
            _read(src, src.size - 2, 10)
        assert info.value.kind == "OutOfBounds"
        assert src.stats.requests == 1


def test_closed_source_refuses_reads(server: RangeServer) -> None:
    src = HTTPSource(server.url("blob.bin"))
    src.close()
    src.close()
    with pytest.raises(ClosedFileError):
        _read(src, 100_000, 10)


def test_query_string_is_kept_but_not_shown(server: RangeServer) -> None:
    with HTTPSource(server.url("small.safetensors") + "?X-Signature=secret") as src:
        assert "secret" not in src.name
        assert src.stats.requests == 1
    assert server.records()[0].path.endswith("?X-Signature=secret")


# ----------------------------------------------------------------------------- misbehaviour


def test_server_ignoring_range_small_file_is_accepted_once(
    server: RangeServer, data_dir: Path
) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    assert len(data) > DEFAULT_HEAD_BYTES
    with HTTPSource(server.url("ignore-range/model.safetensors"), accept_full_body=4 << 20) as src:
        assert src.size == len(data)
        assert _read(src, 500_000, 1000) == data[500_000:501_000]
        assert _read(src, 0, len(data)) == data
        assert src.stats.requests == 1
        assert src.stats.bytes_fetched == len(data)


def test_server_ignoring_range_large_file_is_refused(server: RangeServer) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url("ignore-range/blob.bin"))
    assert info.value.kind == "RangeNotSupported"
    assert "ignored the Range header" in str(info.value)
    assert "3145728 bytes" in str(info.value)
    assert server.requests() == 1


def test_truncated_body_is_retried_then_reported(server: RangeServer) -> None:
    with HTTPSource(server.url("truncate/blob.bin"), head_bytes=0, retries=2, **FAST) as src:
        with pytest.raises(RemoteError) as info:
            _read(src, 1000, 50_000)
        assert src.stats.retries == 2
    assert info.value.kind == "Truncated"
    assert "50000" in str(info.value) and "after 3 attempts" in str(info.value)
    assert server.requests("truncate/blob.bin") == 4  # open + 3 attempts


def test_truncated_once_then_complete(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    with HTTPSource(server.url("blob.bin"), head_bytes=0, **FAST) as src:
        server.inject("blob.bin", "reset")
        assert _read(src, 5000, 70_000) == data[5000:75_000]
        assert src.stats.retries <= 1


def test_missing_file(server: RangeServer) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        HTTPSource(server.url("nope.safetensors"), **FAST)
    err = info.value
    assert isinstance(err, FileNotFoundError) and isinstance(err, RemoteError)
    assert isinstance(err, SafetensorError) and isinstance(err, OSError)
    assert err.kind == "NotFound" and "404" in str(err) and "nope.safetensors" in str(err)
    assert server.requests() == 1  # not retried


def test_auth_required(server: RangeServer, data_dir: Path) -> None:
    with pytest.raises(RemotePermissionError) as info:
        HTTPSource(server.url("auth/small.safetensors"))
    assert "401" in str(info.value) and "headers=" in str(info.value)
    assert isinstance(info.value, PermissionError)
    with HTTPSource(server.url("auth/small.safetensors"), headers={"Authorization": TOKEN}) as src:
        assert src.head == (data_dir / "small.safetensors").read_bytes()


def test_forbidden(server: RangeServer) -> None:
    with pytest.raises(RemotePermissionError, match="access denied \\(403\\)"):
        HTTPSource(server.url("forbidden/small.safetensors"))


def test_server_errors_are_retried(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    server.inject("blob.bin", 500, 503)
    with HTTPSource(server.url("blob.bin"), **FAST) as src:
        assert src.stats.retries == 2
        assert src.stats.requests == 3
        assert src.head == data[:DEFAULT_HEAD_BYTES]


def test_persistent_server_errors_give_up(server: RangeServer) -> None:
    server.inject("blob.bin", *([500] * 10))
    with pytest.raises(RemoteError, match="server error 500.*after 3 attempts"):
        HTTPSource(server.url("blob.bin"), retries=2, **FAST)
    assert server.requests() == 3


def test_retry_delays_are_capped(server: RangeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backoff doubled without bound: with retries=12 and backoff=0.5 the last delay was
    0.5 * 2**11 * jitter, up to about 25 minutes of one sleep."""
    import pysafetensors._remote_source as remote_source

    slept: list[float] = []
    monkeypatch.setattr(remote_source.time, "sleep", slept.append)
    server.inject("blob.bin", *([503] * 13))
    with pytest.raises(RemoteError, match="server error 503.*after 13 attempts"):
        HTTPSource(server.url("blob.bin"), retries=12, backoff=0.5)
    assert len(slept) == 12
    assert max(slept) <= remote_source.MAX_BACKOFF
    assert slept[-1] == remote_source.MAX_BACKOFF  # reached, and held there
    assert slept[0] <= 0.75  # the schedule below the cap is as before


def test_redirect_is_followed_once_then_reused(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    with HTTPSource(server.url("redirect/blob.bin")) as src:
        assert src.url == server.url("blob.bin")
        assert _read(src, 2_000_000, 10) == data[2_000_000:2_000_010]
        assert src.stats.requests == 3  # redirect + open + read
    assert server.requests("redirect/blob.bin") == 1


def test_a_redirect_body_is_not_read_to_its_end(server: RangeServer, data_dir: Path) -> None:
    """A redirect whose body never ends: the redirect is followed after a bounded read of the
    body (which closes that connection), where reading the whole body hung, buffering it all."""
    data = (data_dir / "blob.bin").read_bytes()
    result: list[bytes] = []

    def open_and_read() -> None:
        with HTTPSource(server.url("redirect-endless/blob.bin")) as src:
            result.append(_read(src, 1000, 10))

    reader = threading.Thread(target=open_and_read, daemon=True)
    reader.start()
    reader.join(timeout=15)
    assert not reader.is_alive(), "the client kept reading a redirect's endless body"
    assert result == [data[1000:1010]]


def test_credentials_are_not_sent_to_another_host(server: RangeServer) -> None:
    # 127.0.0.1 redirects to localhost: the Authorization header stays behind, so the target
    # (which requires it) answers 401.
    with pytest.raises(RemotePermissionError, match="401"):
        HTTPSource(server.url("redirect-other/small.safetensors"), headers={"Authorization": TOKEN})
    assert any(r.path == "/auth/small.safetensors" and r.status == 401 for r in server.records())


def test_range_mismatch_is_refused(server: RangeServer) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url("wrong-range/blob.bin"))
    assert info.value.kind == "RangeMismatch"


def test_probe_without_content_range_is_refused(server: RangeServer) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url("no-content-range/blob.bin"))
    assert info.value.kind == "RangeNotSupported"


def test_file_replaced_while_open(server: RangeServer, tmp_path: Path, data_dir: Path) -> None:
    target = data_dir / "changing.bin"
    target.write_bytes(b"a" * 200_000)
    try:
        with HTTPSource(server.url("changing.bin")) as src:
            target.write_bytes(b"b" * 300_000)
            with pytest.raises(RemoteError) as info:
                _read(src, 100_000, 10)
            assert info.value.kind == "Changed"
    finally:
        target.unlink()


def test_file_shrunk_while_open(server: RangeServer, data_dir: Path) -> None:
    target = data_dir / "shrinking.bin"
    target.write_bytes(b"a" * 200_000)
    try:
        with HTTPSource(server.url("shrinking.bin"), **FAST) as src:
            target.write_bytes(b"b" * 1000)
            with pytest.raises(RemoteError) as info:
                _read(src, 100_000, 10)
            # A range within the size it had when opened: the file changed (it was reported
            # as a range not satisfiable, which says nothing of the change).
            assert info.value.kind == "Changed"
            assert "now reports 1000 bytes, 200000 when opened" in str(info.value)
    finally:
        target.unlink()


def test_timeout_is_retried_then_reported(server: RangeServer) -> None:
    with pytest.raises(RemoteError) as info:
        HTTPSource(
            server.url("slow/small.safetensors"), timeout=SLOW_SECONDS / 5, retries=1, **FAST
        )
    assert info.value.kind == "Timeout"  # not a refused or dropped connection
    assert "timed out" in str(info.value) and "after 2 attempts" in str(info.value)


def test_open_source_dispatches_http(server: RangeServer) -> None:
    src = open_source(server.url("small.safetensors"), storage_options={"head_bytes": 16})
    try:
        assert isinstance(src, HTTPSource)
        assert len(src.head) == 16
    finally:
        src.close()
    with pytest.raises(ValueError):
        open_source("no-scheme.safetensors")


def test_load_file_and_load_shard_take_storage_options(server: RangeServer, data_dir: Path) -> None:
    pytest.importorskip("torch")
    import pysafetensors.numpy as pnp
    import pysafetensors.torch as ptorch
    from pysafetensors.parallel import load_shard

    url = server.url("auth/small.safetensors")
    options = {"headers": {"Authorization": TOKEN}}
    local = pnp.load_file(data_dir / "small.safetensors")
    with pytest.raises(RemotePermissionError):
        pnp.load_file(url)
    loaded = pnp.load_file(url, storage_options=options)
    assert loaded.keys() == local.keys()
    assert all(np.array_equal(loaded[k], local[k]) for k in local)
    tensors = ptorch.load_file(url, storage_options=options)
    assert np.array_equal(tensors["y"].numpy(), local["y"])
    part = load_shard(url, 1, 3, {"y": "rows"}, framework="np", storage_options=options)
    assert np.array_equal(part["y"], local["y"][1:2]) and np.array_equal(part["x"], local["x"])


def test_user_and_password_in_the_url_become_basic_auth(server: RangeServer) -> None:
    import base64

    url = server.url("small.safetensors").replace("://", "://us%40er:p%3Ass@", 1)
    with HTTPSource(url) as src:
        assert src.size > 0 and "p%3Ass" not in src.name  # never shown in names or errors
    sent = {r.authorization for r in server.records("small.safetensors")}
    assert sent == {"Basic " + base64.b64encode(b"us@er:p:ss").decode()}
    # An explicit header wins.
    with HTTPSource(url, headers={"Authorization": TOKEN}):
        pass
    assert TOKEN in {r.authorization for r in server.records("small.safetensors")}


def test_unknown_storage_options_are_named(server: RangeServer) -> None:
    from pysafetensors import safe_open

    with pytest.raises(TypeError, match=r"unknown storage option for http\(s\) URLs: 'header'"):
        safe_open(server.url("small.safetensors"), "np", storage_options={"header": {}})
    assert server.requests() == 0  # refused before any request


def test_a_remote_reshard_reads_the_shard_versions_it_planned_from(
    server: RangeServer, data_dir: Path, tmp_path: Path
) -> None:
    """Reshard copied remote shards through connections of its own, which learnt each object
    anew: a shard replaced midway was copied at the old header's offsets, silently."""
    import json
    import os

    from pysafetensors import reshard
    from pysafetensors.numpy import save_file

    folder = data_dir / "rs"
    folder.mkdir(exist_ok=True)
    save_file({"p": np.arange(1000, dtype=np.float32)}, str(folder / "s1.safetensors"))
    # Larger than the bytes an open fetches with the header, so the copy reads it again.
    save_file({"r": np.full(100_000, 1.0, np.float32)}, str(folder / "s2.safetensors"))
    other = {"r": np.full(100_000, 9.0, np.float32), "zz": np.zeros(10)}  # another layout
    save_file(other, str(folder / "s2v2.safetensors"))
    index = {"weight_map": {"p": "s1.safetensors", "r": "s2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    swapped = [False]

    def swap_after_the_first_tensor(done: int, total: int) -> None:
        if not swapped[0]:
            swapped[0] = True
            os.replace(folder / "s2v2.safetensors", folder / "s2.safetensors")

    with pytest.raises(RemoteError) as info:
        reshard(
            server.url("rs/model.safetensors.index.json"),
            tmp_path / "out",
            max_shard_size="1GB",
            progress=swap_after_the_first_tensor,
        )
    assert info.value.kind == "Changed"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_fragmented_remote_slices_are_read_as_row_blocks(
    server: RangeServer, data_dir: Path
) -> None:
    """A request (and a Python object) per run made ``[:, ::2]`` of a 4 MiB tensor take ~1.5 s
    and ~150 MB over HTTP; the covering rows are read in a few blocks instead, as locally."""
    from pysafetensors import safe_open
    from pysafetensors.numpy import save_file

    values = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    save_file({"w": values}, str(data_dir / "strided.safetensors"))
    import tracemalloc

    before = len(server.records())
    with safe_open(server.url("strided.safetensors"), "np") as f:
        tracemalloc.start()
        try:
            half = f.get_slice("w")[:, ::2]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert np.array_equal(half, values[:, ::2])
        assert np.array_equal(f.get_slice("w")[3:900:5, 1::7], values[3:900:5, 1::7])
    assert len(server.records()) - before < 20
    assert peak < 40 << 20, peak  # per-run bookkeeping took ~150 MB
    # "exact" still reads run by run (merged within max_gap), with the same result.
    with safe_open(server.url("strided.safetensors"), "np", slice_reads="exact") as f:
        assert np.array_equal(f.get_slice("w")[:16, ::2], values[:16, ::2])


def test_sub_byte_column_splits_are_read_remotely_as_row_blocks(
    server: RangeServer, data_dir: Path
) -> None:
    """An F4 column split (8,192 runs of 64 bytes) read over HTTP as blocks of whole rows, as
    a byte tensor's is, equals numpy's, in a few requests."""
    import ml_dtypes

    from pysafetensors import safe_open
    from pysafetensors.numpy import save_file

    codes = np.random.default_rng(2).integers(0, 16, (8192, 1024), dtype=np.uint8)
    values = codes.view(ml_dtypes.float4_e2m1fn)
    save_file({"w": values}, str(data_dir / "f4.safetensors"))
    before = len(server.records())
    with safe_open(server.url("f4.safetensors"), "np") as f:
        got = f.get_slice("w")[:, 128:256]
    assert got.tobytes() == values[:, 128:256].tobytes()
    assert len(server.records()) - before < 20


def test_exact_slice_reads_fetch_only_the_selected_bytes_remotely(
    server: RangeServer, data_dir: Path
) -> None:
    """slice_reads="exact" merged remote ranges within max_gap (1 MiB) all the same: a 1/8
    column split fetched the whole tensor (8x the bytes)."""
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    values = np.arange(600 * 700, dtype=np.float32).reshape(600, 700)
    save_file({"big": values}, str(data_dir / "cols.safetensors"))
    url = server.url("cols.safetensors")
    fetched = {}
    for mode in ("exact", "coalesce"):
        before = len(server.records())
        part = load_shard(url, 3, 8, {"big": "columns"}, framework="np", slice_reads=mode)
        assert np.array_equal(part["big"], values[:, 3 * 88 : 4 * 88])
        fetched[mode] = sum(r.nbytes for r in server.records()[before:])
    selected = 600 * 88 * 4
    head = 64 << 10  # the bytes an open fetches with the header
    assert fetched["exact"] <= selected + head
    assert fetched["coalesce"] > 4 * selected


def test_index_arrays_read_remotely_in_row_parts_and_column_boxes(
    server: RangeServer, data_dir: Path
) -> None:
    """Rows far apart are fetched alone (``[[3, 17, 2900]]``: 3 rows, not 2,898); columns are
    one box of few requests: as parts, each would be a request per row (with the default
    backend the remote file counted as mapped, and "exact" took 7 s for 2 columns)."""
    from pysafetensors import safe_open
    from pysafetensors.numpy import save_file

    values = np.arange(3000 * 512, dtype=np.float32).reshape(3000, 512)
    save_file({"w": values}, str(data_dir / "rows.safetensors"))
    url = server.url("rows.safetensors")
    for mode in ("exact", "coalesce"):
        with safe_open(url, "np", slice_reads=mode) as f:
            before = len(server.records())
            assert np.array_equal(f.get_slice("w")[[3, 17, 2900]], values[[3, 17, 2900]])
            rows = server.records()[before:]
            assert sum(r.nbytes for r in rows) < 40 * 2048, mode  # read through 14 rows
            before = len(server.records())
            assert np.array_equal(f.get_slice("w")[:, [0, 511]], values[:, [0, 511]])
            assert len(server.records()) - before < 20, mode


def test_column_splits_of_many_small_tensors_are_fetched_together(
    server: RangeServer, data_dir: Path
) -> None:
    """A mixture of experts over HTTP: the column parts of 300 small tensors come from a few
    coalesced requests for the tensors' bytes, not a round trip (or several) per tensor, and
    equal the parts read locally."""
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    rng = np.random.default_rng(8)
    tensors = {f"experts.{i}.w": rng.random((16, 24), np.float32) for i in range(300)}
    path = data_dir / "experts.safetensors"
    save_file(tensors, str(path))
    want = load_shard(path, 1, 4, {"*": "columns"}, framework="np")
    before = len(server.records())
    got = load_shard(server.url("experts.safetensors"), 1, 4, {"*": "columns"}, framework="np")
    assert list(got) == list(want)
    for name, part in want.items():
        assert np.array_equal(got[name], part), name
    assert len(server.records()) - before < 20


def test_a_large_column_split_is_fetched_in_parallel(server: RangeServer, data_dir: Path) -> None:
    """A fragmented slice of a large tensor came one 8 MiB request after another on one
    connection (2.8 s against 0.4 s for a 235 MB file's column split at 100 MB/s per
    connection); its blocks of rows now share one plan of parallel requests."""
    from pysafetensors import safe_open
    from pysafetensors.numpy import save_file

    values = np.random.default_rng(12).random((3072, 2048), np.float32)  # 24 MiB
    save_file({"w": values}, str(data_dir / "wide.safetensors"))
    with safe_open(server.url("wide.safetensors"), "np") as f:
        before = len(server.records())
        got = f.get_slice("w")[:, 256:512]
        records = server.records()[before:]
    assert np.array_equal(got, values[:, 256:512])
    assert len({r.client_port for r in records}) > 1  # requests on several connections at once
    assert sum(r.nbytes for r in records) <= values.nbytes


def test_remote_column_splits_buffer_a_bounded_scratch(
    server: RangeServer, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever max_gap says: a tensor under a large max_gap was gathered from the tensor
    fetched whole (a 300 MB tensor under max_gap=1 GiB: 300 MB of scratch). Blocks of rows
    now, at most SMALL_BATCH of them buffered (shrunk here with the block size)."""
    from pysafetensors import _reader, _slice_gather
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    monkeypatch.setattr(_reader, "SMALL_BATCH", 1 << 20)
    monkeypatch.setattr(_slice_gather, "SMALL_BATCH", 1 << 20)
    monkeypatch.setattr(_slice_gather, "_GATHER_BLOCK", 256 << 10)
    sizes: list[int] = []
    real = _reader.empty_bytes

    def recorded(nbytes: int) -> np.ndarray:
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(_reader, "empty_bytes", recorded)
    values = np.random.default_rng(14).random((1024, 2048), np.float32)  # 8 MiB
    save_file({"w": values}, str(data_dir / "gap.safetensors"))
    url = server.url("gap.safetensors")
    part = load_shard(
        url, 1, 4, {"w": "columns"}, framework="np", storage_options={"max_gap": 1 << 30}
    )
    assert np.array_equal(part["w"], values[:, 512:1024])
    assert max(sizes) <= max(part["w"].nbytes, 1 << 20), sizes


@pytest.mark.parametrize("head_bytes", [0, 5, 8, 100])
def test_a_small_head_cache_fetches_no_data_byte_twice(
    server: RangeServer, data_dir: Path, head_bytes: int
) -> None:
    """With head_bytes under 64 KiB, the header was read by a 64 KiB guess past the cache,
    whose data bytes the load then fetched again (105,508 bytes for an 80,072-byte file).
    Under 8 (0: "cache nothing"), the 8-byte length is read first, then exactly the header."""
    from pysafetensors import safe_open
    from pysafetensors.numpy import save_file

    rng = np.random.default_rng(16)
    tensors = {f"t{i:03d}": rng.random(100, np.float32) for i in range(100)}
    path = data_dir / "smallhead.safetensors"
    save_file(tensors, str(path))
    before = len(server.records())
    with safe_open(
        server.url("smallhead.safetensors"), "np", storage_options={"head_bytes": head_bytes}
    ) as f:
        got = f.get_tensors()
    for name, value in tensors.items():
        assert np.array_equal(got[name], value), name
    records = server.records()[before:]
    # The open (+ the length, when under 8 bytes were cached), the rest of the header, the data.
    assert len(records) <= (3 if head_bytes >= 8 else 4)
    # At most the bytes the open's probe fetched (one, where nothing is cached) twice.
    assert sum(r.nbytes for r in records) <= path.stat().st_size + max(1, head_bytes)


def test_a_mixed_load_shard_fetches_no_byte_twice(server: RangeServer, data_dir: Path) -> None:
    """Row parts, replicated tensors and column splits of tensors under the merge distance
    (1 MiB) in one file: their requests were planned apart, and a request merged across a gap
    fetched the bytes another group fetched too (10.3 MB in 26 requests for this 6 MB file).
    One plan: every byte at most once, in a few requests, equal to the parts read locally."""
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    rng = np.random.default_rng(11)
    tensors = {}
    for i in range(12):
        tensors[f"l{i}.big"] = rng.random((256, 384), np.float32)  # column split, 384 KiB
        tensors[f"l{i}.small"] = rng.random((16, 48), np.float32)  # column split, 3 KiB
        tensors[f"l{i}.rows"] = rng.random((96, 256), np.float32)  # row split
        tensors[f"l{i}.norm"] = rng.random(256, np.float32)  # replicated
    path = data_dir / "mixed.safetensors"
    save_file(tensors, str(path))
    rules = {"*.rows": "rows", "*.norm": "replicate", "*": "columns"}
    for rank, world in ((1, 3), (7, 8)):
        want = load_shard(path, rank, world, rules, framework="np")
        before = len(server.records())
        got = load_shard(server.url("mixed.safetensors"), rank, world, rules, framework="np")
        assert list(got) == list(want)
        for name, part in want.items():
            assert np.array_equal(got[name], part), name
        records = server.records()[before:]
        spans = []
        for record in records:
            assert record.range is not None and record.range.startswith("bytes=")
            first, last = record.range[len("bytes=") :].split("-")
            spans.append((int(first), int(last) + 1))
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, spans  # no byte fetched twice
        assert sum(r.nbytes for r in records) <= path.stat().st_size
        assert len(records) < 10


def test_exact_reads_of_row_parts_fetch_only_their_bytes_remotely(
    server: RangeServer, data_dir: Path
) -> None:
    """The parts that are one run each (row splits, replicated tensors), fetched together:
    with slice_reads="exact" only their bytes, where the default merges runs less than 1 MiB
    apart into one request (fetching the other ranks' rows between them)."""
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    rng = np.random.default_rng(9)
    tensors = {f"layer.{i}.w": rng.random((64, 100), np.float32) for i in range(40)}
    tensors["norm"] = rng.random(100, np.float32)
    save_file(tensors, str(data_dir / "rows.safetensors"))
    url = server.url("rows.safetensors")
    rules = {"norm": "replicate", "*": "rows"}
    fetched = {}
    for mode in ("exact", "coalesce"):
        before = len(server.records())
        part = load_shard(url, 7, 8, rules, framework="np", slice_reads=mode)
        for name, values in tensors.items():
            want = values if name == "norm" else values[56:64]
            assert np.array_equal(part[name], want), name
        fetched[mode] = sum(r.nbytes for r in server.records()[before:])
    selected = 40 * 8 * 100 * 4 + 100 * 4
    head = 64 << 10  # the bytes an open fetches with the header
    assert fetched["exact"] <= selected + head
    assert fetched["coalesce"] > 4 * selected


def test_a_file_changed_or_gone_during_a_load_names_the_tensor_it_met(
    server: RangeServer, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote file replaced (another ETag) or deleted while load_shard fetches its parts:
    the error says so and names the tensor and the offset where the request began."""
    from pysafetensors._remote_source import RemoteSource
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    rng = np.random.default_rng(10)
    # 150 KB: past the bytes an open fetches with the header (reads of those are not requests)
    tensors = {f"e.{i}.w": rng.random((8, 16), np.float32) for i in range(300)}
    path = data_dir / "gone.safetensors"
    real = RemoteSource.readinto_scattered
    for change, error in (
        (lambda: path.write_bytes(path.read_bytes()[:-8] + bytes(8)), RemoteError),
        (path.unlink, RemoteNotFoundError),
    ):
        save_file(tensors, str(path))
        os.utime(path, ns=(1, 1))  # a Last-Modified of its own, whatever the clock

        def changed_first(*args: object, change: Any = change, **kwargs: object) -> Any:
            change()
            return real(*args, **kwargs)

        monkeypatch.setattr(RemoteSource, "readinto_scattered", changed_first)
        with pytest.raises(error) as caught:
            load_shard(server.url("gone.safetensors"), 0, 2, {"*": "columns"}, framework="np")
        assert caught.value.tensor is not None and caught.value.offset is not None
        assert f"reading tensor {caught.value.tensor!r}" in str(caught.value)
