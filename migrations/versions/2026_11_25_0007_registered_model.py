"""Hugging Face model folders registered under a name (model.init_from: hf:NAME)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 13:45:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0007", "0006"
branch_labels = depends_on = None


def upgrade() -> None:
    op.create_table(
        "registered_model",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("model_type", sa.String(length=64), nullable=False),
        sa.Column("fields", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenant.id"],
            name=op.f("fk_registered_model_tenant_id_tenant"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_registered_model")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_registered_model_tenant_id_name")),
    )
    with op.batch_alter_table("registered_model", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_registered_model_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("registered_model", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_registered_model_tenant_id"))
    op.drop_table("registered_model")
