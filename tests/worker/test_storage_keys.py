"""A job's processes hold a storage key scoped to the job (megatrain.storage_scope), not the control
plane's: under `megatrain up`'s stack on S3 with MEGATRAIN_STORAGE_ROLE_ARN, against moto's server
with IAM enforced (tests/fixtures/moto_iam.py). The job checkpoints to S3 with its key; the same key
cannot touch another job's checkpoints or another tenant's data; neither runner nor engine has the
operator's key in its environment; and once the attempt is over its token gets no more keys."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.exceptions import ClientError
from fixtures.live import LiveApi, start_live_api
from fixtures.moto_iam import moto_iam_server
from sqlalchemy import select
from worker_helpers import environ_of, wait_for

from megatrain.db.models import Job
from megatrain.db.session import session_scope


@pytest.fixture(scope="module")
def iam_s3() -> Iterator[dict[str, str]]:
    with moto_iam_server() as info:
        yield info


@pytest.fixture
def scoped_stack(
    iam_s3: dict[str, str], db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LiveApi, str]]:
    """The embedded stack storing in a fresh prefix of the IAM-enforcing endpoint's bucket, holding
    the operator's key (as a control plane on AWS would, from its environment or instance role)."""
    prefix = f"s3://{iam_s3['bucket']}/t-{uuid.uuid4().hex[:8]}"
    env = {"AWS_ACCESS_KEY_ID": iam_s3["access_key_id"], "AWS_SECRET_ACCESS_KEY": iam_s3["secret_access_key"],
           "AWS_DEFAULT_REGION": "us-east-1", "MEGATRAIN_STORAGE_URL": prefix,
           "MEGATRAIN_S3_ENDPOINT_URL": iam_s3["endpoint"],
           "MEGATRAIN_STORAGE_ROLE_ARN": iam_s3["role_arn"]}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # boto3's default session keeps the first credentials it found (an earlier test's dummies): the
    # control plane running in this process must find the operator's.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    for stack in start_live_api(tmp_path, monkeypatch, with_scheduler=True):
        yield stack, prefix


def _s3(endpoint: str, key: dict[str, Any] | None = None) -> Any:
    creds = {}
    if key is not None:
        creds = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"],
                 "aws_session_token": key["SessionToken"]}  # fmt: skip
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)


def _error(call: Any, **kwargs: Any) -> str | None:
    """The S3 error code of the call, None when it succeeds."""
    try:
        call(**kwargs)
    except ClientError as exc:
        return str(exc.response["Error"]["Code"])
    return None


def _denied(call: Any, **kwargs: Any) -> bool:
    return _error(call, **kwargs) == "AccessDenied"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_job_writes_its_checkpoints_with_a_key_scoped_to_it(
    scoped_stack: tuple[LiveApi, str],
    iam_s3: dict[str, str],
    fake_engine: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatrain.client import Client

    live, prefix = scoped_stack
    bucket, root = iam_s3["bucket"], prefix.removeprefix(f"s3://{iam_s3['bucket']}/")
    operator = _s3(iam_s3["endpoint"], {"AccessKeyId": iam_s3["access_key_id"], "SessionToken": None,
                                        "SecretAccessKey": iam_s3["secret_access_key"]})  # fmt: skip
    operator.put_object(Bucket=bucket, Key=f"{root}/jobs/job-elsewhere/checkpoints/latest", Body=b"7")
    operator.put_object(Bucket=bucket, Key=f"{root}/tenants/globex/private.jsonl", Body=b"{}")
    operator.put_object(Bucket=bucket, Key=f"{root}/datasets/shared.jsonl", Body=b"{}")
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.3")
    with Client() as c:
        job = c.submit(live.spec("scoped"))
        attempt = live.settings.runs_dir / job.id / "attempt-1"
        pid_file = attempt / "pids" / "rank0.pid"
        engine = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text(), timeout=60))
        with session_scope(live.settings.resolved_database_url) as s:
            runner = s.get(Job, job.id).runner_pid
        runner_env, engine_env = environ_of(runner), environ_of(engine)
        for env in (runner_env, engine_env):
            assert "AWS_SECRET_ACCESS_KEY" not in env and "AWS_ACCESS_KEY_ID" not in env
            assert iam_s3["secret_access_key"] not in "\0".join(env.values())
        assert engine_env["AWS_CONFIG_FILE"] == str(attempt / "storage" / "aws-config")
        assert engine_env["AWS_SHARED_CREDENTIALS_FILE"] == "/dev/null"
        assert "MEGATRAIN_NODE_TOKEN" not in engine_env  # the runner renews the key, not the ranks

        key = json.loads((attempt / "storage" / "key.json").read_text())
        scoped = _s3(iam_s3["endpoint"], key)
        own = f"{root}/jobs/{job.id}"
        scoped.put_object(Bucket=bucket, Key=f"{own}/probe", Body=b"mine")
        assert scoped.get_object(Bucket=bucket, Key=f"{root}/datasets/shared.jsonl")["Body"].read() == b"{}"
        assert _denied(
            scoped.put_object, Bucket=bucket, Key=f"{root}/jobs/job-elsewhere/checkpoints/latest", Body=b"1"
        )
        assert _denied(scoped.get_object, Bucket=bucket, Key=f"{root}/jobs/job-elsewhere/checkpoints/latest")
        assert _denied(scoped.get_object, Bucket=bucket, Key=f"{root}/tenants/globex/private.jsonl")
        assert _denied(scoped.put_object, Bucket=bucket, Key=f"{root}/datasets/shared.jsonl", Body=b"x")
        forged = _s3(iam_s3["endpoint"], key | {"SessionToken": "forged"})
        assert _error(forged.get_object, Bucket=bucket, Key=f"{own}/probe") == "InvalidToken"

        final = c.wait(job.id, timeout_s=90, poll_interval_s=0.3)
        assert final.status == "succeeded", final.status_reason
        steps = sorted(cp.step for cp in c.checkpoints(job.id))
        assert steps == [5, 10]
    written = operator.list_objects_v2(Bucket=bucket, Prefix=f"{own}/checkpoints/")["Contents"]
    assert any(o["Key"].endswith("/latest") for o in written)
    # The attempt is over: its token (which the runner held) gets no more keys.
    with session_scope(live.settings.resolved_database_url) as s:
        assert s.scalar(select(Job.status).where(Job.id == job.id)) == "succeeded"
    answer = httpx.post(
        f"{live.url}/v1/node/jobs/{job.id}/storage-key",
        json={"attempt": 1},
        headers={"Authorization": f"Bearer {runner_env['MEGATRAIN_NODE_TOKEN']}"},
    )
    assert answer.status_code == 401, answer.text
