"""Tensors of one load by positioned reads share one fresh buffer; each large one gives its
pages back when it (and everything made from it) is dropped. Before, keeping any one tensor
kept the whole buffer: ``del sd["lm_head.weight"]`` freed nothing."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pysafetensors import parallel, safe_open
from pysafetensors._page_release import RELEASE_BUFFER_MIN, RELEASE_MIN, _blocks, can_release
from pysafetensors.numpy import load, load_file, save_file

pytestmark = pytest.mark.skipif(
    not can_release() or not Path("/proc/self/status").exists(), reason="Linux madvise"
)

MIB = 1 << 20


def _anonymous_mib() -> float:
    """This process's anonymous resident memory (what a fresh buffer takes), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    tensors = {
        "embed": rng.standard_normal((2048, 4096), np.float32),  # 32 MiB
        "norm": rng.standard_normal(4096).astype(np.float32),
        "head": rng.standard_normal((1024, 4096), np.float32),  # 16 MiB
        "small": rng.integers(0, 100, 300, np.int64),
        "mid": rng.standard_normal(2 * MIB // 4).astype(np.float32),  # 2 MiB
    }
    path = tmp_path_factory.mktemp("release") / "model.safetensors"
    save_file(tensors, path)
    return path, tensors


LOADS = {
    "numpy load_file": lambda path: load_file(path),
    "numpy pread": lambda path: safe_open(path, "np", backend="pread").get_tensors(),
    "torch pread": lambda path: safe_open(path, "pt", backend="pread").get_tensors(),
    "numpy load(bytes)": lambda path: load(path.read_bytes()),
}


def _as_numpy(t: object) -> np.ndarray:
    return t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


@pytest.mark.parametrize("how", list(LOADS))
def test_dropping_tensors_gives_their_memory_back(model, how: str) -> None:
    path, expected = model
    gc.collect()
    before = _anonymous_mib()
    sd = LOADS[how](path)
    loaded = _anonymous_mib() - before
    assert loaded > 45, loaded  # the 50 MiB of data, in memory of the load's own
    kept = {k: sd[k] for k in ("norm", "small", "mid")}
    del sd
    gc.collect()
    # The two large tensors' 48 MiB went; what is kept is 2 MiB and small ones (and the
    # pages shared at their edges). Before, all 50 MiB stayed.
    assert _anonymous_mib() - before < 8, (how, loaded, _anonymous_mib() - before)
    for name, value in kept.items():
        assert np.array_equal(_as_numpy(value), expected[name]), name


@pytest.mark.parametrize("how", list(LOADS))
def test_a_view_of_a_dropped_tensor_keeps_its_bytes(model, how: str) -> None:
    """Only a tensor nothing refers to any more gives its pages back: a slice, reshape or
    dtype view of it (numpy's or torch's), kept after the tensor itself and the rest of the
    load are dropped, still reads the tensor's values."""
    path, expected = model
    sd = LOADS[how](path)
    embed, head = sd["embed"], sd["head"]
    views = {
        "row": (embed[1000], expected["embed"][1000]),
        "flat": (head.reshape(-1)[-4096:], expected["head"].reshape(-1)[-4096:]),
        "bytes": (
            head.view(torch.uint8) if isinstance(head, torch.Tensor) else head.view(np.uint8),
            expected["head"].view(np.uint8),
        ),
    }
    del sd, embed, head
    gc.collect()
    for name, (view, want) in views.items():
        assert np.array_equal(_as_numpy(view), want), (how, name)


def test_load_shard_parts_give_their_memory_back(model) -> None:
    path, expected = model
    gc.collect()
    before = _anonymous_mib()
    rules = {"head": "rows"}  # the rest replicated: one buffer of over RELEASE_BUFFER_MIN
    parts = parallel.load_shard(path, 0, 2, rules, framework="np", backend="pread")
    assert _anonymous_mib() - before > 38  # 8 MiB of rows, the 32 MiB and 2 MiB tensors
    norm, rows = parts["norm"], parts["head"][:4].copy()
    del parts
    gc.collect()
    assert _anonymous_mib() - before < 6
    assert np.array_equal(norm, expected["norm"])
    assert np.array_equal(rows, expected["head"][:4])


def _owner(array: np.ndarray) -> np.ndarray:
    """The array at the end of ``array``'s chain of bases: what keeps its bytes."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def test_small_tensors_share_a_block(model, adapters) -> None:
    """Tensors under RELEASE_MIN next to each other view one block of the buffer (one object
    and finalizer per block, of about RELEASE_MIN bytes, not one per tensor); a large tensor
    views its own."""
    sd = load_file(adapters[0])
    owners = {id(_owner(value)): _owner(value).nbytes for value in sd.values()}
    assert len(owners) == len(sd) * 8192 // RELEASE_MIN + 1  # 40 blocks (and the empty)
    assert all(RELEASE_MIN <= size < RELEASE_MIN + 8192 for size in list(owners.values())[:-2])
    sd = load_file(model[0])
    assert sd["mid"].nbytes == _owner(sd["mid"]).nbytes >= RELEASE_MIN
    assert _owner(sd["small"]) is not _owner(sd["mid"])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A LoRA-shaped file: 40 MiB of 8 KiB tensors, none large, with an empty one."""
    rng = np.random.default_rng(11)
    tensors = {f"layers.{i}.lora": rng.integers(0, 1 << 16, 4096, np.uint16) for i in range(5120)}
    tensors["layers.empty"] = np.zeros((0, 4), np.uint16)
    path = tmp_path_factory.mktemp("release") / "adapters.safetensors"
    save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("how", list(LOADS))
def test_keeping_one_small_tensor_keeps_its_block_only(adapters, how: str) -> None:
    """Before, the small tensors of a load all viewed its buffer: keeping one of a file of
    small tensors (a LoRA file) kept every one's bytes, 40 MiB here."""
    path, expected = adapters
    gc.collect()
    before = _anonymous_mib()
    sd = LOADS[how](path)
    assert _anonymous_mib() - before > 35
    assert list(sd) == list(expected) or sorted(sd) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(_as_numpy(sd[name]), value), name
    kept, row = sd["layers.77.lora"], sd["layers.3000.lora"][10:20]
    del sd
    gc.collect()
    assert _anonymous_mib() - before < 6, (how, _anonymous_mib() - before)
    assert np.array_equal(_as_numpy(kept), expected["layers.77.lora"])
    assert np.array_equal(_as_numpy(row), expected["layers.3000.lora"][10:20])


def test_a_small_load_keeps_one_buffer(tmp_path: Path) -> None:
    """Under RELEASE_BUFFER_MIN, every tensor views the one buffer, large ones too: malloc
    gives its warm pages to the next load, which handing them back would make fault them in
    again (a loop loading an 8 MiB file took three times as long)."""
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal(MIB // 2), "b": rng.standard_normal(600)}  # 4 MiB
    save_file(tensors, tmp_path / "small.safetensors")
    sd = load_file(tmp_path / "small.safetensors")
    assert sd["a"].nbytes >= RELEASE_MIN and sd["a"].nbytes + sd["b"].nbytes < RELEASE_BUFFER_MIN
    assert sd["a"].base is sd["b"].base
    for name, value in tensors.items():
        assert np.array_equal(sd[name], value)


def test_blocks_group_small_tensors_and_keep_large_ones_alone() -> None:
    mib = RELEASE_MIN
    items = [
        ("c", "F32", (1,), 3 * mib, 3 * mib + 100),  # out of buffer order
        ("a", "F32", (1,), 0, mib // 2),
        ("b", "F32", (1,), mib // 2, mib),  # closes the first block at RELEASE_MIN
        ("big", "F32", (1,), 3 * mib + 100, 5 * mib),
        ("d", "F32", (1,), mib, 2 * mib - 8),
        ("e", "F32", (1,), 2 * mib - 8, 2 * mib - 8),  # empty
        ("f", "F32", (1,), 5 * mib, 5 * mib + 4),
    ]
    spans = [(low, high, [item[0] for item in block]) for low, high, block in _blocks(items)]
    assert spans == [
        (0, mib, ["a", "b"]),
        (mib, 3 * mib + 100, ["d", "e", "c"]),
        (3 * mib + 100, 5 * mib, ["big"]),
        (5 * mib, 5 * mib + 4, ["f"]),
    ]


def test_tensors_stay_readable_in_exit_handlers(model, tmp_path: Path) -> None:
    """Nothing is handed back at exit: an exit handler reading a loaded tensor reads it."""
    path, expected = model
    code = textwrap.dedent(
        f"""
        import atexit, hashlib
        from pysafetensors.numpy import load_file
        sd = load_file({str(path)!r})
        atexit.register(lambda: print(hashlib.sha256(sd["head"].tobytes()).hexdigest()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    import hashlib

    assert out == [hashlib.sha256(expected["head"].tobytes()).hexdigest()]


def test_a_ctrl_c_while_pages_go_back_reaches_the_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor's pages go back in a finalizer, whose exceptions Python prints and drops: a
    Ctrl-C during that madvise (a large tensor's takes a while) did not stop the program."""
    import signal
    import time

    from pysafetensors import _page_release

    calls: list[int] = []

    def interrupted_madvise(address: int, length: int, advice: int) -> int:
        calls.append(length)
        signal.raise_signal(signal.SIGINT)  # the Ctrl-C comes during the call
        return 0

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(_page_release, "madvise", interrupted_madvise)
        buf = np.zeros(4 << 20, np.uint8)
        view = _page_release.releasing_view(buf, 0, 2 << 20)
        with pytest.raises(KeyboardInterrupt):
            del view
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert calls
    finally:
        signal.signal(signal.SIGINT, previous)
