"""LoRA through the training loop: every layout trains the same adapters as one process (same seed,
same data), and only the adapters train: no gradient buffer or optimizer state for the base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatrain.spec import SpecError, parse_spec

from .helpers import tiny_spec, write_corpus

STEPS = 4


def _spec(
    root: Path,
    world: int,
    parallelism: dict[str, Any],
    method: str = "lora",
    extra: dict[str, Any] | None = None,
) -> Any:
    raw = tiny_spec(root / "corpus.jsonl", global_batch_size=8, micro_batch_size=2, lr=2e-2, warmup_iters=0)
    raw["model"].update(num_layers=4)
    if method == "qlora":  # NF4 quantises whole blocks of 16,384 weights: a wider model
        raw["model"].update(hidden_size=256, ffn_hidden_size=256)  # every shard at tp=2 too
    raw["data"]["split"] = "1,0,0"
    raw["training"].update(method=method, lora={"rank": 4, "alpha": 8.0})
    raw["parallelism"] = {"distributed_optimizer": False, **parallelism}
    raw["resources"] = {"devices": world}
    for block, fields in (extra or {}).items():  # {"model": {...}, "training": {...}}
        raw[block].update(fields)
    return parse_spec(raw)


def _lora_rank(
    rank: int,
    world: int,
    workdir: str,
    parallelism: dict[str, Any],
    method: str = "lora",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """STEPS TrainLoop steps of a LoRA run under `parallelism`: each step's loss and grad norm."""
    from megatrain.engine.build import build_model, make_trainable
    from megatrain.engine.config import train_config, transformer_config
    from megatrain.engine.data import ByteTokenizer, build_datasets
    from megatrain.engine.loop import Rates, TrainLoop, reduce_mean
    from megatrain.engine.lora import trainable_parameters
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.engine.sink import RunLog
    from megatrain.plan.layout import resolve_layout
    from megatrain.spec import ParallelismSpec

    root = Path(workdir)
    spec = _spec(root, world, parallelism, method, extra)
    layout = resolve_layout(spec, world)
    cfg = train_config(spec, layout.dp)
    tokenizer = ByteTokenizer()
    mcfg = transformer_config(spec, tokenizer.vocab_size)
    state = ParallelState.build(layout)
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    model = build_model(mcfg, state, cfg.seed, "cpu", lora=cfg.lora)
    train = make_trainable(model, cfg, par, "fp32", mcfg)
    ds = build_datasets(spec, tokenizer, mcfg.seq_length, root / f"cache{world}-{rank}")
    out = root / f"out{world}-{rank}"
    out.mkdir(exist_ok=True)
    loop = TrainLoop(train, cfg, {"train": ds["train"]}, RunLog(out, rank == 0), Rates(1.0, 1, None), print)
    losses, norms = [], []
    for step in range(STEPS):
        loss, result = loop.step(step)
        losses.append(reduce_mean(loss, state))
        norms.append(result.grad_norm)
    trainable, total = trainable_parameters(train.model.module)
    nf4 = sum(type(p).__name__ == "NF4Tensor" for p in train.model.module.parameters())
    buffered = sum(p.numel() for p in train.ddp.params)
    sizes = {"trainable": trainable, "total": total, "buffered": buffered, "nf4": nf4}
    return {"losses": losses, "norms": norms, **sizes}


@pytest.mark.distributed
def test_lora_trains_the_same_adapters_in_every_layout(tmp_path: Path) -> None:
    from .parallel._launch import run_distributed

    write_corpus(tmp_path / "corpus.jsonl", num_docs=60)
    ref = run_distributed(_lora_rank, 1, str(tmp_path), {})[0]
    assert ref["losses"][-1] < ref["losses"][0]  # the adapters learn
    assert 0 < ref["trainable"] < ref["total"] / 4
    assert ref["buffered"] == ref["trainable"]  # gradient buffers for the adapters only
    layouts: list[dict[str, Any]] = [
        {"dp": 2, "distributed_optimizer": True},
        {"tp": 2, "dp": 1},
        {"tp": 2, "dp": 1, "sequence_parallel": True},
        {"pp": 2, "dp": 1, "virtual_stages": 2},
    ]
    for layout in layouts:
        _assert_same_run(run_distributed(_lora_rank, 2, str(tmp_path), layout)[0], ref, layout)


def _assert_same_run(got: dict[str, Any], ref: dict[str, Any], layout: Any) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) < 1e-5, (layout, step, a, b)
    for a, b in zip(got["norms"], ref["norms"], strict=True):
        assert abs(a - b) < 1e-4 * b, (layout, a, b)


MOE_LORA = {
    "model": {
        "moe": {
            "num_experts": 4,
            "router_topk": 2,
            "ffn_hidden_size": 32,
            "shared_expert_ffn_hidden_size": 16,
        }
    },
    "training": {"lora": {"rank": 4, "alpha": 8.0, "targets": ["qkv", "proj", "fc1", "fc2", "experts"]}},
}


@pytest.mark.distributed
def test_moe_lora_trains_the_same_adapters_under_expert_and_tensor_parallelism(tmp_path: Path) -> None:
    """Adapters on attention, the shared expert and every routed expert: ep=2 (each rank holds and
    trains its experts' adapters) and tp=2 with sequence parallelism train what one process does."""
    from .parallel._launch import run_distributed

    write_corpus(tmp_path / "corpus.jsonl", num_docs=60)
    ref = run_distributed(_lora_rank, 1, str(tmp_path), {}, "lora", MOE_LORA)[0]
    assert ref["losses"][-1] < ref["losses"][0] and ref["buffered"] == ref["trainable"]
    for layout in (
        {"dp": 2, "ep": 2, "distributed_optimizer": True},
        {"tp": 2, "dp": 1, "sequence_parallel": True},
    ):
        got = run_distributed(_lora_rank, 2, str(tmp_path), layout, "lora", MOE_LORA)
        if "ep" in layout:  # half the experts' adapters on each rank
            assert got[0]["trainable"] < ref["trainable"] and got[0]["trainable"] == got[1]["trainable"]
        _assert_same_run(got[0], ref, layout)


@pytest.mark.distributed
def test_lora_under_context_parallelism_and_recompute_trains_as_one_process(tmp_path: Path) -> None:
    from .parallel._launch import run_distributed

    write_corpus(tmp_path / "corpus.jsonl", num_docs=60)
    ref = run_distributed(_lora_rank, 1, str(tmp_path), {})[0]
    full = run_distributed(_lora_rank, 1, str(tmp_path), {}, "lora", {"training": {"recompute": "full"}})[0]
    _assert_same_run(full, ref, "recompute full")
    got = run_distributed(
        _lora_rank, 2, str(tmp_path), {"cp": 2, "dp": 1}, "lora", {"training": {"recompute": "selective"}}
    )
    _assert_same_run(got[0], ref, "cp=2, recompute selective")


@pytest.mark.distributed
def test_qlora_under_tensor_and_sequence_parallelism_tracks_one_process(tmp_path: Path) -> None:
    """Each rank quantises its own shard, so the NF4 bases differ by rounding across layouts:
    the same run, within that rounding, not bit for bit."""
    from .parallel._launch import run_distributed

    write_corpus(tmp_path / "corpus.jsonl", num_docs=60)
    ref = run_distributed(_lora_rank, 1, str(tmp_path), {}, "qlora")[0]
    tp_sp = {"tp": 2, "dp": 1, "sequence_parallel": True}
    got = run_distributed(_lora_rank, 2, str(tmp_path), tp_sp, "qlora")
    assert ref["nf4"] == 16 and got[0]["nf4"] == 16  # every dense linear of 4 layers, on each rank
    assert ref["losses"][-1] < ref["losses"][0]
    for a, b in zip(got[0]["losses"], ref["losses"], strict=True):
        assert abs(a - b) < 1e-2 * b, (got[0]["losses"], ref["losses"])


def test_lora_settings_are_judged(tmp_path: Path) -> None:
    raw = tiny_spec(tmp_path / "c.jsonl")
    raw["training"]["lora"] = {"rank": 8}
    with pytest.raises(SpecError, match="training.method is 'full'"):
        parse_spec(raw)
    raw["training"].update(method="lora", lora={"rank": 0, "targets": ["qkv", "router"]})
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    fields = {e["field"] for e in err.value.errors}
    assert {"training.lora.rank", "training.lora.targets.1"} <= fields, err.value.errors
    raw["training"]["lora"] = {"targets": ["qkv", "qkv"]}
    with pytest.raises(SpecError, match="twice"):
        parse_spec(raw)
    # Targets the model lacks: experts on a dense model; fc1 where every layer is routed experts.
    raw["training"]["lora"] = {"targets": ["qkv", "experts"]}
    with pytest.raises(SpecError, match="experts, but the model has no routed experts") as err:
        parse_spec(raw)
    assert [e["field"] for e in err.value.errors] == ["training.lora.targets"]
    raw["model"]["moe"] = {"num_experts": 4}
    raw["training"]["lora"] = {"targets": ["fc1", "experts"]}
    with pytest.raises(SpecError, match="names fc1, but the model has no dense MLP and no shared expert"):
        parse_spec(raw)
    raw["training"]["lora"] = {"targets": ["experts"], "dropout": 0.1}
    with pytest.raises(SpecError, match="dropout must be 0 when training.lora.targets include experts"):
        parse_spec(raw)
    # The default targets on such a model: those it has (attention's), not a spec error.
    raw["training"]["lora"] = {"rank": 4}
    from megatrain.engine.config import lora_config

    lora = lora_config(parse_spec(raw))
    assert lora is not None and lora.targets == ("qkv", "proj")


def test_lora_on_a_bf16_or_fp8_base_tracks_fp32(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frozen base in bf16, or multiplying in float8 (torchao's emulation on a CPU), while the
    adapters keep fp32 masters: every step's loss within 0.01 of the fp32 run's (measured: at most
    7e-4 for fp8, 2e-4 for bf16, over 8 steps), and the float8 GEMMs did run."""
    from megatrain.engine.train import run
    from megatrain.settings import Settings

    from .helpers import read_jsonl

    monkeypatch.setattr("megatrain.engine.runtime.get_settings", lambda: Settings(cpu_low_precision=True))
    losses = {}
    for precision in ("fp32", "bf16", "fp8"):
        raw = tiny_spec(corpus, precision=precision, train_iters=8, global_batch_size=4, eval_interval=0,
                        checkpoint_interval=0, warmup_iters=2, lr=2e-2)  # fmt: skip
        raw["training"].update(method="lora", lora={"rank": 4, "alpha": 8.0})
        run(parse_spec(raw), tmp_path / precision)
        started = next(
            e for e in read_jsonl(tmp_path / precision / "events.jsonl") if e["event"] == "started"
        )
        assert started["precision"] == precision
        losses[precision] = [
            r["loss"] for r in read_jsonl(tmp_path / precision / "metrics.jsonl") if "loss" in r
        ]
    assert losses["fp8"] != losses["bf16"]
    for precision in ("bf16", "fp8"):
        got, want = losses[precision], losses["fp32"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.01, (precision, got, want)
    assert losses["fp8"][-1] < losses["fp8"][0]
