"""`parallelism: auto` is planned at submission (megatrain.plan.planner on the spec's pool): the
chosen layout is stored in the spec and the job (job.layout stays the engine's), the prediction in
the `submitted` event; an explicit layout gets its prediction too; a plan that fits nothing is a
422 with the rest."""

from __future__ import annotations

from typing import Any

from api_handle import Api
from sqlalchemy import update

from megatrain.db.models import Node
from megatrain.db.session import session_scope

HUGE = {"num_layers": 1024, "hidden_size": 131072, "num_attention_heads": 1024, "seq_length": 4096}


def _node_memory(api: Api, value: int | None) -> None:
    with session_scope(api.db_url) as s:
        s.execute(update(Node).values(device_memory_bytes=value))


def _submitted(api: Api, job_id: str) -> dict[str, Any]:
    resp = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers)
    assert resp.status_code == 200, resp.text
    items = resp.json()
    items = items["items"] if isinstance(items, dict) else items
    [event] = [e for e in items if e.get("reason") == "submitted" or e.get("kind") == "submitted"]
    return event["data"]


def test_auto_is_planned_over_one_node_and_the_prediction_stored(api: Api) -> None:
    _node_memory(api, 6 << 30)
    spec = api.spec("auto")
    del spec["resources"]["devices"]  # the planner's best over one node (4 slots)
    job = api.submit(spec)
    lay = job["layout"]
    world = lay["tp"] * lay["pp"] * lay["dp"] * lay["cp"]
    assert job["num_procs"] == world <= 4
    stored = job["spec"]
    assert isinstance(stored["parallelism"], dict)  # the plan, written into the spec
    assert (stored["parallelism"]["tp"], stored["parallelism"]["pp"]) == (lay["tp"], lay["pp"])
    assert stored["resources"]["devices"] == world
    assert "predicted" not in lay  # the engine reads job.layout and accepts layout fields only
    plan = _submitted(api, job["id"])["plan"]
    predicted = plan["predicted"]
    assert predicted["step_time_s"] > 0 and predicted["tokens_per_s"] > 0
    assert 0 < predicted["memory_per_gpu_bytes"] < 6 << 30
    assert not plan["explicit_layout"]
    assert plan["layout"]["tp"] == lay["tp"] and plan["devices"] == world and plan["pool"] == "default"
    assert "candidates" not in plan


def test_an_explicit_layout_is_kept_and_predicted(api: Api) -> None:
    _node_memory(api, 6 << 30)
    job = api.submit(api.spec("explicit", parallelism={"pp": 2, "dp": 1}))
    assert (job["layout"]["pp"], job["layout"]["dp"], job["num_procs"]) == (2, 1, 2)
    plan = _submitted(api, job["id"])["plan"]
    assert plan["predicted"]["step_time_s"] > 0
    assert plan["explicit_layout"] and plan["layout"]["pp"] == 2


def test_a_plan_that_fits_nothing_is_a_422_listed_with_the_other_errors(api: Api) -> None:
    _node_memory(api, 6 << 30)
    spec = api.spec("huge", model={**api.spec()["model"], **HUGE})
    spec["data"]["train"][0]["path"] = (api.data_root / "missing.jsonl").as_uri()
    for path in ("/v1/jobs", "/v1/spec/validate"):
        resp = api.client.post(path, json=spec, headers=api.headers)
        assert resp.status_code == 422, resp.text
        by_field = {e["field"]: e["message"] for e in resp.json()["detail"]}
        assert set(by_field) == {"model", "data.train.0.path"}, by_field
        assert by_field["model"].startswith("no layout of 2 devices fits"), by_field
        assert "GiB" in by_field["model"]
    assert api.client.get("/v1/jobs", headers=api.headers).json()["items"] == []


def test_a_pool_whose_memory_is_unknown_keeps_todays_auto(api: Api) -> None:
    _node_memory(api, None)
    job = api.submit(api.spec("unplanned"))
    assert (job["layout"]["tp"], job["layout"]["pp"], job["layout"]["dp"]) == (1, 1, 2)
    assert job["spec"]["parallelism"] == "auto"
    assert "plan" not in _submitted(api, job["id"])


def test_validate_answers_with_the_plan(api: Api) -> None:
    _node_memory(api, 6 << 30)
    resp = api.client.post("/v1/spec/validate", json=api.spec("dry"), headers=api.headers)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["plan"]["predicted"]["step_time_s"] > 0
    lay = body["plan"]["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"]) == (
        body["layout"]["tp"],
        body["layout"]["pp"],
        body["layout"]["dp"],
    )
    assert body["spec"]["parallelism"]["dp"] == lay["dp"]  # the spec as it would be stored: planned
    assert api.client.get("/v1/jobs", headers=api.headers).json()["items"] == []


def test_validate_plans_a_lora_spec_with_its_trainable_share(api: Api) -> None:
    _node_memory(api, 6 << 30)
    full = api.client.post("/v1/spec/validate", json=api.spec("full"), headers=api.headers).json()
    spec = api.spec("lora", training={"method": "lora", "lora": {"rank": 4}})
    resp = api.client.post("/v1/spec/validate", json=spec, headers=api.headers)
    assert resp.status_code == 200, resp.text
    plan = resp.json()["plan"]
    params = plan["parameters"]
    assert 0 < params["trainable"] < params["total"] == full["plan"]["parameters"]["total"]
    assert "trainable" not in full["plan"]["parameters"]
    # Gradients and Adam's state for the adapters only.
    lora_mem, full_mem = plan["predicted"]["memory_breakdown"], full["plan"]["predicted"]["memory_breakdown"]
    assert lora_mem["grads_bytes"] < full_mem["grads_bytes"] / 2


def test_a_written_micro_batch_size_is_kept_under_auto(api: Api) -> None:
    # issue 28: the planner replaced the spec's micro_batch_size (4 written, 16 stored).
    _node_memory(api, 6 << 30)
    spec = api.spec("kept")  # micro_batch_size 2, parallelism auto
    resp = api.client.post("/v1/spec/validate", json=spec, headers=api.headers)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["spec"]["training"]["micro_batch_size"] == 2 == body["plan"]["layout"]["micro_batch_size"]
    assert "training.micro_batch_size" not in body["auto"]
    assert body["auto"]["parallelism.dp"] == body["layout"]["dp"]  # what parallelism: auto chose
    assert api.submit(spec)["spec"]["training"]["micro_batch_size"] == 2


def test_micro_batch_size_auto_is_the_planners_and_validate_says_so(api: Api) -> None:
    _node_memory(api, 6 << 30)
    spec = api.spec("asked", training={"micro_batch_size": "auto"})
    body = api.client.post("/v1/spec/validate", json=spec, headers=api.headers).json()
    chosen = body["plan"]["layout"]["micro_batch_size"]
    assert body["auto"]["training.micro_batch_size"] == chosen == body["spec"]["training"]["micro_batch_size"]
    assert api.submit(spec)["spec"]["training"]["micro_batch_size"] == chosen  # stored as a number
    # An explicit layout asks the planner for the micro-batch size alone.
    explicit = api.spec("asked-explicit", training={"micro_batch_size": "auto"}, parallelism={"dp": 2})
    body = api.client.post("/v1/spec/validate", json=explicit, headers=api.headers).json()
    assert body["auto"] == {"training.micro_batch_size": body["plan"]["layout"]["micro_batch_size"]}
    assert body["plan"]["explicit_layout"]


def test_micro_batch_size_auto_without_a_plan_is_the_largest_up_to_4(api: Api) -> None:
    _node_memory(api, None)  # no memory known: no planner
    spec = api.spec("unplanned-auto", training={"micro_batch_size": "auto", "global_batch_size": 6})
    body = api.client.post("/v1/spec/validate", json=spec, headers=api.headers).json()
    # 6 samples over dp=2: 3 per rank, so micro-batches of 3.
    assert body["plan"] is None and body["auto"]["training.micro_batch_size"] == 3
    assert api.submit(spec)["spec"]["training"]["micro_batch_size"] == 3
