"""The attention kernel: every backend against the reference twin, with and without packed documents,
over shapes × dtypes, forward and every gradient; and the document mask's meaning."""

from __future__ import annotations

import pytest
import torch

from megatrain import kernels
from megatrain.kernels.attention import Segments, attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _qkv(b: int, h: int, g: int, t: int, hd: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, t, hd, generator=gen).to(dtype) for n in (h, g, g)]


def _segments(b: int, t: int, seed: int) -> torch.Tensor:
    """Rows of random-length contiguous segments (ids increasing along each row)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        cuts = torch.rand(t, generator=gen) < 0.25
        cuts[0] = False
        rows.append(torch.cumsum(cuts.long(), 0))
    return torch.stack(rows)


def _run(backend: str, inputs: list[torch.Tensor], segments: Segments | None) -> tuple[torch.Tensor, list]:
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = kernels.get("attention", backend=backend)(*xs, segments)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out.float() * weights).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _usable_backends() -> list[str]:
    return [b for b in kernels.backends("attention") if b != "flash_varlen" or torch.cuda.is_available()]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(("b", "h", "g", "t", "hd"), [(1, 2, 2, 7, 8), (2, 4, 2, 16, 16), (3, 6, 1, 11, 8)])
@pytest.mark.parametrize("packed", [False, True])
def test_backends_match_the_reference(
    b: int, h: int, g: int, t: int, hd: int, dtype: torch.dtype, packed: bool
) -> None:
    inputs = _qkv(b, h, g, t, hd, dtype)
    segments = Segments(_segments(b, t, seed=t)) if packed else None
    ref_out, ref_grads = _run("reference", inputs, segments)
    for backend in _usable_backends():
        out, grads = _run(backend, inputs, segments)
        assert out.dtype == dtype and out.shape == (b, h, t, hd)
        for got, want in zip([out, *grads], [ref_out, *ref_grads], strict=True):
            torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_a_packed_row_equals_its_documents_run_alone() -> None:
    q, k, v = _qkv(1, 4, 2, 12, 8, torch.float32)
    ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    packed = attention(q, k, v, Segments(ids))
    for lo, hi in ((0, 5), (5, 9), (9, 12)):
        alone = attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])
        torch.testing.assert_close(packed[:, :, lo:hi], alone)
    # ... and not what plain causal attention over the whole row gives past the first document.
    assert not torch.allclose(attention(q, k, v)[:, :, 5:], packed[:, :, 5:])


def test_one_segment_per_row_is_plain_causal_attention() -> None:
    q, k, v = _qkv(2, 2, 2, 9, 8, torch.float32)
    one = Segments(torch.zeros(2, 9, dtype=torch.long))
    torch.testing.assert_close(attention(q, k, v, one), attention(q, k, v))


def test_the_mask_and_the_varlen_boundaries() -> None:
    seg = Segments(torch.tensor([[0, 0, 1, 1, 1], [3, 4, 4, 4, 4]]))
    mask = seg.mask[:, 0]
    assert mask.shape == (2, 5, 5)
    assert mask[0, 1, 0] and not mask[0, 2, 1] and mask[0, 4, 2] and not mask[0, 2, 3]
    assert not mask[1, 1, 0] and mask[1, 4, 1]
    cu, longest = seg.varlen
    assert cu.tolist() == [0, 2, 5, 6, 10] and cu.dtype == torch.int32 and longest == 4
    assert seg.contiguous and not Segments(torch.tensor([[0, 1, 0]])).contiguous
    with pytest.raises(ValueError, match="segment_ids must be"):
        Segments(torch.zeros(5, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backends_match_the_reference(dtype: torch.dtype) -> None:
    inputs = [x.cuda() for x in _qkv(2, 4, 2, 64, 32, dtype)]
    segments = Segments(_segments(2, 64, seed=1).cuda())
    ref_out, ref_grads = _run("reference", inputs, segments)
    out, grads = _run(kernels._choose("attention", "cuda", None).name, inputs, segments)
    for got, want in zip([out, *grads], [ref_out, *ref_grads], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_the_varlen_backend_lays_out_tokens_as_flash_attn_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn needs CUDA; here a stand-in with its documented contract (tokens-first (total, heads,
    hd) tensors, int32 cu_seqlens, causal within each sequence, fewer K/V heads allowed) checks our
    side: the layout in and out, the boundaries, and the fallbacks."""
    import sys
    import types

    import torch.nn.functional as F

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):  # noqa: ANN001, ANN202
        calls.append((cu_q.tolist(), max_q, causal))
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == max_k and causal
        out = torch.empty_like(q)
        bounds = cu_q.tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in (q, k, v))  # (heads, n, hd)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            out[lo:hi] = o.transpose(0, 1)
        return out

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    )
    from megatrain.kernels.attention import attention_flash_varlen, attention_reference

    q, k, v = _qkv(2, 4, 2, 10, 8, torch.bfloat16)
    segments = Segments(_segments(2, 10, seed=4))
    got = attention_flash_varlen(q, k, v, segments)
    assert len(calls) == 1 and calls[0][0] == segments.varlen[0].tolist()
    torch.testing.assert_close(
        got.float(), attention_reference(q, k, v, segments).float(), rtol=3e-2, atol=3e-2
    )
    # No segments, fp32, or a segment that comes back after a gap: the SDPA path, flash-attn untouched.
    attention_flash_varlen(q, k, v, None)
    attention_flash_varlen(q.float(), k.float(), v.float(), segments)
    attention_flash_varlen(q, k, v, Segments(torch.tensor([[0] * 5 + [1] * 3 + [0] * 2] * 2)))
    assert len(calls) == 1
