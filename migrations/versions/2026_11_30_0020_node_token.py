"""node tokens (node_token) and the cursors of nodes' batched reports (report_cursor)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-30 02:10:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0020", "0019"
branch_labels = depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_token",
        sa.Column("id", sa.String(length=40), primary_key=True),
        sa.Column(
            "pool_id", sa.String(length=40), sa.ForeignKey("node_pool.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("node_name", sa.String(length=255), nullable=True),
        sa.Column("token_hash", sa.String(length=64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("job_id", sa.String(length=40), sa.ForeignKey("job.id", ondelete="CASCADE"), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_node_token_pool_id", "node_token", ["pool_id"])
    op.create_index("ix_node_token_job_id", "node_token", ["job_id"])
    op.create_table(
        "report_cursor",
        sa.Column(
            "job_id", sa.String(length=40), sa.ForeignKey("job.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("attempt", sa.Integer(), primary_key=True),
        sa.Column("node_rank", sa.Integer(), primary_key=True),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("report_cursor")
    op.drop_index("ix_node_token_job_id", table_name="node_token")
    op.drop_index("ix_node_token_pool_id", table_name="node_token")
    op.drop_table("node_token")
