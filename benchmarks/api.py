"""API throughput and latency: POST /v1/jobs and GET /v1/jobs/{id} under N concurrent clients.

Starts a real uvicorn server (in a subprocess, on a free loopback port, with a fresh MEGATRAIN_HOME)
once per database backend (SQLite, and PostgreSQL in a fresh schema of the `test` database), drives
it with an asyncio httpx client, and prints requests/s and p50/p99 latency. No scheduler runs, so
submitted jobs stay queued: this measures the API and its database, not training.

    python benchmarks/api.py                       # both backends, 16 clients, 8 s per phase
    python benchmarks/api.py --backends sqlite --clients 4 --duration 5

The client runs on the same machine as the server and shares its CPU cores: on a small machine the
figures are a lower bound of what the server alone would sustain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

POSTGRES_URL = os.environ.get(
    "MEGATRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@dataclass
class PhaseResult:
    backend: str
    endpoint: str
    clients: int
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    wall_s: float = 0.0

    def percentile_ms(self, q: float) -> float:
        lat = sorted(self.latencies_s)
        if not lat:
            return float("nan")
        return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))]

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.wall_s if self.wall_s else 0.0


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
    """`uvicorn megatrain.api.app:create_app --factory` in a subprocess on a free loopback port."""

    def __init__(self, home: Path, db_url: str, workers: int):
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
        )
        self.log_path = home / "uvicorn.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop(), after the server
        cmd = [
            sys.executable, "-m", "uvicorn", "megatrain.api.app:create_app", "--factory",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers),
            "--log-level", "warning", "--no-access-log",
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


def job_spec(i: int, corpus_url: str) -> dict[str, object]:
    return {
        "name": f"bench-{i}",
        "data": {"train": [{"path": corpus_url}]},
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64},
        "training": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2},
        "resources": {"gpus": 1},
    }


async def run_phase(
    result: PhaseResult,
    client: httpx.AsyncClient,
    make_request,  # type: ignore[no-untyped-def]  # (client, n) -> awaitable httpx.Response
    duration_s: float,
    max_requests: int,
) -> list[httpx.Response]:
    """`result.clients` workers send requests back to back until the deadline or the request cap."""
    ok: list[httpx.Response] = []
    counter = iter(range(max_requests))
    deadline = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < deadline:
            n = next(counter, None)
            if n is None:
                return
            t0 = time.perf_counter()
            try:
                resp = await make_request(client, n)
            except httpx.HTTPError as exc:
                result.errors += 1
                result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"
                continue
            dt = time.perf_counter() - t0
            if resp.is_success:
                result.latencies_s.append(dt)
                ok.append(resp)
            else:
                result.errors += 1
                result.first_error = result.first_error or f"HTTP {resp.status_code}: {resp.text[:300]}"

    t_start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(result.clients)))
    result.wall_s = time.perf_counter() - t_start
    return ok


async def bench_server(
    backend: str,
    server: Server,
    key: str,
    corpus_url: str,
    clients: int,
    duration_s: float,
    max_requests: int,
) -> list[PhaseResult]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits, timeout=30) as client:
        # Warm up: connections, the app's lazy imports, the database's caches.
        warm = PhaseResult(backend, "warmup", clients)
        await run_phase(warm, client, lambda c, n: c.post("/v1/jobs", json=job_spec(n, corpus_url)), 1.0, 200)
        if not warm.latencies_s:
            raise RuntimeError(f"warm-up submissions all failed: {warm.first_error}")

        post = PhaseResult(backend, "POST /v1/jobs", clients)
        created = await run_phase(
            post,
            client,
            lambda c, n: c.post("/v1/jobs", json=job_spec(n, corpus_url)),
            duration_s,
            max_requests,
        )
        ids = [r.json()["id"] for r in created] or [r.json()["id"] for r in await run_phase(
            PhaseResult(backend, "seed", 1), client,
            lambda c, n: c.post("/v1/jobs", json=job_spec(n, corpus_url)), 5.0, 10,
        )]  # fmt: skip

        get = PhaseResult(backend, "GET /v1/jobs/{id}", clients)
        await run_phase(
            get, client, lambda c, n: c.get(f"/v1/jobs/{ids[n % len(ids)]}"), duration_s, max_requests
        )
    return [post, get]


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
            server = Server(home, db_url, args.workers)
            server.wait_ready()
            return asyncio.run(
                bench_server(
                    backend, server, key, corpus.as_uri(), args.clients, args.duration, args.max_requests
                )
            )
        except Exception:
            if server is not None:
                print(f"--- uvicorn log ({backend}) ---\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            if server is not None:
                server.stop()
            if schema:
                drop_postgres_schema(schema)


def print_table(results: list[PhaseResult]) -> None:
    header = f"{'backend':<9} {'endpoint':<19} {'clients':>7} {'requests':>8} {'errors':>6} "
    header += f"{'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.backend:<9} {r.endpoint:<19} {r.clients:>7} {len(r.latencies_s):>8} {r.errors:>6} "
            f"{r.rps:>8.0f} {r.percentile_ms(0.50):>8.1f} {r.percentile_ms(0.99):>8.1f}"
        )
    for r in results:
        if r.first_error:
            print(f"first error ({r.backend}, {r.endpoint}): {r.first_error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite,postgres")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per phase (default 8)")
    parser.add_argument("--max-requests", type=int, default=50_000, help="cap on requests per phase")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default 1)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.workers < 1:
        parser.error("--clients and --workers must be >= 1 and --duration > 0")

    results: list[PhaseResult] = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend not in ("sqlite", "postgres"):
            parser.error(f"unknown backend {backend!r}")
        results += run_backend(backend, args)
    print(f"\nmegatrain API, uvicorn workers={args.workers}, {os.cpu_count()} CPUs shared with the client\n")
    print_table(results)
    return 0 if results and all(r.latencies_s for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
