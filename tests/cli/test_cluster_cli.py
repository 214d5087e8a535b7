"""`megatrain cluster` through CliRunner against a live API: a pool without GPUs counts CPU slots
(never GPUs), a GPU pool its GPUs, and the queue says why each job waits."""

from __future__ import annotations

import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Client
from megatrain.db.models import Node, NodePool
from megatrain.db.session import session_scope

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_cluster_in_cpu_words(live_api: LiveApi) -> None:
    with Client() as c:
        job = c.submit(live_api.spec("waits"))  # no scheduler runs: it stays queued
    code, out = run("cluster")
    assert code == 0, out
    assert "default: 2 CPU slots on 1 node, 0 busy, 2 free" in out
    assert "GPU" not in out
    assert job.id in out and "waits" in out

    with session_scope(live_api.settings.resolved_database_url) as s:
        pool = NodePool(name="h100", accelerator="NVIDIA H100 80GB HBM3")
        s.add(pool)
        s.flush()
        s.add(Node(pool_id=pool.id, hostname="gpu-1", slots_total=8))
    code, out = run("cluster")
    assert code == 0, out
    assert "h100: 8 GPUs (NVIDIA H100 80GB HBM3) on 1 node, 0 busy, 8 free" in out
    assert "default: 2 CPU slots" in out


def test_cluster_shows_pool_hardware_and_lost_nodes(live_api: LiveApi) -> None:
    from megatrain.plan.pool import PoolSpec
    from megatrain.scheduler.pools import apply_pool

    spec = PoolSpec(
        name="h100",
        accelerator="NVIDIA H100 80GB HBM3",
        device_memory_bytes=80 << 30,
        peak_tflops={"bf16": 989.4},
        devices_per_node=8,
        nodes=2,
        intra_node_bandwidth_gbps=450,
        inter_node_bandwidth_gbps=50,
    )
    with session_scope(live_api.settings.resolved_database_url) as s:
        pool, _ = apply_pool(s, spec)
        s.add(Node(pool_id=pool.id, hostname="gpu-1", slots_total=8))
        s.add(Node(pool_id=pool.id, hostname="gpu-2", slots_total=8, status="lost"))
    code, out = run("cluster")
    assert code == 0, out
    assert "h100: 8 GPUs (NVIDIA H100 80GB HBM3) on 1 node, 0 busy, 8 free" in out
    assert "hardware (operator): 8 × NVIDIA H100 80GB HBM3 per node × 2 nodes, 80.0 GiB per device" in out
    assert "node gpu-2 lost" in out and "node gpu-1 lost" not in out
