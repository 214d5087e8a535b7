"""Slurm's states onto the job's lifecycle (worker.slurm.states)."""

from __future__ import annotations

import pytest

from megatrain.failures import attempt_reason
from megatrain.worker.slurm.states import SlurmState, failure_record, normalise_state, parse_reason


@pytest.mark.parametrize(
    ("state", "phase", "cause", "retryable"),
    [
        ("PENDING", "pending", None, False),
        ("REQUEUED", "pending", None, False),
        ("CONFIGURING", "pending", None, False),
        ("RUNNING", "running", None, False),
        ("COMPLETING", "running", None, False),
        ("COMPLETED", "succeeded", None, False),
        ("FAILED", "failed", "slurm_failed", True),
        ("TIMEOUT", "failed", "slurm_timeout", True),
        ("NODE_FAIL", "failed", "slurm_node_fail", True),
        ("PREEMPTED", "failed", "slurm_preempted", True),
        ("OUT_OF_MEMORY", "failed", "slurm_out_of_memory", False),  # the same layout runs out again
        ("CANCELLED", "cancelled", "slurm_cancelled", False),
        ("DEADLINE", "failed", "slurm_deadline", False),
        ("SOMETHING_NEW", "failed", "slurm_unknown_state", False),
    ],
)
def test_state_table(state: str, phase: str, cause: str | None, retryable: bool) -> None:
    st = SlurmState("42", state, "Reason")
    assert (st.phase, st.cause, st.retryable) == (phase, cause, retryable)
    assert st.terminal == (phase in ("succeeded", "failed", "cancelled"))


def test_pending_reason_is_event_data() -> None:
    st = SlurmState("7", "PENDING", parse_reason("Resources"))
    assert st.event_data() == {"slurm_id": "7", "state": "PENDING", "reason": "Resources", "cause": None}


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("CANCELLED by 1000", "CANCELLED"),
        ("running", "RUNNING"),
        ("RUNNING+REQUEUED", "RUNNING"),
        (" TIMEOUT ", "TIMEOUT"),
    ],
)
def test_normalise_state(raw: str, state: str) -> None:
    assert normalise_state(raw) == state


@pytest.mark.parametrize(
    ("raw", "reason"), [("None", None), ("(null)", None), ("", None), ("(Priority)", "Priority")]
)
def test_parse_reason(raw: str, reason: str | None) -> None:
    assert parse_reason(raw) == reason


def test_out_of_memory_is_a_failure_record_no_retry_can_help() -> None:
    record = failure_record(SlurmState("101", "OUT_OF_MEMORY", None, "0:125"), "c1")
    assert record is not None and (record["kind"], record["node"], record["cause"]) == (
        "out_of_memory",
        "c1",
        "slurm_out_of_memory",
    )
    assert attempt_reason(record, 0, 1, retrying=False) == (
        "out of memory on node c1: OUT_OF_MEMORY: Slurm job 101 ended out of memory; not retried: "
        "this layout's ranks need more memory than the node has"
    )
    for other in ("TIMEOUT", "NODE_FAIL", "FAILED", "PREEMPTED", "COMPLETED"):
        assert failure_record(SlurmState("101", other), "c1") is None  # retried as before
