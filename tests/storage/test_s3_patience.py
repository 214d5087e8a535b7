"""An S3 endpoint that goes away for a few seconds (a TCP proxy in front of moto's real server, cut
and restored): a node's store rides the outage out (storage.s3.PatientClient) where botocore's own
tries, spent within a second against a refused connection, would fail the checkpoint; a store
without patience fails at once with the connection error; a 404 is never retried."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from megatrain.storage import StorageError, open_store
from megatrain.storage.s3 import transient
from tests.fixtures.tcp_proxy import TcpProxy

OUTAGE_S = 3.0


@pytest.fixture
def proxied(s3_bucket_url: str, moto_s3_endpoint: str) -> tuple[str, TcpProxy]:
    """(endpoint URL through a proxy, the proxy) in front of the bucket's moto server."""
    up = urlparse(moto_s3_endpoint)
    proxy = TcpProxy((up.hostname or "127.0.0.1", up.port or 80)).start()
    yield f"http://127.0.0.1:{proxy.port}", proxy
    proxy.stop()


def _restore_after(proxy: TcpProxy, seconds: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), proxy.start()), daemon=True)
    t.start()
    return t


def test_a_store_rides_out_a_short_outage(s3_bucket_url: str, proxied: tuple[str, TcpProxy]) -> None:
    endpoint, proxy = proxied
    # One botocore try per call, so only the store's patience can carry a call across the outage.
    store = open_store(f"{s3_bucket_url}/ckpt", endpoint, attempts=1, patience_s=30)
    store.put_bytes("before", b"1")
    proxy.stop()
    restored = _restore_after(proxy, OUTAGE_S)
    t0 = time.monotonic()
    with store.writer("iter_0000010/shard.bin") as f:  # the engine's checkpoint path
        f.write(b"x" * 1000)
    store.put_bytes("latest", b"10")
    waited = time.monotonic() - t0
    restored.join()
    assert waited >= OUTAGE_S - 0.5  # it did wait for the endpoint, and then wrote
    assert [o.key for o in store.list("iter_0000010")] == ["iter_0000010/shard.bin"]
    assert store.get_bytes("latest") == b"10" and store.get_bytes("iter_0000010/shard.bin") == b"x" * 1000

    proxy.stop()
    restored = _restore_after(proxy, OUTAGE_S)
    assert {o.key for o in store.list()} == {"before", "latest", "iter_0000010/shard.bin"}
    restored.join()


def test_without_patience_an_outage_fails_at_once(s3_bucket_url: str, proxied: tuple[str, TcpProxy]) -> None:
    endpoint, proxy = proxied
    store = open_store(s3_bucket_url, endpoint, attempts=1, patience_s=0)
    proxy.stop()
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="Could not connect to the endpoint"):
        store.put_bytes("k", b"v")
    assert time.monotonic() - t0 < 5


def test_a_missing_object_is_not_waited_for(s3_bucket_url: str) -> None:
    store = open_store(s3_bucket_url, attempts=1, patience_s=30)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="NoSuchKey|Not Found|404"):
        store.get_bytes("nothing-here")
    assert time.monotonic() - t0 < 5


def test_what_counts_as_transient() -> None:
    def client_error(status: int, code: str) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    assert transient(EndpointConnectionError(endpoint_url="http://x"))
    assert transient(client_error(503, "ServiceUnavailable")) and transient(client_error(400, "SlowDown"))
    assert not transient(client_error(404, "NoSuchKey")) and not transient(client_error(403, "AccessDenied"))
    try:  # boto3's upload_file keeps the ClientError only as the context of its own error
        try:
            raise client_error(500, "InternalError")
        except ClientError as exc:
            raise RuntimeError(f"Failed to upload: {exc}")  # noqa: B904 - as boto3 does
    except RuntimeError as wrapped:
        assert transient(wrapped)
    assert not transient(ValueError("bad"))
