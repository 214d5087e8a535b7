"""The API load test: POST /v1/jobs, GET /v1/jobs/{id}, GET /v1/jobs (a page of 50) under N clients,
then N live SSE streams on a training job, each phase with /healthz probed every 50 ms beside it.

Starts `megatrain api`, the production entry point with its access log on (a subprocess on a free
loopback port, fresh MEGATRAIN_HOME) per database backend (SQLite, and PostgreSQL in a fresh schema
of the `test` database). No scheduler runs: jobs
stay queued, and the streams' job is marked running and fed metric rows by this process, as the
engine's reporter would, then finished; every stream must receive every row once, in order, then
`event: end`. Request phases are driven by `wrk` when it is on PATH (else asyncio httpx); streams by
a small asyncio SSE reader (benchmarks/_load_streams.py).

    python benchmarks/api.py                         # both backends, 32 clients, 8 s phases, 60 s streams
    python benchmarks/api.py --backends sqlite --duration 2 --streams 20 --stream-seconds 5   # smoke

The client runs on the same machine as the server and shares its CPU cores: on a small machine the
figures are a lower bound of what the server alone would sustain.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import httpx
from _load import HealthzProber, PhaseResult, healthz_stats, run_httpx, run_wrk, tree_cpu_s, wrk_script
from _load_streams import run_streams

POSTGRES_URL = os.environ.get(
    "MEGATRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _psycopg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def make_postgres_schema() -> tuple[str, str] | None:
    """(url whose connections use a new empty schema, schema), or None if PostgreSQL is unreachable."""
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(_psycopg_dsn(POSTGRES_URL), autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        print(f"PostgreSQL unreachable at {POSTGRES_URL} ({exc}); skipping it", file=sys.stderr)
        return None
    sep = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}", schema


def drop_postgres_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(_psycopg_dsn(POSTGRES_URL), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def prepare_database(db_url: str, home: Path) -> str:
    """Migrate the database, register this machine's node (as a worker would) and create a tenant's
    API key; returns the plaintext key."""
    from megatrain.api.auth import create_api_key
    from megatrain.db.session import get_engine, session_scope, upgrade_database
    from megatrain.settings import Settings
    from megatrain.worker.nodes import ensure_local_pool

    upgrade_database(db_url)
    with session_scope(db_url) as session:
        ensure_local_pool(session, Settings(home=home, database_url=db_url, cpu_slots=4))
        key = create_api_key(session, "bench", "api-benchmark")
    get_engine(db_url).dispose()
    return key


class Server:
    """`megatrain api` (the production entry point: its request limits, access log on) in a
    subprocess on a free loopback port."""

    def __init__(self, home: Path, db_url: str, workers: int, max_streams: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
        env.update(
            MEGATRAIN_HOME=str(home),
            MEGATRAIN_DATABASE_URL=db_url,
            MEGATRAIN_ALLOWED_DATA_ROOTS=home.as_uri(),
            MEGATRAIN_HOST="127.0.0.1",
            MEGATRAIN_PORT=str(self.port),
            MEGATRAIN_API_URL=self.url,
            # The load test's streams all belong to one tenant; its cap (default 256) is not measured.
            MEGATRAIN_MAX_STREAMS_PER_TENANT=str(max_streams),
            # ... and all come from one address (megatrain.api.server caps a client's connections).
            MEGATRAIN_HTTP_MAX_CONNECTIONS_PER_CLIENT=str(max_streams + 256),
        )
        self.log_path = home / "uvicorn.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop(), after the server
        cmd = [
            sys.executable, "-m", "megatrain.cli", "api",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # Any HTTP answer means the app is up; /healthz needs no key.
                httpx.get(f"{self.url}/healthz", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError(f"uvicorn did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self._log.close()


PHASES = {"post": "POST /v1/jobs", "get": "GET /v1/jobs/{id}", "list": "GET /v1/jobs?limit=50"}
ALL_PHASES = (*PHASES, "streams")
BACKENDS = ("sqlite", "postgres")
DEFAULT_STREAMS = {"sqlite": 200, "postgres": 1000}
SEED_JOBS = 300
"""The GET and list phases read over at least this many jobs."""
NAME_PLACEHOLDER = "__NAME__"


def job_spec(name: str, corpus_url: str) -> dict[str, object]:
    return {
        "name": name,
        "data": {"train": [{"path": corpus_url}]},
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64},
        "training": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2},
        "resources": {"devices": 1},
    }


async def job_ids(client: httpx.AsyncClient) -> list[str]:
    resp = await client.get("/v1/jobs", params={"limit": 500})
    resp.raise_for_status()
    return [job["id"] for job in resp.json()["items"]]


async def request_phase(
    phase: str,
    backend: str,
    args: argparse.Namespace,
    server: Server,
    key: str,
    client: httpx.AsyncClient,
    corpus_url: str,
    ids: list[str],
    workdir: Path,
) -> PhaseResult:
    result = PhaseResult(backend, PHASES[phase], args.client, args.clients)
    names = itertools.count()
    prober = await asyncio.to_thread(HealthzProber, server.url)
    started = time.monotonic()
    cpu_before = tree_cpu_s(server.proc.pid)
    try:
        if args.client == "wrk":
            if phase == "post":
                prefix, suffix = json.dumps(job_spec(NAME_PLACEHOLDER, corpus_url)).split(NAME_PLACEHOLDER)
                script = wrk_script(key, post=("/v1/jobs", prefix, suffix))
            else:
                paths = [f"/v1/jobs/{i}" for i in ids] if phase == "get" else ["/v1/jobs?limit=50"]
                script = wrk_script(key, paths=paths)
            summary = await run_wrk(args.wrk, f"{server.url}/", script, args.clients, args.duration, workdir)
            result.count, result.wall_s = summary.successful, summary.wall_s
            result.errors, result.server_errors = summary.errors, summary.server_errors
            result.p50_ms, result.p99_ms = summary.p50_ms, summary.p99_ms
            if summary.errors:
                result.first_error = f"wrk counted {summary.errors} errors (non-2xx or socket)"
        else:
            requests = {
                "post": lambda c, _: c.post("/v1/jobs", json=job_spec(f"load-{next(names)}", corpus_url)),
                "get": lambda c, n: c.get(f"/v1/jobs/{ids[n % len(ids)]}"),
                "list": lambda c, _: c.get("/v1/jobs", params={"limit": 50}),
            }
            await run_httpx(result, client, requests[phase], args.duration, args.max_requests)
    finally:
        ended = time.monotonic()
        cpu_s = tree_cpu_s(server.proc.pid) - cpu_before
        result.healthz = healthz_stats(await asyncio.to_thread(prober.stop), started, ended)
    # The probes' requests (every 50 ms) are served too: counted with the phase's own.
    served = result.count + result.errors + result.healthz.probes
    result.cpu_ms_per_request = 1000 * cpu_s / served if served else math.nan
    return result


async def bench_server(
    backend: str,
    server: Server,
    key: str,
    db_url: str,
    corpus_url: str,
    args: argparse.Namespace,
    workdir: Path,
) -> list[PhaseResult]:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    headers = {"Authorization": f"Bearer {key}"}
    names = itertools.count()
    results: list[PhaseResult] = []

    def submit(c: httpx.AsyncClient, _: int):  # type: ignore[no-untyped-def]
        return c.post("/v1/jobs", json=job_spec(f"seed-{next(names)}", corpus_url))

    async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=30) as client:
        # Warm up: connections, the app's lazy imports, the database's caches.
        warm = PhaseResult(backend, "warm-up", "httpx", args.clients)
        await run_httpx(warm, client, submit, 1.0, 200)
        if not warm.count:
            raise RuntimeError(f"warm-up submissions all failed: {warm.first_error}")
        if "post" in args.phases:
            results.append(
                await request_phase("post", backend, args, server, key, client, corpus_url, [], workdir)
            )
        ids = await job_ids(client)
        if len(ids) < SEED_JOBS and {"get", "list"} & set(args.phases):
            seed = PhaseResult(backend, "seed", "httpx", args.clients)
            await run_httpx(seed, client, submit, 600, SEED_JOBS - len(ids))
            ids = await job_ids(client)
        for phase in ("get", "list"):
            if phase in args.phases:
                results.append(
                    await request_phase(phase, backend, args, server, key, client, corpus_url, ids, workdir)
                )
        if "streams" in args.phases:
            resp = await submit(client, 0)
            resp.raise_for_status()
            results.append(
                await run_streams(
                    backend,
                    server.url,
                    key,
                    db_url,
                    resp.json()["id"],
                    args.streams[backend],
                    rate=args.stream_rate,
                    hold_s=args.stream_seconds,
                )
            )
    return results


def run_backend(backend: str, args: argparse.Namespace) -> list[PhaseResult]:
    schema = None
    with tempfile.TemporaryDirectory(prefix="megatrain-bench-") as tmp:
        home = Path(tmp) / "home"
        corpus = home / "data" / "corpus.jsonl"
        corpus.parent.mkdir(parents=True)
        corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(100)))
        if backend == "sqlite":
            db_url = f"sqlite:///{home / 'megatrain.db'}"
        else:
            made = make_postgres_schema()
            if made is None:
                return []
            db_url, schema = made
        server = None
        try:
            key = prepare_database(db_url, home)
            server = Server(home, db_url, args.workers, max_streams=args.streams[backend] + 16)
            server.wait_ready()
            return asyncio.run(bench_server(backend, server, key, db_url, corpus.as_uri(), args, Path(tmp)))
        except Exception:
            if server is not None:
                print(f"--- uvicorn log ({backend}) ---\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            if server is not None:
                server.stop()
            if schema:
                drop_postgres_schema(schema)


def _ms(value: float) -> str:
    return f"{value:8.1f}" if not math.isnan(value) else f"{'-':>8}"


def _cpu(value: float) -> str:
    return f"{value:7.2f}" if not math.isnan(value) else f"{'-':>7}"


def print_table(results: list[PhaseResult]) -> None:
    header = (
        f"{'backend':<9} {'phase':<27} {'client':<6} {'conc':>5} {'count':>7} {'errors':>6} {'5xx':>4} "
        f"{'per s':>7} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms':>7} {'healthz p50':>11} {'p99':>8} {'max':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        h = r.healthz
        print(
            f"{r.backend:<9} {r.phase:<27} {r.client:<6} {r.concurrency:>5} {r.count:>7} {r.errors:>6} "
            f"{r.server_errors:>4} {r.rate:>7.0f} {_ms(r.p50_ms)} {_ms(r.p99_ms)} "
            f"{_cpu(r.cpu_ms_per_request)} {_ms(h.p50_ms):>11} {_ms(h.p99_ms)} {_ms(h.max_ms)}"
        )
    for r in results:
        if r.streams:
            s = r.streams
            print(
                f"\nstreams ({r.backend}): {s['opened']}/{r.concurrency} opened in {s['open_s']} s, held "
                f"{s['hold_s']:g} s, {s['complete']} complete (every row once, in order, then `end`), "
                f"{s['disconnects']} disconnects, {s['not_200']} not 200; {s['rows_written']} rows written; "
                "count = row events received, p50/p99 = a row's delay from commit to reader"
            )
            for part in ("open", "hold", "end"):
                h = s[f"healthz_{part}"]
                print(
                    f"  healthz while streams {part + ':':<6} {h['probes']:>5} probes, {h['errors']} errors, "
                    f"p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms"
                )
    for r in results:
        if r.first_error:
            print(f"first error ({r.backend}, {r.phase}): {r.first_error}", file=sys.stderr)
        if r.healthz.errors:
            print(
                f"healthz errors ({r.backend}, {r.phase}): {r.healthz.errors}, first: {r.healthz.first_error}"
            )


def print_targets(results: list[PhaseResult]) -> None:
    """Issue 12's targets (2-core machine, client beside the server), each with what was measured."""
    print("\ntargets:")
    checks: list[tuple[str, bool]] = []
    for r in results:
        where = f"{r.backend}, {r.phase} at {r.concurrency}"
        if r.phase == PHASES["get"]:
            checks.append((f"p99 < 150 ms ({where} clients): {r.p99_ms:.1f} ms", r.p99_ms < 150))
        if r.phase == PHASES["post"]:
            checks.append((f"p99 < 300 ms ({where} clients): {r.p99_ms:.1f} ms", r.p99_ms < 300))
        if r.streams:
            hz = r.healthz.p99_ms
            parts = "/".join(f"{r.streams[f'healthz_{p}']['p99_ms']:.0f}" for p in ("open", "hold", "end"))
            text = f"healthz p99 < 100 ms throughout ({where} streams): {hz:.1f} ms (open/hold/end {parts})"
            checks.append((text, hz < 100))
            complete = r.streams["complete"]
            goal = DEFAULT_STREAMS[r.backend]
            text = f"{goal} streams complete, no 5xx ({where}): {complete} complete, {r.server_errors} 5xx"
            checks.append((text, complete == r.concurrency >= goal and not r.server_errors))
        # Issue 31's: the server's CPU per request (every process of it; the database's not counted).
        cpu_goal = {PHASES["get"]: 1.0, PHASES["list"]: 3.0, PHASES["post"]: 3.0}.get(r.phase)
        if cpu_goal is not None and not math.isnan(r.cpu_ms_per_request):
            text = f"server CPU ≤ {cpu_goal:g} ms per request ({where}): {r.cpu_ms_per_request:.2f} ms"
            checks.append((text, r.cpu_ms_per_request <= cpu_goal))
    for text, ok in checks:
        print(f"  {'ok  ' if ok else 'MISS'} {text}")


def parse_streams(text: str) -> dict[str, int]:
    """`N` (every backend) or `backend=N,...` (the others keep their defaults)."""
    if text.strip().isdigit():
        return dict.fromkeys(BACKENDS, int(text))
    counts = dict(DEFAULT_STREAMS)
    for part in text.split(","):
        backend, _, n = part.partition("=")
        if backend.strip() not in BACKENDS or not n.strip().isdigit():
            raise ValueError(f"--streams: {part!r} is not a count or backend=count ({', '.join(BACKENDS)})")
        counts[backend.strip()] = int(n)
    return counts


def raise_open_files_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (the server subprocess inherits it); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite,postgres")
    parser.add_argument(
        "--phases", default=",".join(ALL_PHASES), help="comma-separated: post,get,list,streams"
    )
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients of request phases (32)")
    parser.add_argument(
        "--duration", type=float, default=8.0, help="seconds per request phase (8; wrk: whole s)"
    )
    parser.add_argument("--client", choices=("wrk", "httpx"), help="request phases' client (wrk if on PATH)")
    parser.add_argument("--max-requests", type=int, default=50_000, help="httpx: cap on requests per phase")
    parser.add_argument("--streams", default="sqlite=200,postgres=1000", help="N or backend=N,... (200/1000)")
    parser.add_argument(
        "--stream-rate", type=float, default=2.0, help="metric rows/s written during streams (2)"
    )
    parser.add_argument(
        "--stream-seconds", type=float, default=60.0, help="hold streams this long once open (60)"
    )
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (1)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    for name in ("clients", "duration", "stream_rate", "stream_seconds", "workers", "max_requests"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if bad := [b for b in args.backends if b not in BACKENDS] or not args.backends:
        parser.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    if bad := [p for p in args.phases if p not in ALL_PHASES] or not args.phases:
        parser.error(f"--phases: unknown {bad}; choose from {', '.join(ALL_PHASES)}")
    try:
        args.streams = parse_streams(args.streams)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.streams.values()) < 1:
        parser.error(f"--streams must be >= 1, got {args.streams}")
    args.wrk = shutil.which("wrk")
    args.client = args.client or ("wrk" if args.wrk else "httpx")
    if args.client == "wrk" and not args.wrk:
        parser.error("--client wrk: wrk is not on PATH (apt-get install wrk), or use --client httpx")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    open_files = raise_open_files_limit()
    if "streams" in args.phases and open_files < 2 * max(args.streams.values()) + 256:
        print(
            f"warning: RLIMIT_NOFILE is {open_files}: too few for client and server sockets", file=sys.stderr
        )
    results: list[PhaseResult] = []
    for backend in args.backends:
        results += run_backend(backend, args)
    print(
        f"\nmegatrain API, uvicorn workers={args.workers}, {os.cpu_count()} CPUs shared with the client "
        f"(request phases: {args.client}, {args.clients} clients, {args.duration:g} s; streams: sse, "
        f"{args.stream_rate:g} rows/s; healthz probed every 50 ms from its own process)\n"
    )
    print_table(results)
    print_targets(results)
    if args.json:
        report = {"args": sys.argv[1:], "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(report, default=str))
    failed = [r for r in results if not r.count or r.errors or r.healthz.errors]
    return 0 if results and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
