"""deploy/: the Grafana dashboard asks only for series that the API's, the scheduler's and a worker's
/metrics expose, grouped by labels those series have; docker-compose.yml runs a Prometheus that
scrapes each of them where its command serves /metrics."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

import pytest
import yaml
from api_handle import Api
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from megatrain import REPO_ROOT
from megatrain.scheduler.metrics import SchedulerMetrics
from megatrain.worker.metrics import WorkerMetrics

DEPLOY = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "megatrain.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
PROMETHEUS_LABELS = {"le", "instance", "job"}
"""Labels a query may group by that no exposition carries: histogram buckets', and the target's."""


def _exposed(text: str, labels: dict[str, set[str]]) -> None:
    """Every name a query may use (samples' and families', with their type's suffixes) -> its labels."""
    for family in text_string_to_metric_families(text):
        names = {family.name, *(family.name + s for s in SUFFIXES.get(family.type, ()))}
        found = {k for s in family.samples for k in s.labels}
        for name in names | {s.name for s in family.samples}:
            labels[name] |= found


@pytest.fixture
def exposed(api: Api) -> dict[str, set[str]]:
    """The series of all three, each with a sample in every labelled family."""
    api.submit()  # a queued job: the queue by pool and tenant has a row
    labels: dict[str, set[str]] = defaultdict(set)
    _exposed(api.client.get("/metrics").text, labels)
    scheduler = SchedulerMetrics()
    scheduler.waiting.labels("default", "no_free_slots").set(1)
    scheduler.errors.labels("schedule", "database").inc()
    _exposed(generate_latest(scheduler.registry).decode(), labels)
    worker = WorkerMetrics()
    attempt = worker.attempt("j1")
    row = {"step": 2, "iter_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.5}
    attempt.observe([row | {"device_memory_used_bytes": 1, "device_memory_total_bytes": 2}], None)
    worker.heartbeat("j1")
    worker.node_heartbeat("node-a", 1 << 30)
    _exposed(generate_latest(worker.registry).decode(), labels)
    return labels


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def test_the_dashboard_asks_only_for_what_metrics_expose(exposed: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "megatrain" and dashboard["templating"]["list"][0]["type"] == "datasource"
    queries = _queries(dashboard)
    assert len(queries) >= 20
    used: set[str] = set()
    for title, expr in queries:
        names = set(re.findall(r"\bmegatrain_[a-z_]+", expr))
        assert names, f"{title}: {expr} names no megatrain series"
        unknown = names - exposed.keys()
        assert not unknown, f"{title}: no /metrics exposes {sorted(unknown)}"
        have = set().union(*(exposed[n] for n in names)) | PROMETHEUS_LABELS
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            missing = {g.strip() for g in group.split(",")} - have
            assert not missing, f"{title}: grouped by {sorted(missing)}, which {sorted(names)} lack"
        for selector in re.findall(r"\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*[!=]~?", selector):
                assert label in have, f"{title}: selects on {label}, which {sorted(names)} lack"
        used |= names
    # The issue's list: requests, latency, streams, queue, jobs, tick time, decisions; workers' pace,
    # goodput, memory, heartbeats.
    for name in (
        "megatrain_http_requests_total", "megatrain_http_request_duration_seconds_bucket",
        "megatrain_open_streams", "megatrain_queued_jobs", "megatrain_jobs",
        "megatrain_scheduler_tick_seconds_bucket", "megatrain_scheduler_decisions_total",
        "megatrain_worker_running_attempts", "megatrain_worker_step_seconds",
        "megatrain_worker_tokens_per_second", "megatrain_worker_mfu_ratio",
        "megatrain_worker_goodput_seconds_total", "megatrain_worker_device_memory_bytes",
        "megatrain_worker_heartbeat_timestamp_seconds",
    ):  # fmt: skip
        assert name in used, f"no panel shows {name}"


def _port(command: list[str], flag: str) -> int:
    (value,) = [c.split("=", 1)[1] for c in command if c.startswith(f"{flag}=")]
    return int(value)


def test_compose_runs_prometheus_on_every_metrics_port() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    prometheus = services["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # Each target is a compose service, at the port its command serves /metrics on.
    assert jobs["megatrain-api"]["static_configs"][0]["targets"] == [
        f"api:{_port(services['api']['command'], '--port')}"
    ]
    assert jobs["megatrain-scheduler"]["static_configs"][0]["targets"] == [
        f"scheduler:{_port(services['scheduler']['command'], '--metrics-port')}"
    ]
    (workers,) = jobs["megatrain-worker"]["dns_sd_configs"]  # every replica of the worker service
    assert workers["names"] == ["worker"] and workers["port"] == _port(
        services["worker"]["command"], "--metrics-port"
    )
    # Grafana gets the data source and the dashboard from files that exist here.
    grafana = services["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (REPO_ROOT / source).exists(), source
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert provisioned["datasources"][0]["url"] == "http://prometheus:9090"
    assert "prometheus-data" in compose["volumes"] and "grafana-data" in compose["volumes"]
