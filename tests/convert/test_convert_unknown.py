"""``unknown="skip"``: checkpoints that pickle objects of unknown classes still give their tensors.

The checkpoints are written by the real ``torch.save`` in a child process whose script is
``__main__`` (so its classes are pickled as ``__main__.Name``, as a training script's are), and
the same child reads them back with ``torch.load(weights_only=False)``: the tensors it sees are
the oracle for what the converter writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import CheckpointError, UnsafePickleError, safe_open
from pysafetensors._torch_pickle import load_checkpoint
from pysafetensors.convert import convert_file, convert_folder, verify_conversion
from pysafetensors.numpy import load_file
from pysafetensors.scan import grade_pickled_global, scan_file

from .corpus import F32x4, P, cli, make_zip, pid, run_writer, state_dict, tensor

#: Run as ``__main__`` in a child: writes the checkpoints named on the command line, then
#: loads each back with ``torch.load(weights_only=False)`` and prints the SHA-256 of every
#: tensor reachable through dicts, lists and tuples, by the dotted name the converter gives it.
_WRITER = textwrap.dedent(
    """
    import argparse, hashlib, json, os, random, sys
    from dataclasses import dataclass

    import numpy as np
    import torch


    @dataclass
    class MyConfig:
        lr: float
        weights: object = None


    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + sys.argv[2],))


    def flat(obj, prefix=""):
        out = {}
        if isinstance(obj, torch.Tensor):
            t = obj.detach().resolve_conj().resolve_neg().reshape(-1)
            t = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # stride 1, whatever it was
            out[prefix] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                out.update(flat(v, f"{prefix}.{i}" if prefix else str(i)))
        return out


    def training_checkpoint():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "optimizer_object": opt,
            "config": MyConfig(0.01, torch.arange(3.0)),
            "args": argparse.Namespace(epochs=3, name="run", mask=torch.ones(2, dtype=torch.bool)),
            "best_metric": np.float64(0.9375),
            "step": np.int64(1234),
            "history": [MyConfig(0.1), np.float32(1.5), 7],
        }


    def numpy_values():
        return {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "f64": np.float64(-2.5),
            "f32": np.float32(0.25),
            "f16": np.float16(1.5),
            "i8": np.int8(-7),
            "u64": np.uint64(2**64 - 1),
            "b": np.bool_(True),
            "c64": np.complex64(1 - 2j),
            "dtype": np.dtype(">i4"),
            "dtypes": [np.dtype("float32"), np.dtype("bool")],
        }


    def random_state(seed):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                  torch.uint8, torch.bool, torch.float64]
        made = []

        def a_tensor():
            if made and rng.random() < 0.15:
                return rng.choice(made)  # the same tensor again: tied
            t = (torch.randn(rng.randint(1, 4), rng.randint(1, 5), generator=gen) * 50)
            t = t.to(rng.choice(dtypes))
            pick = rng.random()
            if pick < 0.2:
                t = t.t()
            elif pick < 0.35:
                t = t[:, ::2]
            elif pick < 0.45:
                t = t[0]
            made.append(t)
            return t

        def value(depth):
            pick = rng.random()
            if depth > 3 or pick < 0.35:
                return a_tensor()
            if pick < 0.45:
                return MyConfig(rng.random(), a_tensor() if rng.random() < 0.5 else None)
            if pick < 0.5:
                return argparse.Namespace(x=rng.randint(0, 9), t=a_tensor())
            if pick < 0.55:
                return rng.choice([np.float64(rng.random()), np.int32(rng.randint(-9, 9))])
            if pick < 0.6:
                return rng.choice([3, "text", None, 2.5, (1, "a")])
            if pick < 0.75:
                return [value(depth + 1) for _ in range(rng.randint(0, 3))]
            if pick < 0.8:
                return tuple(value(depth + 1) for _ in range(rng.randint(1, 3)))
            return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 4))}

        return {f"top{i}": value(0) for i in range(rng.randint(4, 8))}


    out, canary = sys.argv[1], sys.argv[2]
    made = {
        "training.pt": training_checkpoint(),
        "numpy.pt": numpy_values(),
        "optimizer_state.pt": training_checkpoint()["optimizer"],
        "evil.pt": {"config": MyConfig(1.0), "w": torch.ones(2), "payload": Evil()},
    }
    for seed in range(6):
        made[f"random{seed}.pt"] = random_state(seed)
    digests = {}
    for name, obj in made.items():
        path = os.path.join(out, name)
        legacy = name.startswith("random") and int(name[6]) % 3 == 2
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
        if name != "evil.pt":
            digests[name] = flat(torch.load(path, weights_only=False))
    print(json.dumps(digests))
    """
)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, str]]]:
    """The checkpoints, and ``{file: {tensor name: sha256}}`` as ``torch.load`` reads them."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("written")
    return folder, run_writer(folder, _WRITER)


def _digests(path: Path, dropped: dict[str, str]) -> dict[str, str]:
    """SHA-256 of every tensor of a converted file, tied names included as their kept one."""
    arrays = load_file(path)
    out = {
        n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in arrays.items()
    }
    out.update({d: out[k] for d, k in dropped.items()})
    return out


# -- error mode ---------------------------------------------------------------------------------


def test_error_mode_refuses_with_a_hint(written: Any, tmp_path: Path) -> None:
    folder, _ = written
    dst = tmp_path / "out.safetensors"
    with pytest.raises(UnsafePickleError) as exc:
        convert_file(folder / "training.pt", dst)
    assert exc.value.skippable
    assert exc.value.global_name == "torch.optim.adamw.AdamW"  # the first unknown one
    assert str(exc.value).startswith(f"{folder / 'training.pt'}: global torch.optim.adamw.AdamW")
    assert any('unknown="skip"' in note for note in getattr(exc.value, "__notes__", []))
    assert not dst.exists()
    res = cli("convert", str(folder / "training.pt"), str(dst))
    assert res.returncode == 1 and not dst.exists()
    lines = res.stderr.splitlines()
    assert lines[0].startswith("error: ") and "torch.optim.adamw.AdamW" in lines[0]
    assert lines[1].startswith("hint: --skip-unknown leaves out objects of unknown classes ")


def test_main_classes_are_unknown_not_dunder_lookups(tmp_path: Path) -> None:
    make_zip(
        tmp_path / "m.pt", state_dict([("w", tensor()), ("cfg", P.g("__main__", "Cfg") + b")\x81")])
    )
    with pytest.raises(UnsafePickleError, match="not on the allow-list") as exc:
        convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert exc.value.skippable and exc.value.global_name == "__main__.Cfg"
    report = convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors", unknown="skip")
    assert report.tensors == ["w"] and report.skipped_objects == {"cfg": "__main__.Cfg"}
    # A dunder *name* in __main__ (or a dotted one) is still a lookup, never skipped.
    for name in ("__builtins__", "Cfg.__reduce__", "os.system"):
        make_zip(tmp_path / "d.pt", state_dict([("w", tensor()), ("x", P.g("__main__", name))]))
        with pytest.raises(UnsafePickleError, match="dotted or dunder") as exc:
            convert_file(tmp_path / "d.pt", tmp_path / "d.safetensors", unknown="skip")
        assert not exc.value.skippable
        assert not (tmp_path / "d.safetensors").exists()


def test_unknown_must_be_error_or_skip(tmp_path: Path) -> None:
    make_zip(tmp_path / "m.pt", state_dict([("w", tensor())]))
    with pytest.raises(ValueError, match="'error' or 'skip'"):
        convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors", unknown="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'error' or 'skip'"):
        convert_folder(tmp_path, tmp_path / "out", unknown=True)
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "out").exists()


# -- skip mode ----------------------------------------------------------------------------------


def test_training_checkpoint_tensors_match_torch_load(written: Any, tmp_path: Path) -> None:
    folder, digests = written
    dst = tmp_path / "out.safetensors"
    report = convert_file(folder / "training.pt", dst, unknown="skip", verify=True)
    expected = digests["training.pt"]
    # torch.load also reaches no tensor inside the objects: their state is not a dict or list.
    assert set(report.tensors) | set(report.dropped) == set(expected)
    assert _digests(dst, report.dropped) == expected
    assert report.verified == "reader"  # torch's weights_only loader refuses the file
    assert report.skipped_objects == {
        "optimizer_object": "torch.optim.adamw.AdamW",
        "config": "__main__.MyConfig",
        "args": "argparse.Namespace",
        "history.0": "__main__.MyConfig",
    }
    assert report.unknown_globals == [
        "__main__.MyConfig",
        "argparse.Namespace",
        "builtins.dict",
        "collections.defaultdict",
        "torch.optim.adamw.AdamW",
    ]
    # config.weights, args.mask and the optimizer object's four Parameters (its state tensors
    # are the very tensors of "optimizer", written under those names).
    assert report.skipped_tensors == 6
    assert report.non_tensors["best_metric"] == 0.9375
    assert report.non_tensors["step"] == 1234
    assert report.non_tensors["history"] == ["<skipped __main__.MyConfig>", 1.5, 7]
    assert report.non_tensors["args"] == "<skipped argparse.Namespace>"
    assert verify_conversion(folder / "training.pt", dst, unknown="skip") == "reader"


def test_optimizer_state_dict_converts_without_skipping(written: Any, tmp_path: Path) -> None:
    folder, digests = written
    report = convert_file(folder / "optimizer_state.pt", tmp_path / "o.safetensors", verify=True)
    assert report.verified == "torch"
    assert _digests(tmp_path / "o.safetensors", report.dropped) == digests["optimizer_state.pt"]
    assert report.skipped_objects == {} and report.unknown_globals == []
    assert report.non_tensors["param_groups"][0]["lr"] == 0.01


def test_numpy_scalars_and_dtypes_decode_in_both_modes(written: Any, tmp_path: Path) -> None:
    folder, digests = written
    for unknown in ("error", "skip"):
        dst = tmp_path / f"{unknown}.safetensors"
        report = convert_file(
            folder / "numpy.pt",
            dst,
            unknown=unknown,
            keep_non_tensors=True,  # type: ignore[arg-type]
        )
        assert _digests(dst, {}) == digests["numpy.pt"]
        assert report.unknown_globals == []
        values = report.non_tensors
        assert values["f64"] == -2.5 and values["f32"] == 0.25 and values["f16"] == 1.5
        assert values["i8"] == -7 and values["u64"] == 2**64 - 1 and values["b"] is True
        assert values["c64"] == "(1-2j)"
        assert values["dtype"] == ">i4" and values["dtypes"] == ["float32", "bool"]
        with safe_open(dst, "np") as f:
            assert json.loads(f.metadata()["u64"]) == 2**64 - 1


def test_numpy_dtypes_outside_the_whitelist_are_skippable(tmp_path: Path) -> None:
    # numpy.dtype("U3") then BUILD (numpy's own state for it): not decoded, an unknown value.
    dtype_u3 = (
        P.g("numpy", "dtype")
        + P.u("U3")
        + b"\x89\x88\x87R"
        + b"(K\x03"
        + P.u("<")
        + b"NNN"
        + P.i(12)
        + P.i(4)
        + P.i(8)
        + b"tb"
    )
    raw = "abc".encode("utf-32-le")
    scalar = P.g("numpy._core.multiarray", "scalar") + dtype_u3 + b"C\x0c" + raw + b"\x86R"
    make_zip(tmp_path / "u.pt", state_dict([("w", tensor()), ("name", scalar)]))
    with pytest.raises(UnsafePickleError, match="numpy.dtype 'U3'") as exc:
        convert_file(tmp_path / "u.pt", tmp_path / "u.safetensors")
    assert exc.value.skippable
    report = convert_file(tmp_path / "u.pt", tmp_path / "u.safetensors", unknown="skip")
    assert report.skipped_objects == {"name": "numpy._core.multiarray.scalar"}
    assert report.unknown_globals == ["numpy._core.multiarray.scalar", "numpy.dtype"]
    # A scalar whose bytes do not fit its dtype is a broken checkpoint in either mode.
    f8 = P.g("numpy", "dtype") + P.u("f8") + b"\x89\x88\x87R"
    short = P.g("numpy.core.multiarray", "scalar") + f8 + b"C\x04\x00\x00\x00\x00\x86R"
    make_zip(tmp_path / "s.pt", state_dict([("w", tensor()), ("x", short)]))
    for unknown in ("error", "skip"):
        with pytest.raises(Exception, match="scalar called with") as err:
            convert_file(tmp_path / "s.pt", tmp_path / "s.safetensors", unknown=unknown)  # type: ignore[arg-type]
        assert not isinstance(err.value, UnsafePickleError)


def test_dangerous_globals_are_refused_in_skip_mode_too(written: Any, tmp_path: Path) -> None:
    folder, _ = written
    canary = folder / "canary"
    dst = tmp_path / "evil.safetensors"
    for unknown in ("error", "skip"):
        with pytest.raises(UnsafePickleError) as exc:
            convert_file(folder / "evil.pt", dst, unknown=unknown)  # type: ignore[arg-type]
        # The config (unknown, harmless) comes first: skipped, then the payload is refused.
        name = "__main__.MyConfig" if unknown == "error" else "posix.system"
        assert exc.value.global_name == name
        assert exc.value.skippable is (unknown == "error")
        assert not dst.exists() and not canary.exists()
    assert scan_file(folder / "evil.pt").grade == "dangerous"
    res = cli("convert", "--skip-unknown", str(folder / "evil.pt"), str(dst))
    assert res.returncode == 1 and not dst.exists() and not canary.exists()
    assert "posix.system" in res.stderr
    assert "hint: this is refused even with --skip-unknown" in res.stderr


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("subprocess", "Popen"),
        ("torch.serialization", "load"),
        ("pickle", "loads"),
        ("numpy", "load"),
        ("builtins", "dict"),
        ("builtins", "object"),
        ("argparse", "Namespace"),
        ("numpy", "matrix"),
        ("mylib.models", "Net"),
        ("__main__", "Config"),
    ],
)
def test_skip_mode_follows_the_scanner_grade(tmp_path: Path, module: str, name: str) -> None:
    """One grading: what the scanner grades dangerous is refused, everything else skipped."""
    obj = P.g(module, name) + P.u("touch " + str(tmp_path / "canary")) + b"\x85R"
    make_zip(tmp_path / "c.pt", state_dict([("w", tensor()), ("obj", obj)]))
    dst = tmp_path / "c.safetensors"
    if grade_pickled_global(module, name, 2) == "dangerous":
        with pytest.raises(UnsafePickleError) as exc:
            convert_file(tmp_path / "c.pt", dst, unknown="skip")
        assert exc.value.global_name == f"{module}.{name}" and not exc.value.skippable
        assert not dst.exists()
    else:
        report = convert_file(tmp_path / "c.pt", dst, unknown="skip")
        assert report.skipped_objects == {"obj": f"{module}.{name}"}
        assert load_file(dst)["w"].tobytes() == F32x4
    assert not (tmp_path / "canary").exists()


def test_python2_names_are_graded_as_python_3_imports_them(tmp_path: Path) -> None:
    # commands.getoutput is subprocess.getoutput below protocol 3 (as torch.load reads it).
    obj = P.g("commands", "getoutput") + P.u("id") + b"\x85R"
    make_zip(tmp_path / "c.pt", state_dict([("w", tensor()), ("obj", obj)]))
    with pytest.raises(UnsafePickleError) as exc:
        convert_file(tmp_path / "c.pt", tmp_path / "c.safetensors", unknown="skip")
    assert not exc.value.skippable
    # A harmless renamed module is skipped under its Python 3 name.
    obj = P.g("UserDict", "UserDict") + b")R"
    make_zip(tmp_path / "u.pt", state_dict([("w", tensor()), ("obj", obj)]))
    report = convert_file(tmp_path / "u.pt", tmp_path / "u.safetensors", unknown="skip")
    assert report.skipped_objects == {"obj": "collections.UserDict"}


def test_every_way_of_building_an_object_is_inert(tmp_path: Path) -> None:
    cls = P.g("mylib", "Thing")
    objects = {
        "reduce": cls + P.u("x") + b"\x85R",
        "newobj": cls + b")\x81" + b"}" + P.u("t") + tensor("1") + b"sb",
        "newobj_ex": cls + b")}\x92",
        "inst": b"(" + P.u("x") + b"imylib\nThing\n",
        "obj": b"(" + cls + P.u("x") + b"o",
        # A dict subclass: SETITEMS into it (a tensor among the items: not converted).
        "dict_sub": cls + b")\x81(" + P.u("k") + tensor("2") + b"u",
        "list_sub": cls + b")\x81(" + P.i(1) + P.i(2) + b"e" + P.i(3) + b"a",
        # The class itself, not called.
        "cls": cls,
        # A tensor subclass of an unknown class: skipped whole.
        "sub": P.g("torch._tensor", "_rebuild_from_type_v2")
        + b"("
        + P.g("torch._utils", "_rebuild_tensor_v2")
        + cls
        + b"("
        + pid("3")
        + b"Q"
        + P.i(0)
        + P.tup((4,))
        + P.tup((1,))
        + b"\x89"
        + P.g("collections", "OrderedDict")
        + b")Rt}tR",
    }
    items = [("w", tensor()), *((k, v) for k, v in objects.items())]
    storages = {k: F32x4 for k in "0123"}
    make_zip(tmp_path / "t.pt", state_dict(items), storages)
    report = convert_file(tmp_path / "t.pt", tmp_path / "t.safetensors", unknown="skip")
    assert report.tensors == ["w"]
    assert report.skipped_objects == {k: "mylib.Thing" for k in objects}
    assert report.unknown_globals == ["mylib.Thing"]
    # The tensors of "newobj" and "dict_sub"; the subclass's tensor is never rebuilt.
    assert report.skipped_tensors == 2


def test_a_checkpoint_that_is_one_object_leaves_nothing(tmp_path: Path) -> None:
    make_zip(
        tmp_path / "m.pt", P.PROTO2 + P.g("mylib", "Net") + b")\x81}" + P.u("w") + tensor() + b"sb."
    )
    with pytest.raises(Exception, match=r"is a mylib\.Net object, not a state dict"):
        convert_file(tmp_path / "m.pt", tmp_path / "m.safetensors", unknown="skip")
    assert not (tmp_path / "m.safetensors").exists()


def test_subtree_names_skipped_objects_without_the_prefix(tmp_path: Path) -> None:
    inner = b"}(" + P.u("w") + tensor() + P.u("cfg") + P.g("mylib", "Cfg") + b")\x81u"
    make_zip(
        tmp_path / "l.ckpt",
        state_dict([("state_dict", inner), ("hparams", P.g("mylib", "Hp") + b")\x81")]),
    )
    report = convert_file(
        tmp_path / "l.ckpt", tmp_path / "l.safetensors", unknown="skip", subtree="state_dict"
    )
    assert report.tensors == ["w"] and report.skipped_objects == {"cfg": "mylib.Cfg"}
    assert report.unknown_globals == ["mylib.Cfg", "mylib.Hp"]


def test_skipped_objects_inside_sets_and_keys(tmp_path: Path) -> None:
    thing = P.g("mylib", "Thing") + b")\x81"
    leaf = b"}(" + P.u("a") + b"(" + thing + b"\x91" + thing + P.i(1) + b"u"
    make_zip(tmp_path / "k.pt", state_dict([("w", tensor()), ("meta", leaf)]))
    report = convert_file(tmp_path / "k.pt", tmp_path / "k.safetensors", unknown="skip")
    assert report.skipped_objects == {"meta.a": "mylib.Thing", "meta": "mylib.Thing"}
    # A placeholder key is named by its class in the names of the values (not "<SkippedObject>").
    assert report.skipped_non_tensors == ["meta.a", "meta.<skipped mylib.Thing>"]
    # A placeholder key over a tensor: refused, naming the class.
    make_zip(tmp_path / "t.pt", state_dict([("d", b"}" + thing + tensor() + b"s")]))
    with pytest.raises(CheckpointError, match=r"under 'd' is a skipped mylib\.Thing object"):
        convert_file(tmp_path / "t.pt", tmp_path / "t.safetensors", unknown="skip")


def test_deeply_nested_skipped_objects_are_listed(tmp_path: Path) -> None:
    # 1000 lists deep: listed under the list 16 levels down (it was not listed at all, and the
    # command said there was none); a list holding itself is walked once below that level.
    thing = P.g("mylib", "Thing") + b")\x81"
    deep = b"(" * 1000 + thing + b"l" * 1000
    cycle = b"]q\x00h\x00a" + thing + b"a"
    make_zip(tmp_path / "d.pt", state_dict([("w", tensor()), ("deep", deep), ("c", cycle)]))
    report = convert_file(tmp_path / "d.pt", tmp_path / "d.safetensors", unknown="skip")
    assert report.skipped_objects["deep" + ".0" * 16] == "mylib.Thing"
    assert report.skipped_objects["c.1"] == "mylib.Thing"
    assert set(report.skipped_objects.values()) == {"mylib.Thing"}
    assert all(len(k.split(".")) <= 17 for k in report.skipped_objects)
    res = cli("convert", "--skip-unknown", str(tmp_path / "d.pt"), str(tmp_path / "e.safetensors"))
    assert res.returncode == 0, res.stderr
    assert "(none in the converted part)" not in res.stdout
    assert "deep" + ".0" * 16 + " (mylib.Thing)" in res.stdout


def test_legacy_format_and_folders(written: Any, tmp_path: Path) -> None:
    # A Trainer folder: rng_state.pth pickles numpy arrays (decoded, in either mode) and
    # training_args.bin an object of a class the converter does not know (skipped).
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.arange(4.0)}, tmp_path / "pytorch_model.bin")
    torch.save(
        {"python": 1, "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
        tmp_path / "rng_state.pth",
        _use_new_zipfile_serialization=False,
    )
    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "training_args.bin")
    with pytest.raises(UnsafePickleError, match="argparse.Namespace"):
        convert_folder(tmp_path, tmp_path / "out")
    folder = convert_folder(tmp_path, tmp_path / "out", unknown="skip", verify=True)
    rng = next(r for r in folder.files if r.src.endswith("rng_state.pth"))
    assert rng.format == "legacy" and rng.tensors == ["cpu"]
    assert rng.skipped_objects == {} and rng.unknown_globals == []
    loaded = torch.load(tmp_path / "rng_state.pth", weights_only=False)
    assert rng.non_tensors["numpy"][1] == loaded["numpy"][1].tolist()
    assert load_file(tmp_path / "out" / "rng_state.safetensors")["cpu"].tobytes() == bytes(
        loaded["cpu"].numpy()
    )
    assert load_file(tmp_path / "out" / "model.safetensors")["w"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(6))
def test_random_nested_checkpoints_match_torch_load(
    written: Any, tmp_path: Path, seed: int
) -> None:
    """The oracle: ``torch.load(weights_only=False)`` of a random nested state dict, with
    unknown objects holding tensors, numpy scalars, tied tensors and strided views."""
    folder, digests = written
    name = f"random{seed}.pt"
    dst = tmp_path / "r.safetensors"
    expected = digests[name]
    ck = load_checkpoint(folder / name, unknown="skip")
    with ck:
        assert ck.format == ("legacy" if seed % 3 == 2 else "zip")
    report = convert_file(folder / name, dst, unknown="skip", verify=True)
    assert set(report.tensors) | set(report.dropped) == set(expected)
    assert _digests(dst, report.dropped) == expected
    assert set(report.unknown_globals) <= {"__main__.MyConfig", "argparse.Namespace"}
    for where, glob in report.skipped_objects.items():
        assert glob in report.unknown_globals
        if where in report.non_tensors:  # else inside a leaf (a list without tensors)
            assert report.non_tensors[where] == f"<skipped {glob}>"


class _Plain:
    """A plain class, pickled by reference to this module (as a script's config is)."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.mark.parametrize("protocol", [1, 2])
def test_low_protocol_objects_are_named_after_their_class(tmp_path: Path, protocol: int) -> None:
    # Below protocol 2 a plain object is pickled as copyreg._reconstructor(cls, object, None):
    # the report named that helper, not the class the user has to look for.
    torch = pytest.importorskip("torch")
    torch.save(
        {"w": torch.ones(3), "cfg": _Plain(1), "cfgs": [_Plain(2)]},
        tmp_path / "p.pt",
        pickle_protocol=protocol,
    )
    report = convert_file(tmp_path / "p.pt", tmp_path / "p.safetensors", unknown="skip")
    cls = f"{__name__}._Plain"
    assert report.tensors == ["w"]
    assert report.skipped_objects == {"cfg": cls, "cfgs.0": cls}
    assert report.non_tensors["cfg"] == f"<skipped {cls}>"
    assert cls in report.unknown_globals


def test_trainer_folder_leaves_out_files_that_are_one_object(tmp_path: Path) -> None:
    # A Trainer checkpoint folder always holds training_args.bin (one pickled dataclass), often
    # a whole optimizer: with skip, those files failed the whole folder.
    torch = pytest.importorskip("torch")
    from concurrent.futures import ThreadPoolExecutor

    src = tmp_path / "checkpoint-500"
    src.mkdir()
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    torch.save(torch.optim.SGD(model.parameters(), lr=0.1), src / "optimizer.pt")
    torch.save(_Plain(3), src / "training_args.bin")
    torch.save({"last_epoch": 1, "base_lrs": [0.1]}, src / "scheduler.pt")
    with pytest.raises(UnsafePickleError):
        convert_folder(src, tmp_path / "err")
    pool = ThreadPoolExecutor(2)
    for executor in (None, pool):
        dst = tmp_path / f"out-{executor is None}"
        folder = convert_folder(src, dst, unknown="skip", executor=executor)
        assert sorted(p.name for p in dst.iterdir()) == [
            "model.safetensors",
            "scheduler.safetensors",
        ]
        assert [Path(r.src).name for r in folder.files] == ["pytorch_model.bin", "scheduler.pt"]
        assert sorted(Path(p).name for p in folder.left_out) == [
            "optimizer.pt",
            "training_args.bin",
        ]
        assert "torch.optim.sgd.SGD object" in folder.left_out[str(src / "optimizer.pt")]
        assert load_file(dst / "model.safetensors")["weight"].tobytes() == bytes(
            model.weight.detach().numpy()
        )
    pool.shutdown()
    res = cli("convert", "--skip-unknown", "--json", str(src), str(tmp_path / "cli"))
    assert res.returncode == 0, res.stderr
    assert sorted(Path(p).name for p in json.loads(res.stdout)["left_out"]) == [
        "optimizer.pt",
        "training_args.bin",
    ]
    res = cli("convert", "--skip-unknown", str(src), str(tmp_path / "cli2"))
    assert f"{src / 'training_args.bin'}: left out, the checkpoint is a" in res.stdout
    # A whole pickled model as the model's file converts as its state_dict() ...
    torch.save(model, src / "pytorch_model.bin")
    folder = convert_folder(src, tmp_path / "model", unknown="skip")
    assert folder.files[0].tensors == ["weight", "bias"]
    assert folder.files[0].modules == {"": "torch.nn.modules.linear.Linear"}
    # ... but the model's own file is never left out; nor is a folder with nothing else
    # converted.
    torch.save(_Plain(4), src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: the checkpoint is a"):
        convert_folder(src, tmp_path / "whole", unknown="skip")
    (src / "pytorch_model.bin").unlink()
    (src / "scheduler.pt").unlink()
    with pytest.raises(CheckpointError, match="nothing converted") as exc:
        convert_folder(src, tmp_path / "none", unknown="skip")
    assert "optimizer.pt, training_args.bin" in str(exc.value)
    assert not (tmp_path / "whole").exists() and not (tmp_path / "none").exists()


def test_protocol_0_checkpoints_are_refused_for_what_they_are(tmp_path: Path) -> None:
    # torch.save with pickle_protocol=0 writes text persistent ids, which neither torch.load
    # nor the converter can read: the error said torch never writes them.
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(2)}, tmp_path / "p0.pt", pickle_protocol=0)
    with pytest.raises(CheckpointError, match="pickle_protocol=0") as exc:
        convert_file(tmp_path / "p0.pt", tmp_path / "p0.safetensors", unknown="skip")
    assert "not written by torch" not in str(exc.value)
    with pytest.raises(Exception, match="saved_id must be a tuple"):
        torch.load(tmp_path / "p0.pt", weights_only=False)


def test_large_legacy_checkpoints_count_only_the_tensors_left_out(tmp_path: Path) -> None:
    # A legacy object pickle over the first 64 KiB window is run again on a larger one: the
    # same policy was reused, so the tensors of the failed partial run were counted as
    # "inside skipped objects, not converted" (3000 converted, 608 said to be left out).
    torch = pytest.importorskip("torch")
    sd: dict[str, Any] = {f"layer{i}.weight": torch.zeros(2) for i in range(3000)}
    sd["args"] = argparse.Namespace(lr=0.1, mask=torch.ones(2))
    for legacy in (True, False):
        src = tmp_path / f"leg{legacy}.pt"
        torch.save(sd, src, _use_new_zipfile_serialization=not legacy)
        report = convert_file(src, tmp_path / "leg.safetensors", unknown="skip")
        assert len(report.tensors) + len(report.dropped) == 3000
        assert report.skipped_tensors == 1, legacy  # the mask, inside the Namespace


def test_numpy_random_generators_are_skipped_not_refused(tmp_path: Path) -> None:
    # numpy pickles RandomState and Generator objects through numpy.random._pickle's
    # __randomstate_ctor/__generator_ctor/__bit_generator_ctor: their dunder names were
    # refused as lookups even with unknown="skip", so a training checkpoint with RNG state
    # could not be converted at all.
    torch = pytest.importorskip("torch")
    src = tmp_path / "rng.pt"
    torch.save(
        {"w": torch.arange(3.0), "rng": np.random.RandomState(0), "gen": np.random.default_rng(1)},
        src,
    )
    with pytest.raises(UnsafePickleError, match="not on the allow-list") as exc:
        convert_file(src, tmp_path / "rng.safetensors")
    assert exc.value.skippable
    report = convert_file(src, tmp_path / "rng.safetensors", unknown="skip", verify=True)
    assert report.tensors == ["w"]
    assert report.skipped_objects == {
        "rng": "numpy.random._pickle.__randomstate_ctor",
        "gen": "numpy.random._pickle.__generator_ctor",
    }
    assert "numpy.random._pickle.__bit_generator_ctor" in report.unknown_globals
    assert load_file(tmp_path / "rng.safetensors")["w"].tolist() == [0.0, 1.0, 2.0]
    # Real dunder lookups in that module are still refused in skip mode.
    make_zip(
        tmp_path / "d.pt",
        state_dict([("w", tensor()), ("x", P.g("numpy.random._pickle", "__builtins__"))]),
    )
    with pytest.raises(UnsafePickleError, match="dotted or dunder") as exc:
        convert_file(tmp_path / "d.pt", tmp_path / "d.safetensors", unknown="skip")
    assert not exc.value.skippable
