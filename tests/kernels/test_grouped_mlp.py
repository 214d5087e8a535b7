"""The grouped_mlp kernel's backends against its reference twin (forward and every gradient) over
shapes × dtypes × activations, and the CUDA grouped-GEMM backend where a GPU has it."""

from __future__ import annotations

import pytest
import torch

from megatrain import kernels

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(
    counts: list[int], c: int, f: int, swiglu: bool, bias: bool, dtype: torch.dtype, device: str = "cpu"
):
    g = torch.Generator().manual_seed(0)
    e, w = len(counts), 2 * f if swiglu else f

    def leaf(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_()

    x = leaf(sum(counts), c)
    return [x, leaf(e, w, c), leaf(e, c, f), leaf(e, w) if bias else None, leaf(e, c) if bias else None]


def _run(backend: str, inputs: list, counts: list[int], activation: str):
    xs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    x, w1, w2, b1, b2 = xs
    y = kernels.get("grouped_mlp", backend=backend)(x, counts, w1, w2, b1, b2, activation)
    g = torch.Generator().manual_seed(9)
    upstream = torch.randn(y.shape, generator=g).to(device=y.device, dtype=y.dtype)
    (y.float() * upstream.float()).sum().backward()
    return y.detach(), [None if t is None else t.grad for t in xs]


def _compare(backend: str, inputs: list, counts: list[int], activation: str, dtype: torch.dtype) -> None:
    ref_y, ref_grads = _run("reference", inputs, counts, activation)
    y, grads = _run(backend, inputs, counts, activation)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), ref_y.float(), rtol=tol, atol=tol)
    for got, ref in zip(grads, ref_grads, strict=True):
        if ref is None:
            assert got is None
        else:
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)])
# [4, 3, 4, 2] and [1, 2] take the torch backend's padded bmm (little padding), the others its loop.
@pytest.mark.parametrize("counts", [[4, 3, 4, 2], [3, 0, 5, 1], [1, 2], [0, 0, 4]])
def test_torch_backend_against_reference(
    counts: list[int], activation: str, bias: bool, dtype: torch.dtype
) -> None:
    inputs = _inputs(counts, 12, 8, activation == "swiglu", bias, dtype)
    _compare("torch", inputs, counts, activation, dtype)


def test_torch_backend_pads_only_balanced_groups() -> None:
    from megatrain.kernels import grouped_mlp as module

    calls: list[str] = []
    padded, loop = module._padded, module.grouped_mlp_loop
    try:
        module._padded = lambda *a: calls.append("padded") or padded(*a)  # type: ignore[assignment]
        module.grouped_mlp_loop = lambda *a: calls.append("loop") or loop(*a)  # type: ignore[assignment]
        for counts in ([4, 3, 4, 2], [3, 0, 5, 1]):
            x, w1, w2, _, _ = _inputs(counts, 6, 4, True, False, torch.float32)
            module.grouped_mlp(x, counts, w1, w2)
    finally:
        module._padded, module.grouped_mlp_loop = padded, loop
    assert calls == ["padded", "loop"]  # 4·4 <= 1.5·13; 4·5 > 1.5·9


def test_reference_is_each_expert_mlp_on_its_rows() -> None:
    counts = [2, 0, 3]
    x, w1, w2, _, _ = _inputs(counts, 6, 4, True, False, torch.float32)
    y = kernels.get("grouped_mlp", backend="reference")(x, counts, w1, w2, None, None, "swiglu")
    rows = [0, 0, 2, 2, 2]  # the expert of each row
    for r, e in enumerate(rows):
        gate, up = (w1[e] @ x[r]).chunk(2)
        torch.testing.assert_close(y[r], w2[e] @ (torch.nn.functional.silu(gate) * up))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_no_rows_still_reach_the_input_in_backward(backend: str) -> None:
    # Under expert parallelism x arrived through an all-to-all whose reverse every rank must post:
    # a rank whose experts got no rows has to reach x's graph too (else the others hang there).
    x, w1, w2, b1, b2 = _inputs([0, 0], 8, 6, True, False, torch.float32)
    y = kernels.get("grouped_mlp", backend=backend)(x, [0, 0], w1, w2, b1, b2, "swiglu")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 8)


def test_registry_picks_grouped_mm_on_cuda_only() -> None:
    assert kernels.backends("grouped_mlp") == ["grouped_mm", "torch", "reference"]
    cpu = kernels.get("grouped_mlp", "cpu")
    assert cpu is kernels.get("grouped_mlp", backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("counts", [[64, 0, 48, 16], [128, 128]])
def test_grouped_mm_backend_on_cuda(counts: list[int]) -> None:
    from megatrain.kernels.grouped_mlp import grouped_mm_available

    if not grouped_mm_available():
        pytest.skip("torch._grouped_mm is not usable on this device")
    inputs = _inputs(counts, 64, 32, True, False, torch.bfloat16, device="cuda")
    _compare("grouped_mm", inputs, counts, "swiglu", torch.bfloat16)
