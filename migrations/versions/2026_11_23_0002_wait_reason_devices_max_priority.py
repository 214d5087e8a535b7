"""wait reasons as data, device indices per job, a per-tenant priority cap

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 19:40:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("wait_reason", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("devices", sa.JSON(), nullable=True))
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_priority", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.drop_column("max_priority")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("devices")
        batch_op.drop_column("wait_reason")
