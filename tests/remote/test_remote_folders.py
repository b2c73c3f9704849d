"""A folder URL (``.../ckpt/``) opened as a checkpoint: over HTTP by its conventional names,
over S3 and fsspec by one listing and the local folder rule, against the loopback range
server and moto's S3 server."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pysafetensors import MissingShardError, ShardIndexError, safe_open, save_sharded
from pysafetensors._cli import main
from pysafetensors._errors import RemoteError, RemoteNotFoundError, RemotePermissionError
from pysafetensors._validate import locate_model, validate
from pysafetensors.numpy import load_file, save_file
from pysafetensors.parallel import load_shard

from .conftest import BUCKET
from .rangeserver import RangeServer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TENSORS = {f"t{i}": np.full(1000, i, np.float32) for i in range(6)}
ONE = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}


def _write_folders(root: Path) -> None:
    """``sharded``: an index and three shards; ``single``: ``model.safetensors``; ``neither``:
    no checkpoint; ``named``: one file by another name (only a listing finds it); and the
    folders the local rule refuses."""
    plan = save_sharded(TENSORS, root / "sharded", "9KB", metadata={"k": "v"})
    assert plan.is_sharded and len(plan.filename_to_tensors) == 3
    (root / "single").mkdir()
    save_file(ONE, str(root / "single" / SINGLE))
    (root / "neither").mkdir()
    (root / "neither" / "notes.txt").write_text("no checkpoint here\n")
    (root / "named").mkdir()
    save_file(ONE, str(root / "named" / "diffusion_pytorch_model.safetensors"))
    # Two single files, two indexes, shards without their index: ambiguous or incomplete.
    (root / "two-files").mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file(ONE, str(root / "two-files" / name))
    shutil.copytree(root / "sharded", root / "two-indexes")
    shutil.copy(root / "sharded" / INDEX, root / "two-indexes" / "other.safetensors.index.json")
    (root / "two-indexes" / INDEX).rename(root / "two-indexes" / "one.safetensors.index.json")
    shutil.copytree(root / "sharded", root / "only-shards")
    (root / "only-shards" / INDEX).unlink()


@pytest.fixture(scope="module")
def folders(data_dir: Path) -> Path:
    root = data_dir / f"folders-{uuid.uuid4().hex[:8]}"
    _write_folders(root)
    return root


def _url(server: RangeServer, folders: Path, rel: str) -> str:
    return server.url(f"{folders.name}/{rel}")


def _log(server: RangeServer) -> list[tuple[str, str | None, int]]:
    """The requests made, each as (file name with any query string, range, status)."""
    return [(r.path.rsplit("/", 1)[-1], r.range, r.status) for r in server.records()]


# ---------------------------------------------------------------------------------- HTTP


def test_http_folder_with_an_index_opens_it_at_no_extra_request(
    server: RangeServer, folders: Path
) -> None:
    folder = _url(server, folders, "sharded/")
    with safe_open(folder, "np") as f:
        assert f.keys() == sorted(TENSORS)
        assert (f.metadata() or {})["k"] == "v"
        np.testing.assert_array_equal(f.get_tensor("t4"), TENSORS["t4"])
        assert f.path == folder + INDEX
        assert f.shard_of("t4").startswith(folder + "model-0000")
    by_folder = _log(server)
    server.reset()
    with safe_open(folder + INDEX, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("t4"), TENSORS["t4"])
    # The index's request is the one the folder's resolution made: the same requests.
    assert by_folder == _log(server)
    assert by_folder[0] == (INDEX, "bytes=0-65535", 206)


@pytest.mark.parametrize("how", ["load_file", "load_shard"])
def test_http_folder_loads(server: RangeServer, folders: Path, how: str) -> None:
    counts = []
    for target in ("sharded/", f"sharded/{INDEX}"):
        server.reset()
        url = _url(server, folders, target)
        if how == "load_file":
            loaded = load_file(url)
            assert sorted(loaded) == sorted(TENSORS)
            for name, value in TENSORS.items():
                np.testing.assert_array_equal(loaded[name], value)
        else:
            part = load_shard(url, 1, 2, {"t*": "rows"}, framework="np")
            np.testing.assert_array_equal(part["t2"], TENSORS["t2"][500:])
        counts.append(server.requests())
    assert counts[0] == counts[1]


def test_http_folder_with_a_single_file(server: RangeServer, folders: Path) -> None:
    folder = _url(server, folders, "single/")
    with safe_open(folder, "np") as f:
        assert f.keys() == ["x"]
        np.testing.assert_array_equal(f.get_tensor("x"), ONE["x"])
        assert f.path == folder + SINGLE
    # The index's 404, a one-byte probe of the file, then the file opened as its URL opens.
    assert _log(server)[:2] == [(INDEX, "bytes=0-65535", 404), (SINGLE, "bytes=0-0", 206)]
    by_folder = server.requests()
    server.reset()
    with safe_open(folder + SINGLE, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("x"), ONE["x"])
    assert by_folder == server.requests() + 2


def test_http_folder_with_neither_name(server: RangeServer, folders: Path) -> None:
    folder = _url(server, folders, "neither/")
    with pytest.raises(RemoteNotFoundError) as info:
        safe_open(folder, "np")
    assert isinstance(info.value, FileNotFoundError) and info.value.kind == "NotFound"
    message = str(info.value)
    assert repr(folder) in message and INDEX in message and SINGLE in message
    assert [(n, s) for n, _, s in _log(server)] == [(INDEX, 404), (SINGLE, 404)]
    # The tools resolve it alike.
    with pytest.raises(RemoteNotFoundError, match="neither model.safetensors.index.json nor"):
        locate_model(folder)


def test_http_only_a_missing_index_moves_on(server: RangeServer, folders: Path) -> None:
    # A 403 on the index is raised, not taken for "no index" (the single file is not tried).
    path = f"{folders.name}/sharded/{INDEX}"
    server.inject(path, 403)
    with pytest.raises(RemotePermissionError):
        safe_open(_url(server, folders, "sharded/"), "np")
    assert [(n, s) for n, _, s in _log(server)] == [(INDEX, 403)]
    # Nor a server error that outlasts the retries.
    server.reset()
    server.inject(path, 503, 503)
    with pytest.raises(RemoteError) as info:
        safe_open(
            _url(server, folders, "sharded/"),
            "np",
            storage_options={"retries": 1, "backoff": 0.0},
        )
    assert not isinstance(info.value, RemoteNotFoundError)
    assert [(n, s) for n, _, s in _log(server)] == [(INDEX, 503), (INDEX, 503)]
    # A 403 on the single file, after the index's 404, is raised too.
    server.reset()
    server.inject(f"{folders.name}/single/{SINGLE}", 403)
    with pytest.raises(RemotePermissionError):
        safe_open(_url(server, folders, "single/"), "np")


def test_http_folder_query_string_goes_to_the_file_found_only(
    server: RangeServer, folders: Path
) -> None:
    # As for an index URL: the query string (the hub's ?download=true, a signature) is the
    # request's for the file found there, and not passed on to the shards.
    with safe_open(_url(server, folders, "sharded/?download=true"), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("t1"), TENSORS["t1"])
        assert "?" not in f.shard_of("t1")
    names = [n for n, _, _ in _log(server)]
    assert names[0] == f"{INDEX}?download=true"
    assert len(names) > 1 and all("?" not in n for n in names[1:])
    server.reset()
    with safe_open(_url(server, folders, "single/?download=true"), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("x"), ONE["x"])
    assert [n for n, _, _ in _log(server)] == [
        f"{INDEX}?download=true",
        f"{SINGLE}?download=true",
        f"{SINGLE}?download=true",
    ]


def test_http_folder_errors_show_no_secrets(server: RangeServer, folders: Path) -> None:
    url = _url(server, folders, "neither/?token=sup3rs3cret")
    url = url.replace("://", "://user:pa55word@")
    with pytest.raises(RemoteNotFoundError) as info:
        safe_open(url, "np")
    message = str(info.value)
    assert "sup3rs3cret" not in message and "pa55word" not in message
    assert f"{folders.name}/neither/?..." in message


def test_cli_on_an_http_folder(
    server: RangeServer, folders: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _url(server, folders, "sharded/")
    assert main(["inspect", "--json", folder]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sharded"] is True and len(doc["files"]) == 3
    assert sorted(t["name"] for t in doc["tensors"]) == sorted(TENSORS)
    # The same requests as the index URL's inspect.
    by_folder = _log(server)
    server.reset()
    assert main(["inspect", "--json", folder + INDEX]) == 0
    capsys.readouterr()
    assert sorted(by_folder) == sorted(_log(server))
    assert main(["hash", "--json", _url(server, folders, "single/")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [f["path"] for f in doc["files"]] == [SINGLE]
    assert main(["validate", _url(server, folders, "neither/")]) == 2
    err = capsys.readouterr().err
    assert "neither model.safetensors.index.json nor model.safetensors" in err


# ------------------------------------------------------------------------------------ S3


@pytest.fixture(scope="module")
def s3_folders(moto_endpoint: str, folders: Path) -> str:
    """The folders uploaded under ``s3://models/<name>/``; returns that URL."""
    import boto3

    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    for path in folders.rglob("*"):
        if path.is_file():
            key = f"{folders.name}/{path.relative_to(folders).as_posix()}"
            client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
    # A folder's marker object (as consoles make them) and a folder holding nothing else.
    client.put_object(Bucket=BUCKET, Key=f"{folders.name}/sharded/", Body=b"")
    client.put_object(Bucket=BUCKET, Key=f"{folders.name}/marker-only/", Body=b"")
    return f"s3://{BUCKET}/{folders.name}/"


class _Calls:
    """A boto3 client that counts the S3 operations it sends."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint)
        self.names: list[str] = []
        self.client.meta.events.register("before-call.s3", self._note)

    def _note(self, model: Any, **_: Any) -> None:
        self.names.append(model.name)


def test_s3_folder_with_an_index(moto_endpoint: str, s3_folders: str) -> None:
    folder = s3_folders + "sharded/"
    calls = _Calls(moto_endpoint)
    with safe_open(folder, "np", storage_options={"client": calls.client}) as f:
        assert f.keys() == sorted(TENSORS)
        np.testing.assert_array_equal(f.get_tensor("t5"), TENSORS["t5"])
        assert f.path == folder + INDEX
        f.validate()
    by_folder = calls.names
    calls = _Calls(moto_endpoint)
    with safe_open(folder + INDEX, "np", storage_options={"client": calls.client}) as f:
        np.testing.assert_array_equal(f.get_tensor("t5"), TENSORS["t5"])
        f.validate()
    # One listing more than the index URL: nothing else.
    assert by_folder == ["ListObjectsV2", *calls.names]
    opts = {"endpoint_url": moto_endpoint}
    part = load_shard(folder, 0, 2, {"t*": "rows"}, framework="np", storage_options=opts)
    np.testing.assert_array_equal(part["t3"], TENSORS["t3"][:500])
    assert validate(folder, storage_options=opts) == []


@pytest.mark.parametrize(("rel", "name"), [("single/", SINGLE), ("named/", None)])
def test_s3_folder_with_a_single_file(
    moto_endpoint: str, s3_folders: str, rel: str, name: str | None
) -> None:
    folder = s3_folders + rel
    name = name or "diffusion_pytorch_model.safetensors"
    calls = _Calls(moto_endpoint)
    with safe_open(folder, "np", storage_options={"client": calls.client}) as f:
        np.testing.assert_array_equal(f.get_tensor("x"), ONE["x"])
        assert f.path == folder + name
    assert calls.names[0] == "ListObjectsV2" and calls.names.count("ListObjectsV2") == 1
    loaded = load_file(folder, storage_options={"endpoint_url": moto_endpoint})
    np.testing.assert_array_equal(loaded["x"], ONE["x"])


@pytest.mark.parametrize("rel", ["two-files", "two-indexes", "only-shards", "neither"])
def test_s3_folder_refused_as_the_local_rule_refuses_it(
    moto_endpoint: str, s3_folders: str, folders: Path, rel: str
) -> None:
    with pytest.raises((ShardIndexError, MissingShardError)) as local:
        safe_open(folders / rel, "np")
    folder = s3_folders + rel + "/"
    opts = {"endpoint_url": moto_endpoint}
    with pytest.raises(type(local.value)) as remote:
        safe_open(folder, "np", storage_options=opts)
    assert remote.value.kind == local.value.kind
    # The same words, naming the URL for the path.
    assert str(remote.value) == str(local.value).replace(repr(str(folders / rel)), repr(folder))
    with pytest.raises(type(local.value)):
        locate_model(folder, storage_options=opts)


@pytest.mark.parametrize("rel", ["nothing-here/", "marker-only/"])
def test_s3_empty_prefix(moto_endpoint: str, s3_folders: str, rel: str) -> None:
    folder = s3_folders + rel
    with pytest.raises(MissingShardError) as info:
        safe_open(folder, "np", storage_options={"endpoint_url": moto_endpoint})
    assert isinstance(info.value, FileNotFoundError) and info.value.kind == "NoCheckpoint"
    assert repr(folder) in str(info.value)


def test_s3_bucket_root_and_missing_bucket(moto_endpoint: str, s3_folders: str) -> None:
    opts = {"endpoint_url": moto_endpoint}
    # The bucket's top level holds the test files, model.safetensors among them.
    with safe_open(f"s3://{BUCKET}/", "np", storage_options=opts) as f:
        assert f.path == f"s3://{BUCKET}/{SINGLE}"
    with pytest.raises(RemoteNotFoundError, match="no such bucket"):
        safe_open("s3://no-such-bucket-here/ckpt/", "np", storage_options=opts)


def test_s3_folder_refuses_a_version_id(moto_endpoint: str, s3_folders: str) -> None:
    calls = _Calls(moto_endpoint)
    opts = {"client": calls.client, "version_id": "abc"}
    for folder in (s3_folders + "sharded/", s3_folders + "single/"):
        with pytest.raises(ValueError, match="version_id cannot be given for the folder URL"):
            safe_open(folder, "np", storage_options=opts)
        with pytest.raises(ValueError, match="version_id cannot be given for the folder URL"):
            locate_model(folder, storage_options=opts)
    assert calls.names == []  # refused before any request


def test_cli_on_an_s3_folder(
    moto_endpoint: str, s3_folders: str, capsys: pytest.CaptureFixture[str]
) -> None:
    option = ["--remote-option", f"endpoint_url={moto_endpoint}"]
    assert main(["validate", *option, s3_folders + "sharded/"]) == 0
    capsys.readouterr()
    assert main(["stats", "--json", *option, s3_folders + "single/"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in doc["tensors"]] == ["x"]
    assert main(["inspect", *option, s3_folders + "two-files/"]) == 2
    assert "holds several checkpoints" in capsys.readouterr().err


# -------------------------------------------------------------------------------- fsspec


@pytest.fixture
def memory_folders(folders: Path) -> Iterator[str]:
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://pst-folders-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for path in folders.rglob("*"):
        if path.is_file():
            fs.pipe_file(f"{root}/{path.relative_to(folders).as_posix()}", path.read_bytes())
    yield root + "/"
    fs.rm(root, recursive=True)


def test_fsspec_folders(memory_folders: str) -> None:
    with safe_open(memory_folders + "sharded/", "np") as f:
        np.testing.assert_array_equal(f.get_tensor("t2"), TENSORS["t2"])
        assert f.path == memory_folders + "sharded/" + INDEX
    with safe_open(memory_folders + "named/", "np") as f:
        np.testing.assert_array_equal(f.get_tensor("x"), ONE["x"])
    with pytest.raises(ShardIndexError) as info:
        safe_open(memory_folders + "two-files/", "np")
    assert info.value.kind == "AmbiguousFolder"
    with pytest.raises(RemoteNotFoundError):
        safe_open(memory_folders + "no-such-folder/", "np")
