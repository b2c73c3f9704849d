"""Files that the scanner and the loader would read differently: each is built here and graded
dangerous, and (with torch installed) shown live: ``torch.load(weights_only=False)``, or
``pickle.load`` of a buffered file, runs its ``os.system`` in a subprocess.

* FRAME desync: CPython's C unpickler reading a file keeps each frame in a buffer of its own
  (always from an ``io.BytesIO``, as ``torch.load`` reads a zip member; from a buffered file for
  frames of 8 KiB and more). An operand that runs past the frame is read from the bytes after
  the frame and the rest of the frame is dropped, so ``frame(b"g1") + b"2\\n"`` is GET 2 to
  CPython and GET 12 to a linear reader.
* A zip with two central directories: torch's reader (miniz) uses the end record's stated
  offset, Python's ``zipfile`` the directory right before the end record.
* Tar routing: ``torch.load`` tries ``tarfile`` first, which takes old V7 headers (no
  ``ustar``) whose checksum is right, whatever the file's first bytes are.
"""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pysafetensors.scan import scan_bytes, scan_file

from .corpus import (
    LEGACY_INFO,
    LEGACY_MAGIC,
    LEGACY_PROTO,
    ZIP_END,
    P,
    payload,
    zip_central,
    zip_end,
    zip_local,
)


def _load(paths: list[Path], load: str) -> None:
    """Run ``load`` (of ``p``) on each file in a subprocess; errors after a payload are fine."""
    code = (
        "import sys, pickle\n"
        "for p in sys.argv[1:]:\n"
        f"    try: {load}\n"
        "    except Exception as e: print(p, type(e).__name__, e)\n"
    )
    subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, *map(str, paths)],
        capture_output=True,
        timeout=120,
        check=False,
    )


def _zip_bytes(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/version", "3\n")
    return buf.getvalue()


def _evil_dict(canary: Path) -> bytes:
    return P.PROTO2 + b"}" + P.u("w") + payload("os", "system", canary) + b"s."


# --------------------------------------------------------------------------------------------
# FRAME desync.
# --------------------------------------------------------------------------------------------


def _frame(body: bytes) -> bytes:
    return b"\x95" + struct.pack("<Q", len(body)) + body


def _put(text: str, idx: int) -> bytes:
    return b"V" + text.encode() + b"\n" + b"p%d\n0" % idx


#: BINBYTES of 9000 bytes then POP: a frame this large is read into a buffer of its own from
#: a buffered file too (CPython does so from 8 KiB).
_PAD = b"B" + struct.pack("<I", 9000) + bytes(9000) + b"0"


def _get_desync(canary: Path, pad: bytes = b"") -> bytes:
    """Linear: ``collections.OrderedDict("touch ...")``; CPython from a file: ``os.system``."""
    p = _put("os", 2) + _put("system", 3) + _put("collections", 12) + _put("OrderedDict", 13)
    p += _frame(pad + b"g1") + b"2\n"  # linear GET 12, CPython GET 2
    p += _frame(pad + b"g1") + b"3\n"  # linear GET 13, CPython GET 3
    p += b"\x93" + P.u(f"touch {canary}") + b"\x85R0"
    return b"\x80\x04" + p + b"}."


def _frame_zip(canary: Path) -> bytes:
    return _zip_bytes(_get_desync(canary))


def _frame_legacy(canary: Path) -> bytes:
    """A legacy checkpoint (torch.load reads it from a buffered file): frames over 8 KiB."""
    return LEGACY_MAGIC + LEGACY_PROTO + LEGACY_INFO + _get_desync(canary, _PAD) + b"\x80\x02]."


def _frame_pickle(canary: Path) -> bytes:
    return _get_desync(canary, _PAD)


def _frame_length(canary: Path) -> bytes:
    """A frame that ends inside BINUNICODE's length: CPython reads the length (0) after the
    frame and runs the opcodes a linear reader takes for the string's bytes."""
    mal = payload("os", "system", canary) + b"0"
    pkl = b"\x80\x04" + _frame(b"X" + struct.pack("<H", 2 + len(mal))) + bytes(4) + mal + b"0}."
    return _zip_bytes(pkl)


@pytest.mark.parametrize("build", [_frame_zip, _frame_legacy, _frame_pickle, _frame_length])
def test_frame_desync_files_are_dangerous(tmp_path: Path, build: Callable[[Path], bytes]) -> None:
    path = tmp_path / "f.pt"
    path.write_bytes(build(tmp_path / "ran"))
    report = scan_file(path)
    assert report.grade == "dangerous", report.findings
    prefix = "an operand crosses the end of its FRAME: CPython and this scanner"
    assert any(f.message.startswith(prefix) for f in report.findings), report.findings
    # What a linear reading imports is harmless: the FRAME finding alone grades the file.
    assert all(g.grade == "safe" for g in report.globals)


@pytest.mark.parametrize(
    "body",
    [
        _frame(b"g1") + b"2\n",  # GET
        _frame(b"Np1") + b"2\n0",  # PUT
        _frame(b"I1") + b"2\n0",  # INT
        _frame(b"L1") + b"2L\n0",  # LONG
        _frame(b"F1") + b".5\n0",  # FLOAT
        _frame(b"Vab") + b"c\n0",  # UNICODE
        _frame(b"S'a") + b"b'\n0",  # STRING
        _frame(b"ccollections\nOrd") + b"eredDict\n0",  # GLOBAL, second line
        _frame(b"ccollec") + b"tions\nOrderedDict\n0",  # GLOBAL, first line
        _frame(b"C\x04ab") + b"cd0",  # SHORT_BINBYTES
        _frame(b"J\x01\x00") + b"\x00\x000",  # BININT
        _frame(b"N" + _frame(b"0")),  # a FRAME inside a frame
        _frame(b"N.N"),  # STOP inside a frame that announces more bytes
    ],
    ids=[
        "GET",
        "PUT",
        "INT",
        "LONG",
        "FLOAT",
        "UNICODE",
        "STRING",
        "GLOBAL2",
        "GLOBAL1",
        "SHORT_BINBYTES",
        "BININT",
        "nested-FRAME",
        "STOP",
    ],
)
def test_every_frame_desync_is_dangerous(body: bytes) -> None:
    prefix = b"\x80\x04Vxxxxxxxxxxxx\np1\np12\n0"  # memo 1 and 12 hold a string
    report = scan_bytes(prefix + body + b"N.", "f.pkl")
    assert report.grade == "dangerous", (body, report.findings)
    assert any("FRAME" in f.message and f.grade == "dangerous" for f in report.findings)


def test_frames_that_end_at_opcode_boundaries_stay_safe(tmp_path: Path) -> None:
    # A line that ends exactly at its frame's end, or starts right after it (GET is the frame's
    # last byte), is read alike by every reader.
    data = b"\x80\x04" + _frame(b"Vab\np0\n0") + _frame(b"I12\n0") + _frame(b"g") + b"0\n0N."
    report = scan_bytes(data)
    assert (report.grade, report.findings) == ("safe", []), report.findings
    torch = pytest.importorskip("torch")
    big = {"w": torch.ones(3000), "s": "x" * 70000, "l": list(range(30000))}
    for proto in (2, 4, 5):
        for zipped in (True, False):
            path = tmp_path / f"c{proto}{zipped}.pt"
            torch.save(big, path, pickle_protocol=proto, _use_new_zipfile_serialization=zipped)
            assert scan_file(path).grade == "safe", (proto, zipped)
        path = tmp_path / f"p{proto}.pkl"
        path.write_bytes(pickle.dumps({"s": "y" * 70000, "l": list(range(30000))}, proto))
        assert scan_file(path).grade == "safe", proto


# --------------------------------------------------------------------------------------------
# Zip central directories.
# --------------------------------------------------------------------------------------------

_END64 = struct.Struct("<4sQHHIIQQQQ")
_LOCATOR = struct.Struct("<4sIQI")


def _dual_directory_zip(canary: Path) -> bytes:
    """miniz reads directory A (the evil data.pkl), zipfile directory B (a clean one)."""
    evil, good = _evil_dict(canary), P.PROTO2 + b"}."
    blob, offs = b"", {}
    for key, name, data in [
        ("evil", "archive/data.pkl", evil),
        ("ver", "archive/version", b"3\n"),
        ("pad", "archive/pad", bytes(200)),
        ("good", "archive/data.pkl", good),
    ]:
        offs[key] = len(blob)
        blob += zip_local(name, data)
    cd_a = zip_central("archive/data.pkl", evil, offs["evil"])
    cd_a += zip_central("archive/version", b"3\n", offs["ver"])
    shift = len(cd_a)  # zipfile adds the gap to every offset of directory B
    cd_b = zip_central("archive/data.pkl", good, offs["good"] - shift)
    cd_b += zip_central("archive/version", b"3\n", offs["ver"] - shift)
    assert len(cd_b) == shift
    return blob + cd_a + cd_b + zip_end(2, shift, len(blob))


def test_zip_with_two_central_directories_is_dangerous(tmp_path: Path) -> None:
    report = scan_bytes(_dual_directory_zip(tmp_path / "ran"))
    assert report.grade == "dangerous"
    assert any("central directory" in f.message and "miniz" in f.message for f in report.findings)


def _comment_signature_zip(canary: Path) -> bytes:
    """zipfile takes a signature in the comment for the end record and gives up; miniz skips
    it (no whole record after it) and loads the archive."""
    raw = _zip_bytes(P.PROTO2 + payload("os", "system", canary) + b".")
    return raw[:-2] + struct.pack("<H", 10) + b"PK\x05\x06xxxxxx"


def test_zip_end_record_signature_in_the_comment(tmp_path: Path) -> None:
    """The scanner reads the directory miniz reads (it was 'unreadable', suspicious)."""
    report = scan_bytes(_comment_signature_zip(tmp_path / "ran"))
    assert report.grade == "dangerous"
    assert "os.system" in {g.qualname for g in report.globals}


def test_zip64_locator_pointing_at_another_record(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3)}, tmp_path / "t.pt")
    d = (tmp_path / "t.pt").read_bytes()
    assert scan_bytes(d).grade == "safe"
    end = d.rfind(b"PK\x05\x06")
    rec = _END64.unpack_from(d, end - _LOCATOR.size - _END64.size)
    cd = d[rec[9] : rec[9] + rec[8]]
    renamed = cd.replace(b"/version", b"/versioN")
    # [members][renamed directory][its zip64 record][directory][zip64 record][locator][end]
    at_a = rec[9]
    at_b = at_a + len(renamed) + _END64.size
    out = d[:at_a] + renamed + _END64.pack(*rec[:8], len(renamed), at_a)
    out += cd + _END64.pack(*rec[:8], len(cd), at_b)
    out += _LOCATOR.pack(b"PK\x06\x07", 0, at_a + len(renamed), 1)
    out += ZIP_END.pack(b"PK\x05\x06", 0, 0, rec[6], rec[7], len(cd), at_b, 0)
    report = scan_bytes(out)
    assert report.grade == "dangerous"
    assert any("zip64 end record" in f.message for f in report.findings)
    # torch's reader really follows the locator; zipfile does not.
    (tmp_path / "t64.pt").write_bytes(out)
    assert "versioN" in torch._C.PyTorchFileReader(str(tmp_path / "t64.pt")).get_all_records()
    with zipfile.ZipFile(tmp_path / "t64.pt") as zf:
        assert not any(n.endswith("versioN") for n in zf.namelist())


# --------------------------------------------------------------------------------------------
# Tar routing.
# --------------------------------------------------------------------------------------------


def _tar_bytes(canary: Path, first: tuple[str, bytes]) -> bytearray:
    """A torch 0.1.1 tar checkpoint whose 'pickle' member runs the payload."""
    members = [
        first,
        ("storages", pickle.dumps(0, 2) + pickle.dumps([], 2)),
        ("tensors", pickle.dumps(0, 2)),
        ("pickle", _evil_dict(canary)),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return bytearray(buf.getvalue())


def _headers(raw: bytearray) -> tuple[list[int], int]:
    """Offsets of the member headers, and where the last member's blocks end."""
    out, off = [], 0
    while off + 512 <= len(raw) and any(raw[off : off + 512]):
        out.append(off)
        size = int(raw[off + 124 : off + 136].rstrip(b"\0 ") or b"0", 8)
        off += 512 + (size + 511) // 512 * 512
    return out, off


def _v7(raw: bytearray, headers: list[int]) -> None:
    """Drop the ustar magic and version of every header, and fix the checksums."""
    for off in headers:
        raw[off + 257 : off + 265] = bytes(8)
        raw[off + 148 : off + 156] = b" " * 8
        raw[off + 148 : off + 156] = b"%06o\0 " % sum(raw[off : off + 512])


def _v7_polyglot(canary: Path) -> bytes:
    """A V7 tar whose first name starts a BINBYTES that swallows the archive up to a final
    STOP: as a pickle it is one clean bytes value, as a tar it runs the 'pickle' member."""
    raw = _tar_bytes(canary, ("B", b"x"))
    headers, end = _headers(raw)
    del raw[end:]  # no end-of-archive blocks
    raw[-1:] = b"."  # in the last member's padding
    raw[0:5] = b"B" + struct.pack("<I", len(raw) - 6)
    _v7(raw, headers)
    return bytes(raw)


def _v7_safetensors_shaped(canary: Path) -> bytes:
    """A V7 tar whose byte 8 is '{' (inside the first name): shaped like a safetensors file."""
    raw = _tar_bytes(canary, ("A", b""))
    raw[8:9] = b"{"
    _v7(raw, _headers(raw)[0])
    return bytes(raw)


def _tar_with_end_record(canary: Path) -> bytes:
    """A ustar checkpoint with an empty zip end record appended (torch reads it as a tar)."""
    return bytes(_tar_bytes(canary, ("A", b""))) + zip_end(0, 0, 0)


@pytest.mark.parametrize("build", [_v7_polyglot, _v7_safetensors_shaped, _tar_with_end_record])
def test_tar_readings_are_all_scanned(tmp_path: Path, build: Callable[[Path], bytes]) -> None:
    path = tmp_path / "t.pt"
    path.write_bytes(build(tmp_path / "ran"))
    with tarfile.open(path) as tar:
        assert tar.getnames()[-1] == "pickle"
    report = scan_file(path)
    assert report.grade == "dangerous", report.findings
    assert any(g.qualname == "os.system" and g.where.endswith(":pickle") for g in report.globals)


def test_tar_with_a_huge_pax_record_is_read_in_bounded_memory(tmp_path: Path) -> None:
    import tracemalloc

    for size in (8 << 30, 1 << 80):  # GNU base-256 size fields
        header = bytearray(512)
        header[0:14] = b"././@PaxHeader"
        header[100:108], header[108:124] = b"0000644\0", bytes(16)
        header[124:136] = b"\x80" + size.to_bytes(11, "big")
        header[136:148] = b"00000000000\0"
        header[156:157] = b"x"
        header[257:265] = b"ustar\x0000"
        header[148:156] = b" " * 8
        header[148:156] = b"%06o\0 " % sum(header)
        path = tmp_path / "pax.pt"
        path.write_bytes(bytes(header) + bytes(1024))
        tracemalloc.start()
        try:
            report: Any = scan_file(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert report.grade == "suspicious", report.findings
        assert not any("internal error" in f.message for f in report.findings), report.findings
        assert peak < 16 << 20


def test_the_header_checksum_decides_what_is_a_tar(tmp_path: Path) -> None:
    from pysafetensors.scan import _is_tar

    raw = _tar_bytes(tmp_path / "ran", ("a", b"x"))
    assert _is_tar(bytes(raw))
    _v7(raw, [0])
    assert _is_tar(bytes(raw))  # no ustar magic: still a tar to tarfile (and torch)
    raw[148] ^= 1
    assert not _is_tar(bytes(raw))  # a bad checksum: tarfile refuses it
    assert not _is_tar(bytes(512))


# --------------------------------------------------------------------------------------------
# Every file above is live.
# --------------------------------------------------------------------------------------------


def test_the_attack_files_are_live(tmp_path: Path) -> None:
    """Each file runs its payload where a victim loads it: torch.load(weights_only=False) (one
    subprocess for all), or pickle.load of a buffered file for the plain pickle."""
    pytest.importorskip("torch")
    builds: list[Callable[[Path], bytes]] = [
        _frame_zip,
        _frame_legacy,
        _frame_length,
        _dual_directory_zip,
        _comment_signature_zip,
        _v7_polyglot,
        _v7_safetensors_shaped,
        _tar_with_end_record,
    ]
    paths = []
    for build in builds:
        paths.append(tmp_path / f"{build.__name__}.pt")
        paths[-1].write_bytes(build(tmp_path / f"ran{build.__name__}"))
    _load(paths, "import torch; torch.load(p, weights_only=False)")
    (tmp_path / "f.pkl").write_bytes(_frame_pickle(tmp_path / "ran_frame_pickle"))
    _load([tmp_path / "f.pkl"], "pickle.load(open(p, 'rb'))")
    ran = sorted(p.name[3:] for p in tmp_path.glob("ran*"))
    assert ran == sorted([b.__name__ for b in builds] + ["_frame_pickle"])
