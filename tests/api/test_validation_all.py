"""Every error a submission has comes back in one 422, from POST /v1/jobs and /v1/spec/validate alike
(megatrain/api/jobs/validation.py, megatrain/spec_errors.py)."""

from __future__ import annotations

from typing import Any

import pytest
from api_handle import Api, write_corpus
from sqlalchemy import func, select

from megatrain.db.models import Job
from megatrain.db.session import session_scope

ROUTES = ("/v1/jobs", "/v1/spec/validate")


def _errors(api: Api, spec: dict[str, Any]) -> list[list[dict[str, str]]]:
    """The 422's errors from each route (the same spec to both)."""
    out = []
    for route in ROUTES:
        resp = api.client.post(route, json=spec, headers=api.headers)
        assert resp.status_code == 422, (route, resp.text)
        out.append(resp.json()["detail"])
    assert out[0] == out[1]  # one validation, whichever route asks
    with session_scope(api.db_url) as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0
    return out


def _fields(api: Api, spec: dict[str, Any]) -> list[str]:
    return [e["field"] for e in _errors(api, spec)[0]]


def test_a_bad_field_and_a_cross_field_rule_of_the_same_section(api: Api) -> None:
    # num_layers=0 breaks a bound; hidden 250 vs 4 heads a rule pydantic ran only once fields were valid.
    spec = api.spec(model={"num_layers": 0, "hidden_size": 250})
    assert _fields(api, spec) == ["model.num_layers", "model.hidden_size"]


def test_every_rule_of_a_section_not_only_the_first(api: Api) -> None:
    spec = api.spec(training={"global_batch_size": 10, "micro_batch_size": 3, "warmup_iters": 50, "lr": 1e-4,
                              "min_lr": 1e-3}, parallelism={"dp": 2})  # fmt: skip
    errors = _errors(api, spec)[0]
    assert [e["field"] for e in errors] == [
        "training.global_batch_size",
        "training.warmup_iters",
        "training.min_lr",
    ], errors
    assert "training.warmup_iters=50 exceeds training.train_iters=20" in errors[1]["message"]


def test_a_bad_name_does_not_hide_the_rules_between_sections(api: Api) -> None:
    spec = api.spec(name="no spaces allowed", kind="finetune")
    assert _fields(api, spec) == ["name", "model.init_from"]


def test_a_field_error_does_not_hide_the_layout(api: Api) -> None:
    # lr is no input of the layout: tp=3 against 4 heads is judged all the same.
    spec = api.spec(
        training={"lr": -1.0}, parallelism={"tp": 3, "pp": 1, "dp": "auto"}, resources={"devices": 3}
    )
    fields = _fields(api, spec)
    assert fields[0] == "training.lr" and "model.num_attention_heads" in fields, fields


def test_layout_pool_and_data_access_in_one_answer(api: Api) -> None:
    spec = api.spec(parallelism={"tp": 3}, resources={"devices": 3, "pool": "nowhere"})
    spec["data"]["train"][0]["path"] = "file:///etc/passwd"
    errors = _errors(api, spec)[0]
    fields = [e["field"] for e in errors]
    assert "model.num_attention_heads" in fields  # 4 heads, tp=3
    assert "resources.pool" in fields and "data.train.0.path" in fields, errors
    assert any("outside the data this tenant may read" in e["message"] for e in errors)
    assert not any("does not exist" in e["message"] for e in errors)  # no answers about others' files


def test_an_expert_width_tp_does_not_divide_is_refused_before_the_engine(api: Api) -> None:
    # issue 28: the engine refused it (parallel.moe_tensor), validation let it through.
    model = {**api.spec()["model"], "moe": {"num_experts": 4, "ffn_hidden_size": 177}}
    errors = _errors(api, api.spec(model=model, parallelism={"tp": 2}))[0]
    assert errors == [
        {
            "field": "model.moe.ffn_hidden_size",
            "message": "model.moe.ffn_hidden_size=177 is not divisible by parallelism.tp=2",
        }
    ]


def test_an_unknown_field_names_the_nearest_known_one(api: Api) -> None:
    spec = api.spec(training={"trainiters": 5, "queue": "fast"})
    assert _errors(api, spec)[0] == [
        {"field": "training.trainiters", "message": "unknown field; did you mean train_iters?"},
        {"field": "training.queue", "message": "unknown field"},
    ]


def test_no_message_about_a_stand_in_value(api: Api) -> None:
    # hidden_size 'abc' is dropped and its default (256) stands in: 256 is not divisible by 12
    # heads, but that is no error of this spec.
    errors = _errors(api, api.spec(model={"hidden_size": "abc", "num_attention_heads": 12}))[0]
    assert [e["field"] for e in errors] == ["model.hidden_size"], errors
    assert "divisible" not in errors[0]["message"]
    # 0 heads is dropped (8 stand in): 250 vs 8 must not be blamed on hidden_size.
    assert _fields(api, api.spec(model={"hidden_size": 250, "num_attention_heads": 0})) == [
        "model.num_attention_heads"
    ]
    # tp=0 is dropped: no layout verdict on the stand-in tp=1.
    spec = api.spec(parallelism={"tp": 0}, resources={"devices": 3})
    assert _fields(api, spec) == ["parallelism.tp"]


def test_an_error_free_spec_is_still_accepted(api: Api) -> None:
    check = api.client.post("/v1/spec/validate", json=api.spec(), headers=api.headers)
    assert check.status_code == 200 and check.json()["valid"], check.text
    assert api.submit()["status"] == "queued"


def test_missing_data_is_named_with_the_rest(api: Api) -> None:
    root = api.data_root
    prefix = root / "indexed" / "corpus_text_document"
    prefix.parent.mkdir()
    prefix.with_suffix(".bin").write_bytes(b"\0" * 8)  # the .idx is missing
    spec = api.spec(
        resources={"pool": "nowhere"}, kind="finetune", model={"init_from": "checkpoint:job-none"}
    )
    spec["data"] = {
        "train": [
            {"path": (root / "corpus.jsonl").as_uri()},  # exists
            {"path": (root / "missing.jsonl").as_uri()},
            {"path": prefix.as_uri()},
            {"path": (root / "indexed.jsonl").as_uri()},
        ],
        "tokenizer": {"type": "hf", "path": (root / "tokenizer.json").as_uri()},
        "chat_template": (root / "tokenizer_config.json").as_uri(),
    }
    (root / "indexed.jsonl").mkdir()
    errors = _errors(api, spec)[0]
    by_field = {e["field"]: e["message"] for e in errors}
    assert list(by_field) == [
        "resources.pool",
        "data.train.1.path",
        "data.train.2.path",
        "data.train.3.path",
        "data.tokenizer.path",
        "data.chat_template",
        "model.init_from",
    ], errors
    assert by_field["data.train.1.path"].endswith("missing.jsonl' does not exist")
    assert "corpus_text_document.idx does not exist" in by_field["data.train.2.path"]
    assert ".bin and" not in by_field["data.train.2.path"]  # the .bin is there
    assert "is a directory" in by_field["data.train.3.path"]
    # Once they exist, the same data is accepted.
    prefix.with_suffix(".idx").write_bytes(b"\0" * 8)
    write_corpus(root / "missing.jsonl")
    (root / "tokenizer.json").write_text("{}")
    (root / "tokenizer_config.json").write_text("{}")
    spec["data"]["train"].pop()
    spec["resources"] = {"devices": 2}
    spec["kind"], spec["model"]["init_from"] = "pretrain", None
    resp = api.client.post("/v1/spec/validate", json=spec, headers=api.headers)
    assert resp.status_code == 200, resp.text


def test_a_built_in_chat_template_is_no_file_and_others_need_access(api: Api) -> None:
    ok = api.spec(kind="pretrain")
    ok["data"]["chat_template"] = "chatml"
    assert api.client.post("/v1/spec/validate", json=ok, headers=api.headers).status_code == 200
    ok["data"]["chat_template"] = "file:///etc/hostname"
    errors = _errors(api, ok)[0]
    assert [e["field"] for e in errors] == ["data.chat_template"], errors
    assert "outside the data this tenant may read" in errors[0]["message"]


@pytest.mark.parametrize("spec", [[], "name: x", 5])
def test_a_body_that_is_no_mapping_is_one_error(api: Api, spec: Any) -> None:
    for route in ROUTES:
        resp = api.client.post(route, json=spec, headers=api.headers)
        assert resp.status_code == 422 and [e["field"] for e in resp.json()["detail"]] == ["spec"], resp.text


def test_an_unreadable_hf_folder_with_the_rest(api: Api) -> None:
    # The folder's config.json was to fill the model: nothing judges the partial model section
    # (250 vs the default 8 heads), everything else is judged as usual.
    folder = api.data_root / "no-such-model"
    spec = api.spec(training={"warmup_iters": 99}, model=None)
    spec["model"] = {"init_from": f"hf:{folder.as_uri()}", "hidden_size": 250}
    spec["data"]["train"][0]["path"] = (api.data_root / "missing.jsonl").as_uri()
    errors = _errors(api, spec)[0]
    assert [e["field"] for e in errors] == ["model.init_from", "training.warmup_iters", "data.train.0.path"]
    assert "config.json does not exist" in errors[0]["message"]
