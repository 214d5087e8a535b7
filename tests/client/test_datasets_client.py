"""The SDK's dataset calls against the real API (uvicorn on a free port): upload streamed from a
file, register by URL, list/get/delete, wait for ready or failed, errors naming the line."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
from fixtures.live import LiveApi
from sqlalchemy import update

from megatrain.client import ApiError, Client, DatasetFailed, MegatrainError
from megatrain.client.datasets import tokenizer_arg
from megatrain.db.models import Dataset
from megatrain.db.session import session_scope


def _corpus(path: Path, n: int = 50, key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: f"doc {i} " * 10}) + "\n" for i in range(n)))
    return path


def _set_state_later(live_api: LiveApi, name: str, delay_s: float, **values: object) -> threading.Thread:
    """What a worker does, a little later: the SDK must still be polling when it happens."""

    def run() -> None:
        time.sleep(delay_s)
        with session_scope(live_api.settings.resolved_database_url) as s:
            s.execute(update(Dataset).where(Dataset.name == name).values(**values))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_upload_list_get_delete(live_api: LiveApi, tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.jsonl")
    with Client() as c:
        ds = c.upload_dataset(path, "corpus", tokenizer="byte", append_eod=False)
        assert ds.name == "corpus" and ds.state == "pending" and ds.input_bytes == path.stat().st_size
        assert ds.append_eod is False and ds.uploaded and ds.path.endswith("/data")
        assert [d.name for d in c.list_datasets()] == ["corpus"]
        assert c.get_dataset("corpus").id == ds.id
        by_url = c.register_dataset(live_api.data_path.as_uri(), "by-url", tokenizer={"type": "byte"})
        assert by_url.uploaded is False and by_url.source_url == live_api.data_path.as_uri()
        c.delete_dataset("corpus")
        with pytest.raises(ApiError) as ei:
            c.get_dataset("corpus")
        assert ei.value.status == 404
        assert [d.name for d in c.list_datasets()] == ["by-url"]


def test_bad_uploads_name_the_line(live_api: LiveApi, tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.jsonl", 3)
    with open(path, "a") as f:
        f.write('{"body": "no text"}\n')
    with Client() as c:
        with pytest.raises(ApiError) as ei:
            c.upload_dataset(path, "bad")
        assert ei.value.status == 422 and ei.value.fields == ["file"]
        assert "line 4" in str(ei.value) and "'text'" in str(ei.value)
        with pytest.raises(MegatrainError, match="does not exist"):
            c.upload_dataset(tmp_path / "missing.jsonl", "bad")
        assert c.list_datasets() == []


def test_wait_returns_ready_and_raises_on_failed(live_api: LiveApi, tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.jsonl")
    with Client() as c:
        c.upload_dataset(path, "good")
        t = _set_state_later(live_api, "good", 0.3, state="ready", documents=50, tokens=1234)
        ds = c.wait_dataset("good", timeout_s=20, poll_interval_s=0.05)
        t.join()
        assert ds.state == "ready" and ds.documents == 50 and ds.tokens == 1234
        c.upload_dataset(path, "bad")
        t = _set_state_later(live_api, "bad", 0.3, state="failed", state_reason="c.jsonl:3: boom")
        with pytest.raises(DatasetFailed, match="c.jsonl:3: boom"):
            c.wait_dataset("bad", timeout_s=20, poll_interval_s=0.05)
        t.join()
        with pytest.raises(TimeoutError, match="still pending"):
            c.upload_dataset(path, "slow", wait=True, timeout_s=0.2)


def test_tokenizer_shorthand() -> None:
    assert tokenizer_arg("byte") == tokenizer_arg({"type": "byte"}) == "byte"
    assert tokenizer_arg({"type": "hf", "path": "file:///t.json"}) == "hf:file:///t.json"
    assert tokenizer_arg({"type": "tiktoken", "name": "gpt2"}) == "tiktoken:gpt2"


@pytest.mark.slow
def test_a_job_trains_from_an_uploaded_dataset(live_stack: LiveApi, tmp_path: Path) -> None:
    """The whole path: upload through the SDK, preprocessing on a worker the scheduler started,
    a job naming the dataset, trained by the engine from the indexed prefix the API filled in."""
    pytest.importorskip("megatrain.engine.data.preprocess")
    path = tmp_path / "code.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(300))
    )
    with Client() as c:
        c.upload_dataset(path, "code")
        ds = c.wait_dataset("code", timeout_s=120, poll_interval_s=0.2)
        assert ds.documents == 300 and ds.vocab_size is not None and ds.output_bytes
        assert ds.tokens == sum(len(f"def f{i}(x):\n    return x * {i}\n".encode()) + 1 for i in range(300))
        spec = live_stack.spec("from-dataset")
        spec["data"]["train"] = [{"dataset": "code"}]
        job = c.submit(spec)
        assert job.spec is not None and job.spec["data"]["train"][0]["path"] == ds.path
        final = c.wait(job.id, timeout_s=240, poll_interval_s=0.5)
        assert final.status == "succeeded", final.status_reason
        losses = [m["loss"] for m in c.metrics(job.id) if m.get("kind") == "train"]
        assert len(losses) == 5 and all(math.isfinite(x) for x in losses)


def test_upload_fine_tuning_records(live_api: LiveApi, tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(chat) + "\n")
    with Client() as c:
        ds = c.upload_dataset(path, "chat", record_format="chat", wait=True, timeout_s=10)
        assert (ds.state, ds.record_format, ds.documents) == ("ready", "chat", 1)
        assert ds.records_url and ds.records_url.endswith("/records.jsonl")
