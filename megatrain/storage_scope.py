"""Object-store keys for one job's processes, scoped by an IAM session policy.

With `storage_role_arn` set, the control plane (the only holder of its own S3 key) answers a
runner's request (POST /v1/node/jobs/{id}/storage-credentials, or the database runner's direct call)
with STS AssumeRole on that role plus a session policy: what the key may do is the intersection of
the role's policy and this one, so a job's ranks can
  - read, write and delete under `{storage}/jobs/{job_id}/` (its checkpoints),
  - read what its tenant may read (megatrain.data_access: `{storage}/tenants/{tenant}/`,
    `{storage}/datasets/`, the configured data roots), the data its spec names, and the model or
    adapter it starts from (another job's checkpoints, a Hugging Face folder),
and nothing else: not another job's checkpoints, not another tenant's data, not the bucket's
listing beyond those prefixes. The key expires (storage_credentials_ttl_s); the runner renews it
(worker.storage_access). AWS caps a session policy at 2,048 characters: a job whose prefixes do not
fit gets a clear error, never a wider key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from megatrain.data_access import DataUrlError, allowed_roots, data_urls, normalise_data_url
from megatrain.settings import Settings
from megatrain.spec import JobSpec

POLICY_MAX_CHARS = 2048
"""AWS's limit on an AssumeRole session policy's plaintext."""
WRITE_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")
READ_ACTIONS = ("s3:GetObject",)


class StorageScopeError(ValueError):
    """A job's scope cannot be expressed as a session policy (too many prefixes)."""


@dataclass(frozen=True)
class Scope:
    """s3://bucket/prefix URLs (no trailing slash): read-write, and read-only."""

    write: tuple[str, ...]
    read: tuple[str, ...]


def _ref_url(ref: str | None, storage: str) -> str | None:
    """The folder `model.init_from` / `adapter_from` reads: a job's checkpoints, or an hf: folder."""
    if not ref:
        return None
    if ref.startswith("checkpoint:"):
        job_id = ref.removeprefix("checkpoint:").partition("@")[0]
        return f"{storage}/jobs/{job_id}/checkpoints"
    return ref.removeprefix("hf:").rstrip("/") if ref.startswith("hf:") else None


def job_scope(settings: Settings, job_id: str, tenant_name: str, spec: JobSpec) -> Scope:
    """What job `job_id` of `tenant_name` may touch in S3 (file:// URLs are the node's business)."""
    storage = settings.resolved_storage_url
    roots = allowed_roots(settings, tenant_name)
    named = [url for _, url in data_urls(spec)]
    named += filter(None, (_ref_url(r, storage) for r in (spec.model.init_from, spec.model.adapter_from)))
    read = [r for r in roots if r.startswith("s3://")]
    for url in named:
        try:
            url = normalise_data_url(url, root=True)
        except DataUrlError:
            continue  # the API refused such a spec; a key never widens for one
        if url.startswith("s3://") and not any(url == r or url.startswith(r + "/") for r in read):
            read.append(url)
    return Scope(write=(f"{storage}/jobs/{job_id}",), read=tuple(read))


def _bucket_key(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def session_policy(scope: Scope, partition: str = "aws") -> dict[str, Any]:
    """The IAM policy document of `scope`. A prefix `p` grants objects `p/*` (and the object `p`
    itself for reads: a data path may name one file) and listing with an s3:prefix of `p` or `p/…`;
    a whole bucket (no key) grants everything in it."""

    def objects(url: str, exact: bool) -> list[str]:
        bucket, key = _bucket_key(url)
        base = f"arn:{partition}:s3:::{bucket}"
        if not key:
            return [f"{base}/*"]
        return [f"{base}/{key}/*", *([f"{base}/{key}"] if exact else [])]

    def allow(actions: tuple[str, ...], urls: tuple[str, ...], exact: bool) -> dict[str, Any]:
        resources = [o for u in urls for o in objects(u, exact)]
        return {"Effect": "Allow", "Action": list(actions), "Resource": resources}

    statements = [allow(WRITE_ACTIONS, scope.write, False)]
    if scope.read:
        statements.append(allow(READ_ACTIONS, scope.read, True))
    listing: dict[str, list[str]] = {}
    for url in (*scope.write, *scope.read):
        bucket, key = _bucket_key(url)
        listing.setdefault(bucket, []).extend([key, f"{key}/*"] if key else ["*"])
    for bucket, prefixes in listing.items():
        statements.append(
            {
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": f"arn:{partition}:s3:::{bucket}",
                "Condition": {"StringLike": {"s3:prefix": prefixes}},
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def policy_text(scope: Scope, partition: str = "aws") -> str:
    """The policy as sent: compact JSON, checked against AWS's limit."""
    text = json.dumps(session_policy(scope, partition), separators=(",", ":"))
    if len(text) > POLICY_MAX_CHARS:
        raise StorageScopeError(
            f"the job's storage policy is {len(text)} characters, over AWS's {POLICY_MAX_CHARS} for a "
            f"session policy: it reads {len(scope.read)} prefixes ({', '.join(scope.read)}); fewer "
            "data roots (MEGATRAIN_ALLOWED_DATA_ROOTS) or data under one prefix would fit"
        )
    return text


def assume(settings: Settings, job_id: str, attempt: int, scope: Scope) -> dict[str, Any]:
    """A key for `scope` from STS, in the shape of AWS's credential_process output (what a runner
    writes for its ranks' boto3 to read)."""
    import boto3

    role = settings.storage_role_arn
    if role is None:
        raise StorageScopeError("MEGATRAIN_STORAGE_ROLE_ARN is unset: no scoped keys to hand out")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = settings.sts_endpoint_url or settings.s3_endpoint_url
    sts = boto3.client("sts", endpoint_url=endpoint, region_name=region)
    answer = sts.assume_role(
        RoleArn=role,
        RoleSessionName=f"megatrain-{job_id}-{attempt}"[:64],
        Policy=policy_text(scope, role.split(":")[1]),
        DurationSeconds=settings.storage_credentials_ttl_s,
    )
    key = answer["Credentials"]
    return {
        "Version": 1,
        "AccessKeyId": key["AccessKeyId"],
        "SecretAccessKey": key["SecretAccessKey"],
        "SessionToken": key["SessionToken"],
        "Expiration": key["Expiration"].isoformat(),
    }
