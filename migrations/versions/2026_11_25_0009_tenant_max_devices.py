"""a per-tenant device quota (tenant.max_devices; null: unlimited)

Revision ID: 0009
Revises: 0007
Create Date: 2026-11-25 16:20:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0009", "0007"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_devices", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.drop_column("max_devices")
