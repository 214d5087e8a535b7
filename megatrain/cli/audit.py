"""`megatrain audit`: the operator's view of the audit log (db.audit), read from the control plane's
database: who created, cancelled, deleted, shared or exported what, and when."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _server_errors, app
from megatrain.settings import get_settings

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def _since(value: str | None) -> datetime | None:
    """A duration back from now (30m, 2h, 7d) or an ISO date/time (UTC when it names no zone)."""
    if value is None:
        return None
    if m := _DURATION.match(value.strip()):
        return datetime.now(UTC) - timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
    try:
        at = datetime.fromisoformat(value.strip())
    except ValueError:
        raise typer.BadParameter(f"{value!r} is neither a duration (30m, 2h, 7d) nor an ISO date") from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


@app.command("audit")
@_server_errors
def audit(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's records.")] = None,
    action: Annotated[
        str | None, typer.Option(help="Only actions starting so (job, job.cancel, secret…).")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="From this far back (30m, 2h, 7d) or an ISO date.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="At most this many, newest first.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Operator: who created, cancelled, paused, deleted, shared or exported what, and when (newest
    first); reads the database directly."""
    from sqlalchemy import select

    from megatrain.db.audit import AuditEvent
    from megatrain.db.models import Tenant
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    start = _since(since)
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        q = select(AuditEvent, Tenant.name).outerjoin(Tenant, Tenant.id == AuditEvent.tenant_id)
        if tenant is not None:
            tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
            if tenant_id is None:
                raise _fail(f"no tenant named {tenant!r}")
            q = q.where(AuditEvent.tenant_id == tenant_id)
        if action:
            q = q.where(AuditEvent.action.startswith(action))
        if start is not None:
            q = q.where(AuditEvent.at >= start)
        rows = session.execute(q.order_by(AuditEvent.at.desc(), AuditEvent.id.desc()).limit(limit)).all()
    if as_json:
        for ev, name in rows:
            record = {"at": ev.at.isoformat(), "actor": f"{ev.actor_kind}:{ev.actor_id}", "tenant": name,
                      "action": ev.action, "target": ev.target, "detail": ev.detail}  # fmt: skip
            typer.echo(json.dumps(record, sort_keys=True))
        return
    table = Table("at (UTC)", "actor", "tenant", "action", "target", "detail")
    for ev, name in rows:
        detail = " ".join(f"{k}={v}" for k, v in sorted((ev.detail or {}).items()))
        table.add_row(
            ev.at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"), escape(f"{ev.actor_kind}:{ev.actor_id}"),
            escape(name or ev.tenant_id or "-"), ev.action, escape(ev.target), escape(detail),
        )  # fmt: skip
    _out().print(table if rows else "no audit records match")
