"""text sampled from a job's checkpoint by the workers

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 13:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "checkpoint_sample",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("max_new_tokens", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("top_k", sa.Integer(), nullable=True),
        sa.Column("top_p", sa.Float(), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("new_tokens", sa.Integer(), nullable=True),
        sa.Column("elapsed_s", sa.Float(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("runner_host", sa.String(length=255), nullable=True),
        sa.Column("runner_pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_checkpoint_sample_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_sample")),
    )
    with op.batch_alter_table("checkpoint_sample", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoint_sample_status", ["status", "submitted_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_checkpoint_sample_job_id"), ["job_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("checkpoint_sample", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_sample_job_id"))
        batch_op.drop_index("ix_checkpoint_sample_status")

    op.drop_table("checkpoint_sample")
