"""docker-compose.yml and Dockerfile: Docker cannot run here, so check what can be checked statically.

Every MEGATRAIN_* variable the compose file sets must be a real Settings field, and the settings it
builds must pass the production checks; the commands must be real CLI commands.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatrain import REPO_ROOT
from megatrain.settings import Settings

COMPOSE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
MEGATRAIN_SERVICES = ("migrate", "api", "scheduler", "worker")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set in the environment: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_services_present(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {
        "api",
        "scheduler",
        "worker",
        "postgres",
        "redis",
        "minio",
        "create-bucket",
        "migrate",
    }


@pytest.mark.parametrize("service", MEGATRAIN_SERVICES)
def test_megatrain_env_vars_are_settings_fields(compose: dict[str, Any], service: str) -> None:
    env = compose["services"][service]["environment"]
    fields = set(Settings.model_fields)
    megatrain_vars = [k for k in env if k.startswith("MEGATRAIN_")]
    assert megatrain_vars
    unknown = [k for k in megatrain_vars if k.removeprefix("MEGATRAIN_").lower() not in fields]
    assert unknown == [], f"{service} sets variables Settings ignores: {unknown}"


@pytest.mark.parametrize("service", MEGATRAIN_SERVICES)
def test_compose_env_builds_valid_production_settings(
    compose: dict[str, Any], service: str, megatrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {k: _interpolate(str(v)) for k, v in compose["services"][service]["environment"].items()}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = Settings()
    assert s.environment == "production"
    assert s.resolved_database_url.startswith("postgresql+psycopg://")
    assert s.executor == "celery"
    assert s.redis_url == "redis://redis:6379/0"
    assert s.resolved_storage_url.startswith("s3://megatrain/")
    assert s.s3_endpoint_url == "http://minio:9000"
    # The bucket the one-shot service creates is the one the storage URL names.
    assert "local/megatrain" in " ".join(compose["services"]["create-bucket"]["command"])
    # MinIO's root credentials are what the megatrain services sign S3 requests with.
    minio = compose["services"]["minio"]["environment"]
    assert env["AWS_ACCESS_KEY_ID"] == _interpolate(minio["MINIO_ROOT_USER"])
    assert env["AWS_SECRET_ACCESS_KEY"] == _interpolate(minio["MINIO_ROOT_PASSWORD"])
    pg = compose["services"]["postgres"]["environment"]
    assert (
        f"{pg['POSTGRES_USER']}:{_interpolate(pg['POSTGRES_PASSWORD'])}@postgres:5432/{pg['POSTGRES_DB']}"
        in (s.resolved_database_url)
    )


def test_commands(compose: dict[str, Any]) -> None:
    from typer.main import get_command

    from megatrain.cli import app

    services = compose["services"]
    cli_commands = set(get_command(app).commands)  # type: ignore[attr-defined]
    for service in ("api", "scheduler", "worker"):
        cmd = services[service]["command"]
        assert cmd[0] == "megatrain" and cmd[1] == service and service in cli_commands


def test_worker_reserves_gpus(compose: dict[str, Any]) -> None:
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_dependencies_wait_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
            elif cond["condition"] == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is one-shot; it must not restart"
    for name in ("api", "scheduler", "worker", "postgres", "redis", "minio"):
        assert "healthcheck" in services[name], name


def test_api_healthcheck_path_is_served(compose: dict[str, Any], megatrain_home: Path) -> None:
    test = " ".join(compose["services"]["api"]["healthcheck"]["test"])
    path = re.search(r"http://127\.0\.0\.1:8000(/[\w/]*)", test)
    assert path is not None
    try:
        from megatrain.api.app import create_app
    except ImportError:
        pytest.skip("the API is not importable in this checkout")
    from fastapi.testclient import TestClient

    # Ask the app itself (newer FastAPI keeps included routes out of app.routes).
    with TestClient(create_app()) as client:
        assert client.get(path.group(1)).status_code == 200


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert '".[engine,tracking]"' in text  # a spec's tracking: block works in the image
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    # Everything the image copies exists in the build context.
    for src in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.M):
        for name in src.split():
            # web/ holds the dashboard's static files (an empty folder is not in git until they land).
            assert (REPO_ROOT / name).exists() or name == "web", name
    # The API's command is the CLI's production entry point (several processes, bounded requests).
    cmd = json.loads(re.findall(r"^CMD (\[.*\])$", text, re.M)[-1])
    assert cmd[:2] == ["megatrain", "api"]


def test_compose_has_no_secrets_baked_in_beyond_dev_defaults() -> None:
    # Passwords come from the environment with a default, so an .env file overrides them.
    text = COMPOSE.read_text()
    for var in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"):
        assert f"${{{var}:-" in text
    assert "AKIA" not in text  # no real AWS access key id
