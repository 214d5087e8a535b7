"""pool descriptions (PoolSpec JSON), node heartbeat facts and liveness, jobs' avoided nodes

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 16:30:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0008", "0007"
branch_labels = depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_pool", schema=None) as batch_op:
        batch_op.add_column(sa.Column("spec", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("spec_source", sa.String(length=16), nullable=True))
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lost_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("devices_free", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("memory_free_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("health", sa.JSON(), nullable=True))
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("avoid_nodes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("avoid_nodes")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("health")
        batch_op.drop_column("memory_free_bytes")
        batch_op.drop_column("devices_free")
        batch_op.drop_column("lost_at")
    with op.batch_alter_table("node_pool", schema=None) as batch_op:
        batch_op.drop_column("spec_source")
        batch_op.drop_column("spec")
