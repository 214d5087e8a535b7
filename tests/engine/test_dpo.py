"""DPO in our engine: preference records into pairs of rows, the loss and its rules, the reference
with the adapters off, and every layout equal to one process (same seed, same data). TRL's own
DPOTrainer is the reference for the numbers (tests/engine/test_dpo_trl.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatrain.engine.config import DPOConfig, LoRAConfig, TransformerConfig
from megatrain.engine.data.finetune import RecordError
from megatrain.engine.data.preference import build_preference_datasets
from megatrain.engine.data.tokenizers import ByteTokenizer
from megatrain.engine.dpo import pair_losses, sequence_logps
from megatrain.engine.microbatch import MicroBatch
from megatrain.spec import DataSpec, SpecError, parse_spec

from .helpers import tiny_spec


def write_pairs(path: Path, n: int = 40) -> Path:
    """Prompt strings, chats with an earlier assistant turn, responses as strings or messages."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            chosen, rejected = "yes " * rng.randint(1, 3), "no" * rng.randint(1, 4)
            if i % 2:
                record: dict[str, Any] = {"prompt": f"q{i}?", "chosen": chosen, "rejected": rejected}
            else:
                record = {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "HELLO"},
                        {"role": "user", "content": f"q{i}?"},
                    ],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": rejected,
                }
            f.write(json.dumps(record) + "\n")
    return path


def data_spec(path: Path, **fields: Any) -> DataSpec:
    return DataSpec(train=[{"path": path.as_uri()}], **fields)


def test_records_become_pairs_of_rows_with_loss_on_the_response_only(tmp_path: Path) -> None:
    path = write_pairs(tmp_path / "pairs.jsonl")
    built = build_preference_datasets(
        data_spec(path, split="80,20,0"), ByteTokenizer(), 48, 1, tmp_path / "c"
    )
    train, valid = built["train"], built["valid"]
    assert train is not None and valid is not None and built["test"] is None
    assert train.stats["pairs"] == 32 and len(train) == 64 and valid.stats["pairs"] == 8
    batch = train.batch([0, 1, 2, 3])
    tok = ByteTokenizer()
    for row in range(4):
        loss_text = tok.decode(
            [int(t) for t, m in zip(batch.labels[row], batch.loss_mask[row], strict=True) if m]
        )
        # The plain template ends each assistant turn with the end-of-document id; the prompt's own
        # assistant turn (HELLO) is context, never a loss token.
        text = loss_text.replace(tok.decode([tok.eod]), "")
        assert set(text) <= (set("yes ") if row % 2 == 0 else set("no")), (row, loss_text)
        assert "HELLO" in tok.decode(batch.tokens[row].tolist()) or "q" in tok.decode(
            batch.tokens[row].tolist()
        )
    # Rows 2k and 2k+1 share their prompt: one pair.
    assert train.document(0) // 2 == train.document(1) // 2 and train.document(0) % 2 == 0
    # Epochs wrap in a seeded order covering every pair once.
    assert sorted(train.document(2 * k) // 2 for k in range(32)) == sorted(train.pairs[:, 0] // 2)
    with pytest.raises(ValueError, match="whole pairs"):
        train.batch([1, 2])
    # Trained tokens: each sequence's tokens within its row (padding not), into the next epoch.
    for n in (0, 7, 64, 64 + 9):
        rows = [train.tokens[train.document(i)][: train.capacity] for i in range(n)]
        assert train.tokens_through(n) == sum(len(r) for r in rows), n


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "chosen": "b"}', r"bad.jsonl:2: a preference record needs 'rejected'"),
        ('{"chosen": "b", "rejected": "c"}', r"bad.jsonl:2: needs a 'prompt' or a 'messages' field"),
        ('{"prompt": "a", "chosen": [{"role": "assistant"}], "rejected": "c"}', r"bad.jsonl:2: chosen\[0\]"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + line + "\n")
    with pytest.raises(RecordError, match=message):
        build_preference_datasets(data_spec(path), ByteTokenizer(), 16, 0, tmp_path / "c")


def test_dpo_rules_name_their_fields(tmp_path: Path) -> None:
    raw = tiny_spec(tmp_path / "p.jsonl", micro_batch_size=3, global_batch_size=9)
    raw["kind"] = "dpo"
    raw["training"]["dpo"] = {"beta": 0, "loss_type": "ipo", "label_smoothing": 0.1}
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    fields = {e["field"] for e in err.value.errors}
    want = {"training.dpo.beta", "training.dpo.label_smoothing", "model.init_from",
            "training.micro_batch_size"}  # fmt: skip
    assert want <= fields, err.value.errors
    raw = tiny_spec(tmp_path / "p.jsonl")
    raw["training"]["dpo"] = {}
    with pytest.raises(SpecError, match="training.dpo is set but kind is 'pretrain'"):
        parse_spec(raw)
    raw["kind"], raw["model"]["init_from"] = "dpo", "hf:/models/x"
    raw["parallelism"], raw["training"]["dpo"] = "auto", {"loss_type": "hinge", "label_smoothing": 0.0}
    assert parse_spec(raw).training.dpo is not None


def test_an_auto_micro_batch_keeps_pairs_whole(tmp_path: Path) -> None:
    """micro_batch_size auto for kind dpo: the planner and the fallback choose even sizes only."""
    from megatrain.plan.layout import Layout, micro_batch_size
    from megatrain.plan.planner import plan
    from megatrain.plan.pool import PoolSpec

    raw = tiny_spec(tmp_path / "p.jsonl", micro_batch_size="auto", global_batch_size=12)
    raw["kind"], raw["model"]["init_from"] = "dpo", "hf:/models/x"
    spec = parse_spec(raw)
    assert micro_batch_size(spec, Layout()) == 4 and micro_batch_size(spec, Layout(dp=2)) == 2  # 3: odd
    pool = PoolSpec(name="cpu", accelerator="cpu", device_memory_bytes=8 << 30, peak_tflops={"fp32": 1.0},
                    devices_per_node=1, nodes=1, intra_node_bandwidth_gbps=10.0,
                    inter_node_bandwidth_gbps=10.0)  # fmt: skip
    chosen = plan(spec, pool, 1, tokenizer_vocab=257)
    sizes = {chosen.choice.micro_batch_size, *(c.micro_batch_size for c, _, _ in chosen.runners_up)}
    assert len(sizes) > 1 and all(n % 2 == 0 for n in sizes), sizes  # of 1, 2, 3, 4, 6, 12
    raw["training"]["global_batch_size"] = 9
    with pytest.raises(SpecError, match="training.global_batch_size=9 must be even for kind dpo"):
        parse_spec(raw)


def test_pair_losses_are_trls_definitions() -> None:
    gen = torch.Generator().manual_seed(0)
    logps, ref = -torch.rand(6, generator=gen) * 10, -torch.rand(6, generator=gen) * 10
    counts = torch.tensor([3.0, 5.0, 2.0, 7.0, 4.0, 1.0])
    d = (logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2])
    loss, chosen, rejected = pair_losses(logps, ref, counts, DPOConfig(beta=0.2))
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(0.2 * d))
    torch.testing.assert_close(chosen - rejected, 0.2 * d)
    smooth = pair_losses(logps, ref, counts, DPOConfig(beta=0.2, label_smoothing=0.1))[0]
    torch.testing.assert_close(smooth, 0.9 * loss - 0.1 * torch.nn.functional.logsigmoid(-0.2 * d))
    hinge = pair_losses(logps, ref, counts, DPOConfig(beta=0.2, loss_type="hinge"))[0]
    torch.testing.assert_close(hinge, torch.relu(1 - 0.2 * d))
    ipo = pair_losses(logps, ref, counts, DPOConfig(beta=0.2, loss_type="ipo"))[0]
    per_token = (logps[0::2] - ref[0::2]) / counts[0::2] - (logps[1::2] - ref[1::2]) / counts[1::2]
    torch.testing.assert_close(ipo, (per_token - 1 / 0.4) ** 2)


def _tiny(lora: LoRAConfig | None = None) -> Any:
    from megatrain.engine.build import build_model

    from .parallel._tp_common import fake_state

    cfg = TransformerConfig.preset("tiny-llama", vocab_size=320, seq_length=48)
    return build_model(cfg, fake_state(1, 0), seed=3, device="cpu", lora=lora).module


def _batch(tmp_path: Path, ref: bool = True) -> MicroBatch:
    path = write_pairs(tmp_path / "pairs.jsonl")
    ds = build_preference_datasets(data_spec(path, split="1,0,0"), ByteTokenizer(), 48, 1, tmp_path / "c")[
        "train"
    ]
    assert ds is not None
    mb = MicroBatch.from_batch(ds.batch([0, 1, 2, 3, 4, 5]), "cpu")
    mb.ref_logps = -torch.rand(6, generator=torch.Generator().manual_seed(1)) * 30 if ref else None
    return mb


def test_prompt_labels_change_nothing(tmp_path: Path) -> None:
    model, mb = _tiny(), _batch(tmp_path)

    def loss_and_grads(labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        mb.labels = labels
        assert mb.ref_logps is not None and mb.loss_mask is not None
        loss = pair_losses(sequence_logps(model, mb), mb.ref_logps, mb.loss_mask.sum(-1), DPOConfig())[
            0
        ].mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    assert mb.loss_mask is not None
    labels, prompt = mb.labels.clone(), mb.loss_mask == 0
    loss, grads = loss_and_grads(labels)
    changed = labels.clone()
    changed[prompt] = (changed[prompt] + 7) % 257
    loss2, grads2 = loss_and_grads(changed)
    assert torch.equal(loss, loss2)
    for g, g2 in zip(grads, grads2, strict=True):
        assert torch.equal(g, g2)
    response = labels.clone()
    response[~prompt] = (response[~prompt] + 1) % 257
    assert not torch.equal(loss_and_grads(response)[0], loss)


def test_the_reference_is_the_base_with_the_adapters_off(tmp_path: Path) -> None:
    from megatrain.engine.dpo import prepare_reference
    from megatrain.engine.lora import LoRA
    from megatrain.engine.parallel.state import ParallelState

    base, adapted = _tiny(), _tiny(LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():  # a trained adapter: it changes the policy's log-probs
        for m in adapted.modules():
            if isinstance(m, LoRA):
                m.B.fill_(0.05)
    mb = _batch(tmp_path, ref=False)
    with torch.no_grad():
        policy, plain = sequence_logps(adapted, mb), sequence_logps(base, mb)
    assert not torch.allclose(policy, plain)
    # The reference pass switches the adapters off: the base's log-probs, for every pair of the split.
    path = write_pairs(tmp_path / "pairs.jsonl")
    datasets = build_preference_datasets(
        data_spec(path, split="1,0,0"), ByteTokenizer(), 48, 1, tmp_path / "c"
    )
    ds = datasets["train"]
    assert ds is not None

    def run_logps(batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        return [sequence_logps(adapted, b) for b in batches]

    def micro_ids(start: int) -> list[list[int]]:
        return [list(range(start, start + 4)), list(range(start + 4, start + 8))]

    prepare_reference(datasets, adapted, run_logps, micro_ids, 8, ParallelState.single(), "k", lambda s: None)
    assert ds.reference is not None and not np.isnan(ds.reference).any()
    with torch.no_grad():
        for ids in micro_ids(0) + micro_ids(8):
            want = sequence_logps(base, MicroBatch.from_batch(ds.batch(ids), "cpu"))
            np.testing.assert_allclose(ds.batch(ids).ref_logps, want.numpy(), rtol=0, atol=1e-5)
    assert any(m.enabled for m in adapted.modules() if isinstance(m, LoRA))  # switched back on
    # Stored beside the cache: a second pass reads it instead of computing.
    datasets["train"].reference = None
    prepare_reference(datasets, adapted, lambda b: pytest.fail("recomputed"), micro_ids, 8,
                      ParallelState.single(), "k", lambda s: None)  # fmt: skip
    assert ds.reference is not None


# -- every layout trains as one process ------------------------------------------------------------

STEPS = 3


def _dpo_rank(rank: int, world: int, workdir: str, parallelism: dict[str, Any], lora: bool) -> dict[str, Any]:
    """STEPS TrainLoop steps of DPO under `parallelism`: per-step loss, metrics and grad norm."""
    from megatrain.engine.build import build_model, make_trainable
    from megatrain.engine.config import train_config, transformer_config
    from megatrain.engine.data import build_datasets
    from megatrain.engine.loop import Rates, TrainLoop, reduce_mean
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.engine.sink import RunLog
    from megatrain.plan.layout import resolve_layout
    from megatrain.spec import ParallelismSpec

    root = Path(workdir)
    raw = tiny_spec(root / "pairs.jsonl", global_batch_size=8, micro_batch_size=2, lr=2e-2, warmup_iters=0)
    raw["kind"], raw["model"]["init_from"] = "dpo", "hf:/unused"  # weights drawn from the seed here
    raw["model"].update(num_layers=4, seq_length=48)
    raw["data"]["split"] = "1,0,0"
    if lora:
        raw["training"].update(method="lora", lora={"rank": 4, "alpha": 8.0})
    raw["parallelism"] = {"distributed_optimizer": False, **parallelism}
    raw["resources"] = {"devices": world}
    spec = parse_spec(raw)
    layout = resolve_layout(spec, world)
    cfg = train_config(spec, layout.dp)
    tokenizer = ByteTokenizer()
    mcfg = transformer_config(spec, tokenizer.vocab_size)
    state = ParallelState.build(layout)
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    train = make_trainable(build_model(mcfg, state, cfg.seed, "cpu", lora=cfg.lora), cfg, par, "fp32", mcfg)
    ds = build_datasets(spec, tokenizer, mcfg.seq_length, root / f"cache{world}-{rank}-{len(parallelism)}")
    out = root / f"out{world}-{rank}"
    out.mkdir(exist_ok=True)
    loop = TrainLoop(train, cfg, {"train": ds["train"]}, RunLog(out, rank == 0), Rates(1.0, 1, None), print)
    loop.prepare_reference("k")
    steps = []
    for step in range(STEPS):
        loss, result = loop.step(step * cfg.global_batch_size)
        assert loop.preference is not None
        steps.append({"loss": reduce_mean(loss, state), "grad_norm": result.grad_norm,
                      **loop.preference.metrics(state)})  # fmt: skip
    return {"steps": steps}


def _assert_same(got: list[dict], ref: list[dict], what: Any) -> None:
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        for name, want in b.items():
            tol = 1e-4 * max(1.0, abs(want)) if name != "grad_norm" else 1e-4 * want
            assert abs(a[name] - want) <= tol, (what, step, name, a[name], want)


@pytest.mark.distributed
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_in_every_layout_equals_one_process(tmp_path: Path, lora: bool) -> None:
    from .parallel._launch import run_distributed

    write_pairs(tmp_path / "pairs.jsonl", n=48)
    ref = run_distributed(_dpo_rank, 1, str(tmp_path), {}, lora)[0]["steps"]
    assert ref[-1]["loss"] < ref[0]["loss"] and ref[-1]["rewards/accuracies"] > 0.5  # it learns
    layouts: list[dict[str, Any]] = [{"dp": 2, "distributed_optimizer": True}]
    if not lora:  # LoRA's own layouts are proven in test_lora_train; the DPO parts are the same code
        layouts += [{"tp": 2, "dp": 1, "sequence_parallel": True}, {"pp": 2, "dp": 1}, {"cp": 2, "dp": 1}]
    for layout in layouts:
        got = run_distributed(_dpo_rank, 2, str(tmp_path), layout, lora)[0]["steps"]
        _assert_same(got, ref, layout)


def test_a_held_out_file_validates_pairs(tmp_path: Path) -> None:
    train, held = write_pairs(tmp_path / "pairs.jsonl", 20), write_pairs(tmp_path / "held.jsonl", 6)
    data = DataSpec(train=[{"path": train.as_uri()}], valid=[{"path": held.as_uri()}], split="1,0,0")
    built = build_preference_datasets(data, ByteTokenizer(), 48, 1, tmp_path / "c")
    assert built["train"].stats["pairs"] == 20 and built["valid"].stats["pairs"] == 6
    assert built["test"] is None
