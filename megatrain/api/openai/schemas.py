"""Request and response shapes of /openai/v1 (files, fine_tuning.jobs, models), field for field as
OpenAI's API reference and its `openai` SDK's types name them. Extensions live under `megatrain`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

Auto = Literal["auto"]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
SUFFIX_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
"""A suffix becomes part of a model id ft:BASE:TENANT:SUFFIX:ID, so it holds no colon."""


class _Request(BaseModel):
    # An argument we do not know is refused by name (OpenAI: "Unrecognized request argument").
    model_config = ConfigDict(extra="forbid")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["fine-tune"] = "fine-tune"
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None = None
    status_details: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI's document has these two optional, never null: absent when they say nothing.
        out: dict[str, Any] = handler(self)
        for name in ("expires_at", "status_details"):
            if out.get(name) is None:
                out.pop(name, None)
        return out


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str
    """The first file's id; "" on an empty page (OpenAI's document has a string, never null)."""
    last_id: str


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class Hyperparameters(_Request):
    """As asked: a number, "auto", or absent (auto)."""

    batch_size: int | Auto | None = Field(None, ge=1, le=4096)
    learning_rate_multiplier: float | Auto | None = Field(None, gt=0, le=100)
    n_epochs: int | Auto | None = Field(None, ge=1, le=50)
    beta: float | Auto | None = Field(None, gt=0, le=1e4)
    """dpo only."""


class MethodHyperparameters(_Request):
    hyperparameters: Hyperparameters | None = None


class Method(_Request):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: MethodHyperparameters | None = None
    dpo: MethodHyperparameters | None = None
    reinforcement: dict[str, Any] | None = None


class WandbSettings(BaseModel):
    project: str = Field(..., min_length=1, max_length=256)
    entity: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    tags: list[str] | None = Field(None, max_length=64)


class Integration(_Request):
    type: Literal["wandb"]
    wandb: WandbSettings


class Extension(_Request):
    """megatrain's own choices for a fine-tuning job (`extra_body={"megatrain": {...}}`)."""

    training_method: Literal["lora", "full"] | None = None
    """LoRA adapters or every weight; None: the operator's default (settings.openai_training_method)."""
    seq_length: int | None = Field(None, ge=8, le=1 << 20)
    """Tokens a record is cut to; None: the model's own, at most DEFAULT_MAX_SEQ_LENGTH."""


class JobCreate(_Request):
    model: str = Field(..., min_length=1, max_length=512)
    training_file: str = Field(..., min_length=1, max_length=64)
    validation_file: str | None = Field(None, min_length=1, max_length=64)
    suffix: str | None = Field(None, pattern=SUFFIX_PATTERN)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    integrations: list[Integration] | None = Field(None, max_length=8)
    hyperparameters: Hyperparameters | None = None
    """Deprecated by OpenAI in favour of method; still honoured (supervised)."""
    method: Method | None = None
    megatrain: Extension | None = None


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class ResolvedHyperparameters(BaseModel):
    batch_size: int
    learning_rate_multiplier: float
    n_epochs: int
    beta: float | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None
    integrations: list[dict[str, Any]] | None
    metadata: dict[str, str] | None
    method: dict[str, Any]
    megatrain: dict[str, Any]
    """The job behind it: {"job_id", "status", "status_reason", "paused", "training_method"}."""


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class JobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"]


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobEvent]
    has_more: bool


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, float]
    step_number: int


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool
