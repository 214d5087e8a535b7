"""each node's importable packages and their versions (torch, its CUDA, triton, flash-attn,
transformer-engine, torchao), so that a submission is judged against its pool's nodes, not the API host

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 12:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0013", "0012"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("packages", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("packages")
