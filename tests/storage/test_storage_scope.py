"""Scoped object-store keys (megatrain.storage_scope, worker.storage_access): the session policy a
job's key carries, judged by moto's own IAM policy evaluator, and the runner's renewal as botocore
reads it."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from moto.iam.access_control import IAMPolicy, PermissionResult

from megatrain.settings import Settings
from megatrain.spec import JobSpec
from megatrain.storage_scope import POLICY_MAX_CHARS, Scope, StorageScopeError, job_scope, policy_text
from megatrain.worker import storage_access
from megatrain.worker.reporter import ReportRefused

STORE = "s3://mt-store/prod"
ROLE = "arn:aws:iam::123456789012:role/megatrain-jobs"


def _settings(**kw: Any) -> Settings:
    base = {"storage_url": STORE, "storage_role_arn": ROLE, "allowed_data_roots": "s3://corpora/public"}
    return Settings(**(base | kw))


def _spec(**model: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "model": {"arch": "llama", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                      "seq_length": 32, **model},
            "data": {"train": [{"path": f"{STORE}/tenants/acme/corpus.jsonl"}, {"path": "s3://corpora/public/web.jsonl"}],
                     "tokenizer": {"type": "hf", "path": "s3://tok-bucket/llama/tokenizer.json"}},
            "training": {"train_iters": 2, "global_batch_size": 2, "micro_batch_size": 2},
        }
    )  # fmt: skip


def test_a_jobs_scope_is_its_own_prefix_and_what_its_tenant_reads() -> None:
    scope = job_scope(_settings(), "job-1", "acme", _spec(init_from="checkpoint:job-0@20"))
    assert scope.write == (f"{STORE}/jobs/job-1",)
    assert set(scope.read) == {
        f"{STORE}/tenants/acme", f"{STORE}/datasets", "s3://corpora/public",  # the tenant's roots
        "s3://tok-bucket/llama/tokenizer.json",  # named by the spec, under no root
        f"{STORE}/jobs/job-0/checkpoints",  # the checkpoint it starts from
    }  # fmt: skip


def _verdict(policy: str, action: str, bucket: str, key: str | None) -> bool:
    resource = f"arn:aws:s3:::{bucket}" + (f"/{key}" if key is not None else "")
    return IAMPolicy(policy).is_action_permitted(action, resource) == PermissionResult.PERMITTED


def test_the_session_policy_allows_only_the_jobs_prefix_and_its_reads() -> None:
    scope = job_scope(_settings(), "job-1", "acme", _spec(init_from="checkpoint:job-0"))
    policy = policy_text(scope)
    allowed = [
        ("s3:PutObject", "mt-store", "prod/jobs/job-1/checkpoints/iter_0000010/model.bin"),
        ("s3:GetObject", "mt-store", "prod/jobs/job-1/checkpoints/latest"),
        ("s3:DeleteObject", "mt-store", "prod/jobs/job-1/checkpoints/iter_0000005/manifest.json"),
        ("s3:GetObject", "mt-store", "prod/tenants/acme/corpus.jsonl"),
        ("s3:GetObject", "mt-store", "prod/datasets/ds-1/data_text_document.bin"),
        ("s3:GetObject", "corpora", "public/web.jsonl"),
        ("s3:GetObject", "tok-bucket", "llama/tokenizer.json"),
        ("s3:GetObject", "mt-store", "prod/jobs/job-0/checkpoints/iter_0000020/model.bin"),
        ("s3:ListBucket", "mt-store", None),
    ]
    denied = [
        ("s3:PutObject", "mt-store", "prod/jobs/job-2/checkpoints/latest"),  # another job's
        ("s3:GetObject", "mt-store", "prod/jobs/job-2/checkpoints/latest"),
        ("s3:DeleteObject", "mt-store", "prod/jobs/job-0/checkpoints/latest"),  # read-only
        ("s3:PutObject", "mt-store", "prod/jobs/job-0/checkpoints/latest"),
        ("s3:GetObject", "mt-store", "prod/jobs/job-10/checkpoints/latest"),  # a prefix is not a stem
        ("s3:GetObject", "mt-store", "prod/tenants/globex/corpus.jsonl"),  # another tenant's data
        ("s3:PutObject", "mt-store", "prod/datasets/ds-1/data_text_document.bin"),
        ("s3:GetObject", "corpora", "private/x.jsonl"),
        ("s3:GetObject", "tok-bucket", "llama/other.json"),
        ("s3:DeleteBucket", "mt-store", None),
        ("s3:ListBucket", "other-bucket", None),
    ]
    assert [a for a in allowed if not _verdict(policy, *a)] == []
    assert [d for d in denied if _verdict(policy, *d)] == []
    # Listing (which moto's evaluator does not condition): only under the same prefixes.
    lists = {s["Resource"]: s["Condition"]["StringLike"]["s3:prefix"] for s in json.loads(policy)["Statement"]
             if s["Action"] == "s3:ListBucket"}  # fmt: skip
    assert lists["arn:aws:s3:::mt-store"] == [
        "prod/jobs/job-1", "prod/jobs/job-1/*", "prod/tenants/acme", "prod/tenants/acme/*", "prod/datasets",
        "prod/datasets/*", "prod/jobs/job-0/checkpoints", "prod/jobs/job-0/checkpoints/*",
    ]  # fmt: skip
    assert lists["arn:aws:s3:::corpora"] == ["public", "public/*"]


def test_a_scope_too_large_for_a_session_policy_is_refused_not_widened() -> None:
    reads = tuple(f"s3://corpora/team-{i:03d}/shared-training-data" for i in range(40))
    with pytest.raises(
        StorageScopeError, match=f"over AWS's {POLICY_MAX_CHARS}.*MEGATRAIN_ALLOWED_DATA_ROOTS"
    ):
        policy_text(Scope(write=(f"{STORE}/jobs/job-1",), read=reads))


def test_the_role_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="not an IAM role ARN"):
        _settings(storage_role_arn="megatrain-jobs")
    with pytest.raises(ValueError, match="MEGATRAIN_STORAGE_URL must be s3://"):
        _settings(storage_url="file:///tmp/store")
    with pytest.raises(ValueError, match="storage_credentials_ttl_s"):
        _settings(storage_credentials_ttl_s=900)


class _Keys:
    """A reporter handing out keys that expire `life_s` after issue, numbered."""

    def __init__(self, life_s: float, refuse_after: int = 99):
        self.life_s, self.refuse_after, self.issued = life_s, refuse_after, 0
        self.lock = threading.Lock()

    def storage_key(self, job_id: str, attempt: int) -> dict[str, Any]:
        with self.lock:
            if self.issued >= self.refuse_after:
                raise ReportRefused(f"attempt {attempt} of job {job_id} is over")
            self.issued += 1
            expiry = datetime.now(UTC) + timedelta(seconds=self.life_s)
            n = self.issued
            return {"Version": 1, "AccessKeyId": f"ASIA{n:016d}", "SecretAccessKey": f"secret-{n}",
                    "SessionToken": f"token-{n}", "Expiration": expiry.isoformat()}  # fmt: skip


def test_the_runner_renews_the_key_that_botocore_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import botocore.session

    monkeypatch.setattr(storage_access, "RENEW_BEFORE_S", 1.0)
    reporter = _Keys(life_s=3.0, refuse_after=3)
    keys = storage_access.StorageKeys(reporter, "job-1", 1, tmp_path / "storage").start()  # type: ignore[arg-type]
    try:
        base = {"AWS_ACCESS_KEY_ID": "AKIAOPERATOR", "AWS_SECRET_ACCESS_KEY": "operator",
                "AWS_PROFILE": "ops", "AWS_DEFAULT_REGION": "us-east-1", "PATH": "/usr/bin:/bin"}  # fmt: skip
        env = keys.env(base)
        assert (
            "AWS_ACCESS_KEY_ID" not in env
            and "AWS_PROFILE" not in env
            and env["AWS_DEFAULT_REGION"] == "us-east-1"
        )
        assert oct(keys.key_file.stat().st_mode & 0o777) == "0o600"
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED"):
            monkeypatch.setenv(name, env[name])
        # botocore's own credential chain finds the key through the config file's credential_process.
        first = botocore.session.Session().get_credentials().get_frozen_credentials()
        assert (first.access_key, first.token) == ("ASIA0000000000000001", "token-1")
        deadline = time.monotonic() + 10
        while reporter.issued < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reporter.issued == 3  # renewed (half a 3 s life, at least 1 s before expiry), twice
        again = botocore.session.Session().get_credentials().get_frozen_credentials()
        assert again.access_key == "ASIA0000000000000003"
        time.sleep(1.5)  # a refusal (the attempt is over) ends the renewals, not the runner
        assert reporter.issued == 3 and not keys._thread.is_alive()
    finally:
        keys.stop()


def test_a_refused_first_key_is_not_retried(tmp_path: Path) -> None:
    reporter = _Keys(life_s=3600, refuse_after=0)
    with pytest.raises(ReportRefused, match="is over"):
        storage_access.StorageKeys(reporter, "job-1", 1, tmp_path).start()  # type: ignore[arg-type]
