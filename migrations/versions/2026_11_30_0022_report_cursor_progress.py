"""each gang shard's ranks' progress, for naming the node that stopped first (report_cursor.progress)

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-30 17:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0022", "0021"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("report_cursor") as batch:
        batch.add_column(sa.Column("progress", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("report_cursor") as batch:
        batch.drop_column("progress")
