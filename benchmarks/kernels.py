"""Every kernel of the registry (megatrain.kernels), each backend that runs on the device, timed
forward + backward against its twins and, where installed, Liger-Kernel's.

    python benchmarks/kernels.py                          # CPU: the twins ("torch", "reference")
    python benchmarks/kernels.py --device cuda --dtype bf16 --json kernels.json   # a GPU: all of them
    python benchmarks/kernels.py --kernels rms_norm swiglu --repeat 50

Each row: the kernel, its backend, the median seconds of one forward + backward over `--repeat`
calls (after warm-up; CUDA events on a GPU), and the speed against the device: for memory-bound
kernels (norms, RoPE, GLUs) the bytes a minimal kernel must move (every input read once, every
output written once, forward and backward) per second, as GB/s and as a fraction of the device's
memory bandwidth; for GEMM-bound ones (the fused LM head + loss, attention) TFLOP/s and the fraction
of the device's peak at that precision (megatrain.engine.metrics.peak_tflops). On a CPU the
bandwidth is measured here (a large copy), and the peak is engine.calibrate's matmul figure.

The Triton backends register for CUDA only. Off a GPU they run solely under Triton's interpreter
(TRITON_INTERPRET=1: numpy, one op at a time), which proves their numerics in tests/kernels but is
no speed figure: this script does not time them on a CPU and says so. `liger` rows need the
`bench` extra (liger-kernel) and a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain import kernels  # noqa: E402
from megatrain.engine.models.gpt import rope_tables  # noqa: E402

GPU_BANDWIDTH_GBPS = {
    # Datasheet memory bandwidth by name fragment (longest match wins).
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "B200": 8000.0,
    "L40S": 864.0,
    "A10G": 600.0,
}

Inputs = tuple[list[torch.Tensor], tuple[Any, ...]]
"""(tensors that take gradients, further positional arguments)."""


@dataclass(frozen=True)
class Case:
    kernel: str
    shape: str
    make: Callable[[torch.device, torch.dtype], Inputs]
    bytes_moved: Callable[[torch.dtype], float] | None = None
    """Minimal forward + backward memory traffic (memory-bound kernels)."""
    flops: float | None = None
    """Forward + backward FLOPs (GEMM-bound kernels)."""
    liger: Callable[[list[torch.Tensor], tuple[Any, ...]], Any] | None = None
    """The same computation through Liger-Kernel (None: it has no such kernel)."""


def _leaf(
    shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()


def cases(big: bool) -> list[Case]:
    """Shapes of a ~8B Llama layer on a GPU (tokens 8192, hidden 4096), a tenth of that on a CPU."""
    n, h, f = (8192, 4096, 14336) if big else (2048, 1024, 2816)
    b, heads, groups, t, hd = (2, 32, 8, 4096, 128) if big else (1, 8, 2, 1024, 64)
    vocab = 128256 if big else 32000
    cos, sin = rope_tables(t, hd, 500000.0)

    def es(dtype: torch.dtype) -> int:
        return torch.finfo(dtype).bits // 8

    def rope_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
        q, k = _leaf((b, heads, t, hd), device, dtype), _leaf((b, groups, t, hd), device, dtype)
        return [q, k], (cos.to(device), sin.to(device))

    def lce_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
        hidden, weight = _leaf((n, h), device, dtype), _leaf((vocab, h), device, dtype, 0.02)
        return [hidden, weight], (torch.randint(0, vocab, (n,), device=device),)

    def attention_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
        q = _leaf((b, heads, t, hd), device, dtype)
        k, v = _leaf((b, groups, t, hd), device, dtype), _leaf((b, groups, t, hd), device, dtype)
        return [q, k, v], (None, 0.0)

    def liger_fn(name: str) -> Callable[..., Any]:
        from liger_kernel.transformers import functional as lf  # the bench extra

        return getattr(lf, name)

    def liger_glu(name: str) -> Callable[[list[torch.Tensor], tuple[Any, ...]], Any]:
        return lambda x, _: liger_fn(name)(*x[0].chunk(2, dim=-1))

    return [
        Case("rms_norm", f"({n}, {h})",
             lambda d, dt: ([_leaf((n, h), d, dt), _leaf((h,), d, dt)], (1e-5,)),
             bytes_moved=lambda dt: 5 * n * h * es(dt),
             liger=lambda x, e: liger_fn("liger_rms_norm")(x[0], x[1], e[0])),
        Case("layer_norm", f"({n}, {h})",
             lambda d, dt: ([_leaf((n, h), d, dt), _leaf((h,), d, dt), _leaf((h,), d, dt)], (1e-5,)),
             bytes_moved=lambda dt: 5 * n * h * es(dt),
             liger=lambda x, e: liger_fn("liger_layer_norm")(x[0], x[1], x[2], e[0])),
        Case("swiglu", f"({n}, 2·{f})", lambda d, dt: ([_leaf((n, 2 * f), d, dt)], ()),
             bytes_moved=lambda dt: 8 * n * f * es(dt), liger=liger_glu("liger_swiglu")),
        Case("geglu", f"({n}, 2·{f})", lambda d, dt: ([_leaf((n, 2 * f), d, dt)], ()),
             bytes_moved=lambda dt: 8 * n * f * es(dt), liger=liger_glu("liger_geglu")),
        Case("apply_rope_qk", f"q ({b}, {heads}, {t}, {hd}), k ({b}, {groups}, {t}, {hd})", rope_inputs,
             bytes_moved=lambda dt: 4 * b * (heads + groups) * t * hd * es(dt),
             liger=lambda x, e: liger_fn("liger_rope")(x[0], x[1], e[0].unsqueeze(0), e[1].unsqueeze(0))),
        Case("linear_cross_entropy", f"({n}, {h}) @ ({vocab}, {h})ᵀ", lce_inputs, flops=6.0 * n * h * vocab,
             liger=lambda x, e: liger_fn("liger_fused_linear_cross_entropy")(x[0], x[1], e[0])),
        Case("attention", f"causal B={b} H={heads} G={groups} T={t} hd={hd}", attention_inputs,
             flops=3.5 * 2.0 * b * heads * t * t * hd),  # fwd 4·B·H·T²·hd halved (causal); bwd 2.5×
    ]  # fmt: skip


def runnable_backends(kernel: str, device: torch.device) -> list[str]:
    """The kernel's backends that run on this device, compiled (never the interpreter)."""
    out = []
    for b in kernels._entries(kernel):
        if b.devices is not None and device.type not in b.devices:
            continue
        if b.available is not None and not b.available():
            continue
        out.append(b.name)
    return out


def _backward_seed(out: Any) -> Callable[[], None]:
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]
    return lambda: torch.autograd.backward(list(outs), grads)


def time_call(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int) -> float:
    """Median seconds of fn() (forward + backward)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step(call: Callable[[list[torch.Tensor], tuple[Any, ...]], Any], inputs: Inputs) -> Callable[[], None]:
    """One forward + backward of `call` on fresh-gradient copies of the inputs."""
    leaves, extra = inputs

    def run() -> None:
        for x in leaves:
            x.grad = None
        out = call(leaves, extra)
        _backward_seed(out)()

    return run


def memory_bandwidth_gbps(device: torch.device) -> float | None:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        hits = [k for k in GPU_BANDWIDTH_GBPS if k in name]
        return GPU_BANDWIDTH_GBPS[max(hits, key=len)] if hits else None
    x = torch.empty(64 << 20, dtype=torch.float32)  # 256 MiB: far past the caches
    y = torch.empty_like(x)
    y.copy_(x)
    best = min(time_call(lambda: y.copy_(x), device, 5, 1) for _ in range(2))
    return 2 * x.numel() * 4 / best / 1e9


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    from megatrain.engine.metrics import peak_tflops as peak

    precision = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return peak(torch.cuda.get_device_name(device) if device.type == "cuda" else None, precision)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth, peak = memory_bandwidth_gbps(device), peak_tflops(device, dtype)
    rows = []
    for case in cases(big=device.type == "cuda" and not args.small):
        if args.kernels and case.kernel not in args.kernels:
            continue
        torch.manual_seed(0)
        inputs = case.make(device, dtype)
        variants: dict[str, Callable[[list[torch.Tensor], tuple[Any, ...]], Any]] = {}
        for backend in runnable_backends(case.kernel, device):
            fn = kernels.get(case.kernel, device.type, backend=backend)
            variants[backend] = lambda x, e, fn=fn: fn(*x, *e)
        if case.liger is not None and device.type == "cuda" and _liger_installed():
            variants["liger"] = case.liger
        for name, call in variants.items():
            seconds = time_call(step(call, inputs), device, args.repeat, args.warmup)
            row: dict[str, Any] = {"kernel": case.kernel, "backend": name, "shape": case.shape}
            row["ms"] = seconds * 1e3
            if case.bytes_moved is not None:
                gbps = case.bytes_moved(dtype) / seconds / 1e9
                row |= {"GB/s": gbps, "of_peak": gbps / bandwidth if bandwidth else None}
            if case.flops is not None:
                tflops = case.flops / seconds / 1e12
                row |= {"TFLOP/s": tflops, "of_peak": tflops / peak if peak else None}
            rows.append(row)
    return rows


def _liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"device {args.device}, {args.dtype}, forward + backward, median of {args.repeat}")
    print("| kernel | backend | shape | ms | GB/s | TFLOP/s | of device peak |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        gb = f"{r['GB/s']:.1f}" if "GB/s" in r else ""
        tf = f"{r['TFLOP/s']:.3f}" if "TFLOP/s" in r else ""
        frac = f"{r['of_peak']:.0%}" if r.get("of_peak") is not None else "n/a"
        print(f"| {r['kernel']} | {r['backend']} | {r['shape']} | {r['ms']:.2f} | {gb} | {tf} | {frac} |")
    if args.device == "cpu":
        print(
            "\nNot timed here: the Triton backends (CUDA only; on a CPU they run under Triton's "
            "interpreter, which checks numerics in tests/kernels and is not a speed figure) and Liger-Kernel."
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--kernels", nargs="*", default=None, help="only these kernels")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="the CPU shapes on a GPU too (a smoke run)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.repeat = args.repeat or (50 if args.device == "cuda" else 5)
    rows = run(args)
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
