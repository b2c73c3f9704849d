"""Hostile checkpoints that crashed, exhausted memory, raised foreign exceptions or converted to
other values than ``torch.load`` returns; each is refused with the library's own error, or
converted as torch reads it.

The cases that crashed the interpreter or grew its memory run in a child process: the child's
exit status and peak RSS are what is checked.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import resource
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from pysafetensors import CheckpointError, SafetensorError, safe_open
from pysafetensors._pickle_vm import Limits, Machine
from pysafetensors._torch_policy import TorchPolicy, policy_machine
from pysafetensors.convert import convert_file

from .corpus import P, make_zip, state_dict, tensor, zip_central, zip_end, zip_local

_CHILD = """
import sys
from pysafetensors import SafetensorError
from pysafetensors.convert import convert_file
try:
    convert_file(sys.argv[1], sys.argv[2])
    print("RESULT converted")
except SafetensorError as exc:
    print("RESULT", type(exc).__name__, exc)
# The peak of this process's own memory (VmHWM, new at exec): ru_maxrss carries the parent's
# peak over fork and exec, so a test process grown past the bound failed the check.
with open("/proc/self/status") as status:
    hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print("PEAK_MIB", hwm // 1024)
"""


def _convert_in_child(src: Path, mem_mib: int = 1536) -> tuple[str, int]:
    """Convert in a child under an address-space cap: ``(result line, peak RSS in MiB)``."""

    def cap() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_AS, (mem_mib << 20, mem_mib << 20))

    out = src.with_suffix(".safetensors")
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=cap,
    )
    assert r.returncode == 0, f"child died ({r.returncode}): {r.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert not out.exists(), "a refused checkpoint left an output"
    return lines["RESULT"], int(lines["PEAK_MIB"])


def _loaded(path: Path) -> dict[str, Any]:
    with safe_open(path, "np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


# -- hashing in the calls: crashed in C ------------------------------------------------------

_DEEP = b"N" + b"\x85" * 200_000  # a tuple nested 200,000 deep


@pytest.mark.parametrize(
    "pkl",
    [
        # OrderedDict([(deep, 1)]): the handler hashed its keys itself
        P.PROTO2 + P.g("collections", "OrderedDict") + b"((" + _DEEP + b"K\x01\x86ltR.",
        # {"a": set([deep])}
        P.PROTO2 + b"}" + P.u("a") + P.g("builtins", "set") + b"((" + _DEEP + b"ltRs.",
        # {"a": frozenset((deep,))}
        P.PROTO2 + b"}" + P.u("a") + P.g("builtins", "frozenset") + b"((" + _DEEP + b"ttRs.",
    ],
    ids=["odict_key", "set_item", "frozenset_item"],
)
def test_deep_tuples_hashed_by_calls_are_refused_not_crashing(tmp_path: Path, pkl: bytes) -> None:
    src = tmp_path / "deep.pt"
    make_zip(src, pkl)
    result, _ = _convert_in_child(src)
    assert result.startswith("CheckpointError"), result
    assert "nests tuples over 100 deep" in result


# -- what the calls build: memory amplification ------------------------------------------------


def _size_copies() -> bytes:
    # torch.Size(L) with L a list of a million items, called 400 times from the memo (five
    # bytes each): 400 million items, 3 GiB, from a 2 MB file.
    return P.PROTO2 + P.g("torch", "Size") + b"q\x00]" + b"Na" * 1_000_000 + b"q\x0100"


def _bytearray_copies() -> bytes:
    # bytearray(B) with B 4 MiB of bytes, 400 times: 1.6 GiB from a 4 MiB file.
    blob = b"B" + struct.pack("<I", 4 << 20) + bytes(4 << 20)
    return P.PROTO2 + P.g("builtins", "bytearray") + b"q\x00" + blob + b"q\x0100"


@pytest.mark.parametrize(
    ("head", "message"),
    [(_size_copies, "over 50000000 items"), (_bytearray_copies, "copy over 268435456 bytes")],
)
def test_copies_made_by_calls_count_against_the_budget(
    tmp_path: Path, head: Any, message: str
) -> None:
    # The memo's function and argument (slots 0 and 1) called 400 times, each result kept.
    pkl = head() + b"}" + P.u("junk") + b"]" + b"h\x00h\x01\x85Ra" * 400
    pkl += b"s" + P.u("w") + tensor()
    src = tmp_path / "copies.pt"
    make_zip(src, pkl + b"s.")
    result, peak = _convert_in_child(src)
    assert result.startswith("CheckpointError"), result
    assert message in result
    assert peak < 768, f"{peak} MiB"


def _calls(func: bytes, args: bytes, times: int) -> bytes:
    """``[func(*args)] * times``: each call of the memo's func and argument tuple (five bytes)
    builds its result anew."""
    body = b"h\x00h\x01Ra" * times
    return P.PROTO2 + func + b"q\x00" + args + b"q\x0100]" + body + b"."


@pytest.mark.parametrize(
    ("func", "args", "limits", "message"),
    [
        (
            P.g("builtins", "bytearray"),
            b"C\x08abcdefgh\x85",
            Limits(max_copied_bytes=800),
            "copy over 800 bytes",
        ),
        (
            P.g("_codecs", "encode"),
            P.u("x" * 8) + P.u("latin1") + b"\x86",
            Limits(max_copied_bytes=800),
            "copy over 800 bytes",
        ),
        (
            P.g("torch", "device"),
            P.u("cpu-" * 4) + b"\x85",
            Limits(max_copied_bytes=800),
            "copy over 800 bytes",
        ),
        (
            P.g("torch", "Size"),
            b"]" + b"Na" * 8 + b"\x85",
            Limits(max_items=1000),
            "over 1000 items",
        ),
        (
            P.g("collections", "OrderedDict"),
            b")",
            Limits(max_containers=100),
            "over 100 containers",
        ),
        (
            P.g("collections", "Counter"),
            b"}\x85",
            Limits(max_containers=100),
            "over 100 containers",
        ),
    ],
    ids=["bytearray", "encode", "device", "size", "odict", "counter"],
)
def test_every_call_charges_what_it_builds(
    func: bytes, args: bytes, limits: Limits, message: str
) -> None:
    data = _calls(func, args, 200)
    assert len(policy_machine(data, TorchPolicy(), Limits()).run(0).value) == 200
    with pytest.raises(CheckpointError, match=message):
        policy_machine(data, TorchPolicy(), limits).run(0)


def test_hashing_is_budgeted_in_all() -> None:
    # t = (t, t) eighteen times over (half a million items to hash), then {t: None} set 120
    # times: 63 million items hashed, which a million settings would make 10**12.
    data = P.PROTO2 + b")q\x00" + b"2\x86q\x00" * 18 + b"0}" + b"h\x00Ns" * 120 + b"."
    with pytest.raises(CheckpointError, match="visits over 50000000 items"):
        Machine(data, TorchPolicy()).run(0)
    assert len(Machine(data, TorchPolicy(), Limits(max_hash_items=10**9)).run(0).value) == 1


# -- foreign exceptions ----------------------------------------------------------------------


def test_a_huge_int_key_is_refused_or_outlined(tmp_path: Path) -> None:
    big = 10**9000
    raw = big.to_bytes((big.bit_length() + 8) // 8, "little", signed=True)
    long4 = b"\x8b" + struct.pack("<i", len(raw)) + raw
    src = tmp_path / "key.pt"
    make_zip(src, P.PROTO2 + b"}" + long4 + tensor() + b"s.")
    with pytest.raises(CheckpointError, match=r"top level is an integer of about \d+ digits"):
        convert_file(src, tmp_path / "out.safetensors")
    # Under a value that is no tensor, the key is shown in outline.
    make_zip(src, P.PROTO2 + b"}" + long4 + b"K\x01s" + P.u("w") + tensor() + b"s.")
    report = convert_file(src, tmp_path / "out.safetensors")
    assert report.tensors == ["w"]
    assert list(report.non_tensors) == ["<int>"]


@pytest.mark.parametrize(
    "value",
    [
        P.g("builtins", "complex") + b"\x8a\x82" + bytes(129) + b"\x01" + b"K\x00\x86R",
        P.g("torch", "device") + P.u("cpu") + b"\x8a\x10" + bytes(15) + b"\x01" + b"\x86R",
    ],
    ids=["complex", "device"],
)
def test_calls_on_huge_ints_are_refused_at_their_offset(tmp_path: Path, value: bytes) -> None:
    src = tmp_path / "call.pt"
    pkl = state_dict([("c", value), ("w", tensor())])
    make_zip(src, pkl)
    with pytest.raises(CheckpointError) as info:
        convert_file(src, tmp_path / "out.safetensors")
    assert info.value.offset == pkl.index(b"R")


@pytest.mark.parametrize(
    ("size", "stride", "expected"),
    [
        ((1, 2), (1 << 62, 2), [1, 3]),
        ((2, 1, 2), (1, 1 << 61, 2), [1, 3, 2, 4]),
        ((1,) * 40 + (2,), (1 << 62,) * 40 + (2,), [1, 3]),
    ],
    ids=["2d", "3d", "41d"],
)
def test_any_stride_of_a_size_one_dimension_converts(
    tmp_path: Path, size: tuple[int, ...], stride: tuple[int, ...], expected: list[float]
) -> None:
    # torch takes any stride for a dimension of size 1 (it never steps): numpy's strides
    # overflowed (OverflowError out of as_strided). The storage holds 1, 2, 3, 4.
    src = tmp_path / "stride.pt"
    make_zip(src, state_dict([("w", tensor(size=size, stride=stride))]))
    convert_file(src, tmp_path / "out.safetensors")
    w = _loaded(tmp_path / "out.safetensors")["w"]
    assert w.shape == size
    assert w.reshape(-1).tolist() == expected


def test_a_size_two_dimension_with_a_huge_stride_is_out_of_bounds(tmp_path: Path) -> None:
    src = tmp_path / "stride.pt"
    make_zip(src, state_dict([("w", tensor(size=(2, 2), stride=(1 << 62, 1)))]))
    with pytest.raises(CheckpointError, match="reaches past the end"):
        convert_file(src, tmp_path / "out.safetensors")


# -- tar headers -------------------------------------------------------------------------------


def _tar_header(name: bytes, size_field: bytes, typeflag: bytes) -> bytes:
    h = bytearray(512)
    h[0 : len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field
    h[136:148] = b"00000000000\0"
    h[156:157] = typeflag
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _base256(n: int) -> bytes:
    return bytes([0x80]) + n.to_bytes(11, "big")


@pytest.mark.parametrize(
    ("size", "flag"),
    [
        (_base256(8 << 30), b"x"),
        (b"%011o\0" % ((8 << 30) - 1), b"x"),
        (_base256(8 << 30), b"L"),
        (_base256(1 << 80), b"x"),
        (_base256(1 << 80), b"0"),
    ],
    ids=["pax_8gib", "pax_octal_8gib", "gnu_longname_8gib", "pax_2e80", "member_2e80"],
)
def test_tar_headers_claiming_huge_records_are_refused(
    tmp_path: Path, size: bytes, flag: bytes
) -> None:
    # tarfile read a PAX/long-name record with one read() of its claimed size: MemoryError, or
    # OverflowError for 2**80.
    src = tmp_path / "huge.tar"
    src.write_bytes(_tar_header(b"pickle", size, flag) + bytes(1024))
    what = "tar member 'pickle'" if flag == b"0" else "an extended header"
    with pytest.raises(CheckpointError, match=f"{what} .* past the end of the 1536-byte file"):
        convert_file(src, tmp_path / "out.safetensors")


def test_tar_headers_chained_without_end_are_refused(tmp_path: Path) -> None:
    record = b"30 comment=" + b"x" * 18 + b"\n"
    pax = _tar_header(b"pax", b"%011o\0" % len(record), b"x") + record.ljust(512, b"\0")
    src = tmp_path / "chain.tar"
    src.write_bytes(pax * 2000 + bytes(1024))
    with pytest.raises(CheckpointError, match="tar checkpoint"):
        convert_file(src, tmp_path / "out.safetensors")


def test_sparse_tar_members_are_refused(tmp_path: Path) -> None:
    # A PAX GNU.sparse 1.0 member: tarfile lists it as a regular file whose bytes are a map.
    src = tmp_path / "sparse.tar"
    with tarfile.open(src, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pickle")
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
        data = b"1\n0\n4\n".ljust(512, b"\0") + b"\x80\x02}."
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CheckpointError, match="not a regular file"):
        convert_file(src, tmp_path / "out.safetensors")


# -- zip directories ---------------------------------------------------------------------------


def _members(value: float) -> dict[str, bytes]:
    pkl = state_dict([("w", tensor())])
    return {
        "archive/data.pkl": pkl,
        "archive/byteorder": b"little",
        "archive/data/0": struct.pack("<4f", *[value] * 4),
        "archive/version": b"3\n",
    }


def test_a_zip_with_a_second_hidden_directory_is_refused(tmp_path: Path) -> None:
    # Directory A at the offset the end record states (what torch.load reads), directory B
    # right before the end record (what zipfile reads, shifting every offset by len(A)).
    a, b = _members(1.0), _members(2.0)
    blob = b""
    offsets: dict[tuple[str, str], int] = {}
    for tag, members in (("A", a), ("B", b)):
        for name, data in members.items():
            offsets[(tag, name)] = len(blob)
            blob += zip_local(name, data)
        if tag == "A":
            blob += zip_local("archive/pad", bytes(600))
    cd_a = b"".join(zip_central(n, d, offsets[("A", n)]) for n, d in a.items())
    cd_b = b"".join(zip_central(n, d, offsets[("B", n)] - len(cd_a)) for n, d in b.items())
    assert len(cd_a) == len(cd_b)
    src = tmp_path / "dual.pt"
    src.write_bytes(blob + cd_a + cd_b + zip_end(len(a), len(cd_a), len(blob)))
    with zipfile.ZipFile(src) as z:  # zipfile reads B
        assert z.read("archive/data/0") == struct.pack("<4f", *[2.0] * 4)
    with pytest.raises(CheckpointError, match="readers disagree"):
        convert_file(src, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def _plain_zip(members: dict[str, bytes], *, extra_entries: int = 0, comment: bytes = b"") -> bytes:
    blob, cd = b"", b""
    for name, data in members.items():
        cd += zip_central(name, data, len(blob))
        blob += zip_local(name, data)
    return blob + cd + zip_end(len(members) - extra_entries, len(cd), len(blob), comment)


def test_a_plain_hand_made_zip_converts(tmp_path: Path) -> None:
    src = tmp_path / "plain.pt"
    src.write_bytes(_plain_zip(_members(3.0)))
    convert_file(src, tmp_path / "out.safetensors")
    assert _loaded(tmp_path / "out.safetensors")["w"].tolist() == [3.0] * 4


def test_a_zip_whose_directory_holds_more_than_its_end_record_counts_is_refused(
    tmp_path: Path,
) -> None:
    src = tmp_path / "count.pt"
    src.write_bytes(_plain_zip(_members(3.0), extra_entries=1))
    with pytest.raises(CheckpointError, match="counts 3 members"):
        convert_file(src, tmp_path / "out.safetensors")


def test_an_end_record_signature_in_the_comment_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "comment.pt"
    # A fake end record in the comment, one byte short of ending the file: zipfile takes it
    # (the last signature), the real record's comment length says otherwise.
    src.write_bytes(_plain_zip(_members(3.0), comment=b"PK\x05\x06" + bytes(18) + b"x"))
    with pytest.raises(CheckpointError, match="second end-of-central-directory"):
        convert_file(src, tmp_path / "out.safetensors")


def test_a_zip64_locator_pointing_elsewhere_is_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    src = tmp_path / "z64.pt"
    torch.save({"w": torch.ones(3)}, src)
    raw = bytearray(src.read_bytes())
    loc = raw.rindex(b"PK\x06\x07")
    (rec,) = struct.unpack_from("<Q", raw, loc + 8)
    assert rec == loc - 56  # torch writes a zip64 record right before the locator
    convert_file(src, tmp_path / "ok.safetensors")
    struct.pack_into("<Q", raw, loc + 8, 0)
    src.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="zip64 end-of-directory locator points"):
        convert_file(src, tmp_path / "out.safetensors")


# -- legacy storage views ----------------------------------------------------------------------


def _legacy_view_file(path: Path, views: list[tuple[str, str, int]]) -> None:
    """A legacy checkpoint of storage "0" (eight floats 0..7) and one tensor of four elements
    per ``(name, view key, view offset)``."""

    def t(view_key: str, view_offset: int) -> bytes:
        pid = b"(" + P.u("storage") + P.g("torch", "FloatStorage") + P.u("0") + P.u("cpu")
        pid += P.i(8) + b"(" + P.u(view_key) + P.i(view_offset) + P.i(4) + b"ttQ"
        return (
            P.g("torch._utils", "_rebuild_tensor_v2")
            + b"("
            + pid
            + P.i(0)
            + P.tup((4,))
            + P.tup((1,))
            + b"\x89"
            + P.g("collections", "OrderedDict")
            + b")RtR"
        )

    graph = state_dict([(name, t(key, off)) for name, key, off in views])
    info = {
        "protocol_version": 1001,
        "little_endian": True,
        "type_sizes": {"short": 2, "int": 4, "long": 4},
    }
    path.write_bytes(
        pickle.dumps(0x1950A86A20F9469CFC6C, 2)
        + pickle.dumps(1001, 2)
        + pickle.dumps(info, 2)
        + graph
        + pickle.dumps(["0"], 2)
        + struct.pack("<q", 8)
        + struct.pack("<8f", *range(8))
    )


def test_legacy_views_sharing_a_key_are_the_first_view_as_torch_reads_them(
    tmp_path: Path,
) -> None:
    src = tmp_path / "views.pt"
    _legacy_view_file(src, [("a", "v", 0), ("b", "v", 4), ("c", "u", 4)])
    convert_file(src, tmp_path / "out.safetensors")
    got = {k: v.tolist() for k, v in _loaded(tmp_path / "out.safetensors").items()}
    assert got == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [4, 5, 6, 7]}
    torch = pytest.importorskip("torch")
    expected = torch.load(src, weights_only=True)
    assert {k: v.tolist() for k, v in expected.items()} == got


def test_a_legacy_view_key_that_is_a_storage_key_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "views.pt"
    _legacy_view_file(src, [("a", "0", 4)])
    with pytest.raises(SafetensorError, match="also a storage key"):
        convert_file(src, tmp_path / "out.safetensors")


@pytest.mark.parametrize("operand", [b"Iabc\n", b"V\\u12\n", b"F1e999x\n"])
def test_a_bad_operand_is_placed_at_its_opcode(operand: bytes) -> None:
    # Errors the operand's parser raises name the opcode's byte, not the stream's start.
    data = P.PROTO2 + b"K\x01K\x02" + operand + b"."
    with pytest.raises(CheckpointError, match=r"invalid operand .* at byte 6$") as info:
        Machine(data, TorchPolicy()).run(0)
    assert info.value.offset == 6


def test_real_checkpoints_of_over_a_million_tensors_fit_the_container_budget(
    tmp_path: Path,
) -> None:
    # The budget bounds hostile pickles; it must not refuse what torch.save writes. Measured
    # on 5,000 tensors (views of one storage, as a large state dict's small tensors can be),
    # then scaled: 1.25 million tensors converted before every call counted as a container.
    torch = pytest.importorskip("torch")
    import zipfile as zf

    storage = torch.arange(5000, dtype=torch.float32)
    path = tmp_path / "many.pt"
    torch.save({f"t{i}": storage[i : i + 1] for i in range(5000)}, path)
    with zf.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    machine = policy_machine(data, TorchPolicy(), Limits())
    assert len(machine.run(0).value) == 5000
    per_tensor = machine.budget.containers / 5000
    assert per_tensor <= 6.5
    assert Limits().max_containers / per_tensor >= 1_250_000


_TEXT_NUMBERS = [
    (b"I", [b"0", b"1", b"00", b"01", b"02", b"010", b"-010", b"0x10", b"0X1f", b"08", b"0x"]),
    (b"I", [b" 7", b"+1", b" 1", b"-0", b"1_0", b"0o17", b"9" * 30, b"-" + b"9" * 19, b"0b1"]),
    (b"I", [b"077777777777777777777777", b"5\0junk", b"abc", b" ", b"1 ", b"\t-3", b"0x1g"]),
    (b"L", [b"10L", b"010L", b"0x10L", b"1_0L", b"10", b"-7L", b" 5L", b"LL", b"5LL", b"0L"]),
    (b"F", [b"1.5", b"-0.0", b"1e5", b"1E-5", b".5", b"5.", b"inf", b"-Infinity", b"nan"]),
    (b"F", [b"1_0.5", b" 1.5", b"1e999", b"-1e999", b"1e", b"0x1p3", b"1.5 ", b"1.5\0x"]),
    (b"F", [b"1e-999", b"+.5e+2", b"INF", b"nAn", b"infinit", b"-", b""]),
]


@pytest.mark.parametrize(("opcode", "operands"), _TEXT_NUMBERS)
def test_text_numbers_are_read_as_cpython_reads_them(opcode: bytes, operands: list[bytes]) -> None:
    """INT, LONG and FLOAT (protocols 0-1) as CPython's unpickler, and so torch.load, reads
    them: ``I010`` is 8, not 10 (a storage offset written so moved a tensor's values)."""
    for operand in operands:
        data = opcode + operand + b"\n."
        try:
            expected: Any = pickle.loads(data)
        except (ValueError, OverflowError, pickle.UnpicklingError):
            expected = "refused"
        try:
            got: Any = Machine(data, TorchPolicy()).run(0).value
        except CheckpointError as exc:
            assert "invalid operand" in str(exc) and exc.offset == 0
            got = "refused"
        assert repr(got) == repr(expected), (opcode, operand)


def test_a_tensor_safetensors_cannot_hold_is_refused_wherever_it_sits() -> None:
    """A sparse tensor used as a dict key has no name to give: refused all the same."""
    from pysafetensors._torch_pickle import _records

    data = P.PROTO2 + b"}ctorch._utils\n_rebuild_sparse_tensor\n)RK\x01s."
    policy = TorchPolicy()
    root = policy_machine(data, policy, None).run(0).value
    with pytest.raises(CheckpointError, match=r"^the checkpoint holds sparse tensors \(") as info:
        _records(policy, root, {}, 0)
    assert info.value.offset is not None and info.value.tensor is None


def test_a_shape_the_writer_refuses_names_the_checkpoint(tmp_path: Path) -> None:
    """A zero-size tensor whose product overflows 64 bits before its 0 passes every check
    of the pickle and is refused by the writer, whose message did not say which file."""
    src = tmp_path / "empty.pt"
    make_zip(src, state_dict([("w", tensor(size=(1 << 62, 4, 0), stride=(0, 0, 1)))]))
    with pytest.raises(SafetensorError, match=r"overflow") as info:
        convert_file(src, tmp_path / "out.safetensors")
    assert str(info.value).startswith(f"{src}: ") and info.value.kind == "ValidationOverflow"
    assert not (tmp_path / "out.safetensors").exists()


def _long1(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


#: Ints hash modulo this prime: every multiple of it hashes to 0.
_MODULUS = (1 << 61) - 1


def test_hash_collision_floods_are_refused(tmp_path: Path) -> None:
    """Dict keys that all hash alike made building the dict quadratic (160,000 of them, 2 MB
    of pickle, kept the converter busy for 3 minutes and the scanner for 6): refused once one
    hash value has over 1,000 distinct keys, by both. Keys that merely repeat are not
    collisions (the same key in many dicts, or set again)."""
    from pysafetensors.scan import scan_file

    flood = b"".join(_long1(k * _MODULUS) + b"N" for k in range(1, 2002))
    src = tmp_path / "flood.pt"
    make_zip(src, P.PROTO2 + b"}(" + P.u("w") + tensor() + P.u("cfg") + b"}(" + flood + b"uu.")
    with pytest.raises(CheckpointError, match="share one hash value") as caught:
        convert_file(src, tmp_path / "out.safetensors")
    assert caught.value.kind == "PickleLimit"
    report = scan_file(src)
    assert report.grade == "suspicious"
    assert any("share one hash value" in f.message for f in report.findings)
    # The same large key in 3,000 small dicts, and 3,000 floats whose hashes differ: plain.
    same = b"".join(b"}" + _long1(_MODULUS) + b"Ns" for _ in range(3000))
    floats = b"".join(b"G" + struct.pack(">d", i + 0.5) + b"N" for i in range(3000))
    make_zip(
        src,
        P.PROTO2
        + b"}("
        + P.u("w")
        + tensor()
        + P.u("many")
        + b"("
        + same
        + b"l"
        + P.u("floats")
        + b"}("
        + floats
        + b"uu.",
    )
    report_out = convert_file(src, tmp_path / "out.safetensors")
    assert report_out.tensors == ["w"]
    assert scan_file(src).grade == "safe"


def test_a_layout_value_in_a_state_dict_converts(tmp_path: Path) -> None:
    """torch pickles ``torch.strided`` as ``_get_layout("torch.strided")``, which
    ``torch.load(weights_only=True)`` takes: a value like any other, not a sparse tensor."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "layout.pt"
    torch.save({"w": torch.ones(2), "layout": torch.strided}, src)
    assert torch.load(src, weights_only=True)["layout"] is torch.strided
    report = convert_file(src, tmp_path / "out.safetensors", keep_non_tensors=True)
    assert report.tensors == ["w"]
    with safe_open(tmp_path / "out.safetensors", "np") as f:
        assert "torch.strided" in f.metadata()["layout"]
    # An unknown layout name is refused, as _get_layout refuses it.
    make_zip(
        src,
        P.PROTO2
        + b"}("
        + P.u("l")
        + P.g("torch.serialization", "_get_layout")
        + P.u("torch.nonsense")
        + b"\x85Ru.",
    )
    with pytest.raises(CheckpointError, match="_get_layout called with"):
        convert_file(src, tmp_path / "out2.safetensors")


def test_a_long_first_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    # A plain pickle is a legacy checkpoint only if its first pickle is the magic number (a
    # few opcodes): 8 MB of trivial opcodes ran to their end (~9 s) before that answer. The
    # refusal comes within the first opcodes, so the stream's length does not matter.
    src = tmp_path / "long.pkl"
    src.write_bytes(b"\x80\x02" + b"N0" * 4_000_000 + b"N.")
    ops_run: list[int] = []
    real_run = Machine.run

    def counting_run(self: Machine, start: int = 0) -> Any:
        ops_run.append(self.limits.max_ops)
        return real_run(self, start)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Machine, "run", counting_run)
        with pytest.raises(CheckpointError, match="first pickle is not the legacy magic number"):
            convert_file(src, tmp_path / "out.safetensors")
    assert ops_run and max(ops_run) <= 16
    assert not (tmp_path / "out.safetensors").exists()


def test_legacy_checkpoints_of_every_pickle_protocol_still_convert(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    for protocol in (1, 2, 3, 4, 5):
        src = tmp_path / f"legacy{protocol}.pt"
        torch.save(
            {"w": torch.arange(6, dtype=torch.float32)},
            src,
            _use_new_zipfile_serialization=False,
            pickle_protocol=protocol,
        )
        out = tmp_path / f"legacy{protocol}.safetensors"
        convert_file(src, out)
        with safe_open(out, "np") as f:
            assert f.get_tensor("w").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_overlapping_views_of_one_storage_are_bounded_in_all(tmp_path: Path) -> None:
    """Views ``M[k:]`` of one storage have no stride 0, so only the expanded-tensor bound saw
    them: 2,000 of a 1 MiB storage (a 1.1 MB file, read by ``torch.load`` as 2,000 views
    sharing it) wrote a 2 GB file. The whole output is bounded now."""
    numel, views = 1 << 18, 300  # ~300 MiB out of 1 MiB stored, over the 256 MiB floor
    items = [(f"t{k}", tensor(offset=k, size=(numel - k,), numel=numel)) for k in range(views)]
    src = tmp_path / "views.pt"
    make_zip(src, state_dict(items), {"0": bytes(numel * 4)})
    with pytest.raises(CheckpointError, match=r"overlapping views .* would write \d+ bytes") as e:
        convert_file(src, tmp_path / "views.safetensors")
    assert e.value.kind == "ExpandedTensor"
    assert not (tmp_path / "views.safetensors").exists()
    # A few overlapping views (well under the bound) still convert, each in full.
    make_zip(src, state_dict(items[:3]), {"0": bytes(numel * 4)})
    assert convert_file(src, tmp_path / "few.safetensors").tensors == ["t0", "t1", "t2"]
    assert [v.size for v in _loaded(tmp_path / "few.safetensors").values()] == [
        numel,
        numel - 1,
        numel - 2,
    ]


def test_compressed_storages_do_not_multiply_the_bound(tmp_path: Path) -> None:
    """The bound was a multiple of the storages' inflated size, which DEFLATE makes up to 100
    times the bytes in the file: a 113 KB checkpoint of overlapping views wrote 629 MB. It is
    a multiple of the file's size now (writing each storage once stays allowed)."""
    numel, views = 2 << 20, 40  # an 8 MiB storage, ~60x compressed; 40 views write ~320 MiB
    data = bytearray(numel * 4)
    data[::64] = random.Random(0).randbytes(len(data) // 64)
    items = [(f"t{k}", tensor(offset=k, size=(numel - k,), numel=numel)) for k in range(views)]
    src = tmp_path / "deflated.pt"
    make_zip(src, state_dict(items), {"0": bytes(data)}, compress=zipfile.ZIP_DEFLATED)
    # Under the old bound (64 times the 8 MiB inflated), over the floor and 64 times the file.
    assert src.stat().st_size * 64 < 256 << 20 < views * numel * 4 < 64 * numel * 4
    with pytest.raises(CheckpointError, match=r"overlapping views .* would write \d+ bytes") as e:
        convert_file(src, tmp_path / "out.safetensors")
    assert e.value.kind == "ExpandedTensor" and not (tmp_path / "out.safetensors").exists()
    # Two of the views (16 MiB, well under the bound) still convert.
    make_zip(src, state_dict(items[:2]), {"0": bytes(data)}, compress=zipfile.ZIP_DEFLATED)
    assert convert_file(src, tmp_path / "two.safetensors").tensors == ["t0", "t1"]


def test_a_string_shared_through_the_memo_is_rendered_within_a_budget(tmp_path: Path) -> None:
    """``keep_non_tensors``: a 1 MiB string used 10,000 times through BINGET (two bytes of
    pickle each) rendered 10 GB of JSON and ended in a foreign MemoryError."""
    big = "x" * (1 << 20)
    inner = b"](" + P.u(big) + b"q\x00" + b"h\x00" * 999 + b"eq\x01"  # [big] * 1000
    note = b"](" + inner + b"h\x01" * 9 + b"e"  # [that list] * 10
    src = tmp_path / "strings.pt"
    make_zip(src, P.PROTO2 + b"}(" + P.u("w") + tensor() + P.u("note") + note + b"u.")
    out = tmp_path / "strings.safetensors"
    convert_file(src, out, keep_non_tensors=True)
    assert out.stat().st_size < 40 << 20
    with safe_open(out, "np") as f:
        rendered = json.loads(f.metadata()["note"])
    flat = [s for row in rendered for s in row]
    kept = [s for s in flat if s == big]
    # 16 MiB of characters whole, then a marker each, up to the leaf's 10,000 values ("...").
    assert len(kept) == 16 and len(flat) > 9_900
    assert set(flat) - {big} == {f"<str of {1 << 20} characters>", "..."}
