"""The streams phase of benchmarks/api.py: N live SSE streams on one running job while a writer adds
its metric rows at a steady rate, as the engine's reporter does; then the job finishes and every
stream is checked for every row, once, in order, then `event: end`.

The streams are read by a small HTTP/1.1 client on asyncio's own sockets rather than httpx: a
thousand streams through httpx cost the shared CPU more than the server does, and its pool scans
all its connections for each new one.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field

from _load import HealthzProber, PhaseResult, healthz_stats, percentile_ms

END_STATUS = "succeeded"


@dataclass(frozen=True)
class Event:
    event: str
    id: int | None
    data: str


class SseParser:
    """Server-Sent Events from byte chunks cut anywhere; comments and `retry:` blocks are skipped."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        events = []
        while (end := self._buf.find(b"\n\n")) >= 0:
            block, self._buf = self._buf[:end], self._buf[end + 2 :]
            name, event_id, data = "message", None, []
            for line in block.decode().split("\n"):
                key, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if key == "event":
                    name = value
                elif key == "id":
                    event_id = int(value)
                elif key == "data":
                    data.append(value)
            if data:
                events.append(Event(name, event_id, "\n".join(data)))
        return events


def stream_problem(
    steps: list[int], rows_written: int, end_status: str | None, expected_end: str = END_STATUS
) -> str | None:
    """What is wrong with a stream that received `steps` while rows 1..rows_written were written,
    or None: every row once, in order, then the end."""
    if steps != list(range(1, rows_written + 1)):
        seen: set[int] = set()
        for step in steps:
            if step in seen:
                return f"step {step} twice"
            seen.add(step)
        if extra := sorted(seen - set(range(1, rows_written + 1))):
            return f"unexpected step {extra[0]}"
        if missing := sorted(set(range(1, rows_written + 1)) - seen):
            return f"missing step {missing[0]} ({len(missing)} of {rows_written} missing)"
        return f"rows out of order: {steps[:10]}..."
    if end_status is None:
        return "no `event: end`"
    if end_status != expected_end:
        return f"ended {end_status!r}, expected {expected_end!r}"
    return None


@dataclass
class Stream:
    status: int | None = None
    opened_at: float = 0.0
    steps: list[int] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    end_status: str | None = None
    error: str = ""
    """Transport failure, disconnect before the end, or an answer other than 200."""
    disconnected: bool = False
    """Answered 200, then lost before `event: end`."""
    opened: asyncio.Event = field(default_factory=asyncio.Event)


async def follow(host: str, port: int, path: str, key: str, stream: Stream) -> None:
    """Read one SSE response into `stream` until the server ends it; never raises."""
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        stream.status, stream.opened_at = int(head.split(b" ", 2)[1]), time.monotonic()
        stream.opened.set()
        if stream.status != 200:
            body = await asyncio.wait_for(reader.read(2000), 5)
            stream.error = f"HTTP {stream.status}: {body[:300]!r}"
            return
        chunked = b"transfer-encoding: chunked" in head.lower()
        parser = SseParser()
        while True:
            if chunked:
                size_line = await reader.readline()
                if not size_line:
                    break
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            elif not (data := await reader.read(65536)):
                break
            now = time.monotonic()
            for event in parser.feed(data):
                row = json.loads(event.data)
                if event.event == "end":
                    stream.end_status = row.get("status")
                elif event.id != row["step"]:
                    stream.error = f"event id {event.id} for step {row['step']}"
                else:
                    stream.steps.append(row["step"])
                    stream.received_at.append(now)
        if stream.end_status is None:
            stream.disconnected = True
            stream.error = stream.error or "disconnected before `event: end`"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, KeyError) as exc:
        stream.disconnected = stream.status == 200 and isinstance(exc, OSError | asyncio.IncompleteReadError)
        stream.error = stream.error or f"{type(exc).__name__}: {exc}"
    finally:
        stream.opened.set()
        if writer is not None:
            writer.close()


class MetricWriter(threading.Thread):
    """Adds the job's train rows, one commit per row at `rate` rows/s, as the engine's reporter does;
    remembers when each row was committed."""

    def __init__(self, db_url: str, job_id: str, rate: float):
        super().__init__(name="metric-writer", daemon=True)
        self.db_url, self.job_id, self.interval_s = db_url, job_id, 1.0 / rate
        self.committed_at: dict[int, float] = {}
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        from megatrain.db.session import session_scope
        from megatrain.worker.ingest import ingest_metrics

        jitter = random.Random(0)
        next_at = time.monotonic()
        try:
            while not self._stop_event.is_set():
                step = len(self.committed_at) + 1
                loss = 10.0 / (1 + 0.01 * step)
                row = {"loss": loss, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 12000.0, "mfu": 0.41}
                with session_scope(self.db_url) as s:  # as the runner's reports are stored
                    ingest_metrics(s, self.job_id, [{"step": step, **row}])
                self.committed_at[step] = time.monotonic()
                # Jittered around the mean interval, so that the rows do not phase-lock with the
                # server's polls (a steady 0.5 s writer against a 0.5 s poller would see one delay only).
                next_at = max(next_at + self.interval_s * jitter.uniform(0.5, 1.5), time.monotonic())
                self._stop_event.wait(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:  # reported by finish(); the phase then fails loudly
            self.error = exc

    def finish(self) -> int:
        """Stop writing; the number of rows written."""
        self._stop_event.set()
        self.join(30)
        if self.error is not None:
            raise RuntimeError(f"the metric writer failed: {self.error!r}") from self.error
        return len(self.committed_at)


def set_job_status(db_url: str, job_id: str, to_status: str, from_status: str) -> None:
    from megatrain.db.jobs import transition
    from megatrain.db.session import session_scope

    with session_scope(db_url) as s:
        if not transition(s, job_id, to_status, from_statuses=(from_status,), reason="api load test"):
            raise RuntimeError(f"job {job_id} was not {from_status!r}; cannot mark it {to_status!r}")


async def run_streams(
    backend: str,
    url: str,
    key: str,
    db_url: str,
    job_id: str,
    n: int,
    *,
    rate: float,
    hold_s: float,
    open_batch: int = 100,
    end_timeout_s: float = 60.0,
) -> PhaseResult:
    """Open `n` streams on the (queued) job `job_id`, `open_batch` at a time, while rows are written;
    hold them `hold_s` seconds once all are open; finish the job and check every stream."""
    from megatrain.db.models import QUEUED, RUNNING

    host, port = url.removeprefix("http://").split(":")
    path = f"/v1/jobs/{job_id}/metrics"
    result = PhaseResult(backend, "SSE /v1/jobs/{id}/metrics", "sse", n)
    await asyncio.to_thread(set_job_status, db_url, job_id, RUNNING, QUEUED)
    prober = await asyncio.to_thread(HealthzProber, url)
    writer = MetricWriter(db_url, job_id, rate)
    writer.start()
    streams = [Stream() for _ in range(n)]
    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()
    try:
        # A batch at a time, each answered before the next: the listen backlog is not what is measured.
        for first in range(0, n, open_batch):
            batch = streams[first : first + open_batch]
            tasks += [asyncio.create_task(follow(host, int(port), path, key, s)) for s in batch]
            await asyncio.wait_for(asyncio.gather(*(s.opened.wait() for s in batch)), 60)
        all_open = time.monotonic()
        await asyncio.sleep(hold_s)
        rows_written = await asyncio.to_thread(writer.finish)
        finished = time.monotonic()
        await asyncio.to_thread(set_job_status, db_url, job_id, END_STATUS, RUNNING)
        _, late = await asyncio.wait(tasks, timeout=end_timeout_s)
        for task, stream in zip(tasks, streams, strict=False):
            if task in late:
                stream.error = f"still open {end_timeout_s:.0f} s after the job finished"
    finally:
        for task in tasks:
            task.cancel()  # a no-op for those that ended
        if writer.is_alive():
            await asyncio.to_thread(writer.finish)
        probes = await asyncio.to_thread(prober.stop)
    result.wall_s = time.monotonic() - start
    result.healthz = healthz_stats(probes, since=start)

    lags, problems = [], []
    for stream in streams:
        # Delay from commit to arrival, for rows committed once this stream was open (not its backlog).
        lags += [
            got - writer.committed_at[step]
            for step, got in zip(stream.steps, stream.received_at, strict=True)
            if writer.committed_at.get(step, 0.0) >= stream.opened_at
        ]
        result.count += len(stream.steps)
        problem = stream.error or stream_problem(stream.steps, rows_written, stream.end_status)
        if problem:
            problems.append(problem)
            result.server_errors += (stream.status or 0) >= 500
    result.errors = len(problems)
    result.first_error = problems[0] if problems else ""
    result.p50_ms, result.p99_ms = percentile_ms(lags, 0.50), percentile_ms(lags, 0.99)
    result.streams = {
        "opened": sum(s.status == 200 for s in streams),
        "complete": n - len(problems),
        "not_200": sum(s.status is not None and s.status != 200 for s in streams),
        "disconnects": sum(s.disconnected for s in streams),
        "rows_written": rows_written,
        "open_s": round(all_open - start, 2),
        "hold_s": hold_s,
        # /healthz while the streams open, while they are held, and while they end.
        "healthz_open": asdict(healthz_stats(probes, start, all_open)),
        "healthz_hold": asdict(healthz_stats(probes, all_open, finished)),
        "healthz_end": asdict(healthz_stats(probes, since=finished)),
    }
    return result
