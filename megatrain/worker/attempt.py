"""The runner's side of an attempt: the engine's environment. The attempt itself, and how it
ends, are the control plane's (megatrain.attempts)."""

from __future__ import annotations

import os

from megatrain.attempts.ending import MAX_REASON_CHARS, end_failed_attempt  # noqa: F401  (re-exported)
from megatrain.attempts.model import Attempt
from megatrain.settings import CONTROL_PLANE_SETTINGS, SERVE_TOKEN_ENV
from megatrain.worker.metrics import MULTIPROC_ENV
from megatrain.worker.nodes import device_env


def engine_env(att: Attempt) -> dict[str, str]:
    """The engine's environment: this process's without the control plane's credentials (nor
    this node's token: the engine reports through its runner), the tenant secrets the job
    names, the devices the attempt was placed on (and a serve job's token)."""
    hidden = {f"MEGATRAIN_{name.upper()}" for name in (*CONTROL_PLANE_SETTINGS, "node_token")}
    hidden.add(MULTIPROC_ENV)  # the runner's metrics files are not the engine's to write
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    env |= att.secret_env | {"PYTHONUNBUFFERED": "1", "MEGATRAIN_JOB_ID": att.job_id}
    if att.serve_token is not None:
        env[SERVE_TOKEN_ENV] = att.serve_token
    return env | device_env(att.devices, att.accelerator, os.environ)
