"""URLs as remote sources show them: without credentials or signatures, in messages and
output; the names and folders of remote objects; secrets kept out of quoted exceptions."""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

#: ``scheme://user:password@`` in a quoted URL: up to the last '@' before the path (a password
#: may hold an unencoded '@'; stopping at the first one showed the rest of it as the host).
#: Not in ``hf://``, whose '@' marks a revision (``hf://gpt2@main/model.safetensors``).
_URL_CREDENTIALS: Final = re.compile(r"(\b(?![hH][fF]://)[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s\"']+@")

#: Schemes whose URLs carry no ``user:password@``: an '@' there is something else (the Hub's
#: ``repo@revision``; its token is a storage option, never part of the URL).
_NO_USERINFO: Final = frozenset({"hf"})


#: http.client's refusal of a header value quotes the value, which may be a credential (an
#: access key ID in a signed request's ``Authorization``, a session token with a stray line
#: break): everything from the phrase to the end of the line goes.
_HEADER_VALUE: Final = re.compile(r"(Invalid header value)\b[^\n]*")


def scrubbed(exc: BaseException | str) -> str:
    """An exception's text (or a text) without ``user:password@`` in the URLs it quotes
    (botocore names the endpoint URL as given, credentials included), nor the header values it
    quotes."""
    text = _URL_CREDENTIALS.sub(r"\1", str(exc))
    return _HEADER_VALUE.sub(r"\1 (not shown: it may hold a credential)", text)


def _url_userinfo(url: str) -> str:
    """The ``user:password`` a URL carries before its host ('' when none), as :func:`redact`
    drops it: in a URL that does not parse (or has no ``://``), everything up to the last
    ``@``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rpartition("@")[0]
    if scheme.lower() in _NO_USERINFO:
        return ""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return rest.rpartition("@")[0]
    return parts.netloc.rpartition("@")[0]


#: fsspec's chain separator (``simplecache::s3://...``, ``zip://m::file:///x.zip``), where it
#: is not inside an IPv6 host's brackets (``http://[::1]:8000/``).
_CHAIN: Final = re.compile(r"::(?![^\[]*\])")


def _chain(url: str) -> list[str]:
    """The URLs of an fsspec chain (one for a plain URL)."""
    return _CHAIN.split(url)


def url_secrets(url: str, *, query: bool = False) -> list[str]:
    """What of ``url`` (each URL of an fsspec chain) an exception quoting it must not show: its
    ``user:password`` and the password alone (where long enough not to match ordinary text);
    with ``query``, its query string too (a signed URL's signature). Exceptions quote URLs also
    without their scheme, as paths, which :data:`_URL_CREDENTIALS` cannot recognise."""
    found: list[str] = []
    for link in _chain(url):
        info = _url_userinfo(link)
        password = info.partition(":")[2]
        found += [x for x in (info, password if len(password) >= 4 else "") if x]
        if query:
            q = link.partition("?")[2].partition("#")[0]
            if len(q) >= 4:
                found.append(q)
    return found


#: Storage option names whose values are secrets (fsspec backends: ``password``, ``token``,
#: ``secret``, ``key``, ``account_key``, ``sas_token``, ``client_secret``, ``session_token``...).
_SECRET_OPTION: Final = re.compile(
    r"pass|secret|token|key|cred|auth|sas|sig|connection", re.IGNORECASE
)


def option_secrets(options: Mapping[str, Any]) -> list[str]:
    """String values of secret-looking storage options (nested mappings too), long enough not
    to match ordinary text."""
    found: list[str] = []
    pending: list[tuple[str, Any]] = list(options.items())
    while pending:
        name, value = pending.pop()
        if isinstance(value, Mapping):
            pending.extend((f"{name}.{k}", v) for k, v in value.items())
        elif isinstance(value, str) and len(value) >= 4 and _SECRET_OPTION.search(name):
            found.append(value)
    return found


def quotes_secret(exc: BaseException, secrets: Sequence[str]) -> bool:
    """Whether ``exc``, or any exception it chains to, quotes a URL with credentials or one of
    ``secrets``: in its message, its arguments, (botocore's) keyword arguments, its notes or
    file names, or an exception it groups."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        texts = [str(e), repr(e.args)]
        kwargs = getattr(e, "kwargs", None)
        if isinstance(kwargs, Mapping):
            texts.extend(map(str, kwargs.values()))
        # Notes print with the traceback; an OSError's file names are attributes of their own.
        texts.extend(map(str, getattr(e, "__notes__", ())))
        texts.extend(str(getattr(e, a, None) or "") for a in ("filename", "filename2"))
        grouped = getattr(e, "exceptions", None)  # an ExceptionGroup (Python 3.11+)
        if isinstance(grouped, (list, tuple)):
            pending.extend(x for x in grouped if isinstance(x, BaseException))
        for text in texts:
            if (
                _URL_CREDENTIALS.search(text)
                or _HEADER_VALUE.search(text)
                or any(s and s in text for s in secrets)
            ):
                return True
        pending.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return False


def shown_location(path: str) -> str:
    """A path or URL as messages and output show it: a URL without its credentials and query
    string (a password or a signed URL's signature must not reach a terminal, logs or JSON)."""
    return redact(path) if "://" in path else path


def redact(url: str) -> str:
    """Drop credentials and the query string (signed URLs carry secrets there), from every URL
    of an fsspec chain (``simplecache::ftp://user:pw@host/f``).

    Never raises: it names the URL in error messages, including those about malformed URLs.
    A URL that does not parse, or whose port is not a number, shows nothing before the last
    ``@`` after its scheme: a password with an unencoded ``/``, ``?`` or ``#`` ends the
    authority early (``http://user:pa/ss@host/f`` parses as host ``user`` and port ``pa``),
    leaving the rest of the password in what would be shown as path, query or fragment.
    """
    links = _chain(url)
    if len(links) > 1:
        return "::".join(redact(link) if "://" in link else link for link in links)
    if url.partition("://")[0].lower() in _NO_USERINFO:
        return url.partition("?")[0] + ("?..." if "?" in url else "")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises on a port that is not a number
        if port is not None and "@" not in parts.netloc and "@" in url.partition("://")[2]:
            # ``http://user:2024/pw@host/f``: a password of digits up to an unencoded '/', '?'
            # or '#' parses as a port, and the rest of it as the path, query or fragment.
            # Shown as a URL that does not parse is shown: from after the last '@'. A URL
            # whose query holds an '@' (``host:1/f?email=me@corp.example``) is shown so too,
            # naming the wrong host: telling the two apart by where the '@' falls showed most
            # of ``user:2024/s3cr?t@host``'s password.
            raise ValueError("an '@' after the authority")
    except ValueError:  # that, or an unbalanced '[' in the host
        scheme, sep, rest = url.partition("://")
        if sep and "@" in rest:
            rest = rest.rpartition("@")[2]
        base, query, _ = rest.partition("?")
        authority, slash, path = base.partition("#")[0].partition("/")
        return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}" + (
            "?..." if query else ""
        )
    # The netloc as written, less any user:password.
    netloc = parts.netloc.rpartition("@")[2]
    suffix = "?..." if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + suffix


def _object_link(url: str) -> tuple[list[str], int]:
    """The links of an fsspec chain and the index of the one naming the object read: the first
    with a path (``s3://b/k`` in ``simplecache::s3://b/k``, the member ``zip://m`` in
    ``zip://m::file:///x.zip``). Folders and neighbours of a chain's object are found by
    changing that link alone; the others (the archive, the cache) stay as they are.

    An ``http(s)://`` or ``s3://`` URL is read by this library's own sources, not through a
    chain, so a ``::`` in it is part of its path or key.
    """
    if url.partition("://")[0].lower() in ("http", "https", "s3", "s3a"):
        return [url], 0
    links = _chain(url)
    for i, link in enumerate(links):
        if "://" in link:
            return links, i
    return links, 0


def _on_object_link(url: str, change: Callable[[str], str]) -> str:
    """``url`` with ``change`` applied to the link of its chain naming the object."""
    links, i = _object_link(url)
    if len(links) == 1:
        return change(url)
    links[i] = change(links[i])
    return "::".join(links)


def url_path(url: str) -> str:
    """The part of a URL that names the object, for tests on its name such as the suffix.

    For ``http(s)://`` and fsspec URLs that is the path, without query string or fragment
    (``.../model.safetensors.index.json?download=true`` is an index). For ``s3://`` it is
    ``bucket/key`` whole, since S3 keys may contain ``?`` and ``#``. For an fsspec chain it is
    that of the link naming the object (``m.index.json`` in ``zip://m.index.json::file:///x.zip``).
    """
    links, i = _object_link(url)
    if len(links) > 1:
        return url_path(links[i])
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in ("s3", "s3a"):
        return rest
    if sep and scheme.lower() not in ("http", "https"):
        # An fsspec URL's object may come right after the scheme (``memory://m.index.json``,
        # ``zip://m.index.json``), where urlsplit would take it for a host.
        return rest.partition("?")[0].partition("#")[0]
    try:
        return urllib.parse.urlsplit(url).path
    except ValueError:
        return url.partition("?")[0].partition("#")[0]


def shown_name(path: str) -> str:
    """The file name of a path or URL, as labels and output names show it: a URL's without its
    query string (a signed URL's signature) or fragment."""
    if "://" in path:
        return posixpath.basename(url_path(path))
    return os.path.basename(path)


def url_dirname(url: str) -> str:
    """The URL of the folder holding the object ``url`` names, without query or fragment.

    A query string belongs to one object (a signed URL's signature, ``?download=true``), so it
    is not carried to the folder's other objects. For an fsspec chain, the folder of the
    object in the same archive or cache (``zip://sub::file:///x.zip`` for
    ``zip://sub/m.index.json::file:///x.zip``).
    """
    if len(_object_link(url)[0]) > 1:
        return _on_object_link(url, url_dirname)
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in ("http", "https"):
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            return posixpath.dirname(url)
        return urllib.parse.urlunsplit(
            (parts.scheme, parts.netloc, posixpath.dirname(parts.path), "", "")
        )
    if sep:
        # Not posixpath.dirname(url): for a top-level object (``memory://m.index.json``) it
        # would eat the scheme's slashes and give ``memory:``.
        return f"{scheme}{sep}{posixpath.dirname(rest)}"
    return posixpath.dirname(url)


def url_join(base: str, name: str) -> str:
    """The URL of file ``name`` (a relative path, as in an index) in the folder ``base``.

    For ``http(s)`` the name is percent-encoded, so that ``?``, ``#`` or ``%`` in a file name
    stay part of the path; S3 keys and fsspec paths take names as they are. For an fsspec
    chain the name joins the link naming the folder (:func:`url_dirname`).
    """
    if len(_object_link(base)[0]) > 1:
        return _on_object_link(base, lambda link: url_join(link, name))
    if base.partition("://")[0].lower() in ("http", "https"):
        name = urllib.parse.quote(name, safe="/")
    return posixpath.join(base, name)


def is_folder_url(url: str) -> bool:
    """Whether the URL ``url`` names a folder: its path ends with ``/``.

    For ``http(s)`` the path without query string or fragment
    (``.../resolve/main/?download=true`` is a folder); for ``s3://``, where ``?`` and ``#``
    are characters of a key, and for fsspec URLs, the URL as written (for a chain, its link
    naming the object: ``zip://sub/::file:///x.zip``).
    """
    links, i = _object_link(url)
    if len(links) > 1:
        return is_folder_url(links[i])
    if url.partition("://")[0].lower() in ("http", "https"):
        return url_path(url).endswith("/")
    return url.endswith("/")


def url_in_folder(folder: str, name: str) -> str:
    """The URL of the file ``name`` in the folder URL ``folder`` (:func:`is_folder_url`).

    An ``http(s)`` folder's query string is kept (``.../main/?download=true`` asks for the
    file found there with it, as an index URL's own request keeps it) and the name is
    percent-encoded; its fragment is dropped. S3 and fsspec folders take the name as it is.
    """
    if len(_object_link(folder)[0]) > 1:
        return _on_object_link(folder, lambda link: url_in_folder(link, name))
    if folder.partition("://")[0].lower() in ("http", "https"):
        try:
            parts = urllib.parse.urlsplit(folder)
        except ValueError:
            return url_join(folder, name)  # opening it reports the malformed URL
        path = parts.path + urllib.parse.quote(name, safe="/")
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
    return folder + name


def check_index_options(index: str, storage_options: Mapping[str, Any] | None) -> None:
    """Refuse storage options that cannot go to every shard of the index ``index`` (a URL,
    or a folder URL, which may name an index; a local path has none to refuse).

    The options of an index go to each of its shards too, and S3's ``version_id`` names one
    version of one object: given to the shards as well, each of them was asked for a version
    it never had (``NoSuchVersion``, reported as a missing shard). Nor can the shards be read
    at the versions saved with that index, which records none: the latest shards read
    through an old index would mix two saves. So it is refused before any request; for a
    folder URL as well, which names no one object.

    Raises:
        ValueError: ``version_id`` given for an ``s3://`` index or folder.
    """
    scheme = index.partition("://")[0].lower()
    if scheme in ("s3", "s3a") and (storage_options or {}).get("version_id") is not None:
        if is_folder_url(index):
            raise ValueError(
                f"version_id cannot be given for the folder URL {shown_location(index)!r}: it "
                "names one version of one object, and a folder names none (its checkpoint may "
                "be an index, whose shards have versions of their own); open the folder "
                "without it (or one file with it)"
            )
        raise ValueError(
            f"version_id cannot be given for the index {shown_location(index)!r}: it names one "
            "version of one object, and a sharded checkpoint's shards have versions of their own "
            "that the index does not record; open the index without it (or one shard with it)"
        )
