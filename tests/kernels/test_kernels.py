"""Every kernel's backends against its reference twin, over shapes × dtypes: the forward and every
gradient; and the registry that picks them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from megatrain import kernels
from megatrain.engine.models.gpt import rope_tables

DTYPES = {
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-3,
}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = DTYPES[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_()


def _forward_and_grads(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], *extra: object
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs, *extra)
    # A fixed, non-uniform upstream gradient (a sum would hide errors that cancel).
    g = torch.Generator().manual_seed(99)
    weights = torch.randn(out.shape, generator=g).to(out.dtype)
    (out.float() * weights.float()).sum().backward()
    return out.detach(), [x.grad for x in xs]  # type: ignore[misc]


def _against_reference(kernel: str, inputs: list[torch.Tensor], *extra: object, dtype: torch.dtype) -> None:
    ref_out, ref_grads = _forward_and_grads(kernels.get(kernel, backend="reference"), inputs, *extra)
    for backend in kernels.backends(kernel):
        if backend == "triton":  # CUDA only: tests/kernels/test_triton_*.py run it under the interpreter
            continue
        out, grads = _forward_and_grads(kernels.get(kernel, backend=backend), inputs, *extra)
        _close(out, ref_out, dtype)
        for grad, ref in zip(grads, ref_grads, strict=True):
            _close(grad, ref, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(7, 32), (2, 5, 48)])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _leaf(shape, dtype, 0)
    w = _leaf(shape[-1:], dtype, 1, 0.5)
    _against_reference("rms_norm", [x, w], 1e-5, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(6, 2 * 16), (2, 3, 2 * 40)])
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _against_reference("swiglu", [_leaf(shape, dtype, 2)], dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(6, 2 * 16), (2, 3, 2 * 40)])
def test_geglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _against_reference("geglu", [_leaf(shape, dtype, 2)], dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(7, 32), (2, 5, 48)])
def test_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _leaf(shape, dtype, 0)
    w, b = _leaf(shape[-1:], dtype, 1, 0.5), _leaf(shape[-1:], dtype, 2, 0.5)
    _against_reference("layer_norm", [x, w, b], 1e-5, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("weighted", [True, False])
def test_moe_combine(dtype: torch.dtype, weighted: bool) -> None:
    # 11 routed rows into 6 tokens (token 4 gets none), probabilities in fp32 as the router's.
    index = torch.tensor([0, 3, 1, 0, 5, 2, 3, 3, 1, 5, 0])
    inputs = [_leaf((11, 24), dtype, 1)]
    if weighted:
        inputs.append(_leaf((11,), torch.float32, 2).detach().softmax(0).requires_grad_())

    def combine(kernel: str) -> Callable[..., torch.Tensor]:
        f = kernels.get("moe_combine", backend=kernel)
        return lambda y, *w: f(y, w[0] if w else None, index, 6)

    ref_out, ref_grads = _forward_and_grads(combine("reference"), inputs)
    out, grads = _forward_and_grads(combine("torch"), inputs)
    _close(out, ref_out, dtype)
    assert out[4].abs().sum() == 0
    for grad, ref in zip(grads, ref_grads, strict=True):
        _close(grad, ref, dtype)


def test_moe_combine_saves_the_rows_not_fp32_copies() -> None:
    y = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(64, requires_grad=True)
    index = torch.randint(0, 16, (64,))
    saved: dict[str, list[int]] = {"torch": [], "reference": []}
    for kernel, sizes in saved.items():

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(t.nbytes)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kernels.get("moe_combine", backend=kernel)(y, w, index, 16)
    # The rows (bf16, 4 KiB), the probabilities and the index; the composite adds two fp32 copies.
    assert sum(saved["torch"]) == y.nbytes + w.nbytes + index.nbytes
    assert sum(saved["reference"]) >= sum(saved["torch"]) + 2 * 64 * 32 * 4 - y.nbytes


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("batch", "heads", "seq", "head_dim"), [(1, 2, 5, 8), (2, 3, 9, 16)])
def test_apply_rope(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype) -> None:
    cos, sin = rope_tables(seq, head_dim, 10000.0)
    x = _leaf((batch, heads, seq, head_dim), dtype, 3)
    _against_reference("apply_rope", [x], cos.to(dtype), sin.to(dtype), dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("tokens", "hidden", "vocab", "chunk"), [(37, 16, 50, 8), (64, 24, 130, None)])
def test_linear_cross_entropy(
    tokens: int, hidden: int, vocab: int, chunk: int | None, dtype: torch.dtype
) -> None:
    h = _leaf((tokens, hidden), dtype, 4)
    w = _leaf((vocab, hidden), dtype, 5, 0.2)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(6))
    _against_reference("linear_cross_entropy", [h, w], labels, chunk, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("chunk", [8, None])
def test_linear_cross_entropy_with_a_loss_mask(chunk: int | None, dtype: torch.dtype) -> None:
    h = _leaf((2, 19, 16), dtype, 4)
    w = _leaf((50, 16), dtype, 5, 0.2)
    gen = torch.Generator().manual_seed(6)
    labels = torch.randint(0, 50, (2, 19), generator=gen)
    mask = (torch.rand(2, 19, generator=gen) < 0.4).float()
    _against_reference("linear_cross_entropy", [h, w], labels, chunk, mask, dtype=dtype)
    # The masked mean is the mean over the kept tokens alone; an all-zero mask gives 0 and no gradient.
    keep = mask.bool()
    fused = kernels.get("linear_cross_entropy", backend="torch")
    alone = fused(h.detach()[keep], w.detach(), labels[keep], chunk)
    _close(fused(h.detach(), w.detach(), labels, chunk, mask), alone, dtype)
    hz = h.detach().clone().requires_grad_()
    zero = fused(hz, w, labels, chunk, torch.zeros(2, 19))
    zero.backward()
    assert zero.item() == 0.0 and not hz.grad.any()  # type: ignore[union-attr]


def _with_main_grad(weight: torch.Tensor) -> torch.nn.Parameter:
    """A parameter as DataParallel leaves it: fp32 main_grad, fusion on."""
    p = torch.nn.Parameter(weight.detach().clone())
    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)  # type: ignore[attr-defined]
    p.grad_accumulation_fusion = True  # type: ignore[attr-defined]
    return p


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bias", [True, False])
def test_linear_accumulates_into_main_grad(dtype: torch.dtype, bias: bool) -> None:
    x = _leaf((2, 5, 12), dtype, 7)
    w = _leaf((20, 12), dtype, 8, 0.3)
    b = _leaf((20,), dtype, 9) if bias else None
    _against_reference("linear", [x, w] + ([b] if b is not None else []), dtype=dtype)  # no DataParallel
    ref_out, ref_grads = _forward_and_grads(
        kernels.get("linear", backend="reference"), [x, w] + ([b] if b is not None else [])
    )
    fused_w = _with_main_grad(w)
    xs = x.detach().clone().requires_grad_()
    for _ in range(2):  # two micro-batches accumulate
        out = kernels.get("linear", backend="torch")(xs, fused_w, b.detach() if b is not None else None)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
        (out.float() * weights.float()).sum().backward()
        assert fused_w.grad_added_to_main_grad  # type: ignore[attr-defined]
        fused_w.grad = None  # DataParallel's post-accumulate hook drops the placeholder
    _close(out.detach(), ref_out, dtype)
    _close(xs.grad / 2, ref_grads[0], dtype)  # type: ignore[operator]
    _close((fused_w.main_grad / 2).to(dtype), ref_grads[1], dtype)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_embedding_accumulates_only_the_looked_up_rows(dtype: torch.dtype) -> None:
    w = _leaf((11, 6), dtype, 10)
    tokens = torch.tensor([[1, 3, 3], [0, 9, 1]])
    ref_out, (ref_grad,) = _forward_and_grads(
        lambda weight: kernels.get("embedding", backend="reference")(tokens, weight), [w]
    )
    fused_w = _with_main_grad(w)
    out = kernels.get("embedding", backend="torch")(tokens, fused_w)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
    (out.float() * weights.float()).sum().backward()
    _close(out.detach(), ref_out, dtype)
    _close(fused_w.main_grad.to(dtype), ref_grad, dtype)  # type: ignore[attr-defined]
    untouched = [r for r in range(11) if r not in (0, 1, 3, 9)]
    assert not fused_w.main_grad[untouched].any()  # type: ignore[attr-defined]


# -- the registry ------------------------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's mechanism on the built-in twins (the Triton backends, usable here under the
    interpreter, are tested in test_triton_kernels.py)."""
    builtin = {k: [b for b in v if b.name != "triton"] for k, v in kernels._BACKENDS.items()}
    monkeypatch.setattr(kernels, "_BACKENDS", builtin)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.delenv(kernels.ENV, raising=False)


def test_the_fast_backend_by_default_and_the_reference_when_forced(
    registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.kernels.rms_norm import rms_norm, rms_norm_reference
    from megatrain.kernels.swiglu import swiglu_reference

    assert kernels.get("rms_norm") is rms_norm and kernels.get("rms_norm", "cuda") is rms_norm
    monkeypatch.setenv(kernels.ENV, "reference")
    assert kernels.get("rms_norm") is rms_norm_reference and kernels.get("swiglu") is swiglu_reference
    monkeypatch.setenv(kernels.ENV, "swiglu=reference")
    assert kernels.get("rms_norm") is rms_norm and kernels.get("swiglu") is swiglu_reference


def test_a_registered_backend_is_picked_where_it_runs_and_is_usable(registry: None) -> None:
    from megatrain.kernels.rms_norm import rms_norm, rms_norm_reference

    usable = [False]
    kernels.register(
        "rms_norm",
        "accelerated",
        "megatrain.kernels.rms_norm:rms_norm_reference",
        devices=("cuda",),
        available=lambda: usable[0],
        priority=20,
    )
    assert kernels.backends("rms_norm") == ["accelerated", "torch", "reference"]
    assert kernels.get("rms_norm", "cuda") is rms_norm  # not usable: the next one
    usable[0] = True
    kernels.register("rms_norm", "accelerated", "megatrain.kernels.rms_norm:rms_norm_reference",
                     devices=("cuda",), available=lambda: usable[0], priority=20)  # fmt: skip
    assert kernels.get("rms_norm", "cuda") is rms_norm_reference
    assert kernels.get("rms_norm", "cpu") is rms_norm  # it does not run on a CPU


def test_unknown_names_are_errors_naming_what_exists(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        KeyError,
        match="no kernel named 'group_norm'; known: apply_rope, apply_rope_qk, attention, attention_block, ",
    ):
        kernels.get("group_norm")
    with pytest.raises(KeyError, match="has no backend 'cutlass'; it has: torch, reference"):
        kernels.get("swiglu", backend="cutlass")
    monkeypatch.setenv(kernels.ENV, "swiglu=cutlass")
    with pytest.raises(KeyError, match="'cutlass'"):
        kernels.get("swiglu")
