"""``unknown="skip"``: a whole pickled model (``torch.save(model)``) converts as its state dict.

The models are saved by the real ``torch.save`` in a child process whose script is ``__main__``
(so its classes are pickled as ``__main__.Name``, as a training script's are); the same child
computes ``model.state_dict()`` and prints, for each key in order, the SHA-256 of the tensor's
bytes, its dtype and shape: the oracle for what the converter writes, key for key and byte for
byte. Hostile module states are assembled opcode by opcode.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import CheckpointError, UnsafePickleError
from pysafetensors._torch_pickle import load_checkpoint
from pysafetensors.convert import convert_file, convert_folder
from pysafetensors.numpy import load_file

from .corpus import (
    F32x4,
    P,
    cli,
    legacy_tensor,
    make_legacy,
    make_zip,
    run_writer,
    state_dict,
    tensor,
)

_WRITER = textwrap.dedent(
    """
    import hashlib, json, os, sys

    import torch
    from torch import nn


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 8)
            self.act = nn.ReLU()
            self.norm = nn.BatchNorm1d(8)
            self.fc2 = nn.Linear(8, 2)
            self.scale = nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return self.fc2(self.norm(self.act(self.fc1(x)))) * self.scale


    class Buffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3, bias=False)  # a None bias
            self.register_buffer("kept", torch.arange(5, dtype=torch.int64))
            self.register_buffer("cache", torch.ones(4, 4), persistent=False)
            self.register_buffer("nothing", None)
            self.register_parameter("absent", None)
            self.register_buffer("step", torch.tensor(7, dtype=torch.int32))


    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied weights
            self.block = nn.Linear(4, 4)
            self.again = self.block  # one submodule under two names


    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Sequential(nn.Linear(3, 3)))
            self.layers = nn.ModuleList([nn.Linear(3, 3), nn.LayerNorm(3), None])
            self.heads = nn.ModuleDict({"b": nn.Linear(3, 1), "a": nn.Conv1d(3, 2, 2)})
            self.rnn = nn.LSTM(3, 4, num_layers=2)
            self.attn = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
            self.bn = nn.BatchNorm2d(3)


    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + sys.argv[2],))


    def digest(t):
        t = t.detach().reshape(-1).contiguous()
        return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


    def oracle(sd, prefix=""):
        return [[prefix + k, digest(v), str(v.dtype), list(v.shape)] for k, v in sd.items()]


    out = sys.argv[1]
    torch.manual_seed(0)
    mlp = MLP()
    mlp.train()
    mlp(torch.randn(6, 4)).sum().backward()  # BatchNorm statistics and num_batches_tracked move
    nested = Nested()
    nested.bn(torch.randn(2, 3, 4, 4))
    models = {"mlp": mlp, "buffers": Buffers(), "tied": Tied(), "nested": nested}
    oracles = {}
    for name, model in models.items():
        torch.save(model, os.path.join(out, name + ".pt"))
        oracles[name + ".pt"] = oracle(model.state_dict())
    for proto in (1, 5):  # protocol 1 builds objects by copyreg._reconstructor
        torch.save(nested, os.path.join(out, f"proto{proto}.pt"), pickle_protocol=proto)
        oracles[f"proto{proto}.pt"] = oracle(nested.state_dict())
    torch.save(mlp, os.path.join(out, "legacy.pt"), _use_new_zipfile_serialization=False)
    oracles["legacy.pt"] = oracle(mlp.state_dict())
    torch.save(nested, os.path.join(out, "legacy_nested.pt"), _use_new_zipfile_serialization=False)
    oracles["legacy_nested.pt"] = oracle(nested.state_dict())
    torch.save({"model": mlp, "epoch": 3, "tied": models["tied"]}, os.path.join(out, "in_dict.pt"))
    oracles["in_dict.pt"] = oracle(mlp.state_dict(), "model.") + oracle(
        models["tied"].state_dict(), "tied."
    )
    evil = Buffers()
    evil.payload = Evil()
    torch.save(evil, os.path.join(out, "evil.pt"))
    print(json.dumps(oracles))
    """
)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    """The saved models, and ``{file: [[name, sha256, dtype, shape], ...]}`` in
    ``state_dict()`` order."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("models")
    return folder, run_writer(folder, _WRITER)


def _written_as(path: Path, dropped: dict[str, str]) -> dict[str, list[Any]]:
    """``{name: [sha256, dtype, shape]}`` of a converted file, tied names as their kept one."""
    out: dict[str, list[Any]] = {}
    for name, array in load_file(path).items():
        raw = np.ascontiguousarray(array).tobytes()
        out[name] = [hashlib.sha256(raw).hexdigest(), f"torch.{array.dtype}", list(array.shape)]
    out.update({d: out[k] for d, k in dropped.items()})
    return out


def _check_against_oracle(src: Path, dst: Path, oracle: list[Any], **kwargs: Any) -> Any:
    report = convert_file(src, dst, unknown="skip", **kwargs)
    names = [row[0] for row in oracle]
    # Key for key, in state_dict() order (before tied names are dropped) ...
    with load_checkpoint(src, unknown="skip") as ck:
        prefix = f"{kwargs['subtree']}." if kwargs.get("subtree") else ""
        assert [n[len(prefix) :] for n in ck.tensors if n.startswith(prefix)] == names
    assert [n for n in names if n not in report.dropped] == report.tensors
    # ... and byte for byte, with torch's dtype and shape.
    written = _written_as(dst, report.dropped)
    assert {n: written[n] for n in names} == {row[0]: row[1:] for row in oracle}
    return report


# -- real models --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["mlp.pt", "buffers.pt", "tied.pt", "nested.pt", "proto1.pt", "proto5.pt"]
)
def test_whole_models_convert_as_their_state_dict(written: Any, tmp_path: Path, name: str) -> None:
    folder, oracles = written
    report = _check_against_oracle(
        folder / name, tmp_path / "out.safetensors", oracles[name], verify=True
    )
    assert report.verified is not None
    classes = {"mlp.pt": "MLP", "buffers.pt": "Buffers", "tied.pt": "Tied"}
    assert next(iter(report.modules.items())) == ("", f"__main__.{classes.get(name, 'Nested')}")
    assert report.skipped_objects == {}
    assert all(g in report.unknown_globals for g in set(report.modules.values()))


def test_mlp_modules_and_batchnorm_counter(written: Any, tmp_path: Path) -> None:
    folder, oracles = written
    report = _check_against_oracle(folder / "mlp.pt", tmp_path / "m.safetensors", oracles["mlp.pt"])
    assert report.modules == {
        "": "__main__.MLP",
        "fc1": "torch.nn.modules.linear.Linear",
        "act": "torch.nn.modules.activation.ReLU",
        "norm": "torch.nn.modules.batchnorm.BatchNorm1d",
        "fc2": "torch.nn.modules.linear.Linear",
    }
    # The model's own parameter first, then its submodules', as state_dict() orders them.
    assert report.tensors[0] == "scale"
    assert "norm.num_batches_tracked" in report.tensors
    counter = load_file(tmp_path / "m.safetensors")["norm.num_batches_tracked"]
    assert counter.dtype == np.int64 and counter.shape == () and int(counter) == 1


def test_non_persistent_buffers_and_none_entries_are_left_out(written: Any, tmp_path: Path) -> None:
    folder, oracles = written
    report = _check_against_oracle(
        folder / "buffers.pt", tmp_path / "b.safetensors", oracles["buffers.pt"]
    )
    assert report.tensors == ["kept", "step", "lin.weight"]
    # The non-persistent buffer is a tensor of the pickle that no name reaches.
    assert report.skipped_tensors == 1


def test_tied_weights_and_shared_submodules(written: Any, tmp_path: Path) -> None:
    folder, oracles = written
    report = _check_against_oracle(
        folder / "tied.pt", tmp_path / "t.safetensors", oracles["tied.pt"]
    )
    # Tied names are written once, as today's tied-tensor rule keeps them: the
    # lexicographically first name (recorded in the metadata as {dropped: kept}).
    assert report.dropped == {
        "head.weight": "embed.weight",
        "block.weight": "again.weight",
        "block.bias": "again.bias",
    }
    assert list(report.modules) == ["", "embed", "head", "block", "again"]


def test_legacy_format_models(written: Any, tmp_path: Path) -> None:
    folder, oracles = written
    for name in ("legacy.pt", "legacy_nested.pt"):
        report = _check_against_oracle(
            folder / name, tmp_path / f"{name}.safetensors", oracles[name], verify=True
        )
        assert report.format == "legacy"
        assert report.modules[""].startswith("__main__.")


def test_models_as_values_of_a_state_dict(written: Any, tmp_path: Path) -> None:
    folder, oracles = written
    report = _check_against_oracle(
        folder / "in_dict.pt", tmp_path / "d.safetensors", oracles["in_dict.pt"]
    )
    assert report.non_tensors == {"epoch": 3}
    assert report.modules["model"] == "__main__.MLP" and report.modules["tied"] == "__main__.Tied"
    assert "" not in report.modules
    # --subtree picks one model, named as its own state_dict() names it.
    mlp_oracle = [row for row in oracles["mlp.pt"]]
    sub = _check_against_oracle(
        folder / "in_dict.pt", tmp_path / "s.safetensors", mlp_oracle, subtree="model"
    )
    assert sub.modules[""] == "__main__.MLP" and sub.modules["fc1"].endswith(".Linear")
    assert "tied" not in sub.modules


def test_error_mode_still_refuses_with_its_hint(written: Any, tmp_path: Path) -> None:
    folder, _ = written
    dst = tmp_path / "out.safetensors"
    with pytest.raises(UnsafePickleError) as exc:
        convert_file(folder / "mlp.pt", dst)
    assert exc.value.skippable and exc.value.global_name == "__main__.MLP"
    assert not dst.exists()
    res = cli("convert", str(folder / "mlp.pt"), str(dst))
    assert res.returncode == 1 and not dst.exists()
    hint = res.stderr.splitlines()[1]
    assert hint.startswith("hint: --skip-unknown") and "whole pickled model" in hint


def test_cli_names_the_module_classes_walked(written: Any, tmp_path: Path) -> None:
    folder, _ = written
    dst = tmp_path / "out.safetensors"
    res = cli("convert", "--skip-unknown", str(folder / "tied.pt"), str(dst))
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if "whole model" in x)
    assert "5 modules" in line and "state_dict code is not run" in line
    assert "__main__.Tied, torch.nn.modules.sparse.Embedding, " in line
    assert "torch.nn.modules.linear.Linear x3" in line
    assert "skipped unknown objects" not in res.stdout
    res = cli("convert", "--skip-unknown", "--json", str(folder / "tied.pt"), str(dst))
    assert json.loads(res.stdout)["files"][0]["modules"][""] == "__main__.Tied"


def test_a_dangerous_global_anywhere_is_still_refused(written: Any, tmp_path: Path) -> None:
    folder, _ = written
    dst = tmp_path / "evil.safetensors"
    with pytest.raises(UnsafePickleError, match="posix.system|os.system") as exc:
        convert_file(folder / "evil.pt", dst, unknown="skip")
    assert not exc.value.skippable
    assert not dst.exists() and not (folder / "canary").exists()


def test_a_folder_converts_a_whole_model_file(written: Any, tmp_path: Path) -> None:
    folder, oracles = written
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").write_bytes((folder / "nested.pt").read_bytes())
    report = convert_folder(src, tmp_path / "out", unknown="skip")
    assert report.left_out == {}
    assert report.files[0].tensors[0] == oracles["nested.pt"][0][0]


# -- hostile module states ----------------------------------------------------------------------


def _items(pairs: list[tuple[str, bytes]]) -> bytes:
    return b"(" + b"".join(P.u(k) + v for k, v in pairs) + b"u" if pairs else b""


def _module(
    cls: str = "Net",
    params: list[tuple[str, bytes]] | None = None,
    buffers: list[tuple[str, bytes]] | None = None,
    modules: list[tuple[str, bytes]] | None = None,
    *,
    memo: int | None = None,
    extra: bytes = b"",
) -> bytes:
    """``mylib.<cls>()`` built with a module's state: each list is a ``{name: value}`` dict."""
    put = b"" if memo is None else b"q" + bytes([memo])
    return (
        P.g("mylib", cls)
        + b")\x81"
        + put
        + b"}("
        + P.u("_parameters")
        + b"}"
        + _items(params or [])
        + P.u("_buffers")
        + b"}"
        + _items(buffers or [])
        + P.u("_modules")
        + b"}"
        + _items(modules or [])
        + extra
        + b"ub"
    )


def _convert_raw(tmp_path: Path, pkl: bytes, storages: dict[str, bytes] | None = None) -> Any:
    make_zip(tmp_path / "m.pt", P.PROTO2 + pkl + b".", storages)
    return convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors", unknown="skip")


def test_hand_made_module_converts(tmp_path: Path) -> None:
    sub = _module("Lin", params=[("weight", tensor()), ("bias", b"N")])
    report = _convert_raw(tmp_path, _module(buffers=[("b", tensor())], modules=[("l", sub)]))
    assert report.tensors == ["b"] and report.dropped == {"l.weight": "b"}
    assert report.modules == {"": "mylib.Net", "l": "mylib.Lin"}
    # The state as a (None, slots) pair, and over two BUILDs, are attributes all the same.
    head = P.g("mylib", "Net") + b")\x81"
    empty = P.u("_parameters") + b"}" + P.u("_buffers") + b"}"
    pair = head + b"N}(" + empty + P.u("_modules") + b"}" + _items([("l", sub)]) + b"u\x86b"
    assert _convert_raw(tmp_path, pair).modules == {"": "mylib.Net", "l": "mylib.Lin"}
    twice = head + b"}(" + empty + b"ub}(" + P.u("_modules") + b"}" + _items([("l", sub)]) + b"ub"
    assert _convert_raw(tmp_path, twice).tensors == ["l.weight"]


def test_the_class_itself_is_never_a_module(tmp_path: Path) -> None:
    # BUILD on the global (not an object of it) is dropped: it stays a skipped value.
    cls = P.g("mylib", "Net") + b"}(" + P.u("_parameters") + b"}" + P.u("_buffers") + b"}"
    cls += P.u("_modules") + b"}ub"
    report = _convert_raw(tmp_path, b"}(" + P.u("w") + tensor() + P.u("net") + cls + b"u")
    assert report.tensors == ["w"] and report.modules == {}
    assert report.skipped_objects == {"net": "mylib.Net"}


@pytest.mark.parametrize(
    ("pkl", "message"),
    [
        (
            _module(extra=P.u("_parameters") + b"]"),
            r"module mylib\.Net \(built at byte \d+ of the pickle\): its _parameters is a list, "
            "not a dict",
        ),
        (_module(params=[("w", P.i(3))]), "its parameter 'w' is a int object, not a tensor"),
        (
            _module(buffers=[("b", _module("Inner"))]),
            r"its buffer 'b' is a mylib\.Inner object, not a tensor",
        ),
        (
            _module(modules=[("m", b"]")]),
            "its submodule 'm' is a list, not a module",
        ),
        (
            _module(modules=[("m", P.g("mylib", "Other") + b")\x81")]),
            r"submodule 'm' is a mylib\.Other object without a module's attributes",
        ),
        (
            _module(modules=[("m", P.g("mylib", "Other") + b")\x81}(" + P.u("_modules") + b"}ub")]),
            r"submodule 'm' is a mylib\.Other object without _parameters, _buffers",
        ),
        (
            _module(params=[("x", tensor())], modules=[("x", _module("Inner"))]),
            "'x' is both a parameter or buffer and a submodule",
        ),
        (
            _module(extra=P.u("_non_persistent_buffers_set") + b"]"),
            "its _non_persistent_buffers_set is a list, not a set",
        ),
        (
            _module(memo=0, params=[("w", tensor())], modules=[("me", b"h\x00")]),
            r"state dict contains itself at '(model\.)?me'",
        ),
    ],
)
def test_broken_module_states_are_clear_errors(tmp_path: Path, pkl: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        _convert_raw(tmp_path, pkl)
    assert not (tmp_path / "m.safetensors").exists()
    # The same module as a value of a state dict: the same error.
    make_zip(tmp_path / "d.pt", state_dict([("w", tensor()), ("model", pkl)]))
    with pytest.raises(CheckpointError, match=message):
        convert_file(tmp_path / "d.pt", tmp_path / "d.safetensors", unknown="skip")


def test_deep_module_nesting_is_refused_in_bounded_time(tmp_path: Path) -> None:
    depth = 10_000
    head = P.g("mylib", "Net") + b")\x81}(" + P.u("_parameters") + b"}" + P.u("_buffers") + b"}"
    head += P.u("_modules") + b"}(" + P.u("m")
    leaf = _module("Leaf", params=[("w", tensor())])
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="nested deeper than 64 levels"):
        _convert_raw(tmp_path, head * depth + leaf + b"uub" * depth)
    assert time.monotonic() - started < 30
    # Within the cap, a deep chain converts under its dotted name.
    report = _convert_raw(tmp_path, head * 40 + leaf + b"uub" * 40, {"0": F32x4})
    assert report.tensors == [".".join(["m"] * 40 + ["w"])]
    assert len(report.modules) == 41


def test_legacy_module_persistent_ids_must_name_a_class(tmp_path: Path) -> None:
    def graph(cls: bytes) -> bytes:
        pid = b"(" + P.u("module") + cls + P.u("net.py") + P.u("class Net: ...") + b"tQ"
        module = pid + b")\x81}(" + P.u("_parameters") + b"}(" + P.u("w") + legacy_tensor()
        module += b"u" + P.u("_buffers") + b"}" + P.u("_modules") + b"}ub"
        return P.PROTO2 + module + b"."

    make_legacy(tmp_path / "l.pt", graph=graph(P.g("mylib", "Net")))
    report = convert_file(tmp_path / "l.pt", tmp_path / "l.safetensors", unknown="skip")
    assert report.tensors == ["w"] and report.modules == {"": "mylib.Net"}
    for cls in (P.i(3), P.g("torch", "Size")):
        make_legacy(tmp_path / "b.pt", graph=graph(cls))
        with pytest.raises(CheckpointError, match="does not name a module class"):
            convert_file(tmp_path / "b.pt", tmp_path / "b.safetensors", unknown="skip")
    # In the zip format, torch names no module this way.
    make_zip(tmp_path / "z.pt", graph(P.g("mylib", "Net")).replace(legacy_tensor(), tensor()))
    with pytest.raises(CheckpointError, match="unknown persistent id"):
        convert_file(tmp_path / "z.pt", tmp_path / "z.safetensors", unknown="skip")


def test_a_state_dict_changed_after_build_is_not_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # BUILD copies the state into the object's __dict__ (CPython's and nn.Module's
    # __setstate__ alike): a SETITEMS on the memoised state dict after BUILD changes nothing
    # torch.load returns. The converter kept a reference to that dict, so it converted the
    # tensor the later SETITEMS put there, not the one torch.load gives.
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):  # type: ignore[misc,name-defined]
        pass

    monkeypatch.setattr(sys.modules["__main__"], "Net", Net, raising=False)
    pkl = (
        P.PROTO2
        + P.g("__main__", "Net")
        + b")\x81}q\x01("
        + P.u("_parameters")
        + b"}("
        + P.u("w")
        + tensor("0")
        + b"u"
        + P.u("_buffers")
        + b"}"
        + P.u("_modules")
        + b"}ub"
        # Now the state dict again, with another _parameters: after BUILD.
        + b"h\x01("
        + P.u("_parameters")
        + b"}("
        + P.u("w")
        + tensor("1")
        + b"uu0."
    )
    second = struct.pack("<4f", -1.0, -2.0, -3.0, -4.0)
    make_zip(tmp_path / "m.pt", pkl, {"0": F32x4, "1": second})
    expected = torch.load(tmp_path / "m.pt", weights_only=False).state_dict()
    assert torch.equal(expected["w"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    report = convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors", unknown="skip")
    assert report.tensors == ["w"] and report.modules == {"": "__main__.Net"}
    assert load_file(tmp_path / "m.safetensors")["w"].tolist() == expected["w"].tolist()
