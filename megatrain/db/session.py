"""Engine and session handling; the schema is owned by Alembic (migrations/)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from megatrain import resource_dir


def make_engine(url: str, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """An engine for `url` whose pool holds `pool_size` connections plus `max_overflow` at peaks."""
    if url.startswith("sqlite"):
        path = url.split("sqlite:///", 1)[-1]
        on_disk = bool(path) and path != ":memory:"
        if on_disk:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # An in-memory database lives in one connection: its pool takes no sizes.
        sizes = {"pool_size": pool_size, "max_overflow": max_overflow} if on_disk else {}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **sizes)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            # WAL lets readers (the API) run beside the writers (scheduler, shard runners).
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow)


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    return make_engine(url)


@lru_cache(maxsize=8)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _alembic_config(url: str | None = None):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(resource_dir("migrations")))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_database(url: str) -> None:
    """Bring the schema to Alembic's head (idempotent; the embedded default runs it at start)."""
    from alembic import command

    command.upgrade(_alembic_config(url), "head")


@lru_cache(maxsize=1)
def schema_head() -> str:
    """The schema revision this code's migrations end at."""
    from alembic.script import ScriptDirectory

    (head,) = ScriptDirectory.from_config(_alembic_config()).get_heads()
    return str(head)
