"""worker.slurm.rest: the #SBATCH lines into slurmrestd's job object, its answers (captured from a
real slurmrestd 22.05.8, openapi/v0.0.38, trimmed) into states and nodes, its errors into
SlurmError; then, marked slow, the same against slurmrestd started on this machine."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fixtures.slurm_rest import Slurmrestd
from sqlalchemy import select
from worker_helpers import wait_for

from megatrain.db.models import SUCCEEDED, Job
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.slurm.commands import SlurmCli, SlurmError
from megatrain.worker.slurm.executor import SlurmExecutor
from megatrain.worker.slurm.rest import (
    SlurmRest,
    TokenFile,
    job_properties,
    parse_jobs,
    parse_nodes,
    parse_submit,
    response_errors,
    sbatch_options,
    signal_name,
    slurm_commands,
)
from megatrain.worker.slurm.script import HEAD_ADDR_ENV, SlurmRequest, render_sbatch
from megatrain.worker.slurm.states import SlurmState

META = {
    "plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"},
    "Slurm": {"release": "22.05.8"},
}


def _jobs(*jobs: dict[str, object]) -> dict[str, object]:
    return {"meta": META, "errors": [], "jobs": list(jobs)}


RUNNING = {"job_id": 22, "job_state": "RUNNING", "state_reason": "None", "exit_code": 0, "nodes": "n1"}
PENDING = {"job_id": 21, "job_state": "PENDING", "state_reason": "Resources", "exit_code": 0, "nodes": ""}
FAILED = {"job_id": 19, "job_state": "FAILED", "state_reason": "NonZeroExitCode", "exit_code": 768}
CANCELLED = {"job_id": 20, "job_state": "CANCELLED", "state_reason": "None", "exit_code": 15}
COMPLETED = {"job_id": 18, "job_state": "COMPLETED", "state_reason": "None", "exit_code": 0}
NODES = {
    "meta": META,
    "errors": [],
    "nodes": [
        {"name": "n1", "state": "idle", "state_flags": [], "cpus": 2, "gres": "", "partitions": ["debug"]},
        {
            "name": "n2",
            "state": "idle",
            "state_flags": ["DRAIN"],
            "cpus": 2,
            "gres": "",
            "partitions": ["debug"],
        },
        # Not captured (no GPUs here): the fields as 22.05 names them, for a GPU node in two partitions.
        {
            "name": "g1",
            "state": "mixed",
            "state_flags": [],
            "cpus": 64,
            "gres": "gpu:a100:8(S:0-1)",
            "partitions": ["gpu", "debug"],
        },
    ],
}
UNKNOWN_JOB = {
    "meta": META,
    "errors": [
        {
            "description": "Unable to find JobId=999",
            "error_number": 2017,
            "error": "Invalid job id specified",
            "source": "slurm_load_job",
        }
    ],
    "jobs": [],
}
NO_ENVIRONMENT = {
    "meta": META,
    "errors": [
        {"error": "environment must be set", "error_code": 2127},
        {"error_code": 9001, "error": "Failure during parsing"},
    ],
}
BAD_TOKEN = {
    "meta": META,
    "errors": [{"error_code": 5005, "error": "Zero Bytes were transmitted or received"}],
}


# -- pure ------------------------------------------------------------------------------------------


def test_sbatch_options_until_the_first_command() -> None:
    script = (
        "#!/bin/bash\n#SBATCH --job-name='a b'\n#SBATCH -N 2 --ntasks-per-node=1\n# a comment\n\n"
        "#SBATCH -pdebug\n#SBATCH --no-requeue\n#SBATCH --time 0-00:02:00\necho hi\n#SBATCH --qos=late\n"
    )
    assert sbatch_options(script) == [
        ("job-name", "a b"),
        ("nodes", "2"),
        ("ntasks-per-node", "1"),
        ("partition", "debug"),
        ("no-requeue", None),
        ("time", "0-00:02:00"),
    ]
    with pytest.raises(SlurmError, match="not understood"):
        sbatch_options("#!/bin/bash\n#SBATCH --job-name=a b\n")
    with pytest.raises(SlurmError, match="without a value"):
        sbatch_options("#!/bin/bash\n#SBATCH --partition\n")


def test_rendered_script_becomes_the_job_object(tmp_path: Path) -> None:
    req = SlurmRequest(
        job_id="j1",
        attempt=2,
        nodes=2,
        procs_per_node=4,
        gpus=True,
        time_limit_s=3600,
        log_dir=tmp_path,
        python="/usr/bin/python3",
        partition="gpu",
        account="ml",
    )
    job = job_properties(sbatch_options(render_sbatch(req)), {"PATH": "/bin"}, "/work")
    assert job == {
        "environment": {"PATH": "/bin"},
        "current_working_directory": "/work",
        "name": "megatrain-j1-2",
        "nodes": "2",
        "tasks_per_node": "1",
        "cpus_per_task": "4",
        "gpus_per_node": "4",
        "partition": "gpu",
        "account": "ml",
        "time_limit": "0-01:00:00",
        # No "signal": 22.05 refuses B:, and a step-wide signal would reach torchrun and data workers;
        # the runners stop at the deadline the script exports.
        "no_requeue": True,  # `requeue: false` would still requeue
        "standard_output": str(tmp_path / "batch.log"),
        "open_mode": "append",
    }


def test_job_object_last_requeue_wins_and_unknown_options_refused() -> None:
    job = job_properties([("no-requeue", None), ("requeue", None)], {}, "/")
    assert job["requeue"] is True and "no_requeue" not in job
    with pytest.raises(SlurmError, match="--mpi has no slurmrestd"):
        job_properties([("mpi", "pmix")], {}, "/")


def test_jobs_map_like_squeue_and_sacct() -> None:
    states = parse_jobs(_jobs(RUNNING, PENDING, FAILED, CANCELLED, COMPLETED))
    assert states == [
        SlurmState("22", "RUNNING"),
        SlurmState("21", "PENDING", "Resources"),
        SlurmState("19", "FAILED", "NonZeroExitCode", "3:0"),  # exit_code is the wait status (3 << 8)
        SlurmState("20", "CANCELLED", None, "0:15"),
        SlurmState("18", "COMPLETED", None, "0:0"),
    ]
    assert [s.phase for s in states] == ["running", "pending", "failed", "cancelled", "succeeded"]


def test_nodes_like_sinfo() -> None:
    nodes = parse_nodes(NODES)
    assert [(n.name, n.cpus, n.gpus, n.state, n.partition, n.usable) for n in nodes] == [
        ("n1", 2, 0, "idle", "debug", True),
        ("n2", 2, 0, "drain", "debug", False),
        ("g1", 64, 8, "mix", "gpu", True),
        ("g1", 64, 8, "mix", "debug", True),
    ]
    assert [n.name for n in parse_nodes(NODES, "gpu")] == ["g1"]


def test_errors_in_slurms_words() -> None:
    assert response_errors(NO_ENVIRONMENT) == [
        (2127, "environment must be set"),
        (9001, "Failure during parsing"),
    ]
    assert response_errors(UNKNOWN_JOB) == [(2017, "Invalid job id specified; Unable to find JobId=999")]
    assert parse_submit({"meta": META, "errors": [], "job_id": 18, "step_id": "BATCH"}) == "18"
    with pytest.raises(SlurmError, match="no job id"):
        parse_submit(NO_ENVIRONMENT)
    assert signal_name("SIGTERM") == signal_name("15") == signal_name("term") == "TERM"


# -- the client against a stand-in server ----------------------------------------------------------


def _jwt(exp: float, key: bytes = b"k") -> str:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps({"exp": int(exp), "iat": int(time.time()), "sun": "root"}).encode())
    sig = b64(hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest())
    return f"{head}.{body}.{sig}"


def _rest(handler, token: str | None = None) -> SlurmRest:  # type: ignore[no-untyped-def]
    return SlurmRest(
        "http://restd:6820",
        token or _jwt(time.time() + 600),
        "alice",
        cwd="/",
        transport=httpx.MockTransport(handler),
    )


def test_requests_carry_user_and_token_and_unknown_ids_are_absent() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers["X-SLURM-USER-NAME"]))
        assert request.headers["X-SLURM-USER-TOKEN"].count(".") == 2
        if request.url.path.endswith("/job/22"):
            return httpx.Response(200, json=_jobs(RUNNING))
        return httpx.Response(500, json=UNKNOWN_JOB)

    rest = _rest(handler)
    assert rest.status(["22", "999", "22", ""]) == {"22": SlurmState("22", "RUNNING")}
    rest.cancel("999", "SIGTERM")  # gone already: nothing to cancel, as with scancel
    assert seen == [
        ("GET", "/slurm/v0.0.38/job/22", "alice"),
        ("GET", "/slurm/v0.0.38/job/999", "alice"),
        ("DELETE", "/slurm/v0.0.38/job/999", "alice"),
    ]


def test_submit_sends_script_and_job_and_raises_slurms_errors() -> None:
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(500, json=NO_ENVIRONMENT)

    with pytest.raises(SlurmError, match=r"job submit failed \(HTTP 500\): environment must be set"):
        _rest(handler).submit("#!/bin/bash\n#SBATCH --nodes=1\ntrue\n")
    assert bodies[0]["script"].startswith("#!/bin/bash") and bodies[0]["job"]["nodes"] == "1"


def test_refused_timeouts_auth_and_expired_tokens_are_slurm_errors() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SlurmError, match="ConnectError"):
        SlurmRest(f"http://127.0.0.1:{port}", _jwt(time.time() + 600), "alice").capacity()

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(SlurmError, match="ReadTimeout"):
        _rest(slow).status(["1"])
    with pytest.raises(SlurmError, match=r"HTTP 401\): Authentication failure"):
        _rest(lambda r: httpx.Response(401, text="Authentication failure")).capacity()
    with pytest.raises(SlurmError, match="Zero Bytes.*invalid or expired X-SLURM-USER-TOKEN"):
        _rest(lambda r: httpx.Response(500, json=BAD_TOKEN)).capacity()
    with pytest.raises(SlurmError, match="JWT expired at"):
        _rest(lambda r: httpx.Response(200, json=NODES), _jwt(time.time() - 1)).capacity()


def test_token_file_is_reread_when_rotated(tmp_path: Path) -> None:
    path = tmp_path / "jwt"
    path.write_text("SLURM_JWT=aaa.bbb.ccc\n")  # what `scontrol token` prints
    token = TokenFile(path)
    assert token() == "aaa.bbb.ccc"
    path.write_text("ddd.eee.fffg\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert token() == "ddd.eee.fffg"
    path.unlink()
    with pytest.raises(SlurmError, match="JWT file"):
        token()


def test_settings_choose_the_commands(tmp_path: Path) -> None:
    assert isinstance(slurm_commands(Settings(slurm_bin_dir="/opt/slurm/bin")), SlurmCli)
    rest = slurm_commands(Settings(slurm_rest_url="http://restd:6820/", slurm_jwt="a.b.c", slurm_user="bob"))
    assert isinstance(rest, SlurmRest) and (rest.url, rest.user) == ("http://restd:6820", "bob")
    (tmp_path / "jwt").write_text("x.y.z")
    rest = slurm_commands(Settings(slurm_rest_url="http://restd:6820", slurm_jwt_file=str(tmp_path / "jwt")))
    assert isinstance(rest, SlurmRest) and rest._token() == "x.y.z"
    with pytest.raises(ValueError, match="no token"):
        slurm_commands(Settings(slurm_rest_url="http://restd:6820"))


# -- a real slurmrestd (tests/fixtures/slurm_rest.py) ---------------------------------------------

FOLLOW_TIMEOUT_S = 30.0


def _client(restd: Slurmrestd, token: str | None = None) -> SlurmRest:
    return SlurmRest(restd.url, token or restd.token, restd.user)


def _follow(rest: SlurmRest, slurm_id: str, until: tuple[str, ...]) -> SlurmState:
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    state = None
    while time.monotonic() < deadline:
        state = rest.status([slurm_id]).get(slurm_id)
        if state is not None and (state.phase in until or state.state in until):
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {slurm_id} never reached {until}: last {state}")


ENDED = ("succeeded", "failed", "cancelled")


@pytest.mark.slow
def test_real_capacity_lists_the_nodes(slurm_rest: Slurmrestd) -> None:
    nodes = _client(slurm_rest).capacity(slurm_rest.cluster.partition)
    assert sorted(n.name for n in nodes) == slurm_rest.cluster.node_names
    assert all(n.cpus == 2 and n.gpus == 0 and n.usable for n in nodes)


@pytest.mark.slow
def test_real_submit_and_follow_to_completed(slurm_rest: Slurmrestd, tmp_path: Path) -> None:
    rest = _client(slurm_rest)
    out = tmp_path / "out.txt"
    slurm_id = rest.submit(f"#!/bin/bash\n#SBATCH --output={tmp_path / 'log'}\necho done > {out}\n")
    assert _follow(rest, slurm_id, ENDED).state == "COMPLETED"
    assert out.read_text() == "done\n"
    assert "9999999" not in rest.status([slurm_id, "9999999"])


@pytest.mark.slow
def test_real_cancel_cancels(slurm_rest: Slurmrestd, tmp_path: Path) -> None:
    rest = _client(slurm_rest)
    slurm_id = rest.submit(f"#!/bin/bash\n#SBATCH --output={tmp_path / 'log'}\nsleep 300\n")
    _follow(rest, slurm_id, ("running",))
    rest.cancel(slurm_id)
    state = _follow(rest, slurm_id, ENDED)
    assert (state.state, state.phase) == ("CANCELLED", "cancelled")


@pytest.mark.slow
def test_real_rendered_script_runs_with_its_options(slurm_rest: Slurmrestd, tmp_path: Path) -> None:
    # A stand-in runner module, as in test_slurm_real.py: it writes what each node's runner sees.
    (tmp_path / "echo_runner.py").write_text(
        "import os, sys\n"
        "print('node', os.environ['SLURM_NODEID'], 'of', os.environ['MEGATRAIN_NNODES'],\n"
        f"      os.environ['{HEAD_ADDR_ENV}'], os.environ['MEGATRAIN_MARK'], ' '.join(sys.argv[1:]))\n"
    )
    cluster = slurm_rest.cluster
    nodes = len(cluster.node_names)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    req = SlurmRequest(
        job_id="job-r",
        attempt=2,
        nodes=nodes,
        procs_per_node=1,
        gpus=False,
        time_limit_s=120,
        log_dir=log_dir,
        python=sys.executable,
        partition=cluster.partition,
        env={"PYTHONPATH": str(tmp_path), "MEGATRAIN_MARK": "a b"},
        runner_module="echo_runner",
    )
    rest = _client(slurm_rest)
    slurm_id = rest.submit(render_sbatch(req))
    state = _follow(rest, slurm_id, ENDED)
    assert state.state == "COMPLETED", (log_dir / "batch.log").read_text()
    for rank in range(nodes):
        line = (log_dir / f"node-{rank}.log").read_text().strip()
        assert line == f"node {rank} of {nodes} 127.0.0.1 a b --job-id=job-r --attempt=2"
    # The #SBATCH options applied: name, node count, time limit, no requeue (scontrol's view).
    shown = cluster.client("scontrol", "show", "job", slurm_id).stdout
    for field in ("JobName=megatrain-job-r-2", f"NumNodes={nodes}", "TimeLimit=00:02:00", "Requeue=0"):
        assert field in shown, shown


@pytest.mark.slow
def test_real_wrong_token_names_the_auth_failure(slurm_rest: Slurmrestd) -> None:
    forged = _jwt(time.time() + 600, key=b"not the cluster's key")
    with pytest.raises(SlurmError, match="invalid or expired X-SLURM-USER-TOKEN"):
        _client(slurm_rest, forged).capacity()
    with pytest.raises(SlurmError, match="invalid or expired X-SLURM-USER-TOKEN"):
        _client(slurm_rest, forged).submit("#!/bin/bash\ntrue\n")


@pytest.mark.slow
def test_real_executor_runs_a_placed_job_through_slurmrestd(
    slurm_rest: Slurmrestd,
    settings: Settings,
    fake_engine: Path,
    make_job: Callable[..., str],
) -> None:
    # The executor as the lead wires it (`commands or slurm_commands(settings)`), with the REST settings.
    slurm = settings.model_copy(
        update={
            "executor": "slurm",
            "slurm_partition": slurm_rest.cluster.partition,
            "slurm_rest_url": slurm_rest.url,
            "slurm_user": slurm_rest.user,
            "slurm_jwt": slurm_rest.token,
        }
    )
    executor = SlurmExecutor(slurm, commands=slurm_commands(slurm))
    url = slurm.resolved_database_url
    job_id = make_job(procs=1, train_iters=10)
    executor.submit(job_id)

    def ended() -> str | None:
        with session_scope(url) as s:
            status = s.scalar(select(Job.status).where(Job.id == job_id))
        return status if status not in ("scheduled", "running") else None

    assert wait_for(ended, 60, 0.5) == SUCCEEDED, (executor.log_dir(job_id, 1) / "batch.log").read_text()
    assert (executor.log_dir(job_id, 1) / "node-0.log").exists()
