"""The fused LM-head + cross-entropy against F.cross_entropy on materialised logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.kernels.linear_cross_entropy import linear_cross_entropy


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits.float(), labels.reshape(-1))


def _grads(fn, hidden, weight, labels, scale=1.0):  # noqa: ANN001, ANN202
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [None, 1, 7, 64, 1000])
def test_matches_cross_entropy_fp32(chunk: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 24, generator=g)  # 74 tokens: chunks do not divide it
    weight = torch.randn(101, 24, generator=g) * 0.3
    labels = torch.randint(0, 101, (2, 37), generator=g)
    ref = _grads(_reference, hidden, weight, labels, scale=3.0)
    got = _grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk), hidden, weight, labels, scale=3.0)
    assert got[0] == pytest.approx(ref[0].item(), rel=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)  # upstream scale 3 applied
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-7)


def test_spread_logits_give_no_subnormal_gradients() -> None:
    """A trained head's logits span hundreds below each row's max: the probabilities past e^-50 of
    the max are exactly 0, never subnormal floats (which slow a CPU's exp and GEMMs over 10x), and
    the loss and gradients still equal the reference's."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(48, 32, generator=g)
    weight = torch.randn(300, 32, generator=g) * 10.0  # logits of std ~57
    labels = torch.randint(0, 300, (48,), generator=g)
    ref = _grads(_reference, hidden, weight, labels)
    got = _grads(lambda h, w, y: linear_cross_entropy(h, w, y), hidden, weight, labels)
    assert ((ref[2] != 0) & (ref[2].abs() < torch.finfo(torch.float32).tiny)).any()  # the case is real
    for grad in got[1:]:
        assert not ((grad != 0) & (grad.abs() < torch.finfo(torch.float32).tiny)).any()
    assert got[0] == pytest.approx(ref[0].item(), rel=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [None, 7])
def test_vocab_limit_leaves_padding_rows_out(chunk: int | None) -> None:
    """Rows past vocab_limit are padding: the loss is CE over the first rows only, and their
    gradient is zero (the full weight's gradient is returned, so fusion into main_grad still works)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 16, generator=g)
    weight = torch.randn(128, 16, generator=g) * 0.3
    labels = torch.randint(0, 100, (3, 11), generator=g)
    ref = _grads(lambda h, w, y: _reference(h, w[:100], y), hidden, weight, labels, scale=2.0)
    got = _grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk, vocab_limit=100), hidden, weight, labels, 2.0
    )
    assert got[0] == pytest.approx(ref[0].item(), rel=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-7)
    assert not got[2][100:].any() and got[2].shape == weight.shape


def test_bf16_close_to_fp32_reference() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=g)
    weight = torch.randn(200, 32, generator=g) * 0.2
    labels = torch.randint(0, 200, (64,), generator=g)
    ref = _grads(_reference, hidden, weight, labels)
    loss, gh, gw = _grads(lambda h, w, y: linear_cross_entropy(h, w, y, 16), hidden.bfloat16(),
                          weight.bfloat16(), labels)  # fmt: skip
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref[0].item(), rel=1e-2)
    torch.testing.assert_close(gh.float(), ref[1], rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), ref[2], rtol=5e-2, atol=2e-3)


def test_no_grad_computes_only_the_loss() -> None:
    hidden, weight = torch.randn(10, 8), torch.randn(30, 8)
    labels = torch.randint(0, 30, (10,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, 3)
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(_reference(hidden, weight, labels).item(), rel=1e-6)


def test_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="10 hidden rows but 9 labels"):
        linear_cross_entropy(torch.randn(10, 4), torch.randn(5, 4), torch.zeros(9, dtype=torch.long))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_model_loss_equals_lm_loss_on_logits(arch: str) -> None:
    from megatrain.engine.config import TransformerConfig
    from megatrain.engine.models.gpt import GPTModel, lm_loss

    extra = dict(position_embedding="learned", normalization="layernorm", activation="gelu", add_bias=True,
                 tie_embeddings=True) if arch == "gpt2" else {}  # fmt: skip
    groups = 2 if arch == "llama" else 4
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                            ffn_hidden_size=64, seq_length=16, vocab_size=96, **extra)  # fmt: skip
    torch.manual_seed(0)
    a = GPTModel(cfg)
    b = GPTModel(cfg)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 96, (3, 16))
    y = torch.randint(0, 96, (3, 16))
    la, lb = lm_loss(a(x), y), b.loss(x, y)
    la.backward()
    lb.backward()
    assert lb.item() == pytest.approx(la.item(), rel=1e-6)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_fp32_logits_block_alive(dtype: torch.dtype) -> None:
    """The peak of the fused loss's forward holds one (chunk × V) fp32 block of logits, whatever the
    model dtype, besides the gradients it returns (hidden's in the model dtype, the weight's in fp32)
    and, at 16 bits, the chunk's 16-bit logits gradient and weight-gradient GEMM result."""
    from megatrain.engine.memtrack import LiveTensorBytes

    n, h, v, chunk = 64, 16, 512, 16
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with LiveTensorBytes([hidden, weight, labels]) as live:
        linear_cross_entropy(hidden, weight, labels, chunk)
    grads = n * h * hidden.element_size() + v * h * 4
    block = chunk * v * 4
    sixteen_bit = (chunk * v + v * h) * 2 if dtype != torch.float32 else 0
    assert grads + block <= live.peak < grads + block + sixteen_bit + 4096


@pytest.mark.parametrize("chunk", [None, 5])
def test_counts_the_tokens_predicted_right(chunk: int | None) -> None:
    """counting_token_hits(): the kept tokens whose label is the logits' argmax (token accuracy)."""
    from megatrain.kernels.linear_cross_entropy import counting_token_hits

    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(3, 11, 24, generator=g), torch.randn(30, 24, generator=g)
    logits = (hidden.reshape(-1, 24) @ weight.t()).float()
    labels = torch.randint(0, 30, (33,), generator=g)
    labels[::3] = logits.argmax(-1)[::3]  # a third of the tokens predicted right, at least
    mask = (torch.rand(33, generator=g) < 0.6).float()
    want = ((logits.argmax(-1) == labels) & (mask > 0)).sum()
    with counting_token_hits() as hits:
        linear_cross_entropy(hidden, weight, labels.reshape(3, 11), chunk, loss_mask=mask.reshape(3, 11))
        with torch.no_grad():  # evaluation counts too: twice the tokens
            linear_cross_entropy(hidden, weight, labels.reshape(3, 11), chunk, loss_mask=mask.reshape(3, 11))
    assert want >= 4 and hits.calls == 2 and hits.correct == 2 * want
    linear_cross_entropy(hidden, weight, labels.reshape(3, 11), chunk)  # outside: nobody counts
    assert hits.calls == 2
