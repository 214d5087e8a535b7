"""The request side of benchmarks/api.py: a phase's result, the /healthz prober, and the two load
clients (wrk with a generated Lua script, or asyncio httpx)."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx


def percentile_ms(latencies_s: list[float], q: float) -> float:
    """Nearest-rank percentile `q` (0..1] of latencies in seconds, in ms; nan when there are none."""
    if not latencies_s:
        return math.nan
    ordered = sorted(latencies_s)
    return 1000 * ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class HealthzStats:
    probes: int = 0
    errors: int = 0
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    first_error: str = ""


@dataclass
class PhaseResult:
    backend: str
    phase: str
    client: str
    """Which client drove it: wrk, httpx, or sse (the benchmark's own stream reader)."""
    concurrency: int
    """Connections sending requests back to back, or streams held open."""
    count: int = 0
    """Successful requests, or row events received over all streams."""
    errors: int = 0
    """Failed requests (non-2xx or transport), or streams that failed any check."""
    server_errors: int = 0
    """Of those, 5xx answers."""
    wall_s: float = 0.0
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    """Request latency; for streams, each row's delay from its commit to its arrival at a reader."""
    healthz: HealthzStats = field(default_factory=HealthzStats)
    first_error: str = ""
    streams: dict[str, Any] | None = None
    """The streams phase's own figures (opened, complete, disconnects, rows written, ...)."""
    cpu_ms_per_request: float = math.nan
    """The server's CPU time (every process of it, user + system) over the phase, per request."""

    @property
    def rate(self) -> float:
        return self.count / self.wall_s if self.wall_s else 0.0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` and every process under it (uvicorn's
    workers), from /proc; the dead children of a live process are counted in its own times."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        times[child] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    total = 0.0
    for child, cpu in times.items():
        node = child
        while node and node != pid:
            node = parents.get(node, 0)
        if node == pid:
            total += cpu
    return total


# --- /healthz prober ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    sent_at: float
    """time.monotonic(), which is one clock for every process of the machine."""
    latency_s: float | None
    """None: no answer (transport error)."""
    error: str = ""


def _probe(url: str, interval_s: float, stop: Any, ready: Any, out: Connection) -> None:
    probes: list[Probe] = []
    with httpx.Client(timeout=10) as client:
        next_at = time.monotonic()
        while True:
            start = time.monotonic()
            try:
                resp = client.get(url)
                error = "" if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:200]}"
                probes.append(Probe(start, time.monotonic() - start, error))
            except httpx.HTTPError as exc:
                probes.append(Probe(start, None, f"{type(exc).__name__}: {exc}"))
            ready.set()
            if stop.is_set():
                break
            # Fixed rate without bursts: a slow probe delays the next one, never doubles it up.
            next_at = max(next_at + interval_s, time.monotonic())
            stop.wait(max(0.0, next_at - time.monotonic()))
    out.send(probes)


def healthz_stats(probes: list[Probe], since: float = -math.inf, until: float = math.inf) -> HealthzStats:
    """The probes sent in [since, until): latency of those answered (503s included), and errors."""
    window = [p for p in probes if since <= p.sent_at < until]
    latencies = [p.latency_s for p in window if p.latency_s is not None]
    errors = [p.error for p in window if p.error]
    return HealthzStats(
        probes=len(window),
        errors=len(errors),
        p50_ms=percentile_ms(latencies, 0.50),
        p99_ms=percentile_ms(latencies, 0.99),
        max_ms=1000 * max(latencies) if latencies else math.nan,
        first_error=errors[0] if errors else "",
    )


class HealthzProber:
    """GET /healthz every `interval_s` from a process of its own, so that a load client's busy event
    loop does not inflate the server's figure; `stop()` gives the probes."""

    def __init__(self, url: str, interval_s: float = 0.05):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads and sockets
        self._stop, ready = ctx.Event(), ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe, args=(f"{url}/healthz", interval_s, self._stop, ready, send))
        self._proc.start()
        deadline = time.monotonic() + 60
        while not ready.wait(0.2):
            if not self._proc.is_alive():
                raise RuntimeError(
                    f"the /healthz prober exited with {self._proc.exitcode} before its first probe"
                )
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError("the /healthz prober made no probe within 60 s")

    def stop(self) -> list[Probe]:
        self._stop.set()
        if not self._recv.poll(30):
            self._proc.kill()
            raise RuntimeError("the /healthz prober did not report within 30 s of being stopped")
        probes: list[Probe] = self._recv.recv()
        self._proc.join(10)
        return probes


# --- wrk ---------------------------------------------------------------------------------------

# Counts 5xx per thread and prints one JSON line from wrk's own HdrHistogram at the end. Globals set
# before this (path, paths, body_prefix/suffix, run) are the phase's; `tid` is set by setup().
_WRK_LUA = r"""
local threads = {}
function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end
s5xx = 0
local n = 0
function request()
  n = n + 1
  if body_prefix then
    local name = run .. "-" .. tid .. "-" .. n
    return wrk.format("POST", path, nil, body_prefix .. name .. body_suffix)
  end
  return wrk.format("GET", paths[(n % #paths) + 1])
end
function response(status, headers, body)
  if status >= 500 then s5xx = s5xx + 1 end
end
function done(summary, latency, requests)
  local s5 = 0
  for _, t in ipairs(threads) do s5 = s5 + t:get("s5xx") end
  local e = summary.errors
  io.write(string.format('MEGATRAIN_WRK {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
    '"max_us":%d,"connect":%d,"read":%d,"write":%d,"timeout":%d,"status":%d,"s5xx":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.timeout, e.status, s5))
end
"""


def lua_string(s: str) -> str:
    """`s` as a double-quoted Lua string literal."""
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def wrk_script(key: str, *, paths: list[str] | None = None, post: tuple[str, str, str] | None = None) -> str:
    """A wrk script that GETs `paths` round-robin, or POSTs (path, body_prefix, body_suffix) with a
    unique name (run-thread-n) between prefix and suffix."""
    if (paths is None) == (post is None):
        raise ValueError("give exactly one of paths= and post=")
    lines = [
        f'wrk.headers["Authorization"] = {lua_string("Bearer " + key)}',
        f"run = {lua_string(f'wrk{time.time_ns() % 10**9}')}",
    ]
    if post is not None:
        path, prefix, suffix = post
        lines += [
            'wrk.headers["Content-Type"] = "application/json"',
            f"path = {lua_string(path)}",
            f"body_prefix = {lua_string(prefix)}",
            f"body_suffix = {lua_string(suffix)}",
        ]
    else:
        assert paths
        lines.append("paths = {" + ", ".join(lua_string(p) for p in paths) + "}")
    return "\n".join(lines) + "\n" + _WRK_LUA


@dataclass
class WrkSummary:
    requests: int
    """Answers of any status."""
    successful: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    """Non-2xx/3xx answers plus socket errors (connect, read, write, timeout)."""
    server_errors: int


def parse_wrk(stdout: str) -> WrkSummary:
    """The summary line our script's done() prints."""
    match = re.search(r"^MEGATRAIN_WRK (\{.*\})$", stdout, re.MULTILINE)
    if match is None:
        raise ValueError(f"wrk printed no MEGATRAIN_WRK summary line; its output:\n{stdout[-2000:]}")
    d = json.loads(match.group(1))
    return WrkSummary(
        requests=d["requests"],
        successful=d["requests"] - d["status"],
        wall_s=d["duration_us"] / 1e6,
        p50_ms=d["p50_us"] / 1000,
        p99_ms=d["p99_us"] / 1000,
        errors=d["status"] + d["connect"] + d["read"] + d["write"] + d["timeout"],
        server_errors=d["s5xx"],
    )


async def run_wrk(
    wrk: str, url: str, script: str, clients: int, duration_s: float, workdir: Path
) -> WrkSummary:
    """One wrk thread (the server is one Python process: one thread outpaces it and leaves the other
    core to the server); `duration_s` rounded to whole seconds, wrk's unit."""
    lua = workdir / "phase.lua"
    lua.write_text(script)
    cmd = [
        wrk, "-t1", f"-c{clients}", f"-d{max(1, round(duration_s))}s", "--timeout", "30s",
        "--latency", "-s", str(lua), url,
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{text[-2000:]}")
    return parse_wrk(text)


# --- httpx -------------------------------------------------------------------------------------

MakeRequest = Callable[[httpx.AsyncClient, int], Awaitable[httpx.Response]]


async def run_httpx(
    result: PhaseResult,
    client: httpx.AsyncClient,
    make_request: MakeRequest,
    duration_s: float,
    max_requests: int,
) -> list[httpx.Response]:
    """`result.concurrency` workers send requests back to back until the deadline or the request cap;
    fills `result` (latency of successful requests) and returns the successful responses."""
    ok: list[httpx.Response] = []
    latencies: list[float] = []
    counter = iter(range(max_requests))
    deadline = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < deadline and (n := next(counter, None)) is not None:
            start = time.perf_counter()
            try:
                resp = await make_request(client, n)
            except httpx.HTTPError as exc:
                result.errors += 1
                result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"
                continue
            if resp.is_success:
                latencies.append(time.perf_counter() - start)
                ok.append(resp)
            else:
                result.errors += 1
                result.server_errors += resp.status_code >= 500
                result.first_error = result.first_error or f"HTTP {resp.status_code}: {resp.text[:300]}"

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(result.concurrency)))
    result.wall_s = time.perf_counter() - start
    result.count = len(latencies)
    result.p50_ms, result.p99_ms = percentile_ms(latencies, 0.50), percentile_ms(latencies, 0.99)
    return ok
