"""Embeddings of an encoder (megatrain/engine/serving/embeddings.py and the server's /v1/embeddings)
against transformers' own BertModel and tokenizer on the same folder: mean-pooled (sentence-
transformers' pooling over the attention mask) and [CLS], in batches of unequal lengths, through the
`openai` package (floats and its default base64); OpenAI's errors for what a server cannot do.

Tolerance: fp32 on both sides, the same ops in other kernels (SDPA against transformers' attention)
through two layers and their LayerNorms: differences of a few ulps of values near 1; 1e-5 is ~100 ulps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from starlette.testclient import TestClient

from megatrain.engine.config import TransformerConfig
from megatrain.engine.data.chat_templates import load_chat_template
from megatrain.engine.data.tokenizers import ByteTokenizer, HFTokenizer
from megatrain.engine.interop.hf import load_hf_model
from megatrain.engine.models.bert import BertModel
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.serving import Batcher, Embedder, Specials, embed_rows
from megatrain.engine.serving.batcher import Busy
from megatrain.engine.serving.embeddings import InputError, encoder_rows
from megatrain.engine.serving.server import ModelServer, create_app

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

WORDPIECE = Path(__file__).parents[2] / "examples" / "data" / "wordpiece.json"
SEQ = 48
TEXTS = ["hi", "Hello world, colours!", "The red fox and the blue bird sing", "a b"]
TOKEN = "serve-token"
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BertForMaskedLM and the WordPiece tokenizer, as transformers saves them."""
    out = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = transformers.BertTokenizerFast(tokenizer_file=str(WORDPIECE))
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def theirs(folder: Path) -> dict[str, torch.Tensor]:
    """transformers' embeddings of TEXTS, padded in one batch: mean over the attention mask, [CLS]."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    bert = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert len(set(enc["attention_mask"].sum(1).tolist())) == len(TEXTS)  # unequal lengths: padding
    with torch.no_grad():
        hidden = bert(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return {"mean": mean, "cls": hidden[:, 0], "tokens": enc["attention_mask"].sum(1)}


@pytest.fixture(scope="module")
def ours(folder: Path) -> tuple[BertModel, HFTokenizer]:
    model, _ = load_hf_model(folder)
    assert isinstance(model, BertModel)
    return model, HFTokenizer(str(folder / "tokenizer.json"))


def test_pooling_equals_transformers_in_a_padded_batch(
    ours: tuple[BertModel, HFTokenizer], theirs: dict[str, torch.Tensor]
) -> None:
    model, tokenizer = ours
    specials = Specials.of(tokenizer)
    rows = encoder_rows(TEXTS, tokenizer, specials, SEQ)
    assert [len(r) for r in rows] == theirs["tokens"].tolist()  # [CLS] text [SEP], as transformers reads it
    n = len(TEXTS)
    for pooling in ("mean", "cls"):
        raw = embed_rows(model, rows, specials.pad, [pooling] * n, [False] * n)
        torch.testing.assert_close(raw, theirs[pooling], **TOL)
        unit = embed_rows(model, rows, specials.pad, [pooling] * n, [True] * n)
        torch.testing.assert_close(unit, F.normalize(theirs[pooling], dim=-1), **TOL)
    # Each row by its own choice in one batch; a row alone (no padding) is the same vector.
    mixed = embed_rows(model, rows, specials.pad, ["cls", "mean", "cls", "mean"], [True, False, False, True])
    want = [F.normalize(theirs["cls"][0], dim=-1), theirs["mean"][1], theirs["cls"][2]]
    torch.testing.assert_close(mixed[:3], torch.stack(want), **TOL)
    alone = embed_rows(model, rows[3:], specials.pad, ["mean"], [True])
    torch.testing.assert_close(alone[0], mixed[3], **TOL)


def test_ids_inputs_lengths_and_truncation(ours: tuple[BertModel, HFTokenizer]) -> None:
    _, tokenizer = ours
    specials = Specials.of(tokenizer)
    ids = tokenizer.encode(TEXTS[1])
    assert encoder_rows([ids], tokenizer, specials, SEQ) == encoder_rows([TEXTS[1]], tokenizer, specials, SEQ)
    with pytest.raises(InputError, match=rf"input\[1\] is {len(ids) + 2} tokens .* at most 8") as long:
        encoder_rows(["a", TEXTS[1]], tokenizer, specials, 8)
    assert long.value.index == 1 and long.value.code == "context_length_exceeded"
    cut = encoder_rows([TEXTS[1]], tokenizer, specials, 8, truncate=True)
    assert cut == [[specials.cls, *ids[:6], specials.sep]]


def test_the_thread_batches_requests_together_and_refuses_past_its_queue(
    ours: tuple[BertModel, HFTokenizer],
) -> None:
    model, tokenizer = ours
    embedder = Embedder(model, tokenizer, max_batch=4, max_waiting=3)
    rows = embedder.rows(TEXTS)
    futures = [
        embedder.submit(rows[:2]),
        embedder.submit(rows[2:], "cls"),
        embedder.submit(rows[1:3], "mean"),
    ]
    with pytest.raises(Busy):
        embedder.submit(rows[:1])
    with pytest.raises(InputError, match=r"ids must be in \[0, 128\)"):
        embedder.submit([[2, 999, 3]])
    embedder.start()
    try:
        got = [f.result(timeout=30) for f in futures]
    finally:
        embedder.stop()
    assert embedder.stats.batches == 2 and embedder.stats.most_rows == 4  # three requests, two forwards
    assert embedder.stats.inputs == 6 and embedder.stats.requests == 3
    want = embed_rows(model, rows, embedder.specials.pad, ["mean", "mean", "cls", "cls"], [True] * 4)
    torch.testing.assert_close(torch.cat(got[:2]), want, **TOL)
    again = embed_rows(model, rows[1:3], embedder.specials.pad, ["mean", "mean"], [True, True])
    torch.testing.assert_close(got[2], again, **TOL)
    with pytest.raises(Busy, match="shutting down"):
        embedder.submit(rows[:1])


@pytest.fixture(scope="module")
def sdk(ours: tuple[BertModel, HFTokenizer]) -> Iterator[tuple[Any, Embedder]]:
    model, tokenizer = ours
    embedder = Embedder(model, tokenizer, max_batch=3).start()
    server = ModelServer(None, load_chat_template(None), "tiny-bert", embedder=embedder)
    with TestClient(create_app(server, token=TOKEN)) as http:
        yield (
            openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, http_client=http, max_retries=0),
            embedder,
        )
    embedder.stop()


def test_the_sdk_gets_transformers_vectors(
    sdk: tuple[Any, Embedder], theirs: dict[str, torch.Tensor]
) -> None:
    client, _ = sdk
    raw = client.embeddings.with_raw_response.create(model="tiny-bert", input=TEXTS)
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str)  # the SDK asks for base64
    answer = raw.parse()  # and decodes it
    assert (
        answer.object == "list"
        and answer.model == "tiny-bert"
        and [d.index for d in answer.data] == [0, 1, 2, 3]
    )
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == int(theirs["tokens"].sum())
    got = torch.tensor([d.embedding for d in answer.data])
    torch.testing.assert_close(got, F.normalize(theirs["mean"], dim=-1), **TOL)
    floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in answer.data]  # base64 is exact
    cls = client.embeddings.create(
        model="tiny-bert", input=TEXTS[2], encoding_format="float", dimensions=32,
        extra_body={"pooling": "cls", "normalize": False},
    )  # fmt: skip
    torch.testing.assert_close(torch.tensor(cls.data[0].embedding), theirs["cls"][2], **TOL)


def test_errors_are_openais(sdk: tuple[Any, Embedder]) -> None:
    client, _ = sdk
    with pytest.raises(openai.BadRequestError, match="32 dimensions") as bad:
        client.embeddings.create(model="tiny-bert", input="hi", dimensions=16)
    assert bad.value.param == "dimensions" and bad.value.body["type"] == "invalid_request_error"
    long = "colours " * 40
    with pytest.raises(openai.BadRequestError, match=f"reads at most {SEQ}") as too_long:
        client.embeddings.create(model="tiny-bert", input=["hi", long])
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "input"
    cut = client.embeddings.create(model="tiny-bert", input=long, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == SEQ
    for empty in ([], "", [[]], ["a"] * 2049):
        with pytest.raises(openai.BadRequestError) as no_input:
            client.embeddings.create(model="tiny-bert", input=empty)
        assert no_input.value.param == "input"
    with pytest.raises(openai.BadRequestError, match="is an encoder") as chat:
        client.chat.completions.create(model="tiny-bert", messages=[{"role": "user", "content": "hi"}])
    assert chat.value.param == "model" and chat.value.code == "unsupported_endpoint"
    http = client._client
    assert (
        http.get("http://testserver/health", headers={"authorization": f"Bearer {TOKEN}"}).json()["kind"]
        == "encoder"
    )


def test_a_decoders_server_refuses_embeddings() -> None:
    torch.manual_seed(0)
    cfg = TransformerConfig.preset("tiny-llama", vocab_size=384, seq_length=16)
    batcher = Batcher(GPTModel(cfg).eval(), ByteTokenizer(), max_batch=2).start()
    try:
        with TestClient(create_app(ModelServer(batcher, load_chat_template(None), "tiny"))) as http:
            client = openai.OpenAI(
                base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
            )
            with pytest.raises(
                openai.BadRequestError, match="'tiny-llama' is a decoder; embeddings need an encoder"
            ):
                client.embeddings.create(model="tiny-llama", input="hi")
    finally:
        batcher.stop()


def _serve_spec(init_from: str, folder: Path, **model: Any) -> Any:
    from megatrain.spec import parse_spec

    return parse_spec({"name": "serve", "kind": "serve", "model": {**model, "init_from": init_from},
                       "data": {"tokenizer": {"type": "hf", "path": str(folder / "tokenizer.json")}},
                       "training": {"precision": "fp32"}, "resources": {"devices": 1}})  # fmt: skip


def test_a_serve_job_loads_a_bert_checkpoint_or_folder_as_an_embedder(
    megatrain_home: Path, folder: Path, ours: tuple[BertModel, HFTokenizer], tmp_path: Path
) -> None:
    from megatrain.engine.checkpoint import save_model
    from megatrain.engine.serving.job import _load
    from megatrain.engine.sink import RunLog
    from megatrain.hf_config import model_fields_from_hf
    from megatrain.settings import get_settings

    model, tokenizer = ours
    settings = get_settings()
    fields = model_fields_from_hf(transformers.BertConfig.from_pretrained(folder).to_dict())
    save_model(f"{settings.resolved_storage_url}/jobs/job_bert/checkpoints", 3, model,
               _serve_spec(f"hf:{folder}", folder, **fields))  # fmt: skip
    rows = encoder_rows(TEXTS, tokenizer, Specials.of(tokenizer), SEQ)
    want = embed_rows(model, rows, 0, ["mean"] * len(rows), [True] * len(rows))
    for init_from, extra in (("checkpoint:job_bert", {}), (f"hf:{folder}", fields)):
        out = tmp_path / init_from.split(":")[0]
        out.mkdir()
        run_log = RunLog(out, True)
        server = _load(_serve_spec(init_from, folder, **extra), out, settings, run_log)
        try:
            assert server.batcher is None and server.embedder is not None
            torch.testing.assert_close(server.embedder.embed(rows), want, **TOL)
        finally:
            server.stop()
            run_log.close()
