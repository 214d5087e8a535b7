"""Datasets in record formats (api/datasets/records.py) through /v1/datasets: OpenAI's chat,
prompt/completion and preference files checked line by line at upload (a bad record refused naming
its line and why), stored as uploaded with their records in the engine's shape beside them, ready
at once, read by the job kinds that train on them and refused by the others."""

from __future__ import annotations

import json
from typing import Any

import pytest
from api_handle import Api

from megatrain.api.datasets.records import engine_record
from megatrain.storage import open_store, split_url

SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
"""The API's part is the same SQL as test_datasets.py's, which runs it on PostgreSQL too."""
NDJSON = {"Content-Type": "application/x-ndjson"}


def _jsonl(records: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _upload(api: Api, name: str, records: list[Any], record_format: str) -> Any:
    return api.client.post(
        "/v1/datasets",
        params={"name": name, "record_format": record_format},
        content=_jsonl(records),
        headers={**api.headers, **NDJSON},
    )


def _read(url: str) -> list[Any]:
    parent, key = split_url(url)
    return [json.loads(line) for line in open_store(parent).get_bytes(key).decode().splitlines()]


def _msg(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


CHAT = {"messages": [_msg("developer", "be brief"), _msg("user", "hi"), _msg("assistant", "hello")]}
PREFERENCE = {
    "input": {"messages": [_msg("user", "hi")]},
    "preferred_output": [_msg("assistant", "hello")],
    "non_preferred_output": [_msg("assistant", "go away")],
}


@SQLITE
def test_each_format_is_stored_as_uploaded_with_engine_records_beside_it(api: Api) -> None:
    cases = {
        # OpenAI's developer role is the templates' system role.
        "chat": (CHAT, {"messages": [_msg("system", "be brief"), *CHAT["messages"][1:]]}),
        "prompt_completion": ({"prompt": "2+2=", "completion": "4"}, {"prompt": "2+2=", "response": "4"}),
        "preference": (PREFERENCE, {"messages": [_msg("user", "hi")], "chosen": [_msg("assistant", "hello")],
                                    "rejected": [_msg("assistant", "go away")]}),
    }  # fmt: skip
    for fmt, (record, engine) in cases.items():
        resp = _upload(api, fmt.replace("_", "-"), [record] * 3, fmt)
        assert resp.status_code == 201, resp.text
        ds = resp.json()
        assert (ds["state"], ds["record_format"], ds["documents"]) == ("ready", fmt, 3)
        assert _read(ds["source_url"]) == [record] * 3
        assert ds["records_url"].endswith("/records.jsonl") and _read(ds["records_url"]) == [engine] * 3


@SQLITE
@pytest.mark.parametrize(
    ("fmt", "record", "words"),
    [
        ("chat", {"messages": [_msg("user", "hi")]}, "no assistant message"),
        ("chat", {"messages": [_msg("user", "hi"), _msg("assistant", "x", weight=0)]}, "weight 0"),
        ("chat", {**CHAT, "tools": [{"type": "function"}]}, "'tools' is not supported"),
        ("chat", {"messages": [_msg("tool", "42"), _msg("assistant", "x")]}, "role 'tool'"),
        ("chat", {"messages": [_msg("assistant", None, tool_calls=[{}])]}, "tool_calls"),
        ("chat", {"messages": [_msg("user", [{"type": "image_url"}]), _msg("assistant", "x")]}, "text parts"),
        (
            "chat",
            {"messages": [_msg("user", "a", weight=1), _msg("assistant", "x")]},
            "assistant messages only",
        ),
        ("chat", {"messages": [_msg("assistant", "x", weight=0.5)]}, "must be 0 or 1"),
        ("prompt_completion", {"prompt": "a", "completion": ""}, "'completion' is empty"),
        ("prompt_completion", {"prompt": "a"}, "must be strings"),
        ("preference", {**PREFERENCE, "preferred_output": [_msg("user", "x")]}, "assistant messages only"),
        ("preference", {"input": {"messages": []}}, "non-empty list"),
    ],
)
def test_a_bad_record_is_refused_naming_its_line(api: Api, fmt: str, record: Any, words: str) -> None:
    good = (
        CHAT
        if fmt == "chat"
        else {"prompt": "a", "completion": "b"}
        if fmt == "prompt_completion"
        else PREFERENCE
    )
    resp = _upload(api, "bad", [good, record], fmt)
    assert resp.status_code == 422, resp.text
    (error,) = resp.json()["detail"]
    assert error["field"] == "file" and error["message"].startswith(f"line 2: {fmt} record: "), error
    assert words in error["message"]
    assert api.client.get("/v1/datasets", headers=api.headers).json()["items"] == []


def test_weights_of_zero_are_honoured_where_exact() -> None:
    trailing = {
        "messages": [
            _msg("user", "a"),
            _msg("assistant", "b"),
            _msg("user", "c"),
            _msg("assistant", "d", weight=0),
        ]
    }
    # Nothing after the last trained turn changes its loss: the rest is dropped.
    assert engine_record("chat", trailing) == {"messages": [_msg("user", "a"), _msg("assistant", "b")]}
    earlier = {
        "messages": [
            _msg("user", "a"),
            _msg("assistant", "b", weight=0),
            _msg("user", "c"),
            _msg("assistant", "d"),
        ]
    }
    # An earlier weight 0 stays: the engine's templates then train on turn 3 only (test_finetune).
    assert engine_record("chat", earlier) == earlier
    parts = {"messages": [_msg("user", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
                          _msg("assistant", "c")]}  # fmt: skip
    assert engine_record("chat", parts)["messages"][0] == _msg("user", "ab")


@SQLITE
def test_jobs_read_the_records_and_only_their_kinds_may(api: Api) -> None:
    transformers = pytest.importorskip("transformers")
    folder = api.data_root / "llama"
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, vocab_size=300).save_pretrained(folder)  # fmt: skip
    chat = _upload(api, "chat", [CHAT] * 4, "chat").json()
    prefs = _upload(api, "prefs", [PREFERENCE] * 4, "preference").json()

    def validate(kind: str, name: str) -> Any:
        spec = api.spec("uses-records")
        spec["data"]["train"] = [{"dataset": name}]
        spec["kind"], spec["model"] = kind, {"init_from": f"hf:{folder.as_uri()}", "seq_length": 32}
        return api.client.post("/v1/spec/validate", json=spec, headers=api.headers)

    # Ready at once, whatever the tokenizer (the job tokenizes records with its own).
    ok = validate("finetune", "chat")
    assert ok.status_code == 200, ok.text
    assert ok.json()["spec"]["data"]["train"][0]["path"] == chat["records_url"]
    assert validate("dpo", "prefs").json()["spec"]["data"]["train"][0]["path"] == prefs["records_url"]
    for kind, name, reads in (
        ("pretrain", "chat", "finetune"),
        ("dpo", "chat", "finetune"),
        ("finetune", "prefs", "dpo"),
    ):
        resp = validate(kind, name)
        assert resp.status_code == 422, resp.text
        (error,) = resp.json()["detail"]
        assert (
            error["field"] == "data.train.0.dataset"
            and f"which kind {reads} reads, not kind {kind}" in error["message"]
        )


@SQLITE
def test_only_uploads_take_a_record_format(api: Api) -> None:
    body = {
        "name": "by-url",
        "source_url": (api.data_root / "corpus.jsonl").as_uri(),
        "record_format": "chat",
    }
    resp = api.client.post("/v1/datasets", json=body, headers=api.headers)
    assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "record_format"
