"""Data for the engine: tokenizers, JSONL documents, train/valid/test splits, blending, sampling.

Needs numpy (and `tokenizers` for HF tokenizers), never torch: batches are numpy arrays that the
trainer turns into tensors. Megatron indexed datasets (.bin/.idx) arrive later; this skeleton keeps
the tokenized corpus in memory.
"""

from megatrain.engine.data.dataset import (
    BlendedDataset,
    SourceDataset,
    build_datasets,
    document_split_bounds,
    microbatch_sample_ids,
)
from megatrain.engine.data.jsonl import read_jsonl_texts
from megatrain.engine.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "HFTokenizer",
    "SourceDataset",
    "Tokenizer",
    "build_datasets",
    "build_tokenizer",
    "document_split_bounds",
    "microbatch_sample_ids",
    "read_jsonl_texts",
]
