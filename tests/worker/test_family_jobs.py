"""A BERT pretraining job and a T5 fine-tuning job through the product (the SDK, the API, the
scheduler, the local executor, the real engine on CPU) to success, with the metrics their charts
read: masked-token and sentence-order accuracy for BERT, the decoder targets' token accuracy and a
validation loss for T5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures.live import LiveApi

from megatrain.client import Client, load_spec_file

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(live: LiveApi, spec: dict[str, Any]) -> list[dict[str, Any]]:
    with Client(api_url=live.url, api_key=live.key) as client:
        job = client.submit(spec)
        done = client.wait(job.id, timeout_s=300, poll_interval_s=0.5)
        logs = [line for line in client.logs(job.id)] if done.status != "succeeded" else []
        assert done.status == "succeeded", f"{done.status_reason}\n" + "\n".join(map(str, logs[-40:]))
        return list(client.metrics(job.id))


def _short(spec: dict[str, Any], **training: Any) -> dict[str, Any]:
    spec["training"] |= {"train_iters": 8, "log_interval": 2, "eval_interval": 4, "checkpoint_interval": 0,
                         "warmup_iters": 1, **training}  # fmt: skip
    return spec


def test_a_bert_pretraining_job_succeeds_with_its_accuracies(live_stack: LiveApi) -> None:
    spec = _short(load_spec_file(EXAMPLES / "bert_pretrain.yaml"))
    rows = _run(live_stack, spec)
    train = [r for r in rows if r.get("kind") != "val"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert all(0 <= r["token_accuracy"] <= 1 and 0 <= r["sop_accuracy"] <= 1 for r in train)
    assert all(0.3 < r["sop_loss"] < 1.5 for r in train)
    valid = [r for r in rows if r.get("kind") == "val"]
    assert [r["step"] for r in valid] == [4, 8] and all("valid_mean_token_accuracy" in r for r in valid)


def test_a_t5_fine_tuning_job_succeeds_from_a_transformers_folder(live_stack: LiveApi) -> None:
    import json

    import torch
    import transformers

    vocab = len(json.loads((EXAMPLES / "data" / "t5_wordpiece.json").read_text())["model"]["vocab"])
    folder = live_stack.data_path.parent / "t5"  # under the tenant's data roots
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False, decoder_start_token_id=0)  # fmt: skip
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    spec = _short(load_spec_file(EXAMPLES / "t5_finetune.yaml"), lr=3e-3)
    spec["model"]["init_from"] = f"hf:{folder.as_uri()}"
    rows = _run(live_stack, spec)
    train = [r for r in rows if r.get("kind") != "val"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(0 <= r["token_accuracy"] <= 1 for r in train)
    assert [r["step"] for r in rows if r.get("kind") == "val"] == [4, 8]
