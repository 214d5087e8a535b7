"""a registered model may be a LoRA adapter (a PEFT folder) over a registered base: its kind, the
base's folder and the adapter's settings

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29 15:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0015", "0014"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("registered_model", schema=None) as batch_op:
        # Every model registered so far is a whole model.
        batch_op.add_column(sa.Column("kind", sa.String(length=16), nullable=False, server_default="model"))
        batch_op.add_column(sa.Column("base_url", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("adapter", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Adapters have no place in the older schema: a job naming one would get its base alone.
    op.execute("DELETE FROM registered_model WHERE kind != 'model'")
    with op.batch_alter_table("registered_model", schema=None) as batch_op:
        batch_op.drop_column("adapter")
        batch_op.drop_column("base_url")
        batch_op.drop_column("kind")
