"""POST /v1/plan: the planner behind the API, on a given pool or the spec's stored one."""

from __future__ import annotations

from api_handle import Api
from sqlalchemy import update

from megatrain.db.models import Node, NodePool
from megatrain.db.session import session_scope

H100_POOL = {
    "name": "h100",
    "accelerator": "NVIDIA H100 80GB HBM3",
    "device_memory_bytes": 80 << 30,
    "peak_tflops": {"bf16": 989.0},
    "devices_per_node": 8,
    "nodes": 2,
    "intra_node_bandwidth_gbps": 450.0,
    "inter_node_bandwidth_gbps": 50.0,
}
HUGE = {"num_layers": 1024, "hidden_size": 131072, "num_attention_heads": 1024, "seq_length": 4096}


def test_plan_on_the_stored_pool(api: Api) -> None:
    """The embedded pool: this machine's CPU slots (MEGATRAIN_CPU_SLOTS=4), as a one-node pool."""
    spec = api.spec("planned", resources={"devices": 4})
    resp = api.client.post("/v1/plan", json={"spec": spec}, headers=api.headers)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    lay = body["layout"]
    assert lay["tp"] * lay["pp"] * lay["dp"] == 4 == body["devices"]
    assert body["pool"] == "default" and body["precision"] == "fp32"
    assert body["predicted"]["step_time_s"] > 0 and body["predicted"]["memory_per_gpu_bytes"] > 0
    assert {"runners_up", "rejected", "considered"} <= set(body["candidates"])
    # Nothing was submitted.
    assert api.client.get("/v1/jobs", headers=api.headers).json()["items"] == []


def test_plan_on_a_described_pool_and_an_explicit_layout(api: Api) -> None:
    spec = api.spec(
        "gpus", resources={"devices": 16}, training={"precision": "bf16", "global_batch_size": 32}
    )
    resp = api.client.post("/v1/plan", json={"spec": spec, "pool": H100_POOL}, headers=api.headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["pool"] == "h100" and resp.json()["devices"] == 16
    assert resp.json()["layout"]["tp"] <= 8
    spec["parallelism"] = {"tp": 2, "dp": 8}
    resp = api.client.post("/v1/plan", json={"spec": spec, "pool": H100_POOL}, headers=api.headers)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["explicit_layout"] and (body["layout"]["tp"], body["layout"]["dp"]) == (2, 8)
    spec["training"]["global_batch_size"] = 8  # 8 sequences cannot split into 8 ranks × 2
    resp = api.client.post("/v1/plan", json={"spec": spec, "pool": H100_POOL}, headers=api.headers)
    assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "spec.training.global_batch_size"


def test_bad_spec_and_pool_are_422s_naming_their_fields(api: Api) -> None:
    spec = api.spec("bad", model={**api.spec()["model"], "num_layers": 0})
    pool = {**H100_POOL, "devices_per_node": 0}
    resp = api.client.post("/v1/plan", json={"spec": spec, "pool": pool}, headers=api.headers)
    assert resp.status_code == 422, resp.text
    fields = {e["field"] for e in resp.json()["detail"]}
    assert {"spec.model.num_layers", "pool.devices_per_node"} <= fields
    resp = api.client.post("/v1/plan", json={"pool": H100_POOL}, headers=api.headers)
    assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "spec"
    spec = api.spec("nowhere", resources={"pool": "nowhere", "devices": 2})
    resp = api.client.post("/v1/plan", json={"spec": spec}, headers=api.headers)
    assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "spec.resources.pool"


def test_a_spec_that_fits_nowhere_is_a_422_naming_why(api: Api) -> None:
    with session_scope(api.db_url) as s:
        s.execute(update(Node).values(device_memory_bytes=6 << 30))
    spec = api.spec("huge", model={**api.spec()["model"], **HUGE})
    resp = api.client.post("/v1/plan", json={"spec": spec}, headers=api.headers)
    assert resp.status_code == 422, resp.text
    [problem] = resp.json()["detail"]
    assert problem["field"] == "spec.model"
    assert "no layout of 2 devices fits" in problem["message"] and "GiB" in problem["message"]


def test_planning_needs_a_key(api: Api) -> None:
    assert api.client.post("/v1/plan", json={"spec": api.spec()}).status_code == 401


def test_a_stored_gpu_pool_is_described_from_its_rows(api: Api) -> None:
    """pool_for: the accelerator's datasheet peaks, the nodes' smallest device memory, the slots of
    the largest node as devices per node, and the node count."""
    with session_scope(api.db_url) as s:
        # No description stored (the local worker may have measured its CPU): derived from the rows.
        s.execute(update(NodePool).values(accelerator="NVIDIA H100 80GB HBM3", spec=None, spec_source=None))
        s.execute(update(Node).values(device_memory_bytes=80 << 30, slots_total=8))
    spec = api.spec("on-gpus", resources={"devices": 8}, training={"precision": "auto"})
    resp = api.client.post("/v1/plan", json={"spec": spec}, headers=api.headers)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    described = body["pool_description"]
    assert described["accelerator"] == "NVIDIA H100 80GB HBM3" and described["peak_tflops"]["bf16"] == 989.4
    assert (described["devices_per_node"], described["nodes"]) == (8, 1)
    assert described["device_memory_bytes"] == 80 << 30
    assert body["precision"] == "bf16" and body["devices"] == 8


def test_plan_of_an_moe_with_cp_and_ep_returns_them_and_its_parameters(api: Api) -> None:
    model = {**api.spec()["model"], "moe": {"num_experts": 4, "router_topk": 2}}
    spec = api.spec("moe", model=model, resources={"devices": 8}, training={"precision": "bf16"})
    spec["parallelism"] = {"cp": 2, "dp": 4, "ep": 2}
    resp = api.client.post("/v1/plan", json={"spec": spec, "pool": H100_POOL}, headers=api.headers)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["layout"]["cp"], body["layout"]["ep"], body["layout"]["dp"]) == (2, 2, 4)
    params = body["parameters"]
    assert 0 < params["active"] < params["total"]  # 2 of 4 experts per token
    assert {"cp_comm_s", "ep_comm_s"} <= set(body["predicted"]["time_breakdown"])


def test_an_unknown_pool_says_how_to_describe_one(api: Api) -> None:
    spec = api.spec("nowhere", resources={"pool": "nowhere", "devices": 2})
    resp = api.client.post("/v1/plan", json={"spec": spec}, headers=api.headers)
    [problem] = resp.json()["detail"]
    assert "`megatrain plan SPEC --pool POOL.yaml`" in problem["message"], problem
    assert "docs/pool-reference.md" in problem["message"] and "give `pool`" not in problem["message"]
