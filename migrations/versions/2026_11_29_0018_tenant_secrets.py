"""tenant secrets (tenant_secret): Fernet ciphertext under the operator's key, injected into the
environment of the jobs that name them

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-30 00:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0018", "0017"
branch_labels = depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_secret",
        sa.Column("id", sa.String(length=40), primary_key=True),
        sa.Column(
            "tenant_id", sa.String(length=40), sa.ForeignKey("tenant.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("ciphertext", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_index("ix_tenant_secret_tenant_id", "tenant_secret", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_tenant_secret_tenant_id", table_name="tenant_secret")
    op.drop_table("tenant_secret")
