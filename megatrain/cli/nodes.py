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


token_app = typer.Typer(
    help="Node tokens: how a node's worker reaches the control plane through the API alone.",
    no_args_is_help=True,
)
nodes_app.add_typer(token_app, name="token")


@token_app.command("create")
@_server_errors
def token_create(
    pool: Annotated[str, typer.Argument(help="The pool the node belongs to (created if new).")],
    node: Annotated[
        str | None,
        typer.Option(help="The node's name (MEGATRAIN_NODE_NAME there); default: the first that registers."),
    ] = None,
) -> None:
    """Create a node's token, shown once: give it to the node as MEGATRAIN_NODE_TOKEN, with
    MEGATRAIN_API_URL, and it needs no database URL. It reports for that node's attempts only."""
    from megatrain.db.audit import as_operator
    from megatrain.db.node_tokens import create_node_token
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        row, token = create_node_token(as_operator(session), pool, node)
        token_id = row.id
    bound = f"node '{escape(node)}'" if node else "the first node that registers with it"
    _out().print(f"node token {token_id} for {bound} of pool '{escape(pool)}' (shown once):", highlight=False)
    print(token)


@token_app.command("list")
@_server_errors
def token_list() -> None:
    """Every node token: its id, pool, node (or an attempt token's job), first characters, last use,
    and whether it is revoked."""
    from rich.table import Table
    from sqlalchemy import select

    from megatrain.db.models import NodePool
    from megatrain.db.node_tokens import NodeToken
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    table = Table("id", "pool", "node", "prefix", "created", "last used", "revoked")
    with session_scope(settings.resolved_database_url) as session:
        q = select(NodeToken, NodePool.name).join(NodePool).order_by(NodeToken.created_at)
        for row, pool in session.execute(q).all():
            when = [
                f"{t:%Y-%m-%d %H:%M}" if t else "" for t in (row.created_at, row.last_used_at, row.revoked_at)
            ]
            # An attempt token (minted per attempt by the local and Slurm executors) speaks for a job.
            node = row.node_name or (f"(job {row.job_id})" if row.job_id else "(unbound)")
            table.add_row(row.id, escape(pool), escape(node), row.prefix + "…", *when)
    _out().print(table)


@token_app.command("revoke")
@_server_errors
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (`megatrain nodes token list`).")],
) -> None:
    """Revoke a node token: from now on the API refuses its reports (its runners stop their engines)."""
    from megatrain.db.audit import as_operator
    from megatrain.db.models import utcnow
    from megatrain.db.node_tokens import NodeToken
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        row = as_operator(session).get(NodeToken, token_id)
        if row is None:
            raise _fail(f"no node token '{token_id}': `megatrain nodes token list` lists them")
        if row.revoked_at is not None:
            raise _fail(f"node token '{token_id}' was revoked already")
        row.revoked_at = utcnow()
    _out().print(f"node token {token_id} revoked")
