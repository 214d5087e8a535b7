"""The job answer's queue fields (place in the queue, why it waits as data) and a running job's
progress and ETA from its measured step times."""

from __future__ import annotations

from datetime import timedelta

import pytest
from api_handle import Api
from sqlalchemy import update

from megatrain.api.jobs.progress import pace_from
from megatrain.db.jobs import transition
from megatrain.db.models import RUNNING, SCHEDULED, Job, JobMetric, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler


class _Executor:
    def submit(self, job_id: str) -> None:
        pass

    def refresh_nodes(self) -> None:
        pass


def test_queued_jobs_show_their_place_and_reason(api: Api) -> None:
    running = api.submit(api.spec("big", resources={"devices": 4}))["id"]
    second = api.submit(api.spec("next", resources={"devices": 4}))["id"]
    # may run two days: would end after the head's estimated start (a day, the big job's limit)
    third = api.submit(api.spec("after", resources={"devices": 2, "max_runtime_s": 172800}))["id"]
    assert Scheduler(api.settings, _Executor()).schedule_once() == [running]  # type: ignore[arg-type]
    body = api.client.get(f"/v1/jobs/{second}", headers=api.headers).json()
    assert body["queue_position"] == 1
    assert body["wait"]["code"] == "no_free_slots" and body["wait"]["needs"] == 4
    body = api.client.get(f"/v1/jobs/{third}", headers=api.headers).json()
    assert body["queue_position"] == 2
    assert body["wait"]["code"] == "behind_job" and "job_id" not in body["wait"]
    listed = {j["id"]: j for j in api.client.get("/v1/jobs", headers=api.headers).json()["items"]}
    assert listed[third]["queue_position"] == 2 and listed[running]["queue_position"] is None
    assert listed[running]["eta_s"] is None  # scheduled, not running: no pace yet


def test_running_job_eta_from_measured_step_times(api: Api) -> None:
    job_id = api.submit(api.spec("runs", resources={"devices": 1}))["id"]
    assert Scheduler(api.settings, _Executor()).schedule_once() == [job_id]  # type: ignore[arg-type]
    measured_at = utcnow() - timedelta(seconds=30)
    with session_scope(api.db_url) as s:
        assert transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,))
        s.execute(update(Job).where(Job.id == job_id).values(current_step=40, total_steps=140))
        # one slow interval (a checkpoint) among five: the median ignores it
        for step, t in zip((10, 20, 30, 35, 40), (0.5, 0.5, 9.0, 0.4, 0.6), strict=True):
            data = {"step": step, "loss": 1.0, "iter_time_s": t}
            s.add(
                JobMetric(job_id=job_id, kind="train", step=step, loss=1.0, data=data, created_at=measured_at)
            )
    body = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
    assert body["progress"] == pytest.approx(40 / 140)
    assert body["step_time_s"] == pytest.approx(0.5)
    assert body["eta_s"] == pytest.approx(50.0)  # 100 steps left × 0.5 s
    assert body["queue_position"] is None and body["wait"] is None
    listed = api.client.get("/v1/jobs", headers=api.headers).json()["items"]
    assert listed[0]["eta_s"] == pytest.approx(50.0)


def test_pace_from() -> None:
    at = utcnow()
    pace = pace_from([1.0, 3.0, 2.0], 10, 20, at)
    assert pace is not None and (pace.step_time_s, pace.eta_s) == (2.0, 20.0)
    assert pace.eta_at == at + timedelta(seconds=20)
    assert pace_from([], 10, 20, at) is None
    assert pace_from([1.0], 30, 20, at).eta_s == 0.0  # type: ignore[union-attr]
