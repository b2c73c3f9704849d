"""S3Source against moto's standalone S3 server on 127.0.0.1 (skipped without moto/boto3)."""

from __future__ import annotations

import contextlib
import random
import struct
from pathlib import Path
from typing import Any

import pytest

from pysafetensors._errors import RemoteError
from pysafetensors._range_reads import read_ranges_into
from pysafetensors._remote import (
    DEFAULT_HEAD_BYTES,
    RemoteNotFoundError,
    RemotePermissionError,
    S3Source,
    open_source,
    read_prefix,
)

from .conftest import BUCKET
from .rangeserver import RangeServer
from .test_remote_http import _tensor_span

boto3 = pytest.importorskip("boto3")


def _read(src: S3Source, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    src.readinto(offset, memoryview(buf))
    return bytes(buf)


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def test_open_is_one_request(moto_endpoint: str, data_dir: Path) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    with S3Source(_url("model.safetensors"), endpoint_url=moto_endpoint) as src:
        assert src.size == len(data)
        assert src.stats.requests == 1
        assert src.stats.bytes_fetched == DEFAULT_HEAD_BYTES
        (n,) = struct.unpack("<Q", read_prefix(src, 8))
        assert _read(src, 8, n) == data[8 : 8 + n]
        assert src.stats.requests == 1


def test_long_header_is_two_requests(moto_endpoint: str, data_dir: Path) -> None:
    data = (data_dir / "bigheader.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    with S3Source(_url("bigheader.safetensors"), endpoint_url=moto_endpoint) as src:
        assert _read(src, 8, n) == data[8 : 8 + n]
        assert src.stats.requests == 2
        assert src.stats.bytes_fetched == 8 + n


def test_random_ranges(moto_endpoint: str, data_dir: Path) -> None:
    data = (data_dir / "blob.bin").read_bytes()
    rnd = random.Random(11)
    with S3Source(_url("blob.bin"), endpoint_url=moto_endpoint, part_size=300_000) as src:
        for _ in range(20):
            offset = rnd.randrange(len(data))
            length = rnd.randrange(0, min(len(data) - offset, 800_000) + 1)
            assert _read(src, offset, length) == data[offset : offset + length]


def test_one_tensor_one_request_and_split_parts(moto_endpoint: str, data_dir: Path) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    start, length = _tensor_span(data, "ids")
    big_start, big_length = _tensor_span(data, "embed")
    with S3Source(
        _url("model.safetensors"), endpoint_url=moto_endpoint, part_size=256 << 10
    ) as src:
        src.stats.reset()
        assert _read(src, start, length) == data[start : start + length]
        assert src.stats.as_dict() == {"requests": 1, "bytes_fetched": length, "retries": 0}
        src.stats.reset()
        assert _read(src, big_start, big_length) == data[big_start : big_start + big_length]
        assert src.stats.requests == 4  # 1 MiB in 256 KiB parts
        assert src.stats.bytes_fetched == big_length


def test_adjacent_ranges_are_one_request(moto_endpoint: str, data_dir: Path) -> None:
    data = (data_dir / "model.safetensors").read_bytes()
    spans = [_tensor_span(data, f"block.{i}.bias") for i in range(12)]
    with S3Source(_url("model.safetensors"), endpoint_url=moto_endpoint) as src:
        src.stats.reset()
        out = bytearray(sum(n for _, n in spans))
        read_ranges_into(src, spans, memoryview(out))
        assert bytes(out) == b"".join(data[s : s + n] for s, n in spans)
        assert src.stats.requests == 1


def test_empty_object(moto_endpoint: str) -> None:
    with S3Source(_url("empty.bin"), endpoint_url=moto_endpoint) as src:
        assert src.size == 0
        assert src.stats.requests == 2  # the refused range, then HeadObject


def test_endpoint_from_environment(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    src = open_source(_url("small.safetensors"))
    try:
        assert isinstance(src, S3Source)
        assert src.head == (data_dir / "small.safetensors").read_bytes()
    finally:
        src.close()


def test_missing_key(moto_endpoint: str) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        S3Source(_url("nope.safetensors"), endpoint_url=moto_endpoint)
    assert isinstance(info.value, FileNotFoundError)
    assert "no such object" in str(info.value) and "NoSuchKey" in str(info.value)
    assert f"s3://{BUCKET}/nope.safetensors" in str(info.value)


def test_missing_bucket(moto_endpoint: str) -> None:
    with pytest.raises(RemoteNotFoundError, match="no such bucket.*NoSuchBucket"):
        S3Source("s3://no-such-bucket/x.safetensors", endpoint_url=moto_endpoint)


def _stubbed_client(code: str, status: int) -> Any:
    from botocore.stub import Stubber

    client = boto3.session.Session().client("s3", endpoint_url="http://127.0.0.1:9")
    stubber = Stubber(client)
    stubber.add_client_error("get_object", service_error_code=code, http_status_code=status)
    stubber.activate()
    return client


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_denied(code: str) -> None:
    # moto's server accepts any key by default, so these replies come from botocore's Stubber.
    with pytest.raises(RemotePermissionError) as info:
        S3Source(_url("model.safetensors"), client=_stubbed_client(code, 403))
    assert code in str(info.value) and "credentials" in str(info.value)
    assert isinstance(info.value, PermissionError) and isinstance(info.value, RemoteError)


def test_store_ignoring_range_large_object_is_refused() -> None:
    class WholeObject:
        """A client whose store ignores Range, as a misconfigured gateway might."""

        def get_object(self, **kwargs: Any) -> dict[str, Any]:
            import io

            from botocore.response import StreamingBody

            body = StreamingBody(io.BytesIO(b"\0" * 100), 5 << 20)
            return {"Body": body, "ContentLength": 5 << 20, "ETag": '"x"'}

    with pytest.raises(RemoteError) as info:
        S3Source(_url("x"), client=WholeObject())
    assert info.value.kind == "RangeNotSupported"


def test_bad_url() -> None:
    with pytest.raises(ValueError, match="not an s3://bucket/key URL"):
        S3Source("s3://bucket-only")


@pytest.mark.parametrize("url", ["s3://", "s3:///", "s3:///key", "S3A://"])
def test_url_without_a_bucket_says_so(url: str) -> None:
    # "s3://" ends with "/", so it is taken for a folder: the error names the missing bucket,
    # not the folder form.
    import pysafetensors

    with pytest.raises(ValueError, match="no bucket named in the S3 URL"):
        pysafetensors.safe_open(url, "np")


def test_sharded_index_uses_the_endpoint_from_storage_options(
    moto_endpoint: str, tmp_path: Path
) -> None:
    # No AWS_ENDPOINT_URL in the environment (the fixture removes it): the index and every shard
    # must be read through the endpoint given in storage_options, not from AWS.
    import numpy as np

    from pysafetensors import safe_open, save_sharded

    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    plan = save_sharded(sd, tmp_path, "9KB")
    assert plan.is_sharded
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    for path in tmp_path.iterdir():
        client.put_object(Bucket=BUCKET, Key=f"ck/{path.name}", Body=path.read_bytes())
    opts = {"endpoint_url": moto_endpoint}
    with safe_open(_url("ck/model.safetensors.index.json"), "np", storage_options=opts) as f:
        assert f.keys() == sorted(sd)
        np.testing.assert_array_equal(f.get_tensor("t3"), sd["t3"])
        f.validate()


def test_an_index_under_a_key_with_a_question_mark_is_an_index_for_the_tools_too(
    moto_endpoint: str, tmp_path: Path
) -> None:
    # '?' is a character of an S3 key, not a query string: the reader took the URL for an
    # index, while locate_model (the command line, validate()) cut it at the '?' and read the
    # index's JSON as a safetensors header ("header too large").
    import numpy as np

    from pysafetensors import safe_open, save_sharded
    from pysafetensors._validate import locate_model, validate

    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(3)}
    assert save_sharded(sd, tmp_path, "5KB").is_sharded
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    for path in tmp_path.iterdir():
        client.put_object(Bucket=BUCKET, Key=f"q?ck/{path.name}", Body=path.read_bytes())
    url = _url("q?ck/model.safetensors.index.json")
    opts = {"endpoint_url": moto_endpoint}
    with safe_open(url, "np", storage_options=opts) as f:
        assert f.keys() == sorted(sd)
    located = locate_model(url, storage_options=opts)
    assert located.index_path == url and not located.problems
    assert located.files == [_url(f"q?ck/model-0000{i}-of-00003.safetensors") for i in (1, 2, 3)]
    assert validate(url, strict=True, storage_options=opts) == []


def test_a_version_id_is_refused_for_an_index(moto_endpoint: str, tmp_path: Path) -> None:
    # The index's storage_options go to every shard: version_id asked each shard for the
    # index's version (NoSuchVersion, a "missing" shard after the index had been read).
    import numpy as np

    from pysafetensors import safe_open, save_sharded
    from pysafetensors._validate import locate_model

    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(3)}
    assert save_sharded(sd, tmp_path, "5KB").is_sharded
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket="versioned")
    client.put_bucket_versioning(Bucket="versioned", VersioningConfiguration={"Status": "Enabled"})
    versions = {
        path.name: client.put_object(
            Bucket="versioned", Key=f"ck/{path.name}", Body=path.read_bytes()
        )["VersionId"]
        for path in tmp_path.iterdir()
    }
    index = "s3://versioned/ck/model.safetensors.index.json"
    opts = {"endpoint_url": moto_endpoint, "version_id": versions["model.safetensors.index.json"]}
    with pytest.raises(ValueError, match="version_id cannot be given for the index"):
        safe_open(index, "np", storage_options=opts)
    with pytest.raises(ValueError, match="version_id cannot be given for the index"):
        locate_model(index, storage_options=opts)
    # One object at one of its versions still opens.
    shard = "model-00002-of-00003.safetensors"
    opts["version_id"] = versions[shard]
    with safe_open(f"s3://versioned/ck/{shard}", "np", storage_options=opts) as f:
        np.testing.assert_array_equal(f.get_tensor("t1"), sd["t1"])


def test_a_given_client_config_is_merged_not_replacing_anonymous_access() -> None:
    """client_kwargs={"config": Config(read_timeout=5)} replaced the library's Config whole:
    anon=True was lost (requests signed, or refused without credentials), and with it the pool
    size and retry settings."""
    import botocore
    from botocore.config import Config

    client = S3Source._make_client(
        "http://127.0.0.1:9", "us-east-1", True, 32, {"config": Config(read_timeout=5)}
    )
    config = client.meta.config
    assert config.signature_version is botocore.UNSIGNED
    assert config.read_timeout == 5 and config.max_pool_connections == 64  # shared: 2x
    assert config.retries == {"mode": "standard", "total_max_attempts": 5}  # our max_attempts=4


def test_a_config_that_is_not_a_config_is_a_type_error() -> None:
    # It was merged into the library's Config as it came: AttributeError('str' object has no
    # attribute '_user_provided_options'), naming no option.
    with pytest.raises(TypeError, match=r"client_kwargs\['config'\] must be a botocore"):
        S3Source(
            _url("model.safetensors"),
            endpoint_url="http://127.0.0.1:9",
            client_kwargs={"config": {"read_timeout": 5}},
        )


def test_a_body_longer_than_its_range_is_refused() -> None:
    """A ranged reply whose ContentLength (and body) is longer than its ContentRange says:
    its first bytes were taken and the rest dropped, where the HTTP source refuses the same
    reply ("Content-Length ... disagrees with the range")."""
    import io
    import re

    data = bytes(range(256)) * 1000

    class Padding:
        extra = 0

        def get_object(self, Bucket: str, Key: str, Range: str) -> dict[str, Any]:  # noqa: N803
            match = re.match(r"bytes=(\d+)-(\d+)", Range)
            assert match is not None
            a, b = int(match[1]), min(int(match[2]), len(data) - 1)
            return {
                "Body": io.BytesIO(data[a : b + 1] + b"X" * Padding.extra),
                "ContentRange": f"bytes {a}-{b}/{len(data)}",
                "ContentLength": b - a + 1 + Padding.extra,
                "ETag": '"v1"',
            }

    with S3Source(_url("k"), client=Padding(), read_ahead=0, retries=0) as src:
        Padding.extra = 4
        with pytest.raises(RemoteError, match="ContentLength 1004 disagrees") as info:
            _read(src, 100_000, 1000)
        assert info.value.kind == "Truncated"
        Padding.extra = 0
        assert _read(src, 100_000, 1000) == data[100_000:101_000]


def test_a_whole_body_of_another_version_is_refused() -> None:
    """A store that ignores Range sends the whole object; a different version of it (other
    size, other ETag) was read at the first version's offsets and changed the source's size."""
    import io
    import re

    v1 = bytes(range(256)) * 1000
    v2 = bytes([7]) * 200_000

    class ReplacedObject:
        calls = 0

        def get_object(self, Bucket: str, Key: str, Range: str) -> dict[str, Any]:  # noqa: N803
            ReplacedObject.calls += 1
            match = re.match(r"bytes=(\d+)-(\d+)", Range)
            assert match is not None
            a, b = map(int, match.groups())
            if ReplacedObject.calls == 1:
                b = min(b, len(v1) - 1)
                return {
                    "Body": io.BytesIO(v1[a : b + 1]),
                    "ContentRange": f"bytes {a}-{b}/{len(v1)}",
                    "ContentLength": b - a + 1,
                    "ETag": '"v1"',
                }
            return {"Body": io.BytesIO(v2), "ContentLength": len(v2), "ETag": '"v2"'}

    src = S3Source(_url("k"), client=ReplacedObject(), head_bytes=1024)
    with pytest.raises(RemoteError) as info:
        src.readinto(100_000, memoryview(bytearray(100)))
    assert info.value.kind == "Changed"
    assert src.size == len(v1)


def test_a_request_botocore_gave_up_on_is_not_retried_again() -> None:
    """botocore retries a request itself; a timeout raised by get_object was retried again
    here, multiplying the attempts (about 20 minutes against a stalled endpoint)."""
    from botocore.exceptions import ReadTimeoutError

    class Stalled:
        calls = 0

        def get_object(self, **kwargs: Any) -> dict[str, Any]:
            Stalled.calls += 1
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:9")

    with pytest.raises(RemoteError) as info:
        S3Source(_url("k"), client=Stalled(), backoff=0.01)
    assert info.value.kind == "Timeout" and Stalled.calls == 1


def test_credentials_in_an_endpoint_url_stay_out_of_messages() -> None:
    """botocore quotes the endpoint URL as given, user:password included."""
    from botocore.config import Config

    quick = Config(connect_timeout=0.5, retries={"max_attempts": 1})
    with pytest.raises(RemoteError) as info:
        S3Source(
            _url("k"),
            endpoint_url="http://user:hunter2@127.0.0.1:9",
            client_kwargs={"config": quick},
            anon=True,
        )
    assert "hunter2" not in str(info.value)


def test_load_shard_and_column_slices_from_s3(moto_endpoint: str, tmp_path: Path) -> None:
    """Row, column and replicated parts of a mixed file fetched by one plan of ranged GETs
    (readinto_scattered) from S3, and a column slice by blocks of rows: equal to local reads."""
    import numpy as np

    from pysafetensors import safe_open
    from pysafetensors.numpy import save_file
    from pysafetensors.parallel import load_shard

    rng = np.random.default_rng(15)
    tensors = {}
    for i in range(4):
        tensors[f"l{i}.big"] = rng.random((64, 384), np.float32)
        tensors[f"l{i}.small"] = rng.random((16, 48), np.float32)
        tensors[f"l{i}.rows"] = rng.random((96, 256), np.float32)
        tensors[f"l{i}.norm"] = rng.random(256, np.float32)
    path = tmp_path / "mixed-s3.safetensors"
    save_file(tensors, str(path))
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    client.put_object(Bucket=BUCKET, Key=path.name, Body=path.read_bytes())
    options = {"endpoint_url": moto_endpoint}
    rules = {"*.rows": "rows", "*.norm": "replicate", "*": "columns"}
    for mode in ("coalesce", "exact"):
        want = load_shard(path, 2, 3, rules, framework="np", slice_reads=mode)
        got = load_shard(
            _url(path.name), 2, 3, rules, framework="np", slice_reads=mode, storage_options=options
        )
        assert list(got) == list(want)
        for name, part in want.items():
            assert np.array_equal(got[name], part), (mode, name)
    with safe_open(_url(path.name), "np", storage_options=options) as f:
        assert np.array_equal(f.get_slice("l1.big")[:, 100:140], tensors["l1.big"][:, 100:140])
        assert np.array_equal(f.get_slice("l2.rows")[7:9], tensors["l2.rows"][7:9])


def test_a_credential_quoted_by_a_refused_header_stays_out_of_messages(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A session token with a stray line break: http.client refuses the header and quotes its
    # value, which botocore's message (and the chained exception) carried whole.
    token = "IQoJb3JpZ2luX2VjEXAMPLETOKENsecret\n"
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    with pytest.raises(RemoteError) as info:
        S3Source(_url("small.safetensors"), endpoint_url=moto_endpoint, retries=0)
    shown = str(info.value) + repr(info.value.__cause__) + repr(info.value.__context__)
    assert "EXAMPLETOKEN" not in shown
    assert "Invalid header value (not shown" in str(info.value)


def test_credentials_botocore_cannot_use_are_a_permission_error(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Raised while the client was made, as botocore's own exceptions (a traceback on the
    # command line): a key without its secret, a profile that does not exist.
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemotePermissionError, match="no usable AWS credentials"):
        S3Source(_url("small.safetensors"), endpoint_url=moto_endpoint)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(RemotePermissionError, match="no-such-profile"):
        S3Source(_url("small.safetensors"), endpoint_url=moto_endpoint)


def test_an_object_replaced_by_a_shorter_one_is_changed(moto_endpoint: str) -> None:
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    client.put_object(Bucket=BUCKET, Key="shrinks.bin", Body=b"a" * 200_000)
    with S3Source(_url("shrinks.bin"), endpoint_url=moto_endpoint, read_ahead=0) as src:
        client.put_object(Bucket=BUCKET, Key="shrinks.bin", Body=b"b" * 1000)
        with pytest.raises(RemoteError) as info:
            _read(src, 100_000, 10)
    # Was "range at offset 100000 not satisfiable", which says nothing of the change.
    assert info.value.kind == "Changed"
    assert "shorter than the 200000 bytes it had when opened" in str(info.value)


def test_an_anonymous_read_denied_does_not_advise_anon(moto_endpoint: str) -> None:
    # The advice to pass anon=True was given to a read that had passed it.
    with pytest.raises(RemotePermissionError) as info:
        S3Source(_url("small.safetensors"), endpoint_url=moto_endpoint, anon=True)
    assert "anon=True sends no credentials" in str(info.value)
    assert "pass anon=True" not in str(info.value)


def _client_error(code: str, status: int, headers: dict[str, str] | None = None) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError(
        {
            "Error": {"Code": code, "Message": f"{code} message"},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers or {}},
        },
        "GetObject",
    )


@pytest.mark.parametrize(("code", "status"), [("SlowDown", 503), ("InternalError", 500)])
def test_a_server_error_botocore_retried_is_not_retried_again(code: str, status: int) -> None:
    # botocore retries throttling and 5xx replies itself: retrying them again sent 4x its
    # requests (20 in all) into a store that had asked to slow down.
    class Throttled:
        calls = 0

        def get_object(self, **kwargs: Any) -> dict[str, Any]:
            Throttled.calls += 1
            raise _client_error(code, status)

    with pytest.raises(RemoteError) as info:
        S3Source(_url("k"), client=Throttled(), backoff=0.01)
    assert info.value.kind == "HTTPError" and code in str(info.value)
    assert Throttled.calls == 1


def test_a_server_error_on_the_size_of_an_empty_object_is_not_retried_again() -> None:
    class EmptyThrottled:
        calls = 0

        def get_object(self, **kwargs: Any) -> dict[str, Any]:
            raise _client_error("InvalidRange", 416)  # an empty object has no byte 0

        def head_object(self, **kwargs: Any) -> dict[str, Any]:
            EmptyThrottled.calls += 1
            raise _client_error("SlowDown", 503)

    with pytest.raises(RemoteError, match="SlowDown"):
        S3Source(_url("k"), client=EmptyThrottled(), backoff=0.01)
    assert EmptyThrottled.calls == 1


def test_a_bucket_elsewhere_names_its_region() -> None:
    class Redirected:
        def get_object(self, **kwargs: Any) -> dict[str, Any]:
            raise _client_error("PermanentRedirect", 301, {"x-amz-bucket-region": "eu-west-1"})

    with pytest.raises(RemoteError, match="PermanentRedirect") as info:
        S3Source(_url("k"), client=Redirected())
    assert "region 'eu-west-1'" in str(info.value) and "region_name=" in str(info.value)


def test_a_range_reply_of_unknown_total_is_not_the_whole_object() -> None:
    # "bytes 0-65535/*" (RFC 9110 allows an unknown total) was taken as a store ignoring Range:
    # its 64 KiB became the object's size, and the file then failed as a corrupt one.
    import io
    import re

    data = bytes(range(256)) * 1000

    class Unknown:
        total = "*"

        def get_object(self, Bucket: str, Key: str, Range: str) -> dict[str, Any]:  # noqa: N803
            match = re.match(r"bytes=(\d+)-(\d+)", Range)
            assert match is not None
            a, b = int(match[1]), min(int(match[2]), len(data) - 1)
            return {
                "Body": io.BytesIO(data[a : b + 1]),
                "ContentRange": f"bytes {a}-{b}/{Unknown.total}",
                "ContentLength": b - a + 1,
                "ETag": '"v1"',
            }

    with pytest.raises(RemoteError, match="cannot learn the object's size") as info:
        S3Source(_url("k"), client=Unknown())
    assert info.value.kind == "RangeNotSupported"
    # Once the size is known, a reply that leaves the total out is read.
    Unknown.total = str(len(data))
    with S3Source(_url("k"), client=Unknown(), read_ahead=0) as src:
        Unknown.total = "*"
        assert _read(src, 100_000, 1000) == data[100_000:101_000]


def test_the_shards_of_a_checkpoint_share_one_client_closed_with_the_last(
    moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A boto3 session and client per shard: ~12 MB and a few sockets each, kept after close().
    import numpy as np

    from pysafetensors import safe_open, save_sharded

    made: list[Any] = []
    make = S3Source._make_client

    def counted(*args: Any) -> Any:
        made.append(make(*args))
        return made[-1]

    monkeypatch.setattr(S3Source, "_make_client", staticmethod(counted))
    sd = {f"t{i}": np.full(1000, i, np.float32) for i in range(8)}
    assert save_sharded(sd, tmp_path, "5KB").is_sharded
    upload = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    for path in tmp_path.iterdir():
        upload.put_object(Bucket=BUCKET, Key=f"share/{path.name}", Body=path.read_bytes())
    opts = {"endpoint_url": moto_endpoint}
    with safe_open(_url("share/model.safetensors.index.json"), "np", storage_options=opts) as f:
        for name, value in sd.items():
            np.testing.assert_array_equal(f.get_tensor(name), value)
        # The index's (closed once read, with its client), then the eight shards' one.
        assert len(made) == 2
        assert len(made[0]._endpoint.http_session._manager.pools) == 0
        pools = made[1]._endpoint.http_session._manager.pools
        assert len(pools) == 1
    assert len(pools) == 0  # closed with the last shard
    # Another set of options is another client.
    with S3Source(_url("small.safetensors"), endpoint_url=moto_endpoint, max_connections=32):
        assert len(made) == 3
    # A source collected without close() gives its client back too.
    import gc

    src = S3Source(_url("small.safetensors"), endpoint_url=moto_endpoint)
    pools = made[3]._endpoint.http_session._manager.pools
    assert len(pools) == 1
    del src
    gc.collect()
    assert len(pools) == 0


def _pooled_socket_inodes(client: Any) -> set[int]:
    """The idle connections of a boto3 client, by their sockets' inode."""
    import os

    inodes = set()
    for pool in list(client._endpoint.http_session._manager.pools._container.values()):
        for conn in list(pool.pool.queue):
            sock = getattr(conn, "sock", None)
            if sock is not None:
                inodes.add(os.fstat(sock.fileno()).st_ino)
    return inodes


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.parametrize("given", [False, True])
def test_a_forked_child_does_not_use_its_parent_s_connections(
    data_dir: Path, tmp_path: Path, given: bool
) -> None:
    # Two processes sending requests on one inherited keep-alive connection read each other's
    # replies: wrong tensor bytes, with no error (DataLoader workers forked after an open).
    # Served by a keep-alive loopback server (moto's closes every connection) as bucket "b".
    import os

    data = (data_dir / "model.safetensors").read_bytes()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").write_bytes(data)
    server = RangeServer(tmp_path)
    try:
        endpoint = server.url("").rstrip("/")
        client = S3Source._make_client(endpoint, "us-east-1", True, 8, {}) if given else None
        opts: dict[str, Any] = (
            {"client": client} if given else {"endpoint_url": endpoint, "anon": True}
        )
        with S3Source("s3://b/model.safetensors", read_ahead=0, head_bytes=0, **opts) as src:
            assert _read(src, 100, 1000) == data[100:1100]
            parents = _pooled_socket_inodes(src._client)
            assert parents
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    ok = _read(src, 5000, 3000) == data[5000:8000]
                    open_now = set()
                    for fd in os.listdir("/proc/self/fd"):
                        with contextlib.suppress(OSError):  # the listing's own descriptor
                            open_now.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
                    code = 0 if ok and not parents & open_now else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            # The parent's connection is its own still.
            assert _read(src, 200, 100) == data[200:300]
            assert _pooled_socket_inodes(src._client) == parents
    finally:
        server.close()
