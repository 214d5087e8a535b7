"""The failure rules (megatrain/failures.py): user vs infrastructure, which rank's record explains
an attempt, and the one-line reasons."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatrain.failures import (
    INFRASTRUCTURE,
    USER,
    Activity,
    attempt_reason,
    classify,
    describe,
    exit_description,
    pick,
    summary,
)

MRO = {
    "FileNotFoundError": ["FileNotFoundError", "OSError", "Exception", "BaseException", "object"],
    "PermissionError": ["PermissionError", "OSError", "Exception", "BaseException", "object"],
    "ValueError": ["ValueError", "Exception", "BaseException", "object"],
    "ConnectionResetError": ["ConnectionResetError", "ConnectionError", "OSError", "Exception"],
    "SpecError": ["SpecError", "ValueError", "Exception"],
    "LayoutError": ["LayoutError", "ValueError", "Exception"],
    "UnsupportedLayout": ["UnsupportedLayout", "Exception"],
    "CorpusError": ["CorpusError", "ValueError", "Exception"],
    "PreprocessError": ["PreprocessError", "ValueError", "Exception"],
    "RecordError": ["RecordError", "ValueError", "Exception"],
    "DistBackendError": ["DistBackendError", "RuntimeError", "Exception"],
    "RuntimeError": ["RuntimeError", "Exception"],
    "KeyError": ["KeyError", "LookupError", "Exception"],
    "WorkerDied": ["WorkerDied", "RuntimeError", "Exception"],
}


@pytest.mark.parametrize(
    ("exception", "phase", "kind"),
    [
        # the job's inputs: missing, unreadable or malformed data, tokenizer or initial weights
        ("FileNotFoundError", "data", USER),
        ("PermissionError", "data", USER),
        ("FileNotFoundError", "tokenizer", USER),
        ("ValueError", "tokenizer", USER),  # a tokenizer file that will not load
        ("ValueError", "data", USER),
        ("FileNotFoundError", "init", USER),
        # the spec and the data pipeline's own errors, whatever the rank was doing
        ("SpecError", "setup", USER),
        ("LayoutError", "setup", USER),
        ("UnsupportedLayout", "model", USER),
        ("CorpusError", "training", USER),
        ("PreprocessError", "data", USER),
        ("RecordError", "data", USER),
        # the machine's: collectives, connections, storage, killed workers, anything unknown
        ("DistBackendError", "training", INFRASTRUCTURE),
        ("ConnectionResetError", "data", INFRASTRUCTURE),
        ("RuntimeError", "training", INFRASTRUCTURE),
        ("WorkerDied", "data", INFRASTRUCTURE),
        ("KeyError", "data", INFRASTRUCTURE),
        ("FileNotFoundError", "training", INFRASTRUCTURE),  # a checkpoint folder gone, not the data
        ("PermissionError", "resume", INFRASTRUCTURE),
        ("ValueError", "training", INFRASTRUCTURE),
        ("ValueError", "setup", INFRASTRUCTURE),
    ],
)
def test_classify(exception: str, phase: str, kind: str) -> None:
    assert classify(MRO[exception], phase) == kind


def test_describe_keeps_the_first_line_clipped() -> None:
    record = describe(
        ValueError("\n  bad tokenizer file " + "x" * 400 + "\nTraceback..."), 2, Activity("tokenizer")
    )
    assert record["kind"] == USER and record["rank"] == 2 and record["exception"] == "ValueError"
    assert record["message"].startswith("bad tokenizer file x") and len(record["message"]) == 300
    assert record["message"].endswith("…") and record["step"] is None
    assert describe(MemoryError(), 0, Activity("training", 5), "out_of_memory")["kind"] == "out_of_memory"


def test_pick_prefers_the_first_rank_with_a_user_error() -> None:
    broken_pipe = {"kind": INFRASTRUCTURE, "rank": 0, "at": 1.0}
    bad_data = {"kind": USER, "rank": 3, "at": 2.0}
    later_bad_data = {"kind": USER, "rank": 1, "at": 3.0}
    assert pick([broken_pipe, later_bad_data, bad_data]) is bad_data
    assert pick([{"kind": INFRASTRUCTURE, "rank": 1, "at": 5.0}, broken_pipe]) is broken_pipe
    assert pick([]) is None


def _record(kind: str, phase: str, step: int | None, exception: str, message: str) -> dict:
    return {"kind": kind, "rank": 0, "phase": phase, "step": step, "exception": exception, "message": message}


def test_reasons_are_one_line() -> None:
    record = _record(USER, "data", None, "FileNotFoundError", "/d/c.jsonl does not exist")
    assert summary(record) == (
        "reading the data failed on rank 0 during setup: FileNotFoundError: /d/c.jsonl does not exist"
    )
    assert attempt_reason(record, 1, 1, retrying=False) == (
        f"{summary(record)}; not retried: every attempt would fail the same way"
    )
    infra = _record(INFRASTRUCTURE, "training", 7, "DistBackendError", "NCCL error")
    assert attempt_reason(infra, 1, 2, retrying=True) == (
        "attempt 2: training failed on rank 0 at step 7: DistBackendError: NCCL error; "
        "retrying from the latest checkpoint"
    )
    oom = _record("out_of_memory", "model", None, "OutOfMemoryError", "CUDA out of memory")
    assert attempt_reason(oom, 3, 1, retrying=False).startswith(
        "building the model ran out of memory on rank 0 during setup: OutOfMemoryError: CUDA out of "
        "memory; not retried"
    )
    # Where the record names its node (the runner adds it), the reason leads with it.
    assert attempt_reason(oom | {"node": "gpu-07"}, 3, 1, retrying=False).startswith(
        "out of memory on node gpu-07 (rank 0) while building the model during setup: OutOfMemoryError"
    )
    assert attempt_reason(None, -9, 1, retrying=False) == (
        "attempt 1: a rank exited with code -9 (signal SIGKILL); no retries left"
    )


def test_exit_description_names_signals_where_the_code_tells() -> None:
    assert exit_description(1) == "exited with code 1"
    assert exit_description(-15) == "exited with code -15 (signal SIGTERM)"
    assert exit_description(137) == "exited with code 137 (signal SIGKILL)"
    assert exit_description(255) == "exited with code 255"


def test_the_rules_import_no_torch() -> None:
    # The worker and the CLI render failures on machines without torch.
    code = "import sys, megatrain.failures; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
