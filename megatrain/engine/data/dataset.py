"""A spec's data as train / valid / test datasets: every source an indexed dataset, split and blended.

Each `data.train` source becomes a local `.bin`/`.idx` prefix: an indexed dataset on file:// is used
in place, one on s3:// through the node's verified download cache (`remote`), and a JSONL file is
tokenized once into the cache (`preprocess`) under a key of everything that shapes its tokens (the
file's identity, the tokenizer, the text key), so existing JSONL specs train exactly as before but from
a memory map. Sequences are split by `data.split` as Megatron splits them, each split served by a
GPTDataset sized for what the run consumes, and the sources blended by weight (BlendedDataset).
Fine-tuning and preference jobs take their own datasets (`finetune`, `preference`), and so do the
encoder families (BERT: `encoder`; T5: `t5_data`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatrain.engine.data.gpt_dataset import (
    SPLITS,
    BlendedDataset,
    GPTDataset,
    SampleDataset,
    blended_sizes,
    split_bounds,
)
from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.remote import cached_prefix, source_identity
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.settings import get_settings
from megatrain.spec import DataSource, DataSpec, JobSpec, TokenizerSpec

PARALLEL_PREPROCESS_BYTES = 64 << 20
"""JSONL files from this size on are tokenized by several processes."""


@dataclass(frozen=True)
class SplitSizes:
    """Samples each split must serve: train_iters global batches, and eval_iters for valid / test."""

    train: int
    valid: int
    test: int

    @classmethod
    def for_spec(cls, spec: JobSpec) -> SplitSizes:
        t = spec.training
        evals = t.eval_iters * t.global_batch_size
        return cls(t.train_iters * t.global_batch_size, evals, evals)


def default_cache_root() -> Path:
    """This node's data cache: downloads, tokenized JSONL and indices of read-only data."""
    configured = get_settings().cache_dir
    base = configured or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrain"
    return Path(base) / "data"


def build_datasets(
    spec: JobSpec, tokenizer: Tokenizer, seq_length: int, cache_root: Path | None = None
) -> dict[str, SampleDataset | None]:
    """train/valid/test datasets (None for an empty split) for `spec`'s data and kind."""
    cache_root = cache_root or default_cache_root()
    seed = spec.training.seed
    if spec.kind == "dpo":
        from megatrain.engine.data.preference import build_preference_datasets

        return build_preference_datasets(  # type: ignore[return-value]
            spec.data, tokenizer, seq_length, seed, cache_root / "preference"
        )
    if spec.model.arch == "t5":  # span corruption, or input/target pairs (t5_data.py)
        from megatrain.engine.data.t5_data import build_t5_datasets

        return build_t5_datasets(spec, tokenizer, cache_root)
    if spec.kind == "finetune" and _holds_records(spec.data):
        from megatrain.engine.data.finetune import build_finetune_datasets

        return build_finetune_datasets(
            spec.data, tokenizer, seq_length, seed, cache_root / "finetune", spec.packing
        )
    if spec.model.arch == "bert":
        from megatrain.engine.data.encoder import build_encoder_datasets

        return build_encoder_datasets(spec, tokenizer, seq_length, cache_root)
    data, sizes = spec.data, SplitSizes.for_spec(spec)
    fractions = data.split_fractions
    tok_id = json.dumps(data.tokenizer.model_dump(mode="json"), sort_keys=True)
    per_split: dict[str, list[tuple[SampleDataset, float]]] = {s: [] for s in SPLITS}
    weights = [s.weight for s in data.train]
    # The valid split blends data.train's valid shares with data.valid's sources (held out whole).
    valid_weights = weights + [s.weight for s in data.valid]
    for n, (field, source) in enumerate(data.sources()):
        prefix = local_prefix(source, field, data.tokenizer, data.text_key, cache_root)
        indexed = IndexedDataset(prefix)
        if len(indexed) == 0:
            raise ValueError(f"{field}.path={source.path!r} holds no documents")
        held_out = n >= len(data.train)
        split = "held-out" if held_out else data.split
        every = [(0, 0), (0, len(indexed)), (0, 0)] if held_out else split_bounds(len(indexed), fractions)
        for name, bounds in zip(SPLITS, every, strict=True):
            if bounds[1] <= bounds[0]:
                continue
            planned = getattr(sizes, name)
            among = valid_weights if name == "valid" and data.valid else weights
            if len(among) > 1:
                planned = blended_sizes(among, planned)[n]
            ds = GPTDataset(
                indexed,
                bounds,
                seq_length,
                planned,
                seed,
                indices_dir(prefix, cache_root),
                {"dataset_path": str(prefix), "index_split": name, "split": split, "tokenizer": tok_id},
                eod=tokenizer.eod if spec.packing else None,
            )
            per_split[name].append((ds, source.weight))
    out: dict[str, SampleDataset | None] = {}
    for name in SPLITS:
        parts = per_split[name]
        if not parts:
            out[name] = None
        else:
            out[name] = BlendedDataset(
                [p[0] for p in parts], [p[1] for p in parts], getattr(sizes, name), cache_root / "blends"
            )
    if out["train"] is None:
        raise ValueError("the train split has no documents (check data.split and data.train)")
    return out


def _holds_records(data: DataSpec) -> bool:
    """Whether a fine-tune's sources are prompt/response or chat records (loss on responses only);
    plain text (JSONL documents, indexed datasets) fine-tunes on every token, as pretraining does."""
    kinds = {field: _first_record_kind(s, data) for field, s in data.sources()}
    if len(set(kinds.values())) > 1:
        records = [field for field, k in kinds.items() if k]
        raise ValueError(
            f"data.train: sources {records} hold prompt/response or chat records and the others plain "
            "text; a fine-tune reads one kind"
        )
    return any(kinds.values())


def _first_record_kind(source: DataSource, data: DataSpec) -> bool:
    if source.path is None or not source.is_jsonl:
        return False
    from megatrain.engine.data.finetune import RecordError, iter_records

    try:
        for _, record in iter_records(source.path):
            return isinstance(record, dict) and (data.messages_key in record or data.prompt_key in record)
    except RecordError:
        return False  # not JSON: preprocessing names the line
    return False


def local_prefix(
    source: DataSource,
    field: str,
    tokenizer: TokenizerSpec,
    text_key: str,
    cache_root: Path,
    split_sentences: bool = False,
) -> Path:
    """The local `.bin`/`.idx` prefix serving `source` (downloaded or tokenized into the cache; with
    split_sentences a JSONL file is tokenized one sentence per sequence, as BERT's data is)."""
    if source.path is None:
        raise ValueError(
            f"{field} names dataset {source.dataset!r} without a path; registered datasets are "
            "resolved by the API when the job is submitted"
        )
    if source.is_jsonl:
        return tokenized_jsonl(source.path, tokenizer, text_key, cache_root, split_sentences)
    prefix = cached_prefix(source.path, cache_root)
    if not Path(str(prefix) + ".idx").is_file():
        raise FileNotFoundError(
            f"{field}.path={source.path!r}: no {prefix}.idx (a JSONL file must end in .jsonl, "
            ".json, .jsonl.gz or .jsonl.zst; anything else names an indexed dataset's .bin/.idx prefix)"
        )
    return prefix


def indices_dir(prefix: Path, cache_root: Path) -> Path:
    """Where a dataset's sample indices are kept: beside the data, as Megatron keeps them, unless that
    directory is read-only (a shared dataset), then in the node's cache."""
    beside = prefix.parent / "cache" / "GPTDataset_indices"
    if os.access(prefix.parent, os.W_OK):
        return beside
    return cache_root / "indices" / hashlib.sha256(str(prefix).encode()).hexdigest()[:16]


def tokenized_jsonl(
    url: str, tokenizer: TokenizerSpec, text_key: str, cache_root: Path, split_sentences: bool = False
) -> Path:
    """The indexed dataset of a JSONL file's `text_key` documents (EOD after each; or, split into
    sentences, one sequence per sentence and no EOD), tokenized once per node and kept under a key
    of the file's identity, the tokenizer, the key and the split."""
    identity = source_identity(url)
    description = {
        "source": url,
        "identity": identity,
        "tokenizer": tokenizer.model_dump(mode="json"),
        "json_key": text_key,
        "append_eod": not split_sentences,
    }
    if split_sentences:  # absent otherwise: the keys of the caches already on disk stay as they were
        description["split_sentences"] = True
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
    folder = cache_root / "jsonl" / key
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / "documents"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(str(prefix) + ".idx").is_file():  # the writer renames .idx into place last
            from megatrain.engine.data.preprocess import preprocess

            size = identity.get("size", 0)
            # Small files in this process: spawning workers (which re-import the trainer) costs more.
            workers = 0 if size < PARALLEL_PREPROCESS_BYTES else max(1, min(8, len(os.sched_getaffinity(0))))
            preprocess(
                url,
                prefix,
                tokenizer,
                json_key=text_key,
                workers=workers,
                append_eod=not split_sentences,
                split_sentences=split_sentences,
            )
            (folder / "description.json").write_text(json.dumps(description, indent=2, sort_keys=True))
    return prefix
