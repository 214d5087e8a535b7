"""An arch t5 job's rows (data.t5_data, data.t5_pairs): the start, end and pad ids a tokenizer
gives them, span corruption's sentinel vocabulary, and input/target pairs cut to their lengths with
the loss on the target's tokens and its end token only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatrain.engine.data.t5_data import sentinel_vocab, t5_specials
from megatrain.engine.data.tokenizers import HFTokenizer
from megatrain.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"


def word_tokenizer(tmp_path: Path, pieces: list[str]) -> HFTokenizer:
    """A whole-word tokenizer over `pieces` (ids in order), its bracketed pieces special."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=pieces[1]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([p for p in pieces if p.startswith(("<", "["))])
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    return HFTokenizer(str(path))


def test_specials_of_a_wordpiece_and_of_a_t5_vocabulary(tmp_path: Path) -> None:
    ours = HFTokenizer(str(EXAMPLES / "t5_wordpiece.json"))
    assert t5_specials(ours) == type(t5_specials(ours))(start=5, end=6, pad=0)  # [BOS] [EOS] [PAD]
    # T5's own (SentencePiece's pieces): no start token, so the decoder starts with its pad.
    t5 = word_tokenizer(tmp_path, ["<pad>", "</s>", "<unk>", "cat", "dog"])
    specials = t5_specials(t5)
    assert (specials.start, specials.end, specials.pad) == (0, 1, 0)
    with pytest.raises(ValueError, match="no end token"):
        t5_specials(word_tokenizer(tmp_path, ["<pad>", "<unk>", "cat"]))


def test_span_corruption_needs_sentinels() -> None:
    assert (
        len(sentinel_vocab(HFTokenizer(str(EXAMPLES / "t5_wordpiece.json"))).additional_special_tokens_ids)
        == 100
    )
    with pytest.raises(ValueError, match="sentinels"):
        sentinel_vocab(HFTokenizer(str(EXAMPLES / "wordpiece.json")))  # BERT's: no [BOS], [EOS], sentinels


def pairs_spec(path: Path, seq: int, dec: int) -> Any:
    return parse_spec({
        "name": "pairs", "kind": "finetune",
        "model": {"arch": "t5", "init_from": "hf:/models/t5", "seq_length": seq,
                  "t5": {"decoder_seq_length": dec}},
        "data": {"tokenizer": {"type": "hf", "path": str(EXAMPLES / "t5_wordpiece.json")},
                 "train": [{"path": path.as_uri()}], "split": "1,0,0"},
        "training": {"train_iters": 1, "global_batch_size": 2, "micro_batch_size": 2},
    })  # fmt: skip


def test_pairs_are_cut_to_their_lengths_and_train_on_targets(tmp_path: Path) -> None:
    from megatrain.engine.data.t5_pairs import build_pair_datasets

    path = tmp_path / "pairs.jsonl"
    records = [{"input": "copy: cat dog owl fox hare", "target": "cat dog owl fox hare"},
               {"prompt": "reverse: cat dog", "response": "dog cat"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = HFTokenizer(str(EXAMPLES / "t5_wordpiece.json"))
    ds = build_pair_datasets(pairs_spec(path, 6, 4), tok, tmp_path / "cache")["train"]
    assert ds is not None and len(ds) == 2 and ds.stats["inputs_cut"] == 1 and ds.stats["targets_cut"] == 1
    rows = {ds.record(i): i for i in range(2)}
    b = ds.batch([rows[0], rows[1]])
    long, short = tok.encode(records[0]["input"]), tok.encode("reverse: cat dog")
    assert b.tokens[0].tolist() == [*long[:5], 6] and b.enc_mask[0].tolist() == [1] * 6  # cut, then [EOS]
    assert b.tokens[1].tolist() == [*short, 6, 0] and b.enc_mask[1].tolist() == [1, 1, 1, 1, 1, 0]
    cat, dog = tok.encode("cat dog")
    assert b.dec_tokens[1].tolist() == [5, dog, cat, 0] and b.labels[1].tolist() == [dog, cat, 6, 0]
    assert b.loss_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]  # the target and [EOS] only
    assert b.labels[0][-1] == 6 and np.array_equal(b.dec_mask, b.loss_mask.astype(np.int64))
