"""text sampled from a job's checkpoint by the workers

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 13:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


TABLE = "checkpoint_sample"
revision, down_revision = "0006", "0005"
branch_labels = depends_on = None

# (name, type, nullable) in the model's order: the sample's own columns, then the checkpoint-task
# columns it shares with checkpoint_export (CheckpointTaskColumns).
COLUMNS = (
    ("id", sa.String(length=40), False),
    ("prompt", sa.Text(), False),
    ("max_new_tokens", sa.Integer(), False),
    ("temperature", sa.Float(), True),
    ("top_k", sa.Integer(), True),
    ("top_p", sa.Float(), True),
    ("seed", sa.BigInteger(), True),
    ("text", sa.Text(), True),
    ("prompt_tokens", sa.Integer(), True),
    ("new_tokens", sa.Integer(), True),
    ("elapsed_s", sa.Float(), True),
    ("job_id", sa.String(length=40), False),
    ("step", sa.Integer(), False),
    ("status", sa.String(length=16), False),
    ("error", sa.Text(), False),
    ("attempt", sa.Integer(), False),
    ("runner_host", sa.String(length=255), True),
    ("runner_pid", sa.Integer(), True),
    ("heartbeat_at", sa.DateTime(timezone=True), True),
    ("submitted_at", sa.DateTime(timezone=True), True),
    ("created_at", sa.DateTime(timezone=True), False),
    ("updated_at", sa.DateTime(timezone=True), False),
    ("finished_at", sa.DateTime(timezone=True), True),
)


def upgrade() -> None:

    op.create_table(
        TABLE,
        *(sa.Column(name, kind, nullable=nullable) for name, kind, nullable in COLUMNS),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f(f"fk_{TABLE}_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{TABLE}")),
    )
    with op.batch_alter_table(TABLE, schema=None) as batch_op:
        batch_op.create_index(f"ix_{TABLE}_status", ["status", "submitted_at"], unique=False)
        batch_op.create_index(batch_op.f(f"ix_{TABLE}_job_id"), ["job_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table(TABLE, schema=None) as batch_op:
        batch_op.drop_index(batch_op.f(f"ix_{TABLE}_job_id"))
        batch_op.drop_index(f"ix_{TABLE}_status")

    op.drop_table(TABLE)
