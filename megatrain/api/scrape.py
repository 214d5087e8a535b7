"""What /metrics reports of the whole control plane, counted from the database at scrape time, so
every API process and replica answers the same truth: jobs by state, the queue by pool and tenant,
nodes by pool and state, and the live streams (on PostgreSQL every process's stream leases; on the
embedded default, this one process's own streams). A database that does not answer is reported as
`megatrain_database_up 0`, never a failed scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from megatrain.db.models import JOB_STATES, QUEUED, Job, Node, NodePool, Tenant, utcnow
from megatrain.db.session import get_sessionmaker
from megatrain.db.stream_leases import LEASE_TTL_S, StreamLease

FAMILIES = {
    "megatrain_database_up": ("1 when the database answered this scrape", []),
    "megatrain_jobs": ("Jobs by state (all tenants)", ["status"]),
    "megatrain_queued_jobs": ("Queued jobs by pool and tenant", ["pool", "tenant"]),
    "megatrain_nodes": ("Nodes by pool and state (ready, lost, quarantined)", ["pool", "status"]),
    "megatrain_open_streams": ("Live SSE streams (every API process's on PostgreSQL)", []),
}


def _family(name: str) -> GaugeMetricFamily:
    doc, labels = FAMILIES[name]
    return GaugeMetricFamily(name, doc, labels=labels)


class ControlPlaneCollector(Collector):
    def __init__(self, database_url: str, open_streams: Callable[[], int] | None = None):
        self.database_url = database_url
        self.shared_streams = not database_url.startswith("sqlite")
        self.open_streams = open_streams
        """This process's own count, where the streams are not leased in the database."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = _family("megatrain_database_up")
        try:
            with get_sessionmaker(self.database_url)() as session:
                states = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
                queued = session.execute(
                    select(Job.pool, Tenant.name, func.count())
                    .join(Tenant, Tenant.id == Job.tenant_id)
                    .where(Job.status == QUEUED)
                    .group_by(Job.pool, Tenant.name)
                ).all()
                nodes = session.execute(
                    select(NodePool.name, Node.status, func.count())
                    .join(NodePool, NodePool.id == Node.pool_id)
                    .group_by(NodePool.name, Node.status)
                ).all()
                leases = None
                if self.shared_streams:
                    live = utcnow() - timedelta(seconds=LEASE_TTL_S)
                    leases = session.scalar(
                        select(func.count()).select_from(StreamLease).where(StreamLease.seen_at >= live)
                    )
        except SQLAlchemyError:
            up.add_metric([], 0.0)  # a scrape still answers, and says the database is down
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        jobs = _family("megatrain_jobs")
        for status in JOB_STATES:
            jobs.add_metric([status], float(states.get(status, 0)))
        yield jobs
        queue = _family("megatrain_queued_jobs")
        for pool, tenant, n in queued:
            queue.add_metric([pool, tenant], float(n))
        yield queue
        by_state = _family("megatrain_nodes")
        for pool, status, n in nodes:
            by_state.add_metric([pool, status], float(n))
        yield by_state
        streams = leases if leases is not None else (self.open_streams() if self.open_streams else None)
        if streams is not None:
            gauge = _family("megatrain_open_streams")
            gauge.add_metric([], float(streams))
            yield gauge

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Without describe() registering would call collect(), i.e. query the database at startup.
        for name in FAMILIES:
            yield _family(name)
