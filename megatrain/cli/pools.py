"""`megatrain pools apply|list|show`: describe node pools (operator commands: they talk to the
database directly, like `megatrain tenants`). A pool file holds one PoolSpec mapping or a list:

    name: h100
    accelerator: NVIDIA H100 80GB HBM3
    device_memory_bytes: 85899345920
    peak_tflops: {bf16: 989, fp8: 1979, fp32: 67}
    devices_per_node: 8
    nodes: 16
    intra_node_bandwidth_gbps: 450
    inter_node_bandwidth_gbps: 50
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _server_errors, app
from megatrain.settings import get_settings

pools_app = typer.Typer(
    help="Node pools' hardware (operator commands: they talk to the database directly).",
    no_args_is_help=True,
)
app.add_typer(pools_app, name="pools")

GIB = 1 << 30


def hardware_line(spec: dict[str, Any] | None, described_by: str | None) -> str:
    """One line of a pool's described hardware (rich markup), or why there is none."""
    if spec is None:
        return "[dim]hardware: not described yet (`megatrain pools apply`, or a worker measures it)[/dim]"
    peaks = ", ".join(f"{p} {v:,.4g}" for p, v in spec["peak_tflops"].items())
    return (
        f"hardware ({escape(str(described_by))}): {spec['devices_per_node']} × "
        f"{escape(spec['accelerator'])} per node × {spec['nodes']} node{'s' * (spec['nodes'] != 1)}, "
        f"{spec['device_memory_bytes'] / GIB:,.1f} GiB per device, peak TFLOP/s {peaks}; "
        f"links {spec['intra_node_bandwidth_gbps']:g} GB/s {spec['intra_node_latency_us']:g} µs inside a "
        f"node, {spec['inter_node_bandwidth_gbps']:g} GB/s {spec['inter_node_latency_us']:g} µs across"
    )


def node_status(node: dict[str, Any]) -> str:
    if node["status"] == "lost":
        return "[bold red]lost[/bold red]"
    health = node.get("health") or {}
    if health.get("problems"):
        return f"[yellow]{escape(node['status'])}: {escape('; '.join(health['problems']))}[/yellow]"
    return f"[green]{escape(node['status'])}[/green]"


def _nodes_table(nodes: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold")
    for header in ("NODE", "STATUS", "DEVICES", "FREE", "MEMORY FREE", "LAST SEEN"):
        table.add_column(header, overflow="fold")
    for n in nodes:
        memory = "-" if n["memory_free_bytes"] is None else f"{n['memory_free_bytes'] / GIB:,.1f} GiB"
        ago = "-" if n["seen_s_ago"] is None else f"{n['seen_s_ago']:,.0f}s ago"
        table.add_row(
            escape(n["hostname"]), node_status(n), str(n["devices"]), str(n["devices_free"]), memory, ago
        )
    return table


def _views() -> list[dict[str, Any]]:
    from megatrain.db.session import session_scope, upgrade_database
    from megatrain.scheduler.pools import pools_view

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        return pools_view(session)


@pools_app.command("apply")
@_server_errors
def pools_apply(
    files: Annotated[list[Path], typer.Argument(help="YAML files, each one pool or a list of pools.")],
) -> None:
    """Describe pools (created if new); an operator's description replaces a measured one."""
    from megatrain.db.session import session_scope, upgrade_database
    from megatrain.scheduler.pools import apply_pool, load_pools
    from megatrain.spec_errors import SpecError

    specs = []
    for path in files:
        try:
            specs += load_pools(path)
        except SpecError as exc:
            lines = "\n".join(f"  {e['field']}: {e['message']}" for e in exc.errors)
            raise _fail(f"invalid pool file {path}:\n{lines}") from None
    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        done = [(spec.name, apply_pool(session, spec)[1]) for spec in specs]
    for name, created in done:
        _out().print(f"pool '{escape(name)}' {'created' if created else 'described'}")


@pools_app.command("list")
@_server_errors
def pools_list() -> None:
    """Each pool: its hardware and its nodes, ready and lost."""
    out = _out()
    views = _views()
    if not views:
        out.print("no pools yet: `megatrain pools apply POOL.yaml`, or start a worker")
    for v in views:
        lost = f", [bold red]{v['nodes_lost']} lost[/bold red]" if v["nodes_lost"] else ""
        out.print(
            f"[bold]{escape(v['name'])}[/bold]: {v['nodes_ready']} node{'s' * (v['nodes_ready'] != 1)} "
            f"ready{lost}, {v['devices_free']} of {v['devices_total']} devices free"
        )
        out.print("  " + hardware_line(v["spec"], v["described_by"]))


@pools_app.command("show")
@_server_errors
def pools_show(name: Annotated[str, typer.Argument(help="The pool's name.")]) -> None:
    """One pool: its described hardware and each node's state."""
    view = next((v for v in _views() if v["name"] == name), None)
    if view is None:
        raise _fail(f"pool {name!r} does not exist (`megatrain pools list` shows those that do)")
    out = _out()
    out.print(f"[bold]{escape(view['name'])}[/bold]")
    out.print(hardware_line(view["spec"], view["described_by"]))
    if view["nodes"]:
        out.print(_nodes_table(view["nodes"]))
    else:
        out.print("no nodes yet")
