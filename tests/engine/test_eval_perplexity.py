"""eval.perplexity (engine.evaluation.perplexity): every token of a split of the spec's own data
scored once, against the same figure computed here by hand: the JSONL's documents of that split
(data.split's contiguous ranges, data.valid held out whole) byte-tokenized with their end-of-document
ids, concatenated, cut into windows of seq_length + 1 overlapping by one, and put through the
model's own per-token loss (GPTModel.loss)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lm_eval")

from megatrain.engine.data.gpt_dataset import split_bounds  # noqa: E402
from megatrain.engine.data.tokenizers import ByteTokenizer  # noqa: E402
from megatrain.engine.evaluation.lm import EngineLM  # noqa: E402
from megatrain.engine.evaluation.perplexity import perplexity_results  # noqa: E402
from megatrain.engine.serving.loader import load_served  # noqa: E402
from megatrain.spec import parse_spec  # noqa: E402

from .helpers import write_corpus  # noqa: E402

SEQ = 64


def eval_spec(corpus: Path, held_out: Path | None = None, **block: Any) -> Any:
    data: dict[str, Any] = {
        "train": [{"path": corpus.as_uri()}],
        "split": "80,20,0",
        "tokenizer": {"type": "byte"},
    }
    if held_out is not None:
        data["valid"] = [{"path": held_out.as_uri()}]
    return parse_spec(
        {
            "name": "ppl",
            "kind": "eval",
            "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                      "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": SEQ,
                      "init_method_std": 0.3, "init_from": "hf:/unused"},
            "data": data,
            "training": {"precision": "fp32", "seed": 3},
            "eval": {"perplexity": ["valid", "train"], "batch_size": 3, **block},
        }
    )  # fmt: skip


def by_hand(model: Any, texts: list[str]) -> tuple[float, int]:
    """(per-token loss, windows) of the texts' byte tokens, each document ended by EOD."""
    tok = ByteTokenizer()
    ids = [t for text in texts for t in [*tok.encode(text), tok.eod]]
    windows, start = [], 0
    while len(ids) - start >= 2:
        windows.append(ids[start : start + SEQ + 1])
        start += SEQ
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w])
            loss = model.loss(x[:, :-1], x[:, 1:], None)  # mean over the window's labels
            total += float(loss) * (len(w) - 1)
            count += len(w) - 1
    return total / count, len(windows)


def test_a_splits_perplexity_is_every_token_once_through_the_models_own_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    held = write_corpus(tmp_path / "held.jsonl", num_docs=6, seed=5)
    spec = eval_spec(corpus, held)
    served = load_served(
        spec.model_copy(update={"model": spec.model.model_copy(update={"init_from": None})}), "cpu"
    )
    lm = EngineLM(served.model, served.tokenizer, batch_size=3)
    results = perplexity_results(spec, lm.scorer, 3)
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    (train_lo, train_hi), (valid_lo, valid_hi), _ = split_bounds(len(docs), [0.8, 0.2, 0.0])
    held_docs = [json.loads(line)["text"] for line in held.read_text().splitlines()]
    # The valid split: data.split's share of the corpus, then the held-out file whole.
    for split, texts in (("valid", docs[valid_lo:valid_hi] + held_docs), ("train", docs[train_lo:train_hi])):
        loss, windows = by_hand(served.model, texts)
        got = results[f"perplexity:{split}"]
        assert got["loss"]["value"] == pytest.approx(loss, rel=1e-5), split
        assert got["perplexity"]["value"] == pytest.approx(math.exp(loss), rel=1e-5)
        assert got["loss"]["n"] == windows
        assert got["tokens"]["value"] == sum(len(t.encode()) + 1 for t in texts) - 1
    assert results["perplexity:valid"]["loss"]["value"] != results["perplexity:train"]["loss"]["value"]
    # `limit`: the first windows only.
    limited = perplexity_results(eval_spec(corpus, held, limit=2), lm.scorer, 3)
    assert limited["perplexity:train"]["loss"]["n"] == 2
