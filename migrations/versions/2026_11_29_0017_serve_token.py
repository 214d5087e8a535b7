"""a serve job's bearer token (job.serve_token): its model server listens on every interface of a
Celery or Slurm node and answers only the API that holds the token

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-29 19:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision, down_revision = "0017", "0016"
branch_labels = depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("serve_token", sa.String(length=64), nullable=True))


def downgrade() -> None:
    # SQLite >= 3.35 drops a column in place: no batch copy of `job`, whose copy would cascade
    # to the rows that reference it.
    op.drop_column("job", "serve_token")
