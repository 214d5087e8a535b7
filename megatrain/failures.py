"""Why an attempt failed, as data: what a rank was doing (`Activity`), the record it writes
(OUT/failure.rank{R}.json), the rule that tells a user's error (every attempt would fail the same
way: not retried) from an infrastructure one (retried), and the one-line reasons the worker stores.

Torch-free: the engine writes records with it, the worker reads them, the CLI may render them.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USER = "user"
INFRASTRUCTURE = "infrastructure"
OUT_OF_MEMORY = "out_of_memory"
"""A failed allocation: a user error for this layout (the same spec on the same devices fails again)."""
NOT_RETRIED = frozenset({USER, OUT_OF_MEMORY})

PHASES = {
    "setup": "setting up",
    "tokenizer": "loading the tokenizer",
    "model": "building the model",
    "data": "reading the data",
    "init": "loading the initial weights",
    "resume": "resuming from the checkpoint",
    "training": "training",
    "evaluation": "evaluating",
    "checkpoint": "saving a checkpoint",
    "serving": "serving the model",
}
"""What a rank can be doing, in the words of a reason ("reading the data failed on rank 0 ...")."""

MAX_MESSAGE_CHARS = 300

# The job's own inputs are wrong, whatever the rank was doing: the spec, its layout, the data
# pipeline's own errors (engine/data: corpus, fine-tuning records, preprocessing, chat templates).
_USER_TYPES = frozenset(
    {
        "SpecError",
        "LayoutError",
        "UnsupportedLayout",
        "CorpusError",
        "RecordError",
        "PreprocessError",
        "ChatTemplateError",
        "HFConfigError",
        "TaskError",  # an eval job's lm-eval task file (engine.evaluation.tasks)
    }
)
# These name the user's inputs only while a rank reads them (a missing, unreadable or malformed
# data, tokenizer or initial-weights file); raised elsewhere they are the machine's problem.
_INPUT_TYPES = frozenset(
    {"FileNotFoundError", "PermissionError", "IsADirectoryError", "NotADirectoryError", "ValueError"}
)
_INPUT_PHASES = frozenset({"tokenizer", "data", "init"})


@dataclass
class Activity:
    """What this rank is doing now, for its failure record: one of PHASES and, while training, the
    step in progress (1-based). The train loop sets both each step: two attribute stores."""

    phase: str = "setup"
    step: int | None = None


def classify(type_names: Iterable[str], phase: str) -> str:
    """USER or INFRASTRUCTURE for an exception whose class and bases are named `type_names` (its
    MRO), raised while `phase`. Anything not known to be the user's is retried."""
    names = set(type_names)
    if names & _USER_TYPES:
        return USER
    if phase in _INPUT_PHASES and names & _INPUT_TYPES:
        return USER
    return INFRASTRUCTURE


def first_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """The first non-empty line of `text`, clipped to `limit` characters (with an ellipsis)."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def describe(exc: BaseException, rank: int, activity: Activity, kind: str | None = None) -> dict[str, Any]:
    """The failure record of `exc` on `rank`; `kind` overrides the classification (out of memory)."""
    names = [t.__name__ for t in type(exc).__mro__]
    return {
        "kind": kind or classify(names, activity.phase),
        "rank": rank,
        "phase": activity.phase,
        "step": activity.step,
        "exception": type(exc).__name__,
        "message": first_line(str(exc)),
        "at": time.time(),
    }


def write_record(out: Path, record: dict[str, Any]) -> None:
    """OUT/failure.rank{R}.json: torchrun reports every rank's failure as exit code 1, so the
    worker learns from these files what failed, where and whether retrying can help."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"failure.rank{record['rank']}.json").write_text(json.dumps(record))


def read_records(out: Path, node: str | None = None) -> list[dict[str, Any]]:
    """Every rank's failure record in an attempt's folder (unreadable ones skipped); `node`: the
    node they were written on, added to each record that does not name one."""
    records = []
    for path in sorted(out.glob("failure.rank*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "kind" in record:
            if node is not None:
                record.setdefault("node", node)
            records.append(record)
    return records


def pick(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The record that explains the attempt: the first rank to fail with an error of its own
    inputs (the others then fail on broken collectives or are killed), else the first to fail."""
    if not records:
        return None
    own = [r for r in records if r.get("kind") in NOT_RETRIED]
    return min(own or records, key=lambda r: (float(r.get("at") or 0), int(r.get("rank") or 0)))


def summary(record: dict[str, Any]) -> str:
    """One line: what failed, on which rank (and node) and step, and the exception's message; an
    out-of-memory record that names its node leads with "out of memory on node N (rank R)"."""
    phase = str(record.get("phase") or "setup")
    what = PHASES.get(phase, phase)
    step = record.get("step")
    when = f"at step {step}" if step else ("before step 1" if phase == "training" else "during setup")
    exc, message = record.get("exception") or "error", first_line(str(record.get("message") or ""))
    tail = f": {exc}" + (f": {message}" if message else "")
    rank = record.get("rank")
    if record.get("kind") == OUT_OF_MEMORY and record.get("node"):
        who = f"out of memory on node {record['node']}" + (f" (rank {rank})" if rank is not None else "")
        # A record written for the rank (the OOM killer's, Slurm's) may not know what it was doing.
        return who + (f" while {what} {when}" if record.get("phase") else "") + tail
    verb = "ran out of memory" if record.get("kind") == OUT_OF_MEMORY else "failed"
    return f"{what} {verb} on rank {rank} {when}" + tail


def exit_description(rc: int) -> str:
    """'exited with code 1', or with the signal that ended it where the code tells one (a negative
    code from Popen, 128+N from a shell or torchrun)."""
    number = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    try:
        name = f" (signal {signal.Signals(number).name})" if number else ""
    except ValueError:
        name = ""
    return f"exited with code {rc}{name}"


def attempt_reason(record: dict[str, Any] | None, rc: int, attempt: int, retrying: bool) -> str:
    """The job's one-line status reason after a failed attempt (never a traceback: that is in the log)."""
    if record is not None and record.get("kind") == OUT_OF_MEMORY and record.get("cause"):
        # Ended from outside (the kernel's OOM killer, Slurm): the node's memory ran out.
        return f"{summary(record)}; not retried: this layout's ranks need more memory than the node has"
    if record is not None and record.get("kind") == OUT_OF_MEMORY:
        return f"{summary(record)}; not retried: this layout needs more memory than each device has"
    if record is not None and record.get("kind") == USER:
        return f"{summary(record)}; not retried: every attempt would fail the same way"
    cause = summary(record) if record is not None else f"a rank {exit_description(rc)}"
    then = "retrying from the latest checkpoint" if retrying else "no retries left"
    return f"attempt {attempt}: {cause}; {then}"


def failure_data(record: dict[str, Any]) -> dict[str, Any]:
    """A failure record as a job event carries it (the structured failure for the API and dashboard)."""
    keys = ("kind", "rank", "phase", "step", "exception", "message")
    data = {k: record.get(k) for k in keys}
    # Where known: the node, and who ended a rank from outside (with what evidence).
    return data | {k: record[k] for k in ("node", "cause", "evidence") if record.get(k) is not None}


def event_data(record: dict[str, Any] | None, rc: int, attempt: int) -> dict[str, Any]:
    """The FAILED/QUEUED event's data: the structured failure for the API and dashboard."""
    data: dict[str, Any] = {"attempt": attempt, "exit_code": rc}
    if record is not None:
        data["failure"] = failure_data(record)
    else:
        data["failure"] = {"kind": INFRASTRUCTURE, "exit": exit_description(rc)}
    return data
