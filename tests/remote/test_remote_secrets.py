"""Credentials in URLs stay out of errors: in a password with an unencoded ``/``, ``?`` or
``#`` (which ends the URL's authority early, so the rest of it looks like a path, query or
fragment), and in the exceptions an S3 error chains to (botocore quotes the endpoint URL as
given)."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import pytest

from pysafetensors import safe_open
from pysafetensors._errors import RemoteError
from pysafetensors._remote import HTTPSource, S3Source, shown_location
from pysafetensors._remote_urls import scrubbed

from .rangeserver import RangeServer

USER = "alice9"
SECRET_PARTS = ("pa55", "w0rdXYZ")


def _shows_secret(text: str) -> bool:
    return USER in text or any(part in text for part in SECRET_PARTS)


def _everything_printed(exc: BaseException) -> str:
    """What a traceback shows, plus every exception reachable through the chain."""
    texts = ["".join(traceback.format_exception(exc))]
    pending: list[BaseException | None] = [exc.__cause__, exc.__context__]
    while pending:
        e = pending.pop()
        if e is not None:
            texts.append("".join(traceback.format_exception(e)))
            pending.extend([e.__cause__, e.__context__])
    return "\n".join(texts)


@pytest.mark.parametrize("sep", ["/", "?", "#"])
def test_a_password_with_an_unencoded_delimiter_is_not_shown(server: RangeServer, sep: str) -> None:
    url = f"http://{USER}:{SECRET_PARTS[0]}{sep}{SECRET_PARTS[1]}@127.0.0.1:{server.port}/small.safetensors"
    with pytest.raises(RemoteError) as info:
        safe_open(url, "np")
    assert info.value.kind == "InvalidURL"
    assert not _shows_secret(str(info.value)), info.value
    assert "percent-encoded" in str(info.value)
    assert f"127.0.0.1:{server.port}/small.safetensors" in str(info.value)
    assert not _shows_secret(shown_location(url))
    assert server.requests() == 0


@pytest.mark.parametrize("sep", ["/", "?", "#"])
def test_a_redirect_to_such_a_url_does_not_show_it(server: RangeServer, sep: str) -> None:
    server.redirect_base = f"http://{USER}:{SECRET_PARTS[0]}{sep}{SECRET_PARTS[1]}@127.0.0.1:1"
    with pytest.raises(RemoteError) as info:
        HTTPSource(server.url("redirect-to/small.safetensors"))
    assert info.value.kind == "InvalidURL"
    assert not _shows_secret(str(info.value)), info.value


def test_well_formed_urls_are_shown_as_before() -> None:
    assert shown_location("http://u:p@host:8080/a@b/f?sig=1") == "http://host:8080/a@b/f?..."
    assert shown_location("https://host/x#frag") == "https://host/x"
    assert shown_location("s3://bucket/key@1") == "s3://bucket/key@1"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _s3_options(endpoint: str) -> dict[str, object]:
    config = pytest.importorskip("botocore.config")
    return {
        "endpoint_url": endpoint,
        "client_kwargs": {
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
            "config": config.Config(connect_timeout=1, retries={"max_attempts": 1}),
        },
    }


@pytest.mark.parametrize("port", ["closed", "not-a-number"])
def test_an_s3_endpoint_s_password_is_not_chained(port: str) -> None:
    pytest.importorskip("boto3")
    where = str(_closed_port()) if port == "closed" else "xx"
    endpoint = f"http://{USER}:{SECRET_PARTS[0]}{SECRET_PARTS[1]}@127.0.0.1:{where}"
    with pytest.raises(RemoteError) as info:
        S3Source("s3://bucket/x.safetensors", **_s3_options(endpoint))  # type: ignore[arg-type]
    assert not _shows_secret(str(info.value)), info.value
    assert "127.0.0.1" in str(info.value)
    assert not _shows_secret(_everything_printed(info.value))


def test_a_malformed_s3_endpoint_is_refused_without_its_password() -> None:
    pytest.importorskip("boto3")
    endpoint = f"htp:/{USER}:{SECRET_PARTS[0]}{SECRET_PARTS[1]}@"
    with pytest.raises(ValueError, match="S3 endpoint") as info:
        S3Source("s3://bucket/x.safetensors", **_s3_options(endpoint))  # type: ignore[arg-type]
    assert not _shows_secret(_everything_printed(info.value))


def test_an_s3_endpoint_s_query_string_is_not_shown() -> None:
    # botocore refuses such an endpoint, quoting it whole: a token in its query string too.
    pytest.importorskip("boto3")
    endpoint = f"http://127.0.0.1:1/?token={SECRET_PARTS[0]}{SECRET_PARTS[1]}"
    with pytest.raises(RemoteError) as info:
        S3Source("s3://bucket/x.safetensors", **_s3_options(endpoint))  # type: ignore[arg-type]
    assert "127.0.0.1" in str(info.value)
    assert not _shows_secret(_everything_printed(info.value))


def test_an_s3_error_without_credentials_keeps_its_cause() -> None:
    # Chains are cut only where they would show a secret.
    pytest.importorskip("boto3")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(RemoteError) as info:
        S3Source("s3://bucket/x.safetensors", **_s3_options(endpoint))  # type: ignore[arg-type]
    assert info.value.__cause__ is not None


SECRET_URL = "https://alice:S3CRETPW@127.0.0.1:1/x.safetensors?X-Amz-Signature=S1GSECRET"


def _shows_no_secret(exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    assert "S3CRETPW" not in text and "S1GSECRET" not in text, text


def test_apis_that_take_local_paths_do_not_show_a_url_s_secrets() -> None:
    """A URL where a local path is expected (a save, a metadata edit) or one holding a NUL:
    the error quoted it whole, password and signature included."""
    import numpy as np

    from pysafetensors import WriteError, edit_metadata, save_sharded
    from pysafetensors.numpy import save_file

    tensors = {"x": np.zeros(2, np.float32)}
    attempts = [
        (lambda: safe_open(SECRET_URL.replace("x.", "x\x00."), "np"), FileNotFoundError),
        (lambda: edit_metadata(SECRET_URL, {"a": "b"}), FileNotFoundError),
        (lambda: save_file(tensors, SECRET_URL), WriteError),
        (lambda: save_sharded(tensors, SECRET_URL), WriteError),
        (lambda: save_file(tensors, SECRET_URL.replace("x.", "x\x00.")), WriteError),
    ]
    for attempt, expected in attempts:
        with pytest.raises(expected) as info:
            attempt()
        assert isinstance(info.value, FileNotFoundError | OSError)
        _shows_no_secret(info.value)
        assert "127.0.0.1:1/x" in str(info.value)
    assert not Path("https:").exists()  # nothing was created under the URL as a local path


def test_a_password_with_an_unencoded_at_sign_is_not_shown_in_part() -> None:
    """``user:p@ssword@host``: the scrub of ``user:password@`` in quoted URLs stopped at the
    first '@', and ran before the exact password was taken out, so botocore's "Could not
    connect to the endpoint URL" showed the rest of the password (``http://ssword@host``)."""
    pytest.importorskip("boto3")
    port = _closed_port()
    password = f"{SECRET_PARTS[0]}@{SECRET_PARTS[1]}"
    endpoint = f"http://{USER}:{password}@127.0.0.1:{port}"
    with pytest.raises(RemoteError) as info:
        S3Source("s3://bucket/x.safetensors", **_s3_options(endpoint))  # type: ignore[arg-type]
    assert not _shows_secret(_everything_printed(info.value)), info.value
    assert f"http://127.0.0.1:{port}/bucket/x.safetensors" in str(info.value)
    with pytest.raises(RemoteError) as http:
        HTTPSource(f"http://{USER}:{password}@127.0.0.1:{port}/x.safetensors", retries=0)
    assert not _shows_secret(_everything_printed(http.value)), http.value
    assert f"http://127.0.0.1:{port}/x.safetensors" in str(http.value)


def test_quoted_urls_lose_everything_up_to_the_last_at_sign_of_their_authority() -> None:
    # Exceptions that quote a URL whose password the source was not told of (a redirect's,
    # botocore's own) kept all but the first part of a password holding an '@'.
    text = scrubbed(ValueError('bad "http://u:p@ss@w0rd@host:1/a@b/c" and ftp://x:y@h/p@q'))
    assert text == 'bad "http://host:1/a@b/c" and ftp://h/p@q'


@pytest.mark.parametrize(
    "url",
    [
        "http://user:2024/s3cr?t@host/f.safetensors",
        "http://user:2024/a#b@host/f.safetensors",
        "http://user:2024?pw@host/f.safetensors",
        "http://user:2024/pw@host/f.safetensors",
    ],
)
def test_a_password_of_digits_before_a_separator_is_not_shown(url: str) -> None:
    """A password of digits up to an unencoded '/', '?' or '#' parses as a port, the rest of
    it as the path, query or fragment. Telling an '@' of the query from one ending such a
    password showed most of ``user:2024/s3cr?t@host``'s; any '@' after a port is taken for
    one (so ``host:1/f?email=me@corp.example`` is shown as ``http://corp.example``)."""
    shown = shown_location(url)
    assert shown == "http://host/f.safetensors", shown
