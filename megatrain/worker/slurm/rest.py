"""SlurmCommands through slurmrestd with a JWT, for sites where the scheduler host is no login node.

Speaks the OpenAPI plugin Slurm 22.05 serves, `openapi/v0.0.38` (22.05 also serves v0.0.36 and
v0.0.37; v0.0.39 came with 23.02). What the real slurmrestd 22.05.8 taught:
- job submit ignores the script's #SBATCH lines: they are parsed here into the `job` object
  (`sbatch_options`, `job_properties`), whose values slurmrestd parses as sbatch parses its
  arguments ("0-01:00:00", "2", "500M");
- `environment` must be set, or the submit fails ("environment must be set");
- `requeue` sets requeue whatever its value; `no_requeue` (absent from the OpenAPI text) clears it;
- `signal` refuses sbatch's "B:" prefix ("Invalid SIGNAL specification");
- an unknown job id is error 2017 ("Invalid job id specified") with HTTP 500;
- a wrong or expired token reaches slurmctld, which drops the connection: slurmrestd answers
  "Unspecified error" (-1) or "Zero Bytes were transmitted or received" (5005), never "token".
The parsers are pure functions of the JSON so they are tested on captured responses.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import shlex
import signal as signals
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import httpx

from megatrain.settings import Settings
from megatrain.worker.slurm.commands import SlurmCli, SlurmCommands, SlurmError, SlurmNode, gpu_count
from megatrain.worker.slurm.states import SlurmState, normalise_state, parse_reason

API_VERSION = "v0.0.38"
REQUEST_TIMEOUT_S = 30.0
INVALID_JOB_ID = 2017
"""ESLURM_INVALID_JOB_ID: slurmctld no longer (or never) knew the job."""
AUTH_SUSPECT_ERRORS = (-1, 5005)
"""What 22.05 answers when slurmctld refused the request's token (it names no cause)."""
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

# sbatch option → slurmrestd v0.0.38 job property. Values go through as sbatch's own text.
_PROPERTIES = {
    "account": "account",
    "array": "array",
    "begin": "begin_time",
    "chdir": "current_working_directory",
    "comment": "comment",
    "constraint": "constraints",
    "cpus-per-gpu": "cpus_per_gpu",
    "cpus-per-task": "cpus_per_task",
    "deadline": "deadline",
    "dependency": "dependency",
    "error": "standard_error",
    "exclude": "exclude_nodes",
    "exclusive": "exclusive",
    "gpus": "gpus",
    "gpus-per-node": "gpus_per_node",
    "gpus-per-task": "gpus_per_task",
    "gres": "gres",
    "hold": "hold",
    "input": "standard_input",
    "job-name": "name",
    "licenses": "licenses",
    "mail-type": "mail_type",
    "mail-user": "mail_user",
    "mem": "memory_per_node",
    "mem-per-cpu": "memory_per_cpu",
    "mem-per-gpu": "memory_per_gpu",
    "nice": "nice",
    "nodelist": "nodelist",
    "nodes": "nodes",
    "no-requeue": "no_requeue",
    "ntasks": "tasks",
    "ntasks-per-node": "tasks_per_node",
    "open-mode": "open_mode",
    "output": "standard_output",
    "partition": "partition",
    "qos": "qos",
    "requeue": "requeue",
    "reservation": "reservation",
    "signal": "signal",
    "time": "time_limit",
    "time-min": "time_minimum",
    "wait-all-nodes": "wait_all_nodes",
    "wckey": "wckey",
}
_SHORT = {
    "A": "account", "a": "array", "b": "begin", "C": "constraint", "c": "cpus-per-task", "D": "chdir",
    "d": "dependency", "e": "error", "G": "gpus", "H": "hold", "i": "input", "J": "job-name",
    "L": "licenses", "N": "nodes", "n": "ntasks", "o": "output", "p": "partition", "q": "qos",
    "t": "time", "w": "nodelist", "x": "exclude",
}  # fmt: skip
_FLAGS = {"hold", "requeue", "no-requeue", "exclusive"}
"""Options that take no value (exclusive's optional value must be written --exclusive=user)."""


# -- the script's #SBATCH lines → the job object ---------------------------------------------------


def sbatch_options(script: str) -> list[tuple[str, str | None]]:
    """The script's #SBATCH options as (long name, value or None for a flag), in order. Like sbatch,
    only the lines before the first command count."""
    options: list[tuple[str, str | None]] = []
    for line in script.splitlines()[1:]:  # past the #! line
        text = line.strip()
        if not text:
            continue
        if not text.startswith("#"):
            break  # sbatch stops at the first command
        if not text.startswith("#SBATCH"):
            continue
        words = iter(shlex.split(text[len("#SBATCH") :], comments=True))
        for word in words:
            if word.startswith("--"):  # --name=value, --name value, --flag
                name, eq, value = word[2:].partition("=")
                attached = bool(eq)
            elif word.startswith("-") and word[1:2] in _SHORT:  # -Nvalue, -N value, -H
                name, value = _SHORT[word[1]], word[2:]
                attached = bool(value)
            else:
                raise SlurmError(f"#SBATCH line not understood: {line.strip()!r}")
            if not attached and name in _FLAGS:
                options.append((name, None))
                continue
            if not attached:
                following = next(words, None)
                if following is None:
                    raise SlurmError(f"#SBATCH --{name} without a value: {line.strip()!r}")
                value = following
            options.append((name, value))
    return options


def job_properties(
    options: Sequence[tuple[str, str | None]],
    environment: Mapping[str, str],
    cwd: str,
) -> dict[str, Any]:
    """slurmrestd's `job` object for a script with these #SBATCH options. An option with no
    equivalent here is an error rather than dropped, so a script never runs with less than it asked."""
    job: dict[str, Any] = {"environment": dict(environment), "current_working_directory": cwd}
    for name, value in options:
        key = _PROPERTIES.get(name)
        if key is None:
            raise SlurmError(f"#SBATCH --{name} has no slurmrestd {API_VERSION} equivalent here")
        if name == "signal" and value and value.startswith("B:"):
            # 22.05 refuses B: ("Invalid SIGNAL specification"), and without it Slurm would signal
            # every process of the step (torchrun, data workers) with a signal they do not expect.
            # Not sent: the runners stop at the deadline the script exports (worker.preempt.TimeLimit).
            continue
        if name in ("requeue", "no-requeue"):
            job.pop("requeue", None)
            job.pop("no_requeue", None)  # the last of the two wins, as with sbatch
        job[key] = True if value is None else value
    return job


# -- parsing slurmrestd's answers -----------------------------------------------------------------


def response_errors(body: Mapping[str, Any]) -> list[tuple[int | None, str]]:
    """The `errors` array as (Slurm error number, Slurm's words). 22.05 names the number
    `error_number`, `error_code` or `errno` depending on the handler."""
    errors = []
    for err in body.get("errors") or []:
        number = next((err[k] for k in ("error_number", "error_code", "errno") if k in err), None)
        words = "; ".join(str(err[k]) for k in ("error", "description") if err.get(k))
        errors.append((number, words or json.dumps(err)))
    return errors


def parse_submit(body: Mapping[str, Any]) -> str:
    """The job id of a job/submit answer."""
    job_id = body.get("job_id")
    if not isinstance(job_id, int):
        raise SlurmError(f"slurmrestd returned no job id: {json.dumps(body)[:500]}")
    return str(job_id)


def parse_jobs(body: Mapping[str, Any]) -> list[SlurmState]:
    """The `jobs` of a job (or jobs) answer, mapped like squeue's rows (exit code 'rc:signal' from
    the wait status, as sacct writes it, once the job has ended)."""
    states = []
    for job in body.get("jobs") or []:
        state = SlurmState(
            str(job["job_id"]),
            normalise_state(job.get("job_state") or ""),
            parse_reason(job.get("state_reason")),
        )
        status = job.get("exit_code")
        if state.terminal and isinstance(status, int):
            state = SlurmState(state.slurm_id, state.state, state.reason, _exit_code(status))
        states.append(state)
    return states


def _exit_code(status: int) -> str:
    """A wait(2) status as 'rc:signal' (sacct's ExitCode)."""
    if os.WIFSIGNALED(status):
        return f"0:{os.WTERMSIG(status)}"
    return f"{os.WEXITSTATUS(status)}:0"


# slurmrestd's base node states → sinfo's compact ones (SlurmNode.state).
_NODE_STATES = {"allocated": "alloc", "mixed": "mix", "completing": "comp", "planned": "plnd"}


def parse_nodes(body: Mapping[str, Any], partition: str | None = None) -> list[SlurmNode]:
    """The `nodes` of a nodes answer, one SlurmNode per (node, partition) as `sinfo -N` lists them;
    the DRAIN flag reads as sinfo's 'drain', COMPLETING as 'comp'."""
    nodes = []
    for node in body.get("nodes") or []:
        flags = {f.upper() for f in node.get("state_flags") or []}
        state = _NODE_STATES.get(str(node.get("state", "")).lower(), str(node.get("state", "")).lower())
        if "DRAIN" in flags:
            state = "drain"
        elif "COMPLETING" in flags:
            state = "comp"
        for part in node.get("partitions") or []:
            if partition is None or part == partition:
                nodes.append(
                    SlurmNode(
                        node["name"],
                        int(node.get("cpus") or 0),
                        gpu_count(node.get("gres") or ""),
                        state,
                        part,
                    )
                )
    return nodes


# -- the token -------------------------------------------------------------------------------------


def read_token(text: str) -> str:
    """A JWT from what `scontrol token` printed ('SLURM_JWT=...') or the bare token."""
    token = text.strip().removeprefix("SLURM_JWT=").strip()
    if not token:
        raise SlurmError("the Slurm JWT is empty")
    return token


def token_expiry(token: str) -> int | None:
    """The JWT's `exp` (seconds since the epoch), read without its key; None when unreadable."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return int(claims["exp"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None


class TokenFile:
    """The JWT in a file, re-read when the file changes (an operator rotates it in place)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None
        self._token = ""

    def __call__(self) -> str:
        try:
            stat = self.path.stat()
            if (stat.st_mtime_ns, stat.st_size) != self._seen:
                self._token = read_token(self.path.read_text())
                self._seen = (stat.st_mtime_ns, stat.st_size)
        except OSError as exc:
            raise SlurmError(f"the Slurm JWT file: {exc}") from exc
        return self._token


# -- the client ------------------------------------------------------------------------------------


class SlurmRest:
    """SlurmCommands through slurmrestd at `url`, as `user` with the JWT `token` returns (a str,
    or a callable such as TokenFile, asked before each request).

    `environment` is what a submitted job starts with (slurmrestd needs one, and unlike sbatch
    passes none of ours: the rendered script exports what the runners need); `cwd` its working
    directory (sbatch's default, the submitter's). `transport` is for tests."""

    def __init__(
        self,
        url: str,
        token: str | Callable[[], str],
        user: str | None = None,
        *,
        environment: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self._token = (lambda: read_token(token)) if isinstance(token, str) else token
        self.user = user or getpass.getuser()
        self.environment = (
            dict(environment) if environment is not None else {"PATH": os.environ.get("PATH", DEFAULT_PATH)}
        )
        self.cwd = cwd
        self._client = httpx.Client(
            base_url=f"{self.url}/slurm/{API_VERSION}", timeout=timeout_s, transport=transport
        )

    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        token = self._token()
        expires_at = token_expiry(token)
        if expires_at is not None and expires_at <= time.time():
            expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires_at))
            raise SlurmError(f"{what}: the Slurm JWT expired at {expired}")
        headers = {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": token}
        try:
            response = self._client.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:  # refused, timed out, reset
            raise SlurmError(f"{what}: slurmrestd at {self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            # slurmrestd's own refusals are plain text ("Authentication failure" with 401).
            raise SlurmError(
                f"{what} failed (HTTP {response.status_code}): {response.text.strip()[:500]}"
            ) from None
        if not isinstance(body, dict):
            raise SlurmError(f"{what} failed (HTTP {response.status_code}): {response.text.strip()[:500]}")
        return response.status_code, body

    def _raise(self, what: str, status: int, errors: list[tuple[int | None, str]]) -> NoReturn:
        words = "; ".join(text for _, text in errors) or "no reason given"
        if errors and all(number in AUTH_SUSPECT_ERRORS for number, _ in errors):
            words += " (what slurmctld answers an invalid or expired X-SLURM-USER-TOKEN with)"
        raise SlurmError(f"{what} failed (HTTP {status}): {words}")

    def submit(self, script: str) -> str:
        job = job_properties(sbatch_options(script), self.environment, self.cwd or os.getcwd())
        status, body = self._request("POST", "/job/submit", "job submit", json={"script": script, "job": job})
        errors = response_errors(body)
        if errors or status >= 400:
            self._raise("job submit", status, errors)
        return parse_submit(body)

    def status(self, slurm_ids: Sequence[str]) -> dict[str, SlurmState]:
        # One request per id: 22.05 has no filter on /jobs, which lists every job slurmctld holds.
        # A job slurmctld has forgotten (MinJobAge) is absent; accounting (slurmdbd) is not asked.
        states: dict[str, SlurmState] = {}
        for slurm_id in dict.fromkeys(i for i in slurm_ids if i):
            status, body = self._request("GET", f"/job/{slurm_id}", "job status")
            errors = response_errors(body)
            if any(number == INVALID_JOB_ID for number, _ in errors):
                continue
            if errors or status >= 400:
                self._raise(f"job status of {slurm_id}", status, errors)
            states.update((s.slurm_id, s) for s in parse_jobs(body) if s.slurm_id == slurm_id)
        return states

    def cancel(self, slurm_id: str, signal: str | None = None) -> None:
        # slurmrestd signals with KILL_FULL_JOB (scancel --full); no signal is SIGKILL (scancel's).
        params = {"signal": signal_name(signal)} if signal else {}
        status, body = self._request("DELETE", f"/job/{slurm_id}", "job cancel", params=params)
        errors = response_errors(body)
        if any(number == INVALID_JOB_ID for number, _ in errors):
            return  # like scancel: a job Slurm no longer knows has nothing to cancel
        if errors or status >= 400:
            self._raise(f"job cancel of {slurm_id}", status, errors)

    def capacity(self, partition: str | None = None) -> list[SlurmNode]:
        status, body = self._request("GET", "/nodes", "nodes")
        errors = response_errors(body)
        if errors or status >= 400:
            self._raise("nodes", status, errors)
        return parse_nodes(body, partition)

    def close(self) -> None:
        self._client.close()


def signal_name(signal: str) -> str:
    """slurmrestd's signal names: 'TERM' for 'TERM', 'SIGTERM' or '15'."""
    if signal.isdigit():
        return signals.Signals(int(signal)).name.removeprefix("SIG")
    return signal.upper().removeprefix("SIG")


def slurm_commands(settings: Settings) -> SlurmCommands:
    """The executor's way to Slurm: slurmrestd when `slurm_rest_url` is set, else the CLI tools."""
    if not settings.slurm_rest_url:
        return SlurmCli(bin_dir=settings.slurm_bin_dir)
    token: str | Callable[[], str]
    if settings.slurm_jwt_file:
        token = TokenFile(settings.slurm_jwt_file)
    elif settings.slurm_jwt:
        token = settings.slurm_jwt
    else:
        raise ValueError(
            "MEGATRAIN_SLURM_REST_URL is set but no token: set MEGATRAIN_SLURM_JWT or "
            "MEGATRAIN_SLURM_JWT_FILE (e.g. from `scontrol token lifespan=...`)"
        )
    return SlurmRest(settings.slurm_rest_url, token, settings.slurm_user)
