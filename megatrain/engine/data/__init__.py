"""Data for the engine: tokenizers, JSONL documents, train/valid/test splits, blending, sampling.

Needs numpy (and `tokenizers` for HF tokenizers), never torch: batches are numpy arrays that the
trainer turns into tensors. Megatron-LM's indexed datasets (.bin/.idx) are read and written by
`indexed` (memory-mapped, byte-compatible); training still keeps a JSONL corpus's tokens in memory
until the indexed path reaches the loaders.
"""

from megatrain.engine.data.dataset import (
    BlendedDataset,
    SourceDataset,
    build_datasets,
    document_split_bounds,
    microbatch_sample_ids,
)
from megatrain.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatrain.engine.data.jsonl import read_jsonl_texts
from megatrain.engine.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "SourceDataset",
    "Tokenizer",
    "build_datasets",
    "build_tokenizer",
    "document_split_bounds",
    "microbatch_sample_ids",
    "read_jsonl_texts",
    "token_dtype",
]
