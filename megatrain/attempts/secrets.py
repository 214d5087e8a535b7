"""The tenant secrets an attempt's engine gets: those its job names (spec `secrets`), decrypted when
the attempt is claimed (never written to the attempt's files, its spec copy or its events)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.models import Job
from megatrain.db.secrets import TenantSecret
from megatrain.secrets_box import SecretBox, SecretsUnavailable
from megatrain.settings import Settings


def job_secrets(session: Session, settings: Settings, job: Job) -> dict[str, str]:
    """{NAME: value} of the secrets `job` names; SecretsUnavailable naming one deleted since
    submission, or a key that cannot decrypt them."""
    names = list((job.spec or {}).get("secrets") or [])
    if not names:
        return {}
    rows = {
        r.name: r.ciphertext
        for r in session.scalars(
            select(TenantSecret).where(TenantSecret.tenant_id == job.tenant_id, TenantSecret.name.in_(names))
        )
    }
    missing = [n for n in names if n not in rows]
    if missing:
        raise SecretsUnavailable(f"the job names secret {missing[0]!r}, which its tenant no longer has")
    box = SecretBox.from_settings(settings)
    return {name: box.decrypt(rows[name]) for name in names}
