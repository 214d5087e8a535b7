"""A tenant's secrets (PUT /v1/secrets/{name}): Fernet ciphertext under the operator's key
(megatrain.secrets_box); a job names the ones it needs (spec `secrets`), and each attempt's engine
gets them as environment variables."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from megatrain.db.models import Base, UTCDateTime, new_id, utcnow


class TenantSecret(Base):
    __tablename__ = "tenant_secret"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("sec"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    """The environment variable it becomes in the job's processes."""
    ciphertext: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
