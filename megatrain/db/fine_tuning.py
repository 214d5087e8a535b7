"""Rows of the OpenAI-compatible fine-tuning API (api/openai): what a fine-tuning job was asked as,
beside the job it became. The job row stays the one truth of state, progress and checkpoints."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from megatrain.db.models import Base, UTCDateTime, utcnow


class FineTuningJob(Base):
    """A job submitted through POST /openai/v1/fine_tuning/jobs; its OpenAI id is "ft" + job_id."""

    __tablename__ = "fine_tuning_job"
    __table_args__ = (Index("ix_fine_tuning_job_tenant_created", "tenant_id", "created_at"),)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(Text)
    """The model as asked: a registered model's name, or a fine-tuned model (or checkpoint) id."""
    base_model: Mapped[str] = mapped_column(String(100))
    """The registered model underneath (the BASE of the fine-tuned model's ft:BASE:… id)."""
    training_file: Mapped[str] = mapped_column(String(40))
    validation_file: Mapped[str | None] = mapped_column(String(40), nullable=True)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seed: Mapped[int] = mapped_column(Integer)
    method: Mapped[dict[str, Any]] = mapped_column(JSON)
    """OpenAI's method object with every "auto" resolved: {"type", "supervised"|"dpo": {...}}."""
    training_method: Mapped[str] = mapped_column(String(16))
    """The job's training.method (lora or full): the operator's default or the request's choice."""
    integrations: Mapped[list[Any]] = mapped_column(JSON, default=list)
    """As asked; stored and reported (wandb is honoured once metrics go to trackers)."""
    user_metadata: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    """OpenAI's `metadata`: up to 16 string pairs of the user's."""
    model_deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    """When DELETE /openai/v1/models/{id} removed the fine-tuned model (its job stays)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
