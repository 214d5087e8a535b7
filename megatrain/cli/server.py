"""Server commands: this process runs the control plane (up, scheduler, worker) or talks to its
database directly (keys, tenants). Heavy modules are imported inside the commands."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.markup import escape

from megatrain.cli.common import (
    _configure_logging,
    _err,
    _fail,
    _out,
    _server_errors,
    app,
    keys_app,
    tenants_app,
)
from megatrain.settings import Settings, get_settings

# -- server commands (this process runs the control plane) ---------------------------------------


class EmbeddedStack:
    """The embedded default in one process: the API under uvicorn plus the scheduler loop."""

    def __init__(self, settings: Settings, host: str, port: int, log_level: str = "info"):
        import uvicorn

        from megatrain.api.app import create_app
        from megatrain.api.server import api_config

        self.settings = settings
        self.host, self.port = host, port
        self.stop_event = threading.Event()
        self.app = create_app(settings)
        config = api_config(self.app, settings, host, port, log_level=log_level)
        self.server = uvicorn.Server(config)
        self._threads: list[threading.Thread] = []

    @staticmethod
    def prepare(settings: Settings) -> str:
        """Migrate the database, register the executor's nodes (this machine, for the local
        executor) and make sure the local key exists; returns that key."""
        from megatrain.api.auth import ensure_local_credentials
        from megatrain.db.session import upgrade_database
        from megatrain.scheduler.pools import apply_pools_at_start
        from megatrain.worker.executors import get_executor

        upgrade_database(settings.resolved_database_url)
        apply_pools_at_start(settings)  # MEGATRAIN_POOLS_FILE: a bad one stops the start here
        get_executor(settings).refresh_nodes()
        return ensure_local_credentials(settings)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def runner_settings(self) -> Settings:
        """The scheduler's settings: unless told otherwise, the local executor's runners report
        through this API (on loopback) with a token per attempt, and hold no database URL. (Slurm's
        nodes reach the API at the api_url an operator sets, so runners_via_api stays theirs.)"""
        if self.settings.runners_via_api is not None or self.settings.executor != "local":
            return self.settings
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        return self.settings.model_copy(update={"runners_via_api": True, "api_url": url})

    def start_scheduler(self) -> None:
        from megatrain.scheduler.loop import Scheduler
        from megatrain.scheduler.metrics import SchedulerMetrics

        # Its series (and the local runners') on the API's /metrics: one scrape target for it all.
        metrics = SchedulerMetrics(self.app.state.metrics.served)
        scheduler = Scheduler(self.runner_settings, metrics=metrics)
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


@app.command()
@_server_errors
def up(
    host: Annotated[str | None, typer.Option(help="Address to listen on (MEGATRAIN_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (MEGATRAIN_PORT).")] = None,
) -> None:
    """Run the whole embedded stack (API, dashboard, scheduler, local executor) in this process.

    If this MEGATRAIN_HOME's stack already runs, say so and exit 0 (`megatrain down` stops it)."""
    from megatrain.cli.stack import remove_pid_file, running_stack, write_pid_file

    settings = get_settings()
    host = host or settings.host
    port = port or settings.port
    running = running_stack(settings)
    if running is not None:
        _out().print(
            f"a megatrain stack already runs from {settings.home} at {running.get('url', '?')} "
            f"(pid {running['pid']}); stop it with `megatrain down`"
        )
        return
    if not _port_free(host, port):
        raise _fail(_port_taken(host, port))
    _configure_logging()
    EmbeddedStack.prepare(settings)
    from megatrain.api.server import raise_open_file_limit

    raise_open_file_limit()
    stack = EmbeddedStack(settings, host, port)
    out = _out()
    out.print(f"megatrain dashboard: [bold]http://{host}:{port}/[/bold]")
    out.print(f"API key (tenant 'local') stored in {settings.credentials_path}")
    out.print(f"database {settings.resolved_database_url}, storage {settings.resolved_storage_url}")
    if f"http://{host}:{port}" != settings.api_url.rstrip("/"):
        out.print(f"for the CLI elsewhere: export MEGATRAIN_API_URL=http://{host}:{port}")
    out.print("press Ctrl-C (or run `megatrain down`) to stop")
    write_pid_file(settings, f"http://{host}:{port}")
    try:
        stack.serve_forever()
    finally:
        remove_pid_file(settings)
    out.print("stopped")


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _port_taken(host: str, port: int) -> str:
    """Why `up` cannot listen on host:port: another megatrain stack (another home's), or not."""
    from megatrain.client import Client, MegatrainError

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    try:
        with Client(api_url=url, api_key="", timeout=3.0) as probe:
            probe.health()
    except MegatrainError:
        return f"port {port} on {host} is taken by another program; pick another with --port"
    return (
        f"a megatrain API already answers at {url}, started from another MEGATRAIN_HOME or without "
        "its pid file; stop it there (`megatrain down`), or pick another port with --port"
    )


@app.command("api")
@_server_errors
def api_server(
    host: Annotated[str | None, typer.Option(help="Address to listen on (MEGATRAIN_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (MEGATRAIN_PORT).")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=256, help="API processes (MEGATRAIN_API_WORKERS, default 2).")
    ] = None,
) -> None:
    """Run the API alone, in several processes (production: beside the scheduler and workers).

    Each process is single-threaded Python: parsing, validation and serialisation hold its GIL, so a
    second process on another core serves requests the first cannot; the database is the only state
    they share. Every process serves with the request limits of megatrain.api.server.
    """
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from megatrain.api.app import prepare_backends
    from megatrain.api.server import api_config, raise_open_file_limit

    _configure_logging()
    settings = get_settings()
    prepare_backends(settings)  # once, before the processes start (they would race on SQLite)
    raise_open_file_limit()  # inherited by the worker processes
    n = workers or settings.api_workers
    config = api_config(
        "megatrain.api.app:create_app",
        settings,
        host or settings.host,
        port or settings.port,
        factory=True,
        workers=n,
    )
    if n == 1:
        uvicorn.Server(config).run()
        return
    with _api_metrics_dir():  # set before the processes start: they inherit it
        Multiprocess(config, sockets=[config.bind_socket()]).run()


@contextmanager
def _api_metrics_dir() -> Iterator[None]:
    """PROMETHEUS_MULTIPROC_DIR for the API's processes (they inherit it): a fresh folder of this
    run's on local disk (never a volume other replicas share), removed at its end; unless an
    operator set one, which is then theirs to wipe between runs."""
    import os
    import shutil
    import tempfile

    from megatrain.api.middleware import MULTIPROC_ENV

    if os.environ.get(MULTIPROC_ENV):
        yield
        return
    path = tempfile.mkdtemp(prefix="megatrain-api-metrics-")
    os.environ[MULTIPROC_ENV] = path
    try:
        yield
    finally:
        del os.environ[MULTIPROC_ENV]
        shutil.rmtree(path, ignore_errors=True)


_METRICS_PORT_HELP = "Serve Prometheus metrics at http://0.0.0.0:PORT/metrics (default: none)."


@app.command()
@_server_errors
def scheduler(
    metrics_port: Annotated[int | None, typer.Option(min=1, max=65535, help=_METRICS_PORT_HELP)] = None,
) -> None:
    """Run the scheduler loop alone (production: beside API replicas and Celery workers)."""
    from prometheus_client import start_http_server

    from megatrain.scheduler.loop import Scheduler
    from megatrain.scheduler.metrics import SchedulerMetrics
    from megatrain.scheduler.pools import apply_pools_at_start

    _configure_logging()
    settings = get_settings()
    apply_pools_at_start(settings)
    metrics = SchedulerMetrics()
    if metrics_port is not None:
        start_http_server(metrics_port, registry=metrics.registry)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    _out().print(f"scheduler running against {settings.resolved_database_url}; Ctrl-C stops it")
    Scheduler(settings, metrics=metrics).run(stop)


@app.command()
@_server_errors
def worker(
    concurrency: Annotated[
        int | None,
        typer.Option(min=1, help="Jobs at once (default: the node's slots; lower caps the slots)."),
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(min=1, max=65535, help=_METRICS_PORT_HELP)] = None,
) -> None:
    """Run a Celery worker that executes job shards on this node."""
    from megatrain.worker.celery_app import run_worker

    run_worker(get_settings(), concurrency=concurrency, metrics_port=metrics_port)


@keys_app.command("create")
@_server_errors
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant name; created if new.")],
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
) -> None:
    """Create an API key for a tenant and print it (it is shown only this once)."""
    from megatrain.api.auth import create_api_key
    from megatrain.db.audit import as_operator
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        as_operator(session)  # its changes go in the audit log as the operator's
        key = create_api_key(session, tenant, name)
    _err().print(f"API key for tenant '{escape(tenant)}' (store it now; it is not shown again):")
    typer.echo(key)


@tenants_app.command("set-max-priority")
@_server_errors
def tenants_set_max_priority(
    tenant: Annotated[str, typer.Argument(help="Tenant name; created if new.")],
    priority: Annotated[int, typer.Argument(min=-1000, max=1000, help="Highest resources.priority allowed.")],
) -> None:
    """Cap the priority a tenant's jobs may ask for (default 0: no boost above the others)."""
    from megatrain.api.auth import get_or_create_tenant
    from megatrain.db.audit import as_operator
    from megatrain.db.session import session_scope, upgrade_database

    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        as_operator(session)  # its changes go in the audit log as the operator's
        get_or_create_tenant(session, tenant).max_priority = priority
    _out().print(f"tenant '{escape(tenant)}' may now submit jobs with priority up to {priority}")


def _quota_value(value: str) -> int | None:
    """N (0 or more) or 'none' (unlimited), else a usage error naming the argument."""
    if value.strip().lower() in ("none", "unlimited"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a whole number of devices or 'none'") from None
    if not 0 <= n <= 1_000_000:
        raise typer.BadParameter(f"{n} is outside 0..1000000 devices")
    return n


@tenants_app.command("set-quota")
@_server_errors
def tenants_set_quota(
    tenant: Annotated[str, typer.Argument(help="Tenant name; created if new.")],
    devices: Annotated[
        str, typer.Argument(help="Most devices its running jobs may hold at once, or 'none' (unlimited).")
    ],
) -> None:
    """Cap the devices (GPUs or CPU slots, over all pools) a tenant's jobs may hold at once; a job
    that would go over waits in the queue with that reason."""
    from megatrain.api.auth import get_or_create_tenant
    from megatrain.db.audit import as_operator
    from megatrain.db.session import session_scope, upgrade_database

    quota = _quota_value(devices)
    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    with session_scope(settings.resolved_database_url) as session:
        as_operator(session)  # its changes go in the audit log as the operator's
        get_or_create_tenant(session, tenant).max_devices = quota
    limit = "no device quota" if quota is None else f"a quota of {quota} device{'s' * (quota != 1)}"
    _out().print(f"tenant '{escape(tenant)}' now has {limit}")
