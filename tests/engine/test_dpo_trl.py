"""DPO against TRL's own DPOTrainer (fp32, CPU): a tiny Llama made by transformers, the same
conversational preference records through the same chat template, the same AdamW, schedule and
clipping; 20 steps of our engine (train.run, its metrics.jsonl) give TRL's loss, rewards/* and
logps/* at every step, with every weight trained and with LoRA (TRL's peft_config)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.engine.config import LoRAConfig
from megatrain.engine.data import build_datasets, build_tokenizer
from megatrain.engine.interop.hf import read_hf_config
from megatrain.hf_config import model_fields_from_hf
from megatrain.spec import JobSpec, parse_spec

from .helpers import read_jsonl
from .test_finetune import hf_tokenizer  # noqa: F401  (the fixture: a BPE with a Jinja chat template)

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

STEPS = 20
PAIRS_PER_STEP = 4
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
LORA = LoRAConfig(rank=4, alpha=8.0)
OPTIM = {"lr": 5e-3, "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
         "clip_grad": 1.0}  # fmt: skip


def preference_records(n: int = 24) -> list[dict[str, Any]]:
    """TRL's conversational preference format; words the fixture's BPE knows, and some it spells out."""
    rng = random.Random(3)
    colours = ["Blue.", "Red, or green.", "green", "Red.", "colour"]
    out = []
    for i in range(n):
        chosen, rejected = rng.sample(colours, 2)
        out.append(
            {
                "prompt": [{"role": "user", "content": f"Name a colour. {i}" if i % 2 else "Another?"}],
                "chosen": [{"role": "assistant", "content": chosen * rng.randint(1, 2)}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return out


def _tiny_llama(folder: Path, vocab: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=64,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # off the default init: norms off one, a spread the test can see
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)


def _spec(tmp: Path, tok_folder: Path, lora: bool) -> JobSpec:
    hf = tmp / "hf"
    fields = model_fields_from_hf(read_hf_config(hf), seq_length=64)
    training = {"train_iters": STEPS, "global_batch_size": 2 * PAIRS_PER_STEP, "micro_batch_size": 4,
                "lr_schedule": "constant", "warmup_iters": 0, "precision": "fp32", "log_interval": 1,
                "eval_interval": 0, "checkpoint_interval": 0, "seed": 5, "dpo": {"beta": 0.1},
                **OPTIM}  # fmt: skip
    if lora:
        training.update(method="lora", lora={"rank": LORA.rank, "alpha": LORA.alpha})
    raw = {
        "name": "dpo-trl",
        "kind": "dpo",
        "model": {**fields, "init_from": "hf:" + hf.as_uri()},
        "data": {
            "tokenizer": {"type": "hf", "path": (tok_folder / "tokenizer.json").as_uri()},
            "train": [{"path": (tmp / "pairs.jsonl").as_uri()}],
            "split": "1,0,0",
            "chat_template": (tok_folder / "tokenizer_config.json").as_uri(),
        },
        "training": training,
        "resources": {"devices": 1},
    }
    return parse_spec(raw)


def _our_order(spec: JobSpec, tmp: Path) -> tuple[list[int], Any]:
    """The record of each pair our run trains on, step after step, and the dataset."""
    tokenizer = build_tokenizer(spec.data.tokenizer)
    ds = build_datasets(spec, tokenizer, spec.model.seq_length, tmp / "order-cache")["train"]
    assert ds is not None and ds.stats["dropped"] == ds.stats["truncated"] == 0
    return [ds.document(2 * k) // 2 for k in range(STEPS * PAIRS_PER_STEP)], ds


def _trl_run(spec: JobSpec, tmp: Path, tokenizer: Any, records: list[dict], lora: bool) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    t = spec.training
    args = trl.DPOConfig(
        output_dir=str(tmp / "trl"), per_device_train_batch_size=PAIRS_PER_STEP,
        gradient_accumulation_steps=1, max_steps=STEPS, learning_rate=t.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps, max_grad_norm=t.clip_grad, optim="adamw_torch", logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=t.seed,
        train_sampling_strategy="sequential", dataloader_drop_last=False, beta=0.1, loss_type=["sigmoid"],
        max_length=None, dataset_num_proc=None, disable_tqdm=True,
    )  # fmt: skip
    peft_config = None
    if lora:
        from megatrain.engine.interop.peft import peft_config as our_peft_config

        c = our_peft_config(_model_config(spec, tokenizer), LORA, "llama")
        keys = ("r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules")
        peft_config = peft.LoraConfig(**{k: c[k] for k in keys}, task_type="CAUSAL_LM")
    trainer = trl.DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    return trainer


def _model_config(spec: JobSpec, tokenizer: Any) -> Any:
    from megatrain.engine.config import transformer_config

    return transformer_config(spec, len(tokenizer))


def _start_adapters(trainer: Any, spec: JobSpec, tokenizer: Any) -> None:
    """TRL's adapters set to the ones our run starts from (drawn from the spec's seed)."""
    from megatrain.engine.build import build_model
    from megatrain.engine.interop.peft import adapter_to_peft

    from .parallel._tp_common import fake_state

    mcfg = _model_config(spec, tokenizer)
    ours = build_model(mcfg, fake_state(1, 0), spec.training.seed, "cpu", lora=LORA).module
    state = ours.state_dict()
    adapters = adapter_to_peft(lambda n: state[n], mcfg, LORA, "llama")
    result = peft.set_peft_model_state_dict(trainer.model, adapters)
    assert not result.unexpected_keys


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_steps_equal_trl(lora: bool, tmp_path: Path, hf_tokenizer: tuple[Any, Path]) -> None:  # noqa: F811
    from megatrain.engine.train import run

    reference, tok_folder = hf_tokenizer
    reference.pad_token = reference.eos_token
    records = preference_records()
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    _tiny_llama(tmp_path / "hf", vocab=max(len(reference), 400))
    spec = _spec(tmp_path, tok_folder, lora)
    order, ds = _our_order(spec, tmp_path)
    trainer = _trl_run(spec, tmp_path, reference, [records[i] for i in order], lora)
    # The same tokens and loss tokens as TRL's own tokenization of each record.
    for k, r in enumerate(order[: len(records)]):
        row = trainer.train_dataset[k]
        for side, doc in (("chosen", 2 * r), ("rejected", 2 * r + 1)):
            ids, flags = ds.tokens[doc].tolist(), ds.targets[doc].tolist()
            assert ids == row["prompt_ids"] + row[f"{side}_ids"], (k, side)
            assert flags == [0] * len(row["prompt_ids"]) + [1] * len(row[f"{side}_ids"]), (k, side)
    if lora:
        _start_adapters(trainer, spec, reference)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "rewards/chosen" in h]

    run(spec, tmp_path / "run")
    ours = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "rewards/chosen" in r]
    assert len(ours) == len(theirs) == STEPS
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for name in METRICS:
            # logps are sums over up to ~20 tokens: relative to their size beyond 1.
            diff = abs(a[name] - b[name]) / max(1.0, abs(b[name]))
            assert diff < 1e-4, (step, name, a[name], b[name])
            worst = max(worst, diff)
    print(f"largest difference from TRL over {STEPS} steps: {worst:.2e}")
    # It learned: the loss fell from log 2 (the policy starts as the reference) and the margin grew.
    assert abs(ours[0]["loss"] - 0.693147) < 1e-5 and ours[-1]["loss"] < ours[0]["loss"] - 0.02
    assert ours[-1]["rewards/margins"] > ours[0]["rewards/margins"] + 0.05
