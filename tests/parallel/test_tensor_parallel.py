"""Tensor-parallel loading with real torch.distributed processes (gloo, world size 2 and 4).

Each rank is a separate Python process started like torchrun would start it; they meet through
a FileStore in ``tmp_path``. The ranks load their shards with ``load_shard``, all-gather them and
check that they concatenate to the full tensors; the parent then checks that each rank read
exactly its own bytes of tensor data.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import pysafetensors.torch as ptorch  # noqa: E402
from pysafetensors import SafetensorError  # noqa: E402
from pysafetensors.numpy import save_file  # noqa: E402
from pysafetensors.parallel import load_shard, plan_shard, shard_range  # noqa: E402

WORKER = Path(__file__).with_name("tp_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _model(path: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        # 64 rows: even for 2 and 4 ranks.
        "layer.q.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        # 10 columns: uneven for 4 ranks (3, 3, 3, 1) -> torch.chunk semantics.
        "layer.o.weight": torch.randn(40, 10, generator=g),
        # Split on the last of 4 dims (7 wide: 4 ranks get 2, 2, 2, 1).
        "layer.conv.weight": torch.randint(-100, 100, (6, 5, 3, 7), generator=g, dtype=torch.int16),
        "layer.norm.weight": torch.randn(96, generator=g),
    }
    ptorch.save_file(tensors, path)
    return tensors


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_load_their_shards_and_gather_the_whole(tmp_path: Path, world_size: int) -> None:
    model = tmp_path / "model.safetensors"
    tensors = _model(model)
    results = tmp_path / "results"
    results.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    # gloo picks an interface from the host name; loopback always exists.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(rank),
                str(world_size),
                str(tmp_path / "store"),
                str(model),
                str(results),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world_size)
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out.decode(errors="replace"))
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"

    full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    for rank in range(world_size):
        got = json.loads((results / f"rank-{rank}.json").read_text())
        per = got["tensors"]
        # Every rank reads exactly its part: row splits are one run, column and last-dim
        # splits are many short runs read one by one, replicated tensors are read whole.
        for name in ("layer.q.weight", "layer.norm.weight", "layer.o.weight", "layer.conv.weight"):
            assert per[name]["read"] == per[name]["shard"], (name, per[name])
        total_read = sum(t["read"] for t in per.values())
        assert total_read < full_bytes
        # The header was read once, in one small read.
        assert got["header_read"] <= 64 << 10


def test_plan_and_bytes_without_processes(tmp_path: Path) -> None:
    model = tmp_path / "model.safetensors"
    tensors = _model(model)
    rules = {"*.q.weight": "rows", "*.o.weight": "columns", "*.conv.weight": -1}
    for rank in range(3):
        shard = load_shard(model, rank, 3, rules, framework="np")
        for name, t in tensors.items():
            dim = {"layer.q.weight": 0, "layer.o.weight": 1, "layer.conv.weight": 3}.get(name)
            if dim is None:
                assert shard[name].shape == tuple(t.shape)
                continue
            start, stop = shard_range(t.shape[dim], rank, 3)
            want = t.narrow(dim, start, stop - start)
            if want.dtype == torch.bfloat16:
                want = want.view(torch.int16)
                assert shard[name].dtype.name == "bfloat16"
                assert np.array_equal(shard[name].view(np.int16), want.numpy())
            else:
                assert np.array_equal(shard[name], want.numpy())
    plan = plan_shard({"w": [10, 4]}, 3, 4, {"w": "rows"})
    assert (plan["w"].start, plan["w"].stop, plan["w"].shard_shape) == (9, 10, (1, 4))


def test_a_replicated_spec_takes_the_whole_tensor() -> None:
    """A replicated tensor's spec has no split dimension: it takes the whole tensor, and its
    bounds are ``0`` and ``shape[0]`` (``0`` for a scalar), as its docstring says."""
    plan = plan_shard({"x": [5, 3], "s": []}, 1, 2, {})
    x, s = plan["x"], plan["s"]
    assert (x.dim, x.start, x.stop, x.index, x.shard_shape) == (None, 0, 5, (), (5, 3))
    assert (s.dim, s.start, s.stop, s.index, s.shard_shape) == (None, 0, 0, (), ())


def _root(a: np.ndarray) -> object:
    """The object that owns an array's memory (the array itself when it owns it)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else a.base


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_parts_read_together_equal_get_slice(tmp_path: Path, backend: str) -> None:
    """load_shard reads every one-run part (rows, whole tensors) into one buffer at once; every
    part, of any rank (empty ones too), equals what get_slice gives, in file order."""
    from pysafetensors import safe_open

    model = tmp_path / "model.safetensors"
    tensors = _model(model)
    rules = {"*.q.weight": "rows", "*.o.weight": "columns", "*.conv.weight": -1}
    for world_size in (4, 8):
        shapes = {name: list(t.shape) for name, t in tensors.items()}
        for rank in range(world_size):
            plan = plan_shard(shapes, rank, world_size, rules)
            shard = load_shard(model, rank, world_size, rules, framework="np", backend=backend)
            with safe_open(model, "np", backend=backend) as f:
                assert list(shard) == list(f.offset_keys())
                for name, spec in plan.items():
                    want = f.get_tensor(name) if spec.dim is None else f.get_slice(name)[spec.index]
                    assert shard[name].dtype == want.dtype
                    assert np.array_equal(shard[name].view(np.uint8), want.view(np.uint8))
    shard = load_shard(model, 1, 4, rules, framework="np", backend=backend)
    together = _root(shard["layer.q.weight"]) is _root(shard["layer.norm.weight"])
    assert together == (backend == "pread")  # the mmap backend copies each part on its own
    if backend == "mmap":
        # ... whole tensors included, which are as get_tensor gives them (a copy of their own).
        norm = shard["layer.norm.weight"]
        assert _root(norm) is not _root(shard["layer.q.weight"])
        with safe_open(model, "np") as f:
            alone = f.get_tensor("layer.norm.weight")
            assert norm.flags.owndata == alone.flags.owndata
            assert type(_root(norm)) is type(_root(alone))


def test_auto_backend_maps_a_local_files_column_splits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default backend reads by positioned reads and copies the column splits (parts that
    are not one byte run) out of one mapping of the same open file, made only when a part
    needs it; file objects without a descriptor, URLs and slice_reads="exact" map nothing.
    Sharded folders do the same shard by shard. The parts are the same every way. (This
    model's tensors are small, which load_shard reads whole instead, see the end: mapped here
    with that threshold set to 0.)"""
    import io

    from pysafetensors import _reader
    from pysafetensors._sources import PreadSource

    small_part = _reader._SMALL_PART
    monkeypatch.setattr(_reader, "_SMALL_PART", 0)

    model = tmp_path / "model.safetensors"
    tensors = _model(model)
    ptorch.save_file({"lead": torch.arange(24.0).reshape(1, 4, 6)}, tmp_path / "lead.safetensors")
    folder = tmp_path / "sharded"
    ptorch.save_sharded(tensors, folder, max_shard_size=4_000)
    assert len(list(folder.glob("*.safetensors"))) > 1
    rules = {"*.q.weight": "rows", "*.o.weight": "columns", "*.conv.weight": -1}
    mapped: list[str] = []
    real = PreadSource.mapped

    def spy(self: PreadSource) -> Any:
        mapped.append(self.name)
        return real(self)

    monkeypatch.setattr(PreadSource, "mapped", spy)
    want = load_shard(model, 1, 4, rules, framework="np", backend="pread")
    assert mapped == []
    with open(model, "rb") as fh:
        cases: list[tuple[Any, dict[str, Any], int]] = [
            (model, {}, 1),
            (str(model), {}, 1),
            (fh, {}, 1),
            (io.BytesIO(model.read_bytes()), {}, 0),
            (model, {"slice_reads": "exact"}, 0),
            (model, {"backend": "mmap"}, 0),
            (folder, {}, len(list(folder.glob("*.safetensors")))),
        ]
        for path, options, maps in cases:
            mapped.clear()
            got = load_shard(path, 1, 4, rules, framework="np", **options)
            assert len(mapped) <= maps and (maps == 0) == (not mapped), (path, options, mapped)
            assert sorted(got) == sorted(want)
            for name, part in want.items():
                assert np.array_equal(got[name].view(np.uint8), part.view(np.uint8)), name
    mapped.clear()
    rows_only = load_shard(model, 0, 2, {"*": "rows"}, framework="np")
    assert mapped == []  # nothing needed a mapping
    assert np.array_equal(rows_only["layer.o.weight"], tensors["layer.o.weight"][:20].numpy())
    lead = load_shard(tmp_path / "lead.safetensors", 1, 2, {"lead": 1}, framework="np")
    assert mapped == []  # (1, 4, 6) split along dim 1 is one run
    assert np.array_equal(lead["lead"], np.arange(24.0).reshape(1, 4, 6)[:, 2:])
    # Column splits of small tensors: the tensors read whole, no mapping.
    monkeypatch.setattr(_reader, "_SMALL_PART", small_part)
    got = load_shard(model, 1, 4, rules, framework="np")
    assert mapped == []
    for name, part in want.items():
        assert np.array_equal(got[name].view(np.uint8), part.view(np.uint8)), name


def test_auto_backend_reads_whole_rows_where_the_file_cannot_be_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without mmap (ENODEV), or no address space for the mapping: the column
    splits are read by positioned reads instead, the same bytes."""
    import errno

    from pysafetensors import _reader
    from pysafetensors._sources import PreadSource

    monkeypatch.setattr(_reader, "_SMALL_PART", 0)  # this model's tensors are all small
    model = tmp_path / "model.safetensors"
    _model(model)
    rules = {"*.q.weight": "rows", "*.o.weight": "columns", "*.conv.weight": -1}
    want = load_shard(model, 1, 4, rules, framework="np", backend="pread")
    tries: list[int] = []

    def unmappable(self: PreadSource) -> Any:
        tries.append(1)
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(PreadSource, "mapped", unmappable)
    got = load_shard(model, 1, 4, rules, framework="np")
    assert tries == [1]  # tried once, not once per part
    for name, part in want.items():
        assert np.array_equal(got[name].view(np.uint8), part.view(np.uint8)), name


@pytest.mark.parametrize("small_part", [0, 64 << 10])
def test_auto_backend_reads_one_file_even_if_its_path_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_part: int
) -> None:
    """Every part comes from the file that was opened: a file put in its place by os.replace
    during the load (a checkpoint being re-saved) is not mixed in, column splits included
    (copied out of a mapping, or, for small tensors, read whole by positioned reads)."""
    import pysafetensors.parallel as parallel
    from pysafetensors import _reader

    monkeypatch.setattr(_reader, "_SMALL_PART", small_part)

    model = tmp_path / "model.safetensors"
    tensors = _model(model)
    newer = tmp_path / "newer.safetensors"
    ptorch.save_file({k: v + 1 for k, v in tensors.items()}, newer)
    rules = {"*.q.weight": "rows", "*.o.weight": "columns", "*.conv.weight": -1}
    want = load_shard(model, 1, 4, rules, framework="np", backend="pread")
    real = parallel._plan_parts
    replaced: list[int] = []

    def replaced_after_planning(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        os.replace(newer, model)  # after the header was read, before any part is
        replaced.append(1)
        return plan

    monkeypatch.setattr(parallel, "_plan_parts", replaced_after_planning)
    got = load_shard(model, 1, 4, rules, framework="np")
    assert replaced == [1]
    for name, part in want.items():
        assert np.array_equal(got[name].view(np.uint8), part.view(np.uint8)), name


def test_rank_and_world_size_checked_before_anything(tmp_path: Path) -> None:
    # Even when every tensor is replicated (no split would notice), and naming no tensor.
    model = tmp_path / "model.safetensors"
    ptorch.save_file({"norm": torch.ones(4)}, model)
    bad: list[tuple[Any, Any, type[Exception], str]] = [
        (99, 0, ValueError, "world_size must be at least 1, got 0"),
        (2, 2, ValueError, "rank 2 is not in a group of size 2"),
        (-1, 2, ValueError, "rank -1 is not in a group of size 2"),
        (0.5, 2, TypeError, "rank must be an int, got float"),
        (0, True, TypeError, "world_size must be an int, got bool"),
    ]
    for rank, world, error, text in bad:
        with pytest.raises(error, match=text):
            load_shard(model, rank, world, {})
        with pytest.raises(error, match=text):
            plan_shard({"norm": [4]}, rank, world, {})
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(ValueError, match="rank 3"):
        load_shard(missing, 3, 2, {})  # refused before the file is opened


def test_shard_range_checks_its_arguments_as_plan_shard_does() -> None:
    from pysafetensors.parallel import plan_shard, shard_range

    with pytest.raises(ValueError, match="size must be a non-negative int"):
        shard_range(-5, 0, 2)
    with pytest.raises(TypeError, match="size must be an int"):
        shard_range(10.0, 0, 2)  # type: ignore[arg-type]
    # numpy integers are integers (they were taken before the checks, and stay so).
    assert shard_range(np.int64(10), np.int64(1), np.int64(4)) == (3, 6)
    with pytest.raises(TypeError, match="world_size must be an int"):
        shard_range(10, 0, True)
    # A negative dimension is refused wherever it is, also in a dimension not split.
    for shape in ([-5], [3, -1]):
        with pytest.raises(ValueError, match="has a negative dimension"):
            plan_shard({"a": shape}, 0, 2, {"a": "rows"})
    # A numpy integer names a dimension as an int does.
    spec = plan_shard({"a": [4, 6]}, 1, 2, {"a": np.int64(1)})["a"]
    assert (spec.dim, spec.start, spec.stop) == (1, 3, 6)


def test_packed_splits_inside_a_byte_are_refused_on_every_rank(tmp_path: Path) -> None:
    # F4 packs two values per byte: split 3 ways along columns of 8, ranks 0 and 1 would end
    # mid-byte. Rank 2's part was aligned and loaded while the others failed (a job then hangs
    # at its next collective); now every rank refuses, naming the tensor.
    import ml_dtypes

    path = tmp_path / "f4.safetensors"
    values = np.zeros((4, 8), ml_dtypes.float4_e2m1fn)
    save_file({"layers.0.w": values}, path)
    for rank in range(3):
        with pytest.raises(ValueError, match="'layers.0.w'.*inside a byte"):
            load_shard(path, rank, 3, {"*": "columns"}, framework="np")
    # Along rows (whole bytes per row) and in even column parts it works.
    assert load_shard(path, 1, 2, {"*": "columns"}, framework="np")["layers.0.w"].shape == (4, 4)
    assert load_shard(path, 2, 4, {"*": "rows"}, framework="np")["layers.0.w"].shape == (1, 8)


def test_malformed_options_are_refused_whatever_the_tensors(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a.norm.weight": np.ones(4, np.float32)}, path)
    # Only replicated tensors: typos in uneven/default were not noticed.
    with pytest.raises(ValueError, match="uneven"):
        load_shard(path, 0, 2, {"*": "replicate"}, framework="np", uneven="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default"):
        load_shard(path, 0, 2, {"*": "replicate"}, framework="np", default="bogus")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rules"):
        load_shard(path, 0, 2, "rows", framework="np")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rules"):
        load_shard(path, 0, 2, None, framework="np")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="names"):
        load_shard(path, 0, 2, {}, framework="np", names="a.norm.weight")
    with pytest.raises(TypeError, match="dimension"):
        plan_shard({"a": [4.7]}, 0, 2, {"*": "rows"})  # was silently 4
    # safe_open's message listed its two backends, not the default "auto" of load_shard.
    expected = r'backend "AUTO" is invalid \(expected one of: "auto", "mmap", "pread"\)'
    with pytest.raises(SafetensorError, match=expected):
        load_shard(path, 0, 2, {}, framework="np", backend="AUTO")  # type: ignore[arg-type]


def test_in_memory_buffers_are_copied_not_viewed() -> None:
    # With the mmap backend, tensors from a bytearray viewed the caller's buffer: writing to a
    # part changed the buffer (and every later load from it); a read-only buffer made torch
    # warn that writing to the tensor was undefined.
    import warnings

    from pysafetensors import safe_open
    from pysafetensors.numpy import load, save

    data = bytearray(save({"w": np.arange(16, dtype=np.float32).reshape(4, 4)}))
    for framework in ("pt", "np"):
        with safe_open(data, framework) as f:
            f.get_tensor("w")[0, 0] = 99
        load_shard(data, 0, 2, {"*": "columns"}, framework, backend="mmap")["w"][0, 0] = 77
        assert load(bytes(data))["w"][0, 0] == 0
    frozen = memoryview(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        part = load_shard(frozen, 0, 2, {"*": "columns"}, "pt", backend="mmap")["w"]
    assert part.tolist() == [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0], [12.0, 13.0]]


def _first_unaligned_by_every_rank(
    size: int, inner: int, width: int, world_size: int, uneven: str
) -> tuple[int, int] | None:
    from pysafetensors.parallel import shard_range

    for rank in range(world_size):
        for bound in shard_range(size, rank, world_size, uneven):  # type: ignore[arg-type]
            if bound * inner * width % 8:
                return rank, bound
    return None


def test_packed_split_check_names_the_first_bad_rank_without_visiting_all() -> None:
    # The check looks at a few ranks only (the bounds are arithmetic progressions): it must
    # name the same first rank and bound a loop over every rank finds.
    from pysafetensors._slicing import Part
    from pysafetensors.parallel import _check_byte_aligned

    cases = 0
    for uneven in ("chunk", "tensor_split"):
        for width in (4, 6):
            for inner in (1, 2, 3, 4):
                for size in range(40):
                    for world_size in range(1, 13):
                        want = _first_unaligned_by_every_rank(
                            size, inner, width, world_size, uneven
                        )
                        planned = ((size, inner), Part(0, 0, 0))
                        try:
                            _check_byte_aligned({"t": planned}, {"t": width}, world_size, uneven)  # type: ignore[arg-type]
                            got = None
                        except ValueError as exc:
                            m = re.search(r"rank (\d+)'s part .* \(at index (\d+)\)", str(exc))
                            assert m is not None
                            got = (int(m.group(1)), int(m.group(2)))
                        assert got == want, (uneven, width, inner, size, world_size)
                        cases += got is not None
    assert cases > 1000  # the refusals were exercised, not only the aligned splits
    # A world size in the millions is answered at once (it looped over every rank: 12 s).
    planned = ((3 * 10**7 + 1, 1), Part(0, 0, 0))
    with pytest.raises(ValueError, match=r"rank \d+'s part"):
        _check_byte_aligned({"t": planned}, {"t": 4}, 10**7, "tensor_split")


def test_column_parts_are_copied_into_one_destination(tmp_path: Path) -> None:
    # Each column part had a destination of its own (4-31 MiB for a 7B model), which fell
    # back to 4 KiB pages once one huge-page step was slow; one destination for all, as the
    # row parts share, is probed as a whole (a TP=8 column split of a 2 GiB file: 222-316 ms
    # against 312-492 ms in fresh processes on a 2-core VM).
    rng = np.random.default_rng(7)
    tensors = {
        "a": rng.standard_normal((64, 48)).astype(np.float32),
        "b": rng.standard_normal((32, 80)).astype(np.float16),
        "n": rng.standard_normal(48).astype(np.float32),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)

    def root(array: np.ndarray) -> Any:
        """The memory an array views: the owning array, or the buffer object under it."""
        while isinstance(array.base, np.ndarray):
            array = array.base
        return array if array.base is None else array.base

    for rank in range(4):
        part = load_shard(path, rank, 4, {"a": "columns", "b": "columns"}, framework="np")
        assert np.array_equal(part["a"], tensors["a"][:, rank * 12 : (rank + 1) * 12])
        assert np.array_equal(part["b"], tensors["b"][:, rank * 20 : (rank + 1) * 20])
        assert np.array_equal(part["n"], tensors["n"])
        assert root(part["a"]) is root(part["b"])


@pytest.mark.parametrize(
    ("rules", "error", "text"),
    [
        ({"*.q_proj.weight": "row"}, ValueError, "unknown split 'row'"),
        ({"w": "replicate", "*": "colums"}, ValueError, "unknown split 'colums'"),
        ({"x": 1.5}, ValueError, "unknown split 1.5"),
        ({0: "rows"}, TypeError, "pattern 0 is not a str"),
        ([(b"w", "rows")], TypeError, "pattern b'w' is not a str"),
        ({re.compile(b"w"): "rows"}, TypeError, "compiled str regex"),
    ],
)
def test_every_rule_is_checked_whatever_the_tensors(
    tmp_path: Path, rules: Any, error: type[Exception], text: str
) -> None:
    """A typo in a rule no tensor of this rank matched passed silently here and failed on the
    ranks whose tensors it matched: they raised, the others waited in their next collective."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.zeros((4, 4), np.float32)}, str(path))
    with pytest.raises(error, match=re.escape(text)):
        load_shard(path, 0, 2, rules)
    with pytest.raises(error, match=re.escape(text)):
        plan_shard({}, 0, 2, rules)


def test_small_parts_close_together_are_read_as_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of many small tensors (a mixture of experts): a rank's row parts less than
    a page apart are read in a few spans, not one read each, and equal get_slice's parts;
    ``slice_reads="exact"`` reads one run per part, only its bytes."""
    from pysafetensors import safe_open

    rng = np.random.default_rng(5)
    tensors = {
        f"experts.{i}.w": rng.integers(0, 2**16, (8, int(rng.integers(1, 40))), np.uint16)
        for i in range(600)
    }
    tensors["big"] = rng.integers(0, 255, (64, 4096), np.uint8)  # 32 KiB parts, read alone
    model = tmp_path / "moe.safetensors"
    save_file(tensors, model)
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        n = real(fd, buffers, offset, *args)
        reads.append((offset, n))
        return n

    monkeypatch.setattr(os, "preadv", counting)
    plan = plan_shard({k: list(t.shape) for k, t in tensors.items()}, 1, 8, {"*": "rows"})
    with safe_open(model, "np") as f:
        data_start = f.header.data_start
        want = {name: f.get_slice(name)[plan[name].index] for name in f.offset_keys()}
    for mode in ("coalesce", "exact"):
        reads.clear()
        got = load_shard(
            model, 1, 8, {"*": "rows"}, framework="np", backend="pread", slice_reads=mode
        )
        assert list(got) == list(want)
        for name, part in want.items():
            assert np.array_equal(got[name], part), name
        data_reads = [(o, n) for o, n in reads if o >= data_start]
        part_bytes = sum(part.nbytes for part in want.values())
        if mode == "coalesce":
            assert len(data_reads) < 10
        else:
            assert len(data_reads) == len(want)
            assert sum(n for _, n in data_reads) == part_bytes


def test_small_and_large_column_parts_equal_get_slice(tmp_path: Path) -> None:
    """Column and last-dimension parts copied out of a mapping (the default backend): small
    tensors through one view of the data, large ones by the framework's copy, for every
    whole-byte width and both frameworks, equal get_slice's parts."""
    from pysafetensors import safe_open

    rng = np.random.default_rng(6)
    tensors: dict[str, np.ndarray] = {}
    for i, dtype in enumerate([np.uint8, np.int16, np.float32, np.float64] * 20):
        shape = (int(rng.integers(1, 9)), int(rng.integers(1, 30)), int(rng.integers(1, 5)))
        tensors[f"small.{i}"] = rng.integers(0, 100, shape).astype(dtype)
    tensors["large"] = rng.integers(0, 100, (300, 200)).astype(np.float32)  # 240 KB
    tensors["flat"] = rng.integers(0, 100, (70,)).astype(np.int16)  # replicated
    model = tmp_path / "m.safetensors"
    save_file(tensors, model)
    rules = {"small.1*": -1, "flat": "replicate", "*": "columns"}
    shapes = {k: list(t.shape) for k, t in tensors.items()}
    for framework in ("np", "pt"):
        for rank in (0, 3):
            plan = plan_shard(shapes, rank, 4, rules)
            got = load_shard(model, rank, 4, rules, framework=framework)
            with safe_open(model, framework) as f:
                for name, spec in plan.items():
                    want = f.get_tensor(name) if spec.dim is None else f.get_slice(name)[spec.index]
                    if framework == "pt":
                        assert torch.equal(got[name], want), name
                    else:
                        assert np.array_equal(got[name], want), name


_TRUNCATED_DURING_LOAD = """
import os, sys
import numpy as np
import pysafetensors.parallel as parallel
from pysafetensors import SafetensorError, _reader
from pysafetensors.numpy import save_file

path, small_part = sys.argv[1], int(sys.argv[2])
_reader._SMALL_PART = small_part
rng = np.random.default_rng(0)
save_file({f"t{i:03d}": rng.random((32, 32), np.float32) for i in range(200)}, path)
real = parallel._plan_parts

def truncated_after_planning(*args, **kwargs):
    plan = real(*args, **kwargs)
    os.truncate(path, os.path.getsize(path) // 2)  # another process cuts the file short
    return plan

parallel._plan_parts = truncated_after_planning
try:
    parallel.load_shard(path, 0, 2, {"*": "columns"}, framework="np")
except SafetensorError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("small_part", [0, 64 << 10])
def test_a_file_cut_short_during_a_column_split_is_refused_not_a_crash(
    tmp_path: Path, small_part: int
) -> None:
    """Column splits copied out of a mapping check the file's size before each copy (touching
    a page past a truncated end is SIGBUS); small tensors' splits are read by positioned reads,
    which meet the end of the file. Either way a clear error, in a child process that would
    die of SIGBUS otherwise."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRUNCATED_DURING_LOAD,
            str(tmp_path / "m.safetensors"),
            str(small_part),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "refused:" in proc.stdout
    assert "reading tensor 't" in proc.stdout or "tensor `t" in proc.stdout, proc.stdout
    assert "truncated" in proc.stdout or "end of file" in proc.stdout or "short" in proc.stdout, (
        proc.stdout
    )


def test_the_first_bad_tensor_names_the_error_whatever_later_rules_do(tmp_path: Path) -> None:
    """Rules run tensor by tensor between the checks, in file order: a bad split of an early
    tensor is the error, not a later rule's exception; duplicate names ask the rule once."""
    model = tmp_path / "m.safetensors"
    save_file({"a": np.zeros((8, 6), np.float32), "b": np.zeros((4, 4), np.float32)}, model)
    asked: list[str] = []

    def rule(name: str, shape: tuple[int, ...]) -> Any:
        asked.append(name)
        if name == "b":
            raise RuntimeError("later")
        return "row"

    with pytest.raises(ValueError, match="tensor 'a': unknown split 'row'"):
        load_shard(model, 0, 2, rule, framework="np")
    asked.clear()
    load_shard(model, 0, 2, lambda n, s: asked.append(n) or "rows", names=["a", "b", "a"])
    assert asked == ["a", "b"]


def test_errors_of_the_callers_arguments_name_the_tensor(tmp_path: Path) -> None:
    # A rules function that raised, a shape that is no sequence, shapes that are no mapping:
    # a bare ZeroDivisionError, "'int' object is not iterable" and an AttributeError.
    model = tmp_path / "m.safetensors"
    save_file({"a": np.zeros((8, 6), np.float32)}, model)
    with pytest.raises(ZeroDivisionError) as info:
        load_shard(model, 0, 2, lambda n, s: 1 / 0, framework="np")
    assert info.value.__notes__ == ["in the rules function, for tensor 'a' of shape [8, 6]"]
    with pytest.raises(TypeError, match="tensor 'a': a shape must be a sequence of ints, not int"):
        plan_shard({"a": 3}, 0, 2, {})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="shapes must be a mapping .* not list"):
        plan_shard([("a", [3])], 0, 2, {})  # type: ignore[arg-type]
