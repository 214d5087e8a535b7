"""the OpenAI-compatible fine-tuning API: datasets in record formats (chat, prompt_completion,
preference) with their engine-shaped records and file name, a user's pause of a job (paused_at),
and fine_tuning_job (what each OpenAI fine-tuning job was asked as)

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29 16:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0016", "0015"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dataset", schema=None) as batch_op:
        # Every dataset so far holds documents under json_key.
        batch_op.add_column(
            sa.Column("record_format", sa.String(length=32), nullable=False, server_default="text")
        )
        batch_op.add_column(sa.Column("records_url", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("filename", sa.String(length=255), nullable=True))
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "fine_tuning_job",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("base_model", sa.String(length=100), nullable=False),
        sa.Column("training_file", sa.String(length=40), nullable=False),
        sa.Column("validation_file", sa.String(length=40), nullable=True),
        sa.Column("suffix", sa.String(length=64), nullable=True),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("method", sa.JSON(), nullable=False),
        sa.Column("training_method", sa.String(length=16), nullable=False),
        sa.Column("integrations", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("model_deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_fine_tuning_job_job_id_job"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_fine_tuning_job_tenant_id_tenant"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_fine_tuning_job")),
    )
    with op.batch_alter_table("fine_tuning_job", schema=None) as batch_op:
        batch_op.create_index("ix_fine_tuning_job_tenant_created", ["tenant_id", "created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_job", schema=None) as batch_op:
        batch_op.drop_index("ix_fine_tuning_job_tenant_created")
    op.drop_table("fine_tuning_job")
    # Plain ALTER TABLE … DROP COLUMN (SQLite 3.35+), not a batch copy: on SQLite that drops and
    # recreates the job table, and the drop would cascade to every job's events, metrics and exports.
    op.drop_column("job", "paused_at")
    # Record datasets have no place in the older schema: a job naming one would read no index.
    op.execute("DELETE FROM dataset WHERE record_format != 'text'")
    for column in ("filename", "records_url", "record_format"):
        op.drop_column("dataset", column)
