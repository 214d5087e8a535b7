"""`megatrain cluster`: each pool's slots, busy and free, in its own words (GPUs, or CPU slots on a
pool without GPUs), and the queue in scheduling order with why each job waits. SDK only."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _out, _user_errors, app
from megatrain.cli.pools import hardware_line
from megatrain.client import Client


def _pool_line(pool: dict[str, Any]) -> str:
    kind = pool.get("slot_kind") or "devices"
    nodes = len(pool.get("nodes", [])) - pool.get("nodes_lost", 0) - pool.get("nodes_quarantined", 0)
    where = f"on {nodes} node" + ("" if nodes == 1 else "s")
    device = "" if pool.get("accelerator") == "cpu" else f" ({escape(str(pool.get('accelerator')))})"
    return (
        f"[bold]{escape(pool['name'])}[/bold]: {pool['slots_total']} {kind}{device} {where}, "
        f"{pool['slots_used']} busy, {pool['slots_free']} free"
    )


@app.command()
@_user_errors
def cluster() -> None:
    """Show the pools (GPUs, or CPU slots on a pool without GPUs) and the queue."""
    out = _out()
    with Client() as client:
        view = client.cluster()
    pools = view.get("pools", [])
    if not pools:
        out.print("no pools yet: start `megatrain up` (or a worker) to register this machine")
    for pool in pools:
        out.print(_pool_line(pool))
        if "hardware" in pool:
            out.print("  " + hardware_line(pool["hardware"], pool.get("described_by")))
        for node in pool.get("nodes", []):
            if node["status"] == "lost":
                out.print(
                    f"  [bold red]node {escape(node['hostname'])} lost[/bold red] (no heartbeat since "
                    f"{escape(str(node['last_seen_at']))}): its slots are not offered"
                )
            elif node["status"] == "quarantined":
                out.print(
                    f"  [bold red]node {escape(node['hostname'])} quarantined[/bold red] "
                    f"({escape(str(node.get('quarantine_reason') or 'repeated failures'))}): its slots "
                    f"are not offered until `megatrain nodes release {escape(node['hostname'])}`"
                )
    queue = view.get("queue", [])
    if not queue:
        out.print("queue: empty")
        return
    table = Table(box=None, header_style="bold")
    for header in ("#", "JOB", "POOL", "SLOTS", "WHY IT WAITS"):
        table.add_column(header, overflow="fold")
    for q in queue:
        job = escape(f"{q['name']} {q['id']}") if q.get("own") else "[dim]another tenant's job[/dim]"
        table.add_row(str(q["position"] or "-"), job, escape(q["pool"]), str(q["slots"]), escape(q["reason"]))
    out.print(table)
