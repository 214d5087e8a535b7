"""Settings: embedded defaults under an isolated home, env overrides, production refusals, data roots."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from megatrain import REPO_ROOT
from megatrain.settings import Settings, get_settings, reset_settings_cache


def test_defaults_live_under_the_home(megatrain_home: Path) -> None:
    s = Settings()
    assert s.home == megatrain_home.resolve()
    assert s.environment == "dev" and s.executor == "local"
    assert s.resolved_database_url == f"sqlite:///{megatrain_home / 'megatrain.db'}"
    assert s.resolved_storage_url == (megatrain_home / "storage").as_uri()
    assert s.credentials_path == megatrain_home / "credentials"
    assert s.runs_dir == megatrain_home / "runs"
    assert s.s3_endpoint_url is None and s.api_key is None
    assert (s.host, s.port, s.api_url) == ("127.0.0.1", 8000, "http://127.0.0.1:8000")
    assert not megatrain_home.exists()  # reading settings creates nothing


def test_home_defaults_to_dot_megatrain(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEGATRAIN_HOME")
    monkeypatch.setenv("HOME", str(megatrain_home.parent / "user"))
    assert Settings().home == (megatrain_home.parent / "user" / ".megatrain").resolve()


def test_home_expands_user_and_resolves(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(megatrain_home.parent))
    monkeypatch.setenv("MEGATRAIN_HOME", "~/sub/../mt")
    assert Settings().home == (megatrain_home.parent / "mt").resolve()


def test_env_overrides(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "MEGATRAIN_DATABASE_URL": "postgresql+psycopg://u@db/megatrain",
        "MEGATRAIN_STORAGE_URL": "s3://bucket/prefix/",
        "MEGATRAIN_S3_ENDPOINT_URL": "http://minio:9000",
        "MEGATRAIN_EXECUTOR": "celery",
        "MEGATRAIN_REDIS_URL": "redis://redis:6379/2",
        "MEGATRAIN_PORT": "9001",
        "MEGATRAIN_CPU_SLOTS": "3",
        "MEGATRAIN_HEARTBEAT_TIMEOUT_S": "12.5",
        "MEGATRAIN_API_KEY": "mt_secret",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.resolved_database_url == "postgresql+psycopg://u@db/megatrain"
    assert s.resolved_storage_url == "s3://bucket/prefix"  # trailing slash dropped
    assert s.s3_endpoint_url == "http://minio:9000"
    assert s.executor == "celery" and s.redis_url == "redis://redis:6379/2"
    assert s.port == 9001 and s.cpu_slots == 3 and s.heartbeat_timeout_s == 12.5
    assert s.api_key == "mt_secret"


def test_cache_dir(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().cache_dir is None  # the XDG default, chosen where it is used
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", "")
    assert Settings().cache_dir is None
    monkeypatch.setenv("HOME", str(megatrain_home.parent))
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", "~/c")
    assert Settings().cache_dir == (megatrain_home.parent / "c").resolve()
    # The CPU peak is measured now, never configured: the old variable sets nothing.
    monkeypatch.setenv("MEGATRAIN_CPU_PEAK_TFLOPS", "2.5")
    assert not hasattr(Settings(), "cpu_peak_tflops")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MEGATRAIN_EXECUTOR", "slurm-ish"),
        ("MEGATRAIN_ENVIRONMENT", "staging"),
        ("MEGATRAIN_CPU_SLOTS", "0"),
        ("MEGATRAIN_PORT", "eighty"),
        ("MEGATRAIN_SCHEDULER_INTERVAL_S", "0"),
        ("MEGATRAIN_MAX_REQUEST_BYTES", "10"),
    ],
)
def test_bad_values_are_refused(
    megatrain_home: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert var.removeprefix("MEGATRAIN_").lower() in str(info.value)


def test_get_settings_is_cached_until_reset(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = get_settings()
    monkeypatch.setenv("MEGATRAIN_PORT", "8123")
    assert get_settings() is first and first.port == 8000
    reset_settings_cache()
    assert get_settings().port == 8123


PROD_OK = {
    "MEGATRAIN_ENVIRONMENT": "production",
    "MEGATRAIN_DATABASE_URL": "postgresql+psycopg://u@db/megatrain",
    "MEGATRAIN_STORAGE_URL": "s3://megatrain/prod",
}


def test_production_with_server_database_and_s3(
    megatrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in PROD_OK.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.environment == "production"
    assert s.data_roots == []  # nobody may read arbitrary data until roots are configured


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("MEGATRAIN_DATABASE_URL", "", "MEGATRAIN_DATABASE_URL"),
        ("MEGATRAIN_DATABASE_URL", "sqlite:////tmp/x.db", "MEGATRAIN_DATABASE_URL"),
        ("MEGATRAIN_DATABASE_URL", "sqlite+pysqlite:///x.db", "MEGATRAIN_DATABASE_URL"),
        ("MEGATRAIN_STORAGE_URL", "", "MEGATRAIN_STORAGE_URL"),
        ("MEGATRAIN_STORAGE_URL", "file:///srv/megatrain", "MEGATRAIN_STORAGE_URL"),
        ("MEGATRAIN_STORAGE_URL", "/srv/megatrain", "MEGATRAIN_STORAGE_URL"),
    ],
)
def test_production_refuses_embedded_defaults(
    megatrain_home: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str, message: str
) -> None:
    for k, v in PROD_OK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError, match=message):
        Settings()
    monkeypatch.setenv("MEGATRAIN_ENVIRONMENT", "dev")
    Settings()  # the same values are fine for the embedded default


def test_data_roots(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(megatrain_home.parent))
    home = megatrain_home.parent.resolve().as_uri()
    examples = (REPO_ROOT / "examples").resolve().as_uri()  # the checkout's own examples
    assert Settings().data_roots == [home, examples]
    # The variable adds to the defaults: the exported model under $HOME stays readable.
    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", " file:///data/ , s3://corpora/shared/,,")
    assert Settings().data_roots == [home, examples, "file:///data", "s3://corpora/shared"]
    for k, v in PROD_OK.items():
        monkeypatch.setenv(k, v)
    assert Settings().data_roots == ["file:///data", "s3://corpora/shared"]


def test_cpu_slots_default_to_the_usable_cores(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain.worker import nodes

    monkeypatch.setattr(nodes, "detect_gpus", lambda: [])  # a machine without GPUs
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 5, 7}, raising=False)
    s = Settings()
    assert s.cpu_slots is None and s.resolved_cpu_slots == 5
    assert nodes.local_capacity(s) == ("cpu", 5)
    # A configured value wins over the cores.
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", "3")
    assert nodes.local_capacity(Settings()) == ("cpu", 3)


def test_slurm_pools_map_pools_onto_partitions_and_refuse_nonsense() -> None:
    assert Settings(slurm_pools="h100=gpu-h100, cpu=debug").slurm_pool_partitions == {
        "h100": "gpu-h100",
        "cpu": "debug",
    }
    assert Settings(pool_name="p", slurm_partition="x").slurm_pool_partitions == {"p": "x"}
    refused = [("h100", "must be POOL=PARTITION"), ("a=x,a=y", "names pool 'a' twice"), ("=x", "must be")]
    for bad, words in refused:
        with pytest.raises(ValidationError, match=words):
            Settings(slurm_pools=bad)
