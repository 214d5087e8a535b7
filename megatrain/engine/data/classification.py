"""A BERT sequence-classification fine-tune's data: JSONL records of `text` (data.text_key), an
optional `text_pair` and an integer `label`, as rows [CLS] text [SEP] (text_pair [SEP]).

Records are read whole (a classification set fits in memory: GLUE's largest is 400k pairs), shuffled
once by the run's seed and split by data.split as Megatron splits documents; a split serves any
number of samples by going round its records again, each pass in a fresh order. Rows are tokenized
when a batch asks for them (the tokenizer has no special tokens of its own here: the row's [CLS]
and [SEP] are placed by hand), the longer text losing tokens at its end until the pair fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.gpt_dataset import SPLITS, SampleDataset, split_bounds
from megatrain.engine.data.masking import WordPieceVocab, pad_id
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import JobSpec

LABEL_KEY, PAIR_KEY = "label", "text_pair"


@dataclass(frozen=True)
class Record:
    text: str
    pair: str | None
    label: int


def read_records(url: str, text_key: str, num_labels: int) -> list[Record]:
    """The records of one JSONL source; ValueError naming FILE:LINE and what is wrong."""
    from megatrain.engine.data.finetune import RecordError, iter_records

    out: list[Record] = []
    try:
        for line, row in iter_records(url):
            where = f"{url}:{line}"
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise ValueError(f"{where}: a classification record needs a string {text_key!r}")
            label = row.get(LABEL_KEY)
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
                why = f"{LABEL_KEY!r} must be an integer in [0, {num_labels}) (model.bert.num_labels)"
                raise ValueError(f"{where}: {why}, not {label!r}")
            pair = row.get(PAIR_KEY)
            if pair is not None and not isinstance(pair, str):
                raise ValueError(f"{where}: {PAIR_KEY!r} must be a string")
            out.append(Record(row[text_key], pair, label))
    except RecordError as exc:
        raise ValueError(str(exc)) from None
    return out


class ClassificationSamples:
    """Records as the trainer's SampleDataset: sample i is record order[i % n] of pass i // n."""

    def __init__(
        self, records: list[Record], tokenizer: Tokenizer, vocab: WordPieceVocab, seq_length: int, seed: int
    ):
        if not records:
            raise ValueError("a classification split holds no record")
        self.records, self.tokenizer, self.vocab = records, tokenizer, vocab
        self.seq_length, self.seed = seq_length, seed
        self.pad = max(pad_id(vocab), 0)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _record(self, i: int) -> Record:
        n = len(self.records)
        epoch = i // n
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState((self.seed + epoch) % 2**32).permutation(n)
        return self.records[int(self._orders[epoch][i % n])]

    def row(self, record: Record) -> tuple[list[int], list[int]]:
        """(tokens, types) of [CLS] text [SEP] (pair [SEP]), the longer part cut to fit."""
        a = self.tokenizer.encode(record.text)
        b = self.tokenizer.encode(record.pair) if record.pair is not None else None
        budget = self.seq_length - (3 if b is not None else 2)
        if b is None:
            a = a[:budget]
        else:
            while len(a) + len(b) > budget:
                if len(a) >= len(b):
                    a.pop()
                else:
                    b.pop()
        v = self.vocab
        tokens = [v.cls, *a, v.sep]
        types = [0] * len(tokens)
        if b is not None:
            tokens += [*b, v.sep]
            types += [1] * (len(b) + 1)
        return tokens, types

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        rows = [self._record(int(i)) for i in sample_ids]
        b, t = len(rows), self.seq_length
        tokens = np.full((b, t), self.pad, dtype=np.int64)
        types = np.zeros((b, t), dtype=np.int64)
        padding = np.ones((b, t), dtype=np.int64)
        for r, record in enumerate(rows):
            ids, kinds = self.row(record)
            tokens[r, : len(ids)], types[r, : len(ids)], padding[r, : len(ids)] = ids, kinds, 0
        return Batch(
            tokens=tokens,
            labels=np.zeros((b, t), dtype=np.int64),
            loss_mask=np.zeros((b, t), dtype=np.float32),  # no masked token: the classifier's loss alone
            segment_ids=padding,  # padding is a segment of its own
            token_type_ids=types,
            binary_labels=np.array([record.label for record in rows], dtype=np.int64),
        )


def build_classification_datasets(
    spec: JobSpec, tokenizer: Tokenizer, vocab: WordPieceVocab, seq_length: int
) -> dict[str, SampleDataset | None]:
    """train/valid/test classification datasets (None for an empty split): data.train's records
    split by data.split, data.valid's held out whole into valid."""
    data, seed = spec.data, spec.training.seed
    labels = spec.model.bert_block.num_labels
    assert labels is not None
    parts: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for field, source in data.sources():
        if source.path is None or not source.is_jsonl:
            raise ValueError(f"{field}: a classification fine-tune reads JSONL records (a .jsonl path)")
        records = read_records(source.path, data.text_key, labels)
        if field.startswith("data.valid"):
            parts["valid"] += records
            continue
        order = np.random.RandomState(seed % 2**32).permutation(len(records))
        shuffled = [records[int(i)] for i in order]
        for name, (lo, hi) in zip(SPLITS, split_bounds(len(shuffled), data.split_fractions), strict=True):
            parts[name] += shuffled[lo:hi]
    if not parts["train"]:
        raise ValueError("the train split has no record (check data.split and data.train)")
    return {
        name: ClassificationSamples(recs, tokenizer, vocab, seq_length, seed) if recs else None
        for name, recs in parts.items()
    }
