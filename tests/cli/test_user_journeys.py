"""The command line as a user meets it: a sharded model's metadata, resharding in place,
quiet runs, follow-on problems, outputs that name folders, and other traps a new user hit."""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from pysafetensors import edit_metadata, extract, merge, reshard, safe_open
from pysafetensors.numpy import save_file

from .conftest import example_tensors, raw_file, write_sharded


def _set_index_metadata(folder: Path, **entries: object) -> None:
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"].update(entries)
    index_path.write_text(json.dumps(index))


# ------------------------------------------------------------- a sharded model's metadata


def test_diff_compares_the_index_metadata(cli, sharded: Path, tmp_path: Path) -> None:
    _set_index_metadata(sharded, producer="me")
    other = tmp_path / "other"
    shutil.copytree(sharded, other)
    _set_index_metadata(other, producer="someone-else", license="gpl")
    r = cli("diff", sharded, other)
    assert r.code == 1 and "metadata differs" in r.out
    assert "~ metadata producer: me -> someone-else" in r.out
    assert "+ metadata license: gpl" in r.out
    doc = cli("diff", sharded, other, "--json").json()
    assert doc["equal"] is False


def test_diff_compares_a_key_the_shards_disagree_on_tensor_by_tensor(
    cli, sharded: Path, tmp_path: Path
) -> None:
    """A key in one shard only is in no model metadata (the shards disagree), so a change to
    it was no difference at all: exit 0. transformers reads such keys from each shard."""
    other = tmp_path / "other"
    shutil.copytree(sharded, other)
    edit_metadata(other / "model-00002-of-00002.safetensors", set={"quant_method": "gptq"})
    r = cli("diff", sharded, other)
    assert r.code == 1 and "metadata differs" in r.out
    assert (
        "~ metadata quant_method by file: model-00001-of-00002.safetensors: -, "
        "model-00002-of-00002.safetensors: - -> model-00001-of-00002.safetensors: -, "
        "model-00002-of-00002.safetensors: gptq"
    ) in r.out
    doc = cli("diff", sharded, other, "--json").json()
    assert doc["metadata"]["by_shard"]["quant_method"][1] == {
        "model-00001-of-00002.safetensors": None,
        "model-00002-of-00002.safetensors": "gptq",
    }
    assert not doc["metadata"]["added"] and not doc["metadata"]["changed"]
    # The same value for every tensor, however the files split the tensors: no difference.
    names = list(example_tensors())
    split = write_sharded(
        tmp_path / "split", example_tensors(), [[names[0]], names[1:2], names[2:]]
    )
    edit_metadata(split / "model-00003-of-00003.safetensors", set={"quant_method": "gptq"})
    r = cli("diff", other, split)
    assert r.code == 0, r.out
    # A merge keeps the entries every shard agrees on: the key is lost, and diff says so.
    merged = tmp_path / "merged.safetensors"
    with pytest.warns(UserWarning, match="disagree on metadata 'quant_method'"):
        merge(other, merged)
    r = cli("diff", other, merged, "--json")
    assert r.code == 1 and list(r.json()["metadata"]["by_shard"]) == ["quant_method"]


def test_diff_by_shard_takes_a_models_own_value_where_its_index_sets_one(
    cli, sharded: Path, tmp_path: Path
) -> None:
    """A key the index sets is the model's for every tensor (it wins over the shards'): it
    went uncompared when the other model's shards disagreed on it (exit 0)."""
    edit_metadata(sharded / "model-00001-of-00002.safetensors", set={"q": "1"})
    edit_metadata(sharded / "model-00002-of-00002.safetensors", set={"q": "2"})
    other = tmp_path / "other"
    shutil.copytree(sharded, other)
    _set_index_metadata(other, q="3")
    doc = cli("diff", sharded, other, "--json").json()
    assert doc["equal"] is False
    assert set(doc["metadata"]["by_shard"]["q"][1].values()) == {"3"}


def test_a_warning_made_an_error_by_the_users_filters_is_one_error_line(
    cli, sharded: Path, tmp_path: Path
) -> None:
    """Under PYTHONWARNINGS=error a command's warning is raised: it was reported as a failure
    no check foresaw (a traceback), not as the error the user asked for."""
    edit_metadata(sharded / "model-00002-of-00002.safetensors", set={"quant_method": "gptq"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = cli("merge", sharded, tmp_path / "m.safetensors")
    assert r.code == 1 and "Traceback" not in r.err
    assert r.err.startswith("error: the shards of") and "'quant_method'" in r.err
    assert not (tmp_path / "m.safetensors").exists() and os.listdir(tmp_path) == ["sharded"]


def test_another_librarys_warning_made_an_error_says_what_it_was(
    cli, sharded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pysafetensors._cli import _cmd_inspect

    def deprecated(args: object) -> int:
        warnings.warn("np.foo is deprecated", DeprecationWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(_cmd_inspect, "run", deprecated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = cli("inspect", sharded)
    assert (r.code, r.err) == (1, "error: DeprecationWarning: np.foo is deprecated\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = cli("--debug", "inspect", sharded)
    assert r.code == 1 and "Traceback" in r.err and "in deprecated" in r.err  # where it was
    assert r.err.endswith("error: DeprecationWarning: np.foo is deprecated\n")

    class Quiet(DeprecationWarning):
        pass

    class Ours(UserWarning):  # a command's own kind of warning: its text, as warned
        pass

    for raised, shown in ((Quiet(), "Quiet"), (Ours("kept as is"), "kept as is")):

        def raising(args: object, raised: Warning = raised) -> int:
            warnings.warn(raised, stacklevel=1)
            return 0

        monkeypatch.setattr(_cmd_inspect, "run", raising)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r = cli("inspect", sharded)
        assert (r.code, r.err) == (1, f"error: {shown}\n")

    # Raised while the commands are imported, before any option is read.
    import pysafetensors._cli as cli_module

    def importing() -> None:
        warnings.warn("a module is deprecated", FutureWarning, stacklevel=1)

    monkeypatch.setattr(cli_module, "build_parser", importing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = cli("inspect", sharded)
    assert (r.code, r.err) == (1, "error: FutureWarning: a module is deprecated\n")


def test_a_rewrite_warns_of_keys_the_shards_disagree_on(cli, sharded: Path, tmp_path: Path) -> None:
    """merge/reshard/extract keep what every shard agrees on: a key in one shard only was
    lost without a word."""
    edit_metadata(sharded / "model-00002-of-00002.safetensors", set={"quant_method": "gptq"})
    r = cli("merge", sharded, tmp_path / "m.safetensors")
    assert r.code == 0
    assert "warning: the shards of" in r.err and "disagree on metadata 'quant_method'" in r.err
    assert "UserWarning" not in r.err  # a command's own warning line, not Python's
    for rewrite in (
        lambda: merge(sharded, tmp_path / "m2.safetensors"),
        lambda: reshard(sharded, tmp_path / "r", "1KB"),
        lambda: extract(sharded, tmp_path / "e.safetensors", ["model.*"]),
    ):
        with pytest.warns(UserWarning, match="disagree on metadata 'quant_method'") as seen:
            rewrite()
        assert seen[0].filename == __file__  # names the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merge(sharded, tmp_path / "m3.safetensors", metadata={"quant_method": "gptq"})
        # format is written whatever the shards say (one lacking it is no key left out).
        edit_metadata(sharded / "model-00001-of-00002.safetensors", delete=["format"])
        edit_metadata(sharded / "model-00001-of-00002.safetensors", set={"quant_method": "gptq"})
        merge(sharded, tmp_path / "m4.safetensors")
    with safe_open(tmp_path / "m4.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt", "quant_method": "gptq"}


def test_a_sharded_model_equals_its_merge(cli, sharded: Path, tmp_path: Path) -> None:
    # The index's own keys go into the merged header; its total_size does not.
    _set_index_metadata(sharded, producer="me", layers=2)
    merged = tmp_path / "merged.safetensors"
    merge(sharded, merged)
    with safe_open(merged, "np") as f:
        assert f.metadata() == {"format": "pt", "producer": "me", "layers": "2"}
    r = cli("diff", sharded, merged)
    assert r.code == 0, r.out
    assert cli("diff", merged, sharded).code == 0


def test_a_merge_of_an_index_with_total_parameters_equals_its_source(
    cli, sharded: Path, tmp_path: Path
) -> None:
    # transformers v5 writes total_parameters into the index. It went into the merged file's
    # header (an index key, computed anew), where diff, which leaves the index's computed keys
    # out, met it as an added key: the merge was "different" from its source (exit 1).
    _set_index_metadata(sharded, producer="me", total_parameters=5)
    merged = tmp_path / "merged.safetensors"
    r = cli("merge", sharded, merged)
    assert r.code == 0, r.err
    with safe_open(merged, "np") as f:
        assert f.metadata() == {"format": "pt", "producer": "me"}
    r = cli("diff", sharded, merged)
    assert r.code == 0, r.out
    one = tmp_path / "one.safetensors"
    assert cli("extract", sharded, one, "*").code == 0
    assert cli("diff", sharded, one).code == 0
    # A sharded output has an index: there it is computed for the tensors written.
    out = tmp_path / "out"
    assert cli("extract", sharded, out, "*", "-s", "2KB").code == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    count = sum(int(np.asarray(v).size) for v in example_tensors().values())
    assert index["metadata"]["total_parameters"] == count
    assert cli("diff", sharded, out).code == 0


def test_metadata_get_shows_the_model_s_metadata(cli, sharded: Path) -> None:
    _set_index_metadata(sharded, producer="me")
    total = json.loads((sharded / "model.safetensors.index.json").read_text())["metadata"][
        "total_size"
    ]
    doc = cli("metadata", "get", sharded, "--json").json()
    # What every shard agrees on, then the index's (as safe_open(folder).metadata() has it).
    assert doc["metadata"] == {"format": "pt", "total_size": str(total), "producer": "me"}
    assert cli("metadata", "get", sharded, "producer").out == "me\n"
    index = sharded / "model.safetensors.index.json"
    assert cli("metadata", "get", index, "total_size").out == f"{total}\n"


def test_a_merge_of_files_without_format_gains_it_and_diff_says_so(cli, tmp_path: Path) -> None:
    # As documented: the one difference between such a source and its merge.
    source = tmp_path / "src"
    source.mkdir()
    save_file({"a": np.ones(3, np.float32)}, str(source / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones(3, np.float32)}, str(source / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 24}, "weight_map": weight_map})
    )
    merged = tmp_path / "merged.safetensors"
    assert cli("merge", source, merged).code == 0
    doc = cli("diff", source, merged, "--json").json()
    assert doc["metadata"] == {
        "added": {"format": "pt"},
        "removed": {},
        "changed": {},
        "by_shard": {},
    }
    assert doc["summary"]["identical"] == 2 and doc["equal"] is False


def test_inspect_shows_index_values_as_their_json_text(cli, sharded: Path) -> None:
    # As `metadata get` shows them; Python's repr printed True, None and {'a': 1}.
    _set_index_metadata(sharded, flag=True, none=None, nested={"a": [1, "x"]})
    r = cli("inspect", sharded, "--no-tensors")
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if x.startswith("Index metadata:"))
    assert 'flag=true, none=null, nested={"a": [1, "x"]}' in line, line
    assert cli("metadata", "get", sharded, "nested", "--raw").out == '{"a": [1, "x"]}\n'


def test_shard_metadata_lists_each_file_s_own(sharded: Path) -> None:
    with safe_open(sharded, "np") as f:
        assert f.shard_metadata() == [{"format": "pt"}, {"format": "pt"}]


# ------------------------------------------------------------------------- reshard, format


def test_reshard_in_place_with_another_pattern_replaces_the_checkpoint(cli, sharded: Path) -> None:
    before = {n: np.asarray(v) for n, v in example_tensors().items()}
    r = cli("reshard", sharded, sharded, "-s", "2KB", "--filename-pattern", "w{suffix}.safetensors")
    assert r.code == 0, r.err
    names = sorted(p.name for p in sharded.iterdir())
    # The old index and shards are gone: the folder is one checkpoint, the new one.
    assert all(n.startswith("w") for n in names), names
    assert "w.safetensors.index.json" in names
    assert cli("validate", "--strict", sharded).code == 0
    with safe_open(sharded, "np") as f:
        assert f.path.endswith("w.safetensors.index.json")
        for name, value in before.items():
            np.testing.assert_array_equal(f.get_tensor(name), value)


def test_reshard_into_another_folder_leaves_the_source_alone(sharded: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in sharded.iterdir())
    reshard(sharded, tmp_path / "out", "2KB", filename_pattern="w{suffix}.safetensors")
    assert sorted(p.name for p in sharded.iterdir()) == before


@pytest.mark.parametrize("fmt", ["tf", "flax", "mlx"])
def test_reshard_and_merge_keep_the_source_format(fmt: str, tmp_path: Path) -> None:
    source = tmp_path / "model.safetensors"
    save_file(example_tensors(), str(source), metadata={"format": fmt, "source": "x"})
    plan = reshard(source, tmp_path / "out", "2KB")
    assert plan.is_sharded
    with safe_open(tmp_path / "out", "np") as f:
        # What the source file's header held stays in every shard's header (transformers
        # reads a quantizer's metadata back from there), not in the index alone.
        assert f.shard_metadata() == [{"format": fmt, "source": "x"}] * len(
            plan.filename_to_tensors
        )
        assert f.index_metadata() == {"total_size": plan.metadata["total_size"]}
    merge(tmp_path / "out", tmp_path / "merged.safetensors")
    with safe_open(tmp_path / "merged.safetensors", "np") as f:
        assert f.metadata() == {"format": fmt, "source": "x"}
    # An explicit format still wins.
    merge(tmp_path / "out", tmp_path / "pt.safetensors", format="pt")
    with safe_open(tmp_path / "pt.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt", "source": "x"}


def test_filename_pattern_error_does_not_invent_a_shard_count(cli, sharded: Path, tmp_path) -> None:
    r = cli("reshard", sharded, tmp_path / "x", "-s", "1KB", "--filename-pattern", "a.safetensors")
    assert r.code == 2
    assert "no {suffix} field, so every shard would get the same name" in r.err


# ------------------------------------------------------------------------------ outputs


def test_reshard_onto_a_file_is_a_clear_error(cli, sharded: Path, example: Path) -> None:
    before = example.read_bytes()
    r = cli("reshard", sharded, example, "-s", "1MB")
    assert r.code == 2
    assert r.err == f"error: the output '{example}' is a file; reshard writes a folder\n"
    assert example.read_bytes() == before


@pytest.mark.parametrize(
    ("command", "extra", "how"),
    [
        ("reshard", ["-s", "1KB"], "reshard writes a folder"),
        ("extract", ["*", "-s", "1KB"], "extract -s writes a folder"),
        ("cast", ["--to", "f16"], "a sharded model is cast into a folder"),
    ],
)
@pytest.mark.parametrize("name", ["out.safetensors", "out.index.JSON"])
def test_an_output_folder_named_as_a_file_is_a_usage_error(
    cli, sharded: Path, tmp_path: Path, command: str, extra: list[str], how: str, name: str
) -> None:
    # It became a folder of that name, shards and an index inside.
    out = tmp_path / name
    r = cli(command, sharded, out, *extra)
    assert r.code == 2 and r.err.startswith(f"error: the output '{out}' is named like a file; ")
    assert f"{how} (model.safetensors, or shards and their index, inside it)" in r.err
    assert not out.exists()
    # An existing folder is taken whatever its name.
    out.mkdir()
    assert cli(command, sharded, out, *extra).code == 0
    assert any(out.iterdir())


@pytest.mark.parametrize("command", ["cast", "merge", "extract"])
def test_an_output_file_named_as_a_folder_is_a_usage_error(
    cli, command: str, example: Path, tmp_path: Path
) -> None:
    out = f"{tmp_path / 'newdir'}/"
    extra = {"cast": ["--to", "f16"], "merge": [], "extract": ["*"]}[command]
    r = cli(command, example, out, *extra)
    said = "names a folder (it ends with a separator)"
    assert r.code == 2 and r.err == f"error: the output '{out}' {said}; name the file to write\n"
    assert not (tmp_path / "newdir").exists()
    (tmp_path / "newdir").mkdir()
    r = cli(command, example, out.rstrip("/"), *extra)
    assert r.code == 2 and r.err.endswith("' is a folder; name the file to write\n")


def test_convert_of_a_folder_into_a_file_name_is_a_usage_error(cli, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    r = cli("convert", tmp_path / "src", tmp_path / "out.safetensors")
    assert r.code == 2 and r.err.startswith(
        f"error: the output '{tmp_path / 'out.safetensors'}' is named like a file; "
        "a folder is converted into a folder"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_convert_of_a_folder_with_nothing_to_convert_fails(cli, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hello")
    r = cli("convert", tmp_path / "empty", tmp_path / "out")
    assert r.code == 2 and "nothing to convert" in r.err and "*.bin" in r.err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- quiet and warnings


def test_quiet_keeps_warnings_and_drops_informational_lines(cli, tmp_path: Path) -> None:
    source = tmp_path / "big.safetensors"
    save_file({"big": np.array([1e5, 7e4, 1.0], np.float32)}, str(source))
    r = cli("-q", "cast", source, tmp_path / "f8.safetensors", "--to", "F8_E4M3")
    assert r.code == 0 and r.out == ""
    assert r.err == "warning: 2 finite values of big became Inf/NaN in F8_E4M3\n"
    r = cli("cast", source, tmp_path / "f8b.safetensors", "--to", "F8_E4M3")
    assert "cast 1 of 1 tensor to F8_E4M3" in r.out and r.err.startswith("warning: ")
    r = cli("-q", "metadata", "set", source, "a=b")
    assert r.code == 0 and r.out == "" and r.err == ""
    with safe_open(source, "np") as f:
        assert f.metadata() == {"a": "b"}


def test_convert_escapes_non_tensor_names(cli, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2), "\x1b]0;pwned\x07": 5}, ckpt)
    r = cli("convert", ckpt, tmp_path / "out.safetensors")
    assert r.code == 0, r.err
    assert 'skipped non-tensor values: "\\x1b]0;pwned\\x07"' in r.out
    assert "\x1b" not in r.out


def test_convert_reports_non_tensor_values_it_could_not_keep(cli, tmp_path: Path) -> None:
    """With --keep-non-tensors, a value named like a metadata key ("format", a --metadata key)
    cannot be stored under its name: reported, not dropped without a word."""
    import json

    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"format": "v2", "source": "x", "epoch": 3, "w": torch.ones(1)}, ckpt)
    out = tmp_path / "out.safetensors"
    r = cli("convert", ckpt, out, "--keep-non-tensors", "--metadata", "source=hub")
    assert r.code == 0, r.err
    assert "skipped non-tensor values (their names are metadata keys): format, source" in r.out
    with safe_open(out, "np") as f:
        assert f.metadata() == {"format": "pt", "source": "hub", "epoch": "3"}
    r = cli("convert", ckpt, tmp_path / "again.safetensors", "--json")
    (report,) = json.loads(r.out)["files"]
    assert report["skipped_non_tensors"] == ["format", "source", "epoch"]
    assert report["kept_non_tensors"] == []


# --------------------------------------------------------------------- no invented problems


def test_an_unknown_dtype_is_one_problem(cli, tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "c": {"dtype": "X99", "shape": [2], "data_offsets": [8, 16]},
        "d": ["X98", [2], [16, 24]],  # serde's sequence form
    }
    path = tmp_path / "unknown.safetensors"
    path.write_bytes(raw_file(header, bytes(24)))
    doc = cli("validate", path, "--json").json()
    assert [(p["code"], p["tensor"]) for p in doc["problems"]] == [
        ("InvalidHeaderDeserialization", "c"),
        ("InvalidHeaderDeserialization", "d"),
    ]


def test_an_index_with_a_tensor_in_the_wrong_shard_has_a_right_total(cli, sharded: Path) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    doc = cli("validate", sharded, "--json").json()
    assert [p["code"] for p in doc["problems"]] == ["IndexWrongShard"]
    # A total outside what the shards can hold is still its own problem.
    index["metadata"]["total_size"] = 1
    index_path.write_text(json.dumps(index))
    doc = cli("validate", sharded, "--json", "--strict").json()
    assert {p["code"] for p in doc["problems"]} == {"IndexWrongShard", "IndexTotalSize"}


# -------------------------------------------------------------------------- small traps


def test_cast_from_nothing_is_a_usage_error(cli, example: Path, tmp_path: Path) -> None:
    r = cli("cast", example, tmp_path / "o.safetensors", "--to", "bf16", "--from", ",")
    assert r.code == 2 and "--from names no dtype" in r.err
    assert not (tmp_path / "o.safetensors").exists()


def test_metadata_raw_needs_a_key(cli, example: Path) -> None:
    r = cli("metadata", "get", example, "--raw")
    assert r.code == 2 and "--raw prints one value" in r.err


def test_stats_histogram_bins_are_labelled_as_counted(cli, tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    save_file(
        {"const": np.full(4, 1000, np.int64), "fine": np.array([1000.0, 1000.1], np.float64)},
        str(path),
    )
    doc = cli("stats", path, "--json", "--histogram", "2").json()
    const = next(t for t in doc["tensors"] if t["name"] == "const")
    assert const["histogram"] == {"edges": [999.5, 1000.0, 1000.5], "counts": [0, 4]}
    out = cli("stats", path, "-f", "fine", "--histogram", "2").out
    # Labels tell neighbouring edges apart; the last bin is closed (it holds the maximum).
    assert f"[{'1000':>11}, {'1000.05':>11}){1:>12}" in out
    assert f"[{'1000.05':>11}, {'1000.1':>11}]{1:>12}" in out


def test_a_torch_checkpoint_is_named_as_one(cli, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    for name, legacy in (("model.bin", False), ("legacy.pt", True)):
        path = tmp_path / name
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)
        r = cli("inspect", path)
        kind = "a pickle" if legacy else "a zip archive"
        assert r.code == 1 and f"the file starts like {kind}" in r.err, r.err
        assert "`pysafetensors convert` converts PyTorch checkpoints" in r.err
        assert "max_header_size=" not in r.err


def test_scan_grades_attribute_chains_through_any_module_name_dangerous(
    cli, tmp_path: Path
) -> None:
    # A folder named "my-data" in the working directory is an importable namespace package:
    # a module name that is not an identifier proves nothing.
    path = tmp_path / "chain.pkl"
    path.write_bytes(b"\x80\x04cmy-data\n__spec__.loader.__class__.__init__.__globals__\n.")
    r = cli("scan", path)
    assert r.code == 2 and ": dangerous" in r.out


def test_header_length_prefix_alone_still_suggests_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(Exception, match="raise it with max_header_size= if the file is trusted"):
        safe_open(path, "np")


def test_output_closed_early_exits_as_sigpipe_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "many.safetensors"
    save_file({f"tensor.{i:05d}": np.zeros(1, np.float32) for i in range(3000)}, str(path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pysafetensors", "inspect", str(path), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(100)  # `| head -c 100`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == b""


def test_output_never_shows_url_credentials_or_signatures(cli, http_server) -> None:
    base = f"{http_server.url}/sharded/model.safetensors.index.json"
    secret = base.replace("http://", "http://user:PASSWD@") + "?X-Amz-Signature=QSECRET"
    for command in (
        ["inspect", secret],
        ["inspect", secret, "--json"],
        ["validate", secret],
        ["validate", secret, "--json"],
        ["hash", secret],
        ["stats", secret, "--json"],
        ["metadata", "get", secret, "--json"],
        ["diff", secret, secret],
    ):
        r = cli(*command)
        assert r.code in (0, 1), (command, r.err)
        assert "PASSWD" not in r.out + r.err and "QSECRET" not in r.out + r.err, command


def test_labels_and_outputs_of_a_signed_index_url_drop_its_query(
    cli, http_root: Path, http_server, tmp_path: Path
) -> None:
    folder = http_root / "invalid-index"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text("{bad")
    broken = f"{http_server.url}/invalid-index/model.safetensors.index.json?X-Amz-Signature=QSECRET"
    for command in (["validate", broken], ["validate", broken, "--json"]):
        r = cli(*command)
        assert r.code == 1 and "IndexInvalid" in r.out, (command, r.out, r.err)
        assert "QSECRET" not in r.out + r.err, command
    # A file written from a signed URL is named as the object, not with the query appended.
    signed = f"{http_server.url}/sharded/model.safetensors.index.json?X-Amz-Signature=QSECRET"
    out = tmp_path / "cast"
    r = cli("cast", signed, str(out), "--to", "F16")
    assert r.code == 0, r.err
    assert (out / "model.safetensors.index.json").is_file(), sorted(os.listdir(out))


def test_a_local_index_naming_a_url_is_refused(tmp_path: Path) -> None:
    from pysafetensors import ShardIndexError

    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s.safetensors"))
    index = {"metadata": {"total_size": 8}, "weight_map": {"a": "http://127.0.0.1:9/x.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ShardIndexError, match="looks like a URL"):
        safe_open(tmp_path, "np")


def test_a_refused_shard_name_of_a_remote_index_hides_the_credentials(
    http_root: Path, http_server
) -> None:
    from pysafetensors import ShardIndexError

    folder = http_root / "unsafe-shard-name"
    folder.mkdir()
    index = {"metadata": {}, "weight_map": {"a": "../model.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    url = f"{http_server.url}/unsafe-shard-name/model.safetensors.index.json"
    secret = url.replace("http://", "http://user:PASSWD@") + "?X-Amz-Signature=QSECRET"
    with pytest.raises(ShardIndexError, match=r"refused \(`..` in path\)") as info:
        safe_open(secret, "np")
    assert info.value.tensor == "a"
    assert "PASSWD" not in str(info.value) and "QSECRET" not in str(info.value)


def test_a_malformed_redirect_is_a_remote_error(tmp_path: Path) -> None:
    import http.server
    import threading

    from pysafetensors import RemoteError

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's API
            self.send_response(302)
            self.send_header("Location", "http://[::1/x.safetensors")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/m.safetensors"
        with pytest.raises(RemoteError, match="redirect \\(302\\) to a malformed URL"):
            safe_open(url, "np")
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------- a single output file beside an older index


def _halves() -> list[list[str]]:
    names = list(example_tensors())
    return [names[:2], names[2:]]


def _write_one_file(cli, command: str, tmp_path: Path, example: Path, out: Path):
    """Run a command that writes one file, ``out``."""
    torch = pytest.importorskip("torch")  # convert's checkpoint is written by torch.save

    if command == "cast":
        return cli("cast", example, out, "--to", "F16")
    if command == "merge":
        other = tmp_path / "other"
        if not other.exists():
            write_sharded(other, example_tensors(), _halves())
        return cli("merge", other, out)
    if command == "extract":
        return cli("extract", example, out, "model.embed.weight")
    pickled = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(3)}, pickled)
    return cli("convert", pickled, out)


@pytest.mark.parametrize("command", ["cast", "merge", "extract", "convert"])
def test_a_single_file_beside_another_checkpoints_index_is_warned_of(
    cli, tmp_path: Path, example: Path, command: str
) -> None:
    # The folder then holds two checkpoints: it opens by the old index here (and in vLLM), by
    # the new file in transformers. The old index and shards are left (they may be the only
    # copy of that checkpoint), and the command says so.
    out = tmp_path / "out"
    old = write_sharded(out, example_tensors(), _halves())
    before = sorted(p.name for p in old.iterdir())
    r = _write_one_file(cli, command, tmp_path, example, out / "model.safetensors")
    assert r.code == 0, r.err
    assert "warning: " in r.err and "model.safetensors.index.json" in r.err
    assert "opens by that index here" in r.err
    assert sorted(p.name for p in old.iterdir()) == sorted([*before, "model.safetensors"])
    # Under another name, or in a folder without that index, there is nothing to say.
    assert (
        "warning" not in _write_one_file(cli, command, tmp_path, example, out / "x.safetensors").err
    )
    alone = tmp_path / "alone" / "model.safetensors"
    assert "warning" not in _write_one_file(cli, command, tmp_path, example, alone).err


def test_a_folder_convert_beside_another_checkpoints_index_is_warned_of(
    cli, tmp_path: Path
) -> None:
    """Converting a folder into one with an older index said nothing (a single file's
    conversion warned); an index naming a shard that is not there is exit 2, as elsewhere."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    write_sharded(out, example_tensors(), _halves())
    torch.save({"w": torch.ones(3)}, out / "pytorch_model.bin")
    r = cli("convert", out, out)
    assert r.code == 0, r.err
    assert "warning: " in r.err and "opens by that index here" in r.err
    broken = tmp_path / "broken"
    broken.mkdir()
    listed = {"w": "pytorch_model-00001-of-00002.bin", "v": "pytorch_model-00002-of-00002.bin"}
    (broken / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": listed}))
    torch.save({"w": torch.ones(3)}, broken / "pytorch_model-00001-of-00002.bin")
    r = cli("convert", broken, tmp_path / "dst")
    assert r.code == 2, r.err
    assert "pytorch_model-00002-of-00002.bin" in r.err
