"""Alembic on SQLite and PostgreSQL: the head schema matches the models, and 0002 upgrades a
database that already holds rows (tenants get no priority boost, jobs no devices), as 0014 does
(earlier exports hold the whole model)."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from fixtures.cluster import seed_job
from sqlalchemy import inspect, text

from megatrain import resource_dir
from megatrain.db.models import Base, CheckpointExport
from megatrain.db.session import get_engine, session_scope


def _config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(resource_dir("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def test_head_matches_the_models(db_url: str) -> None:
    with get_engine(db_url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_0002_upgrades_a_populated_database_and_downgrades(db_url: str) -> None:
    cfg = _config(db_url)
    command.downgrade(cfg, "0001")
    engine = get_engine(db_url)
    assert "max_priority" not in {c["name"] for c in inspect(engine).get_columns("tenant")}
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO tenant (id, name, created_at) VALUES ('t1', 'acme', CURRENT_TIMESTAMP)")
        )
    command.upgrade(cfg, "head")
    engine.dispose()  # the schema changed under pooled connections
    with session_scope(db_url) as s:
        assert s.execute(text("SELECT max_priority FROM tenant WHERE id = 't1'")).scalar() == 0
    columns = {c["name"] for c in inspect(engine).get_columns("job")}
    assert {"wait_reason", "devices"} <= columns


def test_0014_export_form_keeps_earlier_exports_and_downgrades(db_url: str) -> None:
    """An export from before 0014 holds the whole model; a downgrade drops the adapter exports the
    older schema has no place for and keeps the rest."""
    cfg = _config(db_url)
    job_id = seed_job(db_url)  # at head (the ORM's columns): later migrations keep the row
    command.downgrade(cfg, "0013")
    engine = get_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO checkpoint_export (id, job_id, step, format, dtype, status, error, attempt, "
                "created_at, updated_at) VALUES ('exp-1', :job, 5, 'hf', 'bf16', 'ready', '', 1, "
                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            ),
            {"job": job_id},
        )
    command.upgrade(cfg, "head")
    engine.dispose()
    with session_scope(db_url) as s:
        exp = s.get(CheckpointExport, "exp-1")
        assert exp is not None and exp.form == "model"
        assert exp.folder_key == f"jobs/{job_id}/exports/hf/iter_0000005-bf16"  # where it always was
        s.add(CheckpointExport(id="exp-2", job_id=job_id, step=5, form="adapter", status="ready"))
    command.downgrade(cfg, "0013")
    engine.dispose()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM checkpoint_export")).scalars().all() == ["exp-1"]
    command.upgrade(cfg, "head")
