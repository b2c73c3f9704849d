"""``-H/--header`` and ``--remote-option``: the command line's ``storage_options`` for URLs.

The library takes options for remote files as ``storage_options`` (headers, timeouts, an S3
endpoint); these two arguments build that mapping for every command that reads a target.
Header values are often credentials: no message here quotes one, and ``@FILE`` reads them from
a file (or ``@/dev/stdin``, or a shell's ``<(...)``) so that they need not appear on the command
line, where other users of the machine can read them (``ps``).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Final

from ._common import UsageError

__all__ = ["add_remote_args", "remote_options"]

#: The largest ``@FILE`` of headers read (a token is a few KiB; a mistyped path to a model
#: file must not be read whole).
MAX_HEADER_FILE: Final = 1 << 20

#: An HTTP header name (RFC 9110 5.1: a token).
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: What cannot be in a header value: control characters other than the tab (a line break would
#: start another header), and anything past Latin-1, which HTTP/1.1 cannot carry (http.client
#: would fail at the first request, quoting a character of the value).
_BAD_VALUE: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]|[^\x00-\xff]")
#: Option names are the keyword arguments of the remote sources.
_OPTION: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def add_remote_args(parser: argparse.ArgumentParser) -> None:
    """Add ``-H/--header`` and ``--remote-option`` to a command that reads a target."""
    group = parser.add_argument_group("remote targets (http(s)://, s3://, fsspec URLs)")
    group.add_argument(
        "-H",
        "--header",
        dest="headers",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="send this HTTP header with every request (repeatable), e.g. 'Authorization: "
        "Bearer TOKEN'; @FILE reads one header a line from FILE ('#' lines skipped), which "
        "keeps a token off the command line",
    )
    group.add_argument(
        "--remote-option",
        dest="remote_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the remote source (repeatable), as the library's storage_options: "
        "timeout=60, deadline=900, retries=5, max_connections=16, part_size=16777216, "
        "endpoint_url=http://127.0.0.1:9000, region_name=..., anon=true, ...; a VALUE that "
        "reads as JSON (a number, true, false, null, an object) is taken as such, any other "
        "as a string",
    )


def remote_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``storage_options`` that ``-H`` and ``--remote-option`` ask for, or None.

    Raises:
        UsageError: A header or option is malformed, given twice, or a file of headers cannot
            be read.
    """
    headers = _headers(getattr(args, "headers", None) or [])
    options: dict[str, Any] = {}
    for number, item in enumerate(getattr(args, "remote_options", None) or [], 1):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not _OPTION.fullmatch(key):
            # Not quoted: a value given without its key may be a secret.
            raise UsageError(
                f"--remote-option number {number}: expected KEY=VALUE, KEY a Python name"
            )
        if key == "headers":
            raise UsageError("--remote-option headers=...: give each header with -H/--header")
        if key in options:
            raise UsageError(f"--remote-option {key} is given twice")
        options[key] = _value(text)
    if headers:
        options["headers"] = headers
    return options or None


def _value(text: str) -> Any:
    """``text`` as JSON when it is a JSON number, literal, object or array, else as is."""
    stripped = text.strip()
    if (
        stripped[:1] in ('"', "{", "[", "-")
        or stripped[:1].isdigit()
        or stripped
        in (
            "true",
            "false",
            "null",
        )
    ):
        try:
            return json.loads(stripped)
        except ValueError:
            pass
    return text


def _headers(items: list[str]) -> dict[str, str]:
    """The headers of ``-H`` arguments and ``@FILE`` files, in order, each name once."""
    headers: dict[str, str] = {}
    seen: dict[str, str] = {}
    for number, item in enumerate(items, 1):
        if item.startswith("@"):
            where = f"header file {item[1:]!r}"
            # Lines end at "\n" alone: str.splitlines() also breaks at \x85, \x0c, \u2028...,
            # which would cut a value in two and send its second half as a header.
            text = _read_header_file(item[1:])
            lines = [
                (f"{where}, line {n}", line.removesuffix("\r"))
                for n, line in enumerate(text.split("\n"), 1)
                if line.strip() and not line.lstrip().startswith("#")
            ]
        else:
            lines = [(f"-H/--header number {number}", item)]
        for where, line in lines:
            name, value = _header(where, line)
            if name.lower() in seen:
                raise UsageError(f"header {name!r} is given twice ({where})")
            seen[name.lower()] = name
            headers[name] = value
    return headers


def _header(where: str, line: str) -> tuple[str, str]:
    """``NAME: VALUE`` split and checked; messages name the header, never show its value."""
    name, sep, value = line.partition(":")
    name = name.strip()
    if not sep or not name:
        # The text is not shown: it may be a token given without its name.
        raise UsageError(f"{where}: expected 'NAME: VALUE' (no ':' after a header name)")
    if not _TOKEN.fullmatch(name):
        # Not shown: what precedes the first ':' may be the credential itself
        # ("Authorization Bearer TOKEN:...").
        raise UsageError(
            f"{where}: the text before the first ':' is not a valid header name (letters, "
            "digits and !#$%&'*+-.^_`|~ only)"
        )
    value = value.strip()
    if _BAD_VALUE.search(value):
        raise UsageError(
            f"{where}: the value of {name!r} holds a control character or a character past "
            "Latin-1 (which HTTP cannot send)"
        )
    return name, value


def _read_header_file(path: str) -> str:
    """A file of headers, at most :data:`MAX_HEADER_FILE` bytes; pipes (``<(...)``) too."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HEADER_FILE + 1)
    except OSError as exc:
        raise UsageError(f"cannot read header file {path!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_HEADER_FILE:
        raise UsageError(f"header file {path!r} is over {MAX_HEADER_FILE} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"header file {path!r} is not UTF-8 (byte {exc.start})") from None
