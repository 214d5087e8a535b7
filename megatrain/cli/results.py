"""`megatrain results JOB...`: a job's evaluation results (an eval job's, or its tasks scored during
training), one table; several jobs side by side, one column each, to compare them. SDK only."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _user_errors, app
from megatrain.client import Client


def _cell(result: dict[str, Any] | None) -> str:
    if not result or result.get("value") is None:
        return "-"
    text = f"{result['value']:.4f}"
    return text if result.get("stderr") is None else f"{text} ± {result['stderr']:.4f}"


@app.command()
@_user_errors
def results(
    job_ids: Annotated[list[str], typer.Argument(help="Job id(s): several are shown side by side.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's answers as JSON.")] = False,
) -> None:
    """Show evaluation results: each task's metrics (value ± stderr) and items scored."""
    with Client() as client:
        answers = [client.results(job_id) for job_id in job_ids]
    if as_json:
        typer.echo(json.dumps(answers if len(answers) > 1 else answers[0], indent=2))
        return
    empty = [a["job_id"] for a in answers if not a["tasks"]]
    if len(empty) == len(answers):
        raise _fail(f"no evaluation results yet for {', '.join(empty)}")
    rows = sorted({(task, metric) for a in answers for task, ms in a["tasks"].items() for metric in ms})
    table = Table(box=None, header_style="bold")
    table.add_column("TASK")
    table.add_column("METRIC")
    for a in answers:
        table.add_column(escape(a["job_id"]) if len(answers) > 1 else "VALUE", justify="right")
    table.add_column("N", justify="right")
    for task, metric in rows:
        cells = [_cell(a["tasks"].get(task, {}).get(metric)) for a in answers]
        ns = {a["tasks"][task][metric]["n"] for a in answers if metric in a["tasks"].get(task, {})}
        table.add_row(escape(task), escape(metric), *cells, "/".join(str(n) for n in sorted(ns)))
    _out().print(table)
    for job_id in empty:
        _out().print(f"(no evaluation results yet for {escape(job_id)})")
