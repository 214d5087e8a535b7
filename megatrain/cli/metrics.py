"""`megatrain metrics JOB` (a table of the job's metric rows, or a stream of them with --follow) and
`megatrain events JOB` (its timeline). SDK only, like the other job commands."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fmt, _out, _still_running, _user_errors, app
from megatrain.client import Client

# (header, width, cell) per column; a train row and a val row share them (val rows carry val_loss).
_COLUMNS: list[tuple[str, int, Any]] = [
    ("STEP", 7, lambda r: str(r.get("step", "-"))),
    ("KIND", 5, lambda r: str(r.get("kind", "train"))),
    ("LOSS", 8, lambda r: _fmt(r.get("loss", r.get("val_loss")), ".4f")),
    ("LR", 9, lambda r: _fmt(r.get("lr"), ".3g")),
    ("GRAD", 7, lambda r: _fmt(r.get("grad_norm"), ".3g")),
    ("TOK/S", 9, lambda r: _fmt(r.get("tokens_per_s"), ",.0f")),
    ("MFU", 7, lambda r: "-" if r.get("mfu") is None else f"{100 * r['mfu']:.2f}%"),
    ("ITER S", 7, lambda r: _fmt(r.get("iter_time_s"), ".3f")),
]


def _line(cells: list[str]) -> str:
    return "  ".join(c.rjust(w) for c, (_, w, _) in zip(cells, _COLUMNS, strict=True)).rstrip()


def _cells(row: dict[str, Any]) -> list[str]:
    return [cell(row) for _, _, cell in _COLUMNS]


@app.command()
@_user_errors
def metrics(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new rows until the job ends.")
    ] = False,
    kind: Annotated[str | None, typer.Option(help="Only rows of this kind (train or val).")] = None,
    last: Annotated[int | None, typer.Option(help="Only the last N rows.", min=1)] = None,
) -> None:
    """Show a job's metric rows: step, loss, learning rate, grad norm, tokens/s, MFU, step time."""
    out = _out()
    with Client() as client:
        rows = client.metrics(job_id, kind=kind)
        if last is not None:
            rows = rows[-last:]
        if not follow:
            if not rows:
                out.print(f"no metrics yet for job {job_id}")
                return
            table = Table(box=None, header_style="bold")
            for header, _, _ in _COLUMNS:
                table.add_column(header, justify="right", no_wrap=True)
            for row in rows:
                table.add_row(*_cells(row))
            out.print(table)
            return
        # Following: fixed-width lines, so rows printed before and after the stream line up.
        out.print(f"[bold]{escape(_line([h for h, _, _ in _COLUMNS]))}[/bold]")
        for row in rows:
            out.print(_line(_cells(row)))
        since = max((int(r["step"]) for r in rows), default=None)
        try:
            for row in client.stream_metrics(job_id, since_step=since, kind=kind):
                out.print(_line(_cells(row)))
        except KeyboardInterrupt:
            raise _still_running(job_id) from None
        job = client.get_job(job_id)
    out.print(f"job {job.id} {job.status}")


@app.command()
@_user_errors
def events(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Show a job's timeline: state changes, checkpoints, resumes, oldest first."""
    with Client() as client:
        rows = client.events(job_id)
    if not rows:
        _out().print(f"no events for job {job_id}")
        return
    table = Table(box=None, header_style="bold")
    table.add_column("TIME", no_wrap=True)
    table.add_column("KIND", no_wrap=True)
    table.add_column("MESSAGE", overflow="fold")
    for ev in rows:
        when = str(ev.get("created_at", ""))[:19].replace("T", " ")
        change = f"{ev['from_status']} -> {ev['to_status']}" if ev.get("from_status") else ""
        message = "  ".join(m for m in (change, str(ev.get("reason") or "")) if m)
        table.add_row(when, escape(str(ev.get("kind", ""))), escape(message))
    _out().print(table)
