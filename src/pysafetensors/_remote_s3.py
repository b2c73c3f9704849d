"""Amazon S3 and compatible stores through boto3: :class:`S3Source`."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final

from ._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
)
from ._remote_read_ahead import DEFAULT_READ_AHEAD
from ._remote_source import (
    DEFAULT_ACCEPT_FULL_BODY,
    DEFAULT_HEAD_BYTES,
    DEFAULT_MAX_GAP,
    DEFAULT_PART_SIZE,
    RemoteSource,
    Transient,
    optional_str,
    parse_content_range,
    shown_value,
)
from ._remote_urls import url_secrets

#: Where botocore finds credentials given to it: their values are kept out of messages.
_CREDENTIAL_VARIABLES: Final = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)
_CREDENTIAL_KWARGS: Final = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
#: S3 error codes that mean "this object or bucket is not there".
_S3_MISSING: Final = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchVersion", "NotFound", "404"})
#: S3 error codes about credentials or permissions.
_S3_DENIED: Final = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "403",
    }
)


class _SharedClients:
    """The clients the library makes, one per set of options, shared by the sources open with
    them (the shards of one checkpoint) and closed with the last of them.

    A boto3 session and client cost ~12 MB and keep up to ``max_pool_connections`` sockets
    each: made per shard, a 40-shard checkpoint held 520 MB and 234 sockets (the HTTP source
    shares its idle connections across shards the same way). The key holds every ``AWS_*``
    variable and ``REQUESTS_CA_BUNDLE``, which botocore reads when a client is made; a
    shared credentials file rewritten meanwhile is read again by the next client only (the
    first file opened after the last one closed).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple[Any, ...], list[Any]] = {}  # key -> [client, users]
        if hasattr(os, "register_at_fork"):  # a lock held by a parent's thread stays held
            os.register_at_fork(after_in_child=self._renew_lock)

    def _renew_lock(self) -> None:
        self._lock = threading.Lock()

    def take(self, key: tuple[Any, ...] | None, make: Callable[[], Any]) -> Any:
        """The client for ``key`` (made by ``make`` if none is open); ``key`` None: a new one
        of its own. Each take is given back with :meth:`give_back`."""
        if key is None:
            return make()
        with self._lock:
            entry = self._clients.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0]
        # Made outside the lock: resolving credentials may take seconds (instance metadata,
        # an STS role, a credential_process), which other keys' sources must not wait for.
        client = make()
        with self._lock:
            entry = self._clients.get(key)
            if entry is None:
                self._clients[key] = [client, 1]
                return client
            entry[1] += 1
        _close(client)  # another thread made one meanwhile
        return entry[0]

    def give_back(self, key: tuple[Any, ...] | None, client: Any) -> None:
        """Release one take; the last user of a client closes its connections."""
        if key is not None:
            with self._lock:
                entry = self._clients.get(key)
                if entry is None or entry[0] is not client:
                    return
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._clients[key]
        _close(client)


def _close(client: Any) -> None:
    close = getattr(client, "close", None)
    if close is not None:
        close()


_SHARED: Final = _SharedClients()


def _client_key(
    endpoint: str | None,
    region_name: str | None,
    anon: bool,
    max_connections: int,
    client_kwargs: Mapping[str, Any],
) -> tuple[Any, ...] | None:
    """What makes two clients the same, or None when an option cannot be compared (such a
    client is not shared). A ``Config`` object compares by identity."""
    key = (
        endpoint,
        region_name,
        anon,
        max_connections,
        tuple(sorted(client_kwargs.items(), key=lambda item: str(item[0]))),
        tuple(
            sorted(
                (k, v)
                for k, v in os.environ.items()
                if k.startswith("AWS_") or k == "REQUESTS_CA_BUNDLE"
            )
        ),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


#: The process whose connections each client holds. A forked child inherits its parent's idle
#: keep-alive sockets: two processes sending requests on one connection read each other's
#: replies (wrong tensor bytes, or a reply's headers taken for data).
_CONNECTIONS_OF: Final[weakref.WeakKeyDictionary[Any, int]] = weakref.WeakKeyDictionary()
_CONNECTIONS_LOCK = [threading.Lock()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _CONNECTIONS_LOCK.__setitem__(0, threading.Lock()))


def _own_connections(client: Any) -> None:
    """Make ``client`` this process's: in a forked child, close the connections it holds,
    which are the parent's sockets (closing the child's copies leaves the parent's open), so
    that it opens its own."""
    pid = os.getpid()
    try:
        if _CONNECTIONS_OF.get(client, pid) == pid:
            return
    except TypeError:  # a client given that cannot be weakly referred to: left as it is
        return
    with _CONNECTIONS_LOCK[0]:
        if _CONNECTIONS_OF.get(client, pid) != pid:
            close = getattr(client, "close", None)
            if close is not None:
                close()  # the client stays usable: the next request connects anew
            _CONNECTIONS_OF[client] = pid


def _split_s3_url(url: str) -> tuple[str, str]:
    # Not urlsplit: keys may contain '?' and '#', which are not query or fragment in S3.
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("s3", "s3a") or "/" not in rest:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"no bucket named in the S3 URL {url!r}: expected s3://bucket/...")
    if not key:
        raise ValueError(f"not an s3://bucket/key URL: {url!r}")
    return bucket, key


class S3Source(RemoteSource):
    """Random access to an S3 object (or any S3-compatible store) with ranged ``GetObject``.

    Needs ``boto3`` (``pip install 'pysafetensors[s3]'``). Credentials come from boto3's usual
    chain (environment, shared config, instance roles); the endpoint from ``endpoint_url``, else
    ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (for MinIO, R2, moto...). S3 serves one
    range per request, so coalescing matters more here than over HTTP.

    Every reply must carry a ``ContentRange`` matching the request, and the object's ETag must
    not change while it is open.

    Args:
        url: ``s3://bucket/key``.
        client: A ready boto3 S3 client; when given, the other client options are ignored.
        endpoint_url: S3 endpoint, overriding the environment.
        region_name: Region for the client.
        anon: Send unsigned requests (public buckets).
        version_id: Read this version of the object.
        client_kwargs: Extra keyword arguments for ``boto3.session.Session().client``.
        max_connections: Parallel requests of one read (the client's connection pool holds
            twice as many: files opened with the same options share it).
        part_size: Largest single request when a read is split.
        max_gap: Ranges closer than this are merged into one request by ``readinto_many``.
        head_bytes: Bytes fetched and cached when opening.
        retries: Repeats after a truncated body (botocore retries throttling and 5xx itself).
        backoff: First retry delay in seconds; doubles each time, with jitter, up to 20 s.
        read_ahead: The largest window read ahead for small reads in file order (a
            ``get_tensor`` loop); 0 fetches every read as asked.

    Raises:
        ImportError: boto3 is not installed.
        TypeError: An option of the wrong type.
        ValueError: Not an ``s3://bucket/key`` URL, or an option out of range.
        RemoteNotFoundError: NoSuchKey, NoSuchBucket.
        RemotePermissionError: AccessDenied, InvalidAccessKeyId, missing credentials...
        RemoteError: Anything else the store or the connection reports.
    """

    def __init__(
        self,
        url: str,
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        anon: bool = False,
        version_id: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        max_connections: int = 8,
        part_size: int = DEFAULT_PART_SIZE,
        max_gap: int = DEFAULT_MAX_GAP,
        head_bytes: int = DEFAULT_HEAD_BYTES,
        retries: int = 3,
        backoff: float = 0.2,
        read_ahead: int = DEFAULT_READ_AHEAD,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"an s3:// URL must be a string, got {type(url).__name__}")
        self._bucket, self._key = self._split_url(url)
        for option, value in (
            ("endpoint_url", endpoint_url),
            ("region_name", region_name),
            ("version_id", version_id),
        ):
            optional_str(option, value)
        if not isinstance(anon, bool):
            raise TypeError(f"anon must be True or False, got {shown_value(anon)}")
        if client_kwargs is not None and not isinstance(client_kwargs, Mapping):
            raise TypeError(
                f"client_kwargs must be a mapping or None, got {type(client_kwargs).__name__}"
            )
        super().__init__(
            f"s3://{self._bucket}/{self._key}",
            max_connections=max_connections,
            part_size=part_size,
            max_gap=max_gap,
            head_bytes=head_bytes,
            retries=retries,
            backoff=backoff,
            read_ahead=read_ahead,
            # S3 always honours Range; a reply without ContentRange is a broken proxy.
            accept_full_body=DEFAULT_ACCEPT_FULL_BODY,
        )
        self._version_id = version_id
        self._anon = anon
        try:
            import botocore.exceptions
        except ImportError as exc:
            raise ImportError(
                "reading s3:// URLs needs boto3: pip install 'pysafetensors[s3]' "
                "(or pass an fsspec URL with s3fs installed through FsspecSource)"
            ) from exc
        self._botoexc: Any = botocore.exceptions
        # Recent botocore reads these variables itself; reading them here also covers old ones.
        endpoint = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        given_endpoint = (client_kwargs or {}).get("endpoint_url")
        given_endpoint = given_endpoint if isinstance(given_endpoint, str) else None
        if client is not None:
            given_endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None)
            given_endpoint = given_endpoint if isinstance(given_endpoint, str) else None
            endpoint = None
        #: Credentials in the endpoint URL: botocore's exceptions quote the URL as given (the
        #: messages here are cleaned of them, and an exception quoting them is not chained).
        #: Its query string too, as every URL's is kept out of messages (a token there made
        #: botocore refuse the URL, quoting the token).
        secrets: list[str] = []
        for url_given in (endpoint, given_endpoint):
            secrets.extend(url_secrets(url_given, query=True) if url_given else ())
        # The credentials given, which an error may quote (a header value refused for a line
        # break quotes it whole): kept out of messages too.
        for value in (
            *(os.environ.get(v) for v in _CREDENTIAL_VARIABLES),
            *((client_kwargs or {}).get(k) for k in _CREDENTIAL_KWARGS),
        ):
            if isinstance(value, str) and len(value.strip()) >= 8:
                secrets.extend({value, value.strip()})
        self._secrets = tuple(secrets)
        #: Gives the library's client back, once: at close(), or when the source is
        #: collected unclosed. None for a client given (the caller's).
        self._give_back: weakref.finalize[Any, Any] | None = None
        if client is None:
            failure: Exception | None = None
            options = client_kwargs or {}
            key = _client_key(endpoint, region_name, anon, max_connections, options)
            try:
                client = _SHARED.take(
                    key,
                    lambda: self._make_client(
                        endpoint, region_name, anon, max_connections, options
                    ),
                )
                self._give_back = weakref.finalize(self, _SHARED.give_back, key, client)
            except Exception as exc:
                if not isinstance(exc, self._botoexc.BotoCoreError) and not self._quotes_secret(
                    exc
                ):
                    raise
                failure = exc
            if isinstance(failure, self._botoexc.BotoCoreError):
                # Credentials or configuration botocore could not use (a partial pair, a
                # profile that does not exist): escaped as botocore's own exceptions.
                self._raise(self._setup_error(failure), failure)
            if failure is not None:
                # Outside the except clause: not even as __context__.
                raise ValueError(
                    f"{self._name}: the S3 endpoint URL (shown without its credentials) was "
                    f"refused: {self._clean(failure)}"
                ) from None
        self._client = client
        with _CONNECTIONS_LOCK[0], contextlib.suppress(TypeError):  # not weakly referable
            _CONNECTIONS_OF.setdefault(client, os.getpid())
        try:
            self._open()
        except BaseException:
            self.close()  # a head_bytes above part_size may have started worker threads
            raise

    #: ``(bucket, key)`` of an ``s3://`` URL (a folder's: see :class:`S3Folder`).
    _split_url = staticmethod(_split_s3_url)

    def _release(self) -> None:
        """Give the client back, once (a client given as ``client=`` is the caller's).

        A forked child gives back its copy of the take: the shared clients it inherited
        count the sources it inherited.
        """
        give_back = self.__dict__.get("_give_back")
        if give_back is not None:
            give_back()  # at most once, whichever thread calls it first

    def _client_here(self) -> Any:
        """The client, with connections of this process's own (see ``_own_connections``)."""
        _own_connections(self._client)
        return self._client

    @staticmethod
    def _make_client(
        endpoint: str | None,
        region_name: str | None,
        anon: bool,
        max_connections: int,
        client_kwargs: Mapping[str, Any],
    ) -> Any:
        import boto3
        import botocore
        from botocore.config import Config

        config = Config(
            # Shared by every file opened with the same options (shards opened ahead while
            # others read): beyond its size, urllib3 drops connections and opens new ones.
            max_pool_connections=max(16, 2 * max_connections),
            retries={"max_attempts": 4, "mode": "standard"},
            signature_version=botocore.UNSIGNED if anon else None,
        )
        kwargs: dict[str, Any] = dict(client_kwargs)
        given = kwargs.get("config")
        if given is not None and not isinstance(given, Config):
            # Merged below: anything else failed there as an AttributeError on its type.
            raise TypeError(
                "client_kwargs['config'] must be a botocore.config.Config or None, got "
                f"{type(given).__name__}"
            )
        # A user's Config (timeouts, say) is merged over ours rather than replacing it: as a
        # whole it dropped anon=True (requests were then signed, or failed without
        # credentials), the connection pool size and the retry settings.
        kwargs["config"] = config.merge(given) if given is not None else config
        if anon:
            # Anonymous means unsigned, whatever the given Config says.
            kwargs["config"] = kwargs["config"].merge(Config(signature_version=botocore.UNSIGNED))
        if endpoint:
            kwargs.setdefault("endpoint_url", endpoint)
        if region_name:
            kwargs.setdefault("region_name", region_name)
        # A private session: the default one is not safe to build clients from concurrently.
        return boto3.session.Session().client("s3", **kwargs)

    def _setup_error(self, exc: Exception) -> RemoteError:
        """The error for a botocore exception raised while the client was made."""
        if self._is_credentials_error(exc):
            return self._credentials_error(exc)
        return RemoteError(
            f"{self._name}: the S3 client could not be set up: {self._clean(exc)}",
            kind="InvalidRequest",
        )

    def _is_credentials_error(self, exc: Exception) -> bool:
        bexc = self._botoexc
        return isinstance(
            exc, (bexc.NoCredentialsError, bexc.PartialCredentialsError, bexc.ProfileNotFound)
        )

    def _credentials_error(self, exc: Exception) -> RemotePermissionError:
        """Credentials botocore found none of, or could not use."""
        return RemotePermissionError(
            f"{self._name}: no usable AWS credentials ({self._clean(exc)}); set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, configure a profile, or pass "
            "anon=True",
            kind="PermissionDenied",
        )

    def _error(self, exc: Exception, offset: int, probing: bool) -> Exception:
        """Translate a botocore exception into a RemoteError or a Transient."""
        bexc = self._botoexc
        where = self._name
        if isinstance(exc, bexc.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            message = self._clean(str(err.get("Message", "")) or code)
            if code in _S3_MISSING or status == 404:
                what = "bucket" if code == "NoSuchBucket" else "object"
                return RemoteNotFoundError(
                    f"{where}: no such {what} ({code or status}: {message})",
                    kind="NotFound",
                    offset=None if probing else offset,
                )
            if code in _S3_DENIED or status in (401, 403):
                advice = (
                    "the object is not public (anon=True sends no credentials)"
                    if self._anon
                    else "check the AWS credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE), the "
                    "endpoint, or pass anon=True for a public bucket"
                )
                return RemotePermissionError(
                    f"{where}: access denied ({code or status}: {message}); {advice}",
                    kind="PermissionDenied",
                )
            if code in ("PreconditionFailed",) or status == 412:
                return RemoteError(
                    f"{where} changed while open; reopen it", kind="Changed", offset=offset
                )
            if (code == "InvalidRange" or status == 416) and 0 <= offset < self._size:
                # Within the size the object had when opened: it is shorter now.
                return RemoteError(
                    f"{where} changed while open (it is now shorter than the "
                    f"{self._size} bytes it had when opened); reopen it",
                    kind="Changed",
                    offset=offset,
                )
            if code == "InvalidRange" or status == 416:
                return RemoteError(
                    f"{where}: range at offset {offset} not satisfiable ({message})",
                    kind="RangeNotSatisfiable",
                    offset=offset,
                )
            if status >= 500 or code in ("SlowDown", "InternalError", "RequestTimeout"):
                return Transient(f"{where}: {code or status}: {message}", "HTTPError")
            return RemoteError(
                f"{where}: {code or status}: {message}{self._elsewhere(exc)}", kind="HTTPError"
            )
        if self._is_credentials_error(exc):
            return self._credentials_error(exc)
        if isinstance(
            exc,
            (
                bexc.IncompleteReadError,
                bexc.ResponseStreamingError,
                bexc.ReadTimeoutError,
                bexc.ConnectionClosedError,
            ),
        ):
            return Transient(f"{where}: transfer interrupted: {self._clean(exc)}", "Truncated")
        # Endpoint unreachable and the like: botocore already retried.
        return RemoteError(f"{where}: {self._clean(exc)}", kind=self._connection_kind(exc))

    def _elsewhere(self, exc: Any) -> str:
        """Where a store that redirects a bucket (in another region: botocore follows that
        on AWS's own endpoint, not on another) says it is, for the message."""
        err = exc.response.get("Error", {})
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        region = headers.get("x-amz-bucket-region") or err.get("Region")
        if region == getattr(getattr(self._client, "meta", None), "region_name", None):
            region = None  # the client's own: not where the bucket is elsewhere
        endpoint = err.get("Endpoint")
        if not region and not endpoint:
            return ""
        where = ", ".join(
            f"{what} {self._clean(str(value))!r}"
            for what, value in (("region", region), ("endpoint", endpoint))
            if value
        )
        return f" (the store names {where}: pass region_name= or endpoint_url=)"

    def _final(self, error: Exception, failure: Exception) -> Exception:
        """``error`` for a request botocore gave up on: already retried by botocore (its
        max_attempts, throttling and 5xx replies included), so final here, not a truncated
        body for our retries, which multiplied botocore's (~20 minutes against a stalled
        endpoint at the defaults; 20 requests into a store that asked to slow down)."""
        if not isinstance(error, Transient):
            return error
        if isinstance(failure, self._botoexc.BotoCoreError):
            return RemoteError(
                f"{self._name}: {self._clean(failure)}", kind=self._connection_kind(failure)
            )
        return RemoteError(str(error), kind=error.kind)

    def _connection_kind(self, exc: BaseException) -> str:
        """``Timeout`` for botocore's timeouts (told apart from a refused or dropped
        connection), else ``ConnectionError``."""
        bexc = self._botoexc
        timeouts = (bexc.ReadTimeoutError, bexc.ConnectTimeoutError)
        return "Timeout" if isinstance(exc, timeouts) else "ConnectionError"

    def _fetch_once(self, offset: int, out: memoryview, probing: bool) -> None:
        bexc = self._botoexc
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": self._key,
            "Range": f"bytes={offset}-{offset + out.nbytes - 1}",
        }
        if self._version_id:
            kwargs["VersionId"] = self._version_id
        self.stats.add(requests=1)
        # Failures are raised after their except clause, so that one quoting the endpoint's
        # credentials is not chained (see _raise).
        failure: Exception | None = None
        empty = False
        try:
            resp = self._client_here().get_object(**kwargs)
        except bexc.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            # An empty object has no byte 0; ask for its size instead.
            empty = probing and code == "InvalidRange"
            failure = None if empty else exc
        except bexc.BotoCoreError as exc:
            failure = exc
        if empty:
            self._probe_empty()
            return
        if failure is not None:
            self._raise(self._final(self._error(failure, offset, probing), failure), failure)
        body = resp["Body"]
        try:
            self._consume(resp, body, offset, out, probing)
        except bexc.BotoCoreError as exc:
            failure = exc
        finally:
            body.close()
        if failure is not None:
            self._raise(self._error(failure, offset, probing), failure)

    def _probe_empty(self) -> None:
        bexc = self._botoexc
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        if self._version_id:
            kwargs["VersionId"] = self._version_id
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            resp = self._client_here().head_object(**kwargs)
        except (bexc.ClientError, bexc.BotoCoreError) as exc:
            failure = exc
        if failure is not None:
            self._raise(self._final(self._error(failure, 0, True), failure), failure)
        size = int(resp.get("ContentLength", 0))
        if size != 0:
            raise RemoteError(
                f"{self._name}: range 0- refused although the object has {size} bytes",
                kind="RangeNotSatisfiable",
            )
        self._size = 0
        self._etag = resp.get("ETag")

    def _consume(
        self, resp: Mapping[str, Any], body: Any, offset: int, out: memoryview, probing: bool
    ) -> None:
        where = self._name
        content_range = resp.get("ContentRange")
        first, last, total = parse_content_range(content_range, where)
        length = int(resp.get("ContentLength", -1))
        etag = resp.get("ETag")
        if content_range is None:
            # No ContentRange: the range was ignored and the body is the whole object.
            if length < 0 or length > self._accept_full_body:
                raise RemoteError(
                    f"{where}: the store ignored the Range and is sending the whole object "
                    f"({length} bytes); ranged reads are not supported there",
                    kind="RangeNotSupported",
                )
            if not probing and (length != self._size or (self._etag and etag != self._etag)):
                # Another version of the object (as for ranged replies, and as the HTTP source
                # checks a whole body): its bytes must not be read at this version's offsets.
                raise RemoteError(
                    f"{where} changed while open; reopen it", kind="Changed", offset=offset
                )
            whole = bytearray(length)
            self._read_body(body, memoryview(whole), offset)
            if probing:
                self._etag = etag
            self._cached_whole(bytes(whole), length)
            want = min(out.nbytes, max(0, length - offset))
            out[:want] = whole[offset : offset + want]
            return
        if first is None or last is None or (total is None and probing):
            # "bytes */N", or a size the store did not give ("/*"): not one to learn it from.
            raise RemoteError(
                f"{where}: reply without a usable ContentRange ({content_range!r})"
                + ("; cannot learn the object's size" if probing else ""),
                kind="RangeNotSupported",
            )
        if total is None:
            total = self._size  # unknown here: the ETag still names the version
        want = min(out.nbytes, total - offset) if probing else out.nbytes
        if first != offset or last != offset + want - 1:
            raise RemoteError(
                f"{where}: asked for bytes {offset}-{offset + want - 1}, store sent {first}-{last}",
                kind="RangeMismatch",
            )
        if length >= 0 and length != want:
            # As the HTTP source: a body of another length than its range is not that range
            # (taking its first bytes would hide the store's mistake).
            raise Transient(
                f"{where}: ContentLength {length} disagrees with the range of {want} bytes",
                "Truncated",
            )
        if probing:
            self._etag = etag
        elif total != self._size or (self._etag and etag != self._etag):
            # A reply without the ETag the object had at open names no version: a change too.
            raise RemoteError(
                f"{where} changed while open; reopen it", kind="Changed", offset=offset
            )
        self._read_body(body, out[:want], offset)
        if probing:
            self._size = total
            self._head = bytes(out[:want])

    def _read_body(self, body: Any, out: memoryview, offset: int) -> None:
        done = 0
        total = out.nbytes
        try:
            while done < total:
                n = int(body.readinto(out[done:]))
                if not n:
                    break
                done += n
        finally:
            self.stats.add(nbytes=done)
        if done < total:
            raise Transient(
                f"{self._name}: response truncated: got {done} of {total} bytes at offset {offset}",
                "Truncated",
            )


class S3Folder(S3Source):
    """An ``s3://bucket/prefix/`` folder, listed one level deep (:meth:`names`): with the
    client, options and errors of :class:`S3Source`, and nothing opened.

    Raises:
        ValueError: Not an ``s3://bucket/`` or ``s3://bucket/prefix/`` URL.
        As :class:`S3Source` for the client and the options.
    """

    @staticmethod
    def _split_url(url: str) -> tuple[str, str]:
        scheme, sep, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if sep and scheme.lower() in ("s3", "s3a") and not bucket:
            raise ValueError(f"no bucket named in the S3 URL {url!r}: expected s3://bucket/...")
        if not sep or scheme.lower() not in ("s3", "s3a") or not rest.endswith("/"):
            raise ValueError(f"not an s3://bucket/folder/ URL: {url!r}")
        return bucket, prefix

    def _open(self) -> None:
        """Nothing to open: a folder is listed."""

    def names(self) -> tuple[list[str], set[str]]:
        """Every name in the folder, one level deep, and those of them that are objects (the
        others are the folders under it): ``ListObjectsV2`` with a ``/`` delimiter, one
        request per 1,000 names.

        Raises:
            RemoteNotFoundError: The bucket does not exist.
            RemotePermissionError: Listing is refused.
            RemoteError: Anything else the store or the connection reports.
        """
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Prefix": self._key, "Delimiter": "/"}
        names: list[str] = []
        files: set[str] = set()
        cut = len(self._key)
        while True:
            page = self._list_page(kwargs)
            for item in page.get("Contents") or ():
                name = str(item.get("Key", ""))[cut:]
                if name:  # not the folder's own marker object ("prefix/")
                    names.append(name)
                    files.add(name)
            for item in page.get("CommonPrefixes") or ():
                name = str(item.get("Prefix", ""))[cut:].rstrip("/")
                if name:
                    names.append(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return names, files
            kwargs["ContinuationToken"] = token

    def _list_page(self, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        bexc = self._botoexc
        self.stats.add(requests=1)
        failure: Exception | None = None
        try:
            page: Mapping[str, Any] = self._client_here().list_objects_v2(**kwargs)
        except (bexc.ClientError, bexc.BotoCoreError) as exc:
            failure = exc
        if failure is not None:
            self._raise(self._final(self._error(failure, 0, True), failure), failure)
        return page
