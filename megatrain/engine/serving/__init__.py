"""The model server: a trained model answering OpenAI's chat completions and completions, or (an
encoder, arch bert) OpenAI's embeddings.

One process holds one base model and every LoRA adapter trained on it (adapters.py), and batches
all their requests together, continuously (batcher.py over cache.py's per-row KV cache): requests
join and leave the running batch between decode steps. text.py renders chats and streams text,
protocol.py and server.py speak OpenAI's HTTP, loader.py loads a serve job's base and job.py is the
serve job's process (`kind: serve`, started by a worker like any job; the API proxies to it).
embeddings.py pools an encoder's hidden states into sentence embeddings, batched on one thread.
"""

from megatrain.engine.serving.adapters import Adapter, AdapterBank, AdapterError, read_adapter
from megatrain.engine.serving.batcher import Batcher, Busy, Delta, SamplingParams, Sequence, TokenLogprob
from megatrain.engine.serving.cache import SlotCache
from megatrain.engine.serving.embeddings import Embedder, Specials, embed_rows, pool
from megatrain.engine.serving.text import TextStream, encode_chat_prompt

__all__ = [
    "Adapter",
    "AdapterBank",
    "AdapterError",
    "Batcher",
    "Busy",
    "Delta",
    "Embedder",
    "SamplingParams",
    "Sequence",
    "SlotCache",
    "Specials",
    "TextStream",
    "TokenLogprob",
    "embed_rows",
    "encode_chat_prompt",
    "pool",
    "read_adapter",
]
