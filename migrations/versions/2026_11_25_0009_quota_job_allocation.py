"""a per-tenant device quota (tenant.max_devices; null: unlimited), and job_allocation: each node's
share of a multi-node job while it is scheduled or running

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 16:20:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0009", "0008"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_devices", sa.Integer(), nullable=True))
    op.create_table(
        "job_allocation",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_job_allocation_job_id_job"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["node.id"], name=op.f("fk_job_allocation_node_id_node"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_allocation")),
        sa.UniqueConstraint("job_id", "node_id", name=op.f("uq_job_allocation_job_id_node_id")),
    )
    with op.batch_alter_table("job_allocation", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_allocation_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_job_allocation_node_id"), ["node_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_allocation", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_allocation_node_id"))
        batch_op.drop_index(batch_op.f("ix_job_allocation_job_id"))
    op.drop_table("job_allocation")
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.drop_column("max_devices")
