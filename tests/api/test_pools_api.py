"""GET /v1/pools and /v1/pools/{name}: any tenant reads each pool's hardware description and its
live nodes (ready or lost, devices, free); /v1/cluster carries the same description and counts a
lost node's slots nowhere."""

from __future__ import annotations

from datetime import timedelta

from api_handle import Api
from sqlalchemy import select, update

from megatrain.db.models import Node, NodePool, utcnow
from megatrain.db.session import session_scope
from megatrain.plan.pool import PoolSpec
from megatrain.scheduler.pools import apply_pool

H100 = PoolSpec(
    name="h100",
    accelerator="NVIDIA H100 80GB HBM3",
    device_memory_bytes=80 << 30,
    peak_tflops={"bf16": 989.4, "fp8": 1979.0},
    devices_per_node=8,
    nodes=2,
    intra_node_bandwidth_gbps=450,
    inter_node_bandwidth_gbps=50,
)


def test_pools_list_and_one(api: Api) -> None:
    with session_scope(api.db_url) as s:
        apply_pool(s, H100)
        pool_id = s.scalar(select(NodePool.id).where(NodePool.name == "h100"))
        s.add(Node(pool_id=pool_id, hostname="gpu-1", slots_total=8, slots_used=3))
        gone = utcnow() - timedelta(minutes=10)
        s.add(Node(pool_id=pool_id, hostname="gpu-2", slots_total=8, status="lost", last_seen_at=gone))

    resp = api.client.get("/v1/pools", headers=api.other_headers)  # any tenant
    assert resp.status_code == 200, resp.text
    items = {p["name"]: p for p in resp.json()["items"]}
    assert set(items) == {"default", "h100"}
    h100 = items["h100"]
    assert h100["described_by"] == "operator"
    assert h100["spec"] == H100.model_dump(mode="json")
    assert (h100["nodes_ready"], h100["nodes_lost"], h100["devices_total"], h100["devices_free"]) == (
        1,
        1,
        8,
        5,
    )
    nodes = {n["hostname"]: n for n in h100["nodes"]}
    assert nodes["gpu-2"]["status"] == "lost" and nodes["gpu-2"]["devices_free"] == 0
    assert nodes["gpu-2"]["seen_s_ago"] >= 600
    assert items["default"]["nodes"][0]["devices"] == 4  # MEGATRAIN_CPU_SLOTS

    one = api.client.get("/v1/pools/h100", headers=api.headers)
    assert one.status_code == 200 and one.json() == {**h100, "nodes": one.json()["nodes"]}
    missing = api.client.get("/v1/pools/nope", headers=api.headers)
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]
    assert api.client.get("/v1/pools").status_code == 401


def test_cluster_shows_hardware_and_no_slots_of_lost_nodes(api: Api) -> None:
    with session_scope(api.db_url) as s:
        apply_pool(s, H100)
        pool_id = s.scalar(select(NodePool.id).where(NodePool.name == "h100"))
        s.add(Node(pool_id=pool_id, hostname="gpu-1", slots_total=8))
        s.add(Node(pool_id=pool_id, hostname="gpu-2", slots_total=8))
    with session_scope(api.db_url) as s:
        s.execute(update(Node).where(Node.hostname == "gpu-2").values(status="lost"))
    view = api.client.get("/v1/cluster", headers=api.headers).json()
    h100 = next(p for p in view["pools"] if p["name"] == "h100")
    assert h100["hardware"]["peak_tflops"] == {"bf16": 989.4, "fp8": 1979.0}
    assert (h100["slots_total"], h100["slots_free"], h100["nodes_lost"]) == (8, 8, 1)
    assert [n["status"] for n in h100["nodes"]] == ["ready", "lost"]
