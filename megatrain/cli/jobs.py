"""Job commands: submit, list, status, logs, cancel, download. They only call the SDK
(`megatrain.client`), so they stay quick and torch-free."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from megatrain.cli.common import _err, _fail, _fmt, _out, _status, _still_running, _user_errors, app
from megatrain.cli.prediction import planned_line, recent_since, submitted_prediction, versus_line
from megatrain.client import Client, Job, LogLine
from megatrain.failures import first_line
from megatrain.job_states import JOB_STATES
from megatrain.scheduler.reasons import duration, ordinal

# -- following a job ----------------------------------------------------------------------------


def follow_job(client: Client, job_id: str, poll_interval_s: float = 1.0) -> Job:
    """A live progress bar (step/total, loss, tokens/s, MFU) until the job ends; returns it.
    Ctrl-C ends the following (exit 130) with a note that the job keeps running."""
    try:
        return _follow_job(client, job_id, poll_interval_s)
    except KeyboardInterrupt:
        raise _still_running(job_id) from None


def _follow_job(client: Client, job_id: str, poll_interval_s: float) -> Job:
    console = _out()
    columns = (
        TextColumn("{task.fields[status]}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("step {task.fields[steps]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("MFU {task.fields[mfu]}"),
        TimeElapsedColumn(),
    )
    last_seen: tuple[str, int] | None = None
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(job_id, total=None, status="", steps="-", loss="-", tps="-", mfu="-")
        while True:
            job = client.get_job(job_id)
            fields = {
                "status": _status(job.status),
                "steps": f"{job.current_step}/{job.total_steps or '?'}",
                "loss": _fmt(job.latest_loss, ".4f"),
                "tps": _fmt(job.latest_tokens_per_s, ",.0f"),
                "mfu": _fmt(None if job.latest_mfu is None else 100 * job.latest_mfu, ".2f") + "%",
            }
            progress.update(task, total=job.total_steps or None, completed=job.current_step, **fields)
            if not console.is_terminal and (job.status, job.current_step) != last_seen and not job.done:
                # Piped to a file or CI log: no live bar there, so leave one line per change instead.
                console.print("{status} step {steps} loss {loss} {tps} tok/s MFU {mfu}".format(**fields))
            last_seen = (job.status, job.current_step)
            if job.done:
                break
            time.sleep(poll_interval_s)
    reason = f": {_one_line(job.status_reason)}" if job.status_reason else ""
    console.print(f"job {job.id} {_status(job.status)}{escape(reason)}")
    if job.status == "failed":
        console.print(_logs_hint(job.id))
    return job


def _status_text(job: Job) -> str:
    """'queued #3' for a queued job with a place in its pool's queue, else the status."""
    position = job.raw.get("queue_position")
    return f"{job.status} #{position}" if job.status == "queued" and isinstance(position, int) else job.status


def _one_line(reason: str | None) -> str:
    """A reason's first line: the worker writes one, but jobs stored before it may hold tracebacks."""
    return first_line(reason or "", limit=1000)


def _logs_hint(job_id: str) -> str:
    return f"the full traceback is in the job's log: [bold]megatrain logs {escape(job_id)}[/bold]"


# -- job commands (SDK only) ---------------------------------------------------------------------


@app.command()
@_user_errors
def submit(
    spec: Annotated[Path, typer.Argument(help="Job spec file (YAML or JSON).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Show progress until the job ends.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submitting again with the same key returns the same job.")
    ] = None,
) -> None:
    """Submit a training job."""
    with Client() as client:
        job = client.submit(spec, idempotency_key=idempotency_key)
        _out().print(f"submitted job [bold]{job.id}[/bold] ({escape(job.name)}): {_status(job.status)}")
        if follow:
            final = follow_job(client, job.id)
            if final.status != "succeeded":
                raise typer.Exit(1)


@app.command()
@_user_errors
def validate(spec: Annotated[Path, typer.Argument(help="Job spec file (YAML or JSON).")]) -> None:
    """Run every check a submission runs (spec, layout, pool fit, data access) without submitting."""
    with Client() as client:
        check = client.validate(spec)
    layout = layout_text(check.get("layout", {}), check.get("num_procs"))
    out = _out()
    out.print(f"{escape(str(spec))} is valid: {escape(layout)}")
    auto = check.get("auto") or {}
    if auto:
        shown = (f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in auto.items())
        out.print("auto chose: " + escape(", ".join(shown)))
    plan = check.get("plan")
    if plan:
        how = "as given" if plan.get("explicit_layout") else "planned"
        out.print(f"{how}: {escape(planned_line(plan))}")


@app.command()
@_user_errors
def follow(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Show a job's progress until it ends (Ctrl-C stops following; the job keeps running)."""
    with Client() as client:
        final = follow_job(client, job_id)
    if final.status != "succeeded":
        raise typer.Exit(1)


@app.command("list")
@_user_errors
def list_jobs(
    status: Annotated[
        str | None, typer.Option(help=f"Only jobs in this state: {', '.join(JOB_STATES)}.")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many jobs, newest first.")] = 50,
) -> None:
    """List jobs, newest first."""
    if status is not None and status not in JOB_STATES:
        # Checked here: the API's 422 would read as a problem with a job spec.
        raise _fail(f"unknown --status {status!r}; the states are {', '.join(JOB_STATES)}")
    with Client() as client:
        jobs = list(client.list_jobs(status=status, limit=limit))
    if not jobs:
        _out().print("no jobs" + (f" with status {status}" if status else ""))
        return
    out = _out()
    # Ids are what the other commands take: never cut. The name gives way (ellipsis); below 110
    # columns the throughput columns go and the date is shortened, so 80 columns hold a row.
    wide = out.width >= 110
    headers = ["ID", "NAME", "STATUS", "STEP", "LOSS"] + (["TOK/S", "MFU"] if wide else []) + ["CREATED"]
    rows = []
    for job in jobs:
        created = (job.created_at or "")[:19].replace("T", " ")
        cells = [
            job.id,
            job.name,
            _status_text(job),
            f"{job.current_step}/{job.total_steps}",
            _fmt(job.latest_loss, ".4f"),
        ]
        if wide:
            cells += [
                _fmt(job.latest_tokens_per_s, ",.0f"),
                "-" if job.latest_mfu is None else f"{100 * job.latest_mfu:.2f}%",
            ]
        rows.append([*cells, created if wide else created[5:16]])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    # What the other columns and the two-space gaps leave is the name's (at least 4 columns).
    name_width = max(4, min(widths[1], out.width - sum(widths) + widths[1] - 2 * (len(headers) - 1)))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for i, header in enumerate(headers):
        table.add_column(
            header,
            no_wrap=True,
            overflow="ellipsis" if header == "NAME" else "fold",
            width=name_width if header == "NAME" else widths[i],
            justify="right" if header in ("STEP", "LOSS", "TOK/S", "MFU") else "left",
        )
    for row in rows:
        state, _, place = row[2].partition(" ")
        table.add_row(row[0], escape(row[1]), _status(state) + (f" {place}" if place else ""), *row[3:])
    out.print(table, soft_wrap=False)  # soft wrap would let rows run past the width


GOODPUT_LOSSES = (
    ("queued_s", "queued"),
    ("restart_s", "restarts"),
    ("checkpoint_stall_s", "checkpoint stalls"),
    ("hang_s", "hangs"),
    ("preempt_s", "preemptions"),
    ("eval_s", "evaluation"),
)


def goodput_line(goodput: Any) -> str | None:
    """'92.1% productive (1h02m of 1h07m); lost: restarts 3m10s, hangs 2m' over the ended attempts."""
    if not isinstance(goodput, dict) or not goodput.get("attempts"):
        return None
    total = sum(float(goodput.get(k) or 0) for k in ("productive_s", *(k for k, _ in GOODPUT_LOSSES)))
    share = "-" if goodput.get("goodput") is None else f"{100 * goodput['goodput']:.1f}%"
    lost = [f"{name} {duration(float(goodput[k]))}" for k, name in GOODPUT_LOSSES if goodput.get(k)]
    head = f"{share} productive ({duration(float(goodput.get('productive_s') or 0))} of {duration(total)})"
    return head + ("; lost: " + ", ".join(lost) if lost else "")


@app.command()
@_user_errors
def status(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Show one job: state, progress, layout and its latest events."""
    with Client() as client:
        job = client.get_job(job_id)
        events = client.events(job_id)
        predicted = submitted_prediction(events)
        train = client.metrics(job_id, recent_since(job), kind="train") if predicted else []
    out = _out()
    out.print(f"[bold]{job.id}[/bold]  {escape(job.name)}  ({job.kind})")
    reason = _one_line(job.status_reason)
    out.print(f"status     {_status(job.status)}" + (f"  {escape(reason)}" if reason else ""))
    if job.status == "failed":
        out.print(f"           {_logs_hint(job.id)}")
    position = job.raw.get("queue_position")
    if job.status == "queued" and isinstance(position, int):
        out.print(f"queue      {ordinal(position)} in pool {escape(repr(job.pool))}")
    preempted = f" (preempted {job.preemptions} of at most {job.max_preemptions})" if job.preemptions else ""
    out.print(f"progress   step {job.current_step}/{job.total_steps}  attempt {job.attempt}{preempted}")
    eta = job.raw.get("eta_s")
    if job.status == "running" and isinstance(eta, int | float):
        step_time = job.raw.get("step_time_s") or 0.0
        when = str(job.raw.get("eta_at") or "")[11:16]
        out.print(f"eta        {duration(eta)} ({step_time:.3g} s/step measured; done about {when} UTC)")
    out.print(
        f"latest     loss {_fmt(job.latest_loss, '.4f')}  "
        f"{_fmt(job.latest_tokens_per_s, ',.0f')} tok/s  "
        f"MFU {'-' if job.latest_mfu is None else f'{100 * job.latest_mfu:.2f}%'}"
    )
    if job.layout:
        out.print(f"layout     {escape(layout_text(job.layout, job.num_procs))}")
    if predicted:
        out.print(f"predicted  {escape(versus_line(predicted, train))}")
    if line := goodput_line(job.raw.get("goodput")):
        out.print(f"goodput    {line}")
    out.print(f"created    {job.created_at}")
    for ev in events[-10:]:
        when = str(ev.get("created_at", ""))[:19].replace("T", " ")
        reason = _one_line(ev.get("reason"))
        out.print(f"  {when}  {escape(str(ev.get('kind', '')))}  {escape(str(reason))}")


@app.command()
@_user_errors
def logs(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    after_seq: Annotated[int, typer.Option(help="Only lines after this sequence number.")] = 0,
) -> None:
    """Print a job's log lines."""
    with Client() as client:
        lines = client.follow_logs(job_id, after_seq) if follow else _all_logs(client, job_id, after_seq)
        if follow:  # on stderr: stdout stays the log alone, for pipes
            _err().print(f"following the log of job {job_id} (Ctrl-C stops following; the job keeps running)")
        try:
            for line in lines:
                typer.echo(line.line)
        except KeyboardInterrupt:
            if follow:
                raise _still_running(job_id) from None
            raise


def _all_logs(client: Client, job_id: str, after_seq: int) -> Iterator[LogLine]:
    """Every stored line after after_seq, page by page (the API caps one answer at 1000 lines)."""
    while batch := client.logs(job_id, after_seq=after_seq):
        yield from batch
        after_seq = batch[-1].seq


@app.command()
@_user_errors
def cancel(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Cancel a job (at once if queued; a running job stops within a few seconds)."""
    with Client() as client:
        job = client.cancel(job_id)
    _out().print(f"cancel requested for job [bold]{job.id}[/bold]: {_status(job.status)}")


@app.command()
@_user_errors
def download(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    step: Annotated[int | None, typer.Option(help="Checkpoint step; the latest if omitted.")] = None,
    to: Annotated[Path | None, typer.Option("--to", help="Destination folder.")] = None,
    weights_only: Annotated[
        bool, typer.Option("--weights-only", help="Only the model's files, not the optimizer state.")
    ] = False,
) -> None:
    """Download a checkpoint into a folder (JOB@STEP picks a step; the latest otherwise)."""
    if "@" in job_id:
        job_id, _, at = job_id.partition("@")
        if not at.isdigit() or (step is not None and step != int(at)):
            raise _fail(f"JOB@STEP needs a step number that agrees with --step, not {at!r}")
        step = int(at)
    with Client() as client:
        if step is None:
            cps = client.checkpoints(job_id)
            if not cps:
                raise _fail(client.get_job(job_id).no_checkpoints)
            step = cps[-1].step
        dest = to or Path(f"{job_id}-iter_{step:07d}")
        path = client.download(job_id, step=step, dest=dest, weights_only=weights_only)
    what = "the weights of step" if weights_only else "step"
    _out().print(f"downloaded {what} {step} of job {job_id} to [bold]{escape(str(path))}[/bold]")


_LAYOUT_DEFAULTS = {"cp": 1, "ep": 1, "virtual_stages": 1, "sequence_parallel": False,
                    "pipeline_schedule": "1f1b", "pipeline_layers": None, "moe_overlap_chunks": 1,
                    "moe_overlap_microbatches": False,
                    "moe_dispatch": "pairs"}  # fmt: skip


def layout_text(layout: dict[str, Any], num_procs: int | None) -> str:
    """'2 processes: tp=2 pp=1 dp=1 sequence_parallel': the degrees always, the rest where not default."""
    parts = [f"{k}={layout[k]}" for k in ("tp", "pp", "dp") if k in layout]
    for key, default in _LAYOUT_DEFAULTS.items():
        value = layout.get(key, default)
        if value != default:
            parts.append(key if value is True else f"{key}={value}")
    n = num_procs if num_procs is not None else "?"
    return f"{n} process{'' if n == 1 else 'es'}: {' '.join(parts)}"
