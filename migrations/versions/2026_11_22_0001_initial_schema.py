"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22 22:38:35.408935
"""

from alembic import op
import sqlalchemy as sa


revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_pool",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("accelerator", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_pool")),
        sa.UniqueConstraint("name", name=op.f("uq_node_pool_name")),
    )
    op.create_table(
        "tenant",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenant")),
        sa.UniqueConstraint("name", name=op.f("uq_tenant_name")),
    )
    op.create_table(
        "api_key",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_api_key_tenant_id_tenant"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_key")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_key_key_hash")),
    )
    with op.batch_alter_table("api_key", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_key_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "node",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("pool_id", sa.String(length=40), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("slots_total", sa.Integer(), nullable=False),
        sa.Column("slots_used", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id"], ["node_pool.id"], name=op.f("fk_node_pool_id_node_pool"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node")),
        sa.UniqueConstraint("pool_id", "hostname", name=op.f("uq_node_pool_id_hostname")),
    )
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_node_pool_id"), ["pool_id"], unique=False)

    op.create_table(
        "job",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(length=100), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("num_procs", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_retries", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("runner_host", sa.String(length=255), nullable=True),
        sa.Column("runner_pid", sa.Integer(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("current_step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("latest_loss", sa.Float(), nullable=True),
        sa.Column("latest_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("latest_mfu", sa.Float(), nullable=True),
        sa.Column("num_params", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("scheduled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["node.id"], name=op.f("fk_job_node_id_node"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_job_tenant_id_tenant"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job")),
        sa.UniqueConstraint("tenant_id", "idempotency_key", name=op.f("uq_job_tenant_id_idempotency_key")),
    )
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.create_index("ix_job_status_priority", ["status", "priority", "created_at"], unique=False)
        batch_op.create_index("ix_job_tenant_created", ["tenant_id", "created_at"], unique=False)

    op.create_table(
        "checkpoint",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_checkpoint_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_checkpoint_job_id_step")),
    )
    op.create_table(
        "job_event",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("from_status", sa.String(length=16), nullable=True),
        sa.Column("to_status", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_job_event_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_event")),
    )
    with op.batch_alter_table("job_event", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_event_job_id"), ["job_id"], unique=False)

    op.create_table(
        "job_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_job_log_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_log")),
        sa.UniqueConstraint("job_id", "seq", name=op.f("uq_job_log_job_id_seq")),
    )
    op.create_table(
        "job_metric",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["job.id"], name=op.f("fk_job_metric_job_id_job"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_metric")),
        sa.UniqueConstraint("job_id", "kind", "step", name=op.f("uq_job_metric_job_id_kind_step")),
    )


def downgrade() -> None:
    op.drop_table("job_metric")
    op.drop_table("job_log")
    with op.batch_alter_table("job_event", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_event_job_id"))

    op.drop_table("job_event")
    op.drop_table("checkpoint")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_index("ix_job_tenant_created")
        batch_op.drop_index("ix_job_status_priority")

    op.drop_table("job")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_node_pool_id"))

    op.drop_table("node")
    with op.batch_alter_table("api_key", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_key_tenant_id"))

    op.drop_table("api_key")
    op.drop_table("tenant")
    op.drop_table("node_pool")
