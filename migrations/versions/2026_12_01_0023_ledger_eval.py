"""attempt_ledger.eval_s: the seconds an attempt spent evaluating between steps (validation and
training.eval_tasks), apart from its productive training time

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-01 01:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0023", "0022"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempt_ledger", schema=None) as batch_op:
        batch_op.add_column(sa.Column("eval_s", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("attempt_ledger", schema=None) as batch_op:
        batch_op.drop_column("eval_s")
