"""datasets registered through the API and preprocessed on the workers (issue 13)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 09:40:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "dataset",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=False),
        sa.Column("source_url", sa.Text(), nullable=False),
        sa.Column("uploaded", sa.Boolean(), nullable=False),
        sa.Column("prefix_url", sa.Text(), nullable=False),
        sa.Column("tokenizer", sa.JSON(), nullable=False),
        sa.Column("json_key", sa.String(length=128), nullable=False),
        sa.Column("append_eod", sa.Boolean(), nullable=False),
        sa.Column("documents", sa.BigInteger(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("vocab_size", sa.Integer(), nullable=True),
        sa.Column("input_bytes", sa.BigInteger(), nullable=True),
        sa.Column("output_bytes", sa.BigInteger(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("runner_host", sa.String(length=255), nullable=True),
        sa.Column("runner_pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_dataset_tenant_id_tenant"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dataset")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_dataset_tenant_id_name")),
    )
    with op.batch_alter_table("dataset", schema=None) as batch_op:
        batch_op.create_index("ix_dataset_state", ["state", "submitted_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_dataset_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("dataset", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_dataset_tenant_id"))
        batch_op.drop_index("ix_dataset_state")

    op.drop_table("dataset")
