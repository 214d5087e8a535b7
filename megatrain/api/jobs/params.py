"""Parameter count of a spec's model, before the engine reports the exact one.

Pure arithmetic on the ModelSpec, mirroring the engine's GPT-2 and Llama blocks (tensor parallelism
does not change the total). The dashboard shows it for jobs that have not started yet.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from megatrain.spec import ModelSpec

BYTE_TOKENIZER_VOCAB = 257
"""256 byte values + end-of-document (engine/data/tokenizers.py)."""


def estimate_params(spec: dict[str, Any]) -> int | None:
    """Parameters of the model a stored spec describes; None when the vocabulary is unknown
    (a Hugging Face tokenizer without `model.vocab_size`) or the spec is not readable."""
    try:
        model = ModelSpec.model_validate(spec.get("model") or {})
    except ValidationError:
        return None
    tokenizer = ((spec.get("data") or {}).get("tokenizer") or {}).get("type", "byte")
    # The embedding rows as the engine pads them (ModelSpec.padded_vocab: an explicit vocab_size too).
    if model.vocab_size is not None:
        vocab = model.padded_vocab(model.vocab_size)
    elif tokenizer == "byte":
        vocab = model.padded_vocab(BYTE_TOKENIZER_VOCAB)
    else:
        return None
    h, ffn = model.hidden_size, model.ffn_size
    kv = 2 * h * model.query_groups * model.head_dim  # key and value projections (GQA)
    gpt2 = model.arch == "gpt2"
    if gpt2:
        attn = h * h + kv + h * h + (h + 2 * model.query_groups * model.head_dim) + h  # + biases
        mlp = 2 * h * ffn + ffn + h
        norms = 2 * 2 * h  # two LayerNorms with weight and bias
    else:
        attn = h * h + kv + h * h
        mlp = 3 * h * ffn  # SwiGLU: gate, up, down
        norms = 2 * h  # two RMSNorms
    embeddings = vocab * h + (model.seq_length * h if gpt2 else 0)
    head = 0 if model.tied else vocab * h
    final_norm = 2 * h if gpt2 else h
    return model.num_layers * (attn + mlp + norms) + embeddings + head + final_norm
