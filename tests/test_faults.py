"""MEGATRAIN_FAULTS beyond a rank's own (those are in tests/engine/test_stragglers.py): `storage:`
fails a fraction of a process's S3 requests with a 5xx below boto's retries (against moto's real S3
server: at a moderate rate every object still arrives whole, at rate 1 a write fails with a clear
error); `corrupt:` and `silence:` parse here and act in tests/worker/test_shard.py."""

from __future__ import annotations

import pytest

from megatrain.faults import ENV, checkpoints_to_corrupt, parse, silences
from megatrain.storage import StorageError, open_store


def test_storage_corrupt_and_silence_faults_parse() -> None:
    (fault,) = parse("storage:rate=0.25,status=500")
    assert (fault.kind, fault.rate, fault.status, fault.rank) == ("storage", 0.25, 500, -1)
    corrupt, silence = parse("corrupt:at_step=7,once=/tmp/x; silence:node=gpu-3,after_s=60,for_s=90")
    assert (corrupt.at_step, corrupt.once) == (7, "/tmp/x")
    assert (silence.node, silence.after_s, silence.for_s) == ("gpu-3", 60.0, 90.0)
    env = {ENV: "silence:node=gpu-3,after_s=60,for_s=90;silence:node=gpu-4,after_s=1,for_s=1"}
    ((start, end),) = silences("gpu-3", env)
    assert end - start == pytest.approx(90.0) and silences("gpu-9", env) == []
    assert list(checkpoints_to_corrupt({ENV: "corrupt:at_step=7"})) == [7]
    for text, message in [
        ("storage:status=503", "storage needs rate"),
        ("storage:rate=2", "rate is within 0..1 and status a 5xx"),
        ("storage:rate=0.1,status=404", "rate is within 0..1 and status a 5xx"),
        ("storage:rate=0.1,rank=0", "storage takes rate, status"),
        ("silence:node=a,after_s=1", "silence needs for_s"),
        ("corrupt:rank=0,at_step=1", "corrupt takes at_step, once"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(text)


def test_injected_5xx_are_retried_and_every_object_arrives(
    s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "storage:rate=0.3")
    store = open_store(f"{s3_bucket_url}/faults")
    assert store.faults is not None
    store.faults._random.seed(1234)  # which requests fail: the same every run (CI once drew 1 of ~24)
    blobs = {f"ckpt/shard-{i}.bin": bytes([i]) * (1000 + i) for i in range(12)}
    for key, data in blobs.items():
        store.put_bytes(key, data)
    assert {key: store.get_bytes(key) for key in blobs} == blobs
    assert store.faults.injected >= 6  # ~30% of ~30 requests (12 with this seed) failed and were retried


def test_a_store_that_always_fails_says_so(s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain.storage import s3 as storage_s3

    # Not the product's patience: the test's time.
    monkeypatch.setattr(storage_s3, "S3_ATTEMPTS", 2)
    monkeypatch.setattr(storage_s3, "S3_PATIENCE_S", 0.0)
    monkeypatch.setenv(ENV, "storage:rate=1,status=503")
    store = open_store(f"{s3_bucket_url}/down")
    with pytest.raises(StorageError, match="503|ServiceUnavailable|SlowDown"):
        store.put_bytes("latest", b"7")
    monkeypatch.delenv(ENV)
    assert open_store(f"{s3_bucket_url}/down").faults is None  # no switch, no hook
