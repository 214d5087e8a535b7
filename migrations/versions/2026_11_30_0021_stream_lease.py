"""the per-tenant live-stream cap across API processes (stream_lease)

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-30 02:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0021", "0020"
branch_labels = depends_on = None


def upgrade() -> None:
    op.create_table(
        "stream_lease",
        sa.Column("id", sa.String(length=40), primary_key=True),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("process", sa.String(length=255), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_stream_lease_tenant_id", "stream_lease", ["tenant_id"])
    op.create_index("ix_stream_lease_process", "stream_lease", ["process"])


def downgrade() -> None:
    op.drop_index("ix_stream_lease_process", table_name="stream_lease")
    op.drop_index("ix_stream_lease_tenant_id", table_name="stream_lease")
    op.drop_table("stream_lease")
