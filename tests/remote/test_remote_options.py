"""Storage options are checked when a source opens, before any request: a wrong type is a
TypeError and a bad value a ValueError, both naming the option (never a header's value, which
may be a credential). Also which headers reach the server when the caller's overlap the
library's own."""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import safe_open
from pysafetensors._errors import RemoteError
from pysafetensors._remote import FsspecSource, HTTPSource, S3Source, open_source

from .rangeserver import RangeServer
from .rawserver import RawServer

BAD_TYPES: list[tuple[dict[str, Any], str]] = [
    ({"timeout": "5"}, "timeout"),
    ({"deadline": "3"}, "deadline"),
    ({"retries": 1.5}, "retries"),
    ({"retries": True}, "retries"),
    ({"max_connections": 2.5}, "max_connections"),
    ({"part_size": "8MB"}, "part_size"),
    ({"head_bytes": "64KiB"}, "head_bytes"),
    ({"max_gap": None}, "max_gap"),
    ({"backoff": "0.2"}, "backoff"),
    ({"max_redirects": 2.0}, "max_redirects"),
    ({"accept_full_body": "1M"}, "accept_full_body"),
    ({"headers": "Authorization: x"}, "headers"),
    ({"headers": [("X", "y")]}, "headers"),
    ({"headers": {"X": None}}, "'X'"),
    ({"headers": {"X": 5}}, "'X'"),
    ({"headers": {5: "x"}}, "header name"),
    ({"ssl_context": "yes"}, "ssl_context"),
]

BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"timeout": 0}, "timeout"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"deadline": 0}, "deadline"),
    ({"deadline": -2.5}, "deadline"),
    ({"retries": -1}, "retries"),
    ({"max_connections": 0}, "max_connections"),
    ({"part_size": 0}, "part_size"),
    ({"head_bytes": -1}, "head_bytes"),
    ({"max_gap": -1}, "max_gap"),
    ({"backoff": -1}, "backoff"),
    ({"backoff": float("nan")}, "backoff"),
    ({"backoff": float("inf")}, "backoff"),
    ({"max_redirects": -1}, "max_redirects"),
    ({"accept_full_body": -5}, "accept_full_body"),
    ({"headers": {"range": "bytes=0-10"}}, "'range'"),
    ({"headers": {"Accept-Encoding": "gzip"}}, "'Accept-Encoding'"),
    ({"headers": {"X-Token": "a", "x-token": "b"}}, "'x-token'"),
]


@pytest.mark.parametrize(("options", "named"), BAD_TYPES, ids=lambda v: str(v)[:40])
def test_an_option_of_the_wrong_type_is_a_type_error(
    server: RangeServer, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(TypeError, match=re.escape(named)):
        open_source(server.url("small.safetensors"), storage_options=options)
    assert server.requests() == 0


@pytest.mark.parametrize(("options", "named"), BAD_VALUES, ids=lambda v: str(v)[:40])
def test_an_option_out_of_range_is_a_value_error(
    server: RangeServer, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        open_source(server.url("small.safetensors"), storage_options=options)
    assert not isinstance(info.value, RemoteError)
    assert server.requests() == 0


def test_header_values_are_not_quoted(server: RangeServer) -> None:
    for headers in ({"Authorization": 12345}, {"Range": "secret-ish"}):
        with pytest.raises((TypeError, ValueError)) as info:
            HTTPSource(server.url("small.safetensors"), headers=headers)
        assert "12345" not in str(info.value) and "secret-ish" not in str(info.value)


def test_a_negative_backoff_is_refused_before_a_retry_needs_it(server: RangeServer) -> None:
    # It used to be accepted, and the first retry crashed in time.sleep.
    with pytest.raises(ValueError, match="backoff"):
        safe_open(server.url("model.safetensors"), "np", storage_options={"backoff": -1})
    assert server.requests() == 0


def test_other_sources_check_their_options() -> None:
    # Refused before boto3 or fsspec is needed, so these run without them.
    with pytest.raises(ValueError, match="retries"):
        S3Source("s3://bucket/key", retries=-1)
    with pytest.raises(TypeError, match="anon"):
        S3Source("s3://bucket/key", anon="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="endpoint_url"):
        S3Source("s3://bucket/key", endpoint_url=8080)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="part_size"):
        FsspecSource("memory://x.safetensors", part_size=0)


def test_limits_of_none_or_infinity_mean_none(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "small.safetensors").read_bytes()
    for options in (
        {"timeout": None},
        {"timeout": None, "deadline": 30},
        {"deadline": float("inf")},
        {"timeout": float("inf")},
        # numpy numbers are numbers (np.float32 is no float subclass; it was refused).
        {"timeout": np.float32(5), "deadline": np.float64(30), "backoff": np.float16(0.1)},
    ):
        with HTTPSource(server.url("small.safetensors"), head_bytes=8, **options) as src:
            buf = bytearray(len(data) - 8)
            src.readinto(8, memoryview(buf))
            assert bytes(buf) == data[8:]


def test_a_huge_head_bytes_allocates_what_the_file_holds(
    server: RangeServer, data_dir: Path
) -> None:
    data = (data_dir / "small.safetensors").read_bytes()
    tracemalloc.start()
    try:
        with HTTPSource(server.url("small.safetensors"), head_bytes=1 << 30) as src:
            _, peak = tracemalloc.get_traced_memory()
            assert bytes(src.head) == data
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_a_head_bytes_above_part_size_is_cached_whole(server: RangeServer, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    with HTTPSource(server.url("blob.bin"), head_bytes=1 << 20, part_size=300_000) as src:
        assert bytes(src.head) == data[: 1 << 20]
        requests = server.requests()
        buf = bytearray(1000)
        src.readinto(500_000, memoryview(buf))
        assert bytes(buf) == data[500_000:501_000]
        assert server.requests() == requests  # served from the cached head


# ------------------------------------------------------------------------- headers as sent


@pytest.fixture
def echo(data_dir: Path) -> Iterator[RawServer]:
    """A server that keeps every request as sent, and serves small.safetensors."""
    data = (data_dir / "small.safetensors").read_bytes()
    server = RawServer(lambda conn, request: server.serve_ranges(data)(conn, request))
    yield server
    server.close()


def _header_lines(request: bytes) -> list[tuple[str, str]]:
    lines = request.decode("latin-1").split("\r\n")[1:]
    return [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]


def _values(request: bytes, name: str) -> list[str]:
    return [v for k, v in _header_lines(request) if k == name]


@pytest.mark.parametrize("name", ["User-Agent", "user-agent", "USER-AGENT"])
def test_a_user_agent_replaces_the_library_s_in_any_case(echo: RawServer, name: str) -> None:
    with HTTPSource(echo.url(), headers={name: "me/1.0"}) as src:
        assert src.size > 0
    (request,) = echo.seen
    assert _values(request, "user-agent") == ["me/1.0"]
    assert len(_values(request, "range")) == 1
    assert _values(request, "accept-encoding") == ["identity"]


@pytest.mark.parametrize("value", ["identity", "IDENTITY", " identity "])
def test_an_identity_accept_encoding_is_sent_once(echo: RawServer, value: str) -> None:
    with HTTPSource(echo.url(), headers={"accept-encoding": value}) as src:
        assert src.size > 0
    (request,) = echo.seen
    assert _values(request, "accept-encoding") == ["identity"]
    assert _values(request, "user-agent") == ["pysafetensors"]
