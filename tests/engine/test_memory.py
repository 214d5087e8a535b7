"""The analytical memory estimate against measured bytes of real GPTModel training steps.

CPU peaks come from megatrain.engine.memtrack.LiveTensorBytes (every storage an op returns, until
it is freed); the GPU test uses torch.cuda.max_memory_allocated. Tolerances:

- parameters, gradients, Adam state: the counts are exact, so ±1%.
- activations saved for backward (measured at the end of the forward pass): ±5%; they are counted
  tensor by tensor, what is left are a few tiny tensors (norm statistics, RoPE slices).
- peak activations (saved + the largest backward transient): ±15%; the estimate models the
  transient at the loss and at three moments of an MLP's backward, not op by op, and measured
  within -10%…+10% over these shapes.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatrain.engine.config import TransformerConfig
from megatrain.engine.memtrack import LiveTensorBytes, tensors_of
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.plan.memory import ModelShape, estimate_memory, from_spec, layer_params, stage_params

_SIZE = {"hidden_size": 64, "seq_length": 64, "vocab_size": 256}
GPT2 = TransformerConfig.preset("tiny-gpt2", **_SIZE, ffn_hidden_size=256)
LLAMA = TransformerConfig.preset("tiny-llama", **_SIZE, ffn_hidden_size=192)
FLAVOURS = {"gpt2": GPT2, "llama": LLAMA}


def measure_step(
    cfg: TransformerConfig,
    micro_batch_size: int,
    recompute: str,
    dtype: torch.dtype = torch.float32,
    attention: str = "flash",
    fused_loss: bool = False,
) -> dict[str, int]:
    """Bytes of model state, and saved/peak activation bytes of one forward+backward+AdamW step.

    A first step creates the gradients and Adam state; gradients are then zeroed in place, as the
    engine's persistent gradient buffer is, so the measured step accumulates into existing storage.
    """
    torch.manual_seed(0)
    model = GPTModel(cfg).to(dtype)
    model.set_recompute(recompute)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-4, foreach=True)
    x = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_length))
    y = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_length))
    backends = [SDPBackend.MATH] if attention == "math" else [SDPBackend.FLASH_ATTENTION]
    saved: dict[str, int] = {}

    def step(tracker: LiveTensorBytes | None = None) -> None:
        # Backward inside the context too: selective recompute reruns SDPA there.
        with sdpa_kernel(backends):
            loss = model.loss(x, y) if fused_loss else lm_loss(model(x), y)
            if tracker is not None:
                saved["stored"] = tracker.current
            loss.backward()

    step()
    opt.step()
    opt.zero_grad(set_to_none=False)
    with LiveTensorBytes(tensors_of(model, opt, x, y)) as tracker:
        step(tracker)
        peak = tracker.peak
        tracker.reset_peak()
        opt.step()
        workspace = tracker.peak - tracker.current
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return {
        "params": sum(params.values()),
        "grads": sum(p.grad.untyped_storage().nbytes() for p in model.parameters()),
        "optimizer": sum(v.nbytes for s in opt.state.values() for v in s.values() if v.ndim),
        "stored": saved["stored"],
        "peak": peak,
        "workspace": workspace,
    }


def stored_activations(est) -> int:  # noqa: ANN001
    return sum(v for k, v in est.breakdown.items() if k.startswith("activations_"))


@pytest.mark.parametrize("micro_batch_size", [1, 4])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_estimate_matches_measured_cpu_step(flavour: str, recompute: str, micro_batch_size: int) -> None:
    cfg = FLAVOURS[flavour]
    measured = measure_step(cfg, micro_batch_size, recompute)
    est = estimate_memory(
        cfg,
        micro_batch_size=micro_batch_size,
        precision="fp32",
        recompute=recompute,
        fused_optimizer=False,
        device="cpu",
    )
    assert est.num_params == GPTModel(cfg).num_parameters()
    assert est.params_bytes == pytest.approx(measured["params"], rel=0.01)
    assert est.grads_bytes == pytest.approx(measured["grads"], rel=0.01)
    assert est.optimizer_bytes == pytest.approx(measured["optimizer"], rel=0.01)
    # foreach AdamW's step: one fp32 temporary per parameter of each group.
    assert est.breakdown["optimizer_workspace"] == pytest.approx(measured["workspace"], rel=0.05)
    assert stored_activations(est) == pytest.approx(measured["stored"], rel=0.05)
    assert est.activations_bytes == pytest.approx(measured["peak"], rel=0.15)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_estimate_matches_measured_step_with_fused_loss(flavour: str, recompute: str) -> None:
    cfg = replace(FLAVOURS[flavour], vocab_size=2048)  # a vocabulary large enough to matter
    measured = measure_step(cfg, 4, recompute, fused_loss=True)
    est = estimate_memory(cfg, micro_batch_size=4, precision="fp32", recompute=recompute,
                          fused_optimizer=False, device="cpu", fused_loss=True)  # fmt: skip
    unfused = estimate_memory(cfg, micro_batch_size=4, precision="fp32", recompute=recompute,
                              fused_optimizer=False, device="cpu")  # fmt: skip
    assert stored_activations(est) == pytest.approx(measured["stored"], rel=0.05)
    assert est.activations_bytes == pytest.approx(measured["peak"], rel=0.15)
    assert est.activations_bytes < unfused.activations_bytes  # what the fusion is for


@pytest.mark.parametrize(
    ("flavour", "dtype", "attention", "recompute", "dropout"),
    [
        ("gpt2", torch.bfloat16, "flash", "none", 0.0),
        ("llama", torch.bfloat16, "flash", "full", 0.0),
        ("gpt2", torch.float32, "math", "none", 0.0),
        ("llama", torch.float32, "math", "selective", 0.0),
        ("llama", torch.float32, "flash", "none", 0.1),
    ],
)
def test_estimate_variants(
    flavour: str, dtype: torch.dtype, attention: str, recompute: str, dropout: float
) -> None:
    """16-bit activations, SDPA's math path (which keeps the softmax), dropout masks."""
    cfg = replace(FLAVOURS[flavour], hidden_dropout=dropout)
    measured = measure_step(cfg, 2, recompute, dtype=dtype, attention=attention)
    est = estimate_memory(
        cfg,
        micro_batch_size=2,
        precision="fp32" if dtype == torch.float32 else "bf16",
        recompute=recompute,
        attention=attention,
        device="cpu",
    )
    assert stored_activations(est) == pytest.approx(measured["stored"], rel=0.05)
    assert est.activations_bytes == pytest.approx(measured["peak"], rel=0.15)


def test_math_attention_keeps_softmax_unless_selective() -> None:
    shape = replace(GPT2, seq_length=1024)
    none = estimate_memory(shape, attention="math", recompute="none")
    selective = estimate_memory(shape, attention="math", recompute="selective")
    flash = estimate_memory(shape, attention="flash")
    heads, s = shape.num_attention_heads, shape.seq_length
    # bf16 probabilities: heads·s·2 bytes per token, per layer.
    softmax = shape.num_layers * s * heads * s * 2
    assert none.breakdown["activations_layers"] - selective.breakdown["activations_layers"] == softmax
    assert flash.breakdown["activations_layers"] < none.breakdown["activations_layers"]


def test_gpt_layer_is_megatrons_34_sbh_with_flash_attention() -> None:
    """16-bit GPT-2 layer with dropout on CUDA: Megatron's sbh·34 (+ tiny per-token stats), no 5as/h."""
    shape = ModelShape.of(
        replace(
            GPT2,
            hidden_size=1024,
            num_attention_heads=16,
            num_query_groups=16,
            ffn_hidden_size=4096,
            seq_length=2048,
            hidden_dropout=0.1,
        )
    )
    est = estimate_memory(shape, precision="bf16", micro_batch_size=1)
    per_token = sum(v for k, v in est.breakdown.items() if k.startswith("per_layer_")) / shape.seq_length
    h, a = shape.hidden_size, shape.num_attention_heads
    assert per_token == pytest.approx(34 * h + 4 * a + 16)  # + fp32 log-sum-exp and LayerNorm stats


@pytest.mark.parametrize("tp", [4, 8])
def test_sequence_parallel_layer_is_megatrons_34_sbh_over_t(tp: int) -> None:
    """Korthikanti et al. 2022 (table 2): with tensor and sequence parallelism and selective recompute
    a layer keeps sbh·34/t bytes at 16 bits. Our 16-bit GPT-2 layer (flash attention, so selective
    recompute has no softmax left to drop) keeps exactly that, plus the tiny per-token stats, also
    split t ways. (Before the column-parallel linears saved their shard, their two gathered inputs
    kept 4sbh whole: 1.35× Megatron's figure at t=4, 1.82× at t=8.)"""
    shape = ModelShape.of(
        replace(
            GPT2,
            hidden_size=1024,
            num_attention_heads=16,
            num_query_groups=16,
            ffn_hidden_size=4096,
            seq_length=2048,
            hidden_dropout=0.1,
        )
    )
    est = estimate_memory(shape, precision="bf16", tp=tp, sequence_parallel=True, recompute="selective")
    per_token = sum(v for k, v in est.breakdown.items() if k.startswith("per_layer_")) / shape.seq_length
    h, a = shape.hidden_size, shape.num_attention_heads
    assert per_token == pytest.approx((34 * h + 4 * a + 16) / tp)
    assert per_token / (34 * h / tp) == pytest.approx(1.0, abs=0.003)  # the stats add 0.2%


def test_model_state_bytes_per_parameter() -> None:
    n = GPTModel(LLAMA).num_parameters()
    bf16 = estimate_memory(LLAMA, precision="bf16")
    assert (bf16.params_bytes, bf16.grads_bytes, bf16.optimizer_bytes) == (2 * n, 4 * n, 12 * n)
    sharded = estimate_memory(LLAMA, precision="bf16", dp=4, distributed_optimizer=True)
    assert sharded.optimizer_bytes == 3 * n  # 12 bytes over 4 ranks: Megatron's 6 + 12/d
    fp32 = estimate_memory(LLAMA, precision="fp32", dp=4, distributed_optimizer=True)
    assert (fp32.params_bytes, fp32.grads_bytes, fp32.optimizer_bytes) == (4 * n, 4 * n, 2 * n)


def test_tensor_and_sequence_parallel_split() -> None:
    big = replace(LLAMA, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1408)
    one = estimate_memory(big, micro_batch_size=2)
    tp = estimate_memory(big, micro_batch_size=2, tp=4)
    sp = estimate_memory(big, micro_batch_size=2, tp=4, sequence_parallel=True)
    layer = {k: v for k, v in one.breakdown.items() if k.startswith("per_layer_")}
    # Without sp only the tensor-parallel region shrinks; the norms stay whole on every rank.
    assert tp.breakdown["per_layer_norms"] == layer["per_layer_norms"]
    assert tp.breakdown["per_layer_mlp"] == layer["per_layer_mlp"] // 4
    # With sp every activation is split t ways, the inputs qkv and fc1 save included: the
    # column-parallel linears keep the sequence shard and all-gather it again in backward.
    assert sp.breakdown["per_layer_linear_inputs"] == layer["per_layer_linear_inputs"] // 4
    # ... all but RoPE's fp32 table copies, which cover the whole sequence attention sees.
    rope = "per_layer_rope_tables"
    assert sp.breakdown[rope] == layer[rope] > 0
    split = {k: v for k, v in sp.breakdown.items() if k.startswith("per_layer_") and k != rope}
    assert sum(split.values()) == pytest.approx((sum(layer.values()) - layer[rope]) / 4, rel=1e-6)
    # Weights: linears split, norms replicated.
    assert layer_params(ModelShape.of(big), 4) < layer_params(ModelShape.of(big), 1) / 3
    assert sp.total_bytes < tp.total_bytes < one.total_bytes


def test_full_recompute_keeps_layer_inputs() -> None:
    est = estimate_memory(LLAMA, micro_batch_size=4, recompute="full", precision="bf16")
    tokens, h = 4 * LLAMA.seq_length, LLAMA.hidden_size
    assert est.breakdown["activations_layers"] == LLAMA.num_layers * tokens * 2 * h
    every2 = estimate_memory(
        replace(LLAMA, num_layers=4), micro_batch_size=4, recompute="full", recompute_every=2
    )
    full = estimate_memory(replace(LLAMA, num_layers=4), micro_batch_size=4, recompute="full")
    none = estimate_memory(replace(LLAMA, num_layers=4), micro_batch_size=4)
    assert full.breakdown["activations_layers"] < every2.breakdown["activations_layers"]
    assert every2.breakdown["activations_layers"] < none.breakdown["activations_layers"]


def test_pipeline_stages() -> None:
    shape = replace(LLAMA, num_layers=8, vocab_size=32000)
    est = estimate_memory(shape, pp=4, micro_batch_size=1)
    assert len(est.stage_totals) == 4
    first = stage_params(ModelShape.of(shape), 1, 4, 0)
    last = stage_params(ModelShape.of(shape), 1, 4, 3)
    middle = stage_params(ModelShape.of(shape), 1, 4, 1)
    assert "embedding" in first and "lm_head" not in first
    assert "lm_head" in last and "embedding" not in last
    assert set(middle) == {"layers"}
    # The first stage holds pp micro-batches in flight (1F1B), the last one.
    one_stage = estimate_memory(shape, pp=4, micro_batch_size=1, num_microbatches_in_flight=1)
    assert est.stage_totals[0] > one_stage.stage_totals[0]
    assert est.total_bytes == max(est.stage_totals)
    # Tied embeddings: the last stage keeps its own copy of the word embeddings when pp > 1.
    tied = ModelShape.of(replace(shape, tie_embeddings=True))
    assert "lm_head" in stage_params(tied, 1, 4, 3)
    assert "lm_head" not in stage_params(tied, 1, 1, 0)


def test_from_spec_matches_explicit_arguments() -> None:
    from megatrain.plan.layout import resolve_layout
    from megatrain.spec import parse_spec

    spec = parse_spec(
        {
            "name": "mem",
            "model": {
                "arch": "llama",
                "num_layers": 4,
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "seq_length": 128,
            },
            "data": {"train": [{"path": "file:///tmp/x"}]},
            "training": {
                "global_batch_size": 16,
                "micro_batch_size": 2,
                "precision": "bf16",
                "recompute": "selective",
            },
            "parallelism": {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True},
        }
    )
    layout = resolve_layout(spec)
    est = from_spec(spec, layout)
    shape = ModelShape.of(
        {
            "num_layers": 4,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": spec.model.ffn_size,
            "vocab_size": 384,
            "seq_length": 128,
        }
    )
    explicit = estimate_memory(
        shape,
        tp=2,
        pp=2,
        dp=2,
        sequence_parallel=True,
        micro_batch_size=2,
        num_microbatches_in_flight=2,
        precision="bf16",
        distributed_optimizer=True,
        recompute="selective",
        fused_loss=True,  # the engine's loss at every tp
    )
    assert est == explicit


def test_memory_module_imports_without_torch() -> None:
    code = (
        "import sys; import megatrain.plan.memory as m; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(m.estimate_memory)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_estimate_matches_cuda_peak(recompute: str) -> None:
    """bf16 Llama on one GPU: activation peak from torch.cuda.max_memory_allocated over the step."""
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=2816,
        seq_length=1024,
        vocab_size=32000,
    )
    device = torch.device("cuda")
    model = GPTModel(cfg).to(device, torch.bfloat16)
    model.set_recompute(recompute)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device=device)
    lm_loss(model(x), x).backward()  # create the gradients; then zero them in place
    for p in model.parameters():
        p.grad.zero_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lm_loss(model(x), x).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    est = estimate_memory(cfg, micro_batch_size=2, precision="bf16", recompute=recompute)
    assert est.activations_bytes == pytest.approx(peak, rel=0.15)


def _tensor_parallel_rank(
    rank: int, world_size: int, flavour: str, sp: bool, recompute: str, micro_batch_size: int, fused: bool
) -> dict[str, int]:
    from megatrain.engine.parallel.fused_loss import fused_parallel_lm_loss
    from megatrain.engine.parallel.parallelize import parallel_lm_loss, parallelize_model
    from megatrain.engine.parallel.random import manual_seed
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import Layout

    cfg = TP_FLAVOURS[flavour]
    state = ParallelState.build(Layout(tp=world_size, sequence_parallel=sp))
    tracker = manual_seed(0, state)
    model = parallelize_model(GPTModel(cfg), state, rng_tracker=tracker)
    model.set_recompute(recompute)
    x = torch.randint(
        0, cfg.vocab_size, (micro_batch_size, cfg.seq_length), generator=torch.Generator().manual_seed(1)
    )

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        if fused:  # the engine's loss at tp > 1 (megatrain.engine.build.lm_loss)
            return fused_parallel_lm_loss(model.hidden_states(x), model.lm_head, x)
        return parallel_lm_loss(model(x), x, state)

    loss_of(x).backward()
    for p in model.parameters():
        p.grad.zero_()  # persistent gradients, as the engine's buffer
    with LiveTensorBytes(tensors_of(model, x)) as tracker_bytes:
        loss = loss_of(x)
        # gloo's worker thread drops its hold on a collective's buffers after the op completes: wait
        # for every op of the forward, so a loaded host does not count an all-gather's buffer as saved.
        dist.barrier(group=state.tp_group)
        stored = tracker_bytes.current
        loss.backward()
    return {"stored": stored, "peak": tracker_bytes.peak}


TP_FLAVOURS = {
    "gpt2": replace(GPT2, hidden_size=128, ffn_hidden_size=512, vocab_size=512),
    "llama": replace(LLAMA, hidden_size=128, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=384,
                     vocab_size=512),
}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("flavour", "sp", "recompute", "micro_batch_size", "fused"),
    [
        ("gpt2", False, "none", 2, False),
        ("llama", False, "none", 2, False),
        ("llama", True, "none", 2, False),
        ("gpt2", True, "full", 2, False),
        ("gpt2", True, "selective", 1, False),
        ("llama", False, "none", 2, True),
        ("gpt2", True, "full", 2, True),
    ],
)
def test_estimate_matches_tensor_parallel_ranks(
    flavour: str, sp: bool, recompute: str, micro_batch_size: int, fused: bool
) -> None:
    """tp=2 on gloo: each rank's saved and peak activation bytes against the estimate. With sequence
    parallelism the column-parallel linears keep 1/tp of their input (their shard) for backward."""
    from .parallel._launch import run_distributed

    results = run_distributed(_tensor_parallel_rank, 2, flavour, sp, recompute, micro_batch_size, fused)
    est = estimate_memory(
        TP_FLAVOURS[flavour],
        tp=2,
        sequence_parallel=sp,
        micro_batch_size=micro_batch_size,
        precision="fp32",
        recompute=recompute,
        device="cpu",
        fused_loss=fused,
    )
    for measured in results:
        assert stored_activations(est) == pytest.approx(measured["stored"], rel=0.05)
        assert est.activations_bytes == pytest.approx(measured["peak"], rel=0.15)
