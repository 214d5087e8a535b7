"""Preference data (kind dpo): JSONL records of a prompt and a chosen and a rejected response, each
response rendered after the prompt through the chat template and tokenized once into a cache.

    datasets = build_preference_datasets(spec.data, tokenizer, seq_length, seed, cache_dir)
    datasets["train"].batch([0, 1, 2, 3])   # -> 2 pairs: rows chosen, rejected, chosen, rejected

A record is {prompt_key: str | [messages], chosen: ..., rejected: ...} or {messages_key: [messages],
chosen: ..., rejected: ...} (TRL's preference format, standard or conversational): a response is a
string (one assistant turn) or a list of messages. Only the response's assistant tokens are loss
tokens; the prompt's own assistant turns (a multi-turn prompt) are context.

Sequence ids count sequences, two per pair: id 2k is the chosen and 2k+1 the rejected response of
the k-th pair of the epoch's order, so a micro-batch of an even size starting at an even id holds
whole pairs, each as two adjacent rows. The cache holds two documents per record (chosen, then
rejected) in `preference-<hash>.bin/.idx` and their target flags in `...-mask`; a pair is truncated
on the right to seq_length+1 tokens, and dropped if either response then has no loss token.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.chat_templates import ChatTemplate, load_chat_template
from megatrain.engine.data.finetune import RecordError, iter_records, record_splits
from megatrain.engine.data.gpt_dataset import SPLITS
from megatrain.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatrain.engine.data.packing import batch_from_samples, packed_sample, tokens_through
from megatrain.engine.data.remote import source_identity
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import DataSpec

CACHE_VERSION = 1
RESPONSES = ("chosen", "rejected")
"""The response fields of a record (TRL's names)."""

Messages = list[dict[str, str]]


def _messages(value: Any, where: str, field: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: {field!r} must be a string or a non-empty list of messages")
    for i, m in enumerate(value):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, Mapping) else (None, None)
        if not (isinstance(role, str) and isinstance(content, str)):
            raise RecordError(f"{where}: {field}[{i}] needs string 'role' and 'content'")
    return [dict(m) for m in value]


def record_pair(obj: Any, data: DataSpec, where: str) -> tuple[Messages, Messages, Messages]:
    """(prompt messages, chosen response messages, rejected response messages) of a record."""
    if not isinstance(obj, Mapping):
        raise RecordError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    missing = [k for k in RESPONSES if k not in obj]
    if missing:
        raise RecordError(f"{where}: a preference record needs {' and '.join(map(repr, missing))}")
    if data.messages_key in obj:
        prompt = _messages(obj[data.messages_key], where, data.messages_key)
    elif isinstance(obj.get(data.prompt_key), str):
        prompt = [{"role": "user", "content": obj[data.prompt_key]}]
    elif data.prompt_key in obj:
        prompt = _messages(obj[data.prompt_key], where, data.prompt_key)
    else:
        raise RecordError(f"{where}: needs a {data.prompt_key!r} or a {data.messages_key!r} field")
    responses = []
    for key in RESPONSES:
        value = obj[key]
        if isinstance(value, str):
            responses.append([{"role": "assistant", "content": value}])
        else:
            responses.append(_messages(value, where, key))
    return prompt, responses[0], responses[1]


def encode_response(
    prompt: Messages, response: Messages, template: ChatTemplate, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of prompt + response and their target flags: 1 on the response's assistant turns
    only (the prompt's assistant turns, if any, are context)."""
    skip = sum(m["role"] == "assistant" for m in prompt)
    ids: list[int] = []
    flags: list[int] = []
    seen = 0
    for text, assistant in template.spans([*prompt, *response]):
        tokens = tokenizer.encode(text)
        target = assistant and seen >= skip
        seen += int(assistant)
        if assistant and template.eod_after_assistant:
            tokens = [*tokens, tokenizer.eod]
        ids += tokens
        flags += [int(target)] * len(tokens)
    return np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.uint8)


def _cache_key(data: DataSpec, tokenizer: Tokenizer, template: ChatTemplate) -> str:
    sources = []
    for _, s in data.sources():
        assert s.path is not None  # the API resolves named datasets to paths
        sources.append([s.path, source_identity(s.path)])
    shape = {
        "version": CACHE_VERSION,
        "sources": sources,
        "tokenizer": data.tokenizer.model_dump(),
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "template": [template.source, dict(template.special_tokens), template.eod_after_assistant],
        "keys": [data.prompt_key, data.messages_key, *RESPONSES],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:20]


def tokenize_pairs(
    data: DataSpec, tokenizer: Tokenizer, template: ChatTemplate, cache_dir: Path
) -> tuple[Path, list[int]]:
    """The cache prefix (documents 2r and 2r+1: record r's chosen and rejected sequence), and each
    source's record count. Built once per node under a file lock; the meta file is written last."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    prefix = cache_dir / f"preference-{_cache_key(data, tokenizer, template)}"
    meta = Path(f"{prefix}.json")
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not meta.exists():
            counts = []
            with (
                IndexedDatasetWriter(f"{prefix}-mask", np.uint8) as masks,
                IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size)) as tokens,
            ):
                for _, source in data.sources():
                    assert source.path is not None
                    n = 0
                    for lineno, obj in iter_records(source.path):
                        prompt, chosen, rejected = record_pair(obj, data, f"{source.path}:{lineno}")
                        for response in (chosen, rejected):
                            ids, flags = encode_response(prompt, response, template, tokenizer)
                            tokens.add_document(ids)
                            masks.add_document(flags)
                        n += 1
                    if n == 0:
                        raise RecordError(f"{source.path}: no records")
                    counts.append(n)
            tmp = meta.with_name(meta.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"records_per_source": counts}))
            os.replace(tmp, meta)
    return prefix, json.loads(meta.read_text())["records_per_source"]


class PreferenceDataset:
    """A split's pairs as sequences: id i is sequence i % 2 (chosen, rejected) of the pair at
    position i // 2 of its epoch's order (epochs wrap, each in an order drawn from seed, key and
    epoch). Rows are one sequence each, padded to seq_length+1 tokens."""

    def __init__(
        self,
        tokens: IndexedDataset,
        targets: IndexedDataset,
        records: np.ndarray,
        seq_length: int,
        seed: int,
        pad_id: int,
        key: tuple[int, ...] = (),
        prefix: Path | None = None,
    ):
        self.tokens, self.targets, self.prefix = tokens, targets, prefix
        self.capacity, self.pad_id, self.seed, self.key = seq_length + 1, pad_id, seed, key
        docs = np.stack([2 * records, 2 * records + 1], axis=1)  # (pairs, 2)
        lengths = tokens.sequence_lengths[docs].astype(np.int64)
        kept = np.minimum(lengths, self.capacity)

        def useful(doc: int, n: int) -> bool:  # a label (a token after the first) is a target
            return bool(targets[int(doc)][1:n].any())

        ok = np.array([useful(c, nc) and useful(r, nr) for (c, r), (nc, nr) in zip(docs, kept, strict=True)])
        ok = ok.astype(bool).reshape(-1)
        self.pairs = docs[ok]  # (pairs kept, 2) document ids
        self.pair_tokens = kept[ok]  # (pairs kept, 2) each sequence's tokens within its row
        self.stats = {
            "records": int(len(records)),
            "truncated": int(((lengths > self.capacity).any(axis=1) & ok).sum()),
            "dropped": int((~ok).sum()),
            "pairs": int(ok.sum()),
        }
        self.reference: np.ndarray | None = None
        """(documents in the cache,) float32 reference log-probs (engine.dpo), NaN where unknown."""
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Sequences in one epoch: two per pair."""
        return 2 * len(self.pairs)

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, *self.key, epoch]).permutation(len(self.pairs))
            self._orders = {epoch: order}
        return order

    def tokens_through(self, consumed: int) -> int:
        """Both sequences' tokens of the pairs in sequences [0, consumed) (padding not counted)."""
        whole = tokens_through(self.pair_tokens.sum(axis=1), self._order, consumed // 2)
        if consumed % 2:  # a chosen sequence without its rejected one
            epoch, pos = divmod(consumed // 2, len(self.pairs))
            whole += int(self.pair_tokens[int(self._order(epoch)[pos]), 0])
        return whole

    def document(self, index: int) -> int:
        """The cache document of sequence `index`."""
        epoch, pos = divmod(int(index) // 2, len(self.pairs))
        return int(self.pairs[int(self._order(epoch)[pos]), int(index) % 2])

    def batch(self, sample_ids: list[int]) -> Batch:
        ids = [int(i) for i in sample_ids]
        if len(ids) % 2 or any(a % 2 or b != a + 1 for a, b in zip(ids[::2], ids[1::2], strict=True)):
            raise ValueError(f"a preference micro-batch holds whole pairs (an even id, then its +1): {ids}")
        cap = self.capacity
        docs = [self.document(i) for i in ids]
        samples = [
            packed_sample([self.tokens[d][:cap]], [self.targets[d][:cap]], cap, self.pad_id) for d in docs
        ]
        batch = batch_from_samples(samples, packed=False)
        if self.reference is not None:
            batch.ref_logps = self.reference[docs].astype(np.float32)
        return batch


def build_preference_datasets(
    data: DataSpec, tokenizer: Tokenizer, seq_length: int, seed: int, cache_dir: Path
) -> dict[str, PreferenceDataset | None]:
    """train/valid/test preference datasets from data.train's and data.valid's JSONL records (None:
    an empty split; finetune.record_splits)."""
    for field, source in data.sources():
        if source.path is None or not source.is_jsonl:
            raise RecordError(
                f"{field}: preference training reads JSONL records; {source.path or source.dataset!r} is not"
            )
    template = load_chat_template(data.chat_template)
    prefix, counts = tokenize_pairs(data, tokenizer, template, cache_dir)
    tokens, targets = IndexedDataset(prefix), IndexedDataset(f"{prefix}-mask")
    per_split = record_splits(data, counts)
    out: dict[str, PreferenceDataset | None] = {}
    for i, name in enumerate(SPLITS):
        records = per_split[name]
        ds = None
        if len(records):
            ds = PreferenceDataset(tokens, targets, records, seq_length, seed, tokenizer.eod, (i,), prefix)
        out[name] = ds if ds is not None and len(ds) else None
    if out["train"] is None:
        raise RecordError("the train split has no usable preference pairs (check data.split and data.train)")
    return out
