"""Whether the control plane can hear its nodes at all.

When every ready node of a cluster falls silent at once, the likelier cause is on the control
plane's side (the API restarting or down, its database connections dropped, the network in front of
it) than every node dying in the same second; failing every job over then would throw away all the
cluster's work for nothing. Kubernetes' node lifecycle controller makes the same call: it stops
evicting when a whole zone goes NotReady together. So while no ready node has been heard from for
QUIET_FRACTION of node_lost_after_s (and at least MIN_NODES are ready), the scheduler marks no node
lost and ends no attempt for a missed heartbeat. Half a bound, not a whole one: nodes heartbeat at
different moments, so when a whole cluster falls silent one node crosses the bound up to a heartbeat
interval before the newest; judged by a whole bound, that node would be lost first, and with it
gone the rest no longer count as a cluster (MIN_NODES). While one node alone is silent the others'
heartbeats keep the newest fresh, so the bound judges it as before. Once heartbeats arrive again,
every node and runner is judged from that moment, so each has a full bound to be heard. A definite
verdict (the executor's "that process is gone") still ends an attempt at once. A silence longer
than MAX_DEAF_FACTOR bounds is judged as usual: a cluster that really went dark must not hold its
jobs forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

log = logging.getLogger(__name__)

MIN_NODES = 2
"""One silent node is that node's problem, whatever the size of the cluster."""
QUIET_FRACTION = 0.5
"""How much of the node-lost bound without any heartbeat means the control plane cannot hear."""
MAX_DEAF_FACTOR = 10
"""How many node-lost bounds a cluster-wide silence may last before it is judged node by node."""


@dataclass
class Intake:
    """What one scheduler saw of the heartbeats reaching the database, tick after tick."""

    bound_s: float
    """settings.node_lost_after_s."""
    silent_since: datetime | None = None
    """The newest heartbeat of any ready node when a cluster-wide silence was seen (None: hearing)."""
    resumed_at: datetime | None = None
    """When heartbeats arrived again after the last such silence."""

    def observe(self, newest: datetime | None, ready: int, now: datetime) -> None:
        """One tick's reading: `newest` is the latest last_seen_at of any ready node, `ready` their
        number."""
        quiet = timedelta(seconds=self.bound_s * QUIET_FRACTION)
        silent = ready >= MIN_NODES and newest is not None and now - newest > quiet
        if silent and self.silent_since is None:
            self.silent_since = newest
            log.warning(
                "no heartbeat from any of %d ready nodes for %.0fs: the control plane cannot hear them "
                "(an API or network outage?); no node is judged lost until it can",
                ready, (now - newest).total_seconds(),
            )  # fmt: skip
        elif not silent and self.silent_since is not None:
            self.silent_since, self.resumed_at = None, now
            log.warning("heartbeats arrive again: nodes and runners are judged from now")

    def deaf(self, now: datetime) -> bool:
        """Whether heartbeat-based judgments must wait (a cluster-wide silence, not yet too long)."""
        if self.silent_since is None:
            return False
        return now - self.silent_since <= timedelta(seconds=self.bound_s * MAX_DEAF_FACTOR)

    def heard_from(self, last: datetime | None) -> datetime | None:
        """When something was last heard from, for judging its silence: never before the control
        plane could hear again."""
        if last is None or self.resumed_at is None:
            return last
        return max(last, self.resumed_at)
