"""0.1.1 tar checkpoints, built here as torch's ``legacy_load`` (tarfile branch) reads them.

Modern torch cannot write this format, so the tests write the members by hand following
``torch/serialization.py``; real ``torch.load(weights_only=False)`` (in a subprocess, only on
files this test wrote) is the oracle for the good files.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402

from pysafetensors._errors import CheckpointError, UnsafePickleError  # noqa: E402
from pysafetensors._torch_pickle import load_checkpoint  # noqa: E402
from pysafetensors.convert import convert_file  # noqa: E402

from .corpus import write_tar  # noqa: E402

_STORAGE_TYPES = {
    torch.float32: torch.FloatStorage,
    torch.int64: torch.LongStorage,
    torch.bfloat16: torch.BFloat16Storage,
}
_TENSOR_TYPES = {
    torch.float32: torch.FloatTensor,
    torch.int64: torch.LongTensor,
    torch.bfloat16: torch.BFloat16Tensor,
}


class _Pid:
    """A persistent reference to a tensor key (torch 0.1.x wrote ``str(cdata)``)."""

    def __init__(self, key: int) -> None:
        self.key = key


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> str | None:
        return str(obj.key) if isinstance(obj, _Pid) else None


def _p(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=2)


def _raw(data: bytes, itemsize: int, numel: int | None = None) -> bytes:
    # _new_with_file: little-endian int64 element count, then the elements.
    count = len(data) // itemsize if numel is None else numel
    return struct.pack("<q", count) + data


def _tensor_rec(key: int, storage: int, dtype: Any, size: Any, stride: Any, off: int) -> bytes:
    ndim = len(size)
    return (
        _p((key, storage, _TENSOR_TYPES[dtype]))
        + struct.pack("<i", ndim)
        + b"\0\0\0\0"
        + struct.pack(f"<{ndim}q", *size)
        + struct.pack(f"<{ndim}q", *stride)
        + struct.pack("<q", off)
    )


def _storage_bytes(t: Any) -> bytes:
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return bytes(t.numpy().tobytes())


def _graph(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _members(**over: bytes) -> dict[str, bytes]:
    """A valid checkpoint: float32 and int64 roots, a float32 view, bf16, a scalar."""
    f32 = torch.arange(12, dtype=torch.float32) * 0.5 - 2
    i64 = torch.arange(-3, 3, dtype=torch.int64) * 1000003
    bf16 = torch.tensor([1.5, -2.25, 3.0, 1e-3], dtype=torch.bfloat16)
    storages = (
        _p(3)
        + _p((1, "cpu", torch.FloatStorage))
        + _raw(_storage_bytes(f32), 4)
        + _p((2, "cpu", torch.LongStorage))
        + _raw(_storage_bytes(i64), 8)
        + _p((3, "cpu", torch.BFloat16Storage))
        + _raw(_storage_bytes(bf16), 2)
        # storage 10: elements 4..11 of storage 1
        + _p([(10, 1, 4, 8)])
    )
    tensors = (
        _p(5)
        + _tensor_rec(100, 1, torch.float32, (3, 4), (4, 1), 0)
        + _tensor_rec(101, 10, torch.float32, (2, 3), (1, 2), 1)  # strided, in the view
        + _tensor_rec(102, 2, torch.int64, (2, 3), (3, 1), 0)
        + _tensor_rec(103, 3, torch.bfloat16, (2, 2), (2, 1), 0)
        + _tensor_rec(104, 1, torch.float32, (), (), 5)  # 0-d
    )
    graph = OrderedDict(
        [
            ("w", _Pid(100)),
            ("view", _Pid(101)),
            ("ints", {"x": _Pid(102)}),
            ("bf16", _Pid(103)),
            ("scalar", _Pid(104)),
            ("epoch", 7),
        ]
    )
    out = {
        "sys_info": _p({"protocol_version": 1001, "little_endian": True, "type_sizes": {}}),
        "pickle": _graph(graph),
        "tensors": tensors,
        "storages": storages,
    }
    out.update(over)
    return out


_ORACLE = """
import json, sys, torch
sd = torch.load(sys.argv[1], weights_only=False)
def flat(o, p=""):
    if isinstance(o, torch.Tensor):
        yield p, o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield from flat(v, f"{p}.{k}" if p else str(k))
def values(t):
    return (t.double() if t.dtype.is_floating_point else t).reshape(-1).tolist()
out = {n: [str(t.dtype), list(t.shape), values(t)] for n, t in flat(sd)}
print(json.dumps(out))
"""


def _torch_oracle(path: Path) -> dict[str, Any]:
    # Only ever run on a file this test wrote itself.
    res = subprocess.run(
        [sys.executable, "-c", _ORACLE, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    loaded: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return loaded


def test_tar_checkpoint_converts_like_torch_load(tmp_path: Path) -> None:
    src = write_tar(tmp_path / "old.pt", _members())
    expected = _torch_oracle(src)
    assert set(expected) == {"w", "view", "ints.x", "bf16", "scalar"}

    with load_checkpoint(src) as ck:
        assert ck.format == "tar"
        assert ck.non_tensors == {"epoch": 7}
        assert ck.tensors["view"].storage_offset == 5  # view offset 4 + tensor offset 1
        assert set(ck.tensors) == set(expected)
        for name, (dtype, shape, values) in expected.items():
            rec = ck.tensors[name]
            assert f"torch.{rec.torch_dtype}" == dtype, name
            assert list(rec.torch_shape) == shape, name
            arr = ck.tensor_array(rec).astype("float64" if "float" in dtype else "int64")
            assert arr.reshape(-1).tolist() == values, name

    dst = tmp_path / "old.safetensors"
    report = convert_file(src, dst, verify=True)
    assert report.format == "tar"
    assert report.verified
    # "view" and "scalar" share w's storage but are other views of it (offsets, shapes):
    # written as copies, not dropped as the reference's save_model would drop them.
    assert report.dropped == {}
    with safe_open(str(dst), framework="pt") as f:
        assert set(f.keys()) == set(expected)
        assert set(f.metadata()) == {"format"}
        for name in sorted(expected):
            dtype, shape, values = expected[name]
            ours = f.get_tensor(name)
            assert str(ours.dtype) == dtype, name
            assert list(ours.shape) == shape, name
            got = ours.double() if ours.is_floating_point() else ours
            assert got.reshape(-1).tolist() == values, name


def _refused(tmp_path: Path, members: dict[str, bytes], exc: type[Exception], what: str) -> None:
    src = write_tar(tmp_path / "bad.pt", members)
    _refused_file(tmp_path, src, exc, what)


def _refused_file(tmp_path: Path, src: Path, exc: type[Exception], what: str) -> None:
    dst = tmp_path / "bad.safetensors"
    with pytest.raises(exc, match=what):
        convert_file(src, dst)
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != src.name] == []


def test_truncated_archive_refused(tmp_path: Path) -> None:
    src = write_tar(tmp_path / "bad.pt", _members())
    with open(src, "rb") as fh:
        data = fh.read()
    # Cut inside the last member (storages): its header claims more bytes than remain.
    cut = data.index(b"\0" * 1024, len(data) - 10240) - 40
    with open(src, "wb") as fh:
        fh.write(data[:cut])
    with pytest.raises(CheckpointError, match="runs past the end") as info:
        load_checkpoint(src)
    assert info.value.kind == "Truncated"
    _refused_file(tmp_path, src, CheckpointError, "runs past the end")


def test_storage_shorter_than_claimed_refused(tmp_path: Path) -> None:
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    storages = _p(1) + _p((1, "cpu", torch.FloatStorage)) + _raw(f32, 4, numel=1000) + _p([])
    tensors = _p(1) + _tensor_rec(100, 1, torch.float32, (4,), (1,), 0)
    _refused(
        tmp_path,
        _members(storages=storages, tensors=tensors, pickle=_graph({"w": _Pid(100)})),
        CheckpointError,
        "claims 1000",
    )


def test_tensor_past_its_view_refused(tmp_path: Path) -> None:
    tensors = _p(1) + _tensor_rec(100, 10, torch.float32, (3, 3), (3, 1), 0)  # view holds 8
    members = _members(tensors=tensors, pickle=_graph({"w": _Pid(100)}))
    _refused(tmp_path, members, CheckpointError, "reaches past")


def test_os_system_in_pickle_member_refused(tmp_path: Path) -> None:
    evil = b"cos\nsystem\n(S'echo pwned > /tmp/pysafetensors-tar-pwned'\ntR."
    _refused(tmp_path, _members(pickle=evil), UnsafePickleError, "os.system")
    assert not os.path.exists("/tmp/pysafetensors-tar-pwned")


def test_os_system_in_storage_record_refused(tmp_path: Path) -> None:
    evil = _p(1) + b"\x80\x02(K\x01X\x03\x00\x00\x00cpucos\nsystem\nt."
    _refused(tmp_path, _members(storages=evil), UnsafePickleError, "os.system")


def test_link_member_refused(tmp_path: Path) -> None:
    src = tmp_path / "bad.pt"
    members = _members()
    with tarfile.open(src, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            if name == "pickle":
                info = tarfile.TarInfo(name)
                info.type = tarfile.SYMTYPE
                info.linkname = "/etc/passwd"
                tar.addfile(info)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    _refused_file(tmp_path, src, CheckpointError, "not a regular file")


def test_duplicate_member_refused(tmp_path: Path) -> None:
    src = tmp_path / "bad.pt"
    members = _members()
    with tarfile.open(src, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [*members.items(), ("pickle", members["pickle"])]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    _refused_file(tmp_path, src, CheckpointError, "twice")


def _u(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def test_whole_pickled_module_converts_with_skip_unknown(tmp_path: Path) -> None:
    # torch 0.1 named a module's class by a (class, source file, source) persistent id.
    cls = b"ctorch.nn.modules.linear\nLinear\n"
    graph = (
        b"\x80\x02("
        + cls
        + _u("linear.py")
        + _u("class Linear: ...")
        + b"tQ)\x81}("
        + _u("_parameters")
        + b"}("
        + _u("weight")
        + _u("100")
        + b"Q"
        + _u("bias")
        + b"Nu"
        + _u("_buffers")
        + b"}("
        + _u("count")
        + _u("104")
        + b"Qu"
        + _u("_modules")
        + b"}"
        + _u("training")
        + b"\x88ub."
    )
    src = write_tar(tmp_path / "model.pt", _members(pickle=graph))
    oracle = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
            "print(json.dumps({k: v.reshape(-1).tolist() for k, v in m.state_dict().items()}))",
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert oracle.returncode == 0, oracle.stderr
    expected = json.loads(oracle.stdout.strip().splitlines()[-1])
    assert list(expected) == ["weight", "count"]
    with pytest.raises(UnsafePickleError, match="torch.nn.modules.linear.Linear"):
        convert_file(src, tmp_path / "err.safetensors")
    report = convert_file(src, tmp_path / "m.safetensors", unknown="skip")
    assert report.tensors == list(expected)
    assert report.modules == {"": "torch.nn.modules.linear.Linear"}
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        for name, values in expected.items():
            assert f.get_tensor(name).reshape(-1).tolist() == values
    # Another tuple is no persistent id torch writes.
    bad = write_tar(tmp_path / "bad.pt", _members(pickle=graph.replace(b"tQ)", b"NtQ)", 1)))
    with pytest.raises(CheckpointError, match="unknown persistent id"):
        convert_file(bad, tmp_path / "bad.safetensors", unknown="skip")
