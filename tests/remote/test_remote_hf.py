"""``hf://`` URLs through ``huggingface_hub.HfFileSystem``, against a stand-in for the Hub's HTTP
API on loopback (``hubserver.py``): the real client code, the bytes and requests counted."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import pysafetensors
from pysafetensors import RemoteError, safe_open
from pysafetensors.numpy import load_file, save

from .hubserver import HubServer

pytest.importorskip("huggingface_hub")
pytest.importorskip("fsspec")

TENSORS = {f"layer{i:02d}": np.full((128, 512), i, dtype=np.float32) for i in range(12)}  # 256 KiB
TENSORS["bias"] = np.arange(10, dtype=np.float32)
DATA = save(TENSORS)


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    server = HubServer()
    server.add("org/model", "main", {"model.safetensors": DATA})
    other = {"bias": np.full(3, 7, np.float32)}
    server.add("org/model", "v1", {"model.safetensors": save(other)})
    yield server
    server.close()


def _options(hub: HubServer) -> dict[str, Any]:
    return {"endpoint": hub.endpoint}


def test_reads_fetch_the_ranges_asked_for(hub: HubServer) -> None:
    # HfFileSystem keeps fsspec's default cat_file, a buffered file with a 5 MiB read-ahead:
    # opening fetched 5 MiB for a 300-byte header, and a load 1.6 times the file.
    url = "hf://org/model/model.safetensors"
    hub.downloads.clear()
    with safe_open(url, "np", storage_options=_options(hub)) as f:
        assert hub.downloaded() <= 64 << 10  # the head read at open
        assert np.array_equal(f.get_tensor("bias"), TENSORS["bias"])
        start = hub.downloaded()
        assert np.array_equal(f.get_slice("layer05")[3:4], TENSORS["layer05"][3:4])
        assert hub.downloaded() - start == 512 * 4  # one row, exactly
    hub.downloads.clear()
    loaded = load_file(url, storage_options=_options(hub))
    assert hub.downloaded() <= len(DATA) + (64 << 10)
    for name, value in TENSORS.items():
        assert np.array_equal(loaded[name], value), name


def test_a_revision_is_read_at_that_revision(hub: HubServer) -> None:
    loaded = load_file("hf://org/model@v1/model.safetensors", storage_options=_options(hub))
    assert list(loaded) == ["bias"]
    assert np.array_equal(loaded["bias"], np.full(3, 7, np.float32))


def test_a_repository_at_revision_is_named_as_written(hub: HubServer) -> None:
    # '@' in hf:// marks a revision, not user:password@: the message showed
    # "hf://main/model.safetensors", and huggingface_hub's own words with the repository cut.
    with pytest.raises(Exception) as info:
        safe_open("hf://gpt2@main/model.safetensors", "np", storage_options=_options(hub))
    assert "gpt2@main" in str(info.value)


def test_an_unreachable_hub_is_a_connection_error() -> None:
    # kind was "HTTPError" for every failure but a missing file or a refusal.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RemoteError) as info:
        safe_open(
            "hf://org/model/model.safetensors",
            "np",
            storage_options={"endpoint": f"http://127.0.0.1:{port}"},
        )
    assert info.value.kind == "ConnectionError", info.value


def _failing_fs(exc: Exception) -> Any:
    """A filesystem whose client library timed out or lost its connection."""
    from fsspec.spec import AbstractFileSystem

    class Failing(AbstractFileSystem):  # type: ignore[misc]
        protocol = "failing"

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            raise exc

    return Failing(skip_instance_cache=True)


class ReadTimeout(Exception):
    """As httpx and requests name theirs: no built-in base class."""


class ConnectError(Exception):
    pass


class NetworkError(ConnectError):
    pass


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (TimeoutError("timed out"), "Timeout"),
        (ReadTimeout("timed out"), "Timeout"),
        (ConnectionRefusedError("refused"), "ConnectionError"),
        (NetworkError("dropped"), "ConnectionError"),
        (RuntimeError("something else"), "HTTPError"),
    ],
)
def test_failures_to_reach_the_server_are_named_as_http_and_s3_name_them(
    exc: Exception, kind: str
) -> None:
    from pysafetensors._remote import FsspecSource

    with pytest.raises(RemoteError) as info:
        FsspecSource("x.safetensors", fs=_failing_fs(exc))
    assert info.value.kind == kind


def test_a_folder_url_opens_the_sharded_checkpoint(hub: HubServer, tmp_path: Any) -> None:
    pysafetensors.save_sharded(TENSORS, tmp_path, 1 << 20)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(files) > 2
    hub.add("org/sharded", "main", files)
    with safe_open("hf://org/sharded/", "np", storage_options=_options(hub)) as f:
        assert sorted(f.keys()) == sorted(TENSORS)
        assert np.array_equal(f.get_tensor("layer11"), TENSORS["layer11"])


def test_parts_of_a_read_go_at_once_and_threads_read_right(hub: HubServer) -> None:
    # HfFileSystem opens a file of its own for each ranged read and sends it through a shared
    # httpx client: reads may overlap (they went one at a time, like tar:// and ftp://).
    import random
    import threading
    import time

    rng = np.random.default_rng(5)
    tensors = {f"t{i:02d}": rng.integers(0, 2**31, (64, 1024), dtype=np.int32) for i in range(16)}
    hub.add("org/parallel", "main", {"model.safetensors": save(tensors)})
    url = "hf://org/parallel/model.safetensors"
    options = {**_options(hub), "part_size": 256 << 10}
    hub.delay = 0.02  # a distant server: parts in flight together show
    try:
        loaded = load_file(url, storage_options=options)
        assert hub.most_in_flight > 1
        for name, value in tensors.items():
            assert np.array_equal(loaded[name], value), name
        wrong: list[tuple[str, int, int]] = []
        with safe_open(url, "np", storage_options=options) as f:

            def reader(seed: int) -> None:
                r = random.Random(seed)
                for _ in range(20):
                    name = f"t{r.randrange(16):02d}"
                    a = r.randrange(64)
                    b = r.randrange(a, 64) + 1
                    if not np.array_equal(f.get_slice(name)[a:b], tensors[name][a:b]):
                        wrong.append((name, a, b))

            threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
            start = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert time.monotonic() - start < 60
        assert not wrong
    finally:
        hub.delay = 0.0
