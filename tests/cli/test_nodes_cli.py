"""`megatrain nodes release NODE` on the database, `megatrain cluster` naming a quarantined node,
and the goodput line of `megatrain status`."""

from __future__ import annotations

import pytest
from fixtures.cluster import seed_job, seed_node
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


def test_node_tokens_are_created_shown_once_listed_revoked_and_audited(db_url: str) -> None:
    from megatrain.db.audit import AuditEvent
    from megatrain.db.node_tokens import (
        TOKEN_PATTERN,
        NodeToken,
        authenticate_node,
        create_attempt_token,
        hash_token,
    )

    code, out = run("nodes", "token", "create", "h100", "--node", "gpu-1")
    assert code == 0 and "for node 'gpu-1' of pool 'h100' (shown once)" in out, out
    token = out.strip().splitlines()[-1]
    assert TOKEN_PATTERN.match(token)
    with session_scope(db_url) as s:
        (row,) = s.scalars(select(NodeToken)).all()
        assert row.token_hash == hash_token(token) and token not in str(vars(row))  # only its hash
        assert authenticate_node(s, token) is not None
        token_id = row.id
    code, out = run("nodes", "token", "list")
    assert code == 0 and token_id in out and "gpu-1" in out and token[:10] in out and token not in out
    job_id = seed_job(db_url)
    with session_scope(db_url) as s:  # an attempt's own token (local and Slurm executors) names its job
        create_attempt_token(s, job_id, s.scalar(select(NodeToken.pool_id)), ttl_s=60)
    code, out = run("nodes", "token", "list")
    assert code == 0 and f"(job {job_id})" in out and "(unbound)" not in out, out
    code, out = run("nodes", "token", "revoke", token_id)
    assert code == 0 and f"node token {token_id} revoked" in out
    code, out = run("nodes", "token", "revoke", token_id)
    assert code == 1 and "was revoked already" in out
    code, out = run("nodes", "token", "revoke", "ntok-nope")
    assert code == 1 and "no node token 'ntok-nope'" in out
    with session_scope(db_url) as s:
        assert authenticate_node(s, token) is None
        actions = s.scalars(select(AuditEvent.action).order_by(AuditEvent.at)).all()
        assert actions == ["node_token.create", "node_token.revoke"]
