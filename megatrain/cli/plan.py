"""`megatrain plan SPEC.yaml [--pool POOL.yaml] [--devices N] [--json]`: the fastest layout of a spec,
its predicted step time and memory, and the runners-up; nothing is submitted.

With --pool the planner runs here, offline (it is pure and torch-free); without, the API plans on
the spec's resources.pool as the server knows it (POST /v1/plan, through the SDK).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _user_errors, app
from megatrain.client import ApiError, Client
from megatrain.spec import SpecError

GiB = 1 << 30


def _problems(errors: list[dict[str, str]]) -> str:
    return "\n".join(f"  {e.get('field', '?')}: {e.get('message', '')}" for e in errors)


def _offline(spec_path: Path, pool_path: Path, devices: int | None) -> dict[str, Any]:
    from megatrain.plan.planner import plan
    from megatrain.plan.pool import load_pool
    from megatrain.spec import load_spec

    for path in (spec_path, pool_path):
        if not path.is_file():
            raise _fail(f"no such file: {path}")
    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        raise _fail(f"invalid job spec {spec_path}:\n{_problems(exc.errors)}") from None
    try:
        pool = load_pool(pool_path)
    except SpecError as exc:
        raise _fail(f"invalid pool {pool_path}:\n{_problems(exc.errors)}") from None
    try:
        return plan(spec, pool, devices).as_dict()
    except SpecError as exc:
        raise _fail(f"cannot plan {spec_path}:\n{_problems(exc.errors)}") from None


def _layout_text(layout: dict[str, Any]) -> str:
    parts = [f"tp={layout['tp']}", f"pp={layout['pp']}", f"dp={layout['dp']}"]
    parts += [f"{axis}={layout[axis]}" for axis in ("cp", "ep") if layout.get(axis, 1) > 1]
    if layout.get("virtual_stages", 1) > 1:
        parts.append(f"v={layout['virtual_stages']}")
    parts.append(f"mbs={layout['micro_batch_size']}")
    if layout.get("sequence_parallel"):
        parts.append("sp")
    if layout.get("recompute", "none") != "none":
        parts.append(f"recompute={layout['recompute']}")
    if layout.get("distributed_optimizer"):
        parts.append("dist-opt")
    return " ".join(parts)


def _count(n: int) -> str:
    """Three significant digits in the largest unit that fits: 46.7B, 1.78M, 974K (never 0.00B)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale * 0.9995:  # (999.6M rounds to 1B, not 1e+03M)
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def _show(result: dict[str, Any]) -> None:
    out = _out()
    pred = result["predicted"]
    explicit = " (the spec's own layout)" if result.get("explicit_layout") else ""
    out.print(
        f"[bold]{escape(_layout_text(result['layout']))}[/bold] on {_devices(result['devices'])} of pool "
        f"{escape(str(result['pool']))} ({result['precision']}){explicit}"
    )
    out.print(
        f"predicted: {pred['step_time_s']:.3g} s/step | {pred['tokens_per_s']:,.0f} tok/s | "
        f"{pred['tflops_per_gpu']:.3g} TFLOP/s per device | MFU {pred['mfu']:.1%} | "
        f"{pred['memory_per_gpu_bytes'] / GiB:,.2f} GiB per device"
    )
    params = result.get("parameters") or {}
    if params:
        active = params["active"]
        sparse = f", {_count(active)} active per token" if active != params["total"] else ""
        out.print(f"parameters: {_count(params['total'])}{sparse}")
        trainable = params.get("trainable")  # a LoRA run's adapters; the base above is frozen
        if trainable is not None:
            held = params["total"] + trainable
            out.print(
                f"trainable: {_count(trainable)} LoRA adapter parameters of {_count(held)} "
                f"({trainable / held:.2%}); the base's {_count(params['total'])} are frozen"
            )
    mem = pred.get("memory_breakdown", {})
    if mem:
        out.print(
            "memory: "
            + " | ".join(
                f"{k.removesuffix('_bytes')} {mem[k] / GiB:,.2f} GiB"
                for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
            )  # fmt: skip
        )
    times = pred.get("time_breakdown", {})
    if times:
        shown = [f"{k.removesuffix('_s')} {v:.3g}s" for k, v in times.items() if v]
        out.print("time: " + " | ".join(shown))
    cands = result.get("candidates", {})
    runners = cands.get("runners_up", [])
    if runners:
        table = Table(title="runners-up", title_justify="left")
        for col in ("LAYOUT", "S/STEP", "TOK/S", "MFU", "GIB/DEVICE"):
            table.add_column(col, justify="left" if col == "LAYOUT" else "right")
        for r in runners:
            p = r["predicted"]
            table.add_row(
                escape(_layout_text(r["layout"])),
                f"{p['step_time_s']:.3g}",
                f"{p['tokens_per_s']:,.0f}",
                f"{p['mfu']:.1%}",
                f"{p['memory_per_gpu_bytes'] / GiB:,.2f}",
            )
        out.print(table)
    counts = cands.get("rejected_counts") or {}
    if counts:
        summary = ", ".join(f"{n} {code.replace('_', ' ')}" for code, n in sorted(counts.items()))
        out.print(f"considered {cands.get('considered', '?')}; rejected: {summary}")


@app.command("plan")
@_user_errors
def plan_command(
    spec: Annotated[Path, typer.Argument(help="Job spec file (YAML or JSON).")],
    pool: Annotated[
        Path | None,
        typer.Option("--pool", help="A pool description (YAML): plan here, offline, without the server."),
    ] = None,
    devices: Annotated[
        int | None,
        typer.Option(min=1, help="Devices to plan for (default: resources.devices, else the pool)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON (the API's answer).")
    ] = False,
) -> None:
    """Choose the fastest layout (tp, pp, dp, micro-batch, recompute, ...) that fits, without submitting."""
    if pool is not None:
        result = _offline(spec, pool, devices)
    else:
        try:
            with Client() as client:
                result = client.plan(spec, devices=devices)
        except ApiError as exc:
            if exc.status == 422 and exc.field_errors:
                raise _fail(f"cannot plan {spec} (HTTP 422):\n{_problems(exc.field_errors)}") from None
            raise
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    _show(result)
