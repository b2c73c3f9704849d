"""Opening a remote shard does not hold up reads from the checkpoint's other shards."""

from __future__ import annotations

import http.server
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import safe_open, save_sharded


class _Handler(http.server.BaseHTTPRequestHandler):
    """Files of one folder with single ranges; requests for ``hold`` wait for ``release``."""

    protocol_version = "HTTP/1.1"  # keep-alive, so connections go back to the pool
    root: Path
    hold: str
    release: threading.Event
    held = threading.Event()
    asked: list[str] = []  # every name requested, in order

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        name = self.path.lstrip("/").split("?", 1)[0]
        self.asked.append(name)
        if name == self.hold:
            self.held.set()
            self.release.wait(60)
        data = (self.root / name).read_bytes()
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match is None:
            self.send_response(200)
            body = data
        else:
            first = int(match.group(1))
            last = min(int(match.group(2) or len(data) - 1), len(data) - 1)
            body = data[first : last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"v1"')
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def held_server(tmp_path: Path) -> Iterator[tuple[str, threading.Event, threading.Event]]:
    sd = {f"layer.{i}.w": np.full(1000, i, np.int32) for i in range(4)}
    save_sharded(sd, tmp_path, max_shard_size="5KB")
    release = threading.Event()
    handler = type(
        "Held",
        (_Handler,),
        {
            "root": tmp_path,
            "hold": "model-00002-of-00004.safetensors",
            "release": release,
            "held": threading.Event(),
        },
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler.held, release
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_reads_go_on_while_another_shard_is_opening(
    held_server: tuple[str, threading.Event, threading.Event],
) -> None:
    # The handle's lock was held while a shard opened over the network: one slow (or dead)
    # shard server stalled every read of the handle, shards already open included.
    base, held, release = held_server
    with safe_open(f"{base}/model.safetensors.index.json", "np") as f:
        assert f.get_tensor("layer.0.w")[0] == 0  # shard 1 open
        opener = threading.Thread(target=f.get_tensor, args=("layer.1.w",))
        opener.start()
        assert held.wait(30)  # shard 2's open is now waiting on the server
        reads: list[int] = []
        reader = threading.Thread(
            target=lambda: reads.extend(
                int(f.get_tensor(name)[0]) for name in ("layer.0.w", "layer.2.w")
            )
        )
        reader.start()
        reader.join(30)
        # Done while shard 2's server still holds its request: neither the open shard nor
        # opening another waited for it.
        assert not reader.is_alive() and reads == [0, 2]
        assert not release.is_set()
        release.set()
        opener.join(30)
        assert f.get_tensor("layer.1.w")[0] == 1


@pytest.mark.parametrize("how", ["load_file", "load_shard"])
def test_a_load_opens_the_next_shards_while_one_is_held(
    held_server: tuple[str, threading.Event, threading.Event], how: str
) -> None:
    # A load opened each remote shard after reading the one before: a round trip per shard
    # in a row. Now the next shards are opened meanwhile, and handed over in order.
    from pysafetensors.numpy import load_file
    from pysafetensors.parallel import load_shard

    base, held, release = held_server
    loaded: dict[str, np.ndarray] = {}
    failed: list[BaseException] = []
    url = f"{base}/model.safetensors.index.json"

    def load() -> None:
        try:
            if how == "load_file":
                loaded.update(load_file(url))
            else:
                loaded.update(load_shard(url, 0, 1, {}, framework="np"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failed.append(exc)

    _Handler.asked.clear()
    loader = threading.Thread(target=load)
    loader.start()
    assert held.wait(30)  # shard 2's open waits on the server
    later = {"model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"}
    deadline = time.monotonic() + 30
    while not later <= set(_Handler.asked) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert later <= set(_Handler.asked)  # asked for while shard 2 is still held
    assert loader.is_alive() and not loaded
    release.set()
    loader.join(30)
    assert not loader.is_alive() and not failed
    assert {k: int(v[0]) for k, v in loaded.items()} == {f"layer.{i}.w": i for i in range(4)}


def test_many_open_sources_share_worker_threads_and_idle_connections(tmp_path: Path) -> None:
    # Each remote source kept its own pool of up to max_connections threads and idle sockets
    # for as long as it was open: a handle on 200 shards of one server held over a thousand
    # sockets and ran out of descriptors; 64 shards read held 408 idle threads.
    from pysafetensors import _remote_http, _remote_source
    from pysafetensors._remote import HTTPSource

    blob = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    blob.write_bytes(data)
    handler = type(
        "Plain", (_Handler,), {"root": tmp_path, "hold": "", "release": threading.Event()}
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/blob.bin"
    sources = []
    try:
        for i in range(40):
            src = HTTPSource(url, max_connections=8, part_size=256 << 10)
            sources.append(src)
            out = bytearray(2 << 20)
            src.readinto(i * 1000, memoryview(out))  # eight parts, read in parallel
            assert bytes(out) == data[i * 1000 : i * 1000 + len(out)]
        workers = [t for t in threading.enumerate() if t.name.startswith("pysafetensors-remote")]
        assert 0 < len(workers) <= 64  # were 8 a source: 320
        assert len(workers) <= _remote_source._Workers.SIZE
        idle = sum(
            len(conns)
            for ((_, _, port), _), conns in _remote_http._IDLE._idle.items()
            if port == server.server_port
        )
        assert 0 < idle <= _remote_http._IDLE_PER_HOST
    finally:
        for src in sources:
            src.close()
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
# The child runs only this library's code and leaves by os._exit: JAX, imported by other
# tests of the run, warns about its own threads, which the child never touches.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_forked_child_closes_a_source_whose_parent_was_mid_read(tmp_path: Path) -> None:
    # close() waits for the source's parallel reads in flight; a child forked during one has
    # none of them, and its close() waited for ever.
    import time

    from pysafetensors._remote import HTTPSource

    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4096)
    release = threading.Event()
    handler = type(
        "Held",
        (_Handler,),
        {"root": tmp_path, "hold": "", "release": release, "held": threading.Event()},
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    src = HTTPSource(f"http://127.0.0.1:{server.server_port}/blob.bin", part_size=64 << 10)
    handler.hold = "blob.bin"  # every request from now on waits for the release
    out = bytearray(512 << 10)
    reader = threading.Thread(target=src.readinto, args=(0, memoryview(out)))
    reader.start()
    try:
        assert handler.held.wait(30)  # a parallel read is in flight
        pid = os.fork()
        if pid == 0:  # the child: close, then leave at once
            src.close()
            os._exit(0)
        stop = time.monotonic() + 30
        while time.monotonic() < stop:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child's close() did not return")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        reader.join(30)
        src.close()
        server.shutdown()
        server.server_close()
    assert bytes(out) == (bytes(range(256)) * 4096)[: len(out)]
