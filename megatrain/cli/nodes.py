"""`megatrain nodes release NODE`: lift a node's quarantine (an operator command: it talks to the
database directly, like `megatrain pools`). A node is quarantined after repeated infrastructure
failures (settings.node_quarantine_failures within node_quarantine_window_s); placement skips it
until released."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from megatrain.cli.common import _fail, _out, _server_errors, app
from megatrain.settings import get_settings

nodes_app = typer.Typer(
    help="Nodes (operator commands: they talk to the database directly).", no_args_is_help=True
)
app.add_typer(nodes_app, name="nodes")


@nodes_app.command("release")
@_server_errors
def nodes_release(
    node: Annotated[str, typer.Argument(help="The node's hostname (or its id).")],
    pool: Annotated[
        str | None, typer.Option(help="The node's pool, when several have that hostname.")
    ] = None,
) -> None:
    """Lift a node's quarantine: placement offers it again."""
    from sqlalchemy import or_, select

    from megatrain.db.goodput import release_node
    from megatrain.db.models import QUARANTINED, Node, NodePool
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        q = select(Node.id, Node.hostname, Node.status, NodePool.name).join(NodePool)
        q = q.where(or_(Node.hostname == node, Node.id == node))
        if pool is not None:
            q = q.where(NodePool.name == pool)
        rows = session.execute(q).all()
        if not rows:
            where = f" in pool '{pool}'" if pool else ""
            raise _fail(f"no node '{node}'{where}: `megatrain cluster` lists them")
        if len(rows) > 1:
            pools = ", ".join(sorted(r.name for r in rows))
            raise _fail(f"several nodes are named '{node}' (pools {pools}): name one with --pool")
        (row,) = rows
        if row.status != QUARANTINED:
            raise _fail(f"node '{row.hostname}' is {row.status}, not quarantined: nothing to release")
        release_node(session, row.id)
    _out().print(f"node '{escape(row.hostname)}' released: jobs may be placed on it again")
