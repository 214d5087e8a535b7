"""Gradient-accumulation fusion and the hand-written RMSNorm / RoPE backward passes."""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain.engine.models.gpt import GPTModel, rope_tables
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.state import ParallelState
from megatrain.kernels.rms_norm import rms_norm
from megatrain.kernels.rope import apply_rope

from .parallel._dp_common import GPT2_TINY, LLAMA_TINY, make_model

assert (GPT2_TINY.vocab_size, GPT2_TINY.seq_length) == (LLAMA_TINY.vocab_size, LLAMA_TINY.seq_length)


def _model(flavour: str, dtype: torch.dtype = torch.float32) -> GPTModel:
    """The data-parallel tests' tiny GPT-2 (tied embedding, biases) or Llama (GQA, no biases)."""
    model = make_model(flavour, 0, dtype)
    assert isinstance(model, GPTModel)
    return model.train()


def _batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    vocab, seq = LLAMA_TINY.vocab_size, LLAMA_TINY.seq_length
    return [tuple(torch.randint(0, vocab, (2, seq), generator=g) for _ in range(2)) for _ in range(n)]


def _accumulate(model: GPTModel, fusion: bool, logits: bool = False) -> dict[str, torch.Tensor]:
    """main_grad after three micro-batches (two under no_sync) through DataParallel."""
    ddp = DataParallel(model, ParallelState.single(), gradient_accumulation_fusion=fusion)
    batches = _batches(3)
    for i, (x, y) in enumerate(batches):
        with ddp.no_sync() if i < len(batches) - 1 else torch.enable_grad():
            if logits:  # the unfused head: lm_head's Linear, then the loss on the logits
                loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            else:
                loss = model.loss(x, y)
            (loss * 0.5).backward()
    ddp.finish_grad_sync()
    for p in model.parameters():
        assert p.grad is None  # the placeholder (or the real .grad) was dropped by the hook
        assert not getattr(p, "grad_added_to_main_grad", False)
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _reference(model: GPTModel, logits: bool = False) -> dict[str, torch.Tensor]:
    for x, y in _batches(3):
        if logits:
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        else:
            loss = model.loss(x, y)
        (loss * 0.5).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
@pytest.mark.parametrize("logits", [False, True], ids=["fused-loss", "logits"])
def test_fused_accumulation_equals_plain_backward(flavour: str, logits: bool) -> None:
    """Linear, Embedding (GPT-2's tied with the head) and the fused loss add into main_grad what
    plain autograd puts in .grad, summed over micro-batches; fp32 rounding differs only in the
    order of the additions (~1e-7 relative)."""
    model = _model(flavour)
    ref = _reference(copy.deepcopy(model), logits)
    fused = _accumulate(copy.deepcopy(model), fusion=True, logits=logits)
    unfused = _accumulate(model, fusion=False, logits=logits)
    for name, g in ref.items():
        torch.testing.assert_close(fused[name], g, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(unfused[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_fused_accumulation_matches_unfused() -> None:
    """bf16 weights: the 16-bit weight-gradient GEMM is added into the fp32 buffer either way."""
    model = _model("llama", torch.bfloat16)
    fused = _accumulate(copy.deepcopy(model), fusion=True)
    unfused = _accumulate(model, fusion=False)
    for name, g in unfused.items():
        assert fused[name].dtype == torch.float32
        # The embedding adds its rows in fp32 when fused (its bf16 dense gradient otherwise).
        torch.testing.assert_close(fused[name], g, rtol=2e-2, atol=1e-4, msg=name)


def test_remove_hooks_returns_to_plain_grads() -> None:
    model = _model("llama")
    ref = _reference(copy.deepcopy(model))
    ddp = DataParallel(model, ParallelState.single())
    ddp.remove_hooks()
    assert not any(
        hasattr(p, "main_grad") or hasattr(p, "grad_accumulation_fusion") for p in model.parameters()
    )
    got = _reference(model)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)


def test_evaluation_and_frozen_weights_take_the_plain_path() -> None:
    model = _model("llama")
    DataParallel(model, ParallelState.single())
    x, y = _batches(1)[0]
    with torch.no_grad():
        assert model.loss(x, y).grad_fn is None
    model.embed.weight.requires_grad_(False)  # frozen after wrapping: no gradient, no error
    model.loss(x, y).backward()
    assert model.embed.weight.main_grad.abs().sum() == 0


# --- RMSNorm and RoPE -----------------------------------------------------------------------------


def _rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)).to(x.dtype)


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def test_rms_norm_gradcheck_and_reference() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    dy = torch.randn(3, 5, 8, dtype=torch.float64)
    got = torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), dy)
    want = torch.autograd.grad(_rms_norm_reference(x, w, 1e-5), (x, w), dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_rms_norm_bf16_computes_in_fp32() -> None:
    x = torch.randn(4, 16, 64) * 30
    w = torch.randn(64)
    got = rms_norm(x.bfloat16(), w.bfloat16(), 1e-5)
    assert got.dtype == torch.bfloat16
    want = _rms_norm_reference(x.bfloat16().float(), w.bfloat16().float(), 1e-5)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)  # one bf16 rounding


def test_rope_gradcheck_and_reference() -> None:
    cos, sin = rope_tables(6, 8, 10000.0)
    cos, sin = cos.double(), sin.double()
    # A strided view, as q/k are (slices of the fused qkv, transposed).
    base = torch.randn(2, 6, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda b: apply_rope(b.transpose(1, 2), cos, sin), (base,))
    dy = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    got = torch.autograd.grad(apply_rope(base.transpose(1, 2), cos, sin), base, dy)[0]
    want = torch.autograd.grad(_rope_reference(base.transpose(1, 2), cos, sin), base, dy)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    fwd = apply_rope(base.transpose(1, 2), cos, sin)
    torch.testing.assert_close(fwd, _rope_reference(base.transpose(1, 2), cos, sin), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fused_accumulation_under_recompute(mode: str) -> None:
    """Checkpointed blocks hand backward the recomputed tensors: main_grad must still be found."""
    model = _model("llama")
    ref = _reference(copy.deepcopy(model))
    model.set_recompute(mode)
    got = _accumulate(model, fusion=True)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_swiglu_gradcheck_and_reference() -> None:
    from megatrain.kernels.swiglu import swiglu

    h = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (h,))
    gate, up = h.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = swiglu(h)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(got)
    torch.testing.assert_close(
        torch.autograd.grad(got, h, dy)[0], torch.autograd.grad(want, h, dy)[0], rtol=1e-12, atol=1e-12
    )


def test_deferred_weight_grads_wait_for_the_w_pass() -> None:
    """A zero-bubble B: inside deferring_weight_grads the linears' weight gradients stay out of
    main_grad (the input gradients are complete), one closure per linear use; running them (W)
    gives exactly the gradients of an ordinary backward."""
    from megatrain.kernels.grad_accumulation import deferring_weight_grads

    model = _model("llama")
    ref = _accumulate(copy.deepcopy(model), fusion=True)
    ddp = DataParallel(model, ParallelState.single())
    linears = {n for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n}
    w_passes: list[list] = []
    batches = _batches(3)
    for i, (x, y) in enumerate(batches):
        with ddp.no_sync() if i < len(batches) - 1 else torch.enable_grad():
            before = {n: p.main_grad.clone() for n, p in model.named_parameters()}
            deferred: list = []
            with deferring_weight_grads(deferred):
                (model.loss(x, y) * 0.5).backward()
            w_passes.append(deferred)
            for n, p in model.named_parameters():
                if n in linears and n != "lm_head.weight":  # the fused head + loss is not deferred
                    assert torch.equal(p.main_grad, before[n]), n
            assert len(deferred) == sum(1 for n in linears if n != "lm_head.weight")
    for deferred in w_passes:
        for accumulate in deferred:
            accumulate()
    ddp.finish_grad_sync()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.main_grad, ref[n], rtol=1e-5, atol=1e-7, msg=n)
