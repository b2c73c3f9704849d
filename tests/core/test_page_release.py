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
from pysafetensors._page_release import RELEASE_MIN, can_release
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
    rules = {"embed": "rows", "head": "rows"}  # the rest replicated
    parts = parallel.load_shard(path, 0, 2, rules, framework="np", backend="pread")
    assert _anonymous_mib() - before > 20  # 24 MiB of rows and the 2 MiB tensor
    norm, rows = parts["norm"], parts["head"][:4].copy()
    del parts
    gc.collect()
    assert _anonymous_mib() - before < 6
    assert np.array_equal(norm, expected["norm"])
    assert np.array_equal(rows, expected["head"][:4])


def test_small_tensors_still_share_the_buffer(model) -> None:
    """Tensors under RELEASE_MIN view the buffer as before (no object of their own each)."""
    path, _ = model
    sd = load_file(path)
    assert sd["small"].nbytes < RELEASE_MIN <= sd["mid"].nbytes
    assert np.shares_memory(sd["small"], sd["norm"]) is False  # disjoint bytes...
    assert sd["small"].base is sd["norm"].base  # ...of one buffer
    assert sd["mid"].base is not sd["small"].base


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
