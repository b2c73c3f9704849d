"""What a streaming writer's commit does when it fails, races another close, or an abort."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import (
    ClosedFileError,
    SafetensorError,
    SerializeError,
    ShardedStreamingWriter,
    StreamingWriter,
    WriteError,
)
from pysafetensors.numpy import load_file

#: One 400-byte tensor per shard under a 400-byte limit: three shards.
SD = {f"l{i}": np.full(100, i, np.float32) for i in range(3)}


def _fsync_failing_on(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Make the ``call``-th ``os.fsync`` from now fail as a disk's I/O error would."""
    real = os.fsync
    calls = [0]

    def fsync(fd: int) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _slow_fsync_in_workers(
    monkeypatch: pytest.MonkeyPatch, entered: threading.Event, fail: bool = False
) -> None:
    """fsync on threads other than the main one signals ``entered`` and takes a while (a large
    shard's durable commit), then fails with ``fail``."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            time.sleep(0.3)
            if fail:
                raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _in_thread(do: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            do()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("earlier_save", [False, True])
def test_a_shard_whose_commit_fails_fails_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier_save: bool
) -> None:
    """The shard's writer was closed, its temporary file gone, its bytes recorded as written:
    a retry was an overlap, missing() said nothing was, and close() committed the checkpoint
    without the shard (or, over an earlier save, with that save's file of its name, which
    loaded without error and held the old values)."""
    folder = tmp_path / "ckpt"
    if earlier_save:
        with ShardedStreamingWriter(folder, SD, 400) as w:
            for name, values in SD.items():
                w.write_tensor(name, -values)
    before = {p.name: p.read_bytes() for p in folder.iterdir()} if earlier_save else {}
    w = ShardedStreamingWriter(folder, SD, 400, fsync=True)
    w.write_tensor("l0", SD["l0"])
    _fsync_failing_on(monkeypatch, 1)  # the second shard's, as its last byte is written
    with pytest.raises(WriteError, match="Input/output error"):
        w.write_tensor("l1", SD["l1"])
    monkeypatch.undo()
    with pytest.raises(ClosedFileError, match="00002-of-00003.safetensors.: committing it failed"):
        w.write_tensor("l1", SD["l1"])  # its bytes cannot be written again
    w.write_tensor("l2", SD["l2"])
    with pytest.raises(ClosedFileError, match="could not be committed"):
        w.close()
    w.abort()
    after = {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}
    assert after == before


def test_a_close_waits_for_a_shard_another_thread_is_committing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard's writer counted as closed from the start of its commit: a close() meanwhile
    committed the index without it, and the worker's commit then found the group finished."""
    folder = tmp_path / "ckpt"
    w = ShardedStreamingWriter(folder, SD, 400, fsync=True)
    w.write_tensor("l0", SD["l0"])
    w.write_tensor("l2", SD["l2"])
    entered = threading.Event()
    _slow_fsync_in_workers(monkeypatch, entered)
    errors: list[BaseException] = []
    worker = _in_thread(lambda: w.write_tensor("l1", SD["l1"]), errors)
    assert entered.wait(10)
    w.close()
    worker.join()
    assert errors == []
    assert {k: v.tolist() for k, v in load_file(str(folder)).items()} == {
        k: v.tolist() for k, v in SD.items()
    }


def test_a_second_close_reports_the_first_one_s_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It returned at once, as if committed, before the first close's commit failed."""
    target = tmp_path / "x.safetensors"
    w = StreamingWriter(target, {"x": ("U8", (4,))}, fsync=True)
    w.write("x", b"1234")
    entered = threading.Event()
    _slow_fsync_in_workers(monkeypatch, entered, fail=True)
    errors: list[BaseException] = []
    first = _in_thread(w.close, errors)
    assert entered.wait(10)
    with pytest.raises(ClosedFileError, match="committing it failed earlier"):
        w.close()
    first.join()
    assert [type(e) for e in errors] == [WriteError]
    assert not target.exists()
    assert os.listdir(tmp_path) == []


def test_close_after_an_abort_or_a_failed_close_says_nothing_was_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = StreamingWriter(tmp_path / "a.safetensors", {"x": ("U8", (4,))}, fsync=True)
    w.write("x", b"1234")
    _fsync_failing_on(monkeypatch, 1)
    with pytest.raises(WriteError):
        w.close()
    monkeypatch.undo()
    with pytest.raises(ClosedFileError, match="committing it failed earlier"):
        w.close()
    w.abort()  # nothing left to discard
    for make in (
        lambda: StreamingWriter(tmp_path / "b.safetensors", {"x": ("U8", (4,))}),
        lambda: ShardedStreamingWriter(tmp_path / "c", SD, 400),
    ):
        writer = make()
        writer.abort()
        with pytest.raises(ClosedFileError, match="was aborted"):
            writer.close()
    committed = StreamingWriter(tmp_path / "d.safetensors", {"x": ("U8", (4,))})
    committed.write("x", b"1234")
    committed.close()
    committed.close()  # a commit is not repeated, nor refused
    committed.abort()  # nor undone
    assert load_file(str(tmp_path / "d.safetensors"))["x"].tolist() == [49, 50, 51, 52]
    assert sorted(os.listdir(tmp_path)) == ["d.safetensors"]


def test_an_abort_racing_writes_to_new_shards_leaves_nothing(tmp_path: Path) -> None:
    """A worker that had passed the closed check began a shard while abort() went through
    the shard writers: RuntimeError (dictionary changed size), the group never discarded, and
    the finished shards' temporary files stayed on disk."""
    names = [f"t{i:04d}" for i in range(200)]
    for trial in range(12):
        folder = tmp_path / f"ckpt{trial}"
        w = ShardedStreamingWriter(folder, {n: ("U8", (64,)) for n in names}, 64)

        def worker(k: int, w: ShardedStreamingWriter = w) -> None:
            for name in names[k::4]:
                try:
                    w.write(name, bytes(64))
                except ClosedFileError:
                    return  # aborted (a shard committing meanwhile too: see the next test)

        workers = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in workers:
            t.start()
        time.sleep(0.001 * trial)
        w.abort()
        for t in workers:
            t.join()
        assert not folder.exists() or os.listdir(folder) == [], trial


def test_a_with_block_left_after_an_abort_inside_it_is_quiet(tmp_path: Path) -> None:
    # close() after abort() raises; leaving the with block normally after a deliberate
    # abort() inside it must not.
    with StreamingWriter(tmp_path / "x.safetensors", {"x": ("U8", (4,))}) as w:
        w.abort()
    with ShardedStreamingWriter(tmp_path / "d", SD, 400) as s:
        s.write_tensor("l0", SD["l0"])
        s.abort()
    assert os.listdir(tmp_path) == []


def test_a_misaligned_array_outside_the_tensor_is_out_of_range(tmp_path: Path) -> None:
    with StreamingWriter(tmp_path / "x.safetensors", {"x": ("F32", (4,))}) as w:
        for offset in (-2, 1001):
            with pytest.raises(SerializeError) as info:
                w.write("x", np.zeros(1, np.float32), offset=offset)
            assert info.value.kind == "OutOfRange"
        w.write("x", np.zeros(4, np.float32))


def test_a_failed_write_names_its_tensor_and_offsets(tmp_path: Path) -> None:
    """A file size limit (as a full disk) reached by a write: it named only the file."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pysafetensors import StreamingWriter, WriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        w = StreamingWriter({str(tmp_path / "x.safetensors")!r},
                            {{"head": ("U8", (100,)), "big": ("U8", (1 << 20,))}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            w.write("big", bytes(8192), offset=8192)
        except WriteError as exc:
            print(exc.tensor, exc.errno, "|".join(getattr(exc, "__notes__", [])))
        w.abort()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    tensor, code, note = out.split(" ", 2)
    assert (tensor, int(code)) == ("big", errno.EFBIG)
    assert note.startswith("while writing bytes [8192, 16384) of tensor `big` (file offset ")
    assert os.listdir(tmp_path) == []


def test_total_sizes_past_the_largest_file_are_refused_at_once(tmp_path: Path) -> None:
    # Each size fits in 64 bits, their sum does not (offsets no reader can parse), or the file
    # would pass the largest file offset: a bare OverflowError naming nothing.
    with pytest.raises(SerializeError, match="overflow computing the data offsets") as info:
        StreamingWriter(tmp_path / "x", {f"t{i:02d}": ("U8", (2**60,)) for i in range(16)})
    assert (info.value.kind, info.value.tensor) == ("ValidationOverflow", "t15")
    with pytest.raises(WriteError, match="File too large") as too_large:
        StreamingWriter(tmp_path / "x", {f"t{i:02d}": ("U8", (2**60,)) for i in range(8)})
    assert too_large.value.errno == errno.EFBIG
    assert os.listdir(tmp_path) == []


def test_an_array_written_inside_an_element_is_refused(tmp_path: Path) -> None:
    """An offset in elements where bytes are meant: committed with every value garbled."""
    values = np.arange(4, dtype=np.float32)
    with StreamingWriter(tmp_path / "x.safetensors", {"x": ("F32", (8,))}) as w:
        with pytest.raises(SerializeError, match="byte offset 2, which is not a multiple") as e:
            w.write("x", values, offset=2)
        assert (e.value.kind, e.value.tensor) == ("MisalignedSlice", "x")
        w.write("x", values, offset=16)
        w.write("x", values.tobytes()[:6])  # raw bytes may be cut anywhere
        w.write("x", values.tobytes()[6:], offset=6)
    assert load_file(str(tmp_path / "x.safetensors"))["x"].tolist() == [0, 1, 2, 3] * 2


def test_a_shard_finished_while_the_checkpoint_is_aborted_says_it_was_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write that finishes a shard hands it to the checkpoint's group; an abort() on
    another thread in between finished the group first, and the write failed with the group's
    own SerializeError ("the save group is already finished") instead of the error every
    other write after an abort gets."""
    folder = tmp_path / "d"
    w = ShardedStreamingWriter(folder, {"a": ("U8", (64,)), "b": ("U8", (64,))}, 64)
    group_type = type(w._group)
    hand_over = group_type._add

    def aborted_first(self: Any, tmp: str, target: str, fd: int) -> None:
        other = threading.Thread(target=w.abort)
        other.start()
        other.join()
        hand_over(self, tmp, target, fd)

    monkeypatch.setattr(group_type, "_add", aborted_first)
    with pytest.raises(ClosedFileError, match="abort") as info:
        w.write("a", bytes(64))
    assert info.value.kind == "FileClosed"
    monkeypatch.undo()
    assert not folder.exists() or os.listdir(folder) == []
    with pytest.raises(ClosedFileError):
        w.write("b", bytes(64))


def test_a_shard_header_too_large_is_refused_when_the_writer_opens(tmp_path: Path) -> None:
    # It was refused only at the first write to that shard, after the rest had been streamed.
    decls = {f"t{i}": ("U8", (1,)) for i in range(4)}
    with pytest.raises(SerializeError, match="header too large") as info:
        ShardedStreamingWriter(tmp_path / "d", decls, metadata={"k": "v" * 100_000_100})
    assert info.value.kind == "HeaderTooLarge"
    assert not (tmp_path / "d").exists()
    assert isinstance(info.value, SafetensorError)


def test_shards_whose_headers_fit_are_accepted_whatever_their_sum(tmp_path: Path) -> None:
    # Each shard's header is held to the limit, as save_sharded holds it; the declarations
    # laid out as one file (for their sizes) were held to it too, and refused a checkpoint of
    # 20,000 long names whose headers together pass 100 MB.
    names = [f"{i:06d}" + "x" * 5000 for i in range(20_000)]
    w = ShardedStreamingWriter(tmp_path / "d", {n: ("U8", (1,)) for n in names}, 2000)
    try:
        assert len(w.plan.filename_to_tensors) == 10
        assert sum(len(layout.header) for layout in w._layouts.values()) > 100_000_000
    finally:
        w.abort()
    with pytest.raises(SerializeError, match="header too large"):
        ShardedStreamingWriter(tmp_path / "e", {n: ("U8", (1,)) for n in names}, 10**9)


def test_an_interrupt_late_in_close_leaves_nothing_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing after the commit, in close()'s clean-up, left the writer "closing"
    for ever: the with block's abort(), atexit's and any later close() waited on it."""
    from pysafetensors import _streaming

    w = StreamingWriter(tmp_path / "x.safetensors", {"a": ("F32", (4,))})
    w.write("a", np.arange(4, dtype=np.float32))
    real = _streaming._OPEN_WRITERS.discard

    def interrupted(item: object) -> None:
        monkeypatch.setattr(_streaming._OPEN_WRITERS, "discard", real)
        raise KeyboardInterrupt("a Ctrl-C")

    monkeypatch.setattr(_streaming._OPEN_WRITERS, "discard", interrupted)
    errors: list[BaseException] = []

    def leave_with_block() -> None:
        with w:
            pass

    thread = _in_thread(leave_with_block, errors)
    thread.join(10)
    assert not thread.is_alive(), "the with block hung"
    assert [type(e) for e in errors] == [KeyboardInterrupt]
    later = _in_thread(w.close, errors)
    later.join(10)
    assert not later.is_alive(), "a later close() hung"
    assert w.committed and len(errors) == 1
    assert load_file(str(tmp_path / "x.safetensors"))["a"].tolist() == [0, 1, 2, 3]


def test_a_ctrl_c_on_any_call_of_the_settling_step_frees_the_lock(tmp_path: Path) -> None:
    """A real Ctrl-C raised at the start of each Python call close() makes while recording
    its outcome: one in the condition's ``__exit__`` left the writer's lock held for good,
    so the with block's abort() and the exit handler's waited for ever."""
    script = textwrap.dedent(
        """
        import os, signal, sys
        import numpy as np
        from pysafetensors import StreamingWriter, _streaming

        n = int(sys.argv[2])
        w = StreamingWriter(sys.argv[1], {"x": ("F32", (4,))})
        w.write("x", np.arange(4, dtype=np.float32))
        seen = [0]

        def hook(frame, event, arg):
            caller = frame.f_back
            if event == "call" and caller and caller.f_code is _streaming._settle.__code__:
                seen[0] += 1
                if seen[0] == n:
                    sys.setprofile(None)
                    os.kill(os.getpid(), signal.SIGINT)  # raised as the call starts

        sys.setprofile(hook)
        try:
            w.close()
        except KeyboardInterrupt:
            pass
        sys.setprofile(None)
        free = w._lock.acquire(timeout=5)
        if free:
            w._lock.release()
        w.abort()
        print(seen[0] >= n, free, w.committed)
        """
    )
    target = tmp_path / "x.safetensors"
    for n in (1, 2, 3):
        done = subprocess.run(
            [sys.executable, "-c", script, str(target), str(n)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        reached, free, committed = done.stdout.split()
        assert (free, committed) == ("True", "True"), (n, done.stdout)
        if n == 1:
            assert reached == "True"  # at least one Python call there to land in
        assert load_file(str(target))["x"].tolist() == [0, 1, 2, 3]
        target.unlink()


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """Make ``owner.name`` do its work, then take a real Ctrl-C (SIGINT) as it returns."""
    import signal

    real = getattr(owner, name)

    def then_interrupted(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(owner, name, real)
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(owner, name, then_interrupted)


def test_a_ctrl_c_held_over_the_rename_leaves_the_writer_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename holds a Ctrl-C until the file is in place, then raises it: close() recorded
    that as a failed commit, and a second close() said nothing was written in its place."""
    from pysafetensors import _writer

    w = StreamingWriter(tmp_path / "x.safetensors", {"a": ("F32", (4,))})
    w.write("a", np.arange(4, dtype=np.float32))
    _interrupt_after(monkeypatch, _writer.os, "replace")
    with pytest.raises(KeyboardInterrupt):
        w.close()
    assert w.committed
    w.close()  # settled as committed: returns
    w.abort()  # and is not undone
    assert load_file(str(tmp_path / "x.safetensors"))["a"].tolist() == [0, 1, 2, 3]


def test_a_ctrl_c_held_over_a_shards_hand_over_keeps_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished shard handed to the group as a Ctrl-C came was marked failed: the
    checkpoint's close() then refused it (its bytes "lost") though they were in the group."""
    from pysafetensors import _writer

    w = ShardedStreamingWriter(
        tmp_path / "ck", {"a": ("F32", (4,)), "b": ("F32", (4,))}, max_shard_size=16
    )
    _interrupt_after(monkeypatch, _writer.SaveGroup, "_add")
    with pytest.raises(KeyboardInterrupt):
        w.write("a", np.ones(4, np.float32))  # its shard's last byte: handed over
    w.write("b", np.full(4, 2, np.float32))
    w.close()
    got = {
        k: v.tolist()
        for f in sorted((tmp_path / "ck").glob("*.safetensors"))
        for k, v in load_file(str(f)).items()
    }
    assert got == {"a": [1, 1, 1, 1], "b": [2, 2, 2, 2]}
    assert not list((tmp_path / "ck").glob(".*.partial"))


def test_a_ctrl_c_after_a_checkpoints_renames_leaves_it_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file renamed, then a Ctrl-C in the clean-up of an earlier save's files: the
    checkpoint was settled as failed, and a second close() said so."""
    from pysafetensors import _sharding

    w = ShardedStreamingWriter(tmp_path / "ck", {"a": ("F32", (4,))})
    w.write("a", np.ones(4, np.float32))
    real = _sharding.remove_stale_files

    def interrupted(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(_sharding, "remove_stale_files", real)
        raise KeyboardInterrupt("a Ctrl-C")

    monkeypatch.setattr(_sharding, "remove_stale_files", interrupted)
    assert not w.committed
    with pytest.raises(KeyboardInterrupt):
        w.close()
    assert w.committed  # as a file's writer says (the sharded one had no such property)
    w.close()  # committed: returns
    w.abort()
    assert load_file(str(tmp_path / "ck" / "model.safetensors"))["a"].tolist() == [1] * 4
