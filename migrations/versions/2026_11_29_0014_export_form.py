"""what a checkpoint export holds (form): the whole model, or a LoRA job's adapters alone (PEFT's
folder); one live export per step, format, form and dtype

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29 14:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0014", "0013"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_export", schema=None) as batch_op:
        # Every export so far holds the whole model.
        batch_op.add_column(sa.Column("form", sa.String(length=16), nullable=False, server_default="model"))
        batch_op.drop_index("uq_checkpoint_export_live")
        batch_op.create_index(
            "uq_checkpoint_export_live",
            ["job_id", "step", "format", "form", "dtype"],
            unique=True,
            sqlite_where=sa.text("status != 'failed'"),
            postgresql_where=sa.text("status != 'failed'"),
        )


def downgrade() -> None:
    # Adapter exports have no place in the older schema (and would break its unique index).
    op.execute("DELETE FROM checkpoint_export WHERE form != 'model'")
    with op.batch_alter_table("checkpoint_export", schema=None) as batch_op:
        batch_op.drop_index("uq_checkpoint_export_live")
        batch_op.create_index(
            "uq_checkpoint_export_live",
            ["job_id", "step", "format", "dtype"],
            unique=True,
            sqlite_where=sa.text("status != 'failed'"),
            postgresql_where=sa.text("status != 'failed'"),
        )
        batch_op.drop_column("form")
