"""`megatrain nodes release NODE` on the database, `megatrain cluster` naming a quarantined node,
and the goodput line of `megatrain status`."""

from __future__ import annotations

import pytest
from fixtures.cluster import seed_node
from fixtures.live import LiveApi
from sqlalchemy import select, update
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.cli.jobs import goodput_line
from megatrain.db.models import QUARANTINED, Node
from megatrain.db.session import session_scope

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _quarantine(url: str, hostname: str) -> None:
    with session_scope(url) as s:
        s.execute(
            update(Node)
            .where(Node.hostname == hostname)
            .values(status=QUARANTINED, quarantine_reason="3 attempts failed with infrastructure errors")
        )


def test_release_lifts_a_quarantine_and_refuses_what_is_not_one(db_url: str) -> None:
    seed_node(db_url, 4, "default", "gpu-7")
    seed_node(db_url, 4, "other", "twin")
    seed_node(db_url, 4, "third", "twin")
    code, out = run("nodes", "release", "gpu-7")
    assert code == 1 and "node 'gpu-7' is ready, not quarantined: nothing to release" in out
    code, out = run("nodes", "release", "nope")
    assert code == 1 and "no node 'nope'" in out
    code, out = run("nodes", "release", "twin")
    assert code == 1 and "several nodes are named 'twin' (pools other, third): name one with --pool" in out
    _quarantine(db_url, "gpu-7")
    code, out = run("nodes", "release", "gpu-7")
    assert code == 0 and "node 'gpu-7' released" in out
    with session_scope(db_url) as s:
        assert s.scalar(select(Node.status).where(Node.hostname == "gpu-7")) == "ready"


def test_cluster_names_a_quarantined_node(live_api: LiveApi) -> None:
    with session_scope(live_api.settings.resolved_database_url) as s:
        hostname = s.scalars(select(Node.hostname)).first()
    _quarantine(live_api.settings.resolved_database_url, hostname)
    code, out = run("cluster")
    assert code == 0, out
    assert f"node {hostname} quarantined (3 attempts failed with infrastructure errors)" in out
    assert f"`megatrain nodes release {hostname}`" in out
    assert "0 CPU slots on 0 nodes" in out


def test_goodput_line(db_url: str) -> None:
    assert goodput_line(None) is None and goodput_line({"attempts": 0}) is None
    line = goodput_line(
        {
            "attempts": 2,
            "productive_s": 3600,
            "queued_s": 0,
            "restart_s": 180,
            "hang_s": 120,
            "goodput": 0.923,
        }
    )
    assert line == "92.3% productive (1h 00m of 1h 05m); lost: restarts 3m, hangs 2m"
    preempted = goodput_line({"attempts": 2, "productive_s": 3540, "preempt_s": 60, "goodput": 0.983})
    assert preempted == "98.3% productive (59m of 1h 00m); lost: preemptions 1m"
