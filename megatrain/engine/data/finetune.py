"""Fine-tuning data: JSONL chats or prompt/response pairs, rendered through a chat template, tokenized
once into a cache, packed (or padded) into samples whose loss counts only assistant tokens.

    datasets = build_finetune_datasets(spec.data, tokenizer, seq_length, seed, cache_dir, spec.packing)
    datasets["train"].batch([0, 1, 2, 3])   # -> data.Batch with loss_mask (and ids when packed)

A record is {prompt_key: str, response_key: str} or {messages_key: [{"role", "content"}, ...]}
(an assistant message may carry OpenAI's "weight": 0 or 1; 0 is context, not trained on)
(keys from the spec). Its tokens and a per-token target flag (1 on assistant / response tokens) are
written to two Megatron indexed datasets beside the run (`finetune-<hash>.bin/.idx` and
`finetune-<hash>-mask.bin/.idx`, uint8), keyed by a hash of everything that shaped them (the sources
and their sizes and times, the tokenizer, the template, the keys), built once per node under a file
lock; other ranks and later runs map them.

A record longer than seq_length+1 tokens is truncated on the right (its first seq_length+1 tokens
are kept: the prompt survives, the end of the response is cut); one left with no target token (a
chat without an assistant turn, or a prompt alone filling the window) is dropped. Both are counted
in `stats`. Records are split into train/valid/test by data.split, each source on its own, in file
order (Megatron's document split).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.chat_templates import ChatTemplate, load_chat_template
from megatrain.engine.data.corpus import open_corpus, split_lines
from megatrain.engine.data.gpt_dataset import SPLITS, split_bounds
from megatrain.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatrain.engine.data.packing import batch_from_samples, pack, packed_sample, tokens_through
from megatrain.engine.data.remote import source_identity
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import DataSpec

CACHE_VERSION = 2  # 2: assistant turns of weight 0 carry no loss


class RecordError(ValueError):
    """A JSONL record that is not a chat or prompt/response pair; the message names file and line."""


def iter_records(url: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line of a .jsonl file, plain, .gz or .zst
    (streamed through the preprocessing's corpus reader)."""
    with open_corpus(url) as reader:
        for chunk in reader.chunks():
            for lineno, line in split_lines(chunk):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
                    raise RecordError(
                        f"{url}:{lineno}: not valid JSON ({getattr(exc, 'msg', exc)})"
                    ) from None


def record_messages(obj: Any, data: DataSpec, where: str) -> list[dict[str, str]]:
    """A record as chat messages: its `messages_key` list, or [user: prompt, assistant: response]."""
    if not isinstance(obj, Mapping):
        raise RecordError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    if data.messages_key in obj:
        messages = obj[data.messages_key]
        if not isinstance(messages, list) or not messages:
            raise RecordError(f"{where}: {data.messages_key!r} must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise RecordError(f"{where}: {data.messages_key}[{i}] needs string 'role' and 'content'")
            if m.get("weight", 1) not in (0, 1) or isinstance(m.get("weight"), bool):
                raise RecordError(f"{where}: {data.messages_key}[{i}].weight must be 0 or 1")
        if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
            raise RecordError(f"{where}: no assistant message to train on (none, or every one has weight 0)")
        return [dict(m) for m in messages]
    prompt, response = obj.get(data.prompt_key), obj.get(data.response_key)
    if isinstance(prompt, str) and isinstance(response, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    raise RecordError(
        f"{where}: needs a {data.messages_key!r} list, or string {data.prompt_key!r} and "
        f"{data.response_key!r} fields"
    )


def encode_chat(
    messages: list[dict[str, str]], template: ChatTemplate, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and their target flags (1 on assistant tokens), piece by piece of the render."""
    ids: list[int] = []
    flags: list[int] = []
    for text, assistant in template.spans(messages):
        tokens = tokenizer.encode(text)
        if assistant and template.eod_after_assistant:
            tokens = [*tokens, tokenizer.eod]
        ids += tokens
        flags += [int(assistant)] * len(tokens)
    return np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.uint8)


def _cache_key(data: DataSpec, tokenizer: Tokenizer, template: ChatTemplate) -> str:
    sources = []
    for _, s in data.sources():
        assert s.path is not None  # the API resolves named datasets to paths
        sources.append([s.path, source_identity(s.path)])  # size and mtime, or size and ETag
    shape = {
        "version": CACHE_VERSION,
        "sources": sources,
        "tokenizer": data.tokenizer.model_dump(),
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "template": [template.source, dict(template.special_tokens), template.eod_after_assistant],
        "keys": [data.prompt_key, data.response_key, data.messages_key],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:20]


def tokenize_to_cache(
    data: DataSpec, tokenizer: Tokenizer, template: ChatTemplate, cache_dir: Path
) -> tuple[Path, list[int]]:
    """The cache prefix holding every source's records, and each source's record count."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    prefix = cache_dir / f"finetune-{_cache_key(data, tokenizer, template)}"
    meta = Path(f"{prefix}.json")
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first rank of a node builds, the others wait
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
                        ids, flags = encode_chat(
                            record_messages(obj, data, f"{source.path}:{lineno}"), template, tokenizer
                        )
                        tokens.add_document(ids)
                        masks.add_document(flags)
                        n += 1
                    if n == 0:
                        raise RecordError(f"{source.path}: no records")
                    counts.append(n)
            # Written last and atomically: its presence means both datasets are complete.
            tmp = meta.with_name(meta.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"records_per_source": counts}))
            os.replace(tmp, meta)
    return prefix, json.loads(meta.read_text())["records_per_source"]


def record_splits(data: DataSpec, counts: list[int]) -> dict[str, np.ndarray]:
    """Each split's record indices in a cache built over data.sources() in order (`counts`: each
    source's records): every data.train source split by data.split on its own, in file order;
    every data.valid source whole into valid."""
    per_split: dict[str, list[np.ndarray]] = {s: [np.zeros(0, np.int64)] for s in SPLITS}
    first = 0
    for n, (field, _) in zip(counts, data.sources(), strict=True):
        if field.startswith("data.valid."):
            bounds = [(0, 0), (0, n), (0, 0)]
        else:
            bounds = split_bounds(n, data.split_fractions)
        for name, (lo, hi) in zip(SPLITS, bounds, strict=True):
            per_split[name].append(np.arange(first + lo, first + hi, dtype=np.int64))
        first += n
    return {name: np.concatenate(parts) for name, parts in per_split.items()}


class FinetuneDataset:
    """Samples of seq_length+1 tokens from a split's records: packed (several whole records, ids
    restarting per record) or one record each, padded. Sample i beyond len() wraps into later epochs,
    each visiting every sample once in an order drawn from (seed, key, epoch)."""

    def __init__(
        self,
        tokens: IndexedDataset,
        targets: IndexedDataset,
        records: np.ndarray,
        seq_length: int,
        seed: int,
        packing: bool,
        pad_id: int,
        key: tuple[int, ...] = (),
    ):
        self.tokens, self.targets = tokens, targets
        self.capacity, self.packing, self.pad_id = seq_length + 1, packing, pad_id
        self.seed, self.key = seed, key
        lengths = tokens.sequence_lengths[records].astype(np.int64)
        kept_len = np.minimum(lengths, self.capacity)
        # A record counts if one of its tokens after the first (a label) is a target within the window.
        useful = np.array(
            [targets[int(r)][1:c].any() for r, c in zip(records, kept_len, strict=True)], dtype=bool
        )
        self.records, self.lengths = records[useful], kept_len[useful]
        self.stats = {
            "records": int(len(records)),
            "truncated": int(((lengths > self.capacity) & useful).sum()),
            "dropped": int((~useful).sum()),
        }
        if packing:
            bins = pack(self.lengths, self.capacity, seed, key)
            self.samples = [self.records[b] for b in bins]
            self.sample_tokens = np.array([self.lengths[b].sum() for b in bins], dtype=np.int64)
        else:
            self.samples = [self.records[i : i + 1] for i in range(len(self.records))]
            self.sample_tokens = self.lengths.copy()
        self.stats["samples"] = len(self.samples)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Samples in one epoch."""
        return len(self.samples)

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, *self.key, epoch]).permutation(len(self.samples))
            self._orders = {epoch: order}
        return order

    def tokens_through(self, consumed: int) -> int:
        """The records' tokens in samples [0, consumed): padding is not trained on, so not counted."""
        return tokens_through(self.sample_tokens, self._order, consumed)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(window, target, segment, position) of sample `index` (see packing.packed_sample)."""
        epoch, pos = divmod(int(index), len(self.samples))
        docs = self.samples[int(self._order(epoch)[pos])]
        cap = self.capacity
        return packed_sample(
            [self.tokens[int(r)][:cap] for r in docs],
            [self.targets[int(r)][:cap] for r in docs],
            cap,
            self.pad_id,
        )

    def batch(self, sample_ids: list[int]) -> Batch:
        return batch_from_samples([self.sample(i) for i in sample_ids], self.packing)


def build_finetune_datasets(
    data: DataSpec, tokenizer: Tokenizer, seq_length: int, seed: int, cache_dir: Path, packing: bool
) -> dict[str, FinetuneDataset | None]:
    """train/valid/test fine-tuning datasets from data.train's and data.valid's JSONL records (None:
    an empty split; see record_splits)."""
    for field, source in data.sources():
        if source.path is None or not source.is_jsonl:
            raise RecordError(
                f"{field}: fine-tuning reads JSONL records; {source.path or source.dataset!r} is not"
            )
    template = load_chat_template(data.chat_template)
    prefix, counts = tokenize_to_cache(data, tokenizer, template, cache_dir)
    tokens, targets = IndexedDataset(prefix), IndexedDataset(f"{prefix}-mask")
    per_split = record_splits(data, counts)
    out: dict[str, FinetuneDataset | None] = {}
    for i, name in enumerate(SPLITS):
        records = per_split[name]
        ds = None
        if len(records):
            ds = FinetuneDataset(tokens, targets, records, seq_length, seed, packing, tokenizer.eod, key=(i,))
        out[name] = ds if ds is not None and len(ds) else None
    if out["train"] is None:
        raise RecordError(
            "the train split has no usable fine-tuning records (check data.split and data.train)"
        )
    return out
