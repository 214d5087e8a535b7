"""precision fp8: our float8 linear against torchao's own Float8Linear (emulated on CPU), which
layers multiply in float8, the precision a device runs, and a short fp8 run against bf16's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatrain import kernels
from megatrain.engine.config import TransformerConfig
from megatrain.engine.fp8 import enable_fp8
from megatrain.engine.metrics import peak_tflops
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.runtime import effective_precision
from megatrain.engine.train import run
from megatrain.kernels.fp8_linear import Fp8Linear
from megatrain.settings import Settings
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def _torchao_linear(weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> Float8Linear:
    """torchao's module-swap Float8Linear (emulated: CPU) holding copies of `weight` and `bias`."""
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    plain = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        plain.weight.copy_(weight)
        if bias is not None:
            plain.bias.copy_(bias)
    return Float8Linear.from_float(plain, config)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_linear_equals_torchaos_float8_linear(recipe: str, bias: bool, fused: bool) -> None:
    """The `linear` kernel on a weight tagged fp8 computes what torchao's Float8Linear does, output
    and every gradient bit for bit, the weight's landing in main_grad under DataParallel (fused)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 32, dtype=torch.bfloat16) / 6)  # (out, in)
    b = torch.nn.Parameter(torch.randn(48, dtype=torch.bfloat16)) if bias else None
    ref = _torchao_linear(w.detach(), b.detach() if b is not None else None, recipe)
    w.fp8 = Fp8Linear(recipe)  # type: ignore[attr-defined]
    if fused:
        w.grad_accumulation_fusion = True  # type: ignore[attr-defined]
        w.main_grad = torch.full(w.shape, 0.5)  # type: ignore[attr-defined]  # accumulates onto this
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16) * 3
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y = kernels.get("linear", "cpu")(x_ours, w, b)
    assert torch.equal(y, y_ref)
    # float8 is really in play: bf16's own GEMM gives another answer.
    assert not torch.equal(y, torch.nn.functional.linear(x, w, b))
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y.backward(grad)
    assert x_ours.grad is not None and torch.equal(x_ours.grad, x_ref.grad)
    if fused:
        assert torch.equal(w.main_grad, ref.weight.grad.float() + 0.5)  # type: ignore[attr-defined]
    else:
        assert w.grad is not None and torch.equal(w.grad, ref.weight.grad)
    if b is not None:
        assert b.grad is not None and torch.equal(b.grad, ref.bias.grad)


def test_registry_and_untagged_weights() -> None:
    assert kernels.backends("linear_fp8") == ["torchao", "te", "reference"]
    assert kernels.get("linear_fp8", "cpu") is kernels.get("linear_fp8", "cpu", "torchao")  # te: CUDA only
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    # A weight precision fp8 did not tag (the LM head's) multiplies as before.
    assert torch.equal(kernels.get("linear", "cpu")(x, w), torch.nn.functional.linear(x, w))


def test_only_the_transformer_linears_run_in_fp8() -> None:
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=256, seq_length=16,
    )  # fmt: skip
    model = GPTModel(cfg)
    names = enable_fp8(model, "rowwise")
    per_layer = {n.split(".", 2)[2] for n in names}
    assert per_layer == {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}
    assert len(names) == 2 * 4
    assert getattr(model.lm_head.weight, "fp8", None) is None  # the head stays bf16
    assert getattr(model.embed.weight, "fp8", None) is None
    assert model.layers[0].attn.qkv.weight.fp8 == Fp8Linear("rowwise")


def test_the_precision_a_device_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("megatrain.engine.runtime.get_settings", lambda: Settings(cpu_low_precision=False))
    monkeypatch.setattr("megatrain.engine.runtime.cpu_has_native_bf16", lambda: False)
    assert effective_precision("fp8", "cpu") == "fp32"  # bf16's rule: emulated bf16 is too slow
    monkeypatch.setattr("megatrain.engine.runtime.cpu_has_native_bf16", lambda: True)
    assert effective_precision("fp8", "cpu") == "fp8"  # float8 GEMMs emulated
    # A GPU without float8 GEMMs (before Ada/Hopper) runs bf16; SM 8.9+ runs fp8.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert effective_precision("fp8", "cuda:0") == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert effective_precision("fp8", "cuda:0") == "fp8"


def test_mfu_reports_fp8_against_the_bf16_peak() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == peak_tflops("NVIDIA H100 80GB HBM3", "bf16")


def _losses(tmp_path: Path, corpus: Path, precision: str, recipe: str = "tensorwise") -> list[float]:
    out = tmp_path / f"{precision}-{recipe}"
    raw = tiny_spec(
        corpus, precision=precision, fp8_recipe=recipe, train_iters=8, global_batch_size=4,
        eval_interval=0, checkpoint_interval=0, warmup_iters=2,
    )  # fmt: skip
    run(parse_spec(raw), out)
    started = next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "started")
    assert started["precision"] == precision
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_a_short_fp8_run_tracks_bf16(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 steps of the tiny llama (widths 32/64/128, multiples of 16) in fp8 (emulated) and in bf16
    from the same seed: every step's loss within 0.05 of bf16's. Measured on this project's CPU:
    at most 0.008 (tensorwise) and 0.012 (rowwise) over 12 steps, 0.0095 and 0.066 over 20 (the
    runs drift apart as training goes on), so 0.05 is about 4× the 12-step figure."""
    monkeypatch.setattr("megatrain.engine.runtime.get_settings", lambda: Settings(cpu_low_precision=True))
    bf16 = _losses(tmp_path, corpus, "bf16")
    for recipe in ("tensorwise", "rowwise"):
        fp8 = _losses(tmp_path, corpus, "fp8", recipe)
        assert len(fp8) == len(bf16) == 8
        assert fp8 != bf16  # the float8 GEMMs ran
        assert max(abs(a - b) for a, b in zip(fp8, bf16, strict=True)) < 0.05, (recipe, fp8, bf16)
        assert fp8[-1] < fp8[0] - 1.0  # and it learns


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_transformer_engine_backend_agrees_with_torchao() -> None:
    """fp8_backend te (Float8CurrentScaling) against torchao's tensorwise on the same GPU: the same
    recipe (per-tensor current scales, e4m3 forward, e5m2 gradients), so outputs and gradients
    agree to the GEMMs' accumulation order (bf16 outputs: 2e-2 relative)."""
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9+")
    torch.manual_seed(0)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16) / 11
    x = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for backend in ("torchao", "te"):
        wb = torch.nn.Parameter(w.clone())
        wb.fp8 = Fp8Linear("tensorwise", backend)  # type: ignore[attr-defined]
        xb = x.clone().requires_grad_()
        y = kernels.get("linear", "cuda")(xb, wb)
        y.float().square().mean().backward()
        grads[backend] = (y.detach(), xb.grad, wb.grad)
    for ours, theirs in zip(grads["te"], grads["torchao"], strict=True):
        assert ours is not None and theirs is not None
        assert ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item() < 2e-2
