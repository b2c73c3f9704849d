"""The library pieces behind the CLI: the lenient validator and edit_metadata."""

from __future__ import annotations

import os
import random
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pysafetensors
from pysafetensors._errors import HeaderError, SafetensorError
from pysafetensors._format import parse_header
from pysafetensors._sources import BufferSource
from pysafetensors._validate import validate_source
from pysafetensors.numpy import load_file, save, save_file

from .conftest import example_tensors, raw_file


def _strict_ok(data: bytes) -> bool:
    if len(data) < 8:
        return False
    n = struct.unpack("<Q", data[:8])[0]
    if 8 + n > len(data):
        return False
    try:
        parse_header(data[8 : 8 + n], len(data) - 8 - n)
    except HeaderError:
        return False
    return True


def test_validator_agrees_with_the_strict_parser() -> None:
    """No errors exactly when the strict reader accepts the file, over random corruptions."""
    base = save(
        {
            "a": np.arange(6, dtype=np.float32),
            "b": np.ones((2, 3), np.int16),
            "c": np.zeros(0, np.uint8),
        },
        metadata={"format": "pt"},
    )
    rng = random.Random(1234)
    n = struct.unpack("<Q", base[:8])[0]
    seen_bad = 0
    for _ in range(400):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if kind < 0.6 and len(data) > 8 + n:  # flip a header byte to a JSON character
                data[rng.randrange(8, 8 + n)] = ord(rng.choice('0123456789[]{},:" -.eE\x00\\'))
            elif kind < 0.8:
                data = data[: rng.randrange(len(data))]
            else:
                data += bytes(rng.randint(1, 9))
        data = bytes(data)
        problems = validate_source(BufferSource(data))
        errors = [p for p in problems if p.severity == "error"]
        assert (not errors) == _strict_ok(data), (data, problems)
        seen_bad += bool(errors)
    assert seen_bad > 200


def test_validator_collects_many_problems() -> None:
    header = {
        "__metadata__": {"format": 1},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},  # overlaps a
        "c": {"dtype": "F4", "shape": [3], "data_offsets": [12, 14]},  # 12 bits
        "d": {"dtype": "F32", "shape": "x", "data_offsets": [14, 18]},  # bad shape type
    }
    problems = validate_source(BufferSource(raw_file(header, bytes(20))))
    codes = [(p.code, p.tensor) for p in problems]
    assert ("InvalidOffset", "b") in codes
    assert ("MisalignedSlice", "c") in codes
    assert ("InvalidHeaderDeserialization", "d") in codes
    assert ("MetadataIncompleteBuffer", None) in codes
    assert any("__metadata__" in p.message for p in problems)
    assert all(p.offset is not None for p in problems if p.tensor in ("b", "c"))


def test_offsets_past_the_end_of_the_file_point_at_the_tensor_s_key() -> None:
    # A header may declare any offsets (2^64 - 1): reported as bytes of the file, they were
    # past its end (and past 2^64, which many JSON readers cannot hold exactly).
    text = '{"a":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,0]}}'
    data = raw_file(text.encode(), bytes(8))
    problems = [p for p in validate_source(BufferSource(data)) if p.code == "InvalidOffset"]
    assert problems and all(p.offset == 8 + text.index('"a"') for p in problems), problems


def test_validator_locates_each_tensor_by_its_own_key() -> None:
    # Offsets came from the first textual match of `"name":`: a tensor named "dtype" was
    # placed at the first tensor's dtype field, a tensor named like a metadata key inside the
    # metadata, and an escaped name nowhere.
    text = (
        '{"__metadata__":{"t":"v"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        '"dtype":{"dtype":"X","shape":[1],"data_offsets":[4,5]},'
        '"t":{"dtype":"Y","shape":[1],"data_offsets":[5,6]},'
        '"\\u00e9":{"dtype":"Z","shape":[1],"data_offsets":[6,7]}}'
    )
    data = raw_file(text.encode(), bytes(7))
    problems = {p.tensor: p.offset for p in validate_source(BufferSource(data)) if p.tensor}
    for name, key in (("dtype", '"dtype":{"dtype":"X"'), ("t", '"t":{'), ("\u00e9", '"\\u00e9"')):
        assert problems[name] == 8 + text.encode().index(key.encode()), name


def test_validator_keeps_the_readers_reason_beside_another_of_its_code() -> None:
    # A problem only the strict parser sees (nesting past its limit in tensor `e`) was dropped
    # when the walk had found another error of the same code (the unknown dtype of `t`).
    deep = "[" * 130 + "]" * 130
    text = (
        '{"e":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + deep + "},"
        '"t":{"dtype":"X","shape":[1],"data_offsets":[0,1]}}'
    )
    problems = validate_source(BufferSource(raw_file(text.encode(), bytes(1))))
    found = {(p.code, p.tensor) for p in problems}
    assert ("InvalidHeaderDeserialization", "e") in found, problems


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        # Only the strict parser sees these; a header-wide error (no tensor) was taken as
        # reported by any error of its code the walk found elsewhere.
        ('"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', "hex escape"),
        ('"__metadata__":{"k":"\\udc00"}', "surrogate"),
        # The reader's own reason in the tensor another error of the walk names.
        (
            '"t":{"dtype":"X","shape":[1],"data_offsets":[0,1],"x":' + "[" * 200 + "]" * 200 + "}",
            "recursion limit",
        ),
    ],
)
def test_validator_keeps_the_readers_reason_beside_another_of_its_code_anywhere(
    first: str, reason: str
) -> None:
    text = "{" + first + ',"z":{"dtype":"X","shape":[0],"data_offsets":[1,1]}}'
    problems = validate_source(BufferSource(raw_file(text.encode(), bytes(1))))
    assert any(reason in p.message for p in problems), problems
    assert any("unknown variant `X`" in p.message and p.tensor == "z" for p in problems)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[]", "invalid type: sequence, expected struct HashMetadata at line 1 column 0"),
        ('"x"', 'invalid type: string "x", expected struct HashMetadata at line 1 column 3'),
        ('{"a\xff":{}}', "invalid UTF-8 in header: invalid utf-8 sequence"),
    ],
)
def test_validator_gives_the_readers_words_for_a_header_it_cannot_walk(
    text: str, reason: str
) -> None:
    # The walk's own "expected a map" said less than the reader, or both were listed.
    problems = validate_source(BufferSource(raw_file(text.encode("latin-1"), b"")))
    assert [p.message for p in problems if p.severity == "error"] == [
        p.message for p in problems if reason in p.message
    ], problems
    assert len(problems) == 1, problems


def test_validator_lists_the_same_fault_of_a_repeated_name_once() -> None:
    # Each entry of the repeated name `t` lacks its shape: the same error, in the same words
    # at the same place, was listed once per entry.
    entry = '"t":{"dtype":"U8","data_offsets":[0,1]}'
    text = "{" + entry + "," + entry + "}"
    problems = validate_source(BufferSource(raw_file(text.encode(), bytes(1))))
    assert [(p.code, p.tensor) for p in problems] == [("InvalidHeaderDeserialization", "t")]


def test_validator_reports_a_fault_once_whatever_the_tensors_name() -> None:
    # A name holding the words of a problem only the strict parser sees made the reader's
    # reason count as one the walk could not see: the size mismatch was listed twice.
    text = '{"number out of range":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'
    problems = validate_source(BufferSource(raw_file(text.encode(), bytes(4))))
    assert [p.code for p in problems] == ["TensorInvalidInfo"], problems


def test_validator_reports_an_entry_without_offsets_once() -> None:
    # Its bytes were counted as trailing bytes too: a second error for the same cause.
    text = '{"a":{"dtype":"F32","shape":[2]}}'
    problems = validate_source(BufferSource(raw_file(text.encode(), bytes(8))))
    assert [(p.code, p.tensor) for p in problems] == [("InvalidHeaderDeserialization", "a")]


def test_validator_reads_an_index_as_strictly_as_the_reader(tmp_path: Path) -> None:
    # json.loads of bytes takes a byte-order mark (and UTF-16): validate said OK where
    # safe_open refuses the folder.
    from pysafetensors import ShardIndexError, save_sharded
    from pysafetensors._validate import validate

    save_sharded({f"t{i}": np.zeros(1000, np.float32) for i in range(4)}, tmp_path, "5KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b"\xef\xbb\xbf" + index.read_bytes())
    with pytest.raises(ShardIndexError):
        pysafetensors.safe_open(tmp_path, "np")
    assert [p.code for p in validate(str(tmp_path)) if p.severity == "error"] == ["IndexInvalid"]


def test_edit_metadata_exported_and_in_place(tmp_path: Path) -> None:
    assert "edit_metadata" in pysafetensors.__all__
    path = tmp_path / "m.safetensors"
    save_file(example_tensors(), str(path), metadata={"format": "pt", "long": "x" * 64})
    before = path.read_bytes()
    n = struct.unpack("<Q", before[:8])[0]
    assert pysafetensors.edit_metadata(path, set={"format": "np"}, delete=["long"]) is True
    after = path.read_bytes()
    assert (
        len(after) == len(before) and after[:8] == before[:8] and after[8 + n :] == before[8 + n :]
    )
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"format": "np"}
    assert pysafetensors.edit_metadata(path, set={"k": "v" * 200}, reserve=100) is False
    # The reserve leaves room: the next, similar edit is in place.
    assert pysafetensors.edit_metadata(path, set={"k2": "w" * 60}) is True
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"format": "np", "k": "v" * 200, "k2": "w" * 60}
    for name, value in example_tensors().items():
        np.testing.assert_array_equal(load_file(str(path))[name], value)
    assert pysafetensors.edit_metadata(path, set={"only": "this"}, replace=True) is True
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"only": "this"}


def test_edit_metadata_in_place_only_within_one_page_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref_np = pytest.importorskip("safetensors.numpy")
    tensors = {f"layer.{i}.weight": np.full((4, 4), i, np.float32) for i in range(300)}
    path = tmp_path / "m.safetensors"
    ref_np.save_file(tensors, str(path), metadata={"k": "a" * 100})
    before = path.read_bytes()
    n = struct.unpack("<Q", before[:8])[0]
    assert n > 3 * 4096  # a header of several pages, the metadata at its start
    writes: list[tuple[int, int]] = []
    real_pwrite = os.pwrite

    def record(fd: int, data: bytes, offset: int) -> int:
        writes.append((offset, len(data)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", record)
    # Shorter: the new object and spaces replace the old one in its slot, one small write.
    assert pysafetensors.edit_metadata(path, set={"k": "b" * 40}) is True
    after = path.read_bytes()
    assert len(writes) == 1 and writes[0][1] <= 110 and writes[0][0] // 4096 == 0
    start, length = writes[0]
    assert after[:start] == before[:start] and after[start + length :] == before[start + length :]
    with ref_np.safe_open(str(path), "np") as f:  # the reference reads it
        assert f.metadata() == {"k": "b" * 40}
    # A key named twice is deleted once (it was "metadata has no key").
    assert pysafetensors.edit_metadata(path, delete=["k", "k"]) is True
    # Larger than the slot: every tensor entry would move, across pages: an atomic rewrite,
    # byte-identical to the reference's save of the same tensors and metadata.
    writes.clear()
    assert pysafetensors.edit_metadata(path, set={"k": "c" * 500}) is False
    expected = tmp_path / "expected.safetensors"
    ref_np.save_file(tensors, str(expected), metadata={"k": "c" * 500})
    assert path.read_bytes() == expected.read_bytes()
    # Asked for, the whole header is rewritten in place when it fits its N bytes.
    assert pysafetensors.edit_metadata(path, set={"k": "d" * 10}, in_place=True) is True
    assert pysafetensors.edit_metadata(path, set={"k": "e" * 200}, in_place=True) is True
    assert path.stat().st_size == expected.stat().st_size
    # And never, when asked not to.
    assert pysafetensors.edit_metadata(path, set={"k": "f"}, in_place=False) is False
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"k": "f"}
        np.testing.assert_array_equal(f.get_tensor("layer.299.weight"), tensors["layer.299.weight"])


def test_edit_metadata_uses_spare_room_at_the_end_of_a_small_header(tmp_path: Path) -> None:
    # Room left at the end of the header (by an earlier --reserve, or another writer) serves a
    # growing edit in place when the whole header is one page: it was rewritten.
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(path), metadata={"k": "v"})
    content = path.read_bytes()
    n = struct.unpack("<Q", content[:8])[0]
    header = content[8 : 8 + n] + b" " * 256
    path.write_bytes(struct.pack("<Q", len(header)) + header + content[8 + n :])
    inode = path.stat().st_ino
    assert pysafetensors.edit_metadata(path, set={"k": "w" * 100}) is True
    assert path.stat().st_ino == inode
    with pysafetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"k": "w" * 100}


def test_edit_metadata_keeps_the_group_where_the_owner_cannot_be_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One fchown(uid, gid) refused (a user cannot give a file away) also dropped the group,
    # which a user may set to one of theirs: the owner and its group lost access to a 0660 file.
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(path), metadata={"k": "v"})
    st = path.stat()
    calls: list[tuple[int, int]] = []

    def fchown(fd: int, uid: int, gid: int) -> None:
        calls.append((uid, gid))
        if uid != -1:
            raise PermissionError(1, "Operation not permitted")

    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        if fd >= 0 and stat.S_ISREG(result.st_mode) and result.st_ino == st.st_ino:
            values = list(result)
            values[4], values[5] = st.st_uid + 1, st.st_gid + 1  # someone else's file
            return os.stat_result(values)
        return result

    monkeypatch.setattr(os, "fchown", fchown)
    monkeypatch.setattr(os, "fstat", fstat)
    assert pysafetensors.edit_metadata(path, set={"k": "w" * 300}) is False
    assert calls == [(st.st_uid + 1, st.st_gid + 1), (-1, st.st_gid + 1)]


def test_edit_metadata_rewrite_keeps_permissions_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rewritten file had the umask's permissions until a chmod after the rename: a private
    # file was briefly world-readable (and stayed so if the process died in between).
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(path), metadata={"k": "v"})
    os.chmod(path, 0o600)
    seen: list[int] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        seen.append(stat.S_IMODE(os.stat(dst).st_mode))

    monkeypatch.setattr(os, "replace", replace)
    assert pysafetensors.edit_metadata(path, set={"k": "w" * 300}) is False
    assert seen == [0o600] and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_edit_metadata_rewrite_keeps_extended_attributes(tmp_path: Path) -> None:
    # Only mode and owner were carried over: a note in a user.* attribute (or an ACL) was
    # dropped by an edit that rewrote the file, and kept by one in place.
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(path), metadata={"k": "v"})
    try:
        os.setxattr(path, "user.note", b"keep me")
    except OSError as exc:  # the file system here holds no user attributes
        pytest.skip(f"no extended attributes: {exc}")
    assert pysafetensors.edit_metadata(path, set={"k": "w" * 5000}) is False  # rewritten
    assert os.getxattr(path, "user.note") == b"keep me"
    assert pysafetensors.safe_open(path, "np").metadata() == {"k": "w" * 5000}


def test_edit_metadata_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path))
    with pytest.raises(SafetensorError, match="no key 'x'"):
        pysafetensors.edit_metadata(path, delete=["x"])
    with pytest.raises(TypeError):
        pysafetensors.edit_metadata(path, set={"a": 1})  # type: ignore[dict-item]
    bad = tmp_path / "bad.safetensors"
    content = raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4))
    bad.write_bytes(content)
    with pytest.raises(HeaderError):
        pysafetensors.edit_metadata(bad, set={"a": "b"})
    assert bad.read_bytes() == content  # a file that fails validation is never written


def test_edit_metadata_refuses_what_is_no_file_naming_the_path_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A FIFO was opened (O_RDWR does not wait for a writer) and read as a 0-byte file
    # ("HeaderSizeError"); a missing file, a folder or a dangling link were named by their
    # real path, a dangling link's without saying it was one.
    from pysafetensors._sources import NotRegularFileError

    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    os.mkdir("folder")
    os.symlink("gone.safetensors", "link.safetensors")
    cases = [
        ("fifo", NotRegularFileError, r"a FIFO, not a regular file: 'fifo'"),
        ("folder", IsADirectoryError, r"Is a directory: 'folder'"),
        ("nope.safetensors", FileNotFoundError, r"No such file or directory: 'nope.safetensors'"),
        (
            "link.safetensors",
            FileNotFoundError,
            r"\(a link to .*gone\.safetensors\): 'link\.safetensors'",
        ),
    ]
    for name, error, message in cases:
        with pytest.raises(error, match=message):
            pysafetensors.edit_metadata(name, set={"a": "b"})
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder", "link.safetensors"]


def test_a_rewrite_of_the_reference_s_file_with_empty_tensors_is_its_save(
    tmp_path: Path,
) -> None:
    # Empty tensors share an offset; the rewrite listed them by name, the reference by dtype
    # (rank descending) and then name.
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {
        "a": np.arange(3, dtype=np.float32),
        "z": np.zeros(0, np.float16),
        "b": np.zeros((0, 2), np.bool_),
    }
    path = tmp_path / "x.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    assert pysafetensors.edit_metadata(path, set={"y": "2" * 50}) is False  # a rewrite
    assert path.read_bytes() == safetensors_numpy.save(tensors, metadata={"y": "2" * 50})


def test_edit_metadata_refuses_arguments_of_the_wrong_kind(tmp_path: Path) -> None:
    # delete=b"k" was iterated as integers ("no key 107"), a list of pairs taken as a mapping,
    # a negative reserve taken as 0, and 3.5 a TypeError from deep inside.
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path), metadata={"k": "v"})
    before = path.read_bytes()
    with pytest.raises(TypeError, match="delete takes str keys, not int: 107"):
        pysafetensors.edit_metadata(path, delete=b"k")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="set must be a mapping of str to str, not list"):
        pysafetensors.edit_metadata(path, set=[("k", "q")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserve must be 0 or more bytes, not -1"):
        pysafetensors.edit_metadata(path, set={"k": "q"}, reserve=-1)
    with pytest.raises(TypeError, match="reserve must be an int"):
        pysafetensors.edit_metadata(path, set={"k": "q"}, reserve=3.5)  # type: ignore[arg-type]
    assert path.read_bytes() == before


def test_edit_metadata_argument_handling(tmp_path: Path) -> None:
    from pysafetensors import SerializeError, edit_metadata, safe_open
    from pysafetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones(2)}, path, metadata={"key": "v", "k": "single letter"})
    edit_metadata(path, delete="key")  # one key, not the letters k, e, y
    with safe_open(path, "np") as f:
        assert f.metadata() == {"k": "single letter"}
    before = path.read_bytes()
    with pytest.raises(SerializeError, match="lone surrogate"):
        edit_metadata(path, set={"bad": "\ud800"})
    assert path.read_bytes() == before


def test_an_interrupt_is_exit_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import pysafetensors._cli as cli
    import pysafetensors._cli._cmd_hash as cmd_hash

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    # While a command runs, and while the options are read (that was a traceback).
    monkeypatch.setattr(cmd_hash, "run", interrupted)
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert cli.main(["hash", str(path)]) == 130
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["hash", str(path)]) == 130
    assert "Traceback" not in capsys.readouterr().err


_INTERRUPT_DURING_A_COLLECTION = """
import gc, signal, sys
import pysafetensors.numpy, pysafetensors._cli  # what a command imports
garbage = [[[]] for _ in range(1_500_000)]  # a full collection of these takes ~0.2 s
signal.signal(signal.SIGALRM, signal.default_int_handler)  # raises KeyboardInterrupt
signal.setitimer(signal.ITIMER_REAL, 0.01)  # fires while the collection runs
try:
    gc.collect()
    print("lost")
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_an_interrupt_during_a_garbage_collection_is_not_lost() -> None:
    # A gc.callbacks function of the library ran after every collection, and Python runs a
    # pending signal's handler at the first Python code it meets: the callback, whose
    # exception the collector prints as "Exception ignored" and drops. A Ctrl-C that fell in
    # any collection was lost: the command ran to its end and exited 0.
    import gc

    import pysafetensors._sources  # noqa: F401

    assert not [c for c in gc.callbacks if getattr(c, "__module__", "").startswith("pysafetensors")]
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_DURING_A_COLLECTION],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout.strip() == "interrupted", proc.stderr
    assert "Exception ignored" not in proc.stderr
