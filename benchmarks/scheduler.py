"""Scheduling decisions per second: `placement.place` over a whole simulated queue.

A pool of N nodes with D devices each starts partly busy (running jobs with known expected ends,
so the head job's start is estimated and backfill is tried); J queued jobs from T tenants (some with
device quotas) ask for 1 to 4·D devices in whole tp×cp groups, at a few priorities, with runtimes
from minutes to days. One `place()` call decides every queued job (one decision each: placed, or
waiting with its reason and place in the queue), as one scheduler tick does; it is timed over
several repeats and the median reported. Pure: no database.

    python benchmarks/scheduler.py                      # 10,000 jobs on 1,000 nodes, both executors
    python benchmarks/scheduler.py --jobs 1000 --nodes 100 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.scheduler.placement import NodeRoom, QueuedJob, TenantRoom, place  # noqa: E402


def cluster(nodes: int, devices: int, busy_fraction: float, rng: random.Random) -> list[NodeRoom]:
    """Nodes partly held by running jobs, each expected to end within a day."""
    out = []
    for i in range(nodes):
        busy = rng.choice([0, devices // 2, devices, devices]) if rng.random() < busy_fraction else 0
        releases = ((rng.uniform(60, 86400), busy),) if busy else ()
        out.append(
            NodeRoom(f"node-{i}", f"host-{i:05d}", devices, devices - busy, frozenset(range(busy)), releases)
        )
    return out


def queue(jobs: int, tenants: int, devices: int, rng: random.Random) -> list[QueuedJob]:
    """Jobs in (priority, FIFO) order, as the scheduler's query returns them."""
    sizes = [1, 1, 2, 2, 4, devices, devices, 2 * devices, 4 * devices]
    out = []
    for i in range(jobs):
        n = rng.choice(sizes)
        group = rng.choice([g for g in (1, 2, 4, 8) if n % g == 0 and g <= devices])
        runtime = rng.choice([600.0, 3600.0, 4 * 3600.0, 86400.0, 3 * 86400.0])
        expected = runtime * rng.uniform(0.2, 1.0) if rng.random() < 0.3 else None
        tenant = f"tenant-{rng.randrange(tenants)}"
        priority = rng.choice([0, 0, 0, 1, 2, 5])
        out.append(QueuedJob(f"job-{i:06d}", "default", n, tenant=tenant, priority=priority, group=group,
                             max_runtime_s=runtime, expected_runtime_s=expected))  # fmt: skip
    out.sort(key=lambda q: -q.priority)  # stable: FIFO (the index) within a priority
    return out


def tenants_of(tenants: int, rng: random.Random) -> dict[str, TenantRoom]:
    return {
        f"tenant-{t}": TenantRoom(used=rng.randrange(0, 64), quota=rng.choice([None, None, 256, 1024]))
        for t in range(tenants)
    }


def measure(args: argparse.Namespace, multi_node: bool) -> dict[str, object]:
    rng = random.Random(args.seed)
    pools = {"default": cluster(args.nodes, args.devices, args.busy, rng)}
    jobs = queue(args.jobs, args.tenants, args.devices, rng)
    tenants = tenants_of(args.tenants, rng)
    times = []
    decisions = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        decisions = place(jobs, pools, tenants, multi_node=multi_node)
        times.append(time.perf_counter() - t0)
    tick = statistics.median(times)
    outcome = Counter("placed" if d.placements else d.wait.code for d in decisions if d.placements or d.wait)
    gangs = sum(1 for d in decisions if len(d.placements) > 1)
    return {
        "executor": "multi-node" if multi_node else "single-node",
        "jobs": len(jobs),
        "nodes": args.nodes,
        "decisions_per_s": len(decisions) / tick,
        "ms_per_tick": tick * 1e3,
        "placed": outcome["placed"],
        "gangs": gangs,
        "outcome": dict(outcome),
    }


def measure_db(args: argparse.Namespace, url: str) -> dict[str, float]:
    """The same queue and nodes in a database: one tick's snapshot read plus place(), as the
    scheduling loop does it (no reservation: every decision is timed, none is applied)."""
    from datetime import timedelta

    from megatrain.db.models import Job, Node, NodePool, Tenant, new_id, utcnow
    from megatrain.db.session import session_scope, upgrade_database
    from megatrain.scheduler.snapshot import read_snapshot

    rng = random.Random(args.seed)
    nodes = cluster(args.nodes, args.devices, 0.0, rng)  # room only: running jobs are not seeded
    jobs = queue(args.jobs, args.tenants, args.devices, rng)
    upgrade_database(url)
    now = utcnow()
    with session_scope(url) as s:
        pool = NodePool(name="default", accelerator="bench")
        s.add(pool)
        s.flush()
        s.add_all(Node(id=n.id, pool_id=pool.id, hostname=n.hostname, slots_total=n.total) for n in nodes)
        tenants = {f"tenant-{t}": new_id("ten") for t in range(args.tenants)}
        s.add_all(
            Tenant(id=i, name=name, max_devices=rng.choice([None, 1024])) for name, i in tenants.items()
        )
        s.flush()
        s.add_all(
            Job(
                id=q.id, tenant_id=tenants[q.tenant], name=q.id, kind="pretrain", spec={"resources": {
                    "max_runtime_s": q.max_runtime_s}}, spec_hash="x", priority=q.priority, pool="default",
                layout={"tp": q.group, "cp": 1}, num_procs=q.num_procs, created_at=now - timedelta(seconds=i),
            )
            for i, q in enumerate(jobs)
        )  # fmt: skip
    read_s, place_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with session_scope(url) as s:
            snap = read_snapshot(s, utcnow())
        t1 = time.perf_counter()
        place(snap.queue, snap.pools, snap.tenants)
        read_s.append(t1 - t0)
        place_s.append(time.perf_counter() - t1)
    return {"snapshot_ms": statistics.median(read_s) * 1e3, "place_ms": statistics.median(place_s) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--devices", type=int, default=8, help="devices per node")
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--busy", type=float, default=0.6, help="fraction of nodes with running jobs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--db", metavar="URL", help="also time a tick's snapshot read from this (empty) database"
    )
    args = parser.parse_args(argv)
    for name in ("jobs", "nodes", "devices", "tenants", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.busy <= 1.0:
        parser.error(f"--busy must be in [0, 1], got {args.busy}")
    rows = [measure(args, multi_node) for multi_node in (False, True)]
    head = ("executor", "jobs", "nodes", "decisions/s", "ms/tick", "placed", "gangs")
    print(f"{head[0]:<12} {head[1]:>7} {head[2]:>6} {head[3]:>12} {head[4]:>9} {head[5]:>7} {head[6]:>6}")
    for r in rows:
        print(
            f"{r['executor']:<12} {r['jobs']:>7,} {r['nodes']:>6,} {r['decisions_per_s']:>12,.0f} "
            f"{r['ms_per_tick']:>9,.1f} {r['placed']:>7,} {r['gangs']:>6,}"
        )
    for r in rows:
        waits = ", ".join(f"{k} {v:,}" for k, v in sorted(r["outcome"].items()) if k != "placed")  # type: ignore[union-attr]
        print(f"  {r['executor']}: waiting: {waits}")
    if args.db:
        r = measure_db(args, args.db)
        tick = r["snapshot_ms"] + r["place_ms"]
        print(
            f"database tick ({args.db.split(':')[0]}): snapshot {r['snapshot_ms']:,.0f} ms + place "
            f"{r['place_ms']:,.0f} ms = {tick:,.0f} ms for {args.jobs:,} queued jobs "
            f"({args.jobs / tick * 1e3:,.0f} decisions/s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
