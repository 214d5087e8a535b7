"""A real S3 endpoint for tests: moto's standalone server over HTTP on loopback.

`moto_s3_endpoint` (session) starts one server and points the AWS variables at dummy credentials;
`s3_bucket_url` (per test) creates a fresh bucket and returns its s3:// URL. Both are meant to be
promoted to tests/conftest.py for the worker and API tests that store checkpoints on S3.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Keep the developer's own ~/.aws profiles and tokens out of the tests.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def moto_s3_endpoint() -> Iterator[str]:
    """http://127.0.0.1:PORT of a moto S3 server; AWS_* variables set to dummies for the session."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for key, value in _AWS_ENV.items():
            mp.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(key, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_bucket_url(moto_s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3://BUCKET of a new, empty bucket; MEGATRAIN_S3_ENDPOINT_URL points at the moto server."""
    import boto3

    bucket = f"mt-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_s3_endpoint).create_bucket(Bucket=bucket)
    monkeypatch.setenv("MEGATRAIN_S3_ENDPOINT_URL", moto_s3_endpoint)
    return f"s3://{bucket}"
