"""preemption: job.preempt_for (the job a running one is preempted for) and attempt_ledger.preempt_s

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 17:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0011", "0010"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempt_for", sa.String(length=40), nullable=True))
    with op.batch_alter_table("attempt_ledger", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempt_s", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("attempt_ledger", schema=None) as batch_op:
        batch_op.drop_column("preempt_s")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("preempt_for")
