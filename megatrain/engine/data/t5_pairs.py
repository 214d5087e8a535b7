"""Text-to-text fine-tuning data for arch t5: JSONL records of an input and a target.

    datasets = build_pair_datasets(spec, tokenizer, cache_dir)
    datasets["train"].batch([0, 1, 2, 3])   # -> data.Batch of encoder-decoder rows (t5_data.py)

A record is {"input": str, "target": str}, or {data.prompt_key: str, data.response_key: str} (the
spec's names, "prompt" and "response" by default). The encoder reads the input's tokens and the end
token (as T5's tokenizer appends </s>); the decoder reads the start token and the target's tokens,
and learns the target's tokens and then the end token: the loss counts target tokens only, never
the input. Too long, the input is cut to model.seq_length - 1 tokens (before its end token) and the
target to model.t5.decoder_seq_length - 1 (the counts are in `stats`).

Records are tokenized once per node into two Megatron indexed datasets in the cache (inputs,
targets), keyed by everything that shaped them (the sources and their sizes and times, the
tokenizer, the keys); data.train's records are split by data.split, each source on its own in file
order, data.valid's held out whole (finetune.record_splits), and each split visits its records once
per epoch in an order drawn from (seed, split, epoch).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.finetune import RecordError, iter_records, record_splits
from megatrain.engine.data.gpt_dataset import SPLITS
from megatrain.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatrain.engine.data.packing import tokens_through
from megatrain.engine.data.remote import source_identity
from megatrain.engine.data.t5_data import T5Specials, t5_specials
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import DataSpec, JobSpec

CACHE_VERSION = 1
INPUT_KEY, TARGET_KEY = "input", "target"


def record_pair(obj: Any, data: DataSpec, where: str) -> tuple[str, str]:
    """A record's (input, target) text: its "input" and "target" fields, else the spec's
    prompt_key and response_key; RecordError naming the file and line otherwise."""
    if not isinstance(obj, Mapping):
        raise RecordError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    for source, target in ((INPUT_KEY, TARGET_KEY), (data.prompt_key, data.response_key)):
        if isinstance(obj.get(source), str) and isinstance(obj.get(target), str):
            return obj[source], obj[target]
    raise RecordError(
        f"{where}: a T5 fine-tune needs string {INPUT_KEY!r} and {TARGET_KEY!r} fields (or "
        f"{data.prompt_key!r} and {data.response_key!r})"
    )


def _cache_key(data: DataSpec, tokenizer: Tokenizer) -> str:
    sources = []
    for _, s in data.sources():
        assert s.path is not None  # the API resolves named datasets to paths
        sources.append([s.path, source_identity(s.path)])
    shape = {
        "version": CACHE_VERSION,
        "sources": sources,
        "tokenizer": data.tokenizer.model_dump(),
        "vocab_size": tokenizer.vocab_size,
        "keys": [INPUT_KEY, TARGET_KEY, data.prompt_key, data.response_key],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:20]


def tokenize_pairs(data: DataSpec, tokenizer: Tokenizer, cache_dir: Path) -> tuple[Path, list[int]]:
    """The cache prefix of every source's records (PREFIX-input, PREFIX-target), and each source's
    record count; built by the first rank of a node, the others wait and map it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    prefix = cache_dir / f"t5-pairs-{_cache_key(data, tokenizer)}"
    meta = Path(f"{prefix}.json")
    dtype = token_dtype(tokenizer.vocab_size)
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not meta.exists():
            counts = []
            with (
                IndexedDatasetWriter(f"{prefix}-input", dtype) as inputs,
                IndexedDatasetWriter(f"{prefix}-target", dtype) as targets,
            ):
                for field, source in data.sources():
                    if source.path is None or not source.is_jsonl:
                        raise RecordError(f"{field}: a T5 fine-tune reads JSONL records, not {source.path!r}")
                    n = 0
                    for lineno, obj in iter_records(source.path):
                        text, target = record_pair(obj, data, f"{source.path}:{lineno}")
                        inputs.add_document(np.asarray(tokenizer.encode(text), dtype=np.int64))
                        targets.add_document(np.asarray(tokenizer.encode(target), dtype=np.int64))
                        n += 1
                    if n == 0:
                        raise RecordError(f"{source.path}: no records")
                    counts.append(n)
            # Written last and atomically: its presence means both datasets are complete.
            tmp = meta.with_name(meta.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"records_per_source": counts}))
            os.replace(tmp, meta)
    return prefix, json.loads(meta.read_text())["records_per_source"]


class PairDataset:
    """One split's records as encoder-decoder rows of seq_length input and decoder_seq_length
    target positions. Sample i beyond len() wraps into later epochs, each visiting every record
    once in an order drawn from (seed, key, epoch)."""

    def __init__(
        self,
        inputs: IndexedDataset,
        targets: IndexedDataset,
        records: np.ndarray,
        seq_length: int,
        decoder_seq_length: int,
        specials: T5Specials,
        seed: int,
        key: tuple[int, ...] = (),
    ):
        if seq_length < 2 or decoder_seq_length < 2:
            raise ValueError("a T5 pair needs seq_length and decoder_seq_length of at least 2")
        self.inputs, self.targets, self.records = inputs, targets, records
        self.enc_len, self.dec_len, self.specials = seq_length, decoder_seq_length, specials
        self.seed, self.key = seed, key
        enc = inputs.sequence_lengths[records].astype(np.int64)
        dec = targets.sequence_lengths[records].astype(np.int64)
        # Real tokens per row: the input and its end token, the target and its end token, as cut.
        self.sample_tokens = np.minimum(enc + 1, seq_length) + np.minimum(dec + 1, decoder_seq_length)
        self.stats = {
            "records": int(len(records)),
            "inputs_cut": int((enc + 1 > seq_length).sum()),
            "targets_cut": int((dec + 1 > decoder_seq_length).sum()),
        }
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, *self.key, epoch]).permutation(len(self.records))
            self._orders = {epoch: order}
        return order

    def tokens_through(self, consumed: int) -> int:
        """The rows' real tokens (input and target, padding excluded) in samples [0, consumed)."""
        return tokens_through(self.sample_tokens, self._order, consumed)

    def record(self, index: int) -> int:
        epoch, pos = divmod(int(index), len(self.records))
        return int(self.records[int(self._order(epoch)[pos])])

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        b, s, t, sp = len(sample_ids), self.enc_len, self.dec_len, self.specials
        tokens = np.full((b, s), sp.pad, dtype=np.int64)
        dec_tokens = np.full((b, t), sp.pad, dtype=np.int64)
        labels = np.zeros((b, t), dtype=np.int64)
        enc_mask = np.zeros((b, s), dtype=np.int64)
        dec_mask = np.zeros((b, t), dtype=np.int64)
        for row, i in enumerate(sample_ids):
            r = self.record(i)
            enc = [*self.inputs[r][: s - 1].tolist(), sp.end]
            target = self.targets[r][: t - 1].tolist()
            n = len(target) + 1
            tokens[row, : len(enc)] = enc
            enc_mask[row, : len(enc)] = 1
            dec_tokens[row, :n] = [sp.start, *target]  # the targets shifted right
            labels[row, :n] = [*target, sp.end]
            dec_mask[row, :n] = 1
        # Masks by length, not by value: T5 starts its decoder with its pad id.
        return Batch(
            tokens=tokens,
            labels=labels,
            loss_mask=dec_mask.astype(np.float32),
            dec_tokens=dec_tokens,
            enc_mask=enc_mask,
            dec_mask=dec_mask,
        )


def build_pair_datasets(
    spec: JobSpec, tokenizer: Tokenizer, cache_dir: Path
) -> dict[str, PairDataset | None]:
    """train/valid/test pair datasets from data.train's and data.valid's JSONL records (None: an
    empty split)."""
    data, m = spec.data, spec.model
    specials = t5_specials(tokenizer)
    prefix, counts = tokenize_pairs(data, tokenizer, cache_dir)
    inputs, targets = IndexedDataset(f"{prefix}-input"), IndexedDataset(f"{prefix}-target")
    per_split = record_splits(data, counts)
    decoder_length = m.t5_block.decoder_seq_length or m.seq_length
    out: dict[str, PairDataset | None] = {}
    for i, name in enumerate(SPLITS):
        records = per_split[name]
        out[name] = (
            PairDataset(
                inputs, targets, records, m.seq_length, decoder_length, specials, spec.training.seed, key=(i,)
            )
            if len(records)
            else None
        )
    if out["train"] is None:
        raise RecordError("the train split has no T5 fine-tuning records (check data.split and data.train)")
    return out
