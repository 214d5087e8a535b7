"""BERT and T5 data: sentence-split preprocessing, Megatron's sample mapping and masking.

A generated corpus is split into sentences and tokenized by a tiny BERT-style WordPiece vocabulary
("##" continuations); megatron-core (in a subprocess, as in test_gpt_dataset.py) rebuilds the same
files with its own IndexedDatasetBuilder and reads ours, builds its BERTMaskedWordPieceDataset and
T5MaskedWordPieceDataset on them, and every sample's every field must equal ours."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatrain.engine.data.bert_dataset import BERTDataset
from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.masking import (
    BERT_MASKING,
    T5_MASKING,
    MaskingConfig,
    Mt32,
    Mt64,
    WordPieceVocab,
    build_sample_mapping,
)
from megatrain.engine.data.preprocess import PreprocessError, preprocess, split_sentences
from megatrain.engine.data.t5_dataset import T5Dataset
from megatrain.spec import TokenizerSpec

SYLLABLES = ["ka", "lo", "mi", "ra", "to", "ne", "su", "pe", "di", "ba", "fo", "gu"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]"] + [
    f"<extra_id_{i}>" for i in range(40)
]
PIECES = SPECIALS + [".", ",", "!", "?", "the", "and", "of"] + SYLLABLES + ["##" + s for s in SYLLABLES]
SEED, BERT_LEN, T5_LEN, T5_DEC_LEN = 1234, 64, 64, 32
BERT_DOCS, T5_DOCS, NUM_SAMPLES = (0, 140), (10, 150), 300


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(PIECES)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def _sentence(rng: np.random.Generator) -> str:
    words = []
    for _ in range(int(rng.integers(2, 14))):
        if rng.random() < 0.2:
            words.append(str(rng.choice(["the", "and", "of"])))
        else:  # a word of 1..4 syllables: WordPiece cuts it into a piece and "##" continuations
            words.append("".join(rng.choice(SYLLABLES, size=int(rng.integers(1, 5)))))
    return " ".join(words).capitalize() + str(rng.choice([".", "!", "?", ", ka."]))


def _lines() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    lines: list[dict[str, Any]] = []
    for d in range(160):
        sentences = [_sentence(rng) for _ in range(int(rng.integers(1, 9)))]
        if d % 7 == 3:  # already split, with sentences that tokenize to nothing (dropped)
            lines.append({"text": [*sentences[:1], "", "   ", *sentences[1:]]})
        else:
            lines.append({"text": "\n ".join(sentences) if d % 5 == 0 else " ".join(sentences)})
    long = " ".join("kalomi" for _ in range(200)) + "."  # 600 pieces: over Megatron's 512
    lines[20] = {"text": f"{long} Short one."}  # a document of several sentences, one long: unused
    lines[21] = {"text": long}  # one long sentence alone: used
    return lines


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bert-t5")
    (root / "tokenizer.json").write_text(_tokenizer_json())
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(line) + "\n" for line in _lines()))
    spec = TokenizerSpec(type="hf", path=str(root / "tokenizer.json"))
    for name, eod in (("plain", False), ("eod", True)):
        stats = preprocess(str(corpus), root / name, spec, workers=2, append_eod=eod, split_sentences=True)
        assert stats.documents == len(_lines()) and stats.sequences > stats.documents
    return {"root": root, "vocab": WordPieceVocab.from_hf(_tokenizer_json()), "corpus": corpus}


def _expected_sentences(text: str | list[str]) -> list[str]:
    return text if isinstance(text, list) else split_sentences(text)


def test_mersenne_twisters_equal_the_cpp_standard_s() -> None:
    # The C++ standard fixes the 10000th output of each default-seeded (5489) engine.
    assert Mt64(5489).draws(10000)[-1] == 9981545732273789042
    draw = Mt32(5489)
    assert [draw() for _ in range(10000)][-1] == 4123659995


def test_sentence_splitter_rules() -> None:
    assert split_sentences('  Hello there.  Dr. No met J. Smith!\nThen? "Yes." (ok.) 3.14 is pi.  ') == [
        "Hello there.",
        "Dr. No met J. Smith!",
        "Then?",
        '"Yes."',
        "(ok.)",
        "3.14 is pi.",
    ]
    assert split_sentences("no end, e.g. this (a.k.a. that) and U.S. too") == [
        "no end, e.g. this (a.k.a. that) and U.S. too"
    ]
    assert split_sentences("The answer is no. Wait... ok") == ["The answer is no.", "Wait...", "ok"]
    assert split_sentences(" \n ") == []


def test_sentences_are_sequences_and_documents_group_them(data: dict[str, Any]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json())
    eod = 0  # no EOD candidate in this vocabulary: the first special, [PAD]
    plain, with_eod = IndexedDataset(data["root"] / "plain"), IndexedDataset(data["root"] / "eod")
    seq = 0
    for d, line in enumerate(_lines()):
        ids = [tok.encode(s, add_special_tokens=False).ids for s in _expected_sentences(line["text"])]
        ids = [x for x in ids if x]  # a sentence of no tokens is no sequence
        assert plain.document_indices[d] == seq == with_eod.document_indices[d]
        for i, sentence in enumerate(ids):
            assert plain[seq].tolist() == sentence
            assert with_eod[seq].tolist() == sentence + [eod] * (i == len(ids) - 1)  # EOD ends the last
            seq += 1
    assert plain.document_indices[-1] == seq == len(plain)


def test_a_document_of_no_tokens_is_a_bad_line(tmp_path: Path, data: dict[str, Any]) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "Ka lo."}\n{"text": ["", " "]}\n{"text": [1, 2]}\n')
    spec = TokenizerSpec(type="hf", path=str(data["root"] / "tokenizer.json"))
    with pytest.raises(PreprocessError, match=r"c.jsonl:2: empty document"):
        preprocess(str(corpus), tmp_path / "out", spec, split_sentences=True)
    stats = preprocess(str(corpus), tmp_path / "out", spec, split_sentences=True, on_error="skip")
    assert [b.line for b in stats.skipped] == [2, 3] and "JSON array" in stats.skipped[1].reason
    assert stats.documents == 1 and stats.sequences == 1


def test_cli_splits_sentences(tmp_path: Path, data: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from megatrain.cli import app

    args = ["data", "preprocess", "--input", str(data["corpus"]), "--output-prefix", str(tmp_path / "cli")]
    args += ["--tokenizer", f"hf:{data['root'] / 'tokenizer.json'}", "--split-sentences"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "sentences)" in result.output
    assert (tmp_path / "cli.idx").read_bytes() == (data["root"] / "plain.idx").read_bytes()


def _bert(data: dict[str, Any], cache: Path, binary_head: bool = True, **masking: Any) -> BERTDataset:
    config = MaskingConfig(**asdict(BERT_MASKING) | masking)
    indexed = IndexedDataset(data["root"] / "plain")
    return BERTDataset(
        indexed, BERT_DOCS, BERT_LEN, NUM_SAMPLES, SEED, cache, {}, data["vocab"], binary_head, config
    )


def _t5(data: dict[str, Any], cache: Path, **masking: Any) -> T5Dataset:
    config = MaskingConfig(**asdict(T5_MASKING) | masking)
    indexed = IndexedDataset(data["root"] / "plain")
    return T5Dataset(
        indexed, T5_DOCS, T5_LEN, T5_DEC_LEN, NUM_SAMPLES, SEED, cache, {}, data["vocab"], config
    )


def test_bert_replaces_80_10_10_and_masks_within_the_budget(data: dict[str, Any], tmp_path: Path) -> None:
    ds = _bert(data, tmp_path)
    mask, counts = data["vocab"].mask, np.zeros(3)
    masked_share = []
    for i in range(len(ds)):
        s = ds[i]
        at = s["loss_mask"] == 1
        # The last [SEP] ends the tokens ([CLS]/[SEP] are never masked; a random replacement may be
        # [PAD] and then reads as padding in padding_mask, as in Megatron).
        real = int(np.flatnonzero(s["text"] == data["vocab"].sep)[-1]) + 1
        assert np.all(s["padding_mask"][real:] == 0) and s["padding_mask"][:real].sum() >= real - at.sum()
        budget = min(0.15 * int(ds.sample_index[i][2]), max(1, round(real * 0.15)))
        assert at.sum() <= budget  # never past the budget (a short target may mask nothing)
        assert np.all(s["labels"][~at] == -1) and np.all(s["text"][real:] == 0)
        masked_share.append(at.sum() / budget)
        text, labels = s["text"][at], s["labels"][at]
        counts += [(text == mask).sum(), (text == labels).sum(), ((text != mask) & (text != labels)).sum()]
    # ~4,000 masked pieces: the standard error of a 10% share is 0.005, so 0.03 is six of them.
    # A random replacement equal to its original (1 in 73 of the 10%) counts as kept: +0.0014.
    assert np.allclose(counts / counts.sum(), [0.8, 0.1, 0.1], atol=0.03), counts / counts.sum()
    assert np.mean(masked_share) > 0.85  # whole-word n-grams stop a little short of the budget


def test_bert_pairs_and_whole_words(data: dict[str, Any], tmp_path: Path) -> None:
    cont = np.array([p.startswith("##") for p in PIECES])
    partial = {}
    for whole in (True, False):
        ds = _bert(data, tmp_path, whole_word=whole)
        swapped, partial[whole] = 0, 0
        for i in range(len(ds)):
            s = ds[i]
            original = np.where(s["loss_mask"] == 1, s["labels"], s["text"])  # random ids undone
            seps = np.flatnonzero(original == data["vocab"].sep)
            n = int(seps[-1]) + 1
            assert original[0] == data["vocab"].cls and len(seps) == 2 and np.all(s["text"][n:] == 0)
            assert np.all(s["types"][: seps[0] + 1] == 0) and np.all(s["types"][seps[0] + 1 : n] == 1)
            swapped += s["is_random"]
            original, masked = original[:n], s["loss_mask"][:n] == 1
            # A word: a piece and the "##" pieces after it; masked all together or not at all. (A
            # segment cut to start with "##" pieces is left out: Megatron joins them to the word
            # before, across the [SEP].)
            breaks = np.flatnonzero(~cont[original])  # word starts, [CLS] and [SEP]
            for a, b in zip(breaks, [*breaks[1:], n], strict=True):
                if original[a] not in (data["vocab"].cls, data["vocab"].sep):
                    partial[whole] += int(0 < masked[a:b].sum() < b - a)
        assert 0.35 < swapped / len(ds) < 0.65  # sentence order swapped half the time
    assert partial[True] == 0 and partial[False] > 0


def test_t5_spans_become_sentinels_in_order(data: dict[str, Any], tmp_path: Path) -> None:
    ds, vocab = _t5(data, tmp_path), data["vocab"]
    sentinels = list(vocab.additional_special_tokens_ids)
    spans = 0
    for i in range(len(ds)):
        s = ds[i]
        sentences, target, _ = ds.sentences(i)
        original = [t for x in sentences for t in x][:target]
        enc = s["text_enc"][: s["enc_mask"].sum()].tolist()
        dec = s["text_dec"][: s["dec_mask"].sum()].tolist()
        used = [t for t in enc if t in sentinels]
        assert used == sentinels[: len(used)] and vocab.mask not in enc  # s0, s1, ... in order
        spans += len(used)
        assert dec[0] == vocab.bos and [t for t in dec if t in sentinels] == used
        labels = s["labels"][s["loss_mask"] == 1].tolist()
        assert labels == [*dec[1:], vocab.eos] and s["labels"][len(dec) :].tolist() == [-1] * (
            T5_DEC_LEN - len(dec)
        )
        # Putting each span back where its sentinel stands gives the sample's tokens again.
        span_of, cur = {}, None
        for t in dec[1:]:
            cur = t if t in sentinels else cur
            span_of.setdefault(cur, []).extend([] if t in sentinels else [t])
        assert [x for t in enc for x in (span_of[t] if t in sentinels else [t])] == original
        assert len(enc) <= T5_LEN and s["truncated"] == int(sum(map(len, sentences)) > target)
    assert spans > 2 * len(ds)  # a short target may have none; most samples have several


def test_samples_are_cached_and_repeatable(data: dict[str, Any], tmp_path: Path) -> None:
    a, b = _bert(data, tmp_path / "one"), _bert(data, tmp_path / "two")
    again = _bert(data, tmp_path / "one")  # from the cache
    assert np.array_equal(a.sample_index, b.sample_index) and np.array_equal(
        a.sample_index, again.sample_index
    )
    assert len(list((tmp_path / "one").glob("*-BERTMaskedWordPieceDataset-sample_index.npy"))) == 1
    for i in (0, 7, len(a) - 1):
        assert all(np.array_equal(a[i][k], b[i][k]) for k in a[i])
    batch = a.batch([0, 1, len(a)])  # past the end wraps around
    assert batch["text"].shape == (3, BERT_LEN) and batch["is_random"].shape == (3,)
    assert np.array_equal(batch["text"][2], a[0]["text"])


# Megatron's side, one process: rebuild our files with its builder, read ours, build its datasets.
_MEGATRON_SIDE = """
import json, sys
import numpy as np
import torch.distributed
from tokenizers import Tokenizer
from megatron.core.datasets import helpers
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split

torch.distributed.get_rank = lambda *a, **k: 0  # the masked datasets ask without a process group
a = json.loads(sys.stdin.read())
out = {}

# Megatron's preprocess_data --split-sentences encoding of each document's sentences.
hf = Tokenizer.from_file(a["tokenizer"])
for name, eod in (("plain", False), ("eod", True)):
    builder = IndexedDatasetBuilder(a["rebuilt"] + name + ".bin", dtype=np.uint16)
    for sentences in a["documents"]:
        ids, lens = [], []
        for s in sentences:
            x = hf.encode(s, add_special_tokens=False).ids
            if x:
                ids += x
                lens.append(len(x))
        if ids and eod:
            ids.append(0)
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(a["rebuilt"] + name + ".idx")
ours = IndexedDataset(a["prefix"])
out["read"] = {"lengths": ours.sequence_lengths.tolist(), "pointers": ours.index.sequence_pointers.tolist(),
    "documents": ours.document_indices.tolist(), "sequences": [ours[i].tolist() for i in range(len(ours))]}

class Tok:
    unique_identifiers = {"class": "Tok"}
    def __init__(self, t):
        self.__dict__.update(t)
        self.inv_vocab = {int(i): p for i, p in t["inv_vocab"]}

tok = Tok(a["tok"])
for key, kind, m, lo, hi in a["datasets"]:
    masking = dict(masking_probability=m["probability"], short_sequence_probability=m["short_seq_prob"],
        masking_max_ngram=m["max_ngram"], masking_do_full_word=m["whole_word"], masking_do_permutation=False,
        masking_use_longer_ngrams=m["longer_ngrams"], masking_use_geometric_distribution=m["geometric"])
    common = dict(random_seed=a["seed"], path_to_cache=a["cache"] + key, tokenizer=tok, **masking)
    if kind == "t5":
        cfg = T5MaskedWordPieceDatasetConfig(
            sequence_length=a["t5_len"], sequence_length_decoder=a["t5_dec"], **common)
        cls = T5MaskedWordPieceDataset
    else:
        cfg = BERTMaskedWordPieceDatasetConfig(
            sequence_length=a["bert_len"], classification_head=kind == "bert-pairs", **common)
        cls = BERTMaskedWordPieceDataset
    ds = cls(ours, a["prefix"], np.arange(lo, hi, dtype=np.int32), a["n"], Split.train, cfg)
    rows = [ds[i] for i in range(len(ds))]
    out[key] = {"mapping": np.asarray(ds.sample_index).tolist(),
        "samples": [{k: np.asarray(v).tolist() for k, v in r.items()} for r in rows]}
m = a["mapping"]
b, s = np.array(m["bounds"], np.int64), np.array(m["sizes"], np.int32)
out["mapping"] = [helpers.build_mapping(b, s, 2**31 - 2, n, length, p, seed, False, k).tolist()
    for p, k, length, n, seed in m["cases"]]
print(json.dumps(out))
"""
# Sentence lengths for the mapping alone: many documents, some with a sentence over 512 tokens.
_rng = np.random.default_rng(1)
MAP_BOUNDS = np.concatenate([[0], np.cumsum(_rng.integers(0, 12, 400))]).astype(np.int64)
MAP_SIZES = _rng.integers(1, 60, MAP_BOUNDS[-1]).astype(np.int32)
MAP_SIZES[_rng.integers(0, len(MAP_SIZES), 8)] = 600
# (short_seq_prob, min sentences, max length, samples, seed): 1/0.4 rounds to 3 in C, 2 in Python.
MAP_CASES = [(0.1, 2, 61, 500, 77), (0.4, 1, 125, 3000, 78), (0.0, 1, 30, 100, 79), (1.0, 2, 13, 3000, 80)]

BERT, T5 = asdict(BERT_MASKING), asdict(T5_MASKING)
# name: (kind, masking, documents); Megatron's BERT and T5 settings, and the other choices of each knob.
DATASETS: dict[str, tuple[str, dict[str, Any], tuple[int, int]]] = {
    "bert-pairs": ("bert-pairs", BERT, BERT_DOCS),
    "bert-single-pieces": ("bert-single", BERT | {"whole_word": False, "geometric": False}, BERT_DOCS),
    "bert-pairs-longer": ("bert-pairs", BERT | {"geometric": False, "longer_ngrams": True}, (30, 160)),
    "t5": ("t5", T5, T5_DOCS),
    "t5-pieces-1/n": ("t5", T5 | {"whole_word": False, "geometric": False, "short_seq_prob": 0.4}, T5_DOCS),
}


@pytest.fixture(scope="module")
def megatron(data: dict[str, Any]) -> dict[str, Any]:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the test extra brings it on Python 3.11)")
    root, vocab = data["root"], data["vocab"]
    payload = {
        "tokenizer": str(root / "tokenizer.json"),
        "rebuilt": str(root / "megatron-"),
        "prefix": str(root / "plain"),
        "documents": [_expected_sentences(line["text"]) for line in _lines()],
        "tok": {k: getattr(vocab, k) for k in ("cls", "sep", "mask", "pad", "bos", "eos")}
        | {"inv_vocab": list(vocab.inv_vocab.items()),
           "additional_special_tokens_ids": list(vocab.additional_special_tokens_ids)},
        "datasets": [[key, kind, m, *docs] for key, (kind, m, docs) in DATASETS.items()],
        "seed": SEED, "n": NUM_SAMPLES, "cache": str(root / "megatron-cache-"),
        "bert_len": BERT_LEN, "t5_len": T5_LEN, "t5_dec": T5_DEC_LEN,
        "mapping": {"bounds": MAP_BOUNDS[5:390].tolist(), "sizes": MAP_SIZES.tolist(), "cases": MAP_CASES},
    }  # fmt: skip
    args = [sys.executable, "-c", _MEGATRON_SIDE]
    out = subprocess.run(
        args, input=json.dumps(payload), capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["plain", "eod"])
def test_files_equal_megatron_s_builder_byte_for_byte(
    megatron: dict[str, Any], data: dict[str, Any], name: str
) -> None:
    root = data["root"]
    for ext in (".bin", ".idx"):
        assert (root / f"{name}{ext}").read_bytes() == (root / f"megatron-{name}{ext}").read_bytes()


def test_megatron_reads_our_sentences_and_documents(megatron: dict[str, Any], data: dict[str, Any]) -> None:
    ours, theirs = IndexedDataset(data["root"] / "plain"), megatron["read"]
    assert theirs["lengths"] == ours.sequence_lengths.tolist()
    assert theirs["pointers"] == ours.sequence_pointers.tolist()
    assert theirs["documents"] == ours.document_indices.tolist()
    assert theirs["sequences"] == [ours[i].tolist() for i in range(len(ours))]


def test_sample_mapping_equals_megatron_s_helper(megatron: dict[str, Any]) -> None:
    for (p, k, length, n, seed), theirs in zip(MAP_CASES, megatron["mapping"], strict=True):
        ours = build_sample_mapping(MAP_BOUNDS[5:390], MAP_SIZES, length, p, seed, k, n)
        assert ours.dtype == np.uint32 and len(ours) >= n and ours.tolist() == theirs


@pytest.mark.parametrize("key", list(DATASETS))
def test_samples_equal_megatron_s(
    megatron: dict[str, Any], data: dict[str, Any], tmp_path: Path, key: str
) -> None:
    kind, m, docs = DATASETS[key]
    config = MaskingConfig(**m)
    indexed = IndexedDataset(data["root"] / "plain")
    vocab = data["vocab"]
    if kind == "t5":
        ds: BERTDataset | T5Dataset = T5Dataset(
            indexed, docs, T5_LEN, T5_DEC_LEN, NUM_SAMPLES, SEED, tmp_path, {}, vocab, config
        )
    else:
        ds = BERTDataset(
            indexed, docs, BERT_LEN, NUM_SAMPLES, SEED, tmp_path, {}, vocab, kind == "bert-pairs", config
        )
    theirs = megatron[key]
    assert np.asarray(ds.sample_index).tolist() == theirs["mapping"]
    assert len(ds) == len(theirs["samples"]) >= NUM_SAMPLES
    for i, expected in enumerate(theirs["samples"]):
        sample = ds[i]
        assert sample.keys() == expected.keys()
        for field, value in expected.items():
            got = sample[field]
            assert (got.tolist() if isinstance(got, np.ndarray) else got) == value, (i, field)
            assert not isinstance(got, np.ndarray) or got.dtype == np.int64
