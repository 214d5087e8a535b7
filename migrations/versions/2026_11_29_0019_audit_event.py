"""the audit log (audit_event): who created, cancelled, deleted, shared or exported what, and when

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-30 00:10:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0019", "0018"
branch_labels = depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_event",
        sa.Column("id", sa.String(length=40), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=False),
        sa.Column("actor_id", sa.String(length=255), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
    )
    op.create_index("ix_audit_event_at", "audit_event", ["at"])
    op.create_index("ix_audit_event_tenant_at", "audit_event", ["tenant_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_audit_event_tenant_at", table_name="audit_event")
    op.drop_index("ix_audit_event_at", table_name="audit_event")
    op.drop_table("audit_event")
