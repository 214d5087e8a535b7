"""preemption budget: job.preemptions, job.max_preemptions and job.continuations, counted apart
from max_retries (which preemptions and time-limit continuations used to raise)

Jobs preempted before this revision keep the max_retries those preemptions raised: which part of
it the user wrote is not recorded anywhere.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29 10:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0012", "0011"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("max_preemptions", sa.Integer(), nullable=False, server_default="10"))
        batch_op.add_column(sa.Column("continuations", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("continuations")
        batch_op.drop_column("max_preemptions")
        batch_op.drop_column("preemptions")
