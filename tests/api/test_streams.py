"""Events, metrics and logs of a job: JSON lists, and Server-Sent Events that follow new rows until
the job ends."""

from __future__ import annotations

import threading
import time
from typing import Any

from api_handle import Api, parse_sse

from megatrain.db.jobs import transition
from megatrain.db.models import CANCELLED, QUEUED, JobLog, JobMetric
from megatrain.db.session import session_scope


def _train_row(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 10.0 / step, "lr": 3e-4, "grad_norm": 1.5, "tokens_per_s": 1234.5,
            "tflops_per_device": 0.1, "mfu": 0.05, "peak_memory_bytes": 1 << 20, "iter_time_s": 0.2,
            "consumed_samples": step * 8, "time": 1700000000.0 + step}  # fmt: skip


def add_metrics(api: Api, job_id: str, steps: list[int], val_steps: tuple[int, ...] = ()) -> None:
    with session_scope(api.db_url) as s:
        for step in steps:
            row = _train_row(step)
            s.add(JobMetric(job_id=job_id, kind="train", step=step, loss=row["loss"], data=row))
            if step in val_steps:
                val = {"step": step, "val_loss": 5.0 / step, "time": 1700000000.5 + step}
                s.add(JobMetric(job_id=job_id, kind="val", step=step, loss=val["val_loss"], data=val))


def finish(api: Api, job_id: str) -> None:
    with session_scope(api.db_url) as s:
        assert transition(s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="test over")


def later(delay_s: float, fn: Any, *args: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        fn(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_metrics_json(api: Api) -> None:
    job_id = api.submit()["id"]
    assert api.client.get(f"/v1/jobs/{job_id}/metrics", headers=api.headers).json() == []
    add_metrics(api, job_id, [10, 20, 30], val_steps=(20,))
    rows = api.client.get(f"/v1/jobs/{job_id}/metrics", headers=api.headers).json()
    assert [(r["step"], r["kind"]) for r in rows] == [
        (10, "train"),
        (20, "train"),
        (20, "val"),
        (30, "train"),
    ]
    assert rows[0] == {**_train_row(10), "kind": "train"}
    assert rows[2] == {"step": 20, "val_loss": 0.25, "time": 1700000020.5, "kind": "val"}
    since = api.client.get(f"/v1/jobs/{job_id}/metrics?since_step=10&kind=train", headers=api.headers).json()
    assert [r["step"] for r in since] == [20, 30]
    bad = api.client.get(f"/v1/jobs/{job_id}/metrics?kind=test", headers=api.headers)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "kind"


def test_metrics_sse_follows_until_the_job_ends(api: Api) -> None:
    job_id = api.submit()["id"]
    add_metrics(api, job_id, [10, 20], val_steps=(20,))
    # While the stream is open: a new row arrives, then the job ends.
    writer = later(0.3, lambda: (add_metrics(api, job_id, [30]), time.sleep(0.2), finish(api, job_id)))
    resp = api.client.get(
        f"/v1/jobs/{job_id}/metrics", headers={**api.headers, "Accept": "text/event-stream"}
    )
    writer.join()
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(resp.text)
    rows, end = events[:-1], events[-1]
    assert [(e["data"]["step"], e["data"]["kind"]) for e in rows] == [
        (10, "train"), (20, "train"), (20, "val"), (30, "train")
    ]  # fmt: skip
    assert [e["id"] for e in rows] == ["10", "20", "20", "30"]
    assert rows[-1]["data"]["loss"] == 10.0 / 30
    assert end["event"] == "end" and end["data"] == {"status": "cancelled"}

    # Reconnecting with Last-Event-ID resumes after that step; the job is over, so it ends at once.
    resumed = api.client.get(
        f"/v1/jobs/{job_id}/metrics",
        headers={**api.headers, "Accept": "text/event-stream", "Last-Event-ID": "20"},
    )
    assert [(e["event"], e["data"].get("step")) for e in parse_sse(resumed.text)] == [
        ("message", 30), ("end", None)
    ]  # fmt: skip
    only_val = api.client.get(
        f"/v1/jobs/{job_id}/metrics?kind=val", headers={**api.headers, "Accept": "text/event-stream"}
    )
    assert [e["data"].get("val_loss") for e in parse_sse(only_val.text)] == [0.25, None]


def test_logs_json_and_follow(api: Api) -> None:
    job_id = api.submit()["id"]
    with session_scope(api.db_url) as s:
        s.add_all(JobLog(job_id=job_id, seq=i, line=f"line {i}") for i in range(1, 6))
    page = api.client.get(f"/v1/jobs/{job_id}/logs?after_seq=2&limit=2", headers=api.headers).json()
    assert [(ln["seq"], ln["line"]) for ln in page] == [(3, "line 3"), (4, "line 4")]
    assert set(page[0]) == {"seq", "line", "created_at"}

    def more_then_end() -> None:
        with session_scope(api.db_url) as s:
            s.add(JobLog(job_id=job_id, seq=6, line="line 6"))
        time.sleep(0.1)
        finish(api, job_id)

    writer = later(0.3, more_then_end)
    resp = api.client.get(f"/v1/jobs/{job_id}/logs?after_seq=3&follow=true", headers=api.headers)
    writer.join()
    events = parse_sse(resp.text)
    assert [(e["id"], e["data"]["line"]) for e in events[:-1]] == [
        ("4", "line 4"),
        ("5", "line 5"),
        ("6", "line 6"),
    ]
    assert events[-1]["event"] == "end"
    resumed = api.client.get(
        f"/v1/jobs/{job_id}/logs",
        headers={**api.headers, "Accept": "text/event-stream", "Last-Event-ID": "5"},
    )
    assert [e["data"].get("seq") for e in parse_sse(resumed.text)] == [6, None]


def test_events_list_transitions(api: Api) -> None:
    job_id = api.submit()["id"]
    api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.headers)
    events = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers).json()
    assert [(e["kind"], e["from_status"], e["to_status"]) for e in events] == [
        ("queued", None, "queued"),
        ("cancelled", "queued", "cancelled"),
    ]
    assert set(events[0]) == {"id", "kind", "from_status", "to_status", "reason", "data", "created_at"}
