"""EvalSpec: an eval job's block (`eval:`, with `kind: eval`), apart from spec.py.

An eval job scores `model.init_from` (a job's checkpoint, a registered or fine-tuned model, a Hugging
Face folder) on lm-evaluation-harness tasks, each a task YAML whose items are JSON files (local or
s3://; megatrain.eval_tasks says which files it takes); results per task and metric are stored on
the job (GET /v1/jobs/{id}/results). With resources.devices > 1 it runs at the spec's parallelism
(tp, pp, dp), each rank reading only its shards of the model, so a model evaluates on the devices
that could train it. The rules between this block and the rest of a spec
(kind eval, no training data) live in spec.py's JobSpec, which sees both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tasks: list[str] = Field(default_factory=list, max_length=64)
    """lm-eval task YAML files, as paths, file:// or s3:// URLs (a spec file's relative paths
    resolve against its folder), each one self-contained task with `dataset_path: json` and its
    items' `dataset_kwargs.data_files` beside it; examples/eval ships two for the demo corpus."""
    perplexity: list[Literal["train", "valid", "test"]] = Field(default_factory=list, max_length=3)
    """Splits of the spec's own `data` (its sources, data.split and data.valid, as a training job
    splits them) whose per-token loss and perplexity are measured: every token of the split once,
    in windows of the model's seq_length (Megatron's validation samples, unshuffled)."""
    limit: int | None = Field(default=None, ge=1)
    """At most this many items per task, and windows per perplexity split (None: all of them)."""
    batch_size: int = Field(default=8, ge=1, le=1024)
    """Sequences scored (or prompts generated from) at once, over all data-parallel replicas."""

    @field_validator("perplexity")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("each split at most once")
        return v
