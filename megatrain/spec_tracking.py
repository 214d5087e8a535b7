"""TrackingSpec: a spec's `tracking:` block, apart from spec.py: where global rank 0 also sends the
series the dashboard shows (megatrain.engine.tracking), any of TensorBoard, Weights & Biases, MLflow.

No credential is ever a field here: W&B reads WANDB_API_KEY (and WANDB_BASE_URL for a server of
one's own), MLflow MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME / _PASSWORD, from the job's
environment, where a tenant secret named in the spec's `secrets` puts them.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator

from megatrain.spec_base import Strict
from megatrain.spec_base import rule as _rule
from megatrain.spec_errors import Problem

MLFLOW_SCHEMES = ("file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""The tracking URIs MLflow's client opens: a local file store, a tracking server, a database."""


class TensorBoardSpec(Strict):
    """Event files under `{storage}/jobs/{job_id}/tensorboard/`, next to the checkpoints (the run
    folder's tensorboard/ on its own), downloadable: `megatrain tensorboard JOB` opens them."""

    flush_interval_s: float = Field(30.0, ge=1.0, le=3600.0)
    """How often the event files are flushed and copied next to the checkpoints while the job runs
    (and once more when it ends)."""


class WandbSpec(Strict):
    """A W&B run per job (its id is the job's, so a resumed attempt continues it)."""

    project: str | None = Field(None, min_length=1, max_length=128)
    """The W&B project (None: the job's name)."""
    entity: str | None = Field(None, min_length=1, max_length=128)
    """The team or user that owns the project (None: the API key's default entity)."""
    name: str | None = Field(None, min_length=1, max_length=128)
    """The run's display name (None: the job's name)."""
    tags: list[str] = Field(default_factory=list, max_length=64)
    """The run's tags, each at most 64 characters."""
    mode: Literal["online", "offline"] | None = None
    """offline: no network at all; the run folder (OUT/wandb/offline-run-*) is left for `wandb sync`.
    None: W&B's own choice (WANDB_MODE in the job's environment, else online)."""

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str]) -> list[str]:
        for tag in v:
            if not tag or len(tag) > 64 or any(ord(c) < 32 for c in tag):
                raise ValueError("tracking.wandb.tags are 1 to 64 characters each, none a control character")
        if len(set(v)) != len(v):
            raise ValueError("tracking.wandb.tags lists a tag twice")
        return v


class MLflowSpec(Strict):
    """An MLflow run per job (tagged megatrain.job_id, so a resumed attempt continues it)."""

    tracking_uri: str = Field(..., min_length=1, max_length=2048)
    """Where runs go: file:///abs/path (a local file store, works offline), http(s)://HOST (a
    tracking server), or a database URL (sqlite:///abs/path.db)."""
    experiment: str | None = Field(None, min_length=1, max_length=256)
    """The experiment's name, created if missing (None: the job's name)."""
    run_name: str | None = Field(None, min_length=1, max_length=256)
    """The run's name (None: the job's name)."""

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        parsed = urlparse(v)
        if parsed.scheme not in MLFLOW_SCHEMES:
            # A bare path would resolve against the engine's working folder, on whichever node.
            schemes = ", ".join(MLFLOW_SCHEMES)
            raise ValueError(f"tracking.mlflow.tracking_uri needs a scheme: one of {schemes}")
        local = parsed.netloc in ("", "localhost") and parsed.path.startswith("/")
        if parsed.scheme == "file" and not local:
            raise ValueError("tracking.mlflow.tracking_uri: a file store is file:///abs/path")
        return v


class TrackingSpec(Strict):
    tensorboard: TensorBoardSpec | None = None
    """TensorBoard event files (`tensorboard: true` for the defaults)."""
    wandb: WandbSpec | None = None
    """Weights & Biases (`wandb: true` for the defaults)."""
    mlflow: MLflowSpec | None = None
    """MLflow (needs tracking_uri)."""

    @field_validator("tensorboard", "wandb", mode="before")
    @classmethod
    def _switch(cls, v: Any) -> Any:
        # `tensorboard: true` reads better than `tensorboard: {}`; false is the same as leaving it out.
        if v is True:
            return {}
        return None if v is False else v

    @property
    def enabled(self) -> bool:
        """Whether any tracker is configured."""
        return any(t is not None for t in (self.tensorboard, self.wandb, self.mlflow))


def tracking_problems(kind: str, tracking: TrackingSpec | None) -> list[Problem]:
    """The rules between `tracking` and the rest of a spec: only training jobs log a series."""
    if tracking is not None and tracking.enabled and kind in ("serve", "eval"):
        why = f"tracking is for training jobs (kind pretrain, finetune, dpo), not kind {kind}"
        return [_rule("tracking", why)]
    return []
