"""The runner's half of scoped storage keys (megatrain.storage_scope): it asks the control plane for
its attempt's key, leaves it where its ranks' boto3 finds it, and renews it before it expires.

The ranks never hold the node token. They read `{out_dir}/storage/key.json` through an AWS config
file whose `credential_process` prints it: botocore runs the process again when the key nears its
expiry (15 minutes before), by when the runner has renewed it (at half its life). Their environment
loses every variable that would give boto3 another identity (the node's own key, profile, web
identity, container or instance role), which the credential chain would otherwise prefer or fall
back to.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from megatrain.settings import Settings
from megatrain.worker.reporter import Reporter, ReportError, ReportRefused

log = logging.getLogger(__name__)

OTHER_IDENTITIES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CREDENTIAL_EXPIRATION", "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
)  # fmt: skip
"""What boto3 would take an identity from before (or instead of) the config file's process."""
RENEW_BEFORE_S = 1200.0
"""Renew a key at half its life, and at least this long before it expires: botocore runs the
credential process again 15 minutes before expiry and refuses a key that has less than 10 left."""
RETRY_S = 20.0
FIRST_TRIES = 4


def scoped(settings: Settings) -> bool:
    """Whether this control plane hands attempts scoped keys (and so the runner must fetch one)."""
    return settings.storage_role_arn is not None and settings.resolved_storage_url.startswith("s3://")


def _expiry(key: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(key["Expiration"]).replace("Z", "+00:00")).timestamp()


class StorageKeys:
    """The attempt's scoped key under `folder`, renewed by a thread until stop()."""

    def __init__(self, reporter: Reporter, job_id: str, attempt: int, folder: Path):
        self.reporter, self.job_id, self.attempt = reporter, job_id, attempt
        self.folder = folder
        self.key_file, self.config_file = folder / "key.json", folder / "aws-config"
        self.renew_after = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"storage-key-{job_id}")

    def start(self) -> StorageKeys:
        """The first key, written before any rank starts; ReportRefused (the control plane will not
        give one) or ReportError (it could not be reached, FIRST_TRIES times) stop the attempt."""
        for n in range(FIRST_TRIES):
            try:
                self._renew()
                break
            except ReportRefused:
                raise
            except ReportError:
                if n == FIRST_TRIES - 1:
                    raise
                time.sleep(min(RETRY_S, 2.0**n))
        cat = shutil.which("cat")
        command = [cat, str(self.key_file)] if cat else [sys.executable, "-c", _PRINT, str(self.key_file)]
        self.config_file.write_text(f"[default]\ncredential_process = {shlex.join(command)}\n")
        self._thread.start()
        return self

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` (an engine's environment) with this key as boto3's only identity."""
        env = {k: v for k, v in base.items() if k not in OTHER_IDENTITIES}
        return env | {
            "AWS_CONFIG_FILE": str(self.config_file),
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _renew(self) -> None:
        key = self.reporter.storage_key(self.job_id, self.attempt)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.key_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(key, f)
        os.replace(tmp, self.key_file)  # a rank reading it sees the old key or the new, whole
        expiry, now = _expiry(key), time.time()
        self.renew_after = expiry - max(RENEW_BEFORE_S, (expiry - now) / 2)

    def _run(self) -> None:
        while not self._stop.wait(min(RETRY_S, max(1.0, self.renew_after - time.time()))):
            if time.time() < self.renew_after:
                continue
            try:
                self._renew()
            except ReportRefused as exc:
                log.info("job %s: no more storage keys (%s)", self.job_id, exc)
                return
            except ReportError as exc:
                log.warning("job %s: could not renew its storage key (will retry): %s", self.job_id, exc)
                self.renew_after = time.time() + RETRY_S


_PRINT = "import sys; sys.stdout.write(open(sys.argv[1]).read())"
