"""the goodput ledger (attempt_ledger: one row per ended attempt, per node) and node quarantine
(node.quarantine_reason; node.status 'quarantined')

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 17:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0010", "0009"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("quarantine_reason", sa.Text(), nullable=True))
    op.create_table(
        "attempt_ledger",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("failure", sa.String(length=16), nullable=True),
        sa.Column("productive_s", sa.Float(), nullable=False),
        sa.Column("queued_s", sa.Float(), nullable=False),
        sa.Column("restart_s", sa.Float(), nullable=False),
        sa.Column("checkpoint_stall_s", sa.Float(), nullable=False),
        sa.Column("hang_s", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_attempt_ledger_job_id_job"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["node.id"], name=op.f("fk_attempt_ledger_node_id_node"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempt_ledger")),
    )
    with op.batch_alter_table("attempt_ledger", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempt_ledger_job_id"), ["job_id"], unique=False)
        batch_op.create_index("ix_attempt_ledger_node_ended", ["node_id", "ended_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("attempt_ledger", schema=None) as batch_op:
        batch_op.drop_index("ix_attempt_ledger_node_ended")
        batch_op.drop_index(batch_op.f("ix_attempt_ledger_job_id"))
    op.drop_table("attempt_ledger")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("quarantine_reason")
