"""Issue 29 through the product, as a user drives it with the SDK: a tiny Hugging Face Llama made
here is the base; an SFT and a preference JSONL are uploaded through /v1/datasets; a LoRA fine-tune
and a DPO job with LoRA, both naming those datasets, run to success; the DPO job's metrics carry
TRL's names and start at log 2; each job's adapter is exported, downloaded through the API and
loaded by `peft` on the base, where it changes the logits. On the embedded default (SQLite, the
local executor) and on PostgreSQL + Celery (Redis), with the real engine on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from fixtures.celery import celery_stack
from fixtures.checkpoints import write_bpe_tokenizer
from fixtures.live import LiveApi

from megatrain.client import Client

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 240.0
"""Far above a run here (seconds on two CPU cores): only a stuck job reaches it."""
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")  # fmt: skip
LORA = {"rank": 4, "alpha": 8.0}
# lr 5e-2: a few steps move the adapters' B (zero at the start) well off zero.
TRAINING = {"method": "lora", "lora": LORA, "global_batch_size": 2, "micro_batch_size": 2, "lr": 5e-2,
            "lr_schedule": "constant", "warmup_iters": 0, "precision": "fp32", "log_interval": 1,
            "eval_interval": 0}  # fmt: skip


def _tiny_base(folder: Path) -> Path:
    """A 2-layer Llama with random weights and a byte-level BPE, as save_pretrained writes them."""
    import torch
    import transformers

    folder.mkdir(parents=True)
    raw = write_bpe_tokenizer(folder.parent / "bpe.json")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw), eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sft_records() -> list[dict[str, Any]]:
    # prompt/response pairs in words the BPE knows (write_bpe_tokenizer's lines)
    return [{"prompt": f"def add(a, b): # {i}", "response": "    return a + b"} for i in range(24)]


def _preference_records() -> list[dict[str, Any]]:
    return [
        {"prompt": f"class Point: # {i}", "chosen": "    x = 0", "rejected": "print(i)"} for i in range(8)
    ]


def _spec(name: str, kind: str, base: Path, dataset: str, pool: str, **training: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "model": {"init_from": f"hf:{base.as_uri()}", "seq_length": 32},
        "data": {
            "tokenizer": {"type": "hf", "path": (base / "tokenizer.json").as_uri()},
            "train": [{"dataset": dataset}],
            "split": "1,0,0",
        },
        "training": TRAINING | training,
        "resources": {"devices": 1, "pool": pool, "max_runtime_s": 600},
    }


def _wait_succeeded(client: Client, job_id: str, worker_log: Path | None) -> None:
    """The job succeeded; else fail with its reason, events and last log lines (and the worker's)."""
    try:
        job = client.wait(job_id, timeout_s=JOB_TIMEOUT_S, poll_interval_s=0.5)
        status, reason = job.status, job.status_reason
    except TimeoutError as exc:
        status, reason = "timed out", str(exc)
    if status == "succeeded":
        return
    events = "\n".join(json.dumps(e, default=str) for e in client.events(job_id))
    logs = "\n".join(line.line for line in client.logs(job_id)[-80:])
    worker = worker_log.read_text()[-4000:] if worker_log and worker_log.exists() else ""
    pytest.fail(
        f"job {job_id} {status}: {reason}\n--- events ---\n{events}\n--- log ---\n{logs}\n"
        f"--- worker ---\n{worker}"
    )


def _load_adapter(folder: Path, base: Path) -> None:
    """peft loads the downloaded adapter on the base, names that base, and changes its logits."""
    import peft
    import torch
    import transformers

    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (LORA["rank"], LORA["alpha"], "LORA")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b")])
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        plain = model(tokens).logits
        tuned = peft.PeftModel.from_pretrained(model, folder).eval()
        adapted = tuned(tokens).logits
        with tuned.disable_adapter():
            torch.testing.assert_close(tuned(tokens).logits, plain)  # the base is untouched
    # B starts at zero: an adapter that never trained (or was lost on the way) would change nothing.
    # A few steps at lr 5e-2 move the logits by far more than fp32 rounding (~1e-6).
    assert (adapted - plain).abs().max().item() > 1e-3


def _lora_and_dpo_through_the_api(live: LiveApi, work: Path, pool: str, worker_log: Path | None) -> None:
    pytest.importorskip("peft")
    base = _tiny_base(live.data_path.parent / "tiny-llama")
    tokenizer = f"hf:{(base / 'tokenizer.json').as_uri()}"
    sft = _write_jsonl(work / "sft.jsonl", _sft_records())
    prefs = _write_jsonl(work / "prefs.jsonl", _preference_records())
    with Client(api_url=live.url, api_key=live.key) as client:
        # Uploaded from outside the data roots: the API stores them; the workers preprocess them.
        uploaded = {}
        for path, name in ((sft, "sft"), (prefs, "prefs")):
            ds = client.upload_dataset(path, name, tokenizer, json_key="prompt", wait=True, timeout_s=120)
            lines = len(path.read_text().splitlines())
            assert (ds.state, ds.uploaded, ds.documents) == ("ready", True, lines)
            uploaded[name] = ds.source_url
        steps = {"train_iters": 4, "checkpoint_interval": 4}
        lora = client.submit(_spec("lora-sft", "finetune", base, "sft", pool, **steps))
        # Two rows a micro-batch (even): one pair, its chosen and rejected sequences.
        steps = {"train_iters": 3, "checkpoint_interval": 3, "dpo": {"beta": 0.1}}
        dpo = client.submit(_spec("dpo-lora", "dpo", base, "prefs", pool, **steps))
        for job, name in ((lora, "sft"), (dpo, "prefs")):
            # Both read the uploaded records, not the index of their prompts (json_key) alone.
            assert job.spec and job.spec["data"]["train"][0]["path"] == uploaded[name]
            assert job.pool == pool
            _wait_succeeded(client, job.id, worker_log)

        assert [c.step for c in client.checkpoints(lora.id)] == [4]
        rows = client.metrics(lora.id, kind="train")
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)

        rows = client.metrics(dpo.id, kind="train")
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:
            assert set(TRL_METRICS) <= row.keys(), row
        # The policy starts as the reference (the adapters' B is zero): -log σ(0) = log 2, rewards 0.
        first = rows[0]
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-4), first
        assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-4)
        assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
        assert [c.step for c in client.checkpoints(dpo.id)] == [3]

        for job in (lora, dpo):
            exp = client.export(
                job.id, dtype="fp32", form="adapter", wait=True, timeout_s=120, poll_interval_s=0.5
            )
            folder = client.download_export(job.id, exp.id, work / f"{job.id}-adapter")
            assert {p.name for p in folder.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
            _load_adapter(folder, base)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_lora_and_dpo_on_the_embedded_default(live_stack: LiveApi, tmp_path: Path) -> None:
    _lora_and_dpo_through_the_api(live_stack, tmp_path, "default", None)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_lora_and_dpo_on_postgres_and_celery(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with celery_stack(tmp_path, monkeypatch, redis_url) as live:
        pool = live.settings.pool_name
        _lora_and_dpo_through_the_api(live, tmp_path, pool, tmp_path / "worker.log")
