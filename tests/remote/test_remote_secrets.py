"""Credentials in URLs stay out of errors: in a password with an unencoded ``/``, ``?`` or
``#`` (which ends the URL's authority early, so the rest of it looks like a path, query or
fragment)."""

from __future__ import annotations

import pytest

from pysafetensors import safe_open
from pysafetensors._errors import RemoteError
from pysafetensors._remote import HTTPSource, shown_location

from .rangeserver import RangeServer

USER = "alice9"
SECRET_PARTS = ("pa55", "w0rdXYZ")


def _shows_secret(text: str) -> bool:
    return USER in text or any(part in text for part in SECRET_PARTS)


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
