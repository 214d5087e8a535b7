"""Data for the engine: tokenizers, Megatron's indexed datasets, GPT samples, blending, loaders.

Needs numpy (and the tokenizer libraries), never torch: batches are numpy arrays (`Batch`) that the
trainer turns into tensors. Every source is read as a memory-mapped indexed dataset (`.bin`/`.idx`,
byte-compatible with Megatron-LM's); JSONL sources are tokenized into a cache first.
"""

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.dataset import SPLITS, SplitSizes, build_datasets
from megatrain.engine.data.gpt_dataset import BlendedDataset, GPTDataset, SampleDataset, split_bounds
from megatrain.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatrain.engine.data.loader import Loader, microbatch_sample_ids
from megatrain.engine.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "SPLITS",
    "Batch",
    "BlendedDataset",
    "ByteTokenizer",
    "GPTDataset",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Loader",
    "SampleDataset",
    "SplitSizes",
    "Tokenizer",
    "build_datasets",
    "build_tokenizer",
    "microbatch_sample_ids",
    "split_bounds",
    "token_dtype",
]
