"""The Triton kernels (megatrain.kernels.triton) against their PyTorch twins, forward and every
gradient over shapes × dtypes, run by Triton's interpreter on a CPU (tests/conftest.py
turns it on); and the tiny model trained with them against the twins."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatrain import kernels
from megatrain.engine.models.gpt import rope_tables

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# Hidden 48 runs in a block of 64 (masked lanes); 7 and 9 rows split unevenly over 4 programs.
NORM_SHAPES = [(7, 48), (3, 3, 32)]
LAUNCHERS = {"rms_norm": "rms_norm_forward", "layer_norm": "layer_norm_forward", "rope": "rope_launch",
             "glu": "glu_forward"}  # fmt: skip
"""Each Triton module's forward launcher (what the training test counts)."""
TRITON_KERNELS = "rms_norm=triton,layer_norm=triton,apply_rope_qk=triton,swiglu=triton,geglu=triton"
TWINS = TRITON_KERNELS.replace("=triton", "=torch")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def _run(fn: Callable[..., object], inputs: list[torch.Tensor], *extra: object) -> list[torch.Tensor]:
    """Outputs and the gradient of every input under a fixed, non-uniform upstream gradient."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs, *extra)
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=torch.Generator().manual_seed(99 + i)).to(o.device)).sum()
        for i, o in enumerate(outs)
    )
    loss.backward()  # type: ignore[union-attr]
    return [o.detach() for o in outs] + [x.grad for x in xs]  # type: ignore[misc]


def _against_twin(kernel: str, inputs: list[torch.Tensor], *extra: object, dtype: torch.dtype) -> None:
    got = _run(kernels.get(kernel, DEVICE, backend="triton"), inputs, *extra)
    want = _run(kernels.get(kernel, DEVICE, backend="reference"), inputs, *extra)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = _leaf(shape, dtype, 0), 1 + _leaf(shape[-1:], dtype, 1, 0.3)
    _against_twin("rms_norm", [x, w], 1e-5, dtype=dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # An offset input: a variance computed without centring the padding lanes would be wrong.
    x = _leaf(shape, dtype, 0) + 3
    w, b = 1 + _leaf(shape[-1:], dtype, 1, 0.3), _leaf(shape[-1:], dtype, 2, 0.3)
    _against_twin("layer_norm", [x, w, b], 1e-5, dtype=dtype)


def test_layer_norm_without_bias() -> None:
    x, w = _leaf((5, 48), torch.float32, 0), 1 + _leaf((48,), torch.float32, 1, 0.3)
    _against_twin("layer_norm", [x, w], None, 1e-5, dtype=torch.float32)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", [(5, 2 * 24), (2, 3, 2 * 1500)])  # f = 1500: two 1024-wide blocks
@pytest.mark.parametrize("kernel", ["swiglu", "geglu"])
def test_gated_activations(kernel: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _against_twin(kernel, [_leaf(shape, dtype, 3, 2.0)], dtype=dtype)


def _split_rope(kernel: str, heads: int, hd: int, backend: str) -> Callable[..., object]:
    """The kernel applied to q and k as split_qkv makes them: strided views of one (B, T, ·)
    projection (the gradient reaches that projection through them)."""
    rope = kernels.get(kernel, DEVICE, backend=backend)

    def apply(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> object:
        b, t, _ = qkv.shape
        q = qkv[..., : heads * hd].reshape(b, t, heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k = qkv[..., heads * hd :].reshape(b, t, -1, hd).transpose(1, 2)  # (B, G, T, hd)
        return rope(q, k, cos, sin) if kernel == "apply_rope_qk" else rope(q, cos, sin)

    return apply


def _rope_against_twin(
    kernel: str,
    shape: tuple[int, int, int, int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    batch, heads, groups, seq, hd = shape
    qkv = _leaf((batch, seq, (heads + groups) * hd), dtype, 4)
    cos, sin = cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)
    got = _run(_split_rope(kernel, heads, hd, "triton"), [qkv], cos, sin)
    want = _run(_split_rope(kernel, heads, hd, "reference"), [qkv], cos, sin)
    for g, w in zip(got, want, strict=True):
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", [(1, 2, 2, 5, 8), (2, 6, 2, 7, 12)])  # (B, H, G, T, hd)
@pytest.mark.parametrize("kernel", ["apply_rope_qk", "apply_rope"])
def test_rope(kernel: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    cos, sin = rope_tables(shape[3], shape[4], 10000.0)
    _rope_against_twin(kernel, shape, cos, sin, dtype)


def test_rope_with_per_row_positions() -> None:
    """(B, 1, T, hd) tables (packed documents' position ids): each row its own positions."""
    cos, sin = rope_tables(16, 8, 10000.0)
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])
    cos_b, sin_b = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    _rope_against_twin("apply_rope_qk", (2, 4, 2, 5, 8), cos_b, sin_b, torch.float32)


def test_rope_launch_rotates_in_place_and_back() -> None:
    from megatrain.kernels.triton.rope import rope_launch

    cos, sin = (t.to(DEVICE) for t in rope_tables(7, 12, 10000.0))
    q, k = _leaf((2, 6, 7, 12), torch.float32, 5), _leaf((2, 2, 7, 12), torch.float32, 6)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = kernels.get("apply_rope_qk", DEVICE, backend="reference")(q0, k0, cos, sin)
    rope_launch(q, k, cos, sin, q, k)
    _close(q, want_q, torch.float32)
    _close(k, want_k, torch.float32)
    rope_launch(q, k, cos, sin, q, k, backward=True)  # the rotation by -θ undoes it
    _close(q, q0, torch.float32)
    _close(k, k0, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernels_at_model_sizes(dtype: torch.dtype) -> None:
    """Compiled (not interpreted) at a 7B layer's widths: hidden 4096, ffn 11008, 32 heads of 128."""
    rows, h, f = 2048, 4096, 11008
    x, w = _leaf((rows, h), dtype, 0), 1 + _leaf((h,), dtype, 1, 0.3)
    _against_twin("rms_norm", [x, w], 1e-5, dtype=dtype)
    _against_twin("layer_norm", [x, w, _leaf((h,), dtype, 2, 0.3)], 1e-5, dtype=dtype)
    _against_twin("swiglu", [_leaf((rows, 2 * f), dtype, 3)], dtype=dtype)
    _against_twin("geglu", [_leaf((rows, 2 * f), dtype, 3)], dtype=dtype)
    cos, sin = rope_tables(512, 128, 10000.0)
    _rope_against_twin("apply_rope_qk", (2, 32, 8, 512, 128), cos, sin, dtype)


def test_the_registry_picks_triton_on_cuda_and_the_twins_on_a_cpu() -> None:
    from megatrain.kernels.rms_norm import rms_norm
    from megatrain.kernels.triton import rms_norm as triton_rms_norm

    assert kernels.backends("layer_norm") == ["triton", "torch", "reference"]
    assert kernels.get("rms_norm", "cpu") is rms_norm
    assert kernels.get("rms_norm", "cuda") is triton_rms_norm.rms_norm  # the interpreter, or a GPU


def _counting(fn: Callable[..., object], name: str, calls: dict[str, int]) -> Callable[..., object]:
    def counted(*args: object, **kw: object) -> object:
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kw)

    return counted


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "launched"), [("llama", {"rms_norm", "rope", "glu"}), ("gpt2", {"layer_norm"})]
)
def test_the_model_trains_alike_with_the_triton_kernels(
    arch: str, launched: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec
    from tests.engine.helpers import read_jsonl, tiny_spec, write_corpus

    raw = tiny_spec(write_corpus(tmp_path / "corpus.jsonl", num_docs=20), train_iters=3, global_batch_size=2,
                    eval_interval=0, checkpoint_interval=0)  # fmt: skip
    raw["model"]["seq_length"] = 16
    if arch == "gpt2":  # LayerNorm (and GELU, learned positions)
        raw["model"].update(arch="gpt2", num_query_groups=None)
    else:  # RMSNorm, RoPE and the GeGLU option
        raw["model"]["activation"] = "geglu"
    # Count the Triton launches, so a silent fallback to the twins cannot pass.
    calls: dict[str, int] = {}
    for name, launcher in LAUNCHERS.items():
        module = importlib.import_module(f"megatrain.kernels.triton.{name}")

        monkeypatch.setattr(module, launcher, _counting(getattr(module, launcher), name, calls))
    losses = {}
    for name, forced in (("twins", TWINS), ("triton", TRITON_KERNELS)):
        monkeypatch.setenv(kernels.ENV, forced)
        run(parse_spec(raw), tmp_path / name)
        losses[name] = [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")]
    assert set(calls) == launched
    assert len(losses["twins"]) == 3 and losses["twins"][0] != losses["twins"][-1]
    assert losses["triton"] == pytest.approx(losses["twins"], rel=1e-4)
