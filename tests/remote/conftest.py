"""Fixtures for the remote-source tests: real servers on 127.0.0.1 and safetensors test files.

Nothing here reaches beyond loopback. The S3 tests use moto's standalone server (a real HTTP
endpoint, so the same botocore code path as AWS) and skip when moto or boto3 is missing.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from .rangeserver import RangeServer
from .rawserver import RawServer, Script

safetensors_numpy = pytest.importorskip("safetensors.numpy")

BUCKET = "models"


def _write_files(root: Path) -> None:
    rng = np.random.default_rng(1234)
    tensors: dict[str, np.ndarray] = {
        # Sorts first in the file (8-byte dtypes go first), pushing the small tensors past the
        # bytes cached at open, so reading them needs requests.
        "a_table": rng.integers(0, 2**60, size=(100_000,), dtype=np.int64),
        "embed": rng.standard_normal((512, 512)).astype(np.float32),  # 1 MiB
        "proj": rng.standard_normal((256, 256)).astype(np.float16),
        "ids": rng.integers(-(2**40), 2**40, size=(1000,), dtype=np.int64),
        "mask": rng.integers(0, 2, size=(33,)).astype(bool),
    }
    for i in range(12):
        tensors[f"block.{i}.bias"] = rng.standard_normal((16 + i,)).astype(np.float32)
    safetensors_numpy.save_file(tensors, str(root / "model.safetensors"), metadata={"format": "np"})
    # Enough long names that the header passes the 64 KiB read at open.
    many = {
        f"model.layers.{i:05d}.self_attn.q_proj.weight_with_a_long_name": np.full(
            (2,), i, dtype=np.float32
        )
        for i in range(1500)
    }
    safetensors_numpy.save_file(many, str(root / "bigheader.safetensors"))
    small = {"x": np.arange(10, dtype=np.float32), "y": np.ones((3, 3), dtype=np.int32)}
    safetensors_numpy.save_file(small, str(root / "small.safetensors"))
    (root / "blob.bin").write_bytes(rng.bytes(3 << 20))
    (root / "empty.bin").write_bytes(b"")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote-data")
    _write_files(root)
    return root


@pytest.fixture(scope="session")
def _range_server(data_dir: Path) -> Iterator[RangeServer]:
    server = RangeServer(data_dir)
    yield server
    server.close()


@pytest.fixture
def server(_range_server: RangeServer) -> RangeServer:
    """The loopback range server, with its log and faults cleared for this test."""
    _range_server.reset()
    return _range_server


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: ``(certfile, keyfile)``, PEM."""
    pytest.importorskip("cryptography")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    root = tmp_path_factory.mktemp("tls")
    certfile, keyfile = root / "cert.pem", root / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certfile, keyfile


@pytest.fixture
def tls_server(data_dir: Path, tls_cert: tuple[Path, Path]) -> Iterator[RangeServer]:
    """The range server over HTTPS (certificate: ``tls_cert``), for this test only."""
    certfile, keyfile = tls_cert
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certfile, keyfile)
    server = RangeServer(data_dir, ssl_context=ctx)
    yield server
    server.close()


@pytest.fixture(scope="session")
def moto_endpoint(data_dir: Path) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with bucket ``models`` holding the test files."""
    pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    # Keep a developer's real configuration out of the tests.
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(key, None)
    # An empty file of our own, not os.devnull: where /dev/null is a plain file (some
    # containers), whatever another process just wrote to it is not a valid config.
    empty = data_dir / "aws-empty-config"
    empty.write_text("")
    os.environ["AWS_CONFIG_FILE"] = str(empty)
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(empty)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    for path in data_dir.iterdir():
        if path.is_file():  # folders other tests made there (in whatever order they ran)
            client.put_object(Bucket=BUCKET, Key=path.name, Body=path.read_bytes())
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)


@pytest.fixture
def raw() -> Iterator[Callable[[Script], RawServer]]:
    """Start raw servers (see rawserver.py) for this test; closed after it."""
    servers: list[RawServer] = []

    def start(script: Script) -> RawServer:
        servers.append(RawServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
