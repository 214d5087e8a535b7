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
    """Every backend that runs here (flash and te need CUDA and their package)."""
    return [b for b in kernels.backends("attention") if b not in ("flash", "te") or torch.cuda.is_available()]


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
