"""MEGATRAIN_FAULTS `storage:`: an operator makes a fraction of a process's S3 requests fail with a
5xx, below boto's retries (megatrain.faults.install_storage_faults), against moto's real S3 server:
at a moderate rate every object still arrives whole, at rate 1 a write fails with a clear error."""

from __future__ import annotations

import pytest

from megatrain.faults import ENV, parse
from megatrain.storage import StorageError, open_store


def test_storage_faults_parse() -> None:
    (fault,) = parse("storage:rate=0.25,status=500")
    assert (fault.kind, fault.rate, fault.status, fault.rank) == ("storage", 0.25, 500, -1)
    for text, message in [
        ("storage:status=503", "storage needs rate"),
        ("storage:rate=2", "rate is within 0..1 and status a 5xx"),
        ("storage:rate=0.1,status=404", "rate is within 0..1 and status a 5xx"),
        ("storage:rate=0.1,rank=0", "storage takes rate, status"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(text)


def test_injected_5xx_are_retried_and_every_object_arrives(
    s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "storage:rate=0.3")
    store = open_store(f"{s3_bucket_url}/faults")
    assert store.faults is not None
    blobs = {f"ckpt/shard-{i}.bin": bytes([i]) * (1000 + i) for i in range(12)}
    for key, data in blobs.items():
        store.put_bytes(key, data)
    assert {key: store.get_bytes(key) for key in blobs} == blobs
    assert store.faults.injected > 1  # ~30% of ~24 requests failed at first and were retried


def test_a_store_that_always_fails_says_so(s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain import storage

    monkeypatch.setattr(storage, "S3_ATTEMPTS", 2)  # not the product's patience: the test's time
    monkeypatch.setenv(ENV, "storage:rate=1,status=503")
    store = open_store(f"{s3_bucket_url}/down")
    with pytest.raises(StorageError, match="503|ServiceUnavailable|SlowDown"):
        store.put_bytes("latest", b"7")
    monkeypatch.delenv(ENV)
    assert open_store(f"{s3_bucket_url}/down").faults is None  # no switch, no hook
