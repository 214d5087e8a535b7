"""Alembic on SQLite and PostgreSQL: the head schema matches the models, and 0002 upgrades a
database that already holds rows (tenants get no priority boost, jobs no devices)."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from megatrain import resource_dir
from megatrain.db.models import Base
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
