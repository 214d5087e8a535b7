"""MLflow: one run per job in the spec's experiment (tagged megatrain.job_id, so a resumed attempt
continues it), the resolved spec and layout as its params (dotted names: spec.model.num_layers), every
metrics row's numbers at the row's step. Through MlflowClient, never the fluent API's process-wide
active run. A file:///abs/path store works offline; credentials for a server come from MLflow's own
environment variables (tenant secrets), never the spec.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatrain.engine.tracking import RunInfo
from megatrain.spec_tracking import MLflowSpec

JOB_TAG = "megatrain.job_id"
_BATCH = 100
"""MLflow's most params in one log_batch call (MAX_PARAMS_TAGS_PER_BATCH)."""
_METRICS_BATCH = 1000
"""MLflow's most metrics in one log_batch call (MAX_METRICS_PER_BATCH)."""
_MAX_VALUE = 6000
"""MLflow's longest param value (MAX_PARAM_VAL_LENGTH): a longer one is cut."""


class MLflowTracker:
    name = "mlflow"

    def __init__(self, spec: MLflowSpec, run: RunInfo) -> None:
        if spec.tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked for it: the spec's file:// URI asks.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        name = spec.experiment or run.job_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self._resume(experiment_id, run.job_id)
        if self.run_id is None:
            tags = {JOB_TAG: run.job_id} if run.job_id else None
            created = self.client.create_run(experiment_id, tags=tags, run_name=spec.run_name or run.job_name)
            self.run_id = created.info.run_id
            logged: dict[str, str] = {}
        else:
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
        # Params cannot change once logged: a resumed attempt adds only the ones its first lacked.
        params = [self._param(k, v) for k, v in _params(run.config).items() if k not in logged]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def _resume(self, experiment_id: str, job_id: str | None) -> str | None:
        if not job_id:
            return None
        found = self.client.search_runs([experiment_id], f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
        return found[0].info.run_id if found else None

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        ms = int(at * 1000)
        metrics = [self._metric(k, v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), _METRICS_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_BATCH])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


def _params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as MLflow params: dotted keys, scalars as text, lists as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[name] = text[:_MAX_VALUE]
    return out
