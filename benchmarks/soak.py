"""The soak: a stream of small training jobs from three tenants on a production-shaped cluster on this
machine (benchmarks/_soak_cluster.py: `megatrain api` x2 processes, `megatrain scheduler`, two
`megatrain worker` nodes that hold only a node token, PostgreSQL, Redis/Celery, S3 on moto's
server with a share of the nodes' requests answered 503), with a fault every
`--fault-every` seconds, then what it kept (benchmarks/_soak_report.py): goodput from the ledger,
steps recomputed past the last checkpoint, jobs succeeded or failed and why, rows lost or doubled,
and the time from each fault to the first step of the attempt that resumed after it.

The faults take turns (megatrain.faults names the in-engine ones; these are applied from outside, as
they happen): kill_rank (SIGKILL a running job's rank), stop_rank (SIGSTOP: frozen, the hang watch
must end it), restart_api (SIGKILL both API processes, start them again), kill_node (SIGKILL a
node's worker with its runners and engines, back after --node-down-s), corrupt_checkpoint (flip a
bit in a running job's latest checkpoint, then kill its rank: the resume must fall back to the one
before), drop_db (terminate every database connection of the cluster's processes), silence (cut a
running job's node from the API for --silence-s: past the node-lost bound its attempt fails over,
below it the node's reports arrive once each after), storage_outage (cut that node from S3 for
--storage-outage-s: the S3 clients' retries must ride it out).

    python benchmarks/soak.py                               # an hour, a fault every ~3 min
    python benchmarks/soak.py --minutes 5 --fault-every 30 --silence-s 10  # the CI version's shape
    python benchmarks/soak.py --executor slurm              # the same on a real single-host Slurm

With `--executor slurm` the nodes are Slurm's (as root: slurmd runs jobs as their submitter) and
kill_node sets a node DOWN under its jobs (Slurm ends them: NODE_FAIL), then RESUMEs it.

Targets: 0 rows lost, 0 doubled, every job succeeded, goodput >= 90% with a checkpoint every
minute, every resume <= 60 s. `--json PATH` writes the summary; exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from _soak_cluster import TENANTS, Cluster
from _soak_report import Fault, collect, summarize, table

ROTATION = ("kill_rank", "restart_api", "stop_rank", "drop_db", "corrupt_checkpoint", "kill_node",
            "silence", "storage_outage")  # fmt: skip
UNFINISHED = ("queued", "scheduled", "running", "paused")


def job_spec(data_uri: str, iters: int, checkpoint_interval: int, log_interval: int) -> dict[str, Any]:
    return {
        "name": "soak",
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": 64},
        "data": {"train": [{"path": data_uri}], "split": "98,2,0"},
        "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 4,
                     "precision": "fp32", "log_interval": log_interval,
                     "checkpoint_interval": checkpoint_interval, "eval_interval": 0, "warmup_iters": 0},
        "resources": {"devices": 1, "max_retries": 20},
    }  # fmt: skip


def write_corpus(path: Path) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "step", "loss", "node", "rank", "shard", "token"]
    with open(path, "w") as f:
        for i in range(2000):
            text = " ".join(rng.choice(words) for _ in range(40))
            f.write(json.dumps({"text": f"{i}: {text}"}) + "\n")


def _stepped_this_attempt(session: Any, job_id: str) -> bool:
    """Whether the job logged a step since its latest attempt started."""
    from sqlalchemy import func, select

    from megatrain.db.models import JobEvent, JobLog

    started = session.scalar(
        select(func.max(JobEvent.created_at)).where(JobEvent.job_id == job_id, JobEvent.kind == "started")
    )
    if started is None:
        return False
    step = select(JobLog.seq).where(
        JobLog.job_id == job_id, JobLog.created_at >= started, JobLog.line.contains(" | loss ")
    )
    return session.scalar(step.limit(1)) is not None


def say(start: float, what: str) -> None:
    print(f"{time.monotonic() - start:7.1f} s  {what}", flush=True)


class Driver:
    def __init__(self, cluster: Cluster, args: argparse.Namespace):
        self.cluster, self.args = cluster, args
        corpus = cluster.home / "data" / "corpus.jsonl"
        write_corpus(corpus)
        self.spec = job_spec(corpus.as_uri(), args.iters, args.checkpoint_interval, args.log_interval)
        self.jobs: list[str] = []
        self.faults: list[Fault] = []
        self.tenants = itertools.cycle(TENANTS)
        self.submitted = 0

    def unfinished(self) -> int:
        from sqlalchemy import func, select

        from megatrain.db.models import Job

        with self.cluster.session() as s:
            return int(
                s.scalar(select(func.count()).where(Job.id.in_(self.jobs), Job.status.in_(UNFINISHED)))
            )

    def submit(self) -> None:
        """One job from the next tenant; an idempotency key makes a retry through an API restart safe."""
        tenant = next(self.tenants)
        key = f"soak-{self.submitted}"
        headers = {"Authorization": f"Bearer {self.cluster.keys[tenant]}", "Idempotency-Key": key}
        for _ in range(60):
            try:
                resp = httpx.post(
                    f"{self.cluster.api_url}/v1/jobs", json=self.spec, headers=headers, timeout=30
                )
            except httpx.HTTPError:
                time.sleep(1)
                continue
            if resp.status_code >= 500:
                time.sleep(1)
                continue
            resp.raise_for_status()
            self.jobs.append(resp.json()["id"])
            self.submitted += 1
            return
        raise RuntimeError("the API took no job for a minute")

    def running_target(self, with_checkpoint: bool = False) -> tuple[str, int, str] | None:
        """(job, attempt, node) of a running job that has stepped in its current attempt (and, if
        asked, checkpointed) and has steps left, chosen at random. A job still resuming from the last
        fault is not hit again: its resume would be timed with the second fault's delay in it."""
        from sqlalchemy import select

        from megatrain.db.models import Checkpoint, Job, Node

        q = (
            select(Job.id, Job.attempt, Node.hostname)
            .join(Node, Node.id == Job.node_id)
            .where(Job.id.in_(self.jobs), Job.status == "running", Job.current_step > 0)
            .where(Job.current_step < Job.total_steps)
        )
        if with_checkpoint:
            q = q.where(select(Checkpoint.id).where(Checkpoint.job_id == Job.id).exists())
        with self.cluster.session() as s:
            rows = s.execute(q).all()
            rows = [r for r in rows if self.cluster.engine_pid(r[2], r[0], r[1]) is not None]
            rows = [r for r in rows if _stepped_this_attempt(s, r[0])]
        return tuple(random.choice(rows)) if rows else None  # type: ignore[return-value]

    def running_on(self, node: str) -> list[str]:
        """The soak's jobs placed or running on `node` now."""
        from sqlalchemy import select

        from megatrain.db.models import Job, Node

        with self.cluster.session() as s:
            return list(
                s.scalars(
                    select(Job.id)
                    .join(Node, Node.id == Job.node_id)
                    .where(Job.id.in_(self.jobs), Job.status.in_(("scheduled", "running")))
                    .where(Node.hostname == node)
                )
            )

    def apply(self, kind: str) -> Fault | None:
        now = datetime.now(UTC)
        if kind == "restart_api":
            self.cluster.restart("api", down_s=1.0)
            return Fault(kind, now)
        if kind == "drop_db":
            return Fault(kind, now, detail=f"{self.cluster.drop_connections()} connections")
        target = self.running_target(with_checkpoint=kind == "corrupt_checkpoint")
        if target is None:
            return None
        job_id, attempt, node = target
        fault = Fault(kind, now, job_id, attempt, node)
        if kind in ("silence", "storage_outage"):
            fault.window_s = self.args.silence_s if kind == "silence" else self.args.storage_outage_s
            self.cluster.cut(node, "api" if kind == "silence" else "s3", fault.window_s)
            fault.detail = f"{node} cut for {fault.window_s:g} s"
            return fault
        if kind == "kill_node":
            on_slurm = self.cluster.slurm_node(job_id)
            if self.cluster.slurm is not None and on_slurm is None:
                return None  # Slurm has not said where it runs yet: a little later
            node, there = on_slurm or (node, len(self.running_on(node)))
            fault.node, fault.bystanders = node, max(0, there - 1)
            self.cluster.kill_node(node, self.args.node_down_s)
            return fault
        if kind == "corrupt_checkpoint":
            fault.detail = self._corrupt_latest(job_id) or "its checkpoint is gone"
        pid = self.cluster.engine_pid(node, job_id, attempt)
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGSTOP if kind == "stop_rank" else signal.SIGKILL)
        except ProcessLookupError:
            return None
        return fault

    def _owed(self, start: float) -> bool:
        """With --every-kind, whether a kind has not fired yet (for at most --minutes more): a slow
        host starts jobs late, and a fault waits for a job to hit."""
        if not self.args.every_kind or time.monotonic() > start + 2 * self.args.minutes * 60:
            return False
        return bool(set(self.args.faults) - {f.kind for f in self.faults})

    def _corrupt_latest(self, job_id: str) -> str | None:
        from sqlalchemy import select

        from megatrain.db.models import Checkpoint
        from megatrain.faults import corrupt_checkpoint
        from megatrain.storage import open_store

        with self.cluster.session() as s:
            row = s.scalars(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id)
                .order_by(Checkpoint.step.desc())
                .limit(1)
            ).first()
            uri, step = (row.uri, row.step) if row else (None, None)
        if uri is None:
            return None
        return f"step {step}: {corrupt_checkpoint(open_store(uri))}"

    def run(self) -> float:
        args, start = self.args, time.monotonic()
        end = start + args.minutes * 60
        next_fault = start + args.fault_every * 0.5
        kinds = itertools.cycle(args.faults)
        kind = next(kinds)
        while time.monotonic() < end or self._owed(start):
            while self.unfinished() < self.cluster.slots:
                self.submit()
            if time.monotonic() >= next_fault:
                fault = self.apply(kind)
                if fault is None:
                    next_fault += 5  # nothing to hit yet: the same fault a little later
                else:
                    self.faults.append(fault)
                    say(start, f"{fault.kind} {fault.job_id or ''} {fault.detail}")
                    kind = next(kinds)
                    next_fault += args.fault_every * random.uniform(0.8, 1.2)
            time.sleep(1.0)
        say(start, f"no more jobs or faults; waiting for {self.unfinished()} jobs")
        drain_end = time.monotonic() + args.drain_minutes * 60
        while self.unfinished() and time.monotonic() < drain_end:
            time.sleep(2.0)
        return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="how long jobs and faults keep coming")
    p.add_argument("--fault-every", type=float, default=180.0, help="seconds between faults (+-20%%)")
    p.add_argument("--faults", default=",".join(ROTATION), help="the fault kinds, in turn")
    p.add_argument("--iters", type=int, default=27000, help="steps per job (~3 min here)")
    p.add_argument("--checkpoint-interval", type=int, default=9000, help="~1 min here")
    p.add_argument("--log-interval", type=int, default=300)
    p.add_argument("--node-down-s", type=float, default=10.0, help="how long a killed node stays down")
    p.add_argument(
        "--silence-s",
        type=float,
        default=30.0,
        help="how long `silence` cuts a node from the API (the node-lost bound is 20 s)",
    )
    p.add_argument(
        "--storage-outage-s", type=float, default=10.0, help="how long `storage_outage` cuts a node from S3"
    )
    p.add_argument("--storage", choices=("s3", "file"), default="s3")
    p.add_argument(
        "--executor", choices=("celery", "slurm"), default="celery", help="worker nodes, or a real Slurm"
    )
    p.add_argument(
        "--storage-error-rate",
        type=float,
        default=0.02,
        help="the share of the nodes' S3 requests answered 503 throughout",
    )
    p.add_argument("--hang-min-s", type=float, default=15.0, help="the nodes' MEGATRAIN_HANG_MIN_S")
    p.add_argument(
        "--every-kind",
        action="store_true",
        help="go on past --minutes (at most as long again) until each fault kind fired",
    )
    p.add_argument("--drain-minutes", type=float, default=15.0, help="how long to wait for the last jobs")
    p.add_argument(
        "--home", type=Path, default=None, help="keep the cluster's files here (default: a temp dir)"
    )
    p.add_argument("--redis-db", type=int, default=13, help="the broker's Redis database (emptied)")
    p.add_argument("--keep", action="store_true", help="keep the database schema and the files")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--goodput-target", type=float, default=0.90)
    p.add_argument("--resume-target-s", type=float, default=60.0)
    args = p.parse_args(argv)
    args.faults = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = set(args.faults) - set(ROTATION)
    if unknown:
        p.error(f"--faults: unknown {sorted(unknown)} (known: {', '.join(ROTATION)})")
    if args.storage == "file" and "storage_outage" in args.faults:
        p.error("--faults: storage_outage needs --storage s3")
    home = args.home or Path(tempfile.mkdtemp(prefix="megatrain-soak-"))
    cluster = Cluster(
        home,
        redis_db=args.redis_db,
        hang_min_s=args.hang_min_s,
        storage=args.storage,
        storage_error_rate=args.storage_error_rate if args.storage == "s3" else 0.0,
        executor=args.executor,
    )
    # A soak stopped by `timeout` or kill (SIGTERM) still takes its cluster down, Slurm's jobs too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        cluster.create()
        cluster.start()
        print(f"soak cluster up: {cluster.describe()}", flush=True)
        driver = Driver(cluster, args)
        wall = driver.run()
        results = collect(cluster, driver.jobs, driver.faults, args.log_interval)
    finally:
        cluster.stop(keep=args.keep)
    summary = summarize(results, driver.faults, wall)
    summary["storage"] = {"url": cluster.storage_url, "error_rate": cluster.storage_error_rate}
    summary["executor"], summary["nodes"] = args.executor, list(cluster.nodes)
    print(table(results, summary))
    missed = targets_missed(summary, args)
    summary["targets_missed"] = missed
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    print("targets: " + ("all held" if not missed else "MISSED " + "; ".join(missed)))
    return 1 if missed else 0


def targets_missed(s: dict[str, Any], args: argparse.Namespace) -> list[str]:
    missed = []
    if s["lost"] or s["doubled"]:
        missed.append(f"rows lost {s['lost']}, doubled {s['doubled']} (target 0)")
    if s["succeeded"] != s["jobs"] or not s["jobs"]:
        missed.append(f"{s['succeeded']} of {s['jobs']} jobs succeeded")
    if s["problems"]:
        missed.append(f"problems {s['problems']}")
    if s["running_goodput"] is None or s["running_goodput"] < args.goodput_target:
        missed.append(f"goodput {s['running_goodput']} < {args.goodput_target}")
    if s["resume_s_max"] is not None and s["resume_s_max"] > args.resume_target_s:
        missed.append(f"slowest resume {s['resume_s_max']} s > {args.resume_target_s} s")
    if s["resumes_missing"]:
        missed.append(f"{s['resumes_missing']} attempt-ending faults without a resume")
    return missed


if __name__ == "__main__":
    sys.exit(main())
