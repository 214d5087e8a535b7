"""The planner's prediction as the CLI prints it: `megatrain validate`'s "planned" line and
`megatrain status`'s "predicted vs measured" line (the % difference says how far off the cost model
was on this pool; positive: the job measured more than predicted)."""

from __future__ import annotations

from statistics import median
from typing import Any

RECENT_ROWS = 5
"""Train rows the measured medians look at (as the API's pace: megatrain.api.jobs.progress)."""


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"  # unreachable: the loop returns at GiB


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _diff(predicted: float | None, measured: float | None) -> str:
    if not predicted or measured is None:
        return ""
    return f", {100 * (measured - predicted) / predicted:+.0f}%"


def planned_line(plan: dict[str, Any]) -> str:
    """'predicted step 0.0106 s, 18,177 tokens/s, MFU 8.8%, 3.0 MiB per device'."""
    p = plan.get("predicted") or {}
    return (
        f"predicted step {p.get('step_time_s', 0):.3g} s, {p.get('tokens_per_s', 0):,.0f} tokens/s, "
        f"MFU {_pct(p.get('mfu'))}, {_bytes(p.get('memory_per_gpu_bytes', 0))} per device"
    )


def submitted_prediction(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The planner's prediction the API stored in the job's `submitted` event, if it planned one."""
    for ev in events:
        data = ev.get("data") or {}
        if ev.get("reason") == "submitted" and isinstance(data.get("plan"), dict):
            predicted = data["plan"].get("predicted")
            return predicted if isinstance(predicted, dict) else None
    return None


def recent_since(job: Any) -> int | None:
    """The step after which a job's last RECENT_ROWS train rows lie (one row per log_interval), so
    a long job's status reads a few rows, not its whole history."""
    interval = ((job.spec or {}).get("training") or {}).get("log_interval")
    if not isinstance(interval, int) or interval < 1:
        return None
    since = job.current_step - (RECENT_ROWS + 1) * interval
    return since if since > 0 else None


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and r[key] > 0]
    return median(values) if values else None


def versus_line(predicted: dict[str, Any], train_rows: list[dict[str, Any]]) -> str:
    """Each predicted number beside the median the job measured over its last train rows:
    'step 0.0106 s (measured 0.0125 s, +18%)  18,177 tokens/s (measured 15,400, -15%)  ...'."""
    rows = train_rows[-RECENT_ROWS:]
    step, tokens, mfu = (_median(rows, k) for k in ("iter_time_s", "tokens_per_s", "mfu"))
    p_step, p_tokens, p_mfu = (predicted.get(k) for k in ("step_time_s", "tokens_per_s", "mfu"))

    def measured(text: str, value: float | None, pred: float | None) -> str:
        return f" (measured {text}{_diff(pred, value)})" if value is not None else " (not measured yet)"

    return "  ".join(
        [
            f"step {p_step or 0:.3g} s" + measured(f"{step or 0:.3g} s", step, p_step),
            f"{p_tokens or 0:,.0f} tokens/s" + measured(f"{tokens or 0:,.0f}", tokens, p_tokens),
            f"MFU {_pct(p_mfu)}" + measured(_pct(mfu), mfu, p_mfu),
            f"{_bytes(predicted.get('memory_per_gpu_bytes', 0))} per device",
        ]
    ) + _load_note(rows)


def _load_note(rows: list[dict[str, Any]]) -> str:
    """'  (taken under load: other processes kept 1.4 of 2 cores busy)' when most of the rows were
    measured so (the engine's host_* fields, megatrain.hostinfo.HostLoad), else ''."""
    loaded = [r for r in rows if isinstance(r.get("host_other_cores"), int | float)]
    if not loaded or 2 * sum(bool(r.get("host_under_load")) for r in loaded) <= len(loaded):
        return ""
    other = median(float(r["host_other_cores"]) for r in loaded)
    cores = loaded[-1].get("host_cores")
    return f"  (taken under load: other processes kept {other:.2g} of {cores} cores busy)"
