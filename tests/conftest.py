"""Shared fixtures: an isolated MEGATRAIN_HOME, and databases on SQLite and PostgreSQL.

PostgreSQL tests each get a fresh schema in the `test` database (MEGATRAIN_TEST_POSTGRES_URL), so
they never see each other's rows; they are skipped only when that server is unreachable. Seeded
clusters (`add_node`, `add_job`) and live stacks (`live_api`, `live_stack`) come from tests/fixtures/.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatrain.settings import reset_settings_cache


def _triton_interpreter_without_cuda() -> None:
    """Triton picks its CPU interpreter when `triton.jit` decorates a kernel, that is when a module of
    megatrain.kernels.triton is first imported, by whichever test module (or rank) comes first: so it
    is chosen here, before any test module is collected. On a CUDA host the kernels compile."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interpreter_without_cuda()

pytest_plugins = ["fixtures.cluster", "fixtures.live"]

POSTGRES_URL = os.environ.get(
    "MEGATRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("MEGATRAIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _postgres_reachable() -> bool:
    try:
        import psycopg

        dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, connect_timeout=3):
            return True
    except Exception:
        return False


def _redis_reachable() -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping())
    except Exception:
        return False


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Per-host caches (the CPU matmul calibration) go to the session's own folder, not ~/.cache:
    measured once per test session, shared by its engine subprocesses."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def postgres_available() -> bool:
    return _postgres_reachable()


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not _redis_reachable():
        pytest.skip(f"Redis unreachable at {REDIS_URL}")
    return REDIS_URL


@pytest.fixture
def megatrain_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private MEGATRAIN_HOME; every MEGATRAIN_* variable of the outer environment is cleared."""
    for key in list(os.environ):
        if key.startswith("MEGATRAIN_") and not key.startswith("MEGATRAIN_TEST_"):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    monkeypatch.setenv("MEGATRAIN_HOME", str(home))
    reset_settings_cache()
    yield home
    reset_settings_cache()


def make_postgres_schema_url() -> tuple[str, str]:
    """A URL whose connections use a new, empty schema; returns (url, schema)."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}", schema


def drop_postgres_schema(schema: str) -> None:
    import psycopg

    dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


# Migrating a database takes 0.2-0.4 s; ~700 tests want one. Each worker migrates once (Alembic, every
# revision) and copies the result: the SQLite file, or PostgreSQL's schema as pg_dump writes it.
TEMPLATE_SCHEMA = "megatrain_template_schema"


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatrain.db.session import get_engine, upgrade_database

    path = tmp_path_factory.mktemp("db-template") / "megatrain.db"
    upgrade_database(f"sqlite:///{path}")
    get_engine(f"sqlite:///{path}").dispose()  # (no -wal file left beside it)
    return path


@pytest.fixture(scope="session")
def _postgres_template() -> str | None:
    """The migrated schema as SQL (its name TEMPLATE_SCHEMA), or None without pg_dump."""
    import shutil
    import subprocess

    from megatrain.db.session import get_engine, upgrade_database

    if not (_postgres_reachable() and shutil.which("pg_dump")):
        return None
    url, schema = make_postgres_schema_url()
    upgrade_database(url)
    get_engine(url).dispose()
    dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    dump = subprocess.run(
        ["pg_dump", "--schema", schema, "--no-owner", "--no-privileges", "--inserts", dsn],
        capture_output=True, text=True,
    )  # fmt: skip
    drop_postgres_schema(schema)
    if dump.returncode != 0:  # (a pg_dump older than the server): each test migrates its own
        return None
    # (psql's meta-commands, e.g. newer pg_dump's \restrict, are not SQL)
    lines = [line for line in dump.stdout.splitlines() if not line.startswith("\\")]
    return "\n".join(lines).replace(schema, TEMPLATE_SCHEMA)


def _postgres_from_template(template: str) -> tuple[str, str]:
    """A URL whose connections use a new schema made from the template; returns (url, schema)."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(template.replace(TEMPLATE_SCHEMA, schema).encode())
    sep = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}", schema


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(
    request: pytest.FixtureRequest, megatrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A migrated, empty database on SQLite and on PostgreSQL; MEGATRAIN_DATABASE_URL points at it."""
    import shutil

    from megatrain.db.session import get_engine, upgrade_database

    schema = None
    if request.param == "sqlite":
        megatrain_home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), megatrain_home / "megatrain.db")
        url = f"sqlite:///{megatrain_home / 'megatrain.db'}"
    else:
        if not _postgres_reachable():
            pytest.skip(f"PostgreSQL unreachable at {POSTGRES_URL}")
        template = request.getfixturevalue("_postgres_template")
        url, schema = _postgres_from_template(template) if template else make_postgres_schema_url()
    monkeypatch.setenv("MEGATRAIN_DATABASE_URL", url)
    reset_settings_cache()
    upgrade_database(url)  # (at head already where copied: Alembic only checks)
    yield url
    get_engine(url).dispose()
    if schema:
        drop_postgres_schema(schema)


# A real S3 endpoint: moto's standalone server over HTTP on loopback (session), and a fresh
# bucket per test. Storage, API and client tests share it.

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Keep the developer's own ~/.aws profiles and tokens out of the tests.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def moto_s3_endpoint() -> Iterator[str]:
    """http://127.0.0.1:PORT of a moto S3 server; AWS_* variables set to dummies for the session."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for key, value in _AWS_ENV.items():
            mp.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(key, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_bucket_url(moto_s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3://BUCKET of a new, empty bucket; MEGATRAIN_S3_ENDPOINT_URL points at the moto server."""
    import boto3

    bucket = f"mt-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_s3_endpoint).create_bucket(Bucket=bucket)
    monkeypatch.setenv("MEGATRAIN_S3_ENDPOINT_URL", moto_s3_endpoint)
    return f"s3://{bucket}"
