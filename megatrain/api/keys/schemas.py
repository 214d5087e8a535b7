"""Shapes of the keys API; a key's plaintext appears only in the answer that created it."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=100)


class KeyPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyPublic):
    key: str
    """The key itself: shown this once, stored only as its sha256."""
