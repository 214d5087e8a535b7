"""The attention backends a model chooses with model.attention_backend (megatrain/kernels/
attention_flex.py, attention_flash.py, megatrain/spec_attention.py): each that runs here against the
reference twin (causal and packed documents, GQA, fp32/bf16, forward and every gradient), the choice
reaching the model and MEGATRAIN_KERNELS overriding it, a tiny model training the same with flex as
with SDPA, flash-attn's and Transformer Engine's layouts through stand-ins with their documented
contracts, and the real libraries on a GPU."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatrain import kernels
from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.kernels import attention_flash, attention_flex
from megatrain.kernels.attention import Segments, attention_reference
from megatrain.spec_attention import missing_package, precision_problem, runtime_problem


@pytest.fixture(autouse=True)
def _fresh_registry() -> Any:
    """The registry memoises loaded functions: tests that swap one in must not leave it behind."""
    kernels._CHOSEN.clear()
    yield
    kernels._CHOSEN.clear()


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
# (B, H, G, T, hd): multi-head, grouped-query, multi-query.
SHAPES = [(1, 2, 2, 8, 8), (2, 4, 2, 16, 16), (2, 6, 1, 12, 8)]


def _qkv(
    b: int, h: int, g: int, t: int, hd: int, dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(b * 100 + t)
    return [torch.randn(b, n, t, hd, generator=gen).to(device=device, dtype=dtype) for n in (h, g, g)]


def _documents(b: int, t: int) -> torch.Tensor:
    """(B, T) ids of contiguous documents of different lengths in each row."""
    gen = torch.Generator().manual_seed(t)
    cuts = torch.rand(b, t, generator=gen) < 0.3
    cuts[:, 0] = False
    return torch.cumsum(cuts.long(), 1)


def _run(fn: Any, inputs: list[torch.Tensor], segments: Segments | None) -> tuple[torch.Tensor, list]:
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs, segments)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    (out.float() * weights).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _assert_matches_reference(fn: Any, inputs: list[torch.Tensor], segments: Segments | None) -> None:
    dtype = inputs[0].dtype
    out, grads = _run(fn, inputs, segments)
    ref_out, ref_grads = _run(attention_reference, inputs, segments)
    assert out.dtype == dtype and out.shape == ref_out.shape
    for got, want, x in zip([out, *grads], [ref_out, *ref_grads], [out, *inputs], strict=True):
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "g", "t", "hd"), SHAPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_backends_that_run_here_match_the_reference(
    backend: str, b: int, h: int, g: int, t: int, hd: int, dtype: torch.dtype, packed: bool
) -> None:
    segments = Segments(_documents(b, t)) if packed else None
    _assert_matches_reference(
        kernels.get("attention", backend=backend), _qkv(b, h, g, t, hd, dtype), segments
    )


def test_flex_without_gradients_is_its_forward_alone() -> None:
    q, k, v = _qkv(2, 4, 2, 16, 8, torch.float32)
    segments = Segments(_documents(2, 16))
    with torch.no_grad():
        got = attention_flex.attention_flex(q, k, v, segments)
    torch.testing.assert_close(got, attention_reference(q, k, v, segments), rtol=1e-5, atol=1e-5)


def test_the_document_block_mask_is_built_once_per_segments() -> None:
    segments = Segments(_documents(2, 16))
    first = attention_flex.document_block_mask(segments)
    assert attention_flex.document_block_mask(segments) is first  # every layer reuses it
    assert attention_flex.document_block_mask(Segments(segments.ids.clone())) is not first
    # Its dense form is the document mask the other backends use.
    dense = first.to_dense()  # (B, 1, blocks, blocks) of 128-token blocks: T=16 is one block
    assert dense.shape[0] == 2 and bool(dense.all())
    q, k, v = _qkv(2, 2, 2, 16, 8, torch.float32)
    assert attention_flex.causal_block_mask(16, "cpu") is attention_flex.causal_block_mask(16, "cpu")


def test_flex_refuses_dropout() -> None:
    q, k, v = _qkv(1, 2, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="flex attention runs no dropout"):
        attention_flex.attention_flex(q, k, v, None, 0.1)


# -- the choice: registry, model, MEGATRAIN_KERNELS ----------------------------------------------


def test_auto_is_flash_on_cuda_where_installed_else_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels._choose("attention", "cpu", None).name == "sdpa"
    monkeypatch.setattr(attention_flash, "flash_attn_available", lambda: True)
    assert kernels._choose("attention", "cuda", None).name == "flash"
    monkeypatch.setattr(attention_flash, "flash_attn_available", lambda: False)
    assert kernels._choose("attention", "cuda", None).name == "sdpa"
    # te and flex run only when a model names them.
    assert kernels._choose("attention", "cuda", None, prefer="te").name == "te"
    assert kernels._choose("attention", "cpu", None, prefer="flex").name == "flex"


def _tiny(backend: str) -> TransformerConfig:
    return TransformerConfig.preset("tiny-llama", attention_backend=backend)


def test_the_model_calls_the_backend_its_config_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)
    calls: list[str] = []
    real = attention_flex.attention_flex

    def spy(*args: Any) -> torch.Tensor:
        calls.append("flex")
        return real(*args)

    monkeypatch.setattr(attention_flex, "attention_flex", spy)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    GPTModel(_tiny("flex"))(tokens)
    assert calls == ["flex", "flex"]  # one per layer
    GPTModel(_tiny("auto"))(tokens)
    assert len(calls) == 2
    # MEGATRAIN_KERNELS overrides the model's choice, for debugging.
    monkeypatch.setenv(kernels.ENV, "attention=reference")
    GPTModel(_tiny("flex"))(tokens)
    assert len(calls) == 2


@pytest.mark.parametrize("packed", [False, True])
def test_a_tiny_model_trains_the_same_with_flex_as_with_sdpa(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)
    gen = torch.Generator().manual_seed(1)
    # One batch three times: its loss must fall (random tokens are not learnable across batches).
    batches = [torch.randint(0, 128, (2, 17), generator=gen)] * 3
    segment_ids = _documents(2, 16) if packed else None

    def losses(backend: str) -> list[float]:
        torch.manual_seed(0)
        model = GPTModel(_tiny(backend))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for batch in batches:
            loss = model.loss(batch[:, :-1], batch[:, 1:], segment_ids=segment_ids)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    sdpa, flex = losses("sdpa"), losses("flex")
    assert sdpa[-1] < sdpa[0]  # it learns: the steps are not no-ops
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-5)


# -- what a worker without the package, a GPU or 16-bit gets -------------------------------------


def test_runtime_problems_name_the_package_the_device_and_the_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    for backend, dist in (("flash", "flash-attn"), ("te", "transformer-engine")):
        problem = runtime_problem(backend, "cuda", "bf16")
        assert problem is not None and dist in problem and "pip install megatrain[gpu]" in problem
    assert missing_package("flex") is None and missing_package("sdpa") is None
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert runtime_problem("flash", "cuda", "bf16") is None
    assert "needs a CUDA GPU" in (runtime_problem("te", "cpu", "bf16") or "")
    assert "fp16/bf16" in (runtime_problem("flash", "cuda", "fp32") or "")
    assert precision_problem("flex", "fp32") is None and runtime_problem("flex", "cpu", "fp32") is None


# -- flash-attn and Transformer Engine through stand-ins (their contracts; CPU tensors) --------------


def _flash_stand_in(calls: list[tuple[str, Any]]) -> types.ModuleType:
    """flash-attn 2's two entry points as documented: (B, T, heads, hd) dense and tokens-first
    (total, heads, hd) varlen tensors, int32 cu_seqlens, causal per sequence, fewer K/V heads allowed."""

    def dense(q, k, v, dropout_p=0.0, causal=False):  # noqa: ANN001, ANN202
        calls.append(("dense", causal))
        o = F.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, enable_gqa=True
        )
        return o.transpose(1, 2)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):  # noqa: ANN001, ANN202
        calls.append(("varlen", cu_q.tolist()))
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == max_k and causal
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out = torch.empty_like(q)
        bounds = cu_q.tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in (q, k, v))  # (heads, n, hd)
            out[lo:hi] = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = dense  # type: ignore[attr-defined]
    module.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    return module


def test_flash_lays_out_tokens_as_flash_attn_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _flash_stand_in(calls))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # no flash-attn 3 here
    monkeypatch.setattr(
        attention_flash, "flash_supports", lambda q: q.dtype in (torch.float16, torch.bfloat16)
    )
    inputs = _qkv(2, 4, 2, 16, 8, torch.bfloat16)
    segments = Segments(_documents(2, 16))
    _assert_matches_reference(attention_flash.attention_flash, inputs, segments)
    assert calls == [("varlen", segments.varlen[0].tolist())]
    _assert_matches_reference(attention_flash.attention_flash, inputs, None)
    assert calls[-1] == ("dense", True)
    # fp32, or a document that comes back after a gap: SDPA, flash-attn untouched.
    calls.clear()
    attention_flash.attention_flash(*(x.float() for x in inputs), segments)
    attention_flash.attention_flash(*inputs, Segments(torch.tensor([[0] * 6 + [1] * 4 + [0] * 6] * 2)))
    assert calls == []


def test_te_lays_out_tokens_as_transformer_engine_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    """DotProductAttention's documented contract: bshd (B, T, H, hd) with a causal mask, or thd
    (total, H, hd) with cu_seqlens and a padding_causal mask; the output flattens the heads."""
    made: list[tuple] = []

    class StandIn(torch.nn.Module):
        def __init__(self, heads: int, groups: int, hd: int, packed: bool) -> None:
            super().__init__()
            self.packed = packed
            made.append((heads, groups, hd, packed))

        def forward(self, q, k, v, **kw):  # noqa: ANN001, ANN003, ANN202
            if not self.packed:
                assert not kw
                o = F.scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True
                )
                return o.transpose(1, 2).flatten(2)  # (B, T, H·hd)
            cu = kw["cu_seqlens_q"]
            assert torch.equal(cu, kw["cu_seqlens_kv"]) and kw["max_seqlen_q"] == kw["max_seqlen_kv"]
            out = torch.empty_like(q)
            bounds = cu.tolist()
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                out[lo:hi] = o.transpose(0, 1)
            return out.flatten(1)  # (total, H·hd)

    monkeypatch.setattr(
        attention_flash, "_te_attention", lambda h, g, hd, p, packed, causal=True: StandIn(h, g, hd, packed)
    )
    monkeypatch.setattr(attention_flash, "te_supports", lambda q: q.dtype in (torch.float16, torch.bfloat16))
    inputs = _qkv(2, 4, 2, 16, 8, torch.bfloat16)
    _assert_matches_reference(attention_flash.attention_te, inputs, Segments(_documents(2, 16)))
    _assert_matches_reference(attention_flash.attention_te, inputs, None)
    assert made == [(4, 2, 8, True), (4, 2, 8, False)]


# -- the real libraries, the day a GPU runs the suite --------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "te", "flex"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_backends_match_the_reference(backend: str, dtype: torch.dtype, packed: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if backend in ("flash", "te") and missing_package(backend):
        pytest.skip(missing_package(backend) or "")
    b, h, g, t, hd = 2, 8, 2, 256, 64
    inputs = _qkv(b, h, g, t, hd, dtype, device="cuda")
    segments = Segments(_documents(b, t).cuda()) if packed else None
    _assert_matches_reference(kernels.get("attention", "cuda", backend=backend), inputs, segments)
