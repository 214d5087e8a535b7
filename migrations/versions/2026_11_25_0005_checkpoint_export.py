"""checkpoint exports (Hugging Face format) run by the workers

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 12:40:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "checkpoint_export",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("dtype", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("runner_host", sa.String(length=255), nullable=True),
        sa.Column("runner_pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_checkpoint_export_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_export")),
    )
    with op.batch_alter_table("checkpoint_export", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoint_export_status", ["status", "submitted_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_checkpoint_export_job_id"), ["job_id"], unique=False)
        batch_op.create_index(
            "uq_checkpoint_export_live",
            ["job_id", "step", "format", "dtype"],
            unique=True,
            sqlite_where=sa.text("status != 'failed'"),
            postgresql_where=sa.text("status != 'failed'"),
        )


def downgrade() -> None:

    with op.batch_alter_table("checkpoint_export", schema=None) as batch_op:
        batch_op.drop_index("uq_checkpoint_export_live")
        batch_op.drop_index(batch_op.f("ix_checkpoint_export_job_id"))
        batch_op.drop_index("ix_checkpoint_export_status")

    op.drop_table("checkpoint_export")
