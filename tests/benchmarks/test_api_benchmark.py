"""benchmarks/api.py, the API load test: its parsers and checks, its CLI's refusals, and smoke runs
against a real server (every phase ran, no errors, every stream got every row once, in order)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _load  # noqa: E402
import _load_streams  # noqa: E402


def _bench_api():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_api", BENCH / "api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WRK_OUTPUT = """Running 1s test @ http://127.0.0.1:8000/v1/jobs
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     5.00ms    1.00ms  20.00ms   90.00%
  Latency Distribution
     50%    4.80ms
     99%   12.00ms
  812 requests in 1.00s, 1.00MB read
  Non-2xx or 3xx responses: 3
Requests/sec:    811.50
MEGATRAIN_WRK {"requests":812,"duration_us":1000600,"p50_us":4812,"p99_us":12004,"max_us":20001,\
"connect":0,"read":1,"write":0,"timeout":0,"status":3,"s5xx":2}
"""


def test_wrk_summary_line_is_parsed() -> None:
    s = _load.parse_wrk(WRK_OUTPUT)
    assert s.requests == 812
    assert s.wall_s == pytest.approx(1.0006)
    assert (s.p50_ms, s.p99_ms) == (pytest.approx(4.812), pytest.approx(12.004))
    assert s.errors == 4  # 3 non-2xx + 1 read error
    assert s.server_errors == 2


def test_wrk_output_without_its_summary_line_is_an_error() -> None:
    with pytest.raises(ValueError, match="no MEGATRAIN_WRK summary"):
        _load.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_lua_strings_survive_quotes_backslashes_and_newlines() -> None:
    assert _load.lua_string('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'


def test_percentiles_are_nearest_rank() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert _load.percentile_ms(values, 0.50) == pytest.approx(50.0)
    assert _load.percentile_ms(values, 0.99) == pytest.approx(99.0)
    assert _load.percentile_ms([], 0.99) != _load.percentile_ms([], 0.99)  # nan


def test_healthz_stats_count_a_window_s_probes_and_errors() -> None:
    probes = [
        _load.Probe(1.0, 0.002),
        _load.Probe(2.0, 0.300, "HTTP 503: database down"),
        _load.Probe(3.0, None, "ReadTimeout: timed out"),
        _load.Probe(4.0, 0.004),
    ]
    window = _load.healthz_stats(probes, since=2.0, until=4.0)
    assert (window.probes, window.errors) == (2, 2)
    assert window.max_ms == pytest.approx(300.0)  # answered with a 503: its latency counts
    assert window.first_error == "HTTP 503: database down"
    whole = _load.healthz_stats(probes)
    assert (whole.probes, whole.p50_ms) == (4, pytest.approx(4.0))


def test_sse_parser_joins_events_split_across_chunks() -> None:
    parser = _load_streams.SseParser()
    events = parser.feed(b'retry: 2000\n\nid: 1\ndata: {"st')
    events += parser.feed(b'ep":1}\n\n: keep-alive\n\nevent: end\ndata: {"status":"succeeded"}\n\n')
    assert [(e.event, e.id, e.data) for e in events] == [
        ("message", 1, '{"step":1}'),
        ("end", None, '{"status":"succeeded"}'),
    ]


@pytest.mark.parametrize(
    ("steps", "end", "problem"),
    [
        ([1, 2, 3], "succeeded", None),
        ([1, 3], "succeeded", "missing step 2"),
        ([1, 2, 2, 3], "succeeded", "step 2 twice"),
        ([2, 1, 3], "succeeded", "out of order"),
        ([1, 2, 3], None, "no `event: end`"),
        ([1, 2, 3], "failed", "ended 'failed'"),
        ([1, 2, 3, 4], "succeeded", "unexpected step 4"),
    ],
)
def test_a_stream_is_checked_for_every_row_once_in_order_then_the_end(
    steps: list[int], end: str | None, problem: str | None
) -> None:
    found = _load_streams.stream_problem(steps, rows_written=3, end_status=end, expected_end="succeeded")
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_stream_counts_take_one_number_or_one_per_backend() -> None:
    api = _bench_api()
    assert api.parse_streams("50") == {"sqlite": 50, "postgres": 50}
    assert api.parse_streams("sqlite=10,postgres=300") == {"sqlite": 10, "postgres": 300}
    assert api.parse_streams("postgres=300") == {"sqlite": 200, "postgres": 300}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--phases", "post,bogus"], "bogus"),
        (["--backends", "mysql"], "mysql"),
        (["--streams", "sqlite=many"], "sqlite=many"),
        (["--streams", "0"], "--streams"),
        (["--stream-rate", "0"], "--stream-rate"),
        (["--clients", "0"], "--clients"),
    ],
)
def test_bad_arguments_are_refused_naming_what_is_wrong(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _bench_api().main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def _smoke(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "api.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "api.py"), "--duration", "1", "--clients", "4", "--streams", "10",
         "--stream-seconds", "2", "--stream-rate", "5", "--json", str(out), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "healthz" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def _assert_clean_run(data: dict, backend: str, client: str) -> None:
    phases = [r for r in data["results"] if r["backend"] == backend]
    assert [r["phase"] for r in phases] == [
        "POST /v1/jobs", "GET /v1/jobs/{id}", "GET /v1/jobs?limit=50", "SSE /v1/jobs/{id}/metrics",
    ]  # fmt: skip
    for r in phases:
        assert r["count"] > 0 and r["errors"] == 0 and r["server_errors"] == 0, r
        assert r["healthz"]["probes"] > 0 and r["healthz"]["errors"] == 0, r
    assert [r["client"] for r in phases[:3]] == [client] * 3
    streams = phases[3]["streams"]
    assert streams["opened"] == streams["complete"] == 10, streams
    assert streams["healthz_hold"]["probes"] > 0 and streams["disconnects"] == 0
    assert streams["rows_written"] >= 5
    assert phases[3]["count"] == 10 * streams["rows_written"]  # every stream got every row


@pytest.mark.slow
@pytest.mark.parametrize("client", ["httpx", "wrk"])
def test_smoke_run_on_sqlite(tmp_path: Path, client: str) -> None:
    if client == "wrk" and shutil.which("wrk") is None:
        pytest.skip("wrk is not on PATH")
    data = _smoke(tmp_path, "--backends", "sqlite", "--client", client)
    _assert_clean_run(data, "sqlite", client)


@pytest.mark.slow
@pytest.mark.postgres
def test_smoke_run_on_postgres(tmp_path: Path, postgres_available: bool) -> None:
    if not postgres_available:
        pytest.skip("PostgreSQL unreachable")
    data = _smoke(tmp_path, "--backends", "postgres", "--client", "httpx")
    _assert_clean_run(data, "postgres", "httpx")
