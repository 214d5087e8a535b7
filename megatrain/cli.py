"""The `megatrain` command (typer + rich).

Job commands only call the SDK (`megatrain.client`); the server commands (up, scheduler, worker,
keys, and the stack `demo` starts) run the control plane in this process. Heavy modules (uvicorn,
the API, SQLAlchemy, torch) are imported inside the commands that need them, so `megatrain list`
stays quick and torch-free. Every user error ends as one red line and exit code 1, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlparse

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from megatrain.client import ApiError, ApiUnreachable, Client, Job, LogLine, MegatrainError
from megatrain.settings import Settings, get_settings

app = typer.Typer(
    name="megatrain",
    help="Train transformers on the megatrain service: submit, follow, download.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="API keys (operator commands: they talk to the database directly).")
app.add_typer(keys_app, name="keys")

F = TypeVar("F", bound=Callable[..., Any])


def _out() -> Console:
    # Built per call: rich then writes to whatever sys.stdout is now (CliRunner swaps it).
    return Console(highlight=False, soft_wrap=True)


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 1) -> typer.Exit:
    _err().print(f"[bold red]error:[/bold red] [red]{escape(message)}[/red]")
    return typer.Exit(code)


def _explain(exc: MegatrainError) -> str:
    """The error, plus what to do about it where that is not obvious."""
    if isinstance(exc, ApiUnreachable):
        return f"{exc}. Start the service with `megatrain up`, or point MEGATRAIN_API_URL at it."
    if isinstance(exc, ApiError) and exc.status == 401:
        path = get_settings().credentials_path
        return f"{exc}. Set MEGATRAIN_API_KEY, or check the key in {path}."
    if isinstance(exc, ApiError) and exc.status == 422 and exc.field_errors:
        lines = "\n".join(f"  {e['field']}: {e['message']}" for e in exc.field_errors)
        return f"invalid job spec (HTTP 422):\n{lines}"
    return str(exc)


def _user_errors(fn: F) -> F:
    """Turn the SDK's errors into a red message and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MegatrainError as exc:
            raise _fail(_explain(exc)) from None
        except TimeoutError as exc:
            raise _fail(str(exc)) from None
        except KeyboardInterrupt:
            raise _fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


STATUS_STYLE = {
    "queued": "yellow",
    "scheduled": "cyan",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
}


def _status(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


# -- following a job ----------------------------------------------------------------------------


def follow_job(client: Client, job_id: str, poll_interval_s: float = 1.0) -> Job:
    """A live progress bar (step/total, loss, tokens/s, MFU) until the job ends; returns it."""
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
    reason = f": {job.status_reason}" if job.status_reason else ""
    console.print(f"job {job.id} {_status(job.status)}{escape(reason)}")
    return job


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


@app.command("list")
@_user_errors
def list_jobs(
    status: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many jobs, newest first.")] = 50,
) -> None:
    """List jobs, newest first."""
    with Client() as client:
        jobs = list(client.list_jobs(status=status, limit=limit))
    if not jobs:
        _out().print("no jobs" + (f" with status {status}" if status else ""))
        return
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "STATUS", "STEP", "LOSS", "TOK/S", "MFU", "CREATED"):
        table.add_column(col, no_wrap=col in ("ID", "STATUS"))
    for job in jobs:
        table.add_row(
            job.id,
            escape(job.name),
            _status(job.status),
            f"{job.current_step}/{job.total_steps}",
            _fmt(job.latest_loss, ".4f"),
            _fmt(job.latest_tokens_per_s, ",.0f"),
            "-" if job.latest_mfu is None else f"{100 * job.latest_mfu:.2f}%",
            (job.created_at or "")[:19].replace("T", " "),
        )
    _out().print(table)


@app.command()
@_user_errors
def status(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Show one job: state, progress, layout and its latest events."""
    with Client() as client:
        job = client.get_job(job_id)
        events = client.events(job_id)
    out = _out()
    out.print(f"[bold]{job.id}[/bold]  {escape(job.name)}  ({job.kind})")
    out.print(
        f"status     {_status(job.status)}" + (f"  {escape(job.status_reason)}" if job.status_reason else "")
    )
    out.print(f"progress   step {job.current_step}/{job.total_steps}  attempt {job.attempt}")
    out.print(
        f"latest     loss {_fmt(job.latest_loss, '.4f')}  "
        f"{_fmt(job.latest_tokens_per_s, ',.0f')} tok/s  "
        f"MFU {'-' if job.latest_mfu is None else f'{100 * job.latest_mfu:.2f}%'}"
    )
    if job.layout:
        layout = ", ".join(f"{k}={v}" for k, v in job.layout.items() if not isinstance(v, dict | list))
        out.print(f"layout     {escape(layout)}  ({job.num_procs} processes)")
    out.print(f"created    {job.created_at}")
    for ev in events[-10:]:
        when = str(ev.get("created_at", ""))[:19].replace("T", " ")
        reason = ev.get("reason") or ""
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
        for line in lines:
            typer.echo(line.line)


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
) -> None:
    """Download a checkpoint into a folder."""
    with Client() as client:
        if step is None:
            cps = client.checkpoints(job_id)
            if not cps:
                raise _fail(f"job {job_id} has no checkpoints yet")
            step = cps[-1].step
        path = client.download(job_id, step=step, dest=to or Path(f"{job_id}-iter_{step:07d}"))
    _out().print(f"downloaded step {step} of job {job_id} to [bold]{escape(str(path))}[/bold]")


# -- server commands (this process runs the control plane) ---------------------------------------


class EmbeddedStack:
    """The embedded default in one process: the API under uvicorn plus the scheduler loop."""

    def __init__(self, settings: Settings, host: str, port: int, log_level: str = "info"):
        import uvicorn

        from megatrain.api.app import create_app

        self.settings = settings
        self.host, self.port = host, port
        self.stop_event = threading.Event()
        config = uvicorn.Config(create_app(settings), host=host, port=port, log_level=log_level)
        self.server = uvicorn.Server(config)
        self._threads: list[threading.Thread] = []

    @staticmethod
    def prepare(settings: Settings) -> str:
        """Migrate the database and make sure the local key exists; returns that key."""
        from megatrain.api.auth import ensure_local_credentials
        from megatrain.db.session import upgrade_database

        upgrade_database(settings.resolved_database_url)
        return ensure_local_credentials(settings)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_scheduler(self) -> None:
        from megatrain.scheduler.loop import Scheduler

        scheduler = Scheduler(self.settings)
        thread = threading.Thread(
            target=scheduler.run, args=(self.stop_event,), name="scheduler", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def start_in_background(self, scheduler: bool = True, timeout_s: float = 30.0) -> None:
        """Serve from a thread (tests, embedding) and return once the port accepts requests."""
        if scheduler:
            self.start_scheduler()
        thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        thread.start()
        self._threads.append(thread)
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start on {self.url}")
            time.sleep(0.05)

    def serve_forever(self) -> None:
        """Serve in this (main) thread; uvicorn turns Ctrl-C/SIGTERM into a clean shutdown."""
        self.start_scheduler()
        try:
            self.server.run()
        finally:
            self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.stop_event.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its per-plugin INFO lines are noise here


def _server_errors(fn: F) -> F:
    """Server commands: a missing component or a bad database URL is a message, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            return None
        except ImportError as exc:
            raise _fail(f"this installation lacks a component: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - operator commands report any failure in one line
            raise _fail(f"{type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]


@app.command()
@_server_errors
def up(
    host: Annotated[str | None, typer.Option(help="Address to listen on (MEGATRAIN_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (MEGATRAIN_PORT).")] = None,
) -> None:
    """Run the whole embedded stack (API, dashboard, scheduler, local executor) in this process."""
    _configure_logging()
    settings = get_settings()
    host = host or settings.host
    port = port or settings.port
    EmbeddedStack.prepare(settings)
    stack = EmbeddedStack(settings, host, port)
    out = _out()
    out.print(f"megatrain dashboard: [bold]http://{host}:{port}/[/bold]")
    out.print(f"API key (tenant 'local') stored in {settings.credentials_path}")
    out.print(f"database {settings.resolved_database_url}, storage {settings.resolved_storage_url}")
    if f"http://{host}:{port}" != settings.api_url.rstrip("/"):
        out.print(f"for the CLI elsewhere: export MEGATRAIN_API_URL=http://{host}:{port}")
    out.print("press Ctrl-C to stop")
    stack.serve_forever()
    out.print("stopped")


@app.command()
@_server_errors
def scheduler() -> None:
    """Run the scheduler loop alone (production: beside API replicas and Celery workers)."""
    from megatrain.scheduler.loop import Scheduler

    _configure_logging()
    settings = get_settings()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    _out().print(f"scheduler running against {settings.resolved_database_url}; Ctrl-C stops it")
    Scheduler(settings).run(stop)


@app.command()
@_server_errors
def worker(
    concurrency: Annotated[int, typer.Option(min=1, help="Job shards this worker runs at once.")] = 1,
) -> None:
    """Run a Celery worker that executes job shards on this node."""
    from megatrain.worker.celery_app import run_worker

    run_worker(get_settings(), concurrency=concurrency)


@keys_app.command("create")
@_server_errors
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant name; created if new.")],
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
) -> None:
    """Create an API key for a tenant and print it (it is shown only this once)."""
    from megatrain.api.auth import create_api_key
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        key = create_api_key(session, tenant, name)
    _err().print(f"API key for tenant '{escape(tenant)}' (store it now; it is not shown again):")
    typer.echo(key)


# -- demo ---------------------------------------------------------------------------------------


def _ensure_api(settings: Settings, timeout_s: float = 120.0) -> subprocess.Popen[bytes] | None:
    """Start a detached `megatrain up` if nothing answers at settings.api_url; None if one already did
    (and takes this home's key: a server started from another MEGATRAIN_HOME is named as such)."""
    try:
        with Client(api_key="") as probe:
            probe.health()
    except ApiUnreachable:
        pass
    else:
        try:
            with Client() as client:
                next(client.list_jobs(limit=1), None)
        except ApiError as exc:
            if exc.status != 401:
                raise
            raise MegatrainError(
                f"a megatrain API already answers at {settings.api_url} but does not take this home's API "
                f"key ({settings.credentials_path}): it was started from another MEGATRAIN_HOME. Stop it, "
                "or set MEGATRAIN_API_URL to a free port (e.g. http://127.0.0.1:8001) to start this home's "
                "own, or set MEGATRAIN_API_KEY to a key of that server"
            ) from None
        return None
    parsed = urlparse(settings.api_url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ApiUnreachable(settings.api_url, "and it is not on this machine, so the demo cannot start it")
    port = parsed.port or 80
    log_path = settings.home / "megatrain-up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _out().print(f"starting the embedded stack on {settings.api_url} (log: {log_path})")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatrain.cli", "up", "--host", parsed.hostname, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # detached: it outlives the demo, like `megatrain up &`
            env=os.environ.copy(),
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise ApiUnreachable(settings.api_url, "`megatrain up` exited:\n" + "\n".join(tail))
        try:
            with Client(api_key="") as probe:
                probe.health()
            return proc
        except ApiUnreachable:
            time.sleep(0.5)
    raise ApiUnreachable(
        settings.api_url, f"`megatrain up` did not answer within {timeout_s:.0f} s; see {log_path}"
    )


def _demo_corpus(settings: Settings) -> str:
    """Build the stdlib corpus into {storage}/datasets/python-stdlib/ and return its URL."""
    from megatrain.demo import build_stdlib_corpus
    from megatrain.storage import FileStore, open_store

    store = open_store(settings.resolved_storage_url)
    if isinstance(store, FileStore):
        path = build_stdlib_corpus(store.local_path("datasets/python-stdlib"))
        return Path(path).resolve().as_uri()
    # Object storage: build locally, then upload beside the other datasets.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(build_stdlib_corpus(Path(tmp)))
        key = f"datasets/python-stdlib/{path.name}"
        store.put_file(key, path)
    return f"{store.url}/{key}"


@app.command()
@_user_errors
def demo(
    to: Annotated[Path, typer.Option("--to", help="Where to put the final checkpoint.")] = Path(
        "megatrain-demo-checkpoint"
    ),
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree (a divisor of 4 heads).")] = 1,
    dp: Annotated[int, typer.Option(min=1, help="Data-parallel degree (a divisor of 16).")] = 1,
    sequence_parallel: Annotated[bool, typer.Option(help="Sequence parallelism (with tp > 1).")] = False,
    write_spec: Annotated[
        Path | None,
        typer.Option(help="Only build the corpus and write the demo's spec here (for torchrun)."),
    ] = None,
) -> None:
    """Train a small Llama on the Python standard library's sources, end to end, and load the result."""
    from megatrain.demo import demo_spec

    settings = get_settings()
    out = _out()
    if write_spec is not None:
        spec = demo_spec(_demo_corpus(settings), tp=tp, dp=dp, sequence_parallel=sequence_parallel)
        write_spec.write_text(json.dumps(spec, indent=1) + "\n")
        n = tp * dp
        out.print(f"wrote {escape(str(write_spec))}; run it with: torchrun --standalone --nproc-per-node {n} "
                  f"-m megatrain.engine.train --spec {escape(str(write_spec))} --out demo-run")
        return
    proc = _ensure_api(settings)
    if proc is not None:
        out.print(
            f"the stack keeps running in the background (pid {proc.pid}, "
            f"log {settings.home / 'megatrain-up.log'}); stop it with `kill {proc.pid}`"
        )
    corpus_url = _demo_corpus(settings)
    out.print(f"corpus: {corpus_url}")
    with Client() as client:
        job = client.submit(demo_spec(corpus_url, tp=tp, dp=dp, sequence_parallel=sequence_parallel))
        out.print(f"submitted demo job [bold]{job.id}[/bold]; watch it at {client.api_url}/")
        final = follow_job(client, job.id)
        if final.status != "succeeded":
            for line in client.logs(job.id)[-20:]:
                typer.echo(line.line, err=True)
            raise _fail(f"the demo job {final.status}: {final.status_reason or 'see the logs above'}")
        path = client.download(job.id, dest=to)
        train = [
            m
            for m in client.metrics(job.id)
            if m.get("kind", "train") == "train" and m.get("loss") is not None
        ]
    from megatrain.engine.checkpoint import load_checkpoint

    model, _spec = load_checkpoint(str(path))
    num_params = sum(p.numel() for p in model.parameters())
    out.print(
        f"checkpoint downloaded to [bold]{escape(str(path))}[/bold]; it loads: {num_params:,} parameters"
    )
    if train:
        out.print(
            f"loss: first {train[0]['loss']:.4f} (step {train[0]['step']}) -> "
            f"final {train[-1]['loss']:.4f} (step {train[-1]['step']})"
        )
    out.print(f"dashboard: [bold]{client.api_url}/[/bold]")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
