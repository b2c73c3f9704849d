"""The streaming writer: any order, any chunking, byte-identical, atomic, bounded memory."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import (
    ClosedFileError,
    SerializeError,
    ShardedStreamingWriter,
    StreamingWriter,
    safe_open,
    save_sharded,
)
from pysafetensors.numpy import load_file, save_file

from .conftest import assert_same_tree

SD = {
    "w": np.arange(60, dtype=np.float32).reshape(6, 10),
    "b": np.arange(7, dtype=np.float16),
    "step": np.array(5, dtype=np.int64),
    "empty": np.zeros((0, 3), np.float32),
    "mask": np.array([True, False, True]),
}


def _reference(path: Path, meta: dict[str, str] | None = None) -> bytes:
    save_file(SD, path, metadata=meta)
    return path.read_bytes()


@pytest.mark.parametrize("seed", range(20))
def test_random_order_and_chunking_is_byte_identical(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    expected = _reference(tmp_path / "ref.safetensors", {"format": "pt"})
    # Cut every tensor's bytes into random pieces, then write all pieces in a random order.
    pieces = []
    for name, arr in SD.items():
        raw = arr.tobytes()
        cuts = sorted({0, len(raw), *(int(c) for c in rng.integers(0, len(raw) + 1, size=3))})
        pieces += [(name, a, raw[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]
    rng.shuffle(pieces)
    out = tmp_path / "out.safetensors"
    with StreamingWriter(out, SD, {"format": "pt"}) as w:
        for name, offset, chunk in pieces:
            assert w.write(name, chunk, offset=offset) == len(chunk)
        assert w.missing() == {}
    assert out.read_bytes() == expected


def test_declarations_in_every_form(tmp_path: Path) -> None:
    expected = _reference(tmp_path / "ref.safetensors")
    forms = [
        SD,
        {k: (v.dtype, v.shape) for k, v in SD.items()},
        {k: (v.dtype.name, list(v.shape)) for k, v in SD.items()},
        [
            (
                k,
                {"float32": "F32", "float16": "F16", "int64": "I64", "bool": "BOOL"}[v.dtype.name],
                v.shape,
            )
            for k, v in SD.items()
        ],
    ]
    for i, decl in enumerate(forms):
        out = tmp_path / f"o{i}.safetensors"
        with StreamingWriter(out, decl) as w:
            for name, arr in SD.items():
                if arr.ndim >= 1 and len(arr) > 1:
                    w.write_chunk(name, arr[:1])  # rows, appended
                    w.write_chunk(name, arr[1:])
                else:
                    w.write_tensor(name, arr)
        assert out.read_bytes() == expected, i


def test_torch_tensors_and_dtypes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors.torch import save_file as torch_save

    sd = {"x": torch.randn(8, 4).to(torch.bfloat16), "y": torch.arange(10)}
    torch_save(sd, tmp_path / "ref.safetensors")
    with StreamingWriter(
        tmp_path / "o.safetensors", {"x": (torch.bfloat16, (8, 4)), "y": sd["y"]}
    ) as w:
        w.write("x", sd["x"][4:], offset=4 * 4 * 2)
        w.write("x", sd["x"][:4])
        w.write("y", sd["y"])
    assert (tmp_path / "o.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_refusals(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    w = StreamingWriter(out, SD)
    w.write("w", SD["w"][:2])
    cases = [
        (lambda: w.write("w", SD["w"][1:3], offset=40), "Overlap"),
        (lambda: w.write("w", b"\0" * 8, offset=236), "OutOfRange"),
        (lambda: w.write("w", b"\0", offset=-1), "OutOfRange"),
        (lambda: w.write("nope", b""), "UnknownTensor"),
        (lambda: w.write("b", np.zeros(7, np.float32)), "DtypeMismatch"),
    ]
    for call, kind in cases:
        with pytest.raises(SerializeError) as info:
            call()
        assert info.value.kind == kind
    with pytest.raises(SerializeError, match="unwritten bytes") as info:
        w.close()
    assert info.value.kind == "Incomplete"
    assert not out.exists()
    # Still open after a refused close: finish and commit.
    w.write("w", SD["w"][2:], offset=80)
    for name in ("b", "step", "mask"):
        w.write(name, SD[name])
    w.close()
    assert out.read_bytes() == _reference(tmp_path / "ref.safetensors")
    with pytest.raises(ClosedFileError):
        w.write("w", b"")


def test_exception_discards_and_keeps_old_file(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError), StreamingWriter(out, SD) as w:
        w.write("w", SD["w"])
        raise RuntimeError("boom")
    assert out.read_bytes() == b"old"
    # Leaving the block with bytes missing also discards (and says why).
    with pytest.raises(SerializeError, match="unwritten"), StreamingWriter(out, SD) as w:
        w.write("w", SD["w"])
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["o.safetensors"]


@pytest.mark.parametrize("limit", [100, 300, "1MB"])
def test_sharded_streaming_equals_save_sharded(tmp_path: Path, limit: int | str) -> None:
    rng = np.random.default_rng(0)
    sd = {
        f"l{i}": rng.standard_normal((int(rng.integers(1, 20)), 5)).astype(np.float32)
        for i in range(15)
    }
    sd["big"] = np.ones(200, np.float64)
    plan = save_sharded(sd, tmp_path / "direct", limit, metadata={"k": "v"})
    with ShardedStreamingWriter(tmp_path / "stream", sd, limit, metadata={"k": "v"}) as w:
        assert w.plan == plan
        for name in reversed(list(sd)):
            arr = sd[name]
            w.write(name, arr[len(arr) // 2 :], offset=arr[: len(arr) // 2].nbytes)
            w.write(name, arr[: len(arr) // 2])
    assert_same_tree(tmp_path / "direct", tmp_path / "stream")


def test_sharded_streaming_puts_empty_torch_tensors_where_the_hub_does(tmp_path: Path) -> None:
    """The hub gives every empty torch tensor one storage id, so all go to the first one's
    shard; the streaming split placed each by itself, in other shards than save_sharded's."""
    torch = pytest.importorskip("torch")
    from huggingface_hub import save_torch_state_dict

    sd = {
        "e1": torch.zeros(0),
        "a": torch.ones(100),
        "e2": torch.zeros(0, 3, dtype=torch.float16),
        "b": torch.ones(100),
        "e3": torch.zeros(2, 0),
    }
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(sd, tmp_path / "hub", max_shard_size=500)
    save_sharded(sd, tmp_path / "direct", 500)
    with ShardedStreamingWriter(tmp_path / "stream", sd, 500) as w:
        assert set(w.plan.filename_to_tensors["model-00001-of-00002.safetensors"]) == {
            "e1",
            "a",
            "e2",
            "e3",
        }
        for name, tensor in sd.items():
            w.write_tensor(name, tensor)
    assert_same_tree(tmp_path / "hub", tmp_path / "stream")
    assert_same_tree(tmp_path / "direct", tmp_path / "stream")
    # Declared by dtype and shape, an empty tensor has no storage to share: placed by itself.
    decls = {name: (str(t.dtype).split(".")[1], list(t.shape)) for name, t in sd.items()}
    declared = ShardedStreamingWriter(tmp_path / "decl", decls, 500)
    declared.abort()
    assert declared.plan.tensor_to_filename["e3"] == "model-00002-of-00002.safetensors"


def test_sharded_streaming_incomplete_commits_nothing(tmp_path: Path) -> None:
    sd = {f"l{i}": np.ones(50, np.float32) for i in range(6)}
    w = ShardedStreamingWriter(tmp_path, sd, 400)
    for name in list(sd)[:-1]:
        w.write(name, sd[name])
    with pytest.raises(SerializeError, match="l5"):
        w.close()
    assert os.listdir(tmp_path) == [] or all(n.endswith(".partial") for n in os.listdir(tmp_path))
    w.abort()
    assert os.listdir(tmp_path) == []


# A file larger than the child's whole address space: only a writer that never holds the data
# can produce it. The parent writes the same bytes through the ordinary writer (write_file with
# chunked TensorData), and the two hashes must match.
_CHUNK = 8 << 20
_LIMIT_AS = 320 << 20

_CHILD = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from pysafetensors import StreamingWriter
    shapes = {shapes!r}
    def chunks(name, rows):
        per = {chunk} // (shapes[name][1] * 4)
        for r in range(0, rows, per):
            n = min(per, rows - r)
            base = np.arange(n * shapes[name][1], dtype=np.uint32)
            yield r, (base * 2654435761 + r + ord(name)).view(np.float32).reshape(n, -1)
    try:
        np.empty({total}, np.uint8)
    except MemoryError:
        print("cannot-hold-file")
    with StreamingWriter(sys.argv[1], {{k: ("F32", s) for k, s in shapes.items()}}) as w:
        for name in reversed(list(shapes)):  # any order
            for row, block in chunks(name, shapes[name][0]):
                w.write(name, block, offset=row * shapes[name][1] * 4)
    print("ok")
    """
)


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder in memory (tmpfs) when there is one: the test is about memory, not the disk."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 << 30:
        folder = Path(tempfile.mkdtemp(dir=shm, prefix="pysafetensors-test-"))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        yield tmp_path


def test_streaming_write_larger_than_address_space(fast_dir: Path) -> None:
    tmp_path = fast_dir
    from pysafetensors._dtypes import dtype_from_code
    from pysafetensors._writer import TensorData, write_file

    shapes = {"a": (288, 1 << 18), "b": (96, 1 << 18)}  # 288 + 96 MiB of F32 (1 MiB rows)
    total = sum(r * c * 4 for r, c in shapes.values())
    assert total > _LIMIT_AS
    code = _CHILD.format(limit=_LIMIT_AS, shapes=shapes, chunk=_CHUNK, total=total)
    out = tmp_path / "stream.safetensors"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cannot-hold-file" in proc.stdout
    assert "ok" in proc.stdout

    def chunks_of(name: str):  # the same deterministic data, for the ordinary writer
        rows, cols = shapes[name]
        per = _CHUNK // (cols * 4)

        def gen():
            for r in range(0, rows, per):
                n = min(per, rows - r)
                base = np.arange(n * cols, dtype=np.uint32)
                yield (base * 2654435761 + r + ord(name)).view(np.uint8)

        return gen

    f32 = dtype_from_code("F32")
    ref = tmp_path / "ref.safetensors"
    write_file(ref, [TensorData(k, f32, s, chunks_of(k)) for k, s in shapes.items()])

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(16 << 20):
                h.update(block)
        return h.hexdigest()

    assert out.stat().st_size == ref.stat().st_size > _LIMIT_AS
    assert digest(out) == digest(ref)


def test_failed_write_is_not_counted_as_written(tmp_path: Path) -> None:
    # A write the file system refuses half-way (a file size limit here; a full disk in real
    # life) must not count: the range can be written again, and close() never commits a hole.
    script = textwrap.dedent(
        """
        import os, resource, signal, sys
        import numpy as np
        from pysafetensors import SafetensorError, StreamingWriter
        from pysafetensors.numpy import load_file

        target = sys.argv[1]
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        w = StreamingWriter(target, {"a": ("U8", (4 << 20,))})
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            w.write("a", np.full(4 << 20, 7, np.uint8))
        except SafetensorError as exc:
            assert isinstance(exc, OSError) and exc.errno is not None, exc
            assert target in str(exc), exc
            print("refused:", exc)
        else:
            raise SystemExit("the write did not fail")
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert w.missing() == {"a": 4 << 20}, w.missing()
        w.write("a", np.full(4 << 20, 7, np.uint8))  # the same range again
        w.close()
        assert (load_file(target)["a"] == 7).all()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_idle_writer_keeps_its_temporary_file(tmp_path: Path) -> None:
    # Another save to the same target clears temporary files of crashed saves, not the one a
    # live (locked) writer has been filling for more than a minute.
    target = tmp_path / "m.safetensors"
    w = StreamingWriter(target, {"a": ("U8", (8,))})
    w.write("a", b"abcd")
    (partial,) = tmp_path.glob(".m.safetensors.*.partial")
    old = os.stat(partial).st_mtime - 3600
    os.utime(partial, (old, old))
    crashed = tmp_path / ".m.safetensors.0123456789ab.partial"  # no live owner
    crashed.write_bytes(b"x")
    os.utime(crashed, (old, old))
    save_file({"b": np.zeros(2, np.uint8)}, target)
    assert partial.exists() and not crashed.exists()
    w.write("a", b"efgh", offset=4)
    w.close()
    assert target.read_bytes().endswith(b"abcdefgh")


def test_writer_refuses_bad_targets_and_inputs_at_once(tmp_path: Path) -> None:
    from pysafetensors._errors import WriteError

    with pytest.raises(WriteError) as info:
        StreamingWriter(tmp_path, {"a": ("U8", (8,))})
    assert isinstance(info.value, IsADirectoryError) and str(tmp_path) in str(info.value)
    with pytest.raises(WriteError) as info:
        StreamingWriter(tmp_path / "no" / "m.safetensors", {"a": ("U8", (8,))})
    assert isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "no" / "m.safetensors") in str(info.value)
    with StreamingWriter(tmp_path / "m.safetensors", {"a": ("U8", (8,))}) as w:
        for data, offset in [("text", 0), ([1, 2], 0), (b"ab", 1.5)]:
            with pytest.raises(SerializeError, match="`a`"):
                w.write("a", data, offset)  # type: ignore[arg-type]
        assert w.missing() == {"a": 8}
        w.write("a", bytes(8))


@pytest.mark.parametrize("shape", [(2.5,), (True,), (-1,), ("3",)])
def test_declared_shapes_must_be_non_negative_integers(tmp_path: Path, shape: tuple) -> None:
    for make in (
        lambda: StreamingWriter(tmp_path / "m.safetensors", {"a": ("F32", shape)}),
        lambda: ShardedStreamingWriter(tmp_path / "s", {"a": ("F32", shape)}),
    ):
        with pytest.raises(SerializeError, match="dimensions must be non-negative integers"):
            make()
    assert not any(tmp_path.iterdir()) or not list(tmp_path.glob("**/*.safetensors"))


def test_a_declared_0d_array_shape_is_refused_as_a_declaration(tmp_path: Path) -> None:
    # numpy's own TypeError ("iteration over a 0-d array") came out of the declaration.
    for make in (
        lambda: StreamingWriter(tmp_path / "m.safetensors", {"a": ("F32", np.array(3))}),
        lambda: ShardedStreamingWriter(tmp_path / "s", {"a": ("F32", np.array(3))}),
    ):
        with pytest.raises(SerializeError, match="declared with shape array") as info:
            make()
        assert info.value.kind == "TensorInvalidInfo"
        assert info.value.tensor == "a"


def test_a_declared_generator_shape_is_quoted_whole(tmp_path: Path) -> None:
    with pytest.raises(SerializeError, match=r"declared with shape \[2, -1\]"):
        StreamingWriter(tmp_path / "m.safetensors", {"a": ("F32", (d for d in (2, -1)))})


def test_writes_after_close_name_the_file_and_the_tensor(tmp_path: Path) -> None:
    """They said only "the streaming writer is closed", among many writers and tensors."""
    path = tmp_path / "m.safetensors"
    w = StreamingWriter(path, {"a": ("U8", (1,))})
    w.write("a", b"x")
    w.close()
    for write in (w.write, w.write_chunk, w.write_tensor):
        with pytest.raises(ClosedFileError, match=r"m.safetensors' is committed: .* tensor `a`"):
            write("a", b"x")
    w = StreamingWriter(path, {"a": ("U8", (1,))})
    w.abort()
    with pytest.raises(ClosedFileError, match="is aborted: cannot write to tensor `a`") as info:
        w.write("a", b"x")
    assert info.value.tensor == "a"
    sharded = ShardedStreamingWriter(tmp_path / "s", {"a": ("U8", (1,))})
    sharded.abort()
    with pytest.raises(ClosedFileError, match=r"s' is aborted: cannot write to tensor `a`"):
        sharded.write("a", b"x")


def test_a_repeated_declaration_is_refused_by_both_writers(tmp_path: Path) -> None:
    from pysafetensors import ShardedStreamingWriter, StreamingWriter

    decls = [("a", "F32", (2,)), ("a", "F32", (3,))]
    for make in (
        lambda: ShardedStreamingWriter(tmp_path / "d", decls),
        lambda: StreamingWriter(tmp_path / "x.safetensors", decls),
    ):
        with pytest.raises(SerializeError, match="`a` appears twice") as info:
            make()
        assert info.value.kind == "DuplicateName"
    assert sorted(os.listdir(tmp_path)) == []


def _slow_pwrites(monkeypatch: pytest.MonkeyPatch, started: threading.Event) -> None:
    from pysafetensors import _streaming

    original = _streaming.pwrite_all

    def slow(fd: int, view: memoryview, pos: int) -> None:
        started.set()
        time.sleep(0.2)
        original(fd, view, pos)

    monkeypatch.setattr(_streaming, "pwrite_all", slow)


def test_close_waits_for_a_write_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The range of a write is reserved before its bytes are written: close() in another
    thread committed the file without them (zeros), and the write then went to whatever file
    reused the closed descriptor."""
    w = StreamingWriter(tmp_path / "x.safetensors", {"a": ("F32", (4,))})
    started = threading.Event()
    _slow_pwrites(monkeypatch, started)
    writer = threading.Thread(target=lambda: w.write("a", np.arange(4, dtype=np.float32)))
    writer.start()
    assert started.wait(10)
    w.close()  # waits for the write
    writer.join()
    assert load_file(str(tmp_path / "x.safetensors"))["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_abort_stops_a_write_in_progress_and_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = np.asfortranarray(np.ones((64, 64), np.float32))  # written in several pieces
    w = StreamingWriter(tmp_path / "x.safetensors", {"a": ("F32", (64, 64))})
    started = threading.Event()
    _slow_pwrites(monkeypatch, started)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            w.write("a", values)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    assert started.wait(10)
    w.abort()
    writer.join()
    # Stopped at its next piece (ClosedFileError), or finished its only piece first; never a
    # write to a closed (or reused) descriptor.
    assert all(isinstance(e, ClosedFileError) for e in errors), errors
    assert os.listdir(tmp_path) == []
    with pytest.raises(ClosedFileError):
        w.write("a", values)


@pytest.mark.parametrize("declared", [5, "F32", ("F32", 3), ("F32",), None])
def test_malformed_declarations_name_the_tensor(tmp_path: Path, declared: Any) -> None:
    for make in (StreamingWriter, ShardedStreamingWriter):
        with pytest.raises(SerializeError, match="tensor `a`") as info:
            make(tmp_path / "out", {"a": declared})
        assert info.value.kind == "TensorInvalidInfo"
    assert os.listdir(tmp_path) == []


def test_sharded_writer_refuses_sizes_that_overflow_at_once(tmp_path: Path) -> None:
    with pytest.raises(SerializeError, match="overflow") as info:
        ShardedStreamingWriter(tmp_path / "d", {"a": ("F32", (2**62, 4)), "b": ("F32", (2,))})
    assert info.value.tensor == "a"
    assert not (tmp_path / "d").exists()


def test_meta_and_sparse_writes_are_serialize_errors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with StreamingWriter(tmp_path / "x.safetensors", {"a": ("F32", (2,))}) as w:
        for bad, kind in (
            (torch.ones(2, device="meta"), "MetaTensor"),
            (torch.ones(2).to_sparse(), "SparseTensor"),
        ):
            with pytest.raises(SerializeError, match="`a`") as info:
                w.write("a", bad)
            assert info.value.kind == kind
        w.write("a", torch.ones(2))


def test_two_closes_waiting_on_one_write_finish_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both passed the closed check, waited for the write, and the second then called
    __exit__ on None (AttributeError)."""
    w = StreamingWriter(tmp_path / "x.safetensors", {"a": ("F32", (4,))}, fsync=True)
    started = threading.Event()
    _slow_pwrites(monkeypatch, started)
    writer = threading.Thread(target=lambda: w.write("a", np.zeros(4, np.float32)))
    writer.start()
    assert started.wait(10)
    errors: list[BaseException] = []

    def finish(how: str) -> None:
        try:
            getattr(w, how)()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    others = [threading.Thread(target=finish, args=(how,)) for how in ("close", "close")]
    for t in others:
        t.start()
    writer.join()
    for t in others:
        t.join()
    assert errors == [] and w.closed
    assert load_file(str(tmp_path / "x.safetensors"))["a"].tolist() == [0.0] * 4


@pytest.mark.parametrize(
    "declared",
    [[("a", "F32")], [(["a"], "F32", (3,))], ["abc"], [("a", "F32", (2,), "x")], 5, None, "abc"],
)
def test_malformed_declaration_lists_are_serialize_errors(tmp_path: Path, declared: Any) -> None:
    # They raised ValueError/TypeError from unpacking, or read "abc" as a declaration of `a`.
    for make in (StreamingWriter, ShardedStreamingWriter):
        with pytest.raises(SerializeError) as info:
            make(tmp_path / "out", declared)
        assert info.value.kind == "TensorInvalidInfo"
    assert os.listdir(tmp_path) == []


def test_declarations_refuse_none_dtypes_and_non_str_names(tmp_path: Path) -> None:
    # np.dtype(None) is float64: a missing dtype silently declared an F64 tensor.
    with pytest.raises(SerializeError, match="None is not a dtype") as info:
        StreamingWriter(tmp_path / "n.safetensors", {"a": (None, (2,))})
    assert info.value.kind == "UnknownDtype"
    with pytest.raises(SerializeError, match="tensor names are str"):
        StreamingWriter(tmp_path / "n.safetensors", {1: ("F32", (2,))})
    assert os.listdir(tmp_path) == []


def test_meta_tensors_declare_dtype_and_shape(tmp_path: Path) -> None:
    # Declaring reads no data, so a meta tensor (a model built on the meta device) declares
    # its tensor; it failed with "Cannot copy out of meta tensor".
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.safetensors"
    with StreamingWriter(path, {"m": torch.empty(3, 4, dtype=torch.bfloat16, device="meta")}) as w:
        w.write("m", torch.ones(3, 4, dtype=torch.bfloat16))
    from pysafetensors.torch import load_file as load_torch

    assert torch.equal(load_torch(path)["m"], torch.ones(3, 4, dtype=torch.bfloat16))


def test_a_file_where_the_folder_should_be_is_a_write_error(tmp_path: Path) -> None:
    from pysafetensors import WriteError, save_sharded

    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(WriteError, match="afile"):
        ShardedStreamingWriter(tmp_path / "afile", {"a": ("F32", (2,))})
    with pytest.raises(WriteError, match="afile"):
        save_sharded({"a": np.zeros(2, np.float32)}, tmp_path / "afile")


def test_packed_meta_tensors_declare_their_logical_shape(tmp_path: Path) -> None:
    # float4_e2m1fn_x2 holds two values per element: a meta tensor of it was declared at half
    # its size, and writing the real tensor then overran the declaration.
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    path = tmp_path / "f4.safetensors"
    meta = torch.empty(3, 4, dtype=torch.float4_e2m1fn_x2, device="meta")
    real = torch.zeros(3, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with StreamingWriter(path, {"x": meta}) as w:
        assert [(t.dtype.code, t.shape) for t in w.layout.tensors] == [("F4", (3, 8))]
        w.write("x", real)
    # (torch dtype, torch shape) declares what the meta tensor does (it was F4 [3, 4], and
    # the tensor's 12 bytes overran it); a code's shape is the file's.
    for declared, shape in (((real.dtype, (3, 4)), (3, 8)), (("F4", (3, 8)), (3, 8))):
        with StreamingWriter(path, [("x", *declared)]) as w:
            assert [t.shape for t in w.layout.tensors] == [shape]
            w.write_tensor("x", real)


def test_a_forked_child_leaves_its_parents_writer_alone(tmp_path: Path) -> None:
    # At exit a child aborted the writers it inherited (atexit, or their finalizers), deleting
    # the parent's temporary file: the parent's close() then failed.
    script = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        from pysafetensors import StreamingWriter
        w = StreamingWriter({str(tmp_path / "p.safetensors")!r}, {{"a": ("F32", (2,))}})
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit handlers and finalizers run
        os.waitpid(pid, 0)
        w.write("a", np.ones(2, np.float32))
        w.close()
        print("closed")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "closed", run.stderr
    assert load_file(tmp_path / "p.safetensors")["a"].tolist() == [1.0, 1.0]


def test_a_declaration_of_more_than_64_dimensions_is_refused(tmp_path: Path) -> None:
    """The file committed, and then no framework could load the tensor (ours refused it)."""
    target = tmp_path / "deep.safetensors"
    with pytest.raises(SerializeError, match="65 dimensions") as info:
        StreamingWriter(target, {"x": ("F32", [1] * 65)})
    assert info.value.kind == "TooManyDimensions" and info.value.tensor == "x"
    assert list(tmp_path.iterdir()) == []
    with StreamingWriter(target, {"x": ("F32", [1] * 64)}) as w:
        w.write("x", b"\0\0\0\0")
    with safe_open(target, "np") as f:
        assert f.get_tensor("x").ndim == 64


def test_an_abandoned_sharded_writer_leaves_no_finished_shard_behind(tmp_path: Path) -> None:
    """A shard whose last byte was written waits in the writer's group as a temporary file; a
    sharded writer left open at exit (or dropped) aborted its open shards only, and the finished
    ones stayed in the folder as hidden ``.partial`` files, as large as the shards."""
    script = textwrap.dedent(
        """
        import sys
        from pysafetensors import ShardedStreamingWriter
        decls = {"a": ("U8", (300,)), "b": ("U8", (300,))}
        w = ShardedStreamingWriter(sys.argv[1], decls, max_shard_size=300)
        w.write("a", b"x" * 300)  # shard 1 finished
        w.write("b", b"y" * 10)  # shard 2 begun
        print("left open")
        """
    )
    out = tmp_path / "at-exit"
    run = subprocess.run(
        [sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "left open", run.stderr
    assert not out.exists()  # made by the writer, and empty again

    dropped = tmp_path / "dropped"
    w = ShardedStreamingWriter(dropped, {"a": ("U8", (300,)), "b": ("U8", (300,))}, 300)
    w.write("a", b"x" * 300)
    assert [p.name.endswith(".partial") for p in dropped.iterdir()] == [True]
    del w
    assert not dropped.exists()


@pytest.mark.parametrize("declared", [("F99", (2,)), ("int128", (2,)), (np.dtype("M8[s]"), (2,))])
def test_an_unknown_declared_dtype_names_its_tensor(tmp_path: Path, declared: Any) -> None:
    """An array of an unknown dtype named its tensor; a (dtype, shape) declaration did not
    (``Unknown dtype "F99"``, and no tensor among however many were declared)."""
    decls = {"fine": ("F32", (1,)), "bad.weight": declared}
    for writer in (StreamingWriter, ShardedStreamingWriter):
        with pytest.raises(
            SerializeError, match=r"Unknown dtype .*\(tensor `bad\.weight`\)"
        ) as info:
            writer(tmp_path / "out.safetensors", decls)
        assert (info.value.kind, info.value.tensor) == ("UnknownDtype", "bad.weight")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("limit", "metadata", "error"),
    [
        (100, {b"k": "v"}, "keys must be str"),  # into the index
        (10**9, {"k": None}, "'None' is not an instance of 'str'"),  # into the single file
        (10**9, {"k": 1}, "'int' object is not an instance of 'str'"),
    ],
)
def test_sharded_writer_refuses_metadata_it_cannot_write_at_once(
    tmp_path: Path, limit: int, metadata: Any, error: str
) -> None:
    """Metadata the commit could not write was taken: every byte was streamed, then close()
    failed writing the index and discarded the whole checkpoint (or, for a single file, the
    first write failed)."""
    folder = tmp_path / "out"
    decls = {"a": ("U8", (100,)), "b": ("U8", (100,))}
    with pytest.raises(TypeError, match=error):
        ShardedStreamingWriter(folder, decls, limit, metadata=metadata)
    assert not folder.exists()


def test_an_empty_buffer_with_a_zero_in_its_shape_is_an_empty_write(tmp_path: Path) -> None:
    """memoryview cannot cast a view with a 0 in its shape to bytes: the buffer of an empty
    2-D array (``memoryview(np.zeros((0, 3)))``) raised a bare TypeError, also to
    ``write_tensor`` of the empty tensor it is."""
    empty = memoryview(np.zeros((0, 3), np.uint8))
    target = tmp_path / "e.safetensors"
    with StreamingWriter(target, {"e": ("U8", (0, 3)), "w": ("F32", (2,))}) as w:
        assert w.write_tensor("e", empty) == 0
        assert w.write_chunk("w", empty) == 0
        with pytest.raises(SerializeError, match="outside tensor `w`"):
            w.write("w", empty, offset=12)
        w.write_tensor("w", np.ones(2, np.float32))
    save_file({"e": np.zeros((0, 3), np.uint8), "w": np.ones(2, np.float32)}, tmp_path / "r")
    assert target.read_bytes() == (tmp_path / "r").read_bytes()


@pytest.mark.parametrize("sharded", [False, True])
def test_numpy_integer_offsets_are_taken(tmp_path: Path, sharded: bool) -> None:
    # Offsets computed with numpy (np.cumsum of part sizes) are np.int64: they were refused
    # as "must be an int, got int64", while shapes took numpy integers.
    parts = [np.arange(n, dtype=np.float32) + 100 * n for n in (3, 5, 2)]
    offsets = np.cumsum([0] + [p.nbytes for p in parts])[:-1]
    target = tmp_path / ("ckpt" if sharded else "out.safetensors")
    writer = (
        ShardedStreamingWriter(target, {"t": ("F32", [10])}, max_shard_size=1000)
        if sharded
        else StreamingWriter(target, {"t": ("F32", [10])})
    )
    with writer as w:
        for part, at in reversed(list(zip(parts, offsets, strict=True))):
            w.write("t", part, at)
        for bad in (np.True_, True, 4.0, np.float64(4)):
            with pytest.raises(SerializeError, match="offset of a write to `t` must be an int"):
                w.write("t", b"", bad)
    assert np.array_equal(load_file(target)["t"], np.concatenate(parts))


def test_a_producer_that_yields_too_few_bytes_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write counted its whole range as written once its chunks ran out, however many bytes
    they held: a short producer would leave a hole in a committed file."""
    from pysafetensors import _streaming

    real = _streaming._payload

    def short(*args: Any) -> Any:
        length, chunks = real(*args)
        return length, [next(iter(chunks))[:4]]

    w = StreamingWriter(tmp_path / "m.safetensors", {"a": ("U8", (8,))})
    monkeypatch.setattr(_streaming, "_payload", short)
    with pytest.raises(SerializeError, match="4 of 8 bytes of tensor `a` were produced"):
        w.write("a", bytes(range(8)))
    assert w.missing() == {"a": 8}
    w.abort()
