"""POST /openai/v1/chat/completions and /completions (megatrain/api/openai/chat.py) driven by the
`openai` package itself, on the embedded default: two LoRA fine-tunes of one tiny Hugging Face
Llama run to success; their models answer chats, streamed and not, with the greedy tokens of
megatrain's generate() on the same checkpoint; concurrent requests for both adapters are answered
by one model server (one serve job); errors come back in OpenAI's shape as the SDK's own exceptions."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import write_bpe_tokenizer
from fixtures.live import LiveApi, add_checkpoint, start_live_api
from fixtures.openai_kit import (
    SchemaCheck,
    chat_records,
    jsonl,
    megatrain_generate,
    register_model,
    wait_for,
)
from fixtures.openai_kit import sdk as checked_sdk

from megatrain.client import Client

openai = pytest.importorskip("openai")

JOB_TIMEOUT_S = 240.0
WAITING = ("queued", "scheduled", "running")
CHAT = [{"role": "user", "content": "def add(a, b):"}]
TRAINING = {"method": "lora", "lora": {"rank": 4, "alpha": 8.0}, "train_iters": 2, "checkpoint_interval": 2,
            "global_batch_size": 2, "micro_batch_size": 2, "lr_schedule": "constant", "warmup_iters": 0,
            "precision": "fp32", "log_interval": 1, "eval_interval": 0}  # fmt: skip


def _tiny_base(folder: Path) -> Path:
    """A 2-layer Llama (peaked logits: no near-ties for greedy to flip on) and a byte-level BPE."""
    import torch
    import transformers

    folder.mkdir(parents=True)
    raw = write_bpe_tokenizer(folder.parent / "bpe.json")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw), eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _spec(name: str, folder: str, data: Path, lr: float) -> dict[str, Any]:
    """A LoRA fine-tune of the registered base `tiny` (whose folder is `folder`)."""
    return {
        "name": name,
        "kind": "finetune",
        "model": {"init_from": "hf:tiny", "seq_length": 32},
        "data": {
            "tokenizer": {"type": "hf", "path": f"{folder}/tokenizer.json"},
            "train": [{"path": data.as_uri()}],
            "split": "1,0,0",
        },  # fmt: skip
        "training": TRAINING | {"lr": lr},
        "resources": {"devices": 1, "max_runtime_s": 600},
    }


def _finished(job: Any) -> Any:
    return job if job.status in ("succeeded", "failed", "cancelled") else None


def _wait_succeeded(client: Client, job_id: str) -> None:
    job = client.wait(job_id, timeout_s=JOB_TIMEOUT_S, poll_interval_s=0.5)
    if job.status != "succeeded":
        logs = "\n".join(line.line for line in client.logs(job_id)[-60:])
        pytest.fail(f"job {job_id} {job.status}: {job.status_reason}\n{logs}")


@pytest.fixture
def live_stack(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    """fixtures.live's stack; its serve jobs cancelled at the end (a model server outlives the
    stack otherwise, until its idle timeout, here shortened to bound that too)."""
    monkeypatch.setenv("MEGATRAIN_SERVE_IDLE_TIMEOUT_S", "60")
    for live in start_live_api(tmp_path, monkeypatch, with_scheduler=True):
        try:
            yield live
        finally:
            with Client(api_url=live.url, api_key=live.key) as client:
                for job in [j for j in client.list_jobs() if j.kind == "serve" and j.status in WAITING]:
                    client.cancel(job.id)
                    client.wait(job.id, timeout_s=60, poll_interval_s=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_fine_tuned_models_answer_through_the_openai_sdk(live_stack: LiveApi) -> None:
    base = _tiny_base(live_stack.data_path.parent / "tiny-llama")
    folder = register_model(live_stack.url, live_stack.key, "tiny", base)["url"]
    check = SchemaCheck()  # every answer and stream chunk against OpenAI's published document
    sdk = checked_sdk(live_stack.url, live_stack.key, check)
    # Adapter a: a fine-tuning job of OpenAI's API (LoRA, the operator's default) on the registered base.
    train = sdk.files.create(file=("train.jsonl", jsonl(chat_records(8))), purpose="fine-tune")
    hp = {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 50.0}
    ft = sdk.fine_tuning.jobs.create(
        model="tiny", training_file=train.id, suffix="sft", extra_body={"megatrain": {"seq_length": 32}},
        method={"type": "supervised", "supervised": {"hyperparameters": hp}},
    )  # fmt: skip
    # Adapter b: one of our own LoRA jobs on the same base.
    data = live_stack.data_path.parent / "sft.jsonl"
    records = [{"prompt": f"def add(a, b): # {i}", "response": "    return a + b"} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with Client(api_url=live_stack.url, api_key=live_stack.key) as client:
        ours = client.submit(_spec("sft-b", folder, data, 2e-2))
        _wait_succeeded(client, ours.id)
        done = wait_for(lambda: _finished(sdk.fine_tuning.jobs.retrieve(ft.id)), JOB_TIMEOUT_S, 0.5)
        assert done.status == "succeeded", done.error
        jobs = {"a": done.id.removeprefix("ft"), "b": ours.id}
        specs = {name: client.get_job(job_id).spec for name, job_id in jobs.items()}
        checkpoint = {name: client.checkpoints(job_id)[-1].uri for name, job_id in jobs.items()}
    # a: the id OpenAI's API gives (the job id's hex last); b: with our job id, read as loosely.
    models = {"a": done.fine_tuned_model, "b": f"ft:tiny:acme:b:{ours.id}"}
    assert models["a"].startswith("ft:tiny:") and models["a"] in {m.id for m in sdk.models.list()}

    # Not streamed: greedy equals megatrain's generate on the checkpoint (its adapters merged).
    prompt, want = megatrain_generate(checkpoint["a"], specs["a"], CHAT, 8)
    answer = sdk.chat.completions.create(model=models["a"], messages=CHAT, temperature=0, max_tokens=8)
    assert answer.object == "chat.completion" and answer.model == models["a"]
    assert answer.choices[0].message.content == want and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)

    # Streamed: OpenAI's chunks, the same text, a usage chunk when asked, then [DONE] (the SDK stops).
    stream = sdk.chat.completions.create(
        model=models["a"], messages=CHAT, temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    )

    # Two adapters of one base at once: one serve job, one server process.
    raw: dict[str, Any] = {}

    def ask(name: str) -> None:
        raw[name] = sdk.chat.completions.with_raw_response.create(
            model=models[name], messages=CHAT, temperature=0, max_tokens=16
        )

    threads = [threading.Thread(target=ask, args=(name,)) for name in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    servers = {r.headers["x-megatrain-server"] for r in raw.values()}
    serve_jobs = {r.headers["x-megatrain-serve-job"] for r in raw.values()}
    assert len(servers) == 1 and len(serve_jobs) == 1
    _, want_b = megatrain_generate(checkpoint["b"], specs["b"], CHAT, 16)
    assert raw["b"].parse().choices[0].message.content == want_b
    with Client(api_url=live_stack.url, api_key=live_stack.key) as client:
        assert [j.id for j in client.list_jobs() if j.kind == "serve"] == list(serve_jobs)

    # The legacy completions endpoint on the same server.
    text = sdk.completions.create(model=models["b"], prompt="def add", max_tokens=4, temperature=0)
    assert text.object == "text_completion" and text.usage is not None and text.usage.completion_tokens <= 4
    assert list(sdk.completions.create(model=models["b"], prompt="def add", max_tokens=4, stream=True))

    # A PEFT adapter folder registered over the base answers on the same server, as peft's own model.
    import peft
    import torch
    import transformers

    torch.manual_seed(2)
    tuned = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(r=4, init_lora_weights=False)
    ).eval()
    tuned.save_pretrained(base.parent / "tiny-peft")
    with Client(api_url=live_stack.url, api_key=live_stack.key) as client:
        client.register_model("tiny-peft", (base.parent / "tiny-peft").as_uri(), base="tiny")
    raw_peft = sdk.completions.with_raw_response.create(model="tiny-peft", prompt="def add", max_tokens=8,
                                                        temperature=0)  # fmt: skip
    assert raw_peft.headers["x-megatrain-serve-job"] in serve_jobs
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    ids = tokenizer("def add", return_tensors="pt").input_ids
    with torch.no_grad():
        eos = tokenizer.eos_token_id
        out = tuned.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    want_peft = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert raw_peft.parse().choices[0].text == want_peft
    plain = sdk.completions.create(model="tiny", prompt="def add", max_tokens=8, temperature=0)
    assert plain.choices[0].text != want_peft  # the adapters are what answered
    assert check.violations == [], "\n".join(check.violations)
    assert check.checked["document"] >= 10  # answers, stream chunks, pages


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_models_resolve_per_tenant_and_errors_come_back_in_openai_shape(live_api: LiveApi) -> None:
    from megatrain.api.auth import create_api_key
    from megatrain.db.session import session_scope

    url = f"{live_api.url}/openai/v1"
    check = SchemaCheck()
    sdk = checked_sdk(live_api.url, live_api.key, check)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="no-such-model", messages=CHAT)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="mt_wrong", max_retries=0).chat.completions.create(
            model="no-such-model", messages=CHAT
        )
    with Client(api_url=live_api.url, api_key=live_api.key) as client:
        job = client.submit(live_api.spec())  # stays queued: no scheduler here
        with pytest.raises(openai.NotFoundError, match="no checkpoint yet"):
            sdk.chat.completions.create(model=f"ft:tiny:acme:x:{job.id}", messages=CHAT)
        # A checkpoint to serve, but no scheduler to start its server: a 503 with Retry-After, once
        # serve_start_timeout_s has passed; a second request waits on the same serve job.
        add_checkpoint(live_api.settings, job.id, 5)
        live_api.settings.serve_start_timeout_s = 0.5
        for model in (f"checkpoint:{job.id}@5", f"ft:tiny:acme:x:{job.id}:ckpt-step-5"):
            with pytest.raises(openai.InternalServerError) as busy:
                sdk.chat.completions.create(model=model, messages=CHAT)
            assert busy.value.status_code == 503 and busy.value.response.headers["retry-after"] == "10"
        # A registered model is a base of its own, served with its folder's tokenizer.
        base = _tiny_base(live_api.data_path.parent / "tiny-llama")
        client.register_model("tiny-llama", base.as_uri())
        with pytest.raises(openai.InternalServerError):
            sdk.completions.create(model="tiny-llama", prompt="def")
        # A PEFT adapter folder registered over it: its adapters answer on that base's server.
        import peft
        import transformers

        adapter = live_api.data_path.parent / "tiny-lora"
        hf = transformers.AutoModelForCausalLM.from_pretrained(base)
        peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0)).save_pretrained(adapter)
        client.register_model("tiny-lora", adapter.as_uri(), base="tiny-llama")
        with pytest.raises(openai.InternalServerError):
            sdk.chat.completions.create(model="tiny-lora", messages=CHAT)
        jobs = client.list_jobs(include_spec=True)
        serve = {j.spec["model"]["init_from"]: j for j in jobs if j.kind == "serve"}
    assert set(serve) == {f"checkpoint:{job.id}@5", f"hf:{base.as_uri()}"}  # no third server
    assert serve[f"hf:{base.as_uri()}"].spec["data"]["tokenizer"]["path"] == f"{base.as_uri()}/tokenizer.json"
    # Another tenant's job is the same 404 as a missing one.
    with session_scope(live_api.settings.resolved_database_url) as session:
        other = create_api_key(session, "other-tenant")
    theirs = openai.OpenAI(base_url=url, api_key=other, max_retries=0)
    for model in (f"checkpoint:{job.id}@5", f"ft:tiny:acme:x:{job.id}", job.id):
        with pytest.raises(openai.NotFoundError):
            theirs.chat.completions.create(model=model, messages=CHAT)
    with pytest.raises(openai.BadRequestError):  # refused here, before any server: no model named
        sdk.chat.completions.create(model="", messages=CHAT)
    assert check.violations == [] and check.checked["document"] >= 5, check.violations
