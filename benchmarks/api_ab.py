"""The API's server CPU per request, an older checkout against this one, side by side.

On a shared machine the CPU a request costs swings 2x from one minute to the next, so comparing two
runs of `benchmarks/api.py` minutes apart measures the neighbours. Here both servers run at once
(`megatrain api`, access log on, each with its own SQLite file or PostgreSQL schema), the old one
importing megatrain from OLD_ROOT, and requests go one at a time in alternating blocks to each:
both see the same machine, and the ratio of their CPU (from /proc, every process of the server)
per request is the measurement.

    git worktree add /tmp/old REV
    python benchmarks/api_ab.py /tmp/old --backends sqlite,postgres
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from _load import tree_cpu_s
from api import Server, drop_postgres_schema, job_spec, make_postgres_schema, prepare_database

REPO = Path(__file__).resolve().parent.parent
SEED_JOBS = 80
BLOCK = 25
"""Requests sent to one server before the other's turn."""


class Side:
    """One server and a client of it, with a tenant's jobs to read."""

    def __init__(self, root: Path, home: Path, backend: str):
        self.names = itertools.count()
        corpus = home / "data" / "corpus.jsonl"
        corpus.parent.mkdir(parents=True)
        corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(100)))
        self.corpus = corpus.as_uri()
        self.schema = None
        if backend == "sqlite":
            db_url = f"sqlite:///{home / 'megatrain.db'}"
        else:
            made = make_postgres_schema()
            if made is None:
                raise SystemExit("PostgreSQL is unreachable")
            db_url, self.schema = made
        key = prepare_database(db_url, home)
        with _pythonpath(root):
            self.server = Server(home, db_url, workers=1, max_streams=64)
        self.server.wait_ready()
        self.client = httpx.Client(
            base_url=self.server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        for _ in range(SEED_JOBS):
            self.submit()
        items = self.client.get("/v1/jobs", params={"limit": 500}).json()["items"]
        self.ids = itertools.cycle([job["id"] for job in items])

    def submit(self) -> None:
        self.client.post("/v1/jobs", json=job_spec(f"job-{next(self.names)}", self.corpus)).raise_for_status()

    def cpu_s(self) -> float:
        return tree_cpu_s(self.server.proc.pid)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()
        if self.schema:
            drop_postgres_schema(self.schema)


@contextmanager
def _pythonpath(root: Path) -> Iterator[None]:
    """Servers started inside import megatrain from `root` (run from a folder that holds none)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(root)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before


PHASES: dict[str, tuple[Callable[[Side], Any], float]] = {
    "POST /v1/jobs": (lambda s: s.submit(), 1 / 3),
    "GET /v1/jobs/{id}": (lambda s: s.client.get(f"/v1/jobs/{next(s.ids)}").raise_for_status(), 1.0),
    "GET /v1/jobs?limit=50": (
        lambda s: s.client.get("/v1/jobs", params={"limit": 50}).raise_for_status(),
        1 / 3,
    ),
    "GET /healthz": (lambda s: s.client.get("/healthz").raise_for_status(), 1.0),
}
"""Each phase's request and its share of --requests."""


def compare(old: Side, new: Side, requests: int) -> list[tuple[str, float, float]]:
    """(phase, old ms, new ms) of server CPU per request."""
    rows = []
    for label, (request, share) in PHASES.items():
        cpu = {"old": 0.0, "new": 0.0}
        sides = {"old": old, "new": new}
        for side in sides.values():
            for _ in range(10):
                request(side)  # warm: this phase's code paths and queries
        blocks = max(1, int(requests * share) // BLOCK)
        for _ in range(blocks):
            for name, side in sides.items():
                start = side.cpu_s()
                for _ in range(BLOCK):
                    request(side)
                cpu[name] += side.cpu_s() - start
        n = blocks * BLOCK
        rows.append((label, 1000 * cpu["old"] / n, 1000 * cpu["new"] / n))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old_root", type=Path, help="a checkout of the older code (git worktree add DIR REV)")
    p.add_argument("--backends", default="sqlite", help="comma-separated: sqlite,postgres")
    p.add_argument("--requests", type=int, default=900, help="GET requests per server (POST, list: a third)")
    args = p.parse_args(argv)
    if not (args.old_root / "megatrain" / "__init__.py").is_file():
        p.error(f"{args.old_root} holds no megatrain/ package")
    print(f"{'backend':9s} {'phase':24s} {'old ms':>8s} {'new ms':>8s} {'new/old':>8s}")
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix="megatrain-ab-") as tmp:
            os.chdir(tmp)  # neither server finds a megatrain/ in its working directory
            old = Side(args.old_root.resolve(), Path(tmp) / "old", backend)
            try:
                new = Side(REPO, Path(tmp) / "new", backend)
                try:
                    for label, o, n in compare(old, new, args.requests):
                        print(f"{backend:9s} {label:24s} {o:8.2f} {n:8.2f} {n / o:8.2f}", flush=True)
                finally:
                    new.stop()
            finally:
                old.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
