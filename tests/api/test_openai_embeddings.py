"""POST /openai/v1/embeddings (megatrain/api/openai/chat.py) with the `openai` package: a registered
tiny BERT folder answers through a serve job with transformers' own mean-pooled vectors; a model of
the wrong kind (embeddings of a decoder, chat of an encoder) is OpenAI's 400 before any server starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi, add_checkpoint, start_live_api
from fixtures.openai_kit import SchemaCheck, register_model, tiny_model
from fixtures.openai_kit import sdk as checked_sdk

from megatrain.client import Client, load_spec_file

openai = pytest.importorskip("openai")

EXAMPLES = Path(__file__).parents[2] / "examples"
WORDPIECE = EXAMPLES / "data" / "wordpiece.json"
TEXTS = ["hi", "Hello world, colours!", "The red fox and the blue bird sing"]
WAITING = ("queued", "scheduled", "running")
TOL = {"atol": 1e-5, "rtol": 1e-5}
"""fp32 on both sides, other kernels: see tests/engine/test_serving_embeddings.py."""


def _tiny_bert(folder: Path) -> Path:
    """A tiny BertForMaskedLM and its WordPiece tokenizer, as transformers saves them."""
    import torch
    import transformers

    tokenizer = transformers.BertTokenizerFast(tokenizer_file=str(WORDPIECE))
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _stand_in_bert(folder: Path) -> Path:
    """A BERT folder the API reads (config.json, tokenizer.json) but never loads."""
    folder.mkdir()
    config = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 128,
              "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 32, "hidden_act": "gelu"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes(WORDPIECE.read_bytes())
    (folder / "model.safetensors").write_bytes(b"stand-in")
    return folder


def _serve_jobs(live: LiveApi) -> list[Any]:
    with Client(api_url=live.url, api_key=live.key) as client:
        return [j for j in client.list_jobs(include_spec=True) if j.kind == "serve"]


@pytest.fixture
def live_stack(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    """fixtures.live's stack; its serve jobs cancelled at the end."""
    monkeypatch.setenv("MEGATRAIN_SERVE_IDLE_TIMEOUT_S", "60")
    for live in start_live_api(tmp_path, monkeypatch, with_scheduler=True):
        try:
            yield live
        finally:
            with Client(api_url=live.url, api_key=live.key) as client:
                for job in [j for j in _serve_jobs(live) if j.status in WAITING]:
                    client.cancel(job.id)
                    client.wait(job.id, timeout_s=60, poll_interval_s=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_registered_bert_embeds_as_transformers_does(live_stack: LiveApi) -> None:
    import torch
    import torch.nn.functional as F
    import transformers
    from openai.types import CreateEmbeddingResponse

    folder = _tiny_bert(live_stack.data_path.parent / "tiny-bert")
    register_model(live_stack.url, live_stack.key, "tiny-bert", folder)
    check = SchemaCheck()
    sdk = checked_sdk(live_stack.url, live_stack.key, check).with_options(timeout=180)
    assert "tiny-bert" in {m.id for m in sdk.models.list()}

    raw = sdk.embeddings.with_raw_response.create(model="tiny-bert", input=TEXTS)  # base64, decoded
    answer = raw.parse()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    bert = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = bert(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    want = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(torch.tensor([d.embedding for d in answer.data]), want, **TOL)
    assert answer.model == "tiny-bert" and answer.usage.prompt_tokens == int(enc["attention_mask"].sum())

    floats = sdk.embeddings.with_raw_response.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    body = floats.http_response.json()
    CreateEmbeddingResponse.model_validate(body)  # the SDK's own type, strictly
    assert [d["embedding"] for d in body["data"]] == [d.embedding for d in answer.data]
    assert floats.headers["x-megatrain-serve-job"] == raw.headers["x-megatrain-serve-job"]  # one server

    # The server's own refusals come back through the API in OpenAI's shape.
    with pytest.raises(openai.BadRequestError, match="32 dimensions") as bad:
        sdk.embeddings.create(model="tiny-bert", input="hi", dimensions=8)
    assert bad.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError, match="reads at most 32") as long:
        sdk.embeddings.create(model="tiny-bert", input="colours " * 40)
    assert long.value.code == "context_length_exceeded"
    (serve,) = _serve_jobs(live_stack)
    assert (
        serve.spec["model"]["arch"] == "bert" and serve.spec["model"]["init_from"] == f"hf:{folder.as_uri()}"
    )
    assert check.violations == [], "\n".join(check.violations)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_wrong_kind_of_model_is_a_400_before_any_server(live_api: LiveApi) -> None:
    root = live_api.data_path.parent
    register_model(live_api.url, live_api.key, "llama", tiny_model(root / "llama"))
    register_model(live_api.url, live_api.key, "bert", _stand_in_bert(root / "bert"))
    check = SchemaCheck()
    sdk = checked_sdk(live_api.url, live_api.key, check)
    with pytest.raises(
        openai.BadRequestError, match="'llama' is a decoder; embeddings need an encoder"
    ) as dec:
        sdk.embeddings.create(model="llama", input="hi")
    assert dec.value.param == "model" and dec.value.code == "unsupported_endpoint"
    for ask in (
        lambda: sdk.chat.completions.create(model="bert", messages=[{"role": "user", "content": "hi"}]),
        lambda: sdk.completions.create(model="bert", prompt="hi"),
    ):
        with pytest.raises(openai.BadRequestError, match="'bert' is an encoder") as enc:
            ask()
        assert enc.value.param == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="no-such-model", input="hi")
    assert missing.value.code == "model_not_found"
    assert _serve_jobs(live_api) == []  # none of these started a server
    # The encoder's serve job is a valid spec: submitted, waiting for a scheduler (none here).
    live_api.settings.serve_start_timeout_s = 0.5
    with pytest.raises(openai.InternalServerError) as busy:
        sdk.embeddings.create(model="bert", input="hi")
    assert busy.value.status_code == 503
    (serve,) = _serve_jobs(live_api)
    assert serve.spec["model"]["arch"] == "bert" and serve.spec["data"]["tokenizer"]["type"] == "hf"

    # A BERT job's own checkpoint is a model too (queued here: a stand-in checkpoint), an encoder.
    with Client(api_url=live_api.url, api_key=live_api.key) as client:
        job = client.submit(load_spec_file(EXAMPLES / "bert_pretrain.yaml"))
    add_checkpoint(live_api.settings, job.id, 5)
    with pytest.raises(openai.BadRequestError, match="is an encoder"):
        sdk.chat.completions.create(model=job.id, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.InternalServerError):
        sdk.embeddings.create(model=job.id, input="hi")
    serve = {j.spec["model"]["init_from"]: j for j in _serve_jobs(live_api)}[f"checkpoint:{job.id}@5"]
    assert serve.spec["model"]["arch"] == "bert" and serve.spec["data"]["tokenizer"]["type"] == "hf"
    assert check.violations == [], "\n".join(check.violations)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_serve_example_validates_on_a_registered_bert(live_api: LiveApi) -> None:
    folder = live_api.data_path.parent / "demo-bert"
    _stand_in_bert(folder)
    register_model(live_api.url, live_api.key, "demo-bert", folder)
    data = load_spec_file(EXAMPLES / "bert_serve.yaml")
    resp = httpx.post(f"{live_api.url}/v1/spec/validate", json=data,
                      headers={"Authorization": f"Bearer {live_api.key}"})  # fmt: skip
    assert resp.status_code == 200 and resp.json()["valid"], resp.text
    spec = resp.json()["spec"]
    assert spec["kind"] == "serve" and spec["model"]["arch"] == "bert"
    assert spec["model"]["init_from"] == f"hf:{folder.as_uri()}"
