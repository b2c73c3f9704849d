"""Sharded saves at their limits: thousands of shards under a small descriptor limit, a
single file replacing a sharded checkpoint when the clean-up is cut short, an interrupt at
any line of a streaming write, leftovers of crashed saves, other indexes sharing shards, the
hub's numeric shard sizes, and loading many shards."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pysafetensors._sharding as sharding
import pysafetensors._streaming as streaming
from pysafetensors import (
    MissingShardError,
    ShardIndexError,
    StaleFileWarning,
    StreamingWriter,
    reshard,
    safe_open,
    save_sharded,
)
from pysafetensors.numpy import load_file, save_file


def _tensors(n: int, size: int = 1000) -> dict[str, np.ndarray]:
    return {f"t{i}": np.full(size, i, np.float32) for i in range(n)}


def test_thousands_of_shards_under_a_small_descriptor_limit(tmp_path: Path) -> None:
    # Soft and hard limit 256: past the budget, finished shards give up their descriptors.
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        import numpy as np
        from pysafetensors import save_sharded
        from pysafetensors.numpy import load_file
        state = {{f"t{{i}}": np.full(1000, i, np.float32) for i in range(600)}}
        plan = save_sharded(state, {str(tmp_path)!r}, max_shard_size="4KB")
        assert len(plan.filename_to_tensors) == 600
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    loaded = load_file(tmp_path)
    assert all(float(loaded[k][0]) == float(v[0]) for k, v in _tensors(600).items())


def test_a_streamed_save_of_many_shards_under_a_small_descriptor_limit(tmp_path: Path) -> None:
    # Every shard begun kept its descriptor until close(): 100 shards written one after
    # another failed at the 28th under a hard limit of 30. A shard whose every byte is written
    # is handed to the save's group at once, which keeps it closed past its budget.
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (30, 30))
        import numpy as np
        from pysafetensors import ShardedStreamingWriter
        shapes = {{f"t{{i}}": ("F32", (1000,)) for i in range(100)}}
        with ShardedStreamingWriter({str(tmp_path)!r}, shapes, max_shard_size="4KB") as w:
            assert len(w.plan.filename_to_tensors) == 100
            for i in range(100):
                w.write_chunk(f"t{{i}}", np.full(500, i, np.float32))
                w.write_chunk(f"t{{i}}", np.full(500, i, np.float32))
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    loaded = load_file(tmp_path)
    assert all(float(loaded[f"t{i}"][999]) == i for i in range(100))


def test_writes_to_a_streamed_shard_already_complete(tmp_path: Path) -> None:
    # Handed over when its last byte is written: an empty write to it still passes (a loop
    # that writes every tensor, empty ones too), others get the errors they always got.
    from pysafetensors import SerializeError, ShardedStreamingWriter

    shapes = {"a": ("F32", (4,)), "e": ("F32", (0,)), "b": ("F32", (300,))}
    with ShardedStreamingWriter(tmp_path, shapes, max_shard_size=1000) as w:
        assert (
            w.plan.tensor_to_filename["a"]
            == w.plan.tensor_to_filename["e"]
            != (w.plan.tensor_to_filename["b"])
        )
        w.write_tensor("a", np.ones(4, np.float32))
        assert w.write_tensor("e", np.ones(0, np.float32)) == 0
        assert w.write_chunk("a", b"") == 0
        with pytest.raises(SerializeError, match="overlaps bytes") as info:
            w.write("a", np.ones(1, np.float32))
        assert info.value.kind == "Overlap"
        with pytest.raises(SerializeError, match="outside tensor `a`"):
            w.write("a", b"", 99)
        with pytest.raises(SerializeError, match="declared F32"):
            w.write("a", np.ones(1, np.int32))
        with pytest.raises(SerializeError, match="must be an int"):
            w.write("a", b"", 1.5)  # type: ignore[arg-type]
        assert w.missing() == {"b": 1200}
        w.write_tensor("b", np.arange(300, dtype=np.float32))
    loaded = load_file(tmp_path)
    assert loaded["e"].shape == (0,) and np.array_equal(loaded["b"], np.arange(300))


def test_a_finished_shard_keeps_the_append_cursor_as_an_open_one(tmp_path: Path) -> None:
    # An empty write moves the write_chunk cursor; on a shard already handed over it did not,
    # and the next append was an "overlap" where an open writer says "outside tensor".
    from pysafetensors import SerializeError, ShardedStreamingWriter, StreamingWriter

    decl = {"t": ("U8", (8,)), "u": ("U8", (8,))}
    errors = []
    for make in (
        lambda: ShardedStreamingWriter(tmp_path / "s", decl, max_shard_size=8),
        lambda: StreamingWriter(tmp_path / "f.safetensors", decl),
    ):
        w = make()
        w.write("t", b"\0" * 4, 4)
        w.write("t", b"\0" * 4, 0)
        assert w.write("t", b"", 8) == 0
        with pytest.raises(SerializeError) as info:
            w.write_chunk("t", b"x")
        errors.append((info.value.kind, str(info.value)))
        w.abort()
    assert errors[0] == errors[1] and errors[0][0] == "OutOfRange"


def test_write_tensor_refuses_a_part(tmp_path: Path) -> None:
    # A part was taken as a write at 0, and the tensor reported missing bytes only at close.
    from pysafetensors import SerializeError, ShardedStreamingWriter, StreamingWriter

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    for w in (
        StreamingWriter(tmp_path / "f.safetensors", {"a": a}),
        ShardedStreamingWriter(tmp_path / "s", {"a": a, "b": a}, max_shard_size=48),
    ):
        with pytest.raises(SerializeError, match=r"holds 16 bytes but F32 \[3, 4\] needs 48"):
            w.write_tensor("a", a[:1])
        w.write_tensor("a", a)
        with pytest.raises(SerializeError, match="holds 16 bytes"):  # a finished shard too
            w.write_tensor("a", a[:1])
        w.abort()


def test_an_aborted_sharded_stream_removes_the_folder_it_made(tmp_path: Path) -> None:
    from pysafetensors import ShardedStreamingWriter

    decl = {"t": ("U8", (8,))}
    with pytest.raises(RuntimeError), ShardedStreamingWriter(tmp_path / "new" / "sub", decl) as w:
        w.write("t", b"\0" * 4)
        raise RuntimeError("stop")
    # Its parent too, which it made (it was left behind, empty).
    assert os.listdir(tmp_path) == []
    # A parent something else came into while it wrote stays.
    writer = ShardedStreamingWriter(tmp_path / "a" / "b" / "c", decl)
    (tmp_path / "a" / "other.txt").write_text("x")
    writer.abort()
    assert os.listdir(tmp_path / "a") == ["other.txt"]
    (tmp_path / "kept").mkdir()
    ShardedStreamingWriter(tmp_path / "kept", decl).abort()
    assert (tmp_path / "kept").is_dir()  # it was there before


def test_hundreds_of_shards_load_under_a_small_descriptor_limit(tmp_path: Path) -> None:
    # Every shard opened stayed open until the handle closed: load_file of 600 shards ran out
    # of descriptors under a limit of 256 (and of 1,500 under the common 1,024). Now load_file
    # closes each shard once read, and a handle that keeps them raises the soft limit.
    save_sharded(_tensors(600), tmp_path, max_shard_size="4KB")
    checks = {
        (256, 256): f"""
            from pysafetensors.numpy import load_file
            assert len(load_file({str(tmp_path)!r})) == 600
            assert len(load_file({str(tmp_path)!r}, backend="pread")) == 600
            """,
        (256, 4096): f"""
            from pysafetensors import safe_open
            with safe_open({str(tmp_path)!r}, "np", backend="pread") as f:
                assert sorted(int(f.get_tensor(k)[0]) for k in f.keys()) == list(range(600))
            """,
    }
    for limits, check in checks.items():
        code = f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, {limits})\n"
        code += textwrap.dedent(check) + "print('ok')\n"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and out.stdout.strip() == "ok", (limits, out.stderr[-2000:])


def test_a_single_file_replacing_shards_wins_even_if_clean_up_is_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_sharded(_tensors(3), tmp_path, max_shard_size="4KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    new = {k: v + 100 for k, v in _tensors(3).items()}

    def interrupted(path: str) -> None:
        raise KeyboardInterrupt  # the first deletion of the clean-up

    monkeypatch.setattr(sharding.os, "remove", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(new, tmp_path, max_shard_size="1GB")
    monkeypatch.undo()
    # The old index went before the new file was renamed in: the folder opens as the new save.
    assert not (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_file(tmp_path)
    assert all(np.array_equal(loaded[k], v) for k, v in new.items())


def _write_lines() -> list[int]:
    source, start = inspect.getsourcelines(streaming.StreamingWriter._write_payload)
    # From the write's taking of the lock on: every line where an interrupt could land.
    body = next(i for i, line in enumerate(source) if "self._lock" in line)
    return [start + i for i in range(body, len(source)) if source[i].strip()]


@pytest.mark.parametrize("line", _write_lines())
def test_an_interrupt_at_any_line_of_a_write_leaves_the_writer_closable(
    tmp_path: Path, line: int
) -> None:
    code = streaming.StreamingWriter._write_payload.__code__  # write()'s work, after checks
    fired = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None

        def local(f: Any, ev: str, a: Any) -> Any:
            if ev == "line" and f.f_lineno == line and not fired:
                fired.append(line)
                raise KeyboardInterrupt  # as if Ctrl-C arrived right here
            return local

        return local

    path = tmp_path / "x.safetensors"
    outcome: list[str] = []

    def run() -> None:
        try:
            with StreamingWriter(path, {"w": ("F32", (4,))}) as w:
                sys.settrace(tracer)
                try:
                    w.write("w", np.arange(4, dtype=np.float32))
                finally:
                    sys.settrace(None)
            outcome.append("closed")
        except KeyboardInterrupt:
            outcome.append("interrupted")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), f"close/abort hung after an interrupt at line {line}"
    if outcome == ["closed"]:  # the line was not reached, or came after the write's work
        assert np.array_equal(load_file(path)["w"], np.arange(4, dtype=np.float32))
    else:
        assert outcome == ["interrupted"] and not path.exists()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_crashed_saves_leave_no_temporary_files_behind(tmp_path: Path) -> None:
    save_sharded(_tensors(4), tmp_path, max_shard_size="4KB")
    # What a save killed before its commit leaves: hidden temporary files of its shards.
    stale = tmp_path / ".model-00003-of-00004.safetensors.0123456789ab.partial"
    stale.write_bytes(b"x" * 100)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    young = tmp_path / ".model-00004-of-00004.safetensors.ba9876543210.partial"
    young.write_bytes(b"x")  # perhaps a live save on a file system without locks: kept
    save_sharded(_tensors(2), tmp_path, max_shard_size="4KB")
    assert not stale.exists() and young.exists()


def test_reshard_in_place_spares_shards_another_index_uses(tmp_path: Path) -> None:
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": np.ones(4, np.float32)}, str(tmp_path / "s2.safetensors"))
    index = {
        "metadata": {"total_size": 32},
        "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    encoder = {"metadata": {"total_size": 16}, "weight_map": {"a": "s1.safetensors"}}
    (tmp_path / "encoder.safetensors.index.json").write_text(json.dumps(encoder))
    reshard(
        tmp_path / "model.safetensors.index.json",
        tmp_path,
        20,
        filename_pattern="new{suffix}.safetensors",
    )
    assert (tmp_path / "s1.safetensors").exists() and not (tmp_path / "s2.safetensors").exists()
    with safe_open(tmp_path / "encoder.safetensors.index.json", "np") as f:
        assert f.get_tensor("a").tolist() == [1.0] * 4


def test_reshard_of_a_folder_s_single_file_replaces_it(tmp_path: Path) -> None:
    save_file(_tensors(3), str(tmp_path / "model.safetensors"))
    reshard(tmp_path, tmp_path, "4KB", filename_pattern="other{suffix}.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
    with safe_open(tmp_path, "np") as f:
        assert f.path.endswith("other.safetensors.index.json")
    # A file named as the source (not its folder) is not deleted.
    save_file(_tensors(3), str(tmp_path / "extra.safetensors"))
    reshard(tmp_path / "extra.safetensors", tmp_path / "out", "4KB")
    reshard(
        tmp_path / "extra.safetensors", tmp_path, "4KB", filename_pattern="x{suffix}.safetensors"
    )
    assert (tmp_path / "extra.safetensors").exists()


@pytest.mark.parametrize("size", [8e3, 8000.0, np.int64(8000), 8000.9])
def test_numeric_shard_sizes_as_the_hub_takes_them(tmp_path: Path, size: Any) -> None:
    plan = save_sharded(_tensors(4), tmp_path, max_shard_size=size)
    assert len(plan.filename_to_tensors) == 2
    with pytest.raises(ValueError, match="finite"):
        save_sharded(_tensors(4), tmp_path / "x", max_shard_size=float("inf"))
    with pytest.raises(TypeError):
        save_sharded(_tensors(4), tmp_path / "y", max_shard_size=True)


def test_many_shards_load_and_each_is_checked_against_the_index(tmp_path: Path) -> None:
    state = _tensors(300, 10)
    save_sharded(state, tmp_path, max_shard_size=40)
    with safe_open(tmp_path, "np") as f:
        assert all(np.array_equal(f.get_tensor(k), v) for k, v in state.items())
        f.validate()
        assert f._by_shard is not None and len(f._by_shard) == 300  # built once, per shard
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["t5"] = index["weight_map"]["t6"]
    index_path.write_text(json.dumps(index))
    with safe_open(tmp_path, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("t6"), state["t6"])
        with pytest.raises(ShardIndexError, match="t5") as info:
            f.get_tensor("t5")
        assert info.value.kind == "TensorNotInShard"


def test_a_single_file_over_shards_without_clean_is_what_the_folder_opens_as(
    tmp_path: Path,
) -> None:
    save_sharded(_tensors(3), tmp_path, max_shard_size=5000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_sharded({"new": np.ones(2, np.float32)}, tmp_path, clean=False)
    # The old shards stay (clean=False), but the old index no longer decides what opens.
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert (tmp_path / "model-00001-of-00003.safetensors").exists()
    assert list(load_file(tmp_path)) == ["new"]


def test_torch_tensor_subclasses_defined_elsewhere_are_torch_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class MyParam(torch.nn.Parameter):  # as bitsandbytes' Params4bit, torchao's tensors
        pass

    value = MyParam(torch.arange(4, dtype=torch.float32))
    save_sharded({"w": value}, tmp_path / "s")
    with StreamingWriter(tmp_path / "w.safetensors", {"w": ("F32", [4])}) as w:
        w.write("w", value)
    for path in (tmp_path / "s", tmp_path / "w.safetensors"):
        assert load_file(path)["w"].tolist() == [0, 1, 2, 3]


def test_a_value_no_adapter_takes_is_refused_naming_its_tensor(tmp_path: Path) -> None:
    from pysafetensors import SerializeError

    with pytest.raises(SerializeError, match="tensor `bad` is of type list") as info:
        save_sharded({"ok": np.ones(2), "bad": [1, 2]}, tmp_path)
    assert info.value.tensor == "bad"


@pytest.mark.parametrize("force_contiguous", [True, False])
def test_sparse_torch_tensors_are_refused_in_the_reference_s_words(
    tmp_path: Path, force_contiguous: bool
) -> None:
    torch = pytest.importorskip("torch")
    from pysafetensors import SerializeError

    sparse = torch.eye(3).to_sparse()
    with pytest.raises(SerializeError, match=r"sparse tensors: `\['w'\]`"):
        save_sharded({"w": sparse}, tmp_path, force_contiguous=force_contiguous)
    assert os.listdir(tmp_path) == []


def test_string_values_are_skipped_as_the_hub_skips_them(tmp_path: Path) -> None:
    # bitsandbytes state dicts hold strings next to the tensors.
    save_sharded({"w": np.ones(2, np.float32), "q": "bitsandbytes__nf4"}, tmp_path)
    assert list(load_file(tmp_path)) == ["w"]


def test_crashed_partials_of_long_shard_names_go_with_the_old_shards(tmp_path: Path) -> None:
    from pysafetensors._writer import partial_stem

    pattern = "m" * 215 + "{suffix}.safetensors"  # shard names too long to stand whole
    state = {"a": np.ones(64, np.float32), "b": np.ones(64, np.float32)}
    save_sharded(state, tmp_path, max_shard_size=300, filename_pattern=pattern)
    shard = "m" * 215 + "-00001-of-00002.safetensors"
    assert (tmp_path / shard).exists() and partial_stem(shard) != shard
    left = tmp_path / f".{partial_stem(shard)}.0123456789ab.partial"
    left.write_bytes(b"debris of a crashed save")
    os.utime(left, (1e9, 1e9))
    save_sharded(state, tmp_path, max_shard_size=10**6, filename_pattern=pattern)
    assert sorted(os.listdir(tmp_path)) == ["m" * 215 + ".safetensors"]


def _interrupt_renames_after(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Ctrl-C in the middle of a commit: the ``count + 1``-th rename never happens."""
    real = os.replace
    done = [0]

    def replace(src: Any, dst: Any) -> None:
        if done[0] == count:
            raise KeyboardInterrupt
        done[0] += 1
        real(src, dst)

    monkeypatch.setattr(sharding.os, "replace", replace)  # the same os module everywhere


def test_shards_without_their_index_do_not_open_as_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first sharded save interrupted after its first rename left one shard, which the
    # folder lookup opened as the whole model: half the tensors, no error.
    sd = _tensors(4)
    with monkeypatch.context() as m:
        _interrupt_renames_after(m, 1)
        with pytest.raises(KeyboardInterrupt):
            save_sharded(sd, tmp_path, max_shard_size=5000)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["model-00001-of-00004.safetensors"]
    for attempt in (lambda: load_file(tmp_path), lambda: safe_open(tmp_path, "np")):
        with pytest.raises(MissingShardError, match="but no index") as info:
            attempt()
        assert info.value.kind == "MissingIndex"
    # The shard's own path still opens that file; a 1-of-1 "shard" is a whole checkpoint.
    assert len(load_file(tmp_path / left[0])) == 1
    one = tmp_path / "one"
    one.mkdir()
    save_file(sd, one / "model-00001-of-00001.safetensors")
    assert sorted(load_file(one)) == sorted(sd)


_KILLED_DURING_THE_RENAMES = """
import os, signal, sys
import pysafetensors._sharding as sharding
from pysafetensors import reshard

real, done = os.replace, [0]

def replace(src, dst):
    if done[0] == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    done[0] += 1
    real(src, dst)

sharding.os.replace = replace  # the same os module everywhere
reshard(sys.argv[1], sys.argv[1], max_shard_size=int(sys.argv[3]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_a_reshard_in_place_killed_during_its_renames_says_how_to_finish_it(
    tmp_path: Path,
) -> None:
    """Killed between its renames, a reshard into its source's own folder leaves some tensors
    only in its temporary files (the old shard of that name already replaced). The folder,
    without an index, said only "a save or download that did not finish?"; it now names the
    temporary files and how to finish the save, and doing so gives the resharded model."""
    sd = _tensors(8)
    save_sharded(sd, tmp_path, max_shard_size=8500)  # two tensors a shard
    assert len(os.listdir(tmp_path)) == 5
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_DURING_THE_RENAMES, str(tmp_path), "2", "4500"],
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    with pytest.raises(MissingShardError, match="but no index") as info:
        safe_open(tmp_path, "np")
    text = str(info.value)
    pending = sorted(n for n in os.listdir(tmp_path) if n.endswith(".partial"))
    assert any(".index.json." in n for n in pending) and len(pending) == 7  # 8 shards + index
    assert "stopped while it renamed its files into place" in text
    assert pending[-1].startswith(".model.safetensors.index.json.")  # named first:
    assert pending[-1] in text and all(n in text for n in pending[:4]) and " and 2 more" in text
    for name in pending:  # finished by hand, as the message says
        os.rename(tmp_path / name, tmp_path / name[1:].rsplit(".", 2)[0])
    got = load_file(tmp_path)
    assert sorted(got) == sorted(sd) and all(np.array_equal(got[k], sd[k]) for k in sd)
    with safe_open(tmp_path, "np") as f:
        f.validate()
        assert len({f.shard_of(k) for k in sd}) == 8  # one tensor a shard: the new split


def _stopped_save(done: Path, folder: Path, renamed: int, token: str) -> dict[str, str]:
    """Lay out in ``folder`` the files of a sharded save (the complete one in ``done``) that
    was stopped after renaming ``renamed`` shards into place: the rest, and its index, still
    under their temporary names (with ``token`` as their random part). Returns each
    temporary file's name and the name it stands for."""
    from pysafetensors._writer import partial_stem

    (index,) = (p.name for p in done.iterdir() if p.name.endswith(".index.json"))
    shards = sorted(set(json.loads((done / index).read_text())["weight_map"].values()))
    temporary: dict[str, str] = {}
    for i, name in enumerate([*shards, index]):
        if i < renamed:
            (folder / name).write_bytes((done / name).read_bytes())
        else:
            temp = f".{partial_stem(name)}.{token}.partial"
            (folder / temp).write_bytes((done / name).read_bytes())
            temporary[temp] = name
    return temporary


def test_a_stopped_save_of_names_too_long_to_keep_says_what_each_file_is_renamed_to(
    tmp_path: Path,
) -> None:
    """A shard name too long for its temporary file's name is cut there (with a hash). The
    hint said to drop the temporary file's '.' and ending, which gave the cut name; the
    message now names each file's target, read from the stopped save's index."""
    sd = _tensors(4)
    pattern = "m" * 215 + "{suffix}.safetensors"  # 242 bytes: the room is 233
    save_sharded(sd, tmp_path / "done", max_shard_size=4500, filename_pattern=pattern)
    for renamed, expected in ((1, "but no index"), (0, "no safetensors checkpoint")):
        folder = tmp_path / f"stopped{renamed}"
        folder.mkdir()
        temporary = _stopped_save(tmp_path / "done", folder, renamed, "0123456789ab")
        assert len(temporary) == 5 - renamed and all("~" in t for t in temporary)  # index too
        with pytest.raises(MissingShardError, match=expected) as info:
            safe_open(folder, "np")
        text = str(info.value)
        assert "a save was stopped while it renamed its files" in text
        for temp, name in temporary.items():
            assert f"{temp} to {name}" in text
            os.rename(folder / temp, folder / name)  # finished as the message says
        got = load_file(folder)
        assert sorted(got) == sorted(sd) and all(np.array_equal(got[k], sd[k]) for k in sd)


def test_two_stopped_saves_name_the_newest_files_and_set_the_older_apart(
    tmp_path: Path,
) -> None:
    """Two saves to one folder, each stopped during its renames: the hint listed every
    temporary file as one save's, two files for one name. It now names the newest save's
    files (the newest index and, for each name, the newest file) and says the others are
    older."""
    old, new = _tensors(4), {k: v + 10 for k, v in _tensors(4).items()}
    save_sharded(old, tmp_path / "old", max_shard_size=4500)
    save_sharded(new, tmp_path / "new", max_shard_size=4500)
    folder = tmp_path / "stopped"
    folder.mkdir()
    older = _stopped_save(tmp_path / "old", folder, 0, "aaaaaaaaaaaa")
    past = time.time() - 3600
    for temp in older:
        os.utime(folder / temp, (past, past))
    newer = _stopped_save(tmp_path / "new", folder, 2, "bbbbbbbbbbbb")
    with pytest.raises(MissingShardError, match="but no index") as info:
        safe_open(folder, "np")
    text = str(info.value)
    for temp, name in newer.items():
        assert f"{temp} to {name}" in text
    assert not any(f"{temp} to" in text for temp in older)
    assert f"the other {len(older)} temporary file(s) there" in text
    assert "are not that save's" in text and "still running" in text  # written just now
    for temp, name in newer.items():
        os.rename(folder / temp, folder / name)
    got = load_file(folder)
    assert all(np.array_equal(got[k], new[k]) for k in new)


def test_shards_over_a_single_file_retire_it_after_the_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old model.safetensors stayed until the clean-up (for good with clean=False), and
    # transformers opens it before any index: the old weights, silently.
    old = {"w": np.zeros(4, np.float32)}
    save_sharded(old, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    save_sharded(_tensors(3), tmp_path, max_shard_size=5000, clean=False)
    assert not (tmp_path / "model.safetensors").exists()
    assert sorted(load_file(tmp_path)) == sorted(_tensors(3))
    # Interrupted before the index: the folder still holds the old single file whole, and
    # opens as it (the new shards without their index are not a model). It used to be
    # deleted first, which lost tensors when the save was a reshard of it into its folder.
    save_sharded(old, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with monkeypatch.context() as m:
        _interrupt_renames_after(m, 2)
        with pytest.raises(KeyboardInterrupt):
            save_sharded(_tensors(3), tmp_path, max_shard_size=5000)
    assert sorted(load_file(tmp_path)) == ["w"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_a_reshard_into_its_folder_cut_short_keeps_every_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renames that stop once old files are gone keep the rest, which hold the only copy."""
    from pysafetensors import reshard

    for source_sharded in (False, True):
        folder = tmp_path / f"sharded-{source_sharded}"
        folder.mkdir()
        sd = {k: np.full(100, i, np.float32) for i, k in enumerate("abcd")}
        if source_sharded:
            save_sharded(sd, folder, max_shard_size=1200)  # [a, b, c] [d]
        else:
            save_file(sd, folder / "model.safetensors")
        with monkeypatch.context() as m:
            _interrupt_renames_after(m, 1)
            with pytest.raises(KeyboardInterrupt) as info:
                reshard(folder, folder, 800)  # [a, b] [c, d]: the same names when sharded
        kept = [p for p in folder.iterdir() if p.name.endswith(".partial")]
        if source_sharded:  # the first rename replaced a shard: the rest are kept, and named
            assert kept and all(str(p) in info.value.__notes__[0] for p in kept)
        else:  # nothing of the source was touched yet (it goes once all is renamed)
            assert not kept and (folder / "model.safetensors").exists()
        found: dict[str, np.ndarray] = {}
        for path in folder.iterdir():
            if path.name.endswith((".safetensors", ".partial")) and ".index.json" not in path.name:
                with safe_open(path, "np") as f:
                    found.update({k: f.get_tensor(k) for k in f.offset_keys()})
        assert sorted(found) == sorted(sd)
        assert all(np.array_equal(found[k], v) for k, v in sd.items())


@pytest.mark.parametrize("fsync", [False, True])
def test_an_interrupt_during_the_final_rename_is_raised_after_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_sigint_handler: None, fsync: bool
) -> None:
    # Ctrl-C landing in the rename that replaces the old file (long on ext4 for a large
    # file) was raised as os.replace returned: the new file was in place, but a durable save
    # skipped its folder's fsync. It is now held over the commit and raised after it.
    import signal

    import pysafetensors._writer as writer

    target = tmp_path / "m.safetensors"
    save_file({"old": np.zeros(2, np.float32)}, target)
    events: list[str] = []
    real_replace, real_fsync_dir = writer.os.replace, writer._fsync_dir

    def replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        events.append("renamed")
        os.kill(os.getpid(), signal.SIGINT)  # arrives as the rename returns
        events.append("after the signal")

    def fsync_dir(folder: str, saved: str | None = None) -> None:
        events.append("folder synced")
        real_fsync_dir(folder, saved)

    monkeypatch.setattr(writer.os, "replace", replace)
    monkeypatch.setattr(writer, "_fsync_dir", fsync_dir)
    with pytest.raises(KeyboardInterrupt):
        save_file({"new": np.ones(3, np.float32)}, target, fsync=fsync)
    monkeypatch.undo()
    assert events == ["renamed", "after the signal"] + (["folder synced"] if fsync else [])
    assert list(load_file(target)) == ["new"]  # the save is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temporary


@pytest.mark.parametrize("during", ["the first rename", "removing the old index"])
def test_an_interrupt_during_a_sharded_commit_is_raised_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_sigint_handler: None, during: str
) -> None:
    # Ctrl-C between two renames of the commit left a folder without its index: the new files
    # not renamed yet deleted (or, landing as the old index was deleted, nothing renamed at
    # all). The commit holds it, as a single file's rename does, and raises it once done.
    import signal

    sd = _tensors(4)
    save_sharded({k: v + 1 for k, v in sd.items()}, tmp_path, max_shard_size=2500)
    real_replace, real_unlink = os.replace, os.unlink
    sent: list[str] = []

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if during == "the first rename" and not sent:
            sent.append(str(dst))
            os.kill(os.getpid(), signal.SIGINT)

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        real_unlink(path, *args, **kwargs)
        if during == "removing the old index" and str(path).endswith(".index.json") and not sent:
            sent.append(str(path))
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        m.setattr(os, "unlink", unlink)
        with pytest.raises(KeyboardInterrupt):
            save_sharded(sd, tmp_path, max_shard_size=2500)
    assert sent
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    loaded = load_file(tmp_path)  # the new checkpoint, whole
    assert sorted(loaded) == sorted(sd)
    assert all(np.array_equal(loaded[k], v) for k, v in sd.items())


def test_an_interrupt_while_a_shard_joins_its_group_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_sigint_handler: None
) -> None:
    # A finished shard hints its writeback (sync_file_range) and is handed to the save's
    # group; a Ctrl-C between the two deleted the file and left its descriptor open.
    import signal

    import pysafetensors._writer as writer

    if writer.sync_file_range is None:
        pytest.skip("no sync_file_range here")
    sd = _tensors(4)
    save_sharded(sd, tmp_path, max_shard_size=2500)  # targets that exist: the hint is given
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = writer.sync_file_range

    def hint(fd: int, offset: int, count: int, flags: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        real(fd, offset, count, flags)

    def partials_open() -> list[str]:
        found = []
        for entry in os.listdir("/proc/self/fd"):
            try:
                if ".partial" in os.readlink(f"/proc/self/fd/{entry}"):
                    found.append(entry)
            except OSError:
                continue
        return found

    monkeypatch.setattr(writer, "sync_file_range", hint)
    with pytest.raises(KeyboardInterrupt):
        save_sharded({k: v + 1 for k, v in sd.items()}, tmp_path, max_shard_size=2500)
    monkeypatch.undo()
    assert partials_open() == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_stale_file_that_cannot_be_removed_is_a_warning_after_a_complete_save(
    tmp_path: Path,
) -> None:
    # The clean-up runs once the new checkpoint is in place: its failure (here a folder with a
    # shard's name) was raised as a bare OSError, as if the save had failed.
    save_sharded(_tensors(4), tmp_path, max_shard_size=2500)
    (tmp_path / "model-00009-of-00009.safetensors" / "x").mkdir(parents=True)
    new = {k: v + 1 for k, v in _tensors(4).items()}
    stale = r"(?i)model-00009-of-00009\.safetensors.*is a directory"
    with pytest.warns(StaleFileWarning, match=stale):
        save_sharded(new, tmp_path, max_shard_size=2500)
    loaded = load_file(tmp_path)
    assert all(np.array_equal(loaded[k], v) for k, v in new.items())


def test_a_single_file_with_the_longest_legal_name_saves_without_an_error(
    tmp_path: Path,
) -> None:
    # The save retires the previous save's index, "<name>.index.json": for a name of 244-255
    # bytes that is past the file system's 255, and unlink's ENAMETOOLONG escaped as a bare
    # OSError after the file was in place (the CLI said the write failed; exit status 2).
    pattern = "m" * 236 + "{suffix}.safetensors"  # a single file of 248 bytes
    save_sharded({"a": np.arange(4, dtype=np.float32)}, tmp_path, filename_pattern=pattern)
    assert [len(p.name) for p in tmp_path.iterdir()] == [248]
    assert np.array_equal(load_file(tmp_path)["a"], np.arange(4, dtype=np.float32))


def test_an_old_index_that_cannot_be_retired_is_a_warning_after_a_complete_save(
    tmp_path: Path,
) -> None:
    # A single file replacing a sharded checkpoint deletes the old index once it is in place;
    # a failure there (here a folder with the index's name) came out as a bare OSError.
    (tmp_path / "model.safetensors.index.json" / "x").mkdir(parents=True)
    with pytest.warns(StaleFileWarning, match=r"(?i)model\.safetensors\.index\.json.*directory"):
        save_sharded({"a": np.ones(4, np.float32)}, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert np.array_equal(f.get_tensor("a"), np.ones(4, np.float32))
